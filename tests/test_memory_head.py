"""``gradlog.memory.chunked_linear_loss`` against the unchunked head.

Every loss of the zoo (cross entropy with ignore_index, z-loss, label smoothing, MSE to one-hot
targets, KL to teacher logits, a GRPO-style clipped policy-gradient loss with per-token
advantages) gives the unchunked loss and gradients of x, weight and bias (float32, rtol 1e-5)
for every reduction, chunking, schedule and with or without bias; plus autocast, dropout
replay, peak tensor size, errors, hypothesis over shapes and a tiny Llama trained 20 steps.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradlog.errors import InputError
from gradlog.memory import (
    ChunkInfo,
    DoubleBackwardError,
    TensorPeak,
    chunked_linear_loss,
    current_chunk,
)
from gradlog.testing.llama import LlamaConfig, tiny_llama

B, T, D, V = 2, 20, 8, 11  # N = 40 rows; an odd vocabulary
N = B * T
RTOL, ATOL = 1e-5, 1e-6
# int (unequal last chunk), a list of unequal sizes, None (memory budget), larger than N
CHUNKINGS: list[dict[str, Any]] = [
    {"chunk_size": 7},
    {"chunk_size": [1, 16, 23]},
    {"chunk_size": None},
    {"memory_budget_bytes": V * 4 * 6},  # 6 rows per chunk
    {"chunk_size": 1000},
]
SCHEDULES = [None, False]  # grad_in_forward: default (in forward for mean/sum), recompute


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Every tensor here is tiny: on a shared 2-core machine, thread hand-offs dominate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the loss zoo: fn(x_chunk, linear, labels_chunk) -> (rows,) -----------------------------


def ce(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(linear(x).float(), y, ignore_index=-100, reduction="none")


def ce_zloss(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    logits = linear(x).float()  # (rows, V)
    z = torch.logsumexp(logits, dim=-1)  # (rows,); nonzero on ignored rows: masked afterwards
    return F.cross_entropy(logits, y, reduction="none") + 1e-2 * z**2


def label_smoothing(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(linear(x).float(), y, label_smoothing=0.1, reduction="none")


def mse_onehot(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    logits = linear(x).float()  # (rows, V)
    target = F.one_hot(y.clamp_min(0), logits.shape[-1]).float()  # (rows, V); -100 -> row 0
    return ((logits - target) ** 2).mean(-1)


def kl_teacher(x: torch.Tensor, linear: nn.Module, teacher: torch.Tensor) -> torch.Tensor:
    student = F.log_softmax(linear(x).float(), dim=-1)  # (rows, V)
    target = F.log_softmax(teacher.float(), dim=-1)  # (rows, V)
    return F.kl_div(student, target, log_target=True, reduction="none").sum(-1)


def grpo(x: torch.Tensor, linear: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logp = -F.cross_entropy(linear(x).float(), batch["tokens"], reduction="none")  # (rows,)
    ratio = torch.exp(logp - batch["old_logp"])  # (rows,)
    adv = batch["adv"]  # (rows,)
    clipped = torch.clamp(ratio, 0.8, 1.2) * adv
    return -torch.minimum(ratio * adv, clipped)


def _int_labels(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, T), generator=g)  # (B, T)
    y[0, :5] = -100
    y[1, 7] = -100
    return y


def _labels(name: str, x: torch.Tensor, linear: nn.Linear) -> Any:
    g = torch.Generator().manual_seed(2)
    if name == "kl_teacher":
        return torch.randn(B, T, V, generator=g)  # (B, T, V) teacher logits
    if name == "grpo":
        tokens = torch.randint(0, V, (B, T), generator=g)  # (B, T)
        with torch.no_grad():
            logp = -F.cross_entropy(linear(x).transpose(1, 2), tokens, reduction="none")
        return {
            "tokens": tokens,
            "old_logp": logp + 0.3 * torch.randn(B, T, generator=g),  # ratios on both clips
            "adv": torch.randn(B, T, generator=g),
        }
    return _int_labels()


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "ce": ce,
    "ce_zloss": ce_zloss,
    "label_smoothing": label_smoothing,
    "mse_onehot": mse_onehot,
    "kl_teacher": kl_teacher,
    "grpo": grpo,
}


def _setup(bias: bool = True, seed: int = 0) -> tuple[torch.Tensor, nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(D, V, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(V, D, generator=g) / math.sqrt(D))
        if linear.bias is not None:
            linear.bias.copy_(0.1 * torch.randn(V, generator=g))
    x = torch.randn(B, T, D, generator=g).requires_grad_()  # (B, T, D)
    return x, linear


def _flat(labels: Any) -> Any:
    if isinstance(labels, dict):
        return {k: v.reshape(N, *v.shape[2:]) for k, v in labels.items()}
    return labels.reshape(N, *labels.shape[2:])


def unchunked(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, linear: nn.Module, labels: Any, reduction: str
) -> torch.Tensor:
    """The reference: fn on all rows at once, ignored rows masked, then reduced."""
    rows = fn(x.reshape(N, D), linear, _flat(labels))  # (N,)
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        valid = labels.reshape(N) != -100  # (N,)
        rows = torch.where(valid, rows, torch.zeros_like(rows))
        count = int(valid.sum())
    else:
        count = N
    if reduction == "none":
        return rows.reshape(B, T)
    return rows.sum() / count if reduction == "mean" else rows.sum()


def _grads(
    out: torch.Tensor, upstream: torch.Tensor, x: torch.Tensor, linear: nn.Linear
) -> list[torch.Tensor]:
    x.grad = None
    linear.zero_grad(set_to_none=True)
    (out * upstream).sum().backward()
    grads = [x.grad, linear.weight.grad] + ([linear.bias.grad] if linear.bias is not None else [])
    assert all(g is not None for g in grads)
    return [g.clone() for g in grads if g is not None]


def _assert_close_all(got: list[torch.Tensor], want: list[torch.Tensor], **tol: Any) -> None:
    assert len(got) == len(want)
    for name, a, b in zip(("x", "weight", "bias"), got, want):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"grad of {n}: {m}", **tol)


# --- equivalence with the unchunked computation ---------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_matches_unchunked(loss: str, reduction: str, bias: bool) -> None:
    fn = LOSSES[loss]
    x, linear = _setup(bias)
    labels = _labels(loss, x, linear)
    ref = unchunked(fn, x, linear, labels, reduction)
    upstream = torch.randn(ref.shape)  # any upstream gradient, not only ones
    ref_grads = _grads(ref, upstream, x, linear)
    for chunking in CHUNKINGS:
        for schedule in SCHEDULES if reduction != "none" else [None]:
            out = chunked_linear_loss(
                x, linear, labels, fn, reduction=reduction, grad_in_forward=schedule, **chunking
            )
            assert out.shape == ref.shape and out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
            _assert_close_all(_grads(out, upstream, x, linear), ref_grads, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mean_is_torch_cross_entropy_mean_over_valid_tokens(schedule: bool | None) -> None:
    x, linear = _setup()
    y = _int_labels()
    ref = F.cross_entropy(linear(x).transpose(1, 2), y, ignore_index=-100)  # torch's own mean
    ref_grads = _grads(ref, torch.ones(()), x, linear)
    out = chunked_linear_loss(x, linear, y, ce, chunk_size=[3, 30, 7], grad_in_forward=schedule)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    _assert_close_all(_grads(out, torch.ones(()), x, linear), ref_grads, rtol=RTOL, atol=ATOL)


def test_none_zeroes_ignored_rows_even_if_fn_does_not() -> None:
    x, linear = _setup()
    y = _int_labels()
    losses = chunked_linear_loss(x, linear, y, ce_zloss, chunk_size=6, reduction="none")
    assert losses.shape == (B, T)
    assert torch.all(losses[y == -100] == 0) and torch.all(losses[y != -100] > 0)
    losses.sum().backward()
    assert x.grad is not None
    assert torch.all(x.grad[y == -100] == 0)  # ignored tokens get no gradient
    assert torch.all(x.grad[y != -100].abs().sum(-1) > 0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mean_of_no_valid_row_is_zero(schedule: bool | None) -> None:
    x, linear = _setup()
    y = torch.full((B, T), -100)
    out = chunked_linear_loss(x, linear, y, ce, chunk_size=7, grad_in_forward=schedule)
    assert out.item() == 0.0
    out.backward()
    assert x.grad is not None and linear.weight.grad is not None
    assert not x.grad.any() and not linear.weight.grad.any()


def test_ignore_index_none_counts_every_row() -> None:
    x, linear = _setup()
    y = torch.randint(0, V, (B, T))
    y[0, 0] = 3
    a = chunked_linear_loss(x, linear, y, ce, chunk_size=7, ignore_index=3, reduction="none")
    b = chunked_linear_loss(x, linear, y, ce, chunk_size=7, ignore_index=None, reduction="none")
    assert a[0, 0] == 0 and b[0, 0] > 0


def test_two_dim_input_and_tuple_labels() -> None:
    x, linear = _setup()
    x2 = x.detach().reshape(N, D).requires_grad_()  # (N, D)
    y = _int_labels().reshape(N)
    w = torch.rand(N)  # per-row weights, passed in a tuple

    def weighted(xc: torch.Tensor, head: nn.Module, lab: tuple[torch.Tensor, torch.Tensor]):
        return ce(xc, head, lab[0]) * lab[1]

    out = chunked_linear_loss(x2, linear, (y, w), weighted, chunk_size=9, reduction="none")
    ref = ce(x2, linear, y) * w
    assert out.shape == (N,)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_labels_already_flattened_to_rows() -> None:
    x, linear = _setup()
    y = _int_labels()
    a = chunked_linear_loss(x, linear, y, ce, chunk_size=7, reduction="none")
    b = chunked_linear_loss(x, linear, y.reshape(N), ce, chunk_size=7, reduction="none")
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("vocab", "hidden", "budget", "rows"),
    [
        (32_000, 1024, None, 131),  # the 16 MiB budget
        (128_256, 1024, None, 32),
        (128_256, 4096, None, 128),  # at least hidden // 32 rows: logits 1/32 of the weight
        (128_256, 8192, None, 256),
        (50_257, 768, None, 83),
        (128_256, 4096, 16 * 2**20, 32),  # an explicit budget is kept as given
    ],
)
def test_default_chunks_hold_at_least_a_32nd_of_the_weight(
    vocab: int, hidden: int, budget: int | None, rows: int
) -> None:
    from gradlog.memory.rows import chunk_sizes

    assert chunk_sizes(None, budget, 100_000, vocab, hidden)[0] == rows


@pytest.mark.parametrize(
    ("kwargs", "bounds"),
    [
        ({"memory_budget_bytes": V * 4 * 16}, [(0, 16), (16, 32), (32, 40)]),  # 16 rows
        ({"memory_budget_bytes": V * 4 * 16 - 1}, [(i, i + 15) for i in (0, 15)] + [(30, 40)]),
        ({}, [(0, 40)]),  # the default 256 MiB holds every row of this small vocabulary
        ({"chunk_size": 16}, [(0, 16), (16, 32), (32, 40)]),
        ({"chunk_size": (30, 10)}, [(0, 30), (30, 40)]),
    ],
)
def test_chunk_bounds(kwargs: dict[str, Any], bounds: list[tuple[int, int]]) -> None:
    x, linear = _setup()
    seen: list[tuple[int, int]] = []

    def spy(xc: torch.Tensor, head: nn.Module, yc: torch.Tensor) -> torch.Tensor:
        info = current_chunk()
        assert info is not None and info.stop - info.start == xc.shape[0] == yc.shape[0]
        seen.append((info.start, info.stop))
        return ce(xc, head, yc)

    chunked_linear_loss(x, linear, _int_labels(), spy, reduction="none", **kwargs)
    assert seen == bounds


def test_gradients_only_for_what_requires_grad() -> None:
    x, linear = _setup()
    y = _int_labels()
    linear.requires_grad_(False)  # frozen head: only x gets a gradient
    for schedule in SCHEDULES:
        x.grad = None
        chunked_linear_loss(x, linear, y, ce, chunk_size=7, grad_in_forward=schedule).backward()
        assert x.grad is not None and linear.weight.grad is None
    linear.requires_grad_(True)
    x0 = x.detach()  # no gradient wanted for the hidden states
    for schedule in SCHEDULES:
        linear.zero_grad(set_to_none=True)
        chunked_linear_loss(x0, linear, y, ce, chunk_size=7, grad_in_forward=schedule).backward()
        assert linear.weight.grad is not None and linear.bias is not None
        assert linear.bias.grad is not None


def test_under_no_grad_gives_values_only() -> None:
    x, linear = _setup()
    y = _int_labels()
    with torch.no_grad():
        out = chunked_linear_loss(x, linear, y, ce, chunk_size=7)
        ref = F.cross_entropy(linear(x).transpose(1, 2), y)
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_empty_batch() -> None:
    x, linear = _setup()
    x0 = x.detach()[:0].requires_grad_()  # (0, T, D)
    y0 = _int_labels()[:0]
    assert chunked_linear_loss(x0, linear, y0, ce, reduction="none").shape == (0, T)
    out = chunked_linear_loss(x0, linear, y0, ce)
    out.backward()
    assert out.item() == 0.0 and x0.grad is not None and x0.grad.shape == (0, T, D)


def test_tied_weight_gets_both_contributions() -> None:
    emb = nn.Embedding(V, D)
    head = nn.Linear(D, V, bias=False)
    head.weight = emb.weight  # tied, as in GPT-2
    tokens = torch.randint(0, V, (B, T))
    y = _int_labels()
    ref = F.cross_entropy(head(emb(tokens)).transpose(1, 2), y)
    ref.backward()
    assert emb.weight.grad is not None
    want = emb.weight.grad.clone()
    emb.zero_grad(set_to_none=True)
    for schedule in SCHEDULES:
        emb.zero_grad(set_to_none=True)
        out = chunked_linear_loss(emb(tokens), head, y, ce, chunk_size=7, grad_in_forward=schedule)
        out.backward()
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(emb.weight.grad, want, rtol=RTOL, atol=ATOL)


def test_scaled_and_accumulated_upstream() -> None:
    """A scaled loss (GradScaler, gradient accumulation) scales the saved gradients."""
    x, linear = _setup()
    y = _int_labels()
    ref = F.cross_entropy(linear(x).transpose(1, 2), y)
    want = _grads(ref * 3.0, torch.ones(()), x, linear)
    x.grad = None
    linear.zero_grad(set_to_none=True)
    out = chunked_linear_loss(x, linear, y, ce, chunk_size=7)  # gradients in forward
    (out * 1.5).backward(retain_graph=True)
    (out * 1.5).backward()  # backward twice: the saved gradients are not consumed
    assert x.grad is not None and linear.weight.grad is not None and linear.bias is not None
    _assert_close_all([x.grad, linear.weight.grad, linear.bias.grad], want, rtol=RTOL, atol=ATOL)
    # Upstream 1 hands the saved gradients over without a copy: a second backward must not
    # find them aliased with .grad.
    x.grad = None
    linear.zero_grad(set_to_none=True)
    out = chunked_linear_loss(x, linear, y, ce, chunk_size=7)
    out.backward(retain_graph=True)
    out.backward(retain_graph=True)
    out.backward()  # three times upstream 1: the gradients of 3 * loss again
    _assert_close_all([x.grad, linear.weight.grad, linear.bias.grad], want, rtol=RTOL, atol=ATOL)


def test_head_with_a_computed_weight() -> None:
    """A head whose weight is a tensor computed from parameters (not a Parameter) works."""

    class ScaledHead(nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.weight = weight  # (V, D), a plain tensor attribute
            self.bias = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T  # (rows, V)

    emb = nn.Embedding(V, D)
    x, _ = _setup()
    y = _int_labels()
    ref = F.cross_entropy(ScaledHead(emb.weight * 2)(x).transpose(1, 2), y)
    ref.backward()
    assert emb.weight.grad is not None and x.grad is not None
    want = [x.grad.clone(), emb.weight.grad.clone()]
    for schedule in SCHEDULES:
        x.grad = None
        emb.zero_grad(set_to_none=True)
        head = ScaledHead(emb.weight * 2)
        chunked_linear_loss(x, head, y, ce, chunk_size=7, grad_in_forward=schedule).backward()
        assert x.grad is not None and emb.weight.grad is not None
        _assert_close_all([x.grad, emb.weight.grad], want, rtol=RTOL, atol=ATOL)


class _TemperatureHead(nn.Linear):
    """An nn.Linear with a learned temperature: a trainable tensor besides weight and bias."""

    def __init__(self) -> None:
        super().__init__(D, V)
        self.temp = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.temp


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_other_trainable_head_parameters_are_refused_before_any_computation(
    reduction: str,
) -> None:
    """Only x, weight and bias get gradients: a head with another trainable parameter would
    silently lose that one's gradient, so it is refused (naming it) before fn runs."""
    head = _TemperatureHead()
    x, _ = _setup()
    calls = []

    def counting_ce(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return ce(x, linear, y)

    with pytest.raises(InputError, match=r"'temp'.*weight and bias.*requires_grad_\(False\)"):
        chunked_linear_loss(x, head, _int_labels(), counting_ce, chunk_size=7,
                            reduction=reduction)
    assert not calls
    with torch.no_grad():  # no gradient to lose: values only
        got = chunked_linear_loss(x, head, _int_labels(), ce, chunk_size=7)
    want = F.cross_entropy(head(x).transpose(1, 2), _int_labels())
    torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL)
    head.temp.requires_grad_(False)  # frozen: nothing is lost
    chunked_linear_loss(x, head, _int_labels(), ce, chunk_size=7).backward()
    assert head.weight.grad is not None and head.temp.grad is None


