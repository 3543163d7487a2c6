"""LayerNorm classes of libraries and users (gradlog/rules/layer_norm.py, ``layer_norm_like``):
transformers' Cohere (no bias, float32), Nemotron (``1 + w``), DeBERTa, ConvNeXt (channels
last and first) and Pix2Struct (an RMS norm named LayerNorm) norms in closed form against
the loop oracle; a forward other than the formulas (an unbiased variance, an instance norm)
is replayed, caught and re-run per datum; whole Cohere and Nemotron models from configs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradlog.rules.func as func
from gradlog.rules import find_rule
from gradlog.testing.oracle import assert_like_loop

transformers = pytest.importorskip("transformers")

D64 = torch.float64
Counter = Callable[[Any, str], list[int]]  # (conftest's calls_to)


def _norm(kind: str, d: int) -> nn.Module:
    if kind == "cohere":
        from transformers.models.cohere.modeling_cohere import CohereLayerNorm
        return CohereLayerNorm(d, eps=1e-5)
    if kind == "nemotron":
        from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
        return NemotronLayerNorm1P(d, eps=1e-5)
    if kind == "deberta":
        from transformers.models.deberta.modeling_deberta import DebertaLayerNorm
        return DebertaLayerNorm(d, eps=1e-7)
    if kind == "convnext":
        from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
        return ConvNextLayerNorm(d, eps=1e-6)
    if kind == "pix2struct":
        from transformers.models.pix2struct.modeling_pix2struct import Pix2StructLayerNorm
        return Pix2StructLayerNorm(d, eps=1e-6)
    raise KeyError(kind)


class _Block(nn.Module):
    """A Linear, then the norm on (B, T, d)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.up(x))


def _losses(model: nn.Module, B: int = 3, T: int = 5) -> Callable[[], torch.Tensor]:
    x = torch.randn(B, T, 4, dtype=D64, generator=torch.Generator().manual_seed(1))
    return lambda: (model(x) ** 3).flatten(1).sum(1)  # (B,)


@pytest.mark.parametrize("kind", ["cohere", "nemotron", "deberta", "convnext", "pix2struct"])
def test_library_layer_norms_use_the_formula_and_equal_the_loop(
        kind: str, calls_to: Counter) -> None:
    torch.manual_seed(0)
    norm = _norm(kind, 6)
    with torch.no_grad():  # (initial values tell w from 1 + w, or a bias, from nothing)
        for p in norm.parameters():
            p.normal_()
    model = _Block(norm).double()
    calls = calls_to(func, "generic")
    # (Cohere's, DeBERTa's and Pix2Struct's normalise in float32: float32 tolerances)
    described = assert_like_loop(model, _losses(model), reductions=("mean", "sum"),
                                 rtol=1e-4, atol=1e-7)
    assert {m["module"]: m["rule"] for m in described["modules"]}["norm"] == "layer_norm_like"
    assert not described["fallback"]
    assert not calls


class _ChannelsFirst(nn.Module):
    """A conv, then ConvNeXt's norm over the channels of (B, C, H, W)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

        self.conv = nn.Conv2d(2, 6, 3)
        self.norm = ConvNextLayerNorm(6, eps=1e-6, data_format="channels_first")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class OtherLayerNorm(nn.Module):
    """Named like a LayerNorm, computing something else: the unbiased variance (n - 1), the
    bias added before the weight scales, or each channel normalised over its positions."""

    def __init__(self, d: int, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))
        self.eps = 1e-6
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "over_space":  # (B, C, H, W)
            centred = x - x.mean((2, 3), keepdim=True)
            x_hat = centred / torch.sqrt(x.var((2, 3), unbiased=False, keepdim=True) + self.eps)
            return self.weight[:, None, None] * x_hat + self.bias[:, None, None]
        centred = x - x.mean(-1, keepdim=True)
        if self.kind == "unbiased":
            return self.weight * centred / torch.sqrt(x.var(-1, keepdim=True) + self.eps) + (
                self.bias)
        x_hat = centred / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + self.eps)
        return self.weight * (x_hat + self.bias)


def test_convnext_channels_first_norm_uses_the_formula(calls_to: Counter) -> None:
    """ConvNeXt's norm over the channels of (B, C, H, W) (its stem and downsampling layers)
    was re-run per datum: each datum's weight gradient sums over H and W."""
    torch.manual_seed(0)
    model = _ChannelsFirst().double()
    with torch.no_grad():
        for p in model.norm.parameters():
            p.normal_()
    x = torch.randn(3, 2, 5, 5, dtype=D64, generator=torch.Generator().manual_seed(1))
    calls = calls_to(func, "generic")
    # (transformers before 5 normalised channels first in float32: float32 tolerances)
    described = assert_like_loop(model, lambda: (model(x) ** 3).flatten(1).sum(1),
                                 reductions=("mean", "sum"), rtol=1e-4, atol=1e-7)
    assert {m["module"]: m["rule"] for m in described["modules"]}["norm"] == "layer_norm_like"
    assert not described["fallback"]
    assert not calls


