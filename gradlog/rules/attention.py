"""``nn.MultiheadAttention``: from the batch's own backward through its projections, or
re-run per datum by :mod:`gradlog.rules.func` where that cannot be.

Every parameter of the layer is used only by its ``F.linear`` projections (the
in-projections of query, key and value, the out-projection of the attention's output rows;
``out_proj``'s own hooks never fire: the forward reads its weight directly). Their inputs
and outputs are noted during each forward with grad (:func:`track_projections`, through
:func:`gradlog._torch_private.functional_linear_noted`: ``F.multi_head_attention_forward``
takes a torch-function mode's dispatch whole). Datum b's gradient of a projection's weight
is ``sum_t G[t, b]^T X[t, b]`` (of its bias ``sum_t G[t, b]``), with ``X`` its input and
``G`` its output's gradient, both ``(tokens, B, d)`` inside the attention (the output rows
are time-major ``(T*B, E)``). The out-projection's ``G`` is the layer's output gradient; the
in-projections' come from one ``autograd.grad`` from the out-projection's input back to
their outputs, through the attention and, in training, the dropout masks the batch drew
(its graph, retained for the ordinary backward). Attention mixes no datums, so column b of
those is datum b's. This is the only way in training with attention dropout
(``nn.TransformerEncoderLayer``'s default 0.1), drawn inside
``F.scaled_dot_product_attention`` where no re-run can draw it again; elsewhere it also
costs less than the re-run (an encoder of two layers in eval: 1.8x a plain step against
2.3x, ``tests/benchmarks/bench_attention.py``).

Re-run per datum instead (``torch.func``; refused in training with attention dropout):
``add_bias_kv`` (its biases are concatenated, not projected), attention weights
(``need_weights=True``) in the loss, a forward without grad to note (a reentrant
checkpoint's), a compiled forward. (A subclass with a forward of its own gets no rule: the
``torch.func`` fallback.) Query, key and value then split along the batch dimension (0 with
``batch_first``, else 1), the key padding mask along 0, a 3-D attention mask
``(B * heads, L, S)`` by groups of ``heads`` rows; a 2-D mask is shared.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from gradlog._torch_private import functional_linear_noted, in_autograd_backward
from gradlog.errors import UnsupportedLayerError
from gradlog.rules.base import Capture, RuleResult, register_rule, widen
from gradlog.rules.func import LeafSpec, func_grads
from gradlog.rules.randomness import draw_free, undraw_free

__all__ = ["multihead_attention", "track_projections"]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _covers(module: nn.Module) -> dict[str, nn.Parameter]:
    own = dict(module.named_parameters(recurse=False))
    out_proj = cast(nn.Module, module.out_proj)
    own.update({f"out_proj.{k}": p for k, p in out_proj.named_parameters()})
    return own


def _batch_dim(module: nn.Module) -> int:
    return 0 if module.batch_first else 1


def _refuse(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    query = args[0] if args else kwargs.get("query")
    if isinstance(query, torch.Tensor) and query.dim() != 3:
        return ("a call on unbatched (2-D) inputs is not supported yet; add a batch dimension "
                "or use backend='loop'.")
    if module.training and float(getattr(module, "dropout", 0.0)) > 0 and (
            getattr(module, "bias_k", None) is not None):
        return ("in training with attention dropout gradlog takes its per-datum gradients "
                "from its projections, and add_bias_kv's biases are used otherwise. Set its "
                "dropout to 0 or put it in eval mode, or use backend='loop'.")
    return None


class _Unusable(Exception):
    """Why a call's per-datum gradients cannot be taken from its projections."""


@dataclass(eq=False)
class _Projection:
    """One ``F.linear`` call of the layer's forward on its parameters."""

    x: torch.Tensor  # its input, (tokens, B, d_in) or time-major rows (tokens*B, d_in)
    out: torch.Tensor | None  # its output (the out-projection's let go: it holds the frame)
    weight: str  # the parameter its weight is (a block of rows of it), and the first row
    row: int
    bias: str | None
    bias_at: int
    shape: tuple[int, ...] = ()  # the output's
    dtype: torch.dtype = torch.float32


@dataclass
class _Frame:
    """What one call of the layer noted (:func:`_noter`)."""

    inputs: list[weakref.ref[torch.Tensor]]
    projections: list[_Projection] = field(default_factory=list)
    failed: str = ""  # why its per-datum gradients cannot be taken from it
    # (out-projection output gradient, each projection's output gradient or None) of the
    # last backward through it, where the layer is computed after the backward (_stash)
    stash: tuple[torch.Tensor, tuple[torch.Tensor | None, ...]] | None = None

    def alive(self) -> bool:
        return all(r() is not None for r in self.inputs)