def test_head_parameters_feeding_a_computed_weight_are_not_refused() -> None:
    """Trainable parameters of the head that its weight is computed from get their gradients
    through the weight tensor: they are not refused."""

    class DoubledHead(nn.Module):
        def __init__(self, emb: nn.Embedding) -> None:
            super().__init__()
            self.emb = emb  # a submodule: emb.weight is among the head's parameters
            self.weight = emb.weight * 2  # (V, D), computed from it
            self.bias = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T  # (rows, V)

    emb = nn.Embedding(V, D)
    x, _ = _setup()
    y = _int_labels()
    F.cross_entropy(DoubledHead(emb)(x).transpose(1, 2), y).backward()
    assert emb.weight.grad is not None and x.grad is not None
    want = [x.grad.clone(), emb.weight.grad.clone()]
    x.grad = None
    emb.zero_grad(set_to_none=True)
    chunked_linear_loss(x, DoubledHead(emb), y, ce, chunk_size=7).backward()
    assert emb.weight.grad is not None and x.grad is not None
    _assert_close_all([x.grad, emb.weight.grad], want, rtol=RTOL, atol=ATOL)


# --- autocast, randomness, hooks, double backward -------------------------------------------


@pytest.mark.parametrize(
    ("reduction", "schedule"), [("mean", None), ("mean", False), ("none", None)]
)
def test_bf16_autocast_matches_unchunked_autocast(reduction: str, schedule: bool | None) -> None:
    x, linear = _setup()
    y = _int_labels()
    upstream = torch.randn((B, T) if reduction == "none" else ())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = unchunked(ce, x, linear, y, reduction)
    ref_grads = _grads(ref, upstream, x, linear)  # backward outside the autocast region
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_linear_loss(
            x, linear, y, ce, chunk_size=7, reduction=reduction, grad_in_forward=schedule
        )
    assert out.dtype == torch.float32  # the upcast inside fn stays
    got = _grads(out, upstream, x, linear)
    assert [g.dtype for g in got] == [torch.float32] * 3
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    _assert_close_all(got, ref_grads, rtol=5e-2, atol=5e-3)
    # and it is really bf16: float32 is further off than the chunking
    ref32 = unchunked(ce, x, linear, y, reduction)
    assert (out - ref).abs().max() < (ref32 - ref).abs().max()


