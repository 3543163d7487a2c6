"""RMSNorm classes of libraries and users (gradlog/rules/layer_norm.py, ``rms_norm_like``):
transformers' Llama, Gemma (``1 + w``), T5 and per-head (Qwen3's q_norm) norms in closed form
against the loop oracle; a forward other than the formula is replayed, caught and re-run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradlog.rules.func as func
from gradlog.rules import find_rule
from gradlog.testing.oracle import assert_like_loop, backend_grads

transformers = pytest.importorskip("transformers")

D64 = torch.float64
Counter = Callable[[Any, str], list[int]]  # (conftest's calls_to)


def _norm(kind: str, d: int) -> nn.Module:
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        return LlamaRMSNorm(d, eps=1e-5)
    if kind == "gemma":
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        return GemmaRMSNorm(d, eps=1e-6)
    if kind == "t5":
        from transformers.models.t5.modeling_t5 import T5LayerNorm
        return T5LayerNorm(d, eps=1e-6)
    raise KeyError(kind)


class _Block(nn.Module):
    """A Linear, then the norm (on (B, T, d), or per head on (B, T, heads, d / heads))."""

    def __init__(self, norm: nn.Module, heads: int = 1) -> None:
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.norm = norm
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.heads > 1:
            h = h.unflatten(-1, (self.heads, -1))
        return self.norm(h).flatten(2)


def _losses(model: nn.Module, B: int = 3, T: int = 5) -> Callable[[], torch.Tensor]:
    x = torch.randn(B, T, 4, dtype=D64, generator=torch.Generator().manual_seed(1))
    return lambda: (model(x) ** 3).flatten(1).sum(1)  # (B,)


@pytest.mark.parametrize(("kind", "heads"), [("llama", 1), ("gemma", 1), ("t5", 1),
                                             ("llama", 2)])
def test_library_rms_norms_use_the_formula_and_equal_the_loop(
        kind: str, heads: int, calls_to: Counter) -> None:
    torch.manual_seed(0)
    norm = _norm(kind, 6 // heads)
    with torch.no_grad():
        norm.weight.normal_()  # (Gemma's starts at 0, Llama's at 1: neither tells w from 1 + w)
    model = _Block(norm, heads).double()
    calls = calls_to(func, "generic")
    # (transformers normalises in float32 whatever the model's dtype: float32 tolerances)
    described = assert_like_loop(model, _losses(model), reductions=("mean", "sum"),
                                 rtol=1e-4, atol=1e-7)
    assert {m["module"]: m["rule"] for m in described["modules"]}["norm"] == "rms_norm_like"
    assert not calls


class OtherRMSNorm(nn.Module):
    """Named like an RMSNorm, computing something else: normalised by the mean absolute
    value; 5% off (which 16-bit rounding could hide); or the input scaled by ``1 + w``
    before the normalisation, from a zero weight (transformers' MuseSpark input norm: at
    ``w = 0`` it equals ``x_hat``, and ``(1 + w) * x_hat`` too)."""

    def __init__(self, d: int, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d) if kind == "before" else torch.randn(d))
        self.eps = 1e-6
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mean_abs":
            return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)
        if self.kind == "before":
            x = x * (1 + self.weight)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "in 16 bits":  # (3% off only there: a float64 replay cannot see it)
            return (1.03 if torch.finfo(x.dtype).bits <= 16 else 1.0) * self.weight * y
        return y if self.kind == "before" else 1.05 * self.weight * y


class GatedRMSNorm(nn.Module):
    """Mamba-2's: the input gated before the normalisation (a second argument)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = x * torch.sigmoid(gate)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("kind", ["mean_abs", "scaled", "before"])
def test_a_forward_other_than_the_formula_is_re_run(kind: str,
                                                    calls_to: Counter) -> None:
    torch.manual_seed(0)
    model = _Block(OtherRMSNorm(6, kind)).double()
    assert find_rule(model.norm).name == "rms_norm_like"
    calls = calls_to(func, "generic")
    assert_like_loop(model, _losses(model), reductions=("mean",))
    assert calls


@pytest.mark.parametrize("kind", ["llama", "in 16 bits"])
def test_bf16_norms_are_also_compared_as_they_run(kind: str, calls_to: Counter) -> None:
    """A bf16 norm passes the float64 replay whatever it does in 16 bits; it is also run
    as it is, on the call, and compared with the formula in aggregate: a norm 3% off only
    in bf16 is re-run per datum, transformers' LlamaRMSNorm uses the formula."""
    torch.manual_seed(0)
    norm = _norm("llama", 6) if kind == "llama" else OtherRMSNorm(6, kind)
    model = _Block(norm).bfloat16()
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    calls = calls_to(func, "generic")
    backend_grads(model, lambda: (model(x).float() ** 3).flatten(1).sum(1), "hooks", "mean")
    assert bool(calls) == (kind != "llama")


def test_a_gated_norm_is_re_run(calls_to: Counter) -> None:
    torch.manual_seed(0)
    norm, up = GatedRMSNorm(6).double(), nn.Linear(4, 12).double()
    model = nn.ModuleDict({"norm": norm, "up": up})
    x = torch.randn(3, 5, 4, dtype=D64, generator=torch.Generator().manual_seed(1))

    def losses() -> torch.Tensor:
        h, gate = up(x).chunk(2, -1)
        return (norm(h, gate) ** 3).flatten(1).sum(1)

    calls = calls_to(func, "generic")
    assert_like_loop(model, losses, reductions=("mean",))
    assert calls


def test_what_is_not_an_rms_norm_gets_no_such_rule() -> None:
    class RMSNorm(nn.Module):  # (a bias too)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.bias = nn.Parameter(torch.zeros(4))
            self.eps = 1e-6

    class NormLayer(nn.Module):  # (another name)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.eps = 1e-6

    assert find_rule(RMSNorm()) is None
    assert find_rule(NormLayer()) is None


def test_the_replay_compares_element_by_element_and_never_trusts_16_bits() -> None:
    """Rounding passes; a formula 5% off, or off where outputs cancel, does not; nothing in
    16 bits does (a correct bf16 forward rounds as much as a formula a few percent off)."""
    from gradlog.rules.replay import close

    g = torch.Generator().manual_seed(0)
    ours = torch.randn(64, 512, dtype=D64, generator=g)
    rounded = ours.float().double()
    assert close(rounded, ours, 512, torch.float32)
    assert not close(1.05 * ours, ours, 512, torch.float32)
    shifted = ours.clone()
    shifted[0, 0] += 1e-2 * ours.abs().max()  # (one element off)
    assert not close(shifted, ours, 512, torch.float32)
    assert not close(ours.bfloat16(), ours, 512, torch.float32)
    assert not close(ours, ours, 512, torch.bfloat16)
