"""Where the batch is, in the tensors a hooked call saw.

Every per-datum result must have B rows. Layers that treat leading dimensions alike (Linear,
Embedding, LayerNorm) may have the batch in any leading dimension (sequence-first models): it
is found by size (:func:`locate_batch`) and moved first (:func:`batch_first`). A module whose
output has no batch dimension of its own (shared position ids) takes each datum's gradient
from the op that broadcasts it (:func:`shared_outputs`, :func:`consumer_inputs`). A chunked
head's or a row-wise layer's rows flattened over the batch's tokens: :mod:`.rows`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from gradlog._torch_private import storage_key
from gradlog._torch_private.nodes import (
    autograd_node_leading_copies,
    autograd_node_output_shape,
    autograd_node_shapes_known,
)
from gradlog._tree import flatten
from gradlog.backends.hooks.calls import TAG, Call, Entry, sizes_of_b
from gradlog.backends.hooks.feeds import Path, feeds_of
from gradlog.backends.hooks.graph import (
    PASS_THROUGH,
    SHARED_ALONG,
    UNSAVED_ALONG,
    VIEW_NODES,
    Chain,
    GraphSurvey,
    batch_repeat,
    consumers_through_views,
    sequence_first_broadcast,
    through_views,
)
from gradlog.backends.hooks.rows import consumer_rows, flatten_rows
from gradlog.errors import BackendError, UnsupportedLayerError

__all__ = [
    "batch_first",
    "consumer_inputs",
    "locate_batch",
    "shared_outputs",
]

Consumers = list[tuple[Any, int, Chain, tuple[int, ...]]]
"""(autograd node, input slot, view nodes between, shape at that slot) consuming a call's
output (``Chain`` is empty when the node consumes the output itself)."""


def locate_batch(call: Call, B: int, sequence_first: list[str], unchecked: bool = False
                 ) -> None:
    """Settle the call's batch dimension: fixed by its rule, or, for layers that treat
    leading dimensions alike, the leading dimension of size B (dim 0 if it is one; where two
    are in a model with sequence-first layers, the one the module's earlier outputs had:
    :func:`_settled_before`).

    Args:
        call: The call; its ``bd`` and ``lead`` are set.
        B: The batch size.
        sequence_first: The model's modules with ``batch_first=False``.
        unchecked: No datum check verifies this call's layout (captured in the backward, in
            a reentrant checkpoint's recompute): with two dimensions of size B it is read
            batch-first, and the log says so, or refused in a model with sequence-first
            layers or where no input carries data (a table: T5's bias, 1.2-1.6 off so).
    """
    entry, shape = call.entry, call.out_shape
    at = sizes_of_b(call, B)
    if unchecked and B > 1 and len(at) > 1 and not sequence_first and any(
            t.requires_grad for t in flatten((call.args, call.kwargs))[0]
            if isinstance(t, torch.Tensor)):
        if entry.name not in _UNVERIFIED:
            _UNVERIFIED.add(entry.name)
            log.warning(
                "gradlog: %s ran inside a reentrant activation checkpoint with output shape "
                "%s, two of its dimensions of the batch's size (B=%d): it is read batch-first, "
                "unverified (no datum check runs there); a sequence-first use would be "
                "recorded wrong. use_reentrant=False lets the check run.",
                entry.label, tuple(shape), B)
    elif unchecked and B > 1 and len(at) > 1:
        raise UnsupportedLayerError(
            f"{entry.label} ran inside a reentrant activation checkpoint "
            f"(use_reentrant=True) with output shape {tuple(shape)}: more than one of its "
            f"dimensions has the batch's size (B={B}), a layout gradlog settles with a "
            "datum check, which autograd refuses there. Use "
            "use_reentrant=False (HF: gradient_checkpointing_enable(gradient_checkpointing_"
            "kwargs={'use_reentrant': False})), a batch size different from the model's "
            "other sizes, or backend='loop'.")
    first = call.args[0] if call.args else None
    if isinstance(first, PackedSequence):  # its batch: the sequences (the RNN rule splits it)
        call.lead = int(first.batch_sizes[0]) if len(first.batch_sizes) else 0
        return
    features = entry.rule.feature_dims
    if features is not None:
        leading = list(shape[: max(0, len(shape) - features(entry.module))])
        found = [k for k, n in enumerate(leading) if n == B]
        call.bd = 0 if not found or found[0] == 0 else found[0]
        if len(found) > 1 and found[0] == 0 and sequence_first and B > 1:
            call.bd = _settled_before(entry, len(shape), found, sequence_first, B)
        elif found:
            entry.batch_dims.setdefault(len(shape), set()).add(call.bd)
    elif entry.fallback and not entry.op:
        # a module without a rule on a sequence-first (T, B, D) layout; never the last
        # (feature) axis: a flattened (B*T, d) output with d == B has no batch axis
        sized = [k for k, n in enumerate(shape[:-1]) if n == B]
        if len(sized) == 1:
            call.bd = sized[0]
            entry.batch_dims.setdefault(len(shape), set()).add(call.bd)
        elif len(sized) > 1 and sequence_first and B > 1:
            call.bd = _settled_before(entry, len(shape), sized, sequence_first, B)
    call.lead = shape[call.bd] if len(shape) > call.bd else None
    if entry.op and entry.op not in COPYING_OPS and _on_parameters_alone(call):
        call.lead = None  # a size of B there is the parameters': no datum's data came in


def _settled_before(entry: Entry, rank: int, sized: list[int], sequence_first: list[str],
                    B: int) -> int:
    """The batch dimension of an output with several of the batch's size (a sequence-first
    step whose length equals the batch size): the one the entry's outputs of this rank had
    wherever size alone settled it, if always the same (the datum check then verifies this
    layout, :class:`.datum_check.DatumLayouts`); refused without one."""
    seen = entry.batch_dims.get(rank, set())
    if len(seen) == 1 and next(iter(seen)) in sized:
        return next(iter(seen))
    why = (f"its earlier outputs had the batch in dimensions {sorted(seen)}" if seen else
           "no earlier step settled it")
    raise BackendError(
        f"{entry.label} has an output of {rank} dimensions, {len(sized)} of them of the "
        f"batch's size (B={B}): with sequence-first layers in the model "
        f"({sequence_first[:3]}), either may be the batch, and gradlog cannot tell which "
        f"({why}). Record a first step whose sequence length differs from the batch size "
        "(gradlog then keeps the batch where that step had it), use a batch size different "
        "from the sequence length, batch_first=True layers, or backend='loop'."
    )


_UNVERIFIED: set[str] = set()  # calls read batch-first in a reentrant checkpoint, logged
log = logging.getLogger("gradlog")


COPYING_OPS = frozenset({"repeat", "expand", "expand_as", "tile", "broadcast_to", "cat",
                         "concat", "concatenate", "stack", "repeat_interleave"})
"""Ops that can copy a parameter over the batch by themselves (``bias.repeat(1, B, 1)``):
their output may have the batch without a datum's data among their arguments."""