def _per_chunk_autocast_oracle(
    x: torch.Tensor, linear: nn.Linear, y: torch.Tensor, upstream: torch.Tensor, rows: int
) -> list[torch.Tensor]:
    """Gradients of x and weight as autograd gives them chunk by chunk under bf16 autocast
    (each chunk's 16-bit products, widened), summed in float64; the bias's as the float64 sum
    of the chunks' 16-bit logit gradients."""
    xs = x.detach().reshape(-1, D)
    ys, us = y.reshape(-1), upstream.reshape(-1)
    out = [torch.zeros(xs.shape, dtype=torch.float64), torch.zeros(V, D, dtype=torch.float64),
           torch.zeros(V, dtype=torch.float64)]
    for start in range(0, xs.shape[0], rows):
        xc = xs[start : start + rows].clone().requires_grad_()
        w = linear.weight.detach().clone().requires_grad_()
        b = linear.bias.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(xc, w, b)  # (rows, V) bf16
            losses = F.cross_entropy(logits.float(), ys[start : start + rows], reduction="none")
        gx, gw, gl = torch.autograd.grad(losses, [xc, w, logits], us[start : start + rows])
        out[0][start : start + rows] = gx.double()
        out[1] += gw.double()
        out[2] += gl.double().sum(0)
    return [out[0].reshape(x.shape), out[1], out[2]]


