"""Flattening nested batches (tuples, lists, namedtuples, dicts) into tensor leaves."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

__all__ = ["flatten", "leaves"]


def flatten(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Leaves of nested tuples/lists/dicts (namedtuples kept), and their rebuilder."""
    if isinstance(tree, (tuple, list)):
        parts = [flatten(t) for t in tree]
        sizes = [len(leaves) for leaves, _ in parts]

        def rebuild_seq(leaves: list[Any]) -> Any:
            out, i = [], 0
            for (_, rebuild), n in zip(parts, sizes):
                out.append(rebuild(leaves[i : i + n]))
                i += n
            return type(tree)(*out) if hasattr(tree, "_fields") else type(tree)(out)

        return [leaf for leaves, _ in parts for leaf in leaves], rebuild_seq
    if isinstance(tree, dict):
        keys = list(tree)
        leaves, rebuild_values = flatten([tree[k] for k in keys])

        def rebuild_dict(ls: list[Any]) -> Any:
            values = rebuild_values(ls)
            if type(tree) is dict:
                return dict(zip(keys, values))
            out = copy.copy(tree)  # a subclass (Hugging Face's ModelOutput) keeps its type
            for k, v in zip(keys, values):
                out[k] = v
            return out

        return leaves, rebuild_dict
    return [tree], lambda ls: ls[0]


def leaves(tree: Any) -> list[Any]:
    """The leaves :func:`flatten` gives, in the same order, without a rebuilder (hot path:
    the hooks backend calls it for every module call)."""
    if isinstance(tree, (tuple, list)):
        out: list[Any] = []
        for t in tree:
            if isinstance(t, (tuple, list, dict)):
                out.extend(leaves(t))
            else:
                out.append(t)
        return out
    if isinstance(tree, dict):
        return leaves(list(tree.values()))
    return [tree]