def _on_parameters_alone(call: Call) -> bool:
    """Whether every tensor argument of an op call with more than one element is one of its
    parameters or a view of one (``wpe.weight[:T] * 2``)."""
    own = {storage_key(p) for p in call.entry.params}
    return all(storage_key(t) in own for t in flatten((call.args, call.kwargs))[0]
               if isinstance(t, torch.Tensor) and t.numel() > 1)


def shared_outputs(live: list[Call], graph: GraphSurvey, B: int, sequence_first: list[str],
                   unseen: bool = False
                   ) -> Iterator[tuple[Call, Consumers, list[tuple[Call, Path]] | None]]:
    """Before the backward: settle each captured call's batch dimension, and yield the calls
    whose output an op broadcasts over the batch, with the consumers to take their
    per-datum output gradients from, or (last) the calls whose output reaches the batch
    only through such calls' Linear layers, with the paths there (:func:`.feeds.feeds_of`;
    each call so yielded gets batch dimension 0 and ``via_consumers``). Raises for what
    cannot be computed.

    Args:
        live: The calls captured for this backward.
        graph: The batch loss's graph.
        B: The batch size.
        sequence_first: The model's modules with ``batch_first=False``.
        unseen: Whether calls ran in the forward without grad, to be captured in the
            backward (a reentrant checkpoint's segment): the batch's tensors' dimensions
            are then read from the graph, not from the calls seen.
    """
    root = graph.root
    if not live or root is None:
        return
    deferred: list[tuple[Call, list[tuple[Any, int]], BackendError]] = []
    # Node._input_metadata (shapes of a node's forward outputs) tells exactly which
    # captured outputs an op broadcast; without it (older torch) a shape heuristic picks
    # the calls to check, and any call reaching the loss only through pass-through ops
    # counts as shared.
    exact = autograd_node_shapes_known(root)
    widest = max((len(c.out_shape) for c in live), default=0)
    # a size of B beside the batch in a call's output (T == B): a table of T rows may then
    # pass for batched (a conditioning MLP's (B, d) on data need not be proved otherwise)
    coincide = any(B in tuple(c.out_shape)[1:-1] for c in live)
    if exact and unseen:  # (a table of length B among the calls seen would look widest)
        widest = max(widest, graph.widest())
    if exact:
        candidates = live
    else:
        for call in live:
            locate_batch(call, B, sequence_first)
        widest = max((len(c.out_shape) for c in live if c.lead == B), default=0)
        # A leading dimension of size 1 in a batch-first model is a broadcast one (nanoGPT's
        # arange positions, (1, T, d)), even where T == B made locate_batch take T for it.
        broadcast = [] if sequence_first else [c for c in live if c.out_shape
                                               and c.out_shape[0] == 1 != B]
        candidates = [c for c in live if c.lead != B or len(c.out_shape) < widest
                      or c.refusal is not None or any(c is b for b in broadcast)]
        for call in live if unseen else ():  # (the widest seen may be a table of length B)
            if call.lead == B and len(call.out_shape) <= 2 and call not in candidates and (
                    not _from_the_batch(call, B)):
                _unproved(call)
    if not candidates:
        return
    consumers = graph.consumers({id(c) for c in candidates})
    for call in candidates:
        found = consumers.get(id(call))
        if not found:  # not part of this graph (an earlier forward), or its first output
            if call.lead is None:  # unused (a router's logits without an auxiliary loss)
                locate_batch(call, B, sequence_first)
            flatten_rows(call, B, False, graph, bool(sequence_first))
            continue
        entry = call.entry
        if call.refusal is not None:
            raise UnsupportedLayerError(
                f"gradlog cannot compute per-datum gradients of {entry.label} (rule "
                f"{entry.rule.name!r}): {call.refusal} Nothing was computed; p.grad is "
                "untouched."
            )
        shape = tuple(call.out_shape)
        passing = all(_passes(node, shape, B) for node, _ in found)
        if exact:
            shared = any(_passes(node, shape, B)
                         and _broadcast(node, shape, B, bool(sequence_first))
                         for node, _ in found)  # ((B, 1) + (B, d) is not: its own batch)
            if not shared and shape and shape[0] == 1 != B and not sequence_first:
                shared = _replicated(found, graph, shape, B)
        else:
            shared = passing
        first = entry.rule.feature_dims is not None or call.bd == 0
        if shared and passing and first and call.hooked == 1:
            call.bd, call.lead = 0, B  # the consumer's gradient has the batch first
            call.via_consumers = True
            if exact:  # (or each datum's rows of it: Swin's windows)
                rows = [_copies(node, shape, B) for node, _ in found]
                call.copied = any(rows)
                call.datum_rows = max(r or consumer_rows(node, B, graph, bool(sequence_first))
                                      for r, (node, _) in zip(rows, found, strict=True))
                _refuse_unproved_rows(call, found, B)
            elif any(_copy_without_shapes(node) for node, _ in found):
                _unproved(call)  # (no shapes to prove the copy's rows: the datum check must)
            yield call, [(node, slot, (), shape) for node, slot in found], None
            continue
        table = False  # a table whose length is B ((T, d) with T == B, fewer dimensions than
        if exact:  # the batch's tensors): viewed or taken through ops of it alone, then
            locate_batch(call, B, sequence_first)  # broadcast over it, shared all the same
            table = call.lead == B and len(shape) < widest and all(
                type(n).__name__ in SHARED_ALONG for n, _ in found)
        coincides = exact and call.lead == B and B in shape[1:]  # (T, T, H) with T == B
        if (shared or call.lead != B or table or coincides) and first and call.hooked == 1:
            chained = _through_views(found, graph, shape, B, bool(sequence_first))
            if chained is not None:  # shared whole, broadcast after views (T5's bias)
                call.bd, call.lead = 0, B
                call.via_consumers = True
                call.datum_rows = max(_copies(node, at, B) for node, _, _, at in chained)
                call.copied = call.datum_rows > 0
                if coincides and not (shared or table):
                    _unproved(call)  # (its size alone said batched: the datum check decides)
                yield call, chained, None
                continue
        if flatten_rows(call, B, shared, graph, bool(sequence_first)):
            continue
        if (not shared and call.lead == B and (not exact or len(shape) < min(widest, 3))
                and not _from_the_batch(call, B)
                and (not exact or coincide or _of_the_model(call, live))):
            _unproved(call)  # (a size of B taken for the batch: a table of length B?)
        if shared or call.lead != B:
            ops = sorted({type(node).__name__ for node, _ in found})
            beyond = (consumers_through_views(graph, found)
                      if any(type(n).__name__ in VIEW_NODES for n, _ in found) else None)
            if beyond:  # name what the views lead to
                ops += [f"then {n}" for n in sorted({type(n).__name__ for n, _, _ in beyond})]
            deferred.append((call, found, BackendError(
                f"the output of {entry.label} has shape {shape}, with no batch dimension "
                f"of size B={B} of its own, and reaches the loss through {ops}. gradlog "
                "takes per-datum gradients of a shared output only when additions, "
                "subtractions, expands or repeats over the batch alone broadcast it, directly "
                "or after views and permutes, or Linear layers so broadcast take it "
                "(position embeddings, T5's relative attention bias, DeBERTa's relative "
                "positions; with attention implementations that take the bias into a fused "
                "kernel, such as SDPA, use the eager one). Give the layer a batched input (e.g. "
                "position_ids.expand(B, -1)), keep the batch as one dimension (a Linear "
                "accepts (B, T, d); flattened to (B*T, d) or to windows (B*windows, L, d), "
                "each datum's rows together, through ops that keep rows apart: row-wise "
                "ops, batched matmuls, views; README's table of layouts), give one loss per "
                "row the layer saw (a batch of two views concatenated to 2B rows makes 2B "
                "datums), or use backend='loop'." + (_OP_ON_PARAMETERS if entry.op else "")
                + (" Under saved-tensor hooks (torch.utils.checkpoint, whose saved tensors "
                   "are read once) only shape ops are crossed: move the other ops on the "
                   "output out of the checkpointed segment." if graph.views_only else ""))))
    yield from _fed(deferred, [c for c in live if c.via_consumers], graph, B, exact)