@pytest.mark.parametrize("schedule", [None, False])
def test_bf16_autocast_head_gradients_are_the_chunks_own_16_bit_products(
    schedule: bool | None,
) -> None:
    """Under autocast the weight and bias gradients are added in place chunk by chunk: each
    chunk adds the same 16-bit weight product autograd would give it and its bias rows summed
    in float32 (float64 oracle of the per-chunk gradients; only float32 accumulation differs)."""
    x, linear = _setup()
    y = _int_labels()
    upstream = torch.randn(B, T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_linear_loss(x, linear, y, ce, chunk_size=7, reduction="none")
    got = _grads(out, upstream, x, linear)
    want = _per_chunk_autocast_oracle(x, linear, y, upstream, rows=7)
    for g, w, name in zip(got, want, ["x", "weight", "bias"]):
        assert g.dtype == torch.float32, name
        # float32 accumulation of a few float32-exact terms; a differently ordered 16-bit
        # product would differ by a bf16 unit (2^-8) instead
        torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-7, msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mean = chunked_linear_loss(x, linear, y, ce, chunk_size=7, grad_in_forward=schedule)
    got = _grads(mean, torch.ones(()), x, linear)
    valid = (y != -100).double()  # (B, T): the mean is over rows with a label
    want = _per_chunk_autocast_oracle(x, linear, y, valid / valid.sum(), rows=7)
    for g, w, name in zip(got, want, ["x", "weight", "bias"]):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-7, msg=name)


def test_bf16_autocast_head_gradients_with_frozen_features() -> None:
    """Features that need no gradient (a frozen body, a linear probe): the weight's 16-bit
    cast carries no graph either, and the head's weight and bias gradients came out zero
    (under the loop backend, stored as all-zero records with p.grad zero)."""
    x, linear = _setup()
    x = x.detach()  # (B, T, D), no grad
    y = _int_labels()
    upstream = torch.randn(B, T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_linear_loss(x, linear, y, ce, chunk_size=7, reduction="none")
    (out * upstream).sum().backward()
    want = _per_chunk_autocast_oracle(x, linear, y, upstream, rows=7)
    for got, ref, name in zip([linear.weight.grad, linear.bias.grad], want[1:], ["w", "b"]):
        assert got is not None and float(ref.norm()) > 0, name
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-7, msg=name)


