"""Rules for single operations that take a recorded parameter outside its module's forward.

The hooks backend's op-level capture (:mod:`gradlog.backends.hooks.operations`) sees every
torch operation that takes a recorded parameter, or a view of one (``W.T``), during the
recorded forward, outside the calls of the modules whose hooks already cover that parameter:
a language-model head tied by hand (``h @ self.wte.weight.T``, ``F.linear(h, emb.weight)``),
PEFT's LoRA embedding (``F.embedding(x, lora_A.T) @ lora_B.T``), a bias repeated over a
sequence-first batch (``bias.repeat(1, B, 1)``). Each such call becomes a call of an **op
rule** (:func:`op_rule`): closed forms for ``linear``, ``matmul`` and ``embedding``, and
for every other op a per-op ``torch.func`` vector-Jacobian product per datum
(:func:`_per_op_vjp`), never a re-run of a whole module.

A rule first computes per-datum gradients with respect to the argument as the op received it
(the view), then maps them back to the parameter through the views that made the argument
(:meth:`ParamUse.to_param`: a transpose by hand, any other chain of views by ``vjp``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vjp, vmap

from gradlog._torch_private import cuda_devices, linear_ops, rng_states
from gradlog._tree import flatten
from gradlog.errors import BackendError
from gradlog.grads import Rows
from gradlog.rules.base import Capture, Rule, RuleResult, one_feature_dim, widen
from gradlog.rules.func import LeafSpec, func_grads
from gradlog.rules.linear import _affine

__all__ = [
    "GENERIC_BATCH_DIM",
    "LINEAR_OPS",
    "MATMUL_OPS",
    "ParamUse",
    "Step",
    "op_kind",
    "op_rule",
]

Step = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
"""One view op applied to the tracked tensor: ``func(x, *args, **kwargs)``."""

LINEAR_OPS: frozenset[Any] = linear_ops()
MATMUL_OPS: frozenset[Any] = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                                        torch.mm, torch.Tensor.mm})
EMBEDDING_OPS: frozenset[Any] = frozenset({F.embedding})
_TENSOR: Any = torch.Tensor  # (its T/mT properties' getters are what __torch_function__ sees)
_TRANSPOSES: frozenset[Any] = frozenset({torch.Tensor.t, torch.t, _TENSOR.T.__get__,
                                         _TENSOR.mT.__get__})


@dataclass(frozen=True, eq=False)
class ParamUse:
    """A recorded parameter as an op received it: the parameter, and the view ops (in
    order) that made the argument from it.

    Attributes:
        name: The recorded parameter's name.
        param: The parameter.
        steps: View ops applied to it, first to last (empty: the parameter itself).
        kept: Made from a view kept on a module from before the forward, which no rule of
            a module follows: its uses are ops of their own, inside a module's call too.
        forward: The forward it was made in (op capture's count): one kept from an earlier
            forward is as ``kept``.
    """

    name: str
    param: nn.Parameter
    steps: tuple[Step, ...] = ()
    key: str = field(default="", compare=False)
    kept: bool = field(default=False, compare=False)
    forward: int = field(default=0, compare=False)

    def value(self, p: torch.Tensor | None = None) -> torch.Tensor:
        """The argument made from ``p`` (default: the parameter, detached)."""
        x = self.param.detach() if p is None else p
        for func, args, kwargs in self.steps:
            x = func(x, *args, **kwargs)
        return x

    def _transposed(self) -> bool:
        """A 2-D parameter transposed once (``W.T``, ``W.t()``, ``W.transpose(0, 1)``)."""
        if self.param.dim() != 2 or len(self.steps) != 1:
            return False
        func, args, kwargs = self.steps[0]
        if func in _TRANSPOSES and not args and not kwargs:
            return True
        return func in (torch.Tensor.transpose, torch.transpose) and sorted(
            int(a) % 2 for a in args) == [0, 1] and not kwargs

    def to_param(self, per: torch.Tensor) -> torch.Tensor:
        """Per-datum gradients of the argument ``(B, *arg.shape)`` as gradients of the
        parameter ``(B, *param.shape)`` (the adjoint of the views, per datum)."""
        if not self.steps:
            return per
        if self._transposed():
            return per.transpose(1, 2)  # (B, *param.shape), a view: the backend copies it
        back = vjp(self.value, self.param.detach())[1]
        got: torch.Tensor = vmap(lambda g: back(g)[0])(per.to(self.param.dtype))
        return got  # (B, *param.shape)


def op_kind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            tracked: Container[int]) -> tuple[str, dict[str, int]]:
    """Which rule computes a call of ``func``, and the attribute name of each tracked slot.

    ``slots`` maps attribute names to indices into ``flatten((args, kwargs))[0]``. Closed
    forms: ``"linear"`` (``F.linear(x, W, b)``, attributes ``weight``/``bias``),
    ``"matmul"`` (``x @ P`` with P 2-D, attribute ``other``), ``"embedding"``
    (``F.embedding(idx, W)``, attribute ``weight``); else ``"vjp"`` (attributes ``arg<k>``).
    ``tracked`` holds the ids of the tensors that are (views of) recorded parameters.
    """
    leaves, _ = flatten((args, kwargs))
    slots = {f"arg{k}": k for k, t in enumerate(leaves) if id(t) in tracked}
    positional = len(flatten(args)[0])
    input_free = 0 not in slots.values()  # the op's first argument is data

    def slot_of(pos: int, key: str) -> int | None:
        if pos < len(args) and pos < positional:
            return pos
        names = list(kwargs)
        return positional + names.index(key) if key in kwargs else None

    flat_args = all(not isinstance(a, (tuple, list, dict)) for a in args) and all(
        not isinstance(v, (tuple, list, dict)) for v in kwargs.values())
    if flat_args and input_free:
        if func in LINEAR_OPS:
            w, b = slot_of(1, "weight"), slot_of(2, "bias")
            named = {"weight": w, "bias": b}
            if set(slots.values()) <= {w, b}:
                return "linear", {a: k for a, k in named.items() if k is not None
                                  and k in slots.values()}
        if func in MATMUL_OPS and len(leaves) == 2 and list(slots.values()) == [1]:
            x, other = leaves
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and other.dim() == 2:
                return "matmul", {"other": 1}
        if func in EMBEDDING_OPS and list(slots.values()) == [slot_of(1, "weight")]:
            max_norm = args[3] if len(args) > 3 else kwargs.get("max_norm")
            if max_norm is None:
                return "embedding", {"weight": next(iter(slots.values()))}
    return "vjp", slots


def op_rule(func: Any, kind: str, uses: dict[str, tuple[int, ParamUse]], label: str) -> Rule:
    """The rule for calls of ``func`` whose tracked slots are ``uses`` (attribute ->
    (leaf index, :class:`ParamUse`)), of the given ``kind`` (see :func:`op_kind`)."""

    def compute(module: nn.Module, cap: Capture, wanted: frozenset[str]) -> RuleResult:
        leaves, _ = flatten((cap.args, cap.kwargs))
        views = {a: use.value() for a, (_, use) in uses.items()}  # arguments as the op saw them
        per: dict[str, Any]
        if kind == "linear":
            w = views.get("weight")
            if w is not None and w.dim() != 2:
                per = _per_op_vjp(func, leaves, cap, uses, wanted)
            else:
                d_out = w.shape[0] if w is not None else views["bias"].shape[0]
                d_in = w.shape[1] if w is not None else cap.input.shape[-1]
                dtype = next(iter(views.values())).dtype
                per = _affine(cap, wanted, d_in, d_out, dtype, f"{label} ({func.__name__})",
                              transposed=False)
        elif kind == "matmul":
            d_in, d_out = views["other"].shape  # y = x @ P: P's gradient is A_b^T G_b
            per = {"other": _affine(cap, frozenset({"weight"}), d_in, d_out,
                                    views["other"].dtype, f"{label} ({func.__name__})",
                                    transposed=True)["weight"]}
        elif kind == "embedding":
            per = {"weight": _embedding_rows(cap, views["weight"], leaves)}
        else:
            per = _per_op_vjp(func, leaves, cap, uses, wanted)
        out: RuleResult = {}
        for attr, value in per.items():
            use = uses[attr][1]
            if isinstance(value, Rows) and use.steps:
                value = value.dense()  # (B, *view shape)
            out[attr] = value if isinstance(value, Rows) else use.to_param(value)
        return out

    return Rule(name=f"op:{kind}", compute=compute, feature_dims=one_feature_dim,
                covers=lambda module: {})


def _embedding_rows(cap: Capture, weight: torch.Tensor, leaves: list[Any]) -> Rows:
    """``F.embedding(idx, W, padding_idx, ..., scale_grad_by_freq)``: rows ``idx_{b,n}`` of
    datum b get ``g_{b,n}`` (as :func:`gradlog.rules.embedding.embedding`)."""
    B = cap.batch_size
    idx, g = leaves[0], cap.grad_output  # (B, *S) int, (B, *S, D)
    V, D = weight.shape
    if not isinstance(idx, torch.Tensor) or idx.dim() == 0 or idx.shape[0] != B or tuple(
            g.shape) != (*idx.shape, D):
        raise BackendError(
            f"embedding indices {tuple(getattr(idx, 'shape', ()))} with output gradient "
            f"{tuple(g.shape)}: expected (B={B}, ...) and (B, ..., {D})."
        )
    padding_idx = leaves[2] if len(leaves) > 2 else None
    freq = bool(leaves[5]) if len(leaves) > 5 else False
    index = idx.reshape(B, -1).long()  # (B, N) (int32 ids too: torch takes both)
    values = g.reshape(B, -1, D).to(weight.dtype)  # (B, N, D)
    if isinstance(padding_idx, int):
        pad = index == (padding_idx % V)  # (B, N)
        values = values.masked_fill(pad.unsqueeze(-1), 0.0)  # (B, N, D)
    if freq:
        used = idx[0] if cap.expanded else idx
        counts = torch.bincount(used.reshape(-1), minlength=V)  # (V,)
        values = values / counts[index].unsqueeze(-1).to(values.dtype)  # (B, N, D)
    return Rows(index, values, V, cap.scale)


def _per_op_vjp(func: Any, leaves: list[Any], cap: Capture,
                uses: dict[str, tuple[int, ParamUse]], wanted: frozenset[str]
                ) -> dict[str, torch.Tensor]:
    """Per-datum gradients of the tracked arguments of one op by ``torch.func``: the op is
    re-run on each datum's slice of its batched arguments (batch first, kept as a dimension
    of size 1), and ``vjp`` with that datum's output gradient gives the datum's gradient.

    An op none of whose other arguments has the batch (``bias.repeat(1, B, 1)``) is
    differentiated at its own inputs, once per datum, with the output gradient kept at that
    datum's slice (the output's batch dimension is first here) and zero elsewhere. An output
    shared by the batch (``cap.expanded``) gets each datum's gradient from its consumer."""
    B = cap.batch_size
    attrs = [a for a in uses if a in wanted]
    if not attrs:
        return {}
    slots = [uses[a][0] for a in attrs]
    params = [uses[a][1] for a in attrs]
    wide = max((u.param.dtype for u in params if u.param.is_floating_point()),
               key=lambda d: torch.finfo(d).bits, default=None)
    fixed = [widen(t.detach(), wide) if isinstance(t, torch.Tensor) else t for t in leaves]
    for k in {uses[a][0] for a in uses} - set(slots):  # tracked but not wanted: constants
        fixed[k] = next(u.value() for u2, (k2, u) in uses.items() if k2 == k)
    _, rebuild = flatten((cap.args, cap.kwargs))
    tracked = {uses[a][0] for a in uses}
    batched = [k for k, t in enumerate(fixed) if k not in tracked and isinstance(t, torch.Tensor)
               and t.dim() > 0 and t.shape[0] == B and not cap.expanded]
    bd = cap.batch_dim  # where the op has its batch (the backend moved it first here)
    grads = [g for g in cap.grads if g is not None]
    if len(grads) != 1:
        raise BackendError(f"an op with {len(grads)} differentiated outputs is not supported "
                           "by the per-op fallback.")
    g = widen(grads[0], wide)
    g = g * cap.scale if cap.scale != 1 else g  # (B, ...)
    views = [u.value() for u in params]

    def run(vs: tuple[torch.Tensor, ...], xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        full = list(fixed)
        for k, v in zip(slots, vs):
            full[k] = v
        for k, x in zip(batched, xs):
            full[k] = x.unsqueeze(bd)  # a batch of one, where the op has its batch
        a, kw = rebuild(full)
        out = func(*a, **kw)
        if not isinstance(out, torch.Tensor):
            raise BackendError(f"{getattr(func, '__name__', func)} returned "
                               f"{type(out).__name__}; the per-op fallback needs one tensor.")
        return out

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop")
        if batched:
            def datum(xs: tuple[torch.Tensor, ...], gb: torch.Tensor) -> tuple[torch.Tensor, ...]:
                back = vjp(lambda *vs: run(vs, xs), *views)[1]
                return tuple(back(gb.unsqueeze(bd)))

            xs = tuple(fixed[k] for k in batched)
            try:
                got = vmap(datum, randomness="error")(xs, g)
            except RuntimeError:  # no batching rule (a custom autograd Function): per datum
                rows = [datum(tuple(x[b] for x in xs), g[b]) for b in range(B)]
                got = tuple(torch.stack(r) for r in zip(*rows))
        else:
            before = rng_states(cuda_devices(views))
            pair = vjp(lambda *vs: run(vs, ()), *views)
            out, back = pair[0], pair[1]
            if any(not torch.equal(v, rng_states(cuda_devices(views))[k])
                   for k, v in before.items()):
                raise BackendError(
                    f"{getattr(func, '__name__', func)} draws random numbers on a "
                    "parameter (an alpha dropout: a dropout's mask gradlog replays): gradlog "
                    "differentiates it again per datum and cannot reproduce the forward's "
                    "draw. Apply it after a layer, not to the parameter itself, put the model "
                    "in eval mode, or use backend='loop'.")
            if cap.expanded:  # a shared output: each datum's gradient from its consumer
                per = g.reshape(B, *out.shape)  # (B, *out)
            else:  # the output has the batch at bd (g: moved first by the backend)
                if out.dim() <= bd or out.shape[bd] != B:
                    raise BackendError(
                        f"{getattr(func, '__name__', func)} on a parameter alone gave shape "
                        f"{tuple(out.shape)}, with no dimension of size B={B} for the batch.")
                per = torch.zeros((B, *g.shape), dtype=g.dtype, device=g.device)  # (B, B, ..)
                ar = torch.arange(B, device=g.device)
                per[ar, ar] = g  # datum b's gradient at its own slice, zero elsewhere
                per = per.movedim(1, bd + 1)  # (B, *out.shape)
            got = tuple(torch.stack(r) for r in zip(*(back(per[b]) for b in range(B))))
    return dict(zip(attrs, got))


def _generic_batch_dim(module: nn.Module, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """The per-module ``torch.func`` fallback for a call whose batch is not its first
    dimension (a ``(T, B, D)`` sequence-first tensor): every tensor with size B at
    ``cap.batch_dim`` is split there, the rest shared."""
    B, bd = cap.batch_size, cap.batch_dim
    params = dict(module.named_parameters(remove_duplicate=False))
    leaves, _ = flatten((cap.args, cap.kwargs))
    specs = [LeafSpec(bd) if isinstance(t, torch.Tensor) and t.dim() > bd and t.shape[bd] == B
             else None for t in leaves]
    dims = [bd if g is not None and g.dim() > bd and g.shape[bd] == B else 0 for g in cap.grads]
    return dict(func_grads(module, {k: params[k] for k in wanted}, cap, in_specs=specs,
                           out_dims=dims))


GENERIC_BATCH_DIM = Rule(name="torch.func", compute=_generic_batch_dim, uses_torch_func=True)
""":data:`gradlog.rules.GENERIC` for calls with the batch at ``cap.batch_dim`` > 0."""
