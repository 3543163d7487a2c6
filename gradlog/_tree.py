"""Flattening nested batches (tuples, lists, namedtuples, dicts) into tensor leaves."""

from __future__ import annotations

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
        return leaves, lambda ls: dict(zip(keys, rebuild_values(ls)))
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