def test_bf16_autocast_head_called_without_its_bias() -> None:
    """``fn`` calling ``F.linear(x, linear.weight)`` on a head that has a bias: the call's own
    arguments hold (the 16-bit path added the head's bias anyway: x's gradient 78% off)."""
    x, linear = _setup()
    y = _int_labels()

    def no_bias(xc: torch.Tensor, lin: nn.Module, yc: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(xc, lin.weight).float(), yc, reduction="none")

    def grads(losses: torch.Tensor) -> list[torch.Tensor | None]:
        return list(torch.autograd.grad(losses.sum(), [x, linear.weight, linear.bias],
                                        allow_unused=True))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = no_bias(x.reshape(-1, D), linear, y.reshape(-1)).view(B, T)
        out = chunked_linear_loss(x, linear, y, no_bias, chunk_size=7, reduction="none")
    want, got = grads(ref), grads(out)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)  # x: per row, exact
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-3)  # chunk sums in bf16
    assert want[2] is None and (got[2] is None or float(got[2].abs().max()) == 0.0)


def test_a_chunk_backward_keeps_the_autocast_fn_chose() -> None:
    """An ``fn`` that turns autocast off for its own work inside a bf16 region: the chunk's
    backward ran under the region's autocast and cast that work's backward to bf16 (x's
    gradient 3e-3 off a float64 oracle, unchunked 1e-7)."""
    x, linear = _setup()
    y = _int_labels()

    def full_precision(xc: torch.Tensor, lin: nn.Module, yc: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return F.cross_entropy(lin(xc.float()), yc, reduction="none")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_linear_loss(x, linear, y, full_precision, chunk_size=7, reduction="none")
    got = _grads(out, torch.ones(B, T), x, linear)
    x64, lin64 = x.detach().double().requires_grad_(), copy.deepcopy(linear).double()
    want = _grads(unchunked(ce, x64, lin64, y, "none"), torch.ones(B, T, dtype=torch.float64),
                  x64, lin64)
    for g, w, name in zip(got, want, ["x", "weight", "bias"]):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6, msg=name)


