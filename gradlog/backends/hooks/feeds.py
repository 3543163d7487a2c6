"""Shared outputs that reach the batch through the input of a Linear that is itself shared.

DeBERTa's relative position table is normalised (an op on the parameter, no batch), then
taken by the attention's query and key projections, whose outputs are repeated over the
batch (:func:`.layout.shared_outputs` routes those projections: each datum's gradient of
their output is known from the repeat). The table's own per-datum gradient is then each
datum's gradient of the projections' input, ``g_b W``, taken back through the shape ops and
masks between (:func:`feeds_of`), summed over the projections it feeds (:class:`Feeds`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch

from gradlog._torch_private.nodes import autograd_node_output_shape
from gradlog.backends.hooks.graph import UNSAVED_ALONG, VIEW_NODES, GraphSurvey

if TYPE_CHECKING:
    from gradlog.backends.hooks.calls import Call

__all__ = ["Feeds", "Path", "feeds_of"]

Path = tuple[tuple[Any, int], ...]
"""(autograd node, the input slot the path goes through), from the node that takes the
shared output (first) to the one that makes the Linear's input (last)."""

_ALONG = VIEW_NODES | {"SliceBackward0", "SelectBackward0", "NativeDropoutBackward0",
                       "MulBackward0", "DivBackward0", "ToCopyBackward0", "NegBackward0"}
"""Nodes a path may cross: shape ops, and ops by a constant or a mask of their own (a
dropout on the table), each with one input that carries a gradient."""
_LINEAR_RULES = frozenset({"linear", "linear_like"})
_MAX_NODES = 64


def feeds_of(call: Call, found: list[tuple[Any, int]], routed: list[Call],
             graph: GraphSurvey) -> list[tuple[Call, Path]] | None:
    """The routed Linear calls whose input ``call``'s shared output becomes, with the path
    to each; None unless every use of the output, and of each tensor on the way, is such a
    path (a use of it elsewhere would be a gradient this does not take)."""
    if call.hooked != 1 or not found:
        return None
    first, slot = found[0]
    made = first.next_functions[slot][0]  # the node that made the output
    feeds: list[tuple[Call, Path]] = []
    into: dict[int, int] = {}  # id(node making a Linear's input) -> Linear calls taking it
    for linear in routed:
        path = _path(linear, made, UNSAVED_ALONG if graph.views_only else _ALONG)
        if path is not None:
            feeds.append((linear, path))
            end = path[-1][0] if path else made
            into[id(end)] = into.get(id(end), 0) + 1
    if not feeds:
        return None
    held = {id(node): node for _, path in feeds for node, _ in path}
    for key, node in [(id(made), made), *held.items()]:  # every use on the way accounted for
        others = [p for p, _ in (found if node is made else graph.parents(node))
                  if id(p) not in held]
        if len(others) != into.get(key, 0):
            return None
    return feeds


def _path(linear: Call, made: Any, along: frozenset[str]) -> Path | None:
    """From the Linear's input down to the shared output (made by node ``made``): nodes of
    one input each that keep or shrink what they take (none broadcasts it over the batch)."""
    entry = linear.entry
    x = linear.args[0] if linear.args else None
    if (entry.rule.name not in _LINEAR_RULES or entry.fallback or not linear.via_consumers
            or not isinstance(x, torch.Tensor) or x.grad_fn is None):
        return None
    node, walked = x.grad_fn, cast(list[tuple[Any, int]], [])
    for _ in range(_MAX_NODES):
        if node is made:
            return tuple(reversed(walked))
        edges = [(slot, child, nr) for slot, (child, nr) in enumerate(node.next_functions)
                 if child is not None]
        if type(node).__name__ not in along or len(edges) != 1:
            return None
        slot, child, nr = edges[0]
        if math.prod(autograd_node_output_shape(node)) > math.prod(
                autograd_node_output_shape(child, nr)):
            return None  # (a broadcast: the batch may come in here)
        walked.append((node, slot))
        node = child
    return None


class Feeds:
    """This backward's shared calls fed back from Linear calls (:func:`feeds_of`): each
    Linear call's per-datum output gradients give its input's, ``g_b W``, taken back along
    the path; a shared call is computed once all its Linears' consumers have given theirs
    (:meth:`deliver`; those that never ran gave none: :meth:`leftover`)."""

    def __init__(self) -> None:
        self._into: dict[int, list[tuple[Call, Path]]] = {}  # id(Linear call) -> its feeds
        self._uses: dict[int, int] = {}  # id(routed call) -> consumers it is computed from
        self._waiting: dict[int, list[Any]] = {}  # id(shared call) -> [call, left, sum]

    def note(self, call: Call, consumers: int,
             feeds: list[tuple[Call, Path]] | None) -> None:
        """A routed call (its consumers hooked), or a shared call fed by ``feeds``."""
        self._uses[id(call)] = consumers
        if feeds:
            for linear, path in feeds:
                self._into.setdefault(id(linear), []).append((call, path))
            self._waiting[id(call)] = [call, sum(self._uses[id(c)] for c, _ in feeds), None]

    def deliver(self, linear: Call, per: torch.Tensor) -> list[tuple[Call, torch.Tensor]]:
        """A Linear call's per-datum output gradients ``(B, *out)`` (from one consumer):
        the shared calls now complete, with their per-datum output gradients."""
        done = []
        for call, path in self._into.get(id(linear), ()):
            weight = cast(torch.Tensor, linear.entry.module.weight)
            grad = _back(path, per.matmul(weight.to(per.dtype)))  # (B, *call's output)
            waiting = self._waiting[id(call)]
            waiting[1] -= 1
            waiting[2] = grad if waiting[2] is None else waiting[2] + grad
            if waiting[1] == 0:
                del self._waiting[id(call)]
                done.append((call, waiting[2]))
        return done

    def leftover(self) -> list[tuple[Call, torch.Tensor]]:
        """After the backward: shared calls some of whose Linears got no gradient (what
        reached them is all there is)."""
        left = [(call, grad) for call, _, grad in self._waiting.values() if grad is not None]
        self._waiting = {}
        return left


def _back(path: Path, per: torch.Tensor) -> torch.Tensor:
    """Per-datum gradients ``(B, ...)`` at the end of ``path`` as gradients of its start:
    each node's own backward, per datum (``vmap`` over the batch)."""
    from torch.func import vmap

    def back(g: torch.Tensor) -> torch.Tensor:
        for node, slot in reversed(path):
            got = node(g)
            g = got[slot] if isinstance(got, tuple) else got
        return g

    return vmap(back)(per)
