"""``per="child"``: at each autograd node, pass the gradient on only to the input (child) whose
gradient is largest.

The backward graph of a forward is a graph of autograd nodes (``grad_fn``); a node receives the
gradient of its output and computes one gradient per input, its *children* in the backward
direction (``node.next_functions``). With ``per="child"`` each node created inside a selected
module's forward keeps the gradients of its ``k`` children with the largest L1 norm
``sum |g|`` (``k=1``: the largest only) and sends zeros to the others, which then propagate
zeros further down. Nodes with one child (``tanh``, a view) pass it on unchanged.

Which nodes: those reachable backwards from the module call's output tensors, stopping at the
call's input tensors (their own nodes were created outside the call) and at leaves. A node is
hooked once, however many selected modules contain it (its ``metadata`` carries a mark).

Ties: among equal norms, the child that comes first in the node's inputs (``next_functions``
order) wins; the comparison is made in float64.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

__all__ = ["hook_nodes", "keep_largest"]

_MARK = "gradlog.sparse.child"  # in node.metadata: this node is already hooked


def keep_largest(
    k_for: Callable[[int], int],
    grad_inputs: tuple[torch.Tensor | None, ...],
) -> tuple[torch.Tensor | None, ...] | None:
    """The node's input gradients with all but the ``k_for(n)`` largest (L1) set to zero.

    Args:
        k_for: Children kept out of ``n`` that have a gradient.
        grad_inputs: The gradients the node computed for its inputs (None: no gradient).

    Returns:
        The replacement gradients, or None when every child keeps its own.
    """
    live = [i for i, g in enumerate(grad_inputs) if g is not None]
    k = k_for(len(live))
    if len(live) < 2 or k >= len(live):
        return None
    norms = [float(grad_inputs[i].abs().sum(dtype=torch.float64)) for i in live]  # type: ignore[union-attr]
    # sorted() is stable: equal norms keep input order, so the first child wins a tie.
    kept = {live[j] for j in sorted(range(len(live)), key=lambda j: -norms[j])[:k]}
    return tuple(
        g if g is None or i in kept else torch.zeros_like(g) for i, g in enumerate(grad_inputs)
    )


def _on_node(
    k_for: Callable[[int], int],
    counter: Callable[[], None],
    grad_inputs: tuple[torch.Tensor | None, ...],
    grad_outputs: tuple[torch.Tensor | None, ...],
) -> tuple[torch.Tensor | None, ...] | None:
    counter()
    return keep_largest(k_for, grad_inputs)


def hook_nodes(
    outputs: Iterable[torch.Tensor],
    inputs: Iterable[torch.Tensor],
    k_for: Callable[[int], int],
    counter: Callable[[], None],
) -> None:
    """Hook every node between a module call's ``outputs`` and its ``inputs`` (exclusive).

    The hooks live as long as the graph: a forward run inside the context is sparsified in
    its backward even after the context exited, as for the other ``per`` values.

    Args:
        outputs: The call's output tensors.
        inputs: Its input tensors (positional and keyword): the walk stops at their nodes.
        k_for: Children kept of ``n``.
        counter: Called once per hooked node's backward (statistics).
    """
    # Nodes by id, held: a node's Python wrapper may be freed once no one holds it (torch
    # 2.4) and its id reused by the next one, which would then look seen.
    stop = {id(n): n for n in (t.grad_fn for t in inputs) if n is not None}
    hook = functools.partial(_on_node, k_for, counter)
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        children = [n for n, _ in node.next_functions if n is not None]
        metadata = cast(dict[str, Any], node.metadata)  # (a property; stubs say method)
        if len(children) >= 2 and not metadata.get(_MARK):  # (an inner call hooked it already)
            node.register_hook(hook)
            metadata[_MARK] = True
        stack.extend(children)