class _WeightSized(TorchDispatchMode):
    """Counts new tensors of one shape by dtype (outputs not sharing an input's memory)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape
        self.made: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr()
                  for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape
                    and t.untyped_storage().data_ptr() not in inputs):
                self.made[t.dtype] = self.made.get(t.dtype, 0) + 1
        return out


def test_bf16_autocast_head_makes_no_float32_weight_gradient_per_chunk() -> None:
    """autograd's way widened each chunk's 16-bit weight gradient into a new float32 tensor and
    added it: two weight-sized float32 tensors per chunk (most of a GPU chunk's time at V 128K,
    d 4096). Now one accumulator for the whole backward, and the final float32 gradient; and
    the weight is cast to 16 bits once for the pass, not once a chunk."""
    x, linear = _setup()
    y = _int_labels()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_linear_loss(x, linear, y, ce, chunk_size=5, reduction="none")
    with _WeightSized((V, D)) as spy:
        out.sum().backward()
    chunks = B * T // 5
    assert spy.made.get(torch.float32, 0) <= 3, f"{spy.made} (V, d) tensors, {chunks} chunks"
    # each chunk's 16-bit product, and the weight cast to 16 bits once for the whole pass
    assert spy.made.get(torch.bfloat16, 0) <= chunks + 1, f"{spy.made}, {chunks} chunks"


def test_backward_reruns_in_the_forward_autocast_state() -> None:
    x, linear = _setup()
    y = _int_labels()
    seen: list[tuple[bool, torch.dtype]] = []

    def spy(xc: torch.Tensor, head: nn.Module, yc: torch.Tensor) -> torch.Tensor:
        logits = head(xc)
        seen.append((torch.is_grad_enabled(), logits.dtype))
        return F.cross_entropy(logits.float(), yc, reduction="none")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_linear_loss(x, linear, y, spy, chunk_size=20, reduction="none")
    out.sum().backward()  # outside autocast: the re-run must still be bf16
    assert seen == [(False, torch.bfloat16)] * 2 + [(True, torch.bfloat16)] * 2
    seen.clear()
    out = chunked_linear_loss(x, linear, y, spy, chunk_size=20, reduction="none")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.sum().backward()  # inside autocast: the re-run must stay float32, like forward
    assert seen == [(False, torch.float32)] * 2 + [(True, torch.float32)] * 2


def dropout_ce(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.dropout(linear(x), p=0.3).float(), y, reduction="none")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_dropout_masks_are_replayed(reduction: str) -> None:
    x, linear = _setup()
    y = _int_labels()
    sizes = [13, 20, 7]
    upstream = torch.randn((B, T) if reduction == "none" else ())
    # Reference: the same chunks, each with its graph kept, from the same RNG state.
    torch.manual_seed(5)
    rows = torch.cat(
        [
            dropout_ce(xc, linear, yc)
            for xc, yc in zip(x.reshape(N, D).split(sizes), y.reshape(N).split(sizes))
        ]
    )
    rows = torch.where(y.reshape(N) != -100, rows, torch.zeros_like(rows))
    ref = rows.reshape(B, T) if reduction == "none" else rows.sum() / (y != -100).sum()
    state_after_ref = torch.get_rng_state()
    ref_grads = _grads(ref, upstream, x, linear)
    for schedule in [None, False] if reduction == "mean" else [None]:
        torch.manual_seed(5)
        out = chunked_linear_loss(
            x,
            linear,
            y,
            dropout_ce,
            chunk_size=sizes,
            reduction=reduction,
            grad_in_forward=schedule,
        )
        assert torch.equal(torch.get_rng_state(), state_after_ref)
        got = _grads(out, upstream, x, linear)
        assert torch.equal(torch.get_rng_state(), state_after_ref)  # backward restored it
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
        _assert_close_all(got, ref_grads, rtol=RTOL, atol=ATOL)
    # Without preserving the state, the re-run draws other masks: the test can tell.
    runs = []
    for preserve in (True, False):
        torch.manual_seed(5)
        out = chunked_linear_loss(
            x,
            linear,
            y,
            dropout_ce,
            chunk_size=sizes,
            reduction="none",
            preserve_rng_state=preserve,
        )
        runs.append((out.detach(), _grads(out, torch.ones(B, T), x, linear)))
    torch.testing.assert_close(runs[0][0], runs[1][0])  # same forward
    assert not torch.allclose(runs[0][1][1], runs[1][1][1])  # other gradients


def test_module_hooks_see_every_chunk_in_forward_and_backward() -> None:
    """The real module runs the re-run (through functional_call): its hooks fire per chunk."""
    x, linear = _setup()
    y = _int_labels()
    calls: list[tuple[int, bool, ChunkInfo | None]] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        calls.append((args[0].shape[0], out.requires_grad, current_chunk()))

    handle = linear.register_forward_hook(hook)
    try:
        out = chunked_linear_loss(x, linear, y, ce, chunk_size=16, reduction="none")
        out.sum().backward()
        linear(x)  # outside: no chunk
    finally:
        handle.remove()
    bounds = [(0, 16), (16, 32), (32, 40)]
    assert calls == [
        *[(b - a, False, ChunkInfo((B, T), a, b, False)) for a, b in bounds],  # forward
        *[(b - a, True, ChunkInfo((B, T), a, b, True)) for a, b in bounds],  # backward re-run
        (B, True, None),
    ]
    assert current_chunk() is None


def test_double_backward_raises() -> None:
    x, linear = _setup()
    y = _int_labels()
    for reduction, schedule in [("mean", None), ("mean", False), ("none", None)]:
        out = chunked_linear_loss(
            x, linear, y, ce, chunk_size=7, reduction=reduction, grad_in_forward=schedule
        )
        with pytest.raises(DoubleBackwardError, match="create_graph=True"):
            torch.autograd.grad(out.sum(), x, create_graph=True)


# --- errors ----------------------------------------------------------------------------------


def _call(**kw: Any) -> torch.Tensor:
    x, linear = _setup()
    args: dict[str, Any] = {"x": x, "linear": linear, "labels": _int_labels(), "fn": ce}
    args.update(kw)
    return chunked_linear_loss(
        args.pop("x"), args.pop("linear"), args.pop("labels"), args.pop("fn"), **args
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"labels": torch.zeros(B, T + 1, dtype=torch.long)}, r"labels has shape \(2, 21\).*40"),
        ({"labels": {"y": torch.zeros(N + 1, dtype=torch.long)}}, r"labels\['y'\]"),
        ({"labels": torch.randn(B, T, V, requires_grad=True)}, r"requires grad.*detach"),
        ({"chunk_size": [10, 10]}, r"sum to 20, but x has 40 rows"),
        ({"chunk_size": 0}, r"positive number of rows"),
        ({"chunk_size": [10, 0, 30]}, r"positive ints"),
        ({"chunk_size": True}, r"int, a list of ints or None"),
        ({"chunk_size": "8"}, r"int, a list of ints or None"),
        ({"chunk_size": 8, "memory_budget_bytes": 1024}, r"not both"),
        ({"memory_budget_bytes": 0}, r"positive int"),
        ({"reduction": "avg"}, r"\['mean', 'none', 'sum'\].*'avg'"),
        ({"reduction": "none", "grad_in_forward": True}, r"scalar loss"),
        ({"fn": lambda x, h, y: F.cross_entropy(h(x), y)}, r"one loss per row.*shape \(40,\)"),
        ({"fn": lambda x, h, y: h(x)}, r"shape \(40,\), got \(40, 11\)"),
        ({"fn": lambda x, h, y: y}, r"floating-point"),
        ({"x": torch.randn(D)}, r"at least one row dimension"),
        ({"x": torch.randn(B, T, D + 1)}, r"9 features.*\(11, 8\)"),
        ({"linear": torch.randn(V, D)}, r"head module"),
        ({"linear": nn.ReLU()}, r"weight tensor"),
    ],
)
def test_clear_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InputError, match=match):
        _call(**kwargs)


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        _call(reduction="avg")


# --- memory: no tensor ever holds all rows' logits -------------------------------------------


class _MaxNumel(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize(
    ("reduction", "schedule"), [("mean", None), ("mean", False), ("none", None)]
)
def test_no_tensor_holds_all_rows_logits(reduction: str, schedule: bool | None) -> None:
    n_rows, d, vocab, chunk = 96, 16, 1000, 8  # N*V = 96,000 > weight V*d = 16,000
    head = nn.Linear(d, vocab)
    x = torch.randn(n_rows, d, requires_grad=True)
    y = torch.randint(0, vocab, (n_rows,))
    with _MaxNumel() as naive:
        F.cross_entropy(head(x).float(), y).backward()
    assert naive.max_numel >= n_rows * vocab
    with _MaxNumel() as chunked:
        out = chunked_linear_loss(
            x, head, y, ce, chunk_size=chunk, reduction=reduction, grad_in_forward=schedule
        )
        out.sum().backward()
    assert chunked.max_numel <= max(chunk * vocab, vocab * d)  # a chunk's logits, or the weight
    assert chunked.max_numel < n_rows * vocab


# --- hypothesis over shapes ------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    d=st.integers(1, 6),
    vocab=st.integers(2, 9),
    chunk=st.integers(1, 12),
    bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    seed=st.integers(0, 2**16),
)
def test_shapes_property(
    lead: list[int], d: int, vocab: int, chunk: int, bias: bool, reduction: str, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(d, vocab, bias=bias)
    x = torch.randn(*lead, d, generator=g).requires_grad_()
    y = torch.randint(-1, vocab, tuple(lead), generator=g)  # -1: ignored
    logits = head(x).float()  # (..., V)
    ref_rows = F.cross_entropy(
        logits.reshape(-1, vocab), y.reshape(-1), ignore_index=-1, reduction="none"
    ).reshape(lead)
    if reduction == "none":
        ref = ref_rows
    elif reduction == "sum":
        ref = ref_rows.sum()
    else:
        ref = ref_rows.sum() / (y != -1).sum().clamp_min(1)
    upstream = torch.randn(ref.shape, generator=g)
    params = [x, *head.parameters()]
    want = torch.autograd.grad((ref * upstream).sum(), params)

    def fn(xc: torch.Tensor, h: nn.Module, yc: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(h(xc).float(), yc, ignore_index=-1, reduction="none")

    out = chunked_linear_loss(
        x, head, y, fn, chunk_size=chunk, reduction=reduction, ignore_index=-1
    )
    got = torch.autograd.grad((out * upstream).sum(), params)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# --- a tiny Llama trained with either head ---------------------------------------------------


def test_tiny_llama_chunked_head_follows_naive_loss_curve() -> None:
    config = LlamaConfig(
        vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_seq_len=32
    )
    g = torch.Generator().manual_seed(3)
    # Learnable data: 8 fixed sequences, 4 drawn per batch, 20 batches of (B, T + 1).
    corpus = torch.randint(0, config.vocab_size, (8, 33), generator=g)  # (8, T + 1)
    data = corpus[torch.randint(0, 8, (20, 4), generator=g)]  # (20, B, T + 1)

    def train(chunked: bool) -> list[float]:
        model = tiny_llama(config, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        curve = []
        for batch in data:
            tokens, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
            targets = targets.clone()
            targets[:, :3] = -100  # a "prompt" without loss
            hidden = model.hidden(tokens)  # (B, T, D)
            if chunked:
                loss = chunked_linear_loss(hidden, model.lm_head, targets, ce, chunk_size=24)
            else:
                logits = model.lm_head(hidden).float()  # (B, T, V)
                loss = F.cross_entropy(logits.transpose(1, 2), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        return curve

    naive, chunked = train(False), train(True)
    assert naive[-1] < naive[0] - 0.5  # it learns
    for step, (a, b) in enumerate(zip(naive, chunked)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: naive {a}, chunked {b}"


# --- per-datum recording through the chunked head --------------------------------------------


def _recording_case() -> tuple[LlamaConfig, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer Llama's config and a batch: tokens, targets with a 4-token prompt ignored
    in datum 0, and the mask of the counted tokens, each (3, 12)."""
    config = LlamaConfig(
        vocab_size=40, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_seq_len=16
    )
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, config.vocab_size, (3, 12), generator=g)  # (B, T)
    targets = torch.randint(0, config.vocab_size, (3, 12), generator=g)  # (B, T)
    targets[0, :4] = -100
    return config, tokens, targets, targets != -100