def _fed(deferred: list[tuple[Call, list[tuple[Any, int]], BackendError]], routed: list[Call],
         graph: GraphSurvey, B: int, exact: bool
         ) -> Iterator[tuple[Call, Consumers, list[tuple[Call, Path]] | None]]:
    """The shared calls left whose outputs feed routed Linear calls (:func:`.feeds.feeds_of`),
    level by level; raises the first refusal of those that do not."""
    while deferred and exact:
        left = []
        for call, found, error in deferred:
            feeds = feeds_of(call, found, routed, graph)
            if feeds is None:
                left.append((call, found, error))
                continue
            call.bd, call.lead, call.via_consumers = 0, B, True
            call.copied = any(c.copied for c, _ in feeds)  # (its split is theirs)
            routed.append(call)
            yield call, [], feeds
        if len(left) == len(deferred):
            break
        deferred = left
    for call, found, error in deferred:
        made, nr = found[0][0].next_functions[found[0][1]]
        if B != 1 or nr != 0 or call.hooked != 1:
            raise error
        # one datum: its gradient of the output is the output's (a batch of one at the end
        # of an epoch), taken where the output is made
        call.bd, call.lead, call.via_consumers = 0, B, True
        yield call, [(made, 0, (), tuple(call.out_shape))], None


_OP_ON_PARAMETERS = (
    " This output is an operation on parameters alone (adapters build their weights or "
    "scalings so, outside any layer): each datum uses all of it, through an op other than "
    "an addition, so its per-datum gradients cannot be split from the batch's. PEFT's IA3, "
    "LoHa, LoKr, BOFT, AdaLoRA, FourierFT, HRA, VB-LoRA, RandLoRA and C3A Linear layers have "
    "rules (gradlog/rules/adapters.py); for others register a rule covering these "
    "parameters for the layer whose forward uses them, record with backend='loop', or "
    "leave their parameters out (params=)."
)

