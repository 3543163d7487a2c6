"""Mixtures of experts: transformers' experts modules (``@use_experts_implementation``:
Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, DeepSeek and the other families that share it).

Such a module holds every expert's weights as one 3-D parameter and takes the batch's tokens
flattened to rows ``x`` (N, d), each row's K chosen experts ``e`` and routing weights ``w``:
row n's output is ``sum_k w_nk down_e(gate(up_e(x_n)))``. Datum b's gradient of expert e's
weights sums over b's (row, choice) pairs routed to e: ``g_u^T x`` for the up projection and
``g_y^T z`` for the down one, with ``g_y = w g_out``, ``z = gate(u)``, ``u = up_e(x)``,
``g_z = g_y W_down_e`` and ``g_u`` the gate's vector-Jacobian product (autograd on the
module's own gate). The projections are recomputed one matmul per expert; each datum's pairs
are then padded per expert, so a datum's gradients of every expert are one batched matmul,
written in place. The ``torch.func`` fallback re-ran the experts once per datum instead
(the routing of the eager and ``batched_mm`` implementations defeats ``vmap``).

The formula is the interface's (its ``batched_mm`` and ``grouped_mm`` implementations); a
class's own eager forward could compute something else, so the first call of each module and
implementation is replayed against the formula, and a module whose output differs keeps the
fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from gradlog.rules.base import Capture, RuleResult, one_feature_dim, own_params, register_rule
from gradlog.rules.func import generic
from gradlog.rules.replay import replays

__all__ = ["experts", "is_transformers_experts"]

_INTERFACE = ("transformers", "integrations", "moe.py")  # where the dispatching forward lives


def _up(module: nn.Module) -> str:
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def is_transformers_experts(module: nn.Module) -> bool:
    """A class decorated with transformers' ``use_experts_implementation`` whose parameters
    are the interface's 3-D expert weights (and biases) alone: no post-expert norm, not
    split over ranks (expert parallelism routes to sentinel experts)."""
    code = getattr(type(module).forward, "__code__", None)
    if code is None or Path(code.co_filename).parts[-3:] != _INTERFACE:
        return False
    if getattr(module, "has_post_expert_norm", True) or getattr(
            module, "_is_expert_parallel", True):
        return False
    if any(True for child in module.children() for _ in child.parameters()):
        return False
    up = _up(module)
    names = {up, "down_proj"} | ({f"{up}_bias", "down_proj_bias"}
                                 if getattr(module, "has_bias", False) else set())
    params = own_params(module)
    if set(params) != names or not (getattr(module, "has_gate", True) or hasattr(
            module, "act_fn")):
        return False
    E = params["down_proj"].shape[0] if params["down_proj"].dim() == 3 else -1
    return all(params[n].dim() == 3 and params[n].shape[0] == E for n in (up, "down_proj"))


def _routing(tensors: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The call's (hidden states, expert indices, routing weights) from its tensor
    arguments, or None."""
    if len(tensors) != 3:
        return None
    x, index, weights = tensors
    if (not x.is_floating_point() or index.is_floating_point() or not
            weights.is_floating_point() or index.shape != weights.shape
            or index.shape[:-1] != x.shape[:-1]):
        return None
    return x, index, weights


