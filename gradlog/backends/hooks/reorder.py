"""Whether a backward's forward took the batch's rows in another order than the batch's.

A layer's records are filed by row: its row ``b`` is datum ``b``. An op between a layer and
the loss that moves rows along the batch's dimension (``h[order]``, ``index_select``,
``gather``, ``sort``, ``flip``, ``roll``, a ``cat`` or ``stack`` of pieces in another order,
``scatter``, ``index_put``, ``index_copy``: a batch sorted by length and back) files each
datum's gradient under another datum's id, and the records still sum to ``p.grad``: only the
datum check sees it. :func:`reordered` reads the graph's nodes of those ops (:data:`MOVING`,
gathered by :class:`.graph.GraphSurvey`'s walk with the kinds of node that took their
outputs) and says whether one moves rows of a dimension of size B out of the batch's order;
the hooks backend then runs the datum check on that backward, or refuses it where none can
run. An index is read for it (a device sync, only where such an op is in the graph).

Not moved rows: rows taken in the batch's own order (``logits[arange(B), last]``, a mask, a
``cat`` of a ``split`` in its order), a table's rows (the op's input a parameter), and the
sort and unsort of PyTorch's packed sequences (``pack_padded_sequence``, whose RNN reads
each datum's rows back). A dimension that has the batch's size by coincidence (T == B) is
taken for the batch's: its backward is checked, or refused where no check can run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from gradlog._torch_private.nodes import (
    autograd_node_output_shape,
    autograd_node_saved,
    autograd_node_shapes_known,
)

__all__ = ["MOVING", "carries", "reordered"]

MOVING = frozenset({
    "IndexBackward0", "IndexSelectBackward0", "GatherBackward0", "SortBackward0",
    "TopkBackward0", "FlipBackward0", "RollBackward0", "CatBackward0", "StackBackward0",
    "ScatterBackward0", "ScatterBackward1", "ScatterAddBackward0", "IndexPutBackward0",
    "IndexCopyBackward0", "IndexAddBackward0", "EmbeddingBackward0", "TakeBackward0",
})
"""Autograd nodes of ops that may move rows along a dimension."""

_SLICING = frozenset({"CatBackward0", "StackBackward0"})


def reordered(nodes: Iterable[tuple[Any, Sequence[str]]], B: int,
              inside: Callable[[Any], bool], packed: Sequence[torch.Tensor] = ()) -> bool:
    """Whether any of ``nodes`` (each with the kinds of node that took its output) moved
    rows of a dimension of size ``B`` out of their order, outside the forward of any layer
    gradlog computes (``inside``: its rule sees each datum's rows, as an RNN on a packed
    sequence unsorting its hidden state). ``packed``: the sorted and unsorted indices of
    the packed sequences captured calls took (``pack_padded_sequence`` sorts by them and
    ``pad_packed_sequence`` unsorts, around an RNN reading each datum's rows back)."""
    return B > 1 and any(_moves(node, takers, B) and not inside(node) and not (
        type(node).__name__ == "IndexSelectBackward0" and _packing(node, packed))
        for node, takers in nodes)


def _packing(node: Any, packed: Sequence[torch.Tensor]) -> bool:
    index = autograd_node_saved(node, "index")
    return isinstance(index, torch.Tensor) and any(
        t.shape == index.shape and t.device == index.device and bool((t == index).all())
        for t in packed)


def carries(node: Any) -> bool:
    """Whether ``node`` takes something carrying a gradient other than parameters (a
    table's rows taken are no move of the batch's)."""
    inputs = [type(child).__name__ for child, _ in node.next_functions if child is not None]
    return bool(inputs) and not all(k == "AccumulateGrad" for k in inputs)


def _moves(node: Any, takers: Sequence[str], B: int) -> bool:
    kind = type(node).__name__
    if not carries(node):
        return False  # (a table's rows; nothing carrying a gradient)
    # (torch < 2.6, no shapes: dimension 0 taken for the batch's, the index ops read as if
    # every dimension had its size)
    out = autograd_node_output_shape(node) if autograd_node_shapes_known(node) else None
    # ops moving whole slices read dimension 0 alone (a flip of time, or a cat of chunks, in
    # a dimension that has the batch's size by coincidence is common: Mamba2's chunks)
    if out is not None and (not out or out[0] != B):
        return kind not in _SLICING and _moves_by_index(node, kind, out, B)
    if kind == "FlipBackward0":
        return 0 in (autograd_node_saved(node, "dims") or ())
    if kind == "RollBackward0":
        dims, shifts = autograd_node_saved(node, "dims"), autograd_node_saved(node, "shifts")
        return not dims or any(d == 0 and int(s) % B for d, s in zip(dims, shifts, strict=False))
    if kind in _SLICING:
        return (autograd_node_saved(node, "dim") == 0 and len(node.next_functions) > 1
                and not _in_order(node, kind, 0))
    return _moves_by_index(node, kind, out, B)


def _moves_by_index(node: Any, kind: str, out: tuple[int, ...] | None, B: int) -> bool:
    """An index op: whether its index along a dimension of size B (its input's) is not
    ``arange(B)`` there (None shapes: any index of B entries along it)."""
    sizes = autograd_node_saved(node, "self_sym_sizes")
    sizes = tuple(int(n) for n in sizes) if sizes is not None else out
    if kind == "EmbeddingBackward0":  # rows of a table the batch made (F.embedding(p, h))
        rows, t = autograd_node_saved(node, "weight_sym_argsize_0"), autograd_node_saved(
            node, "indices")
        sizes, pairs = (int(rows),) if rows is not None else None, [(0, t, False)]
    elif kind == "TakeBackward0":  # flat entries: in order only if all of them, as laid out
        t, x = autograd_node_saved(node, "index"), autograd_node_saved(node, "self")
        if not isinstance(t, torch.Tensor) or not isinstance(x, torch.Tensor) or (
                x.dim() == 0 or x.shape[0] != B):
            return False
        return t.numel() != x.numel() or not bool(
            (t.reshape(-1) == torch.arange(t.numel(), device=t.device)).all())
    elif kind in ("IndexBackward0", "IndexPutBackward0"):
        indices = autograd_node_saved(node, "indices") or ()
        pairs = [(d, t, False) for d, t in enumerate(indices) if isinstance(t, torch.Tensor)]
    else:
        d = autograd_node_saved(node, "dim")
        t = autograd_node_saved(node, "indices" if kind in ("SortBackward0", "TopkBackward0")
                                else "index")
        whole = kind in ("GatherBackward0", "SortBackward0", "TopkBackward0",
                         "ScatterBackward0", "ScatterBackward1",
                         "ScatterAddBackward0")  # (an index per entry)
        pairs = [(d, t, whole)] if d is not None and isinstance(t, torch.Tensor) else []
    kept = []  # per index along a dimension of size B: whether it is arange(B) there
    for d, t, whole in pairs:
        d = d + len(sizes) if d < 0 and sizes is not None else d  # (torch < 2.6: no rank)
        if t.dtype == torch.bool or (sizes is not None and (d >= len(sizes) or sizes[d] != B)):
            continue  # (a mask keeps rows in order; another dimension)
        if whole:
            if t.dim() <= d or t.shape[d] != B:
                continue
            own = torch.arange(B, device=t.device).view(-1, *(1,) * (t.dim() - d - 1))
        else:
            if t.numel() != B:
                continue  # (fewer or more rows than the batch: not the batch's own rows)
            t, own = t.reshape(-1), torch.arange(B, device=t.device)
        kept.append(bool((t == own).all()))
    # indices taken together (h[arange(B), last]): one keeping its dimension's order keeps
    # every datum's rows its own, whatever the others pick within them (T == B included)
    return bool(kept) and not any(kept)


def _in_order(node: Any, kind: str, d: int) -> bool:
    """Whether a ``cat``/``stack`` puts back, in their order, the pieces one ``split``,
    ``chunk`` or ``unbind`` made (or slices of one tensor, contiguous from its start)."""
    edges = node.next_functions
    if kind == "StackBackward0" and [_selected(child) for child, _ in edges] == list(
            range(len(edges))):  # (losses of each datum's rows, stacked in their order)
        return True
    children = {id(child) for child, _ in edges}
    if len(children) == 1 and type(edges[0][0]).__name__ in (
            "SplitBackward0", "SplitWithSizesBackward0", "UnbindBackward0"):
        return [nr for _, nr in edges] == list(range(len(edges)))
    start = 0
    for child, _ in edges:  # slices of one tensor, each starting where the last ended
        if (type(child).__name__ != "SliceBackward0" or autograd_node_saved(child, "step") != 1
                or autograd_node_saved(child, "dim") != d):
            return False
        if int(autograd_node_saved(child, "start") or 0) != start:
            return False
        end = autograd_node_saved(child, "end")
        start = int(end) if end is not None else -1
    return len({id(c.next_functions[0][0]) for c, _ in edges}) == 1 and kind == "CatBackward0"


def _selected(node: Any, depth: int = 24) -> int | None:
    """The index of the first ``select`` along dimension 0 below ``node`` on its first
    inputs' path (``lg[i]`` under a loss of datum ``i``), or None."""
    for _ in range(depth):
        if node is None:
            return None
        if type(node).__name__ == "SelectBackward0":
            d, i = autograd_node_saved(node, "dim"), autograd_node_saved(node, "index")
            return int(i) if d == 0 and i is not None else None
        edges = [c for c, _ in node.next_functions if c is not None]
        node = edges[0] if edges else None
    return None