# The frames of calls whose backward has not come, by layer and query/key/value ids, held
# by their own graph alone (the output's autograd node's metadata, :data:`_HELD`): a forward
# whose graph is dropped without a backward takes its frame with it, and never keeps the
# graph alive (the frame's tensors lead only down the graph, never back to that node).
_FRAMES: weakref.WeakKeyDictionary[
    nn.Module, weakref.WeakValueDictionary[tuple[int, ...], _Frame]] = weakref.WeakKeyDictionary()
_HELD = "gradlog_projections"


def _qkv(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
         ) -> list[torch.Tensor]:
    """The call's query, key and value (the backend may have expanded its shared masks)."""
    bound = _SIGNATURE.bind(module, *args, **kwargs).arguments
    return [t for t in (bound.get("query"), bound.get("key"), bound.get("value"))
            if isinstance(t, torch.Tensor)]


def _key(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(id(t) for t in tensors)


def _place(t: torch.Tensor | None, params: dict[str, nn.Parameter]) -> tuple[str, int] | None:
    """The parameter ``t`` is a block of whole rows of (its attribute path, first row)."""
    if t is None:
        return None
    for name, p in params.items():
        if (p.dim() != t.dim() or tuple(p.shape[1:]) != tuple(t.shape[1:])
                or t.stride() != p.stride() or t.device != p.device
                or t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()):
            continue
        offset = t.storage_offset() - p.storage_offset()
        step = p.stride(0) if p.dim() else 1
        if offset >= 0 and offset % step == 0 and offset // step + t.shape[0] <= p.shape[0]:
            return name, offset // step
    return None


def _noter(params: dict[str, nn.Parameter], frame: _Frame) -> Any:
    """Notes each ``F.linear`` on the layer's parameters (:class:`_Projection`) in one
    forward; one on other than whole rows of them fails the frame."""

    def note(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor) -> None:
        w, b = _place(weight, params), _place(bias, params)
        if w is None and b is None:
            return  # (another layer's)
        if w is None or (bias is not None and b is None):
            frame.failed = "an F.linear on other weights than whole rows of its own"
            return
        frame.projections.append(_Projection(
            x, out, w[0], w[1], None if b is None else b[0], 0 if b is None else b[1],
            tuple(out.shape), out.dtype))

    return note


def track_projections(module: nn.Module) -> list[Any]:
    """Note the projections of ``module``'s forwards with grad (see the module doc); one
    with ``add_bias_kv`` is re-run as before.

    Returns:
        Handles to remove to stop.
    """
    if type(module).forward is not nn.MultiheadAttention.forward:
        return []
    params = _covers(module)
    bodies: list[Any] = []
    noting: list[_Frame] = []

    def enter(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if (not torch.is_grad_enabled() or getattr(mod, "bias_k", None) is not None
                or torch.compiler.is_compiling()  # (add_bias_kv: re-run, or refused)
                or in_autograd_backward()):  # (a checkpoint's recompute: the call's own frame
            return  # stays, its saved tensors recomputed with the same masks)
        frames = _FRAMES.setdefault(mod, weakref.WeakValueDictionary())
        tensors = _qkv(mod, args, kwargs)
        frame = _Frame([weakref.ref(t) for t in tensors])
        key = _key(tensors)
        other = frames.get(key)
        if other is not None and other.alive():  # twice on the same inputs before a
            other.failed = frame.failed = (  # backward: which backward is whose?
                "it was called twice on the same inputs before their backward")
        frames[key] = frame
        bodies.append(functional_linear_noted(_noter(params, frame)))
        noting.append(frame)
        bodies[-1].__enter__()

    def leave(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if bodies:
            bodies.pop().__exit__(None, None, None)
            frame = noting.pop()
            weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if isinstance(weights, torch.Tensor) and weights.requires_grad:
                _stash(mod, frame)
            # held by the out-projection's autograd node (module doc, _FRAMES), which an
            # in-place op on the layer's output (a view of it) keeps in the graph
            outs = [p for p in frame.projections if p.weight == "out_proj.weight"]
            first = out[0] if isinstance(out, tuple) else out
            node = getattr(outs[0].out if len(outs) == 1 else first, "grad_fn", None)
            if node is not None:  # (else no graph: the frame goes)
                node.metadata[_HELD] = frame
            for p in outs:
                p.out = None  # (it holds that node: no cycle through the frame)

    draw_free(module)
    return [module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(leave, with_kwargs=True, always_call=True),
            _Undo(module)]


class _Undo:
    """A handle that takes the layer off :func:`.randomness.draw_free`'s list."""

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)

    def remove(self) -> None:
        module = self.module()
        if module is not None:
            undraw_free(module)
            _FRAMES.pop(module, None)


def _frame_of(module: nn.Module, cap: Capture) -> _Frame | None:
    """The frame of the captured call, removed from the store; None when none was noted."""
    frames = _FRAMES.get(module)
    if not frames:
        return None
    tensors = _qkv(module, tuple(cap.args), dict(cap.kwargs))
    frame = frames.pop(_key(tensors), None)
    if frame is not None and (len(frame.inputs) != len(tensors) or any(
            r() is not t for r, t in zip(frame.inputs, tensors))):
        return None  # (another call's, whose inputs' ids were reused)
    return frame


def _inner_grads(module: nn.Module, out: _Projection, ins: list[_Projection],
                 rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The in-projections' output gradients for the out-projection's output gradient
    ``rows``: from the out-projection's input (its output's hooks are the backend's, not to
    run again) through the attention and its dropout as the batch drew them."""
    weight = cast(torch.Tensor, cast(nn.Module, module.out_proj).weight)
    into = rows.mm(weight.to(rows.dtype))  # (T*B, E): the out-projection's input gradient
    outputs = [p.out for p in ins if p.out is not None]  # (an in-projection's are kept)
    return torch.autograd.grad(out.x, outputs, into.view(out.x.shape), retain_graph=True,
                               allow_unused=True)


def _stash(module: nn.Module, frame: _Frame) -> None:
    """With ``need_weights`` the layer has a second output, and the backend computes it only
    once the backward ended, its graph freed: the in-projections' gradients are then taken
    while the backward passes its out-projection, and kept with the gradient they came from
    (the rule takes them only for the same one)."""
    outs = [p for p in frame.projections if p.weight == "out_proj.weight"]
    ins = [p for p in frame.projections
           if p.weight != "out_proj.weight" and p.out is not None and p.out.requires_grad]
    if len(outs) != 1 or not ins or outs[0].out is None or not outs[0].out.requires_grad:
        return
    out = outs[0]
    ref = weakref.ref(frame)

    def keep(grad: torch.Tensor) -> None:  # (never raises into the user's backward)
        held = ref()
        if held is None or held.failed:
            return
        try:
            found = dict(zip(map(id, ins), _inner_grads(module, out, ins, grad.detach())))
        except RuntimeError:
            held.stash = None
            return
        held.stash = (grad.detach(), tuple(found.get(id(p)) for p in held.projections))

    outs[0].out.register_hook(keep)


def _zeros(p: _Projection) -> torch.Tensor:
    return p.x.new_zeros(p.shape, dtype=p.dtype)


def _by_projections(module: nn.MultiheadAttention, frame: _Frame, cap: Capture,
                    wanted: frozenset[str]) -> RuleResult:
    """Per-datum gradients from the frame's projections (see the module doc)."""
    B = cap.batch_size
    params = {k: p for k, p in _covers(module).items() if k in wanted}
    g = cap.grads[0] if cap.grads else None
    outs = [p for p in frame.projections if p.weight == "out_proj.weight"]
    ins = [p for p in frame.projections if p.weight != "out_proj.weight"]
    if not frame.failed and len(cap.grads) > 1 and cap.grads[1] is not None:
        frame.failed = ("its attention weights (need_weights=True) are part of the loss, "
                        "and the projections are taken from its output alone")
    if not frame.failed and (len(outs) != 1 or not ins or g is None):
        frame.failed = (f"its forward made {len(outs)} out-projections and {len(ins)} "
                        "in-projections, or its output got no gradient")
    if frame.failed:
        raise _Unusable(frame.failed)
    assert g is not None
    out = outs[0]
    ins = [p for p in ins if p.weight in params or p.bias in params]  # (the recorded ones)
    rows = (g.transpose(0, 1) if module.batch_first else g).reshape(out.shape)  # (T*B, E)
    rows = rows.to(out.dtype)
    if not ins:  # (no in-projection recorded: nothing to take back through the attention)
        found: tuple[torch.Tensor | None, ...] = ()
    elif frame.stash is not None and torch.allclose(  # this backward's (NaN: a datum whose
            frame.stash[0], rows, rtol=0.0, atol=0.0, equal_nan=True):  # keys are all masked)
        at = {id(q): i for i, q in enumerate(frame.projections)}
        found = tuple(frame.stash[1][at[id(p)]] for p in ins)
    else:
        try:
            found = _inner_grads(module, out, ins, rows)
        except RuntimeError as e:  # (its graph freed: the rule ran after the backward)
            raise _Unusable("the batch's graph through it was freed before the layer was "
                            f"computed (torch: {str(e).splitlines()[0][:120]})") from e
    grads = [(out, rows), *((p, _zeros(p) if f is None else f)
                            for p, f in zip(ins, found, strict=True))]
    result: RuleResult = {}
    covered: dict[str, int] = {}
    for proj, grad in grads:
        weight = params.get(proj.weight)
        dtype = weight.dtype if weight is not None else None
        x, gr = widen(proj.x, dtype), widen(grad, dtype)
        if x.dim() == 2:  # time-major rows (T*B, d): row t*B + b is datum b's
            x, gr = x.reshape(-1, B, x.shape[-1]), gr.reshape(-1, B, gr.shape[-1])
        if x.dim() != 3 or x.shape[1] != B or gr.shape[:2] != x.shape[:2]:
            raise _Unusable(f"a projection ran on shape {tuple(proj.x.shape)}, not (tokens, "
                            f"B={B}, d)")
        d_out = gr.shape[-1]
        if weight is not None:
            per = result.setdefault(proj.weight, weight.new_zeros((B, *weight.shape)))
            per[:, proj.row : proj.row + d_out].add_(torch.einsum("tbo,tbi->boi", gr, x))
            covered[proj.weight] = covered.get(proj.weight, 0) + d_out
        if proj.bias is not None and proj.bias in params:
            bias = params[proj.bias]
            per = result.setdefault(proj.bias, bias.new_zeros((B, *bias.shape)))
            per[:, proj.bias_at : proj.bias_at + d_out].add_(gr.sum(0).to(bias.dtype))
            covered[proj.bias] = covered.get(proj.bias, 0) + d_out
    missing = sorted(k for k, p in params.items() if covered.get(k) != p.shape[0])
    if missing:
        raise _Unusable(f"its forward used {missing} otherwise than by whole projections")
    return {k: v.mul_(cap.scale) if cap.scale != 1 else v for k, v in result.items()}


@register_rule(
    nn.MultiheadAttention,
    name="multihead_attention",
    covers=_covers,
    batch_dim=_batch_dim,
    uses_torch_func=True,
    refuse=_refuse,
    views_own_result=True,  # batch_first: a transpose of out_proj's result
    track=track_projections,
)
def multihead_attention(
    module: nn.MultiheadAttention, cap: Capture, wanted: frozenset[str]
) -> RuleResult:
    """Per-datum gradients from the batch's own backward through the projections, or by
    ``torch.func`` over the captured call where they cannot be (module doc)."""
    reason = _refuse(module, cap.args, cap.kwargs)
    if reason is not None:
        raise UnsupportedLayerError(reason)
    frame = _frame_of(module, cap)
    why = ("no projections of this call were noted (its forward ran without grad, as in a "
           "reentrant checkpoint, or compiled)")
    if frame is not None:
        try:
            return _by_projections(module, frame, cap, wanted)
        except _Unusable as e:
            why = str(e)
    if module.training and module.dropout > 0:  # (a re-run cannot draw its masks again)
        raise UnsupportedLayerError(
            "in training with attention dropout gradlog takes its per-datum gradients from "
            f"its projections, and could not here: {why}. Set its dropout to 0 or put it in "
            "eval mode, or use backend='loop'.")
    bound = _SIGNATURE.bind(module, *cap.args, **cap.kwargs)
    arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
    B, bd = cap.batch_size, _batch_dim(module)
    specs: dict[str, LeafSpec] = {"query": LeafSpec(bd), "key": LeafSpec(bd), "value": LeafSpec(bd)}
    if arguments.get("key_padding_mask") is not None:
        specs["key_padding_mask"] = LeafSpec(0)  # (B, S)
    mask = arguments.get("attn_mask")
    if mask is not None and mask.dim() == 3:  # (B * heads, L, S): datum b owns `heads` rows
        arguments["attn_mask"] = mask.reshape(B, module.num_heads, *mask.shape[1:])
        specs["attn_mask"] = LeafSpec(0, unsqueeze=False)  # per datum (heads, L, S)
    params = {k: p for k, p in _covers(module).items() if k in wanted}
    names = list(arguments)  # (as the call passed them: its pre-hooks see the same args)
    at = min(len(cap.args), 3)
    out: RuleResult = dict(func_grads(
        module, params, cap, args=tuple(arguments[k] for k in names[:at]),
        kwargs={k: arguments[k] for k in names[at:]},
        in_specs=[specs.get(k) for k in arguments],
        out_dims=[bd, 0],  # attn_output; attn_weights are (B, ..., L, S) either way
    ))
    return out
