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
fallback. The replay runs a float32 copy of a few experts (:func:`_probes`): in bf16 a
correct forward rounds as much as a formula a few percent off, and 16-bit experts are the
common case in training.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

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
    gradients (a group of datums' pairs padded per datum and expert: one batched matmul
    over (datum, expert) that writes the group's ``(g, E, ...)`` gradients in place)."""

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
        self.datum, self.expert, self.position = datum, clamped, position
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

    def of_datums(self, lo: int, hi: int, *ts: torch.Tensor) -> list[torch.Tensor]:
        """Datums ``lo..hi-1``'s pairs of each expert-major tensor ``(S, f)`` laid out
        ``(g * E, C, f)`` by (datum, expert), zero rows after each one's (C: the most pairs
        one of these datums sends to one expert)."""
        sl, C = slice(lo * self.per, hi * self.per), max(self.most[lo:hi])
        rows = self.rows_of_datum[sl]
        at = ((self.datum[sl] - lo) * self.E + self.expert[sl]) * C + self.position[sl]
        out = []
        for t in ts:
            full = t.new_zeros(((hi - lo) * self.E * C, t.shape[1]))
            out.append(full.index_copy_(0, at, t[rows]).view((hi - lo) * self.E, C, -1))
        return out

    def groups(self, padded: int, budget: int) -> list[tuple[int, int]]:
        """Datums in consecutive groups whose padded layout (``padded`` elements per pair
        slot of a datum and expert) stays within ``budget`` elements, one datum at least."""
        B, out, lo = len(self.most), [], 0
        while lo < B:
            hi = lo + 1
            while hi < B and (hi + 1 - lo) * self.E * max(self.most[lo:hi + 1]) * padded <= budget:
                hi += 1
            out.append((lo, hi))
            lo = hi
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
    b_up = params.get(f"{up}_bias")
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
    impl = str(getattr(getattr(module, "config", None), "_experts_implementation", None))
    theirs, ours = _probes(module, x, index, weights)
    own = ((lambda: module.forward(x, index, weights), ours)  # (as it runs)
           if torch.finfo(dtype).bits <= 16 else None)
    if not replays(module, impl, theirs, ours, H, torch.float32, own):
        return re_run()  # (float32: some classes compute their gate or sums in it)
    g = cap.grad_output.reshape(N, H).to(dtype) * cap.scale  # (every result is linear in g)
    xs = x[pairs.row]  # (S, H)
    w = weights.reshape(-1)[pairs.order, None]  # (S, 1)
    gy = g[pairs.row] * w  # (S, H): the (scaled) gradient of each pair's down projection
    hit = [e for e in range(E) if pairs.slices[e].stop > pairs.slices[e].start]
    u = _per_expert(pairs, hit, xs, W_up, b_up, transposed)
    gz = _per_expert(pairs, hit, gy, W_down, None, not transposed)
    with torch.enable_grad():
        u_ = u.requires_grad_(True)
        z = _gate(module, u_)
        (gu,) = torch.autograd.grad(z, u_, gz)
    z = z.detach()
    out = {name: cap.empty((B, *p.shape), dtype, p.device)
           for name, p in params.items() if name in wanted}
    # (datums in groups: one batched matmul a group; the padded copies within a quarter of
    # the gradients' own size, so they add little to the rule's peak memory)
    padded = xs.shape[1] + gy.shape[1] + z.shape[1] + gu.shape[1]
    for lo, hi in pairs.groups(padded, sum(o.numel() for o in out.values()) // 4):
        X, Gy, Z, Gu = pairs.of_datums(lo, hi, xs, gy, z, gu)  # (g*E, C, .)
        o = {name: t[lo:hi].view(-1, *t.shape[2:]) for name, t in out.items()}  # (g*E, ...)
        if up in o:
            torch.bmm(*((X.mT, Gu) if transposed else (Gu.mT, X)), out=o[up])
        if "down_proj" in o:
            torch.bmm(*((Z.mT, Gy) if transposed else (Gy.mT, Z)), out=o["down_proj"])
        if f"{up}_bias" in o:
            torch.sum(Gu, 1, out=o[f"{up}_bias"])
        if "down_proj_bias" in o:
            torch.sum(Gy, 1, out=o["down_proj_bias"])
    return out


def _per_expert(pairs: _Pairs, hit: list[int], rows: torch.Tensor, W: torch.Tensor,
                b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Each pair's row through its expert's weights, ``rows W_e^T + b_e`` (``rows W_e`` for
    ``transposed`` weights), one matmul per expert hit: the up projection ``u = up_e(x)``,
    the down one, and with ``transposed`` flipped ``g_z = g_y W_down_e``."""
    out = rows.new_empty((rows.shape[0], W.shape[-1] if transposed else W.shape[1]))
    for e in hit:
        sl = pairs.slices[e]
        torch.mm(rows[sl], W[e] if transposed else W[e].T, out=out[sl])
        if b is not None:
            out[sl] += b[e]
    return out


def _probes(module: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
            ) -> tuple[Callable[[], torch.Tensor], Callable[[], list[torch.Tensor]]]:
    """The module's forward and the formula's output on the call, for the replay. 16-bit
    experts run as a float32 copy (built on the first call only: replays caches): in 16 bits
    a correct forward rounds as much as a formula a few percent off. The copy holds every
    expert and takes every row, so a forward that treats some experts or some batch sizes
    otherwise is seen as the real call would be."""
    made: dict[str, Any] = {}

    def probe() -> dict[str, Any]:
        if not made:
            params = own_params(module)
            if torch.finfo(params["down_proj"].dtype).bits > 16:
                made.update(module=module, x=x, weights=weights)
            else:
                copy = _copy.copy(module)  # (its own parameters; called without hooks)
                copy._parameters = {n: nn.Parameter(p.detach().float(), requires_grad=False)
                                    for n, p in params.items()}
                made.update(module=copy, x=x.float(), weights=weights.float())
        return made

    def theirs() -> torch.Tensor:
        m = probe()
        out: torch.Tensor = m["module"].forward(m["x"], index, m["weights"])
        return out

    def ours() -> list[torch.Tensor]:
        m = probe()
        if "ours" not in m:
            m["ours"] = [_formula(m["module"], m["x"], index, m["weights"])]
        out: list[torch.Tensor] = m["ours"]
        return out

    return theirs, ours


def _formula(module: nn.Module, x: torch.Tensor, index: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
    """The interface's output ``(N, H)``: ``sum_k w down_e(gate(up_e(x)))`` per row."""
    params = own_params(module)
    up, transposed = _up(module), bool(getattr(module, "is_transposed", False))
    W_down, b_down = params["down_proj"], params.get("down_proj_bias")
    pairs = _Pairs(index, 1, W_down.shape[0])
    hit = [e for e in range(pairs.E) if pairs.slices[e].stop > pairs.slices[e].start]
    z = _gate(module, _per_expert(pairs, hit, x[pairs.row], params[up],
                                  params.get(f"{up}_bias"), transposed))
    y = _per_expert(pairs, hit, z, W_down, b_down, transposed)
    w = weights.reshape(-1)[pairs.order, None]
    return y.new_zeros((x.shape[0], y.shape[1])).index_add_(0, pairs.row, y * w)
