"""Per-datum gradients of one module by ``torch.func``, from its captured call.

For layers without a closed-form rule: the module is re-run on each datum of its captured
inputs (``vmap`` over the batch, each datum a batch of one) with its parameters passed
functionally, and ``grad`` of ``sum_i <output_i, G_i,b>`` gives datum b's vector-Jacobian
product, i.e. its parameter gradient. Only this module re-runs, never the whole model. If
``vmap`` cannot batch the module (an op without a batching rule, data-dependent control
flow), the module falls back, once and for good, to one small ``autograd.grad`` per datum.

A re-run draws no masks of its own: the masks the batch's forward drew in the module's
``nn.Dropout`` submodules are noted then (:mod:`gradlog.rules.randomness`) and applied, each
datum its own rows; modules with other random draws are refused (:func:`active_randomness`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import grad, vmap

from gradlog._torch_private import tensor_version
from gradlog._tree import flatten
from gradlog.errors import BackendError, GradlogError
from gradlog.rules.base import Capture, Rule, RuleResult, forward_call, widen
from gradlog.rules.randomness import masks_of, replay, unreplayed

__all__ = ["GENERIC", "LeafSpec", "active_randomness", "flatten", "func_grads", "generic"]

log = logging.getLogger("gradlog")

# Modules whose vmap failed once: they use the per-datum loop from then on.
_LOOPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass(frozen=True)
class LeafSpec:
    """How one tensor argument is split by datum.

    Attributes:
        dim: Its batch dimension; ``None``: shared by every datum (passed whole).
        unsqueeze: Re-insert a batch dimension of size 1 at ``dim`` in the per-datum call
            (False when the per-datum slice already has the layout the module expects).
    """

    dim: int | None
    unsqueeze: bool = True


def active_randomness(module: nn.Module) -> list[str]:
    """Names of submodules (``""``: the module itself) that draw dropout masks in this mode
    which a re-run cannot reproduce (the masks of dropouts :mod:`.randomness` tracks are
    replayed, so they are not listed)."""
    return unreplayed(module)


def infer_specs(leaves: Sequence[Any], batch_size: int,
                unsqueeze: bool = True) -> list[LeafSpec | None]:
    """Generic split: a tensor whose first dimension is B is batched at 0; others are shared.
    ``unsqueeze=False``: each datum's slice is passed as it is (``Capture.flattened``)."""
    return [
        LeafSpec(0, unsqueeze)
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch_size
        else None
        for t in leaves
    ]