class _OverSpace(nn.Module):
    """Named like a LayerNorm, normalising each channel over its positions (an instance
    norm): no formula's ``x_hat``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3)
        self.norm = OtherLayerNorm(6, "over_space")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


@pytest.mark.parametrize("kind", ["unbiased", "bias_first", "over_space"])
def test_a_forward_other_than_the_formulas_is_re_run(kind: str, calls_to: Counter) -> None:
    torch.manual_seed(0)
    if kind == "over_space":
        model: nn.Module = _OverSpace().double()
        x = torch.randn(3, 2, 5, 5, dtype=D64, generator=torch.Generator().manual_seed(1))

        def losses() -> torch.Tensor:
            return (model(x) ** 3).flatten(1).sum(1)
    else:
        model = _Block(OtherLayerNorm(6, kind)).double()
        losses = _losses(model)
    assert find_rule(model.norm).name == "layer_norm_like"
    calls = calls_to(func, "generic")
    described = assert_like_loop(model, losses, reductions=("mean",))
    assert calls
    assert "norm" in described["fallback"]


def test_what_is_not_a_layer_norm_gets_no_such_rule() -> None:
    class WideLayerNorm(nn.Module):  # (a 2-D weight: per head)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2, 4))
            self.eps = 1e-6

    class ScaledLayerNorm(nn.Module):  # (a third parameter)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.bias = nn.Parameter(torch.zeros(4))
            self.scale = nn.Parameter(torch.ones(()))
            self.eps = 1e-6

    class NormLayer(nn.Module):  # (another name)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.bias = nn.Parameter(torch.zeros(4))
            self.eps = 1e-6

    assert find_rule(WideLayerNorm()) is None
    assert find_rule(ScaledLayerNorm()) is None
    assert find_rule(NormLayer()) is None
    assert find_rule(nn.LayerNorm(4)).name == "layer_norm"


@pytest.mark.parametrize("family", ["cohere", "nemotron"])
def test_cohere_and_nemotron_record_their_norms_in_closed_form(family: str) -> None:
    """Both re-ran every norm per datum (`torch.func`): now none is, and the models agree
    with the loop in training mode with attention dropout."""
    t = transformers
    common = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                  attention_dropout=0.1)
    if family == "cohere":
        config, cls = t.CohereConfig(**common, use_qk_norm=False), t.CohereForCausalLM
    else:
        config, cls = t.NemotronConfig(**common, head_dim=8), t.NemotronForCausalLM
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config).to(D64).train()
        for name, p in model.named_parameters():
            if "norm" in name:
                nn.init.normal_(p)
    ids = torch.randint(1, 40, (3, 6), generator=torch.Generator().manual_seed(1))

    def losses() -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1]  # (B, T-1, V)
        return nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:],
                                           reduction="none").mean(1)

    described = assert_like_loop(model, losses, reductions=("mean",), rtol=1e-4, atol=1e-6)
    assert not described["fallback"]
    assert any(m["rule"] == "layer_norm_like" for m in described["modules"])