def _unproved(call: Call) -> None:
    """A layout read by size alone: trusted once a datum check passed on it, refused where
    none can run, as a copy over the batch is (:class:`.rows.RowLayouts`). An output with
    fewer dimensions than the batch's tensors and a first dimension of the batch's size,
    not made from them (:func:`_from_the_batch`: a Linear or a norm on a buffer or a
    parameter of B rows); and without the shapes autograd's nodes carry from torch 2.6 on,
    copies over the batch and outputs of its size whose dimensions the shapes would set
    apart."""
    call.copied, call.datum_rows = True, max(call.datum_rows, 1)


def _copy_without_shapes(node: Any) -> bool:
    """An expand, a repeat, or an addition onto what carries no gradient: the nodes whose
    copies :func:`_copies` reads as datums' (an addition onto the batch's tensors copies
    nothing: its gradient's rows are theirs)."""
    kind = type(node).__name__
    return kind in ("ExpandBackward0", "RepeatBackward0") or (
        kind in ("AddBackward0", "SubBackward0")
        and sum(child is not None for child, _ in node.next_functions) == 1)


def _of_the_model(call: Call, live: list[Call]) -> bool:
    """Whether every tensor the call took is a parameter or a buffer of a hooked module (a
    codebook of B rows a norm takes, a parameter a Linear does): no datum's data came in."""
    tensors = [t for t in flatten((call.args, call.kwargs))[0] if isinstance(t, torch.Tensor)]
    if not tensors or any(t.grad_fn is not None for t in tensors):  # (an activation: no)
        return False
    held = {storage_key(t) for c in live
            for t in (*c.entry.module.parameters(), *c.entry.module.buffers())}
    return all(storage_key(t) in held for t in tensors)