def test_per_datum_gradients_recorded_through_chunked_head(tmp_path: Path) -> None:
    import gradlog

    config, tokens, targets, mask = _recording_case()
    recorded = {}
    for chunked in (False, True):
        model = tiny_llama(config, seed=1)
        path = tmp_path / f"chunked{chunked}.gradlog"
        with gradlog.GradRecorder(model, path, backend="loop", params="lm_head.*") as rec:
            hidden = model.hidden(tokens)  # (B, T, D)
            if chunked:
                losses = chunked_linear_loss(
                    hidden, model.lm_head, targets, ce, chunk_size=5, reduction="none"
                )  # (B, T)
            else:
                losses = F.cross_entropy(
                    model.lm_head(hidden).transpose(1, 2), targets, reduction="none"
                )  # (B, T)
            rec.backward(losses, mask=mask)
        recorded[chunked] = gradlog.open(path).grads("lm_head.weight", step=0)
    assert recorded[True].shape == (3, config.vocab_size, config.dim)
    torch.testing.assert_close(
        torch.from_numpy(recorded[True]),
        torch.from_numpy(recorded[False]),
        rtol=RTOL,
        atol=ATOL,
    )


def test_recording_through_chunked_head_under_bf16_autocast(tmp_path: Path) -> None:
    """Under autocast the head's weight gradient takes the in-place path: recording through it
    (hooks backend, every check on every step) leaves ``p.grad`` as without recording, and the
    per-datum head gradients are a float32 unchunked run's within bf16 rounding."""
    import gradlog

    config, tokens, targets, mask = _recording_case()

    def losses_of(model: nn.Module, chunked: bool) -> torch.Tensor:
        hidden = model.hidden(tokens)  # (B, T, D)
        if chunked:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return chunked_linear_loss(
                    hidden, model.lm_head, targets, ce, chunk_size=5, reduction="none"
                )  # (B, T)
        return F.cross_entropy(model.lm_head(hidden).transpose(1, 2), targets,
                               reduction="none")  # (B, T)

    plain = tiny_llama(config, seed=1)
    per_datum = (losses_of(plain, True) * mask).sum(1) / mask.sum(1)  # (B,): token means
    per_datum.mean().backward()  # the batch loss GradRecorder.backward runs
    runs, grads = {}, {}
    for chunked in (True, False):
        model = tiny_llama(config, seed=1)
        path = tmp_path / f"autocast{chunked}.gradlog"
        with gradlog.GradRecorder(model, path, params="lm_head.*", check_every=1) as rec:
            rec.backward(losses_of(model, chunked), mask=mask)
        runs[chunked] = gradlog.open(path).grads("lm_head.weight", step=0)  # (B, V, D)
        grads[chunked] = model.lm_head.weight.grad
    torch.testing.assert_close(grads[True], plain.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
    rec16, rec32 = (torch.from_numpy(runs[c]).double() for c in (True, False))
    err = (rec16 - rec32).flatten(1).norm(dim=1) / rec32.flatten(1).norm(dim=1)  # (B,)
    assert float(err.max()) < 2e-2, err  # bf16 rounding of the head's operands
    assert float(err.min()) > 0  # really bf16: not the float32 run again


@pytest.mark.parametrize("backend", ["hooks", "loop"])
def test_recording_a_head_on_a_frozen_body_under_bf16_autocast(
        tmp_path: Path, backend: str) -> None:
    """Only the head trains (a frozen body: features without grad): per-datum head gradients
    within bf16 of a float32 run, every check on. The 16-bit path once left them zero (hooks
    refused, loop stored zeros); the loop backend's self-check, which reads autocast off the
    losses' graph, saw only the head's float32 losses and refused correct records."""
    import gradlog

    config, tokens, targets, mask = _recording_case()
    runs = {}
    for amp in (True, False):
        model = tiny_llama(config, seed=1)
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("lm_head"))
        path = tmp_path / f"{backend}{amp}.gradlog"
        with gradlog.GradRecorder(model, path, params="lm_head.*", backend=backend,
                                  check_every=1) as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                losses = chunked_linear_loss(model.hidden(tokens), model.lm_head, targets, ce,
                                             chunk_size=5, reduction="none")  # (B, T)
            rec.backward(losses, mask=mask)
        runs[amp] = torch.from_numpy(gradlog.open(path).grads("lm_head.weight", step=0))
    rec16, rec32 = runs[True].double(), runs[False].double()
    err = (rec16 - rec32).flatten(1).norm(dim=1) / rec32.flatten(1).norm(dim=1)  # (B,)
    assert float(rec32.flatten(1).norm(dim=1).min()) > 0
    assert float(err.max()) < 2e-2, err


