"""Layers run on the batch's rows laid out otherwise than batch-first: a row-wise layer or a
re-run module on the batch's tokens flattened to ``(B*T, ...)`` rows, each datum's rows
together (OPT's feed-forward layers, a mixture of experts' router), proved from the graph
(:func:`flattened_rows`) and trusted once a datum check passed on the layout
(:class:`RowLayouts`); and a chunked head's chunks of such rows (:func:`chunk_as_datums`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gradlog._torch_private import view_base
from gradlog._torch_private.nodes import (
    autograd_node_dims,
    autograd_node_output_shape,
    autograd_node_shapes_known,
    autograd_node_view_input_sizes,
)
from gradlog._tree import flatten
from gradlog.backends.hooks.calls import TAG, Call, Entry, calls_moved
from gradlog.backends.hooks.graph import VIEW_NODES, GraphSurvey, row_wise
from gradlog.errors import BackendError, UnsupportedLayerError
from gradlog.memory.chunk import ChunkInfo

__all__ = [
    "RowLayouts",
    "chunk_as_datums",
    "consumer_rows",
    "flatten_rows",
    "flattened_rows",
    "rows_as_datums",
    "rows_by_datum",
]

_FLATTENING = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_MATMUL_INPUT = {"AddmmBackward0": 1, "MmBackward0": 0}  # the input rows' slot (not weight's)
_MAX_NODES = 256


def flatten_rows(call: Call, B: int, shared: bool, graph: GraphSurvey,
                 sequence_first: bool = False) -> bool:
    """Lay out a row-wise layer's or a re-run module's call on the batch's tokens flattened
    to ``(B*T, ...)`` rows (:func:`flattened_rows`) as a chunk of whole datums; True if so."""
    entry = call.entry  # (a batch found by size in a later dimension, Swin's (B*windows,
    # B, d) for windows of B tokens, yields to rows proved datum-major)
    if shared or (call.lead == B and call.bd == 0) or not (
            (entry.rule.feature_dims is not None and call.hooked == 1)
            or (entry.fallback and not entry.op)):
        return False
    # (a batch found by size in a later dimension: dim 0's B must be traced to the batch)
    lead = flattened_rows(call, B, graph, sequence_first, strict=call.lead == B)
    x = call.args[0] if call.args else None
    inside = False
    if lead is None and entry.fallback and isinstance(x, torch.Tensor) and call.lead:
        # a re-run module that flattens its batch-first input itself (DeepSeek's router:
        # (B, T, d) in, (B*T, ...) rows out): inputs split as a batch, outputs as rows
        lead, inside = _flattened(tuple(x.shape), B, call.lead, 1), True
    if lead is None:
        return False
    call.chunk = ChunkInfo(lead, 0, math.prod(lead), True, flattened=True, inside=inside)
    call.bd, call.lead = 0, B
    return True


def flattened_rows(call: Call, B: int, graph: GraphSurvey | None = None,
                   sequence_first: bool = False, strict: bool = False
                   ) -> tuple[int, ...] | None:
    """``(B, N // B)`` when the ``N`` rows of the call's ``(N, ..., d)`` input are B datums'
    in order, each datum's rows together, else None: the tokens of B datums flattened (OPT
    flattens its hidden states to ``(B*T, d)`` before its feed-forward layers), or their
    windows (Swin's ``(B*windows, tokens, d)``). Read from the graph
    (:func:`rows_by_provenance`), or for an input without a graph from where its rows go
    (:func:`_rows_going_back`). That the first dimension of size B is the batch is taken
    from sizes, as everywhere in this backend (in a model with sequence-first layers, a
    ``(B, B, d)`` tensor, whose rows could be time-major, is not taken), so the layout is
    trusted only once a datum check passed on it (:class:`RowLayouts`): rows that only look
    datum-major are refused there. A row-wise layer's per-datum gradients are then those of a
    chunk of whole datums (:func:`chunk_as_datums`)."""
    x = call.args[0] if call.args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] <= B or x.shape[0] % B:
        return None
    n, features = int(x.shape[0]), x.dim() - 1
    if x.grad_fn is None:  # (data without a graph: a view, or where its rows go, tells)
        base = view_base(x)
        if (base is None or not (base.is_contiguous() and x.is_contiguous())
                or x.data_ptr() != base.data_ptr() or x.numel() != base.numel()):
            return _rows_going_back(call, B, n, graph)  # (a frozen layer made x)
        return _flattened(tuple(base.shape), B, n, features)
    proved = rows_by_provenance(x.grad_fn, x.output_nr, n, B, sequence_first, strict)
    return (B, n // B) if proved else None


def rows_by_provenance(start: Any, nr: int, n: int, B: int, sequence_first: bool = False,
                       strict: bool = False) -> bool:
    """Whether the ``n`` rows (dimension 0) of output ``nr`` of autograd node ``start`` are
    B datums' in order (rows ``b n/B`` to ``(b + 1) n/B`` made from datum b's data alone):
    every path back from it reaches a view of a batch-first ``(B, ...)`` tensor, a call
    proved so before it, or parameters, through ops that make each row from the same row
    of their inputs: row-wise ops (:func:`.graph.row_wise`), a Linear through its input,
    batched matmuls (``bmm``: row i from both operands' rows i), permutes, transposes and
    softmaxes that leave dimension 0 alone, expands that add no rows, and views between
    multiples of B rows (a view keeps the elements' order, so each datum's elements stay
    one run of it). Tensors made from parameters alone (Swin's relative position bias,
    indexed and permuted from its table) may be broadcast over the rows. A view of a
    ``(B, ..., B, ...)`` tensor merging a B other than the first into the rows (``strict``:
    with a B anywhere else) is taken only where that first B traces back to the batch
    (:func:`_batch_first`), never with ``sequence_first`` layers in the model: its first B
    could be time (a ``(T, B, d)`` tensor with T == B), or heads."""
    proved = False
    stack, seen = [(start, nr, n)], {id(start)}
    held = [start]  # (node wrappers alive while their ids are keys)
    while stack:
        node, nr, m = stack.pop()
        kind = type(node).__name__
        if any(o == nr and c.chunk is not None and c.chunk.lead_shape[0] == B
               and (c.chunk.start, c.chunk.stop) == (0, m) == (0, math.prod(c.chunk.lead_shape))
               for o, c in _tagged(node)):
            proved = True  # (a call laid out so before this one)
            continue
        rows = m
        if kind in _FLATTENING:
            sizes = autograd_node_view_input_sizes(node)
            if not sizes:
                return False
            if sizes[0] == B:  # a view of a batch-first tensor
                j = next((j for j in range(1, len(sizes) + 1) if math.prod(sizes[:j]) >= m),
                         len(sizes))
                if B in sizes[1:None if strict else j] and (
                        sequence_first or not _batch_first(node, B)):
                    return False  # ((T, B, d) with T == B: its rows could be time-major)
                proved = True
                continue
            if sizes[0] % B or sizes[0] < B:
                return False  # a reshape of something else: no proof
            rows = sizes[0]
            children = list(node.next_functions)
        elif kind == "AccumulateGrad":
            continue  # a parameter (broadcast over the rows: a bias, a norm's weight)
        elif kind in _MATMUL_INPUT:  # (its other operands must be parameters: a weight)
            slot = _MATMUL_INPUT[kind]
            children = [node.next_functions[slot]]
            if not all(child is None or _parameters_only(child)
                       for i, (child, _) in enumerate(node.next_functions) if i != slot):
                return False
        elif _row_for_row(node, kind, m):
            children = list(node.next_functions)
        elif _parameters_only(node):
            continue
        else:
            return False
        for child, child_nr in children:
            if child is None or id(child) in seen:
                continue
            if not _has_rows(child, child_nr, rows):  # broadcast over the rows
                if _parameters_only(child):
                    continue
                return False
            if len(seen) >= _MAX_NODES:
                return False
            seen.add(id(child))
            held.append(child)
            stack.append((child, child_nr, rows))
    return proved


def _has_rows(node: Any, output: int, rows: int) -> bool:
    """Whether output ``output`` of ``node`` has the ``rows`` rows of the op it feeds (not a
    tensor broadcast over them); True where this torch's nodes keep no shapes."""
    if not autograd_node_shapes_known(node):
        return True
    shape = autograd_node_output_shape(node, output)
    return bool(shape) and shape[0] == rows


def _row_for_row(node: Any, kind: str, m: int) -> bool:
    """Whether ``node`` makes each of its ``m`` output rows from its inputs' same row (and
    tensors broadcast over the rows) alone."""
    if kind == "ExpandBackward0":  # (one that adds no rows: matmul's broadcasting)
        sizes = autograd_node_view_input_sizes(node)
        if not sizes or not autograd_node_shapes_known(node):
            return False
        return len(sizes) == len(autograd_node_output_shape(node)) and sizes[0] == m
    if kind in ("PermuteBackward0", "TransposeBackward0") or kind.endswith("SoftmaxBackward0"):
        dims = autograd_node_dims(node)  # (a permute keeping dim 0 first; the others off it)
        return dims is not None and (dims[0] == 0 if kind == "PermuteBackward0" else 0 not in dims)
    return kind == "BmmBackward0" or kind.startswith("ScaledDotProduct") or row_wise(node)


def _batch_first(view: Any, B: int) -> bool:
    """For a view of a tensor with more than one dimension of size B (Swin's ``(B, 8, 8, 7,
    7, C)`` windows at B 8): whether its first dimension is the batch, read back from where
    the tensor came from: through ops that keep its dimensions up to that one in place
    (elementwise ops, norms, a roll or pad of later dimensions, views), permutes and
    transposes (their moves followed), to a tensor with one dimension of size B, which must
    be the one followed, or to the model's input (batch-first: an op on data without a
    graph). Time-major rows, a ``(T, B, d)`` tensor with T == B transposed from the batch's,
    trace back to its second dimension."""
    node: Any = view.next_functions[0][0]
    nr: int = view.next_functions[0][1]
    c = 0
    for _ in range(_MAX_NODES):
        if node is None or type(node).__name__ == "AccumulateGrad":
            return c == 0  # (a leaf: the model's input, batch-first)
        if not autograd_node_shapes_known(node):
            return False
        shape = autograd_node_output_shape(node, nr)
        if len(shape) <= c or shape[c] != B:
            return False
        if shape.count(B) == 1:
            return True
        kind = type(node).__name__
        moves = kind in ("PermuteBackward0", "TransposeBackward0")
        if moves:
            dims = autograd_node_dims(node)
            if dims is None:
                return False
            if kind == "PermuteBackward0":
                c = dims[c]
            else:
                c = dims[1] if c == dims[0] else dims[0] if c == dims[1] else c
        elif kind in _FLATTENING:
            sizes = autograd_node_view_input_sizes(node)
            if sizes is None or sizes[: c + 1] != shape[: c + 1]:
                return False
        data = [(child, n) for child, n in node.next_functions
                if child is not None and not _parameters_only(child)]
        if not data:
            return c == 0  # (an op on the model's input, which is batch-first)
        node, nr = data[0]
        if not moves and kind not in _FLATTENING and type(node).__name__ != "AccumulateGrad":
            before = autograd_node_output_shape(node, nr)  # (it keeps the dims up to c)
            if len(before) != len(shape) or before[: c + 1] != shape[: c + 1]:
                return False
    return False


def consumer_rows(node: Any, B: int, graph: GraphSurvey, sequence_first: bool = False) -> int:
    """For a consumer of an output shared by the batch (:func:`.layout.shared_outputs`)
    whose output has ``k B`` rows (``k`` > 1), not B (Swin's relative position bias, added
    to the scores of each datum's windows): ``k`` when its rows are B datums' in order
    (:func:`rows_by_provenance`), or, where the rows of the consumer itself come from no
    datum (the bias plus a constant mask), those of every op taking its output row for row;
    else 0."""
    if not autograd_node_shapes_known(node):
        return 0
    shape = autograd_node_output_shape(node)
    if not shape or shape[0] <= B or shape[0] % B:
        return 0
    m = shape[0]
    if rows_by_provenance(node, 0, m, B, sequence_first):
        return m // B
    after = graph.parents(node)
    proved = bool(after) and all(
        row_wise(parent) and autograd_node_output_shape(parent)[:1] == (m,)
        and rows_by_provenance(parent, 0, m, B, sequence_first) for parent, _ in after)
    return m // B if proved else 0


_SHAPING = VIEW_NODES | {"IndexBackward0", "ExpandBackward0", "SliceBackward0",
                         "SelectBackward0", "ToCopyBackward0"}


def _parameters_only(node: Any) -> bool:
    """Whether ``node``'s output is a parameter reshaped, indexed, sliced or cast (a chain
    of one-input shape ops down to it): broadcast over rows, it carries no datum's data. (A
    leaf that is not an ``nn.Parameter``, an input the user differentiates, is data.)"""
    for _ in range(_MAX_NODES):
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            leaf = getattr(node, "variable", None)
            return leaf is None or isinstance(leaf, nn.Parameter)
        children = [child for child, _ in node.next_functions if child is not None]
        if kind not in _SHAPING or len(children) != 1:
            return False
        node = children[0]
    return False


class RowLayouts:
    """Layers run on the batch's tokens flattened (:func:`flattened_rows`): each
    datum's rows are inferred from the graph and the sizes, so such a layout is trusted only
    once a datum check passed on it (:attr:`verified`; beside autograd Functions gradlog
    does not know, whose check is otherwise a warning, a failure is then an error), and
    refused where none can run (under FSDP or DDP with ``static_graph``, with backward hooks
    of the user's, a reentrant checkpoint): rows read time-major where sizes allow it would
    sum to p.grad and pass every other check."""

    def __init__(self) -> None:
        self.verified: set[tuple[str, tuple[int, ...]]] = set()
        self.pending: set[tuple[str, tuple[int, ...]]] = set()  # this backward's new ones
        self.own: frozenset[str] = frozenset()
        self._names: dict[str, frozenset[str]] = {}  # layer -> its recorded parameters
        self._calls: dict[tuple[str, tuple[int, ...]], list[Call]] = {}  # pending ones
        self.reordered = False  # this backward's batch reordered in the forward: checked

    def note(self, calls: Iterable[Call], B: int, graph: GraphSurvey) -> bool:
        """This backward's layouts not verified yet (one datum needs none), and whether the
        forward reordered the batch (:meth:`.graph.GraphSurvey.reordered`: every such
        backward is checked, its order being the batch's own); True if any; :attr:`own`:
        the parameters of copies over the batch among them."""
        calls = list(calls)
        self.reordered = B > 1 and graph.reordered(B)
        self._calls = {}
        for c in calls if B > 1 else ():
            if (c.chunk is not None and c.chunk.flattened) or c.datum_rows:
                key = (c.entry.name, tuple(c.chunk.lead_shape) if c.chunk is not None
                       else (B, c.datum_rows))
                if key not in self.verified:
                    self._calls.setdefault(key, []).append(c)
                    c.watched = True  # (its results' being zero read by passed)
        self.pending = set(self._calls)
        self.own = frozenset(n for c in calls if c.copied for n in c.entry.names.values())
        self._names = {c.entry.name: frozenset(c.entry.names.values()) for c in calls}
        return bool(self.pending) or self.reordered

    def require(self, checked: bool) -> None:
        """Refuse the pending layouts unless a trusted datum check runs on them."""
        if self.reordered and not checked:
            self.reordered = False
            raise UnsupportedLayerError(
                "the model takes the batch's rows in another order inside its forward "
                "(h[order], index_select, gather, sort, flip, roll, a cat or stack of its "
                "pieces, scatter or index_put along the batch: a batch sorted by length, or "
                "losses sorted), so its layers see other datums at each row; gradlog verifies "
                "each such backward with a datum check, and that check cannot run here (under "
                "FSDP or DDP(static_graph=True), with backward hooks of your own, or a "
                "reentrant activation checkpoint). Reorder the batch before the model (and "
                "the losses with it), or use backend='loop'.")
        if self.pending and not checked:
            names = sorted({name for name, _ in self.pending})
            self.pending = set()
            raise UnsupportedLayerError(
                f"{names[:3]} ran on the batch's tokens flattened to rows, gave an output "
                "shared by the batch that an expand or a repeat copies over it, or gave one "
                "whose first dimension has the batch's size but that the autograd graph does "
                "not show made from the batch (a table of B rows; before torch 2.6, any "
                "output read by size alone), whose datums "
                "gradlog verifies with a datum check at the layout's first step, and that "
                "check cannot run here (under FSDP or DDP(static_graph=True), with backward "
                "hooks of your own, or a reentrant activation checkpoint). Keep the batch as "
                "its own dimension ((B, T, d) into the layer; a shared output added to "
                "batched data), run one step without those, or use backend='loop'.")

    def passed(self, informative: frozenset[str] | None) -> None:
        """The datum check passed: verified are the pending layouts with a parameter in
        ``informative`` (whose gradient it compared was not zero: see
        :meth:`.datum_check.DatumLayouts.passed`) whose calls gave gradients that are not
        zero (:func:`.calls.calls_moved`: a table weighted 0 at the check, another read of
        its weight informative, was 1.0 off at the next step); the others stay pending."""
        self.verified |= {key for key in self.pending
                          if informative is None or (self._names[key[0]] & informative
                                                     and calls_moved(self._calls[key]))}
        self.pending, self.reordered, self._calls = set(), False, {}


def rows_by_datum(chunk: Any, entry: Entry, B: int, args: tuple[Any, ...],
                  kwargs: dict[str, Any], grads: list[torch.Tensor | None]) -> tuple[
        int, slice | None, tuple[Any, ...], dict[str, Any], list[torch.Tensor | None], bool]:
    """A call that saw rows of ``(B, T)`` flattened, laid out by datum: a chunked head's or a
    row-wise layer's (:func:`chunk_as_datums`), or a module re-run per datum on the batch's
    flattened tokens (:func:`rows_as_datums`, the last item True)."""
    if chunk.flattened and entry.fallback:
        return (B, None, *rows_as_datums(chunk, B, args, kwargs, grads), not chunk.inside)
    return (*chunk_as_datums(chunk, entry, B, args, kwargs, grads), False)


def rows_as_datums(chunk: Any, B: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                   grads: list[torch.Tensor | None]
                   ) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor | None]]:
    """A module re-run per datum on the batch's flattened tokens (``chunk.flattened``):
    every tensor with the call's ``N = B*T`` rows first, in its arguments (the routing of a
    mixture of experts: indices and weights per row) and output gradients, viewed as
    ``(B, T, ...)``; the datum's ``(T, ...)`` slice is the rows the module re-runs on."""
    n = math.prod(chunk.lead_shape)
    per = n // B

    def rows(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n:
            return t.reshape(B, per, *t.shape[1:])
        return t

    flat, rebuild = flatten((args, kwargs))
    args, kwargs = rebuild([rows(t) for t in flat])
    return args, kwargs, [rows(g) for g in grads]


def _rows_going_back(call: Call, B: int, n: int,
                     graph: GraphSurvey | None) -> tuple[int, ...] | None:
    """For a call whose input has no graph (a frozen layer made it: LoRA on OPT's ``fc1``
    alone): ``(B, T, ...)`` when every path from its output onward crosses only row-wise
    ops (:func:`.graph.row_wise`, a Linear through its input) to a reshape of its ``n`` rows into
    ``(B, T, ..., d)``: the layout the rows had, read forward. Else None."""
    out = call.entry.rule.feature_dims
    if graph is None or out is None or not autograd_node_shapes_known(graph.root):
        return None
    features = out(call.entry.module)
    start = graph.consumers({id(call)}).get(id(call), [])
    stack = list(start)
    seen = {(id(node), slot) for node, slot in start}
    leads: set[tuple[int, ...]] = set()
    while stack:
        node, slot = stack.pop()
        kind = type(node).__name__
        if kind in _FLATTENING:  # (n, ..., d) -> (B, T, ..., d)
            lead = _flattened(autograd_node_output_shape(node), B, n, features)
            if lead is None:
                return None
            leads.add(lead)
            continue
        if (kind in _MATMUL_INPUT and slot != _MATMUL_INPUT[kind]) or (
                kind not in _MATMUL_INPUT and not row_wise(node)):
            return None  # (taken as a weight, or by an op that mixes rows)
        after = graph.parents(node)
        if not after:
            return None  # (reached the loss with no reshape to datums)
        for parent in after:
            if (id(parent[0]), parent[1]) not in seen:
                if len(seen) >= _MAX_NODES:
                    return None
                seen.add((id(parent[0]), parent[1]))
                stack.append(parent)
    return leads.pop() if len(leads) == 1 else None


def _flattened(sizes: tuple[int, ...], B: int, n: int, features: int) -> tuple[int, ...] | None:
    """The leading shape ``(B, T, ...)`` of a ``(B, T, ..., *features)`` tensor reshaped into
    ``n`` rows, or None (another shape, or one where rows could be time-major)."""
    lead = sizes[: len(sizes) - features]
    if len(lead) < 2 or lead[0] != B or math.prod(lead) != n or B in lead[1:]:
        return None
    return lead


def _tagged(node: Any) -> list[tuple[int, Call]]:
    """The captured calls whose output ``node`` made, by output slot (:data:`graph.TAG`)."""
    meta = getattr(node, "metadata", None)
    return list(meta.get(TAG, ())) if meta else []


def chunk_as_datums(
    chunk: Any, entry: Entry, B: int, args: tuple[Any, ...], kwargs: dict[str, Any],
    grads: list[torch.Tensor | None],
) -> tuple[int, slice, tuple[Any, ...], dict[str, Any], list[torch.Tensor | None]]:
    """Lay out a chunk of flattened rows (rows ``start:stop`` of ``(B, T)`` flattened, from
    :func:`gradlog.memory.chunked_linear_loss`) as ``(datums spanned, width, ...)``: each
    datum's rows of the chunk first, zero rows after them (zero inputs and gradients add
    nothing to a row-wise layer's gradient). ``width`` is at most the chunk's length, never
    the whole ``T``: a chunk of 32 rows of a 4096-token datum is a ``(1, 32, ...)`` view, where
    padding it to ``T`` made every chunk's per-datum matmul 128 times longer (45 s a step at
    the memory puzzle's shape on an H200).
    Returns the number of datums, their slice, and the re-laid arguments and gradients."""
    if entry.rule.feature_dims is None:
        raise UnsupportedLayerError(
            f"rule {entry.rule.name!r} cannot take the flattened rows of chunked_linear_loss "
            "(only row-wise layers such as Linear can); call the layer unchunked or use "
            "backend='loop'."
        )
    lead = tuple(chunk.lead_shape)
    if not lead or lead[0] != B:
        raise BackendError(
            f"chunked_linear_loss ran on rows of shape {lead} for a batch of B={B} datums; "
            "its input must keep the batch first, e.g. hidden states (B, T, d)."
        )
    per = 1
    for n in lead[1:]:
        per *= n  # rows per datum
    start, stop = chunk.start, chunk.stop
    first, last = start // per, (stop - 1) // per + 1
    n_rows, spanned = stop - start, last - first
    # One datum, or whole datums: the rows are already (datums, rows each) in order.
    aligned = spanned == 1 or (start % per == 0 and n_rows == spanned * per)
    width = n_rows // spanned if aligned else min(per, n_rows)
    places: dict[torch.device, torch.Tensor] = {}

    def place(device: torch.device) -> torch.Tensor:
        """Row ``r`` of the chunk goes to ``datum * width + (its position in the datum's
        part of the chunk)``."""
        if device not in places:
            r = torch.arange(start, stop, device=device)  # (rows,)
            datum = r // per  # (rows,)
            places[device] = (datum - first) * width + r - (datum * per).clamp_min(start)
        return places[device]

    def as_datums(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n_rows:
            return t
        if aligned:
            return t.reshape(spanned, width, *t.shape[1:])  # (datums, width, ...)
        full = t.new_zeros((spanned * width, *t.shape[1:]))  # (datums*width, ...)
        full.index_copy_(0, place(t.device), t)
        return full.view(spanned, width, *t.shape[1:])  # (datums, width, ...)

    parts, rebuild = flatten((args, kwargs))
    new_args, new_kwargs = rebuild([as_datums(t) for t in parts])
    return spanned, slice(first, last), new_args, new_kwargs, [as_datums(g) for g in grads]