def _from_the_batch(call: Call, B: int) -> bool:
    """Whether an input of the call comes, in the autograd graph, from the output of a call
    with the batch's size first and more dimensions than the call's own (a classifier on a
    pooled ``(B, d)``: from the encoder's ``(B, T, d)``); a table of length B made from
    parameters and constants does not. (A pooling over the batch would couple the datums'
    losses, which gradlog requires not to.)"""
    dims = len(call.out_shape)
    stack: list[Any] = [t.grad_fn for t in flatten((call.args, call.kwargs))[0]
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    held = []  # (nodes alive while their ids are keys)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        held.append(node)
        for _, other in node.metadata.get(TAG, ()):
            if other is not call and other.lead == B and len(other.out_shape) > dims:
                return True
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return False


def _replicated(found: list[tuple[Any, int]], graph: GraphSurvey, shape: tuple[int, ...],
                B: int) -> bool:
    """Whether an op copies the output, led by a dimension of size 1, B or more times along
    that dimension (PEFT's prompt embedding ``(1, n, d).repeat(B, 1, 1)``): every datum then
    shares all of it, whatever other dimension of size B it has (n == B would pass for the
    batch). Other ops on it (a cat with other tensors, a Linear on an RNN's ``h_n``) are not."""
    nodes = [node for node, _ in found]
    if any(type(node).__name__ in VIEW_NODES for node in nodes):
        nodes += [node for node, _, _ in consumers_through_views(graph, found) or ()]
    return any((autograd_node_leading_copies(node, len(shape)) or 0) >= B for node in nodes)


def _refuse_unproved_rows(call: Call, found: list[tuple[Any, int]], B: int) -> None:
    """A shared output broadcast over more rows than datums, ``k B`` of them, whose rows
    were not proved each datum's (:func:`.rows.consumer_rows`): refused here, naming that,
    rather than later as an output "broadcast in more than one step"."""
    wide = {autograd_node_output_shape(node)[:1] for node, _ in found}
    rows = [n for (n,) in (w for w in wide if w) if n > B and n % B == 0]
    if call.datum_rows or not rows:
        return
    raise BackendError(
        f"the output of {call.entry.label} has shape {tuple(call.out_shape)}, shared by the "
        f"batch, and is broadcast over {rows[0]} rows (B={B}): gradlog could not prove "
        "those rows are B datums' in order (each datum's windows or tokens together, as "
        "Swin's attention has them), so it cannot split this output's gradient by datum. "
        "See README's table of layouts for the ops the proof crosses, or use backend='loop'."
    )


def _passes(node: Any, at: tuple[int, ...], B: int) -> bool:
    """Whether ``node`` is a pass-through op (:data:`PASS_THROUGH`) for what it received, of
    shape ``at``: a repeat only when it copies it over the batch (:func:`batch_repeat`)."""
    kind = type(node).__name__
    return kind in PASS_THROUGH and (kind != "RepeatBackward0"
                                     or batch_repeat(node, at, B) is not None)


def _broadcast(node: Any, at: tuple[int, ...], B: int, sequence_first: bool) -> bool:
    """Whether pass-through ``node`` broadcasts a tensor of shape ``at`` over leading
    dimensions (a new one, or one of size 1), where a batch would be; or repeats it over
    the batch; or, in a model with sequence-first layers, broadcasts it over dimension 1
    (:func:`.graph.sequence_first_broadcast`)."""
    if batch_repeat(node, at, B) is not None:
        return True
    wide = autograd_node_output_shape(node)
    return len(at) < len(wide) or (len(at) == len(wide) and at[:1] == (1,) != wide[:1]) or (
        sequence_first and sequence_first_broadcast(node, at, B))


def _copies(node: Any, at: tuple[int, ...], B: int) -> int:
    """Each datum's rows in what a repeat or an expand copies over the batch (1 for an
    expand, or an addition onto a tensor that carries no gradient: its rows need not be
    datums'), for the first datum check to verify (:class:`.rows.RowLayouts`): that datum
    ``b``'s copy is the ``b``-th is the layout's reading, which a reordering of the batch
    after the copy, or B copies of something else (heads, when there are B of them), makes
    wrong while the records still sum to p.grad; 0 for other nodes."""
    rows = batch_repeat(node, at, B)
    kind = type(node).__name__
    if rows is None and (kind == "ExpandBackward0" or (
            kind in ("AddBackward0", "SubBackward0")
            and sum(child is not None for child, _ in node.next_functions) == 1
            and autograd_node_output_shape(node)[:1] == (B,))):
        return 1  # (an addition onto B rows of what carries no gradient: a copy too; onto
    return rows or 0  # k B rows, .rows.consumer_rows proves them or they are refused)


def _through_views(found: list[tuple[Any, int]], graph: GraphSurvey,
                   shape: tuple[int, ...], B: int, sequence_first: bool) -> Consumers | None:
    """The consumers of a shared output past views, permutes and ops of it alone
    (:data:`.graph.SHARED_ALONG`), when every one of them is a pass-through op
    (:data:`PASS_THROUGH`) that broadcasts what it receives over the batch (a new leading
    dimension, or a leading dimension of size 1; a repeat over it), and the shapes are
    known; else None. None of those mixes datums, so the output is then shared whole."""
    if not all(type(n).__name__ in SHARED_ALONG or type(n).__name__ in PASS_THROUGH
               for n, _ in found):
        return None
    if not autograd_node_shapes_known(graph.root):
        return None
    chained = consumers_through_views(graph, found,
                                      UNSAVED_ALONG if graph.views_only else SHARED_ALONG)
    if not chained:
        return None
    out: Consumers = []
    for node, slot, chain in chained:
        at = autograd_node_output_shape(chain[-1]) if chain else shape  # what node received
        if not _passes(node, at, B) or not _broadcast(node, at, B, sequence_first):
            return None
        out.append((node, slot, chain, at))
    return out


def consumer_inputs(
    call: Call, g: torch.Tensor, B: int, chain: Chain = (), at: tuple[int, ...] = ()
) -> tuple[torch.Tensor, tuple[Any, ...] | None, dict[str, Any] | None, bool]:
    """A shared output's per-datum gradients from its consumer's output gradient ``g``, and
    the call's inputs broadcast to match. With a ``chain`` of view nodes between the output
    and the consumer (``at``: the shape the consumer received), the per-datum gradients at
    the consumer are taken back through the views; the output is then shared whole.

    Returns:
        ``(per, args, kwargs, expanded)``: the per-datum output gradients ``(B, *shape)``,
        the call's arguments (expanded over the batch when ``expanded``).

    Raises:
        BackendError: The output is broadcast over the batch in more than one step.
    """
    shape = tuple(at) if chain else tuple(call.out_shape)
    if B == 1 and not chain and tuple(g.shape) == shape and shape[:1] != (1,):
        g = g.unsqueeze(0)  # (one datum, the output's own gradient: all of it is its)
    k = call.datum_rows
    if k and g.dim() and g.shape[0] == B * k:  # each datum's k rows (rows.consumer_rows)
        g = g.reshape(B, k, *g.shape[1:]).sum(1)
    extra = g.dim() - len(shape)
    if extra < 0 or g.dim() == 0 or g.shape[0] != B:
        raise BackendError(
            f"its output {shape} is broadcast over the batch in more than one step (the "
            f"consumer's gradient has shape {tuple(g.shape)}, not (B={B}, ...)). Give the "
            "layer a batched input (e.g. position_ids.expand(B, -1)) or use backend='loop'."
        )
    if extra == 0:  # the output has a batch dimension of size 1 (or B)
        per = g.sum_to_size((B, *shape[1:]))  # (B, *shape[1:])
        expand = shape[0] != B

        def batched(t: torch.Tensor) -> torch.Tensor:
            return t.expand(B, *t.shape[1:]) if t.dim() and t.shape[0] == 1 else t
    else:  # the output has no batch dimension: it is shared whole by every datum
        per = g.sum_to_size((B,) + (1,) * (extra - 1) + shape).reshape(B, *shape)
        expand = True

        def batched(t: torch.Tensor) -> torch.Tensor:
            return t.unsqueeze(0).expand(B, *t.shape)
    if chain:
        if extra == 0:  # the consumer's input has a leading dimension of size 1
            per = per.unsqueeze(1)  # (B, *shape)
        per = through_views(chain, per.reshape(B, *shape))  # (B, *out_shape)
        if call.geometry is not None and tuple(per.shape[1:]) != tuple(call.out_shape):
            size, stride, offset = call.geometry  # (from its base, rebuilt by an in-place op)
            n = per[0].numel()
            per = per.contiguous().as_strided((B, *size), (n, *stride), offset)
        expand = True

        def batched(t: torch.Tensor) -> torch.Tensor:
            return t.unsqueeze(0).expand(B, *t.shape)
    args, kwargs = call.args, call.kwargs
    if expand:
        parts, rebuild = flatten((call.args, call.kwargs))
        args, kwargs = rebuild([batched(t) if isinstance(t, torch.Tensor) else t
                                for t in parts])
    return per, args, kwargs, expand


def batch_first(
    bd: int, B: int, args: tuple[Any, ...], kwargs: dict[str, Any],
    grads: list[torch.Tensor | None],
) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor | None]]:
    """Move batch dimension ``bd`` first in the tensors that have it (sequence-first calls)."""

    def first(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > bd and t.shape[bd] == B:
            return t.movedim(bd, 0)
        return t

    parts, rebuild = flatten((args, kwargs))
    new_args, new_kwargs = rebuild([first(t) for t in parts])
    return new_args, new_kwargs, [first(g) for g in grads]