def _gate(module: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """The module's own activation: its ``_apply_gate`` (SwiGLU, GPT-OSS's clamped one) or,
    without a gate, ``act_fn``."""
    gate: Callable[[torch.Tensor], torch.Tensor] = getattr(
        module, "_apply_gate" if getattr(module, "has_gate", True) else "act_fn")
    return gate(u)


class _Pairs:
    """A call's (row, choice) pairs, grouped by expert for the projections it recomputes
    (each expert's rows one matmul with its weights) and by datum for the per-datum
    gradients (each datum's pairs padded per expert: one batched matmul over experts that
    writes the datum's ``(E, ...)`` gradient in place)."""

    def __init__(self, index: torch.Tensor, B: int, E: int) -> None:
        N, K = index.shape
        S = N * K
        device = index.device
        expert = index.reshape(-1)  # (S,) by pair
        pair = torch.arange(S, device=device)
        datum = pair // (S // B)  # (rows are datum-major: S // B pairs a datum)
        clamped = expert.clamp(0, E - 1)
        key = clamped * B + datum
        by_expert = torch.argsort(key, stable=True)  # pairs, expert-major
        counts = torch.bincount(key, minlength=E * B)  # (E*B,)
        place = torch.empty_like(by_expert)
        place[by_expert] = pair  # pair -> its row in the expert-major arrays
        position = place - (counts.cumsum(0) - counts)[key]  # within its (expert, datum)
        self.row = by_expert // K  # (S,) the token row of each expert-major pair
        self.order = by_expert
        self.rows_of_datum = place  # pairs are datum-major already: datum b's S // B
        self.expert, self.position = clamped, position
        outside = ((expert < 0) | (expert >= E)).any().reshape(1)
        host = torch.cat([counts, outside.to(counts.dtype)]).tolist()  # (one sync)
        self.outside = bool(host[-1])
        counts_ = [host[e * B:(e + 1) * B] for e in range(E)]  # per expert, per datum
        ends = [sum(c) for c in counts_]
        starts = [0]
        for n in ends[:-1]:
            starts.append(starts[-1] + n)
        self.slices = [slice(s, s + n) for s, n in zip(starts, ends)]  # per expert
        self.most = [max((c[b] for c in counts_), default=0) for b in range(B)]  # per datum
        self.per, self.E = S // B, E

    def of_datum(self, b: int, *ts: torch.Tensor) -> list[torch.Tensor]:
        """Datum ``b``'s pairs of each expert-major tensor ``(S, f)`` laid out ``(E, C, f)``,
        zero rows after each expert's (C: the most pairs b sends to one expert)."""
        sl, C = slice(b * self.per, (b + 1) * self.per), self.most[b]
        rows = self.rows_of_datum[sl]
        at = self.expert[sl] * C + self.position[sl]
        out = []
        for t in ts:
            full = t.new_zeros((self.E * C, t.shape[1]))
            out.append(full.index_copy_(0, at, t[rows]).view(self.E, C, t.shape[1]))
        return out


@register_rule(name="experts", accepts=is_transformers_experts, feature_dims=one_feature_dim)
def experts(module: nn.Module, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """Per-datum gradients of every expert's weights (the module's doc says how)."""
    tensors = [t for t in (*cap.args, *cap.kwargs.values()) if isinstance(t, torch.Tensor)]
    # (the batch's flattened tokens, laid out (B, T, ...) by datum; the interface takes rows)
    laid_out = bool(tensors) and tensors[0].dim() > 2

    def re_run() -> RuleResult:
        return generic(module, replace(cap, flattened=laid_out), wanted)

    routing = _routing(tensors)
    if routing is None:
        return re_run()
    x, index, weights = routing
    up = _up(module)
    params = own_params(module)
    W_up, W_down = params[up], params["down_proj"]
    b_up, b_down = params.get(f"{up}_bias"), params.get("down_proj_bias")
    transposed = bool(getattr(module, "is_transposed", False))
    dtype, B, E = W_down.dtype, cap.batch_size, W_down.shape[0]
    H, K = x.shape[-1], index.shape[-1]
    x = x.reshape(-1, H).to(dtype)  # (N, H)
    N = x.shape[0]
    index, weights = index.reshape(N, K), weights.reshape(N, K).to(dtype)
    if N % B:
        return re_run()
    pairs = _Pairs(index, B, E)
    if pairs.outside:  # (an expert id outside the module's: not the interface's routing)
        return re_run()
    g = cap.grad_output.reshape(N, H).to(dtype) * cap.scale  # (every result is linear in g)
    xs = x[pairs.row]  # (S, H)
    w = weights.reshape(-1)[pairs.order, None]  # (S, 1)
    gy = g[pairs.row] * w  # (S, H): the (scaled) gradient of each pair's down projection
    U = W_up.shape[-1] if transposed else W_up.shape[1]
    u = xs.new_empty((xs.shape[0], U))
    gz = xs.new_empty((xs.shape[0], W_down.shape[1] if transposed else W_down.shape[-1]))
    hit = [e for e in range(E) if pairs.slices[e].stop > pairs.slices[e].start]
    for e in hit:
        sl = pairs.slices[e]
        torch.mm(xs[sl], W_up[e] if transposed else W_up[e].T, out=u[sl])
        if b_up is not None:
            u[sl] += b_up[e]
        torch.mm(gy[sl], W_down[e].T if transposed else W_down[e], out=gz[sl])
    with torch.enable_grad():
        u_ = u.requires_grad_(True)
        z = _gate(module, u_)
        (gu,) = torch.autograd.grad(z, u_, gz)
    z = z.detach()
    impl = str(getattr(getattr(module, "config", None), "_experts_implementation", None))
    if not replays(module, impl, lambda: module(x, index, weights), lambda: [_output(
            pairs, hit, z, W_down, b_down, w, transposed, N)], H, torch.float32):
        return re_run()  # (float32: some classes compute their gate or sums in it)
    out = {name: cap.empty((B, *p.shape), dtype, p.device)
           for name, p in params.items() if name in wanted}
    for b in range(B):  # (every expert's gradient of datum b written in place)
        X, Gy, Z, Gu = pairs.of_datum(b, xs, gy, z, gu)  # (E, C, .)
        if up in out:
            torch.bmm(*((X.mT, Gu) if transposed else (Gu.mT, X)), out=out[up][b])
        if "down_proj" in out:
            torch.bmm(*((Z.mT, Gy) if transposed else (Gy.mT, Z)), out=out["down_proj"][b])
        if f"{up}_bias" in out:
            torch.sum(Gu, 1, out=out[f"{up}_bias"][b])
        if "down_proj_bias" in out:
            torch.sum(Gy, 1, out=out["down_proj_bias"][b])
    return out


def _output(pairs: _Pairs, hit: list[int], z: torch.Tensor, W_down: torch.Tensor,
            b_down: torch.Tensor | None, w: torch.Tensor, transposed: bool,
            N: int) -> torch.Tensor:
    """The formula's output ``(N, H)``, for the replay: ``sum_k w down_e(z)`` per row."""
    y = z.new_empty((z.shape[0], W_down.shape[-1] if transposed else W_down.shape[1]))
    for e in hit:
        sl = pairs.slices[e]
        torch.mm(z[sl], W_down[e] if transposed else W_down[e].T, out=y[sl])
        if b_down is not None:
            y[sl] += b_down[e]
    out = y.new_zeros((N, y.shape[1]))
    return out.index_add_(0, pairs.row, y * w)