# --- peak memory, measured (slow) ------------------------------------------------------------


@pytest.mark.slow
def test_peak_memory_at_least_halved() -> None:
    """Peak RSS of one step, each method in a fresh process (the benchmark's child)."""
    bench = Path(__file__).parent / "benchmarks" / "bench_memory.py"
    sizes = ["--B", "2", "--T", "1024", "--d", "256", "--V", "32768", "--mem-reps", "1"]
    extra = {}
    for name in ("naive", "chunked 256", "chunked 256 none"):
        done = subprocess.run(
            [sys.executable, str(bench), "--child", f"head:{name}", *sizes],
            capture_output=True,
            text=True,
            check=True,
        )
        extra[name] = json.loads(done.stdout.strip().splitlines()[-1])["extra"]
    assert extra["chunked 256"] <= 0.5 * extra["naive"], extra
    assert extra["chunked 256 none"] <= 0.5 * extra["naive"], extra


# --- peak memory by default, counted tensor by tensor ------------------------------------------
# TensorPeak counts the bytes of every tensor the step allocates (forward and backward) while
# it lives; on the meta device the same operators run without data, so the puzzle's sizes
# (batch 4, length 512, hidden 1024: 2,048 rows) cost no memory and no arithmetic here.


def _head_step(
    device: str, n_rows: int, d: int, vocab: int, method: str, dtype: torch.dtype = torch.float32
) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """(peak bytes, loss, [grad x, grad weight, grad bias]) of one forward and backward."""
    torch.manual_seed(0)
    head = nn.Linear(d, vocab, device=device, dtype=dtype)
    x = torch.randn(4, n_rows // 4, d, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, vocab, (4, n_rows // 4), device=device)
    y[:, :7] = -100
    wide = torch.promote_types(dtype, torch.float32)  # the loss's upcast: float32 or float64

    def row_ce(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(linear(x).to(wide), y, reduction="none")

    with TensorPeak() as mem:
        if method == "naive":
            loss = F.cross_entropy(head(x).flatten(0, 1).to(wide), y.flatten())
        elif method == "none":
            losses = chunked_linear_loss(x, head, y, row_ce, reduction="none")
            loss = losses.sum() / (y != -100).sum()
        else:
            loss = chunked_linear_loss(x, head, y, row_ce)  # the defaults
        loss.backward()
    grads = [x.grad, head.weight.grad, head.bias.grad]
    return mem.peak, loss.detach(), [g for g in grads if g is not None]


@pytest.mark.parametrize(("vocab", "at_most"), [(32_000, 0.5), (128_000, 0.2)])
@pytest.mark.parametrize("method", ["mean", "none"])
def test_default_peak_at_the_puzzle_size(vocab: int, at_most: float, method: str) -> None:
    """>= 50% less peak memory than unchunked at 32K by default, >= 80% at 128K."""
    naive, _, _ = _head_step("meta", 2048, 1024, vocab, "naive")
    chunked, _, _ = _head_step("meta", 2048, 1024, vocab, method)
    assert naive >= 2048 * vocab * 4 * 2  # at least two tensors of all rows' logits
    assert chunked <= at_most * naive, (chunked / 2**20, naive / 2**20)


def test_tensor_peak_on_meta_equals_cpu() -> None:
    """The meta figures above are what the same step allocates on CPU."""
    for method in ("naive", "mean", "none"):
        cpu, _, _ = _head_step("cpu", 64, 16, 20_000, method)
        meta, _, _ = _head_step("meta", 64, 16, 20_000, method)
        assert cpu == meta > 64 * 16 * 4, method


def test_no_weight_sized_gradient_per_chunk() -> None:
    """The weight gradient is accumulated in place: one weight-sized tensor, not one per chunk."""
    n_rows, d, vocab = 64, 256, 4000  # weight 4 MB; a chunk's logits 8 x 4000 x 4 = 128 KB
    head = nn.Linear(d, vocab, bias=False)
    x = torch.randn(n_rows, d, requires_grad=True)
    y = torch.randint(0, vocab, (n_rows,))
    for schedule in (None, False):
        with TensorPeak() as mem:
            chunked_linear_loss(x, head, y, ce, chunk_size=8, grad_in_forward=schedule).backward()
        weight_bytes = vocab * d * 4
        assert weight_bytes <= mem.peak < 1.5 * weight_bytes, (schedule, mem.peak)
        head.weight.grad = None


@pytest.mark.parametrize("method", ["mean", "none"])
def test_default_chunking_is_exact_in_float64(method: str) -> None:
    """Several default chunks (262 rows at V 16K): loss and gradients as unchunked, float64."""
    _, loss, grads = _head_step("cpu", 600, 8, 16_000, method, torch.float64)
    _, ref_loss, ref = _head_step("cpu", 600, 8, 16_000, "naive", torch.float64)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-13)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-14)


@pytest.mark.slow
def test_default_peak_at_the_puzzle_size_on_cpu() -> None:
    """The puzzle's test size on CPU, float32: counted peak and the gradients of naive."""
    naive, ref_loss, ref = _head_step("cpu", 2048, 1024, 32_000, "naive")
    chunked, loss, grads = _head_step("cpu", 2048, 1024, 32_000, "mean")
    assert chunked <= 0.5 * naive, (chunked / 2**20, naive / 2**20)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