def func_grads(
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    cap: Capture,
    *,
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    in_specs: Sequence[LeafSpec | None] | None = None,
    out_dims: Sequence[int | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-datum gradients of ``params`` of ``module`` by re-running it per datum.

    Args:
        module: The module; its other parameters and buffers are used as constants.
        params: Attribute path -> parameter to differentiate.
        cap: The captured call (its ``grads`` align with the flattened output).
        args: Arguments to call with, if not ``cap.args`` (e.g. with a default filled in).
        kwargs: Keyword arguments to call with, if not ``cap.kwargs``.
        in_specs: One entry per leaf of ``flatten((args, kwargs))``: how it splits by datum;
            default: :func:`infer_specs`.
        out_dims: Batch dimension of each output leaf; default 0.

    Returns:
        Attribute path -> ``(B, *shape)`` per-datum gradients (scaled by ``cap.scale``).
    """
    B = cap.batch_size
    call_args = cap.args if args is None else args
    call_kwargs = cap.kwargs if kwargs is None else kwargs
    leaves, rebuild = flatten((tuple(call_args), dict(call_kwargs)))
    # Under autocast the captured inputs and output gradients may be bfloat16/float16 while
    # the parameters are float32; the re-run is without autocast, in the parameters' dtype,
    # so the per-datum products accumulate in float32 (and mixed-dtype matmuls cannot fail).
    wide = _widest(params.values())
    differentiable = {i for i, t in enumerate(leaves)
                      if isinstance(t, torch.Tensor) and t.requires_grad}
    leaves = [widen(t.detach(), wide) if isinstance(t, torch.Tensor) else t for t in leaves]
    specs = (list(in_specs) if in_specs is not None
             else infer_specs(leaves, B, unsqueeze=not cap.flattened))
    if len(specs) != len(leaves):
        raise BackendError(f"in_specs has {len(specs)} entries for {len(leaves)} argument leaves")
    batched = [(i, s) for i, s in enumerate(specs) if s is not None and s.dim is not None]
    outs: list[tuple[int, int, torch.Tensor]] = []  # (output leaf, batch dim, scaled grad)
    for j, g in enumerate(cap.grads):
        if g is None:
            continue
        d = 0 if out_dims is None else out_dims[j]
        if d is None or g.dim() <= d or g.shape[d] != B:
            raise BackendError(
                f"output {j} of {type(module).__name__} has shape {tuple(g.shape)} with no batch "
                f"dimension of size B={B}: its gradient mixes datums (e.g. a batch-level "
                "statistic or loss term), so per-datum gradients are not defined for it."
            )
        g = widen(g, wide)
        outs.append((j, d, g * cap.scale if cap.scale != 1 else g))
    if not outs:
        return {
            k: torch.zeros((B, *p.shape), dtype=p.dtype, device=p.device) for k, p in params.items()
        }
    # One parameter may be registered under several names (opacus' DPLSTM keeps each cell
    # weight under a top-level alias): functional_call refuses two values for tied names, and
    # replaces every alias of a name it is given, so each tensor is passed once, by the first
    # of its names, and its aliases are left out of the constants.
    # The re-runs get copies of the parameters (O(parameters), against their O(B x the
    # module's compute)): a forward that writes them (``weight.data.mul_``, a clamp under
    # no_grad) is refused, the model's as its forward left them (re-runs on the parameters
    # themselves wrote them again: a decay 3 times a step, a version bump that broke the
    # batch's own backward).
    due = _check_due(module, cap, [s for _, s in batched])
    diff: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    originals: dict[str, torch.Tensor] = {}
    for k, p in params.items():
        if id(p) not in seen:
            seen[id(p)], originals[k] = k, p
            diff[k] = p.detach().clone()
    fixed: dict[str, torch.Tensor] = {}
    for k, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen[id(p)], originals[k] = k, p
            fixed[k] = p.detach().clone()

    # Dropout masks the batch's forward drew in this call (see .randomness): each datum's
    # rows go in as batched inputs after the call's own, and its dropouts apply them.
    masks = masks_of(module, (tuple(cap.args), dict(cap.kwargs))) or []
    for m in masks:
        if m.dim() == 0 or m.shape[0] != B:
            raise BackendError(
                f"a dropout inside {type(module).__name__} drew a mask of shape "
                f"{tuple(m.shape)}, with no batch dimension of size B={B} first, so it cannot "
                "be split by datum. Set that dropout to 0 or use backend='loop'."
            )
    dims: list[int] = [s.dim for _, s in batched if s.dim is not None] + [0] * len(masks)

    kept = _Kept()  # the buffers the re-runs use (see _buffers_kept)

    def call(p: Mapping[str, torch.Tensor], xs: Sequence[torch.Tensor]) -> list[Any]:
        full = list(leaves)
        for (i, spec), x in zip(batched, xs):
            assert spec.dim is not None
            full[i] = x.unsqueeze(spec.dim) if spec.unsqueeze else x
        a, kw = rebuild(full)
        with replay(module, [m.unsqueeze(0) for m in xs[len(batched):]]) if masks else (
                contextlib.nullcontext()):
            state = kept.state(fixed, p)
            out = forward_call(module, state, tuple(a), kw)
            kept.after(state)
        return flatten(out)[0]

    def dot(
        p: Mapping[str, torch.Tensor], xs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        outputs = call(p, xs)
        total = torch.zeros((), dtype=gs[0].dtype, device=gs[0].device)
        for (j, d, _), g in zip(outs, gs):
            total = total + (outputs[j] * g.unsqueeze(d)).sum()  # <out_j, G_j,b>
        return total

    xs = [leaves[i] for i, _ in batched] + [widen(m, wide) for m in masks]
    gs = [g for _, _, g in outs]
    with _buffers_kept(module, kept):
        if module not in _LOOPED:
            try:
                per_datum = vmap(
                    grad(dot),
                    in_dims=(None, dims, [d for _, d, _ in outs]),
                    randomness="error",
                )
                with warnings.catch_warnings():
                    # functorch warns when an op has no batching rule and it loops instead: still
                    # exact, and this module is already the slow path.
                    warnings.filterwarnings("ignore", message="There is a performance drop")
                    result: dict[str, torch.Tensor] = per_datum(diff, xs, gs)
            except RuntimeError as e:
                if isinstance(e, GradlogError):  # (a pre-hook's replay: forward_call)
                    raise
                if "random" in str(e):
                    raise BackendError(
                        f"{type(module).__name__} draws random numbers in its forward; gradlog "
                        "re-runs it per datum and cannot reproduce the batch's random draws "
                        "(nn.Dropout's masks it replays; the dropout inside "
                        "F.scaled_dot_product_attention is drawn in the kernel: with "
                        "transformers, attn_implementation='eager' records). Put it in eval "
                        "mode, register a rule for it, or use backend='loop'."
                    ) from e
                _LOOPED.add(module)
                log.warning(
                    "gradlog: torch.func.vmap cannot batch %s (%s); computing its per-datum "
                    "gradients with one small autograd.grad per datum instead.",
                    type(module).__name__,
                    str(e).splitlines()[0][:200],
                )
        if module in _LOOPED:
            result = _loop(diff, xs, gs, dims, outs, call, B)
        if due:  # (after the gradients: random draws are reported as such)
            def whole(p: Mapping[str, torch.Tensor],
                      xs: Mapping[int, torch.Tensor]) -> list[Any]:  # as its forward ran
                # (copies of the inputs: a forward may write into its input in place)
                a, kw = rebuild([xs[i].clone() if i in xs else t for i, t in enumerate(leaves)])
                with replay(module, [widen(m, wide) for m in masks]) if masks else (
                        contextlib.nullcontext()):
                    state = kept.state(fixed, p)
                    out = flatten(forward_call(module, state, tuple(a), kw))[0]
                    kept.after(state)
                    return out

            floating = [(i, spec.dim, leaves[i]) for i, spec in batched  # (inputs that
                        if spec.dim is not None and i in differentiable]  # carry a gradient)
            _check_weighted(module, whole, diff, result, outs, floating, B)
    _refuse_written(module, {**diff, **fixed}, originals)
    return result


def _refuse_written(module: nn.Module, copies: Mapping[str, torch.Tensor],
                    originals: Mapping[str, torch.Tensor]) -> None:
    """Refuse a module whose re-runs wrote the copies of its parameters they were given (a
    copy's version moved: a clamp that changed nothing on this call would on a later one,
    when the re-run writes the parameter the batch's backward saved; or its values changed:
    a write through ``.data``, which no version counts)."""
    written = sorted(k for k, t in copies.items() if tensor_version(t) or not (
        torch.equal(t, originals[k])  # (NaN entries equal too: a NaN is not a write)
        or torch.allclose(t, originals[k], rtol=0.0, atol=0.0, equal_nan=True)))
    if written:
        raise BackendError(
            f"{type(module).__name__} {_RERUN} "
            f"changes its parameters {written[:6]} when it runs (weight.data.mul_(...), a "
            "clamp under torch.no_grad() in its forward): re-run per datum, it would change "
            "them again and compute with them changed. Its re-runs changed copies: the "
            "model's are as its forward left them. Make that change after optimizer.step(), "
            "or use a parametrization (torch.nn.utils.parametrize), a rule for the module "
            "(gradlog.rules.register_rule) or backend='loop'.")


# Calls of each module re-run so far: the check that its rows are independent runs on the
# 1st, 2nd, 4th, 8th, ... (a forward's structure rarely changes; a few checks catch it).
_CALLS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_RERUN = "(no closed-form rule applies: gradlog re-runs it on each datum alone)"



class _Kept:
    """The module's buffers around its re-runs (:func:`_buffers_kept`): the re-runs get
    ``copies``, and a re-run reassigning one (``self.n = self.n + 1``, which
    ``functional_call`` writes back into the state it was given) is noted in ``moved``."""

    def __init__(self) -> None:
        self.copies: dict[str, torch.Tensor] = {}
        self.moved: set[str] = set()

    def state(self, *parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for part in (parts[0], self.copies, *parts[1:]) for k, v in part.items()}

    def after(self, state: Mapping[str, torch.Tensor]) -> None:
        self.moved.update(n for n, t in self.copies.items() if state.get(n) is not t)


@contextlib.contextmanager
def _buffers_kept(module: nn.Module, kept: _Kept) -> Iterator[None]:
    """The module's re-runs leave its state as its forward left it: they get copies of its
    buffers, and its Python numbers and plain tensor attributes are put back after them (a
    batch size noted, a counter, a statistic kept for logging).
    A module whose re-run changes a buffer's values (in place or reassigning it: a batch
    norm's running statistics in training mode, a counter) is refused: re-run per datum it
    computes with its state moved on from the forward's."""
    kept.copies = {n: b.detach().clone() for n, b in module.named_buffers()}
    scalars = [(m, k, v) for m in module.modules()  # (and tensors kept as plain attributes:
               for k, v in vars(m).items()          # re-runs left functorch's wrappers there)
               if type(v) in (int, float, bool) or isinstance(v, torch.Tensor)]
    try:
        yield
    finally:
        changed = sorted(kept.moved | {n for n, b in module.named_buffers()
                                       if not torch.equal(kept.copies[n], b)})
        kept.copies = {}
        for m, k, v in scalars:
            if vars(m).get(k) is not v:
                vars(m)[k] = v
        if changed:  # (in place of any error the change caused: vmap's, say)
            raise BackendError(
                f"{type(module).__name__} {_RERUN} "
                f"changes its buffers {changed} when it runs (a batch norm's running "
                "statistics in training mode, a counter): re-run per datum, it computes "
                "with its state moved on from the forward's (its re-runs changed copies, "
                "not the model's). Put it in eval mode, register a rule for it, or use "
                "backend='loop'."
            )


def _check_due(module: nn.Module, cap: Capture, specs: Sequence[LeafSpec]) -> bool:
    """Whether this call's re-run per datum is checked against the module on the whole
    batch (not where each datum's rows are passed as they are, or inputs were expanded:
    outputs shared by the batch)."""
    n = _CALLS.get(module, 0)
    _CALLS[module] = n + 1
    return (n & (n + 1) == 0 and cap.batch_size > 1 and not cap.expanded
            and all(s.unsqueeze for s in specs))


def _check_weighted(module: nn.Module,
                    whole: Callable[[Mapping[str, torch.Tensor], Mapping[int, torch.Tensor]],
                                    list[Any]],
                    diff: Mapping[str, torch.Tensor], result: Mapping[str, torch.Tensor],
                    outs: Sequence[tuple[int, int, torch.Tensor]],
                    inputs: Sequence[tuple[int, int, torch.Tensor]], B: int) -> None:
    """Refuse a module whose re-run on each datum alone does not give its datums' gradients
    in the batch. Through the module run on the whole batch, the gradient of
    ``sum_b v_b <out_b, G_b>`` (random ``v``): at its parameters it must be the records
    weighted by ``v`` (each record its own datum's gradient); at its batched inputs, row b
    must be ``v_b`` times that of another draw ``u`` over ``u_b`` (no datum's output depends
    on another's input: the gradients it hands the layers below are each datum's). A module
    mixing the batch's datums (a batch statistic, rows taken across the batch) fails; one
    whose outputs merely differ alone (a fake quantisation scaled by the batch's detached
    maximum, rounding of other kernels under autocast) passes. ``inputs``: (leaf index,
    batch dimension, tensor) of the call's batched floating arguments."""
    v, u = torch.randn(2, B, generator=_V, dtype=torch.float64)  # (B,) each
    ps = {k: t.detach().requires_grad_(True) for k, t in diff.items()}
    xs = {i: x.detach().requires_grad_(True) for i, _, x in inputs}
    with torch.enable_grad():
        out = whole(ps, xs)
        if any(not isinstance(out[j], torch.Tensor) or out[j].shape != g.shape
               for j, _, g in outs):
            return  # (rows the backend laid out by datum, (B*T, d): not weighed here)

        def weighted(w: torch.Tensor) -> torch.Tensor | None:
            terms = [(out[j] * (g * w.to(g.device, g.dtype).view(
                *([1] * d), B, *([1] * (g.dim() - d - 1)))).to(out[j].dtype)).sum()
                for j, d, g in outs]
            total = torch.stack(terms).sum() if terms else None
            return total if total is not None and total.requires_grad else None

        total, other = weighted(v), weighted(u)
        wrt = [*ps.values(), *xs.values()]
        found = (torch.autograd.grad(total, wrt, allow_unused=True, retain_graph=True)
                 if total is not None else (None,) * len(wrt))  # (None: zero gradients)
        again = (torch.autograd.grad(other, list(xs.values()), allow_unused=True)
                 if other is not None and xs else (None,) * len(xs))
    first = next(iter(ps.values()))
    rtol = _WEIGHTED_RTOL_16BIT if _autocast_on(first.device) else _WEIGHTED_RTOL.get(
        first.dtype, _WEIGHTED_RTOL_16BIT)
    ours, theirs, scales = [], [], []
    for (k, _), got in zip(ps.items(), found):  # the records weighted by v
        per = result[k].to(torch.float64).reshape(B, -1)  # (B, n)
        vb = v.to(per.device)[:, None]  # (B, 1)
        ours.append((vb * per).sum(0))
        scales.append((vb.abs() * per.abs()).sum(0))
        theirs.append(torch.zeros_like(ours[-1]) if got is None
                      else got.detach().to(torch.float64).reshape(-1))
    where = "its parameters' records"
    if not _close(torch.cat(ours), torch.cat(theirs), torch.cat(scales), rtol):
        _mixes(module, where)
    pairs = [(t.detach().to(torch.float64).movedim(d, 0).reshape(B, -1) for t in (gv, gu))
             for (_, d, _), gv, gu in zip(inputs, found[len(ps):], again)
             if gv is not None and gu is not None]
    vb, ub = v[:, None], u[:, None]
    sides = [(ub.to(gv.device) * gv, vb.to(gv.device) * gu) for gv, gu in pairs]
    # each input alone (one input's gradients may be far smaller than another's), above the
    # rounding noise of the largest (keys that are all one token: their gradient is 0 in
    # exact arithmetic, the noise of the values' in floating point)
    noise = 64 * torch.finfo(first.dtype).eps * max(
        (float(a.abs().amax()) for a, _ in sides if a.numel()), default=0.0)
    for ours_in, theirs_in in sides:
        if not _close(ours_in.reshape(-1), theirs_in.reshape(-1), ours_in.abs().reshape(-1),
                      rtol, noise):
            _mixes(module, "the gradients it hands the layers below")


def _close(ours: torch.Tensor, theirs: torch.Tensor, scale: torch.Tensor, rtol: float,
           noise: float = 0.0) -> bool:
    """Entry by entry, to ``rtol`` of the entry's scale and of the largest one (gradients
    that are rounding noise of the others: a key bias under softmax), and above ``noise``;
    entries where either side is not finite compare only as non-finite on both."""
    scale = scale + theirs.abs()
    finite = ours.isfinite() & theirs.isfinite()
    floor = max(noise, rtol * float(torch.where(finite, scale, 0).amax()) if scale.numel()
                else 0.0)
    near = (ours - theirs).abs() <= rtol * scale + floor
    return bool(torch.where(finite, near, ours.isfinite() == theirs.isfinite()).all())


def _mixes(module: nn.Module, where: str) -> None:
    raise BackendError(
        f"{type(module).__name__} {_RERUN} mixes "
        f"the batch's datums: re-run on each datum alone, {where} are not what the batch's "
        "run gives each datum (its records weighted by random v_b, against the gradient of "
        "sum_b v_b <output_b, G_b> through it run on the whole batch). A batch statistic, "
        "rows taken across the batch, a loss over the batch; or an argument shared by the "
        "batch split as each datum's (gradlog splits every tensor argument whose first "
        "dimension equals the batch size). Register a rule for it, keep the mixing out of "
        "the model's forward, or use backend='loop'."
    )


_V = torch.Generator().manual_seed(0)  # the weights v_b, u_b of _check_weighted
# Loose: a module mixing datums moves the weighted sums by their own size, while batched and
# per-datum kernels round differently, and modules compute parts in narrower dtypes than
# their parameters (transformers' float32 softmax in a float64 model, a bf16 matmul inside).
_WEIGHTED_RTOL = {torch.float64: 1e-6, torch.float32: 1e-2}
_WEIGHTED_RTOL_16BIT = 5e-2  # (16-bit parameters, or a re-run under autocast)


def _autocast_on(device: torch.device) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device.type))
    except TypeError:  # (torch without the device argument)
        return bool(torch.is_autocast_enabled())


