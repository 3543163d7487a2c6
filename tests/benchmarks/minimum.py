"""A reference for ``bench_compute.py``: the least an eager PyTorch implementation can pay.

Not part of gradlog and not a tool: a hand-written per-datum step for exactly the benchmark's
GPT (``gradlog.demo.model.CharGPT``), with the arithmetic of gradlog's ``hooks`` backend in
``batch_grad="sum"`` mode and as little Python as that arithmetic allows. It has no
generality (one model, float32, ``arange`` positions, a mean batch loss), no checks, no
buffer bookkeeping beyond one buffer per layer, and no reuse or tied weights. Its ratio to
a plain step is the floor that the ``hooks`` backend's own ratio should be read against: what
remains above it is gradlog's bookkeeping (hooks, checks, layout handling); what is below it
is unreachable by any eager implementation of these rules on the machine.

What it computes, per step, for every parameter: the per-datum gradients, kept in memory:

- Linear: ``G_b^T A_b`` by one batched matmul into a buffer reused across steps, the bias's
  ``sum_n g_{b,n}``, and ``p.grad`` of the weight as the sum of the per-datum gradients (the
  weight-gradient matmul of autograd never runs: a custom autograd Function); with
  ``bitwise=True``, the arithmetic of the default mode: autograd's weight-gradient matmul
  gives ``p.grad`` as in a plain step, and the per-datum matmul runs beside it.
- LayerNorm: ``sum_n g * x_hat`` and ``sum_n g`` from a tensor hook on the output.
- Token embedding: the per-datum rows added into a zeroed (B, V, d) buffer; the position
  embedding's per-datum gradient is the gradient of the token embedding's output (their
  outputs are added), written into a (B, T_max, d) buffer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["minimum_step"]


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                slot: dict[str, Any]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        slot = ctx.slot
        B, scale = slot["B"], slot["scale"]
        d_out, d_in = weight.shape
        g = grad.reshape(B, -1, d_out)  # (B, N, d_out)
        a = x.reshape(B, -1, d_in)  # (B, N, d_in)
        per = slot.get("weight")
        if per is None:
            per = slot["weight"] = torch.empty(B, d_out, d_in)
        per.baddbmm_(g.transpose(1, 2), a, beta=0.0, alpha=scale)  # (B, d_out, d_in)
        grad_x = grad.reshape(-1, d_out).mm(weight).view(x.shape)
        grad_b = None
        if ctx.has_bias:
            slot["bias"] = g.sum(1).mul_(scale)  # (B, d_out)
            grad_b = grad.reshape(-1, d_out).sum(0)
        if slot["bitwise"]:  # autograd's own weight-gradient matmul, as a plain step runs it
            grad_w = grad.reshape(-1, d_out).t().mm(x.reshape(-1, d_in))
        else:
            grad_w = per.sum(0).div_(scale)
        return grad_x, grad_w, grad_b, None


def _patch(model: nn.Module, B: int, out: dict[str, dict[str, Any]], bitwise: bool) -> None:
    scale = float(B)  # a mean batch loss: output gradients carry 1/B
    tok, pos = cast(nn.Embedding, model.tok_emb), cast(nn.Embedding, model.pos_emb)

    for name, module in model.named_modules():
        slot = out.setdefault(name, {"B": B, "scale": scale, "bitwise": bitwise})
        if isinstance(module, nn.Linear):

            def linear(x: torch.Tensor, m: nn.Linear = module, s: dict[str, Any] = slot) -> Any:
                return _Linear.apply(x, m.weight, m.bias, s)

            module.forward = linear  # type: ignore[method-assign,assignment]
        elif isinstance(module, nn.LayerNorm):

            def layer_norm(x: torch.Tensor, m: nn.LayerNorm = module,
                           s: dict[str, Any] = slot) -> torch.Tensor:
                y = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)

                def hook(g: torch.Tensor) -> None:
                    x_hat = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
                    s["weight"] = (g * x_hat).sum(1).mul_(scale)  # (B, d)
                    s["bias"] = g.sum(1).mul_(scale)  # (B, d)

                y.register_hook(hook)
                return y

            module.forward = layer_norm  # type: ignore[method-assign,assignment]

    tok_slot, pos_slot = out["tok_emb"], out["pos_emb"]

    def embedding(idx: torch.Tensor) -> torch.Tensor:
        y = F.embedding(idx, tok.weight)  # (B, T, d)

        def hook(g: torch.Tensor) -> None:
            V, d = tok.weight.shape
            rows = tok_slot.get("weight")
            if rows is None:
                rows = tok_slot["weight"] = torch.empty(B, V, d)
                pos_slot["weight"] = torch.empty(B, *pos.weight.shape)
            flat = (idx + torch.arange(B).unsqueeze(1) * V).reshape(-1)  # (B*T,)
            rows.zero_().view(B * V, d).index_add_(0, flat, g.reshape(-1, d), alpha=scale)
            T = g.shape[1]
            positions = pos_slot["weight"].zero_()
            positions[:, :T].copy_(g).mul_(scale)  # positions arange(T): row t gets token t

        y.register_hook(hook)
        return y

    tok.forward = embedding  # type: ignore[method-assign,assignment]


def _records(slots: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {f"{m}.{k}" if m else k: v for m, s in slots.items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
          token_losses: Callable[..., torch.Tensor], bitwise: bool
          ) -> Callable[[], dict[str, torch.Tensor]]:
    slots: dict[str, dict[str, Any]] = {}
    _patch(model, x.shape[0], slots, bitwise)

    def step() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        token_losses(model, (x, y)).mean(1).mean().backward()
        return _records(slots)

    return step


def minimum_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 token_losses: Callable[..., torch.Tensor], bitwise: bool = False
                 ) -> Callable[[], Any]:
    """Patch ``model`` (a CharGPT) in place and return its per-datum training step.

    ``bitwise``: the arithmetic of the default ``batch_grad="autograd"`` mode instead, where
    ``p.grad`` is what a plain step computes: each Linear's weight-gradient matmul runs as
    in a plain backward, beside the per-datum one.

    A patched copy is checked first against autograd on the unpatched model (datum 0's
    gradient of every parameter), so that the reference computes what the methods it is
    compared with do; the returned step has not run yet (its buffers are not allocated)."""
    records = _step(copy.deepcopy(model), x, y, token_losses, bitwise)()
    loss0 = token_losses(model, (x[:1], y[:1])).mean()
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss0, [p for _, p in model.named_parameters()])
    missing = sorted(set(names) - set(records))
    if missing:
        raise RuntimeError(f"minimum_step computes no per-datum gradient for {missing}")
    for name, g in zip(names, grads):
        if not torch.allclose(records[name][0], g, rtol=1e-3, atol=1e-6):
            raise RuntimeError(f"minimum_step's per-datum gradient of {name} is wrong")
    return _step(model, x, y, token_losses, bitwise)


_MATRICES: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}


def with_form(records: dict[str, torch.Tensor], form: str) -> dict[str, torch.Tensor]:
    """What a form adds to the per-datum step, at its least: every record's exact norm (the
    store keeps it for every form: squares summed in float64, gradlog's own kernel), and for
    ``projection`` the default two-sided projection to 1024 dims (``P0^T G P1`` with ranks
    as gradlog balances them, fixed Gaussian matrices; vectors: one ``(n, 1024)`` matrix
    each, the vectors of one size in one batched matmul), taken from the dense records in
    the cheaper order. Records of at most 1024 numbers are kept as they are, as gradlog
    plans them (``full``)."""
    from gradlog.forms.projection import DEFAULT_DIM, balanced_ranks
    from gradlog.grads import float64_sqnorms

    out = {f"{name}/norm": float64_sqnorms(g.reshape(g.shape[0], -1)).sqrt_()
           for name, g in records.items()}
    if form != "projection":
        return out
    vectors: dict[int, list[str]] = {}
    for name, g in records.items():
        shape = tuple(g.shape[1:])
        if g[0].numel() <= DEFAULT_DIM:
            continue  # kept whole: no arithmetic
        if len(shape) != 2:
            vectors.setdefault(g[0].numel(), []).append(name)
            continue
        mats = _MATRICES.get(shape)
        if mats is None:
            r0, r1 = balanced_ranks(DEFAULT_DIM, *shape)
            mats = _MATRICES[shape] = (torch.randn(shape[0], r0), torch.randn(shape[1], r1))
        (p, q), (r0, r1) = shape, (mats[0].shape[1], mats[1].shape[1])
        if p * q * r1 + p * r1 * r0 <= r0 * p * q + r0 * q * r1:
            out[f"{name}/proj"] = mats[0].T @ (g @ mats[1])  # (B, r0, r1)
        else:
            out[f"{name}/proj"] = (mats[0].T @ g) @ mats[1]  # (B, r0, r1)
    for n, names in vectors.items():
        stacked = _MATRICES.get(("vectors", n, len(names)))  # (k, n, r): one matrix per vector
        if stacked is None:
            stacked = torch.randn(len(names), n, DEFAULT_DIM)
            _MATRICES[("vectors", n, len(names))] = (stacked,)
        else:
            stacked = stacked[0]
        flat = torch.stack([records[name].reshape(-1, n) for name in names])  # (k, B, n)
        out.update(zip([f"{name}/proj" for name in names], torch.bmm(flat, stacked)))  # (B, r)
    return out
