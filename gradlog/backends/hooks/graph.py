"""Walks of the autograd graph for the hooks backend.

Every question the hooks backend asks of the autograd graph lives here: which nodes consume a
captured output (for outputs broadcast over the batch) and which recorded parameters each op
used (:class:`GraphSurvey`, one walk before each backward), whether the graph holds a reentrant
checkpoint or Python autograd Functions (for the datum check), which outputs of a call feed
each other (``nn.LSTMCell``), and where to hook a layer's output that is a view.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils.rnn import PackedSequence

from gradlog._torch_private import view_base
from gradlog._torch_private.nodes import (
    autograd_node_forward_class,
    autograd_node_output_dims,
    autograd_node_output_shape,
    autograd_node_repeats,
    autograd_node_saved_alpha,
    autograd_node_saved_condition,
    autograd_node_shapes_known,
)
from gradlog._tree import flatten
from gradlog.backends.base import graph_nodes, is_reentrant_checkpoint
from gradlog.backends.hooks import reorder
from gradlog.backends.hooks.calls import BASE, OUTPUT, TAG
from gradlog.errors import BackendError

if TYPE_CHECKING:
    from gradlog.backends.hooks.calls import Call

__all__ = [
    "PASS_THROUGH",
    "SHARED_ALONG",
    "TAG",
    "UNSAVED_ALONG",
    "VIEW_NODES",
    "GraphSurvey",
    "alias_outputs",
    "batch_repeat",
    "consumer_gradient",
    "consumers_through_views",
    "foreign_functions",
    "hook_target",
    "row_wise",
    "through_views",
]

_ROW_WISE = frozenset({
    "NativeLayerNormBackward0", "NativeDropoutBackward0", "ToCopyBackward0", "CloneBackward0",
    "GeluBackward0", "ReluBackward0", "SiluBackward0", "TanhBackward0", "SigmoidBackward0",
    "ThresholdBackward0", "LeakyReluBackward0", "EluBackward0", "HardtanhBackward0",
    "NegBackward0", "AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0",
    "AddBackward1", "SubBackward1", "MulBackward1", "DivBackward1",  # (with a scalar)
    "PowBackward0", "RsqrtBackward0", "SqrtBackward0",  # (an RMSNorm written out by hand)
    "ClampBackward0", "ClampBackward1", "ClampMinBackward0", "ClampMaxBackward0",
    "ExpBackward0", "SoftplusBackward0", "MishBackward0", "HardswishBackward0",
})
_LAST_DIM_REDUCTIONS = frozenset({"MeanBackward1", "SumBackward1"})
_NOT_FIRST_DIM = frozenset({"SplitBackward0", "SplitWithSizesBackward0", "SliceBackward0"})


def row_wise(node: Any) -> bool:
    """Whether the op of autograd ``node`` computes its output row ``r`` from its inputs' row
    ``r`` (and tensors broadcast over the rows) alone: elementwise ops, a LayerNorm, a mean
    or sum over the last dimension only (an RMSNorm written out by hand, Gemma 4's router),
    and chunks or slices along any dimension but the rows' (a SwiGLU's ``chunk(2, -1)``), as
    the flattened-rows walks cross them; a Linear (``addmm``/``mm``) is one through its
    input, not its weight (they handle it)."""
    kind = type(node).__name__
    if kind in _ROW_WISE:
        return True
    if kind not in _LAST_DIM_REDUCTIONS and kind not in _NOT_FIRST_DIM:
        return False
    dims, sizes = getattr(node, "_saved_dim", None), getattr(node, "_saved_self_sym_sizes", None)
    if dims is None or not sizes:
        return False
    signed = [d - 2**64 if d >= 2**63 else d for d in (dims if isinstance(dims, tuple) else [dims])]
    if kind in _NOT_FIRST_DIM:
        return all(d % len(sizes) != 0 for d in signed)
    return bool(signed) and all(d % len(sizes) == len(sizes) - 1 for d in signed)


PASS_THROUGH = ("AddBackward0", "SubBackward0", "ExpandBackward0", "WhereBackward0",
                "RepeatBackward0")
"""Autograd nodes through which a shared output's per-datum gradient is the consumer's, as
:func:`consumer_gradient` takes it (a repeat only over the batch: :func:`batch_repeat`)."""
VIEW_NODES = frozenset({
    "PermuteBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "SqueezeBackward3", "ViewBackward0", "UnsafeViewBackward0",
    "TransposeBackward0", "TransposeBackward1", "TBackward0", "ReshapeAliasBackward0",
    "CloneBackward0", "AliasBackward0",
})
"""Autograd nodes of shape-only ops (one input, one output) that a shared output may pass
through before the op that broadcasts it over the batch (T5's relative attention bias:
``bias(T, T, H).permute(2, 0, 1).unsqueeze(0)`` then added to ``(B, H, T, T)`` scores)."""


def alias_outputs(output: Any, inputs: list[tuple[torch.Tensor, int]]) -> Any:
    """A module whose outputs feed each other (``nn.LSTMCell``: ``h = o * tanh(c)``): the
    gradient autograd gives output ``c`` includes the path through ``h``, which the
    ``torch.func`` fallback counts again from ``h``'s gradient. The outputs another output
    was computed from are handed to the caller as aliases (``view_as``), whose hooks get
    only the gradient from outside the module. None when no output feeds another (the usual
    case: outputs stay as they are, and an in-place op on them keeps their hooks)."""
    flat, rebuild = flatten(output)
    outs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if len(outs) < 2:
        return None
    fed = _outputs_feeding_others(outs, inputs)
    if not fed:
        return None
    return rebuild([t.view_as(t) if any(t is f for f in fed) else t for t in flat])


def _outputs_feeding_others(outs: list[torch.Tensor],
                            inputs: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """The outputs whose autograd edge another output's history reaches inside the call
    (the walk stops at the call's inputs and at leaves)."""
    # (node wrappers held while their ids are keys: torch 2.4 frees one no one holds, and
    # its id goes to the next)
    held = [t.grad_fn for t in outs] + [x.grad_fn for x, _ in inputs]
    edges = {(id(t.grad_fn), t.output_nr): t for t in outs if t.grad_fn is not None}
    stop = {id(x.grad_fn) for x, _ in inputs if x.grad_fn is not None}
    fed: list[torch.Tensor] = []
    for t in outs:
        if t.grad_fn is None:
            continue
        stack, seen, keep = [t.grad_fn], {id(t.grad_fn)}, [t.grad_fn]
        while stack:
            node = stack.pop()
            for child, nr in node.next_functions:
                if child is None:
                    continue
                hit = edges.get((id(child), nr))
                if hit is not None and hit is not t and not any(hit is f for f in fed):
                    fed.append(hit)
                if id(child) not in seen and id(child) not in stop:
                    seen.add(id(child))
                    keep.append(child)
                    stack.append(child)
    del held
    return fed


def foreign_functions(root: Any) -> bool | None:
    """For the datum check: None when the graph holds a ``torch.utils.checkpoint(
    use_reentrant=True)`` segment (its backward refuses ``autograd.grad``); else whether it
    holds a Python autograd Function other than gradlog's own (whose backward might use up
    state on a first backward or draw random numbers)."""
    foreign = False
    for node in graph_nodes(root):
        if is_reentrant_checkpoint(node):
            return None
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            owner = getattr(autograd_node_forward_class(node), "__module__", "")
            # (torch's own, e.g. torch.compile's compiled regions, are trusted as gradlog's;
            # not torch.distributed's, whose backward talks to the other ranks)
            foreign = foreign or not owner.startswith(("gradlog.", "torch.")) or (
                owner.startswith("torch.distributed"))
    return foreign


def hook_target(t: torch.Tensor, inputs: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Where to hook output ``t`` of a layer with a built-in rule: ``t``, or, when ``t`` is a
    view of a whole tensor the call made (a Linear on ``(B, T, d)`` views its 2-D matmul's
    result; ``MultiheadAttention(batch_first=True)`` transposes its projection's), that
    tensor. An in-place op on the view (``ReLU(inplace=True)`` after the layer) rebuilds the
    view's autograd history and drops a hook on ``t``; the base keeps its own, which receives
    the gradient of the output as the layer returned it. (The built-in layers use that
    tensor only through the view, so its gradient is the output's.)"""
    base = view_base(t)
    if (base is None or base.grad_fn is None or base.numel() != t.numel()
            or not base.is_contiguous()):
        return t
    if any(base is x or base is view_base(x) for x, _ in inputs):  # a view of an input
        return t
    return base


class GraphSurvey:
    """What the hooks backend reads from a backward's graph before running it, from one walk
    from ``root`` (the batch loss's ``grad_fn``) shared by its readers: the consumers of
    captured outputs (:meth:`consumers`, for outputs broadcast over the batch) and each
    recorded parameter's uses (:meth:`uses`, for op-level watching). A walk visits every
    node; at GPT-2 small's depth each one cost ~2-3 ms of host time a step, so the two
    readers' separate walks were one too many. The walk is made at the first question;
    a question about other accumulators than the walk counted walks again."""

    def __init__(self, root: Any, hooks: str = "none") -> None:
        self.root = root
        self.hooks = hooks  # the forward's saved-tensor hooks (datum_check.HOOK_KINDS)
        self.views_only = hooks != "none"  # see UNSAVED_ALONG
        self._parents: dict[int, list[tuple[Any, int]]] | None = None
        self._held: list[Any] = []
        self._walked = False
        self._accumulators: Mapping[int, str] | None = None
        self._edges: dict[str, int] = {}
        self._calls: dict[int, int] = {}
        self._consumers: dict[int, list[tuple[Any, int]]] = {}
        self._moving: list[Any] = []  # nodes of ops that may move rows (reordered)
        self._takers: dict[int, list[str]] = {}  # and the kinds of node taking their output
        self._outputs: list[tuple[Any, Call]] = []  # (node, call) of captured outputs
        self._leaves: list[torch.Tensor] = []  # the tensors its AccumulateGrad nodes feed
        self._reached: set[int] = set()  # ids of the calls whose outputs it holds (TAG)

    def consumers(self, wanted: set[int]) -> dict[int, list[tuple[Any, int]]]:
        """For each wanted call (by id), the (node, input slot) pairs that consume its tagged
        output."""
        if not self._walked:
            self._walk(self._accumulators or {})
        return {k: v for k, v in self._consumers.items() if k in wanted}

    def parents(self, node: Any) -> list[tuple[Any, int]]:
        """The (node, input slot) pairs taking ``node``'s output in this graph: the ops
        after it in the forward. A walk of its own, made at the first question (only for
        what the usual walk does not answer: rare layouts, see ``rows.flattened_rows``)."""
        if self._parents is None:
            self._parents, self._held = {}, []
            for parent in graph_nodes(self.root):
                self._held.append(parent)  # (wrappers alive while their ids are keys)
                for slot, (child, _) in enumerate(parent.next_functions):
                    if child is not None:
                        self._parents.setdefault(id(child), []).append((parent, slot))
        return self._parents.get(id(node), [])

    def reordered(self, B: int) -> bool:
        """Whether an op of the graph took rows of a dimension of size B out of the batch's
        order (:func:`.reorder.reordered`): only a datum check sees what that does."""
        if not self._walked:
            self._walk(self._accumulators or {})
        if self.hooks == "selective":  # (a saved index read uses up its cache: not read)
            return B > 1 and any(reorder.carries(n) and not _inside_a_call(n, self._outputs)
                                 and (not autograd_node_shapes_known(n)
                                      or B in autograd_node_output_shape(n))
                                 for n in self._moving)
        packed = [t for _, call in self._outputs for a in (call.args or ())
                  if isinstance(a, PackedSequence)
                  for t in (a.sorted_indices, a.unsorted_indices) if t is not None]
        return reorder.reordered(((n, self._takers[id(n)]) for n in self._moving), B,
                                 functools.partial(_inside_a_call, outputs=self._outputs),
                                 packed)

    def in_this_graph(self, calls: Sequence[Call]) -> list[Call]:
        """``calls`` less those certainly of another graph: noted in an output's node
        (:data:`TAG`) that is still alive, and not reached by this walk from the root (which
        reaches every node the backward runs). A forward kept without its backward leaves
        such calls live; counted as this backward's, they made every module look called
        twice, and the datum check ran at every step (:class:`.datum_check.DatumLayouts`)."""
        if not self._walked:
            self._walk(self._accumulators or {})
        return [c for c in calls
                if id(c) in self._reached or c.tagged is None or c.tagged() is None]

    def leaves(self) -> list[torch.Tensor]:
        """The leaf tensors whose ``.grad`` the backward of this graph accumulates into."""
        if not self._walked:
            self._walk(self._accumulators or {})
        return self._leaves

    def widest(self) -> int:
        """The most dimensions of any tensor the graph's nodes made (shapes known: torch >=
        2.6); a walk of its own, for a forward some of whose calls went unseen."""
        return max(map(autograd_node_output_dims, graph_nodes(self.root)), default=0)

    def uses(self, accumulators: Mapping[int, str]) -> tuple[dict[str, int], dict[int, int]]:
        """For each parameter (its gradient accumulator's id -> its name,
        :func:`~gradlog._torch_private.gradient_accumulator`; the caller keeps the nodes
        alive), the edges into its accumulator (one per op that took it, or a view of it,
        in the forward); for each module entry (by id), its calls whose outputs are in the
        graph (:data:`TAG`)."""
        if not self._walked or self._accumulators is not accumulators:
            self._walk(accumulators)
        return self._edges, self._calls

    def _walk(self, accumulators: Mapping[int, str]) -> None:
        edges: dict[str, int] = {}
        calls: dict[int, set[int]] = {}
        consumers: dict[int, list[tuple[Any, int]]] = {}
        tags: dict[int, list[tuple[int, Call]]] = {}
        bases: dict[int, list[tuple[int, Call]]] = {}  # (Call.mark_base)
        root = self.root
        self._moving, self._takers, self._outputs, self._leaves = [], {}, [], []
        # keep: node wrappers alive, so their ids stay unique
        stack, keep = ([root], [root]) if root is not None else ([], [])
        seen = {id(root)}
        while stack:
            node = stack.pop()
            for slot, (child, output_nr) in enumerate(node.next_functions):
                if child is None:
                    continue
                key = id(child)
                name = accumulators.get(key)
                if name is not None:
                    edges[name] = edges.get(name, 0) + 1
                if key not in seen:
                    seen.add(key)
                    keep.append(child)
                    stack.append(child)
                    kind = type(child).__name__
                    if kind in reorder.MOVING:
                        self._moving.append(child)
                    elif kind == "AccumulateGrad":
                        self._leaves.append(child.variable)
                    metadata = child.metadata
                    outputs = metadata.get(OUTPUT)
                    if outputs:  # (most nodes have none: no list made for them)
                        self._outputs += [(child, c) for _, c in outputs]
                    if metadata.get(BASE):
                        bases[key] = metadata[BASE]
                    tagged = metadata.get(TAG)
                    if tagged:
                        tags[key] = tagged
                        for _, call in tagged:
                            calls.setdefault(id(call.entry), set()).add(id(call))
                if key in self._takers or type(child).__name__ in reorder.MOVING:
                    self._takers.setdefault(key, []).append(type(node).__name__)
                for nr, call in tags.get(key, ()):
                    if nr == output_nr:
                        consumers.setdefault(id(call), []).append((node, slot))
                for nr, call in bases.get(key, ()):  # an in-place op on the output (a view)
                    if nr == output_nr and type(node).__name__ == "CopySlices":
                        consumers.setdefault(id(call), []).append((node, slot))
        self._walked, self._accumulators = True, accumulators
        self._edges = edges
        self._calls = {e: len(c) for e, c in calls.items()}
        self._reached = set().union(*calls.values())
        self._consumers = consumers


def _inside_a_call(node: Any, outputs: Sequence[tuple[Any, Call]]) -> bool:
    """Whether ``node`` is in the forward of a captured call of a layer without layers of
    its own (its rule sees all of it): below an output's node and above its inputs' (a
    walk per call, only for a node that moved rows)."""
    for out, call in outputs:
        if call.args is None or (not call.entry.op and any(
                True for m in call.entry.module.children() for _ in m.parameters())):
            continue  # (rows moved between a container's layers are theirs to misfile)
        held = [t.grad_fn for t in flatten((call.args, call.kwargs))[0]  # (held: torch 2.4
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]  # reuses node ids)
        stops = {id(n) for n in held}
        stack, seen = [out], {id(out)}
        while stack and len(seen) < 100_000:
            top = stack.pop()
            if top is node:
                return True
            for child, _ in top.next_functions:
                if child is not None and id(child) not in seen and id(child) not in stops:
                    seen.add(id(child))
                    held.append(child)
                    stack.append(child)
    return False



def consumer_gradient(node: Any, slot: int, at: tuple[int, ...], B: int,
                      sequence_first: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """How the gradient at a pass-through node's output gives its input ``slot``'s (of shape
    ``at``), the batch kept: times 1, alpha or -alpha; ``torch.where(condition, x, y)``'s
    kept where the output is that input (T5's relative position bias put into SDPA's mask);
    a repeat over the batch's, each datum's copy, ``(B, *at)`` (:func:`batch_repeat`). In a
    model with sequence-first layers, a broadcast over dimension 1
    (:func:`sequence_first_broadcast`) gives ``(B, *at)`` too, the batch moved first."""
    taken = _consumer_gradient(node, slot, at, B)
    if sequence_first and sequence_first_broadcast(node, at, B):
        return lambda g: taken(g).movedim(1, 0).unsqueeze(2)  # (T, B, ..) -> (B, T, 1, ..)
    return taken


def sequence_first_broadcast(node: Any, at: tuple[int, ...], B: int) -> bool:
    """Whether pass-through ``node`` broadcasts a tensor of shape ``at``, ``(T, 1, ...)``,
    over dimension 1 alone to size B, its other dimensions kept: over the batch of a
    sequence-first ``(T, B, d)`` (a position table added to the tokens' embeddings)."""
    if type(node).__name__ not in ("AddBackward0", "SubBackward0", "ExpandBackward0") or (
            not autograd_node_shapes_known(node)):  # (torch before 2.6: refused as before)
        return False
    wide = tuple(autograd_node_output_shape(node))
    return (B > 1 and len(at) == len(wide) >= 2 and at[1] == 1 and wide[1] == B
            and at[0] == wide[0] and tuple(at[2:]) == wide[2:])


def _consumer_gradient(node: Any, slot: int, at: tuple[int, ...], B: int
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    kind = type(node).__name__
    if kind == "WhereBackward0":
        cond = autograd_node_saved_condition(node)
        if cond is None:
            raise BackendError("torch.where's condition is not readable from its autograd "
                               "node in this torch version; use backend='loop'.")
        keep = cond if slot == 0 else ~cond
        return lambda g: torch.where(keep, g, g.new_zeros(()))
    if kind == "RepeatBackward0":
        repeats = autograd_node_repeats(node) or ()
        padded = (1,) * (len(repeats) - len(at)) + tuple(at)
        split = [n for pair in zip(repeats, padded, strict=True) for n in pair]
        copies = tuple(range(2, 2 * len(repeats), 2))  # (r1, r2, ...): a datum's own copies

        def unrepeat(g: torch.Tensor) -> torch.Tensor:  # (r0 s0, r1 s1, ...) -> (B, *at)
            g = g.reshape(split)
            return (g.sum(copies) if copies else g).reshape(B, *at)

        return unrepeat
    alpha = autograd_node_saved_alpha(node)
    factor = -alpha if kind == "SubBackward0" and slot == 1 else (
        alpha if kind == "AddBackward0" and slot == 1 else 1.0)
    return (lambda g: g) if factor == 1.0 else (lambda g: g * factor)


def batch_repeat(node: Any, at: tuple[int, ...], B: int) -> int | None:
    """For a ``repeat`` that copies a shared tensor of shape ``at`` B times along dimension
    0 (``pos.repeat(B, 1, 1)``; DeBERTa's ``(H, 2k, d).repeat(B, 1, 1)`` to ``(B H, 2k,
    d)``): the rows of that dimension each copy has, datum ``b``'s copy the ``b``-th; None
    for another node or repeat."""
    if type(node).__name__ != "RepeatBackward0":
        return None
    repeats = autograd_node_repeats(node)
    if not repeats or len(repeats) < len(at) or repeats[0] != B:
        return None
    return at[0] if len(repeats) == len(at) else 1


Chain = tuple[Any, ...]  # view nodes from a call's output (first) to its consumer (last)


SHARED_ALONG = VIEW_NODES | {
    "SliceBackward0", "SelectBackward0", "NativeDropoutBackward0", "ToCopyBackward0",
    "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0",
    "AddBackward0", "SubBackward0", "SigmoidBackward0", "TanhBackward0", "ReluBackward0",
    "GeluBackward0", "SiluBackward0", "ExpBackward0", "SoftplusBackward0",
    "CopySlices", "AsStridedBackward0",  # an in-place op on a view of it (DeBERTa's `/=`)
}
"""Nodes a shared output may cross before what broadcasts it over the batch, when one of
their inputs alone carries a gradient and they make no more elements than it has (a LoRA
adapter's ``lora_B(...) * scaling`` added to its frozen base layer's output, then repeated
over the batch: DeBERTa's relative positions): each datum's gradient at the broadcast is
taken back through them, exactly (:func:`through_views`)."""


UNSAVED_ALONG = VIEW_NODES | {
    "AsStridedBackward0", "SliceBackward0", "SelectBackward0", "ToCopyBackward0",
    "NegBackward0",
}
""":data:`SHARED_ALONG`'s nodes whose backward reads no saved tensor (shape ops; a product
or quotient by a Python number saves it as a tensor): what a shared output's routing crosses
under saved-tensor hooks (``GraphSurvey.views_only``: a non-reentrant checkpoint's saved
tensors are read once, and a second reading, per datum, made the backward itself fail)."""


def consumers_through_views(graph: GraphSurvey, found: list[tuple[Any, int]],
                            along: frozenset[str] = VIEW_NODES
                            ) -> list[tuple[Any, int, Chain]] | None:
    """The consumers of a call's output past any chain of view nodes (:data:`VIEW_NODES`;
    ``along``: also :data:`SHARED_ALONG`'s, one input carrying a gradient, no broadcast):
    each (node, input slot, the nodes between, first to last). ``found`` are the direct
    consumers (:meth:`GraphSurvey.consumers`). None when a node's output has no consumer in
    the graph (it cannot be followed). Reads the survey's map of each node's consumers
    (:meth:`GraphSurvey.parents`: one walk of the whole graph a backward, shared by every
    call asking; each call walked it once, 16 walks a step of a small Swin)."""
    out: list[tuple[Any, int, Chain]] = []
    stack: list[tuple[Any, int, Chain]] = [(node, slot, ()) for node, slot in found]
    while stack:
        node, slot, chain = stack.pop()
        kind = type(node).__name__
        if kind not in along or (kind not in VIEW_NODES and not _keeps(node, slot)):
            out.append((node, slot, chain))
            continue
        up = graph.parents(node)
        if not up or len(chain) > 64:
            return None
        stack.extend((parent, s, (*chain, node)) for parent, s in up)
    return out


def _keeps(node: Any, slot: int) -> bool:
    """Whether ``node`` takes a gradient at input ``slot`` alone and makes no more elements
    than that input has (no broadcast: the batch cannot come in there)."""
    edges = node.next_functions
    if sum(child is not None for child, _ in edges) != 1 or edges[slot][0] is None:
        return False
    child, nr = edges[slot]
    return math.prod(autograd_node_output_shape(node)) <= math.prod(
        autograd_node_output_shape(child, nr))


def through_views(chain: Chain, per: torch.Tensor) -> torch.Tensor:
    """Per-datum gradients ``(B, *shape)`` at the end of a chain of view nodes, as gradients
    of its start: each node's own backward, per datum (``vmap`` over the batch)."""
    from torch.func import vmap

    def back(g: torch.Tensor) -> torch.Tensor:
        for node in reversed(chain):
            got = node(g)  # (one input carrying a gradient: the chain's)
            g = next(t for t in got if t is not None) if isinstance(got, tuple) else got
        return g

    try:
        return vmap(back)(per)
    except RuntimeError as e:  # (a checkpoint's saved tensors unpack once: CheckpointError)
        raise BackendError(
            f"the per-datum gradients of a shared output could not be taken back through "
            f"{[type(n).__name__ for n in chain]} ({type(e).__name__}: {e}). Inside "
            "torch.utils.checkpoint(use_reentrant=False) an op's saved tensors can be read "
            "once: move the ops on the shared output out of the checkpointed segment, or use "
            "backend='loop'.") from e