def _widest(params: Any) -> torch.dtype | None:
    """The widest floating dtype among ``params`` (None if none is floating)."""
    dtypes = [p.dtype for p in params if p.is_floating_point()]
    return max(dtypes, key=lambda d: torch.finfo(d).bits, default=None)


def _loop(
    diff: dict[str, torch.Tensor],
    xs: list[torch.Tensor],
    gs: list[torch.Tensor],
    dims: list[int],
    outs: list[tuple[int, int, torch.Tensor]],
    call: Callable[[Mapping[str, torch.Tensor], Sequence[torch.Tensor]], list[Any]],
    B: int,
) -> dict[str, torch.Tensor]:
    """One ``autograd.grad`` per datum over a re-run of the module alone."""
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in diff}
    for b in range(B):
        xb = [x.select(d, b) for x, d in zip(xs, dims)]
        ps = {k: v.detach().requires_grad_(True) for k, v in diff.items()}
        with torch.enable_grad():
            outputs = call(ps, xb)
            terms = [
                (outputs[j] * g.select(d, b).unsqueeze(d)).sum() for (j, d, _), g in zip(outs, gs)
            ]
            total = torch.stack(terms).sum()  # <out_j, G_j,b> summed over outputs
            # (no parameter reached: an unused one, a model's own left out of its forward)
            found = (torch.autograd.grad(total, list(ps.values()), allow_unused=True)
                     if total.requires_grad else (None,) * len(ps))
        for (k, p), gk in zip(ps.items(), found):
            rows[k].append(torch.zeros_like(p) if gk is None else gk)
    return {k: torch.stack(v) for k, v in rows.items()}


def generic(module: nn.Module, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """Fallback for any module without a rule: tensors whose first dimension is B are split
    by datum, the rest shared; every output leaf with a gradient must have B rows."""
    params = dict(module.named_parameters(remove_duplicate=False))
    out: RuleResult = dict(func_grads(module, {k: params[k] for k in wanted}, cap))
    return out


GENERIC = Rule(name="torch.func", compute=generic, uses_torch_func=True)
"""The fallback rule for modules without a registered one (never in ``RULES``)."""
