"""Language-model scale (issue 6, part 2): recording chosen layers of a deep model without
paying for the rest, models the user froze, activation checkpointing, bf16 autocast and LoRA,
on every backend where it applies, against the per-datum oracle."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradlog
from gradlog.backends import BACKENDS
from gradlog.backends.base import LOW_PRECISION_RTOL, Backend
from gradlog.backends.hooks import HooksBackend
from gradlog.demo.model import CharGPT
from gradlog.errors import BackendError, FrozenParamError, InputError, ParamSelectionError
from gradlog.losses import per_datum_losses
from gradlog.params import select_params
from gradlog.testing.oracle import naive_per_datum_grads
from gradlog.testing.zoo import gpt_batch, per_token_ce, tiny_gpt

D64 = torch.float64
AUTOGRAD_MESSAGES = (
    "does not require grad and does not have a grad_fn",
    "One of the differentiated Tensors does not require grad",
)


# -- helpers ---------------------------------------------------------------------------------
def make_backend(
    name: str, model: nn.Module, params: str | list[str] = "*", reduction: str = "mean"
) -> Backend:
    patterns = [params] if isinstance(params, str) else params
    be = BACKENDS[name](
        model, select_params(model, patterns), batch_reduction=reduction, randomness="different"
    )
    be.attach()
    return be


def gpt_losses(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per-datum losses (B,) of a CharGPT batch: mean cross entropy over unmasked tokens."""
    x, y, mask = batch
    return per_datum_losses(per_token_ce(model(x), y), mask, "mean")


def backend_grads(
    name: str,
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    params: str | list[str] = "*",
    reduction: str = "mean",
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = gpt_losses,
) -> dict[str, torch.Tensor]:
    """Per-datum gradients from backend ``name`` on one batch (p.grad zeroed first)."""
    be = make_backend(name, model, params, reduction)
    try:
        model.zero_grad(set_to_none=True)
        if be.needs_loss_fn:
            return be.step(loss_fn, batch, lambda raw, _: raw, None, lambda _: None)[1]
        losses = loss_fn(model, batch)
        return be.backward(losses, be.reduce_batch(losses))
    finally:
        be.detach()


def oracle(
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    params: str = "*",
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = gpt_losses,
) -> dict[str, torch.Tensor]:
    """Each datum's own forward and backward (batch of one)."""
    chosen = select_params(model, [params])

    def datum_loss(b: int) -> torch.Tensor:
        return loss_fn(model, tuple(t[b : b + 1] for t in batch))[0]

    return naive_per_datum_grads(datum_loss, chosen, batch[0].shape[0])


def assert_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-7
) -> None:
    assert set(got) == set(want)
    for name, w in want.items():  # atol: key biases have exactly zero gradient, ~1e-20 noise
        torch.testing.assert_close(
            got[name], w, rtol=rtol, atol=rtol * 1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks for m in model.modules()) and all(
        not p._backward_hooks for p in model.parameters()
    )


# -- 1. recording chosen layers of a deep model ----------------------------------------------
def deep_gpt(n_layer: int = 12) -> CharGPT:
    return tiny_gpt(n_layer=n_layer, n_embd=8, n_head=2)


def live_captures(be: HooksBackend) -> list[Any]:
    return [c for c in (r() for r in be._live) if c is not None and c.args is not None]


@pytest.mark.parametrize("frozen_rest", [False, True])
def test_hooks_and_captures_exist_only_for_the_recorded_layer(frozen_rest: bool) -> None:
    model = deep_gpt()
    layer = model.blocks[7]
    if frozen_rest:  # the user froze everything else; params="*" then selects layer 7 only
        model.requires_grad_(False)
        layer.requires_grad_(True)
    params = "*" if frozen_rest else "blocks.7.*"
    owners = [m for m in layer.modules() if any(True for _ in m.parameters(recurse=False))]
    assert len(owners) == 8  # ln1, q, k, v, proj, ln2, fc, proj
    be = make_backend("hooks", model, params)
    try:
        assert isinstance(be, HooksBackend)
        # (the root carries the op-level capture's one forward hook, which captures nothing
        # but the uses of recorded parameters outside their modules' calls)
        hooked = [m for m in model.modules() if m._forward_hooks and m is not model]
        assert hooked == owners
        assert len(model._forward_hooks) <= 1
        assert sum(len(m._forward_hooks) for m in owners) == len(owners)
        hooked_params = [p for p in model.parameters() if p._backward_hooks]
        assert hooked_params == list(layer.parameters())  # 16 weights and biases
        described = sorted(m["module"] for m in be.describe()["modules"])
        assert described == sorted(f"blocks.7.{n}" for n, m in layer.named_modules() if m in owners)

        batch = gpt_batch(3, 6)
        model.zero_grad(set_to_none=True)
        losses = gpt_losses(model, batch)
        captured = live_captures(be)
        assert sorted(id(c.entry.module) for c in captured) == sorted(id(m) for m in owners)
        tensors = [t for c in captured for t in c.args if isinstance(t, torch.Tensor)]
        assert len(tensors) == len(owners)  # one input per recorded module call, no more
        grads = be.backward(losses, be.reduce_batch(losses))
        assert set(grads) == {f"blocks.7.{n}" for n, _ in layer.named_parameters()}
        assert live_captures(be) == []  # released as each layer's backward finished
    finally:
        be.detach()
    assert no_hooks_left(model)
    assert_close(grads, oracle(model, batch, params))


def test_captures_live_only_as_long_as_their_graph() -> None:
    """One capture per recorded module call, for as long as the forward's graph lives: forwards
    whose losses are dropped without a backward (evaluation with grad on) hold nothing."""
    model = deep_gpt(n_layer=6)
    be = make_backend("hooks", model, "blocks.0.mlp.fc.weight")
    try:
        assert isinstance(be, HooksBackend)
        kept = [gpt_losses(model, gpt_batch(2, 5, seed=seed)) for seed in range(3)]
        assert len(live_captures(be)) == 3  # one call of blocks.0.mlp.fc per forward
        assert {c.entry.name for c in live_captures(be)} == {"blocks.0.mlp.fc"}
        del kept
        assert live_captures(be) == []
    finally:
        be.detach()


# -- 2. models the user froze ----------------------------------------------------------------
def partly_frozen_gpt() -> CharGPT:
    """Embeddings and block 0 frozen by the user, block 1 and the final norm trained."""
    model = tiny_gpt(n_layer=2, vocab=13)
    model.requires_grad_(False)
    model.blocks[1].requires_grad_(True)
    model.ln_f.requires_grad_(True)
    return model


@pytest.mark.parametrize("backend", ["hooks", "loop", "vmap"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_model_the_user_froze_gets_correct_per_datum_gradients(
    backend: str, reduction: str
) -> None:
    model = partly_frozen_gpt()
    batch = gpt_batch(4, 6, vocab=13)
    want = oracle(model, batch)
    assert set(want) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert_close(backend_grads(backend, model, batch, reduction=reduction), want)


@pytest.mark.parametrize("backend", ["hooks", "loop", "vmap"])
def test_a_model_the_user_froze_recorded_end_to_end(tmp_path: Path, backend: str) -> None:
    model = partly_frozen_gpt()
    batch = gpt_batch(4, 6, vocab=13)
    want = oracle(model, batch)
    with gradlog.GradRecorder(
        model, tmp_path / "r.gradlog", backend=backend, dtype="float64", check_every=1
    ) as rec:
        rec.step(gpt_losses, batch)
    run = gradlog.open(tmp_path / "r.gradlog")
    assert sorted(run.param_names) == sorted(want)
    for name, w in want.items():
        np.testing.assert_allclose(
            run.grads(name, dtype=np.float64), w.numpy(), rtol=1e-7, atol=1e-12, err_msg=name
        )


def test_selecting_only_frozen_parameters_names_them_and_the_fix() -> None:
    model = partly_frozen_gpt()
    with pytest.raises(ParamSelectionError, match=r"only frozen.*blocks\.0.*requires_grad=True"):
        select_params(model, ["blocks.0.*"])


def freeze_after_selection(model: nn.Module) -> None:
    model.blocks[1].mlp.fc.weight.requires_grad_(False)


@pytest.mark.parametrize(
    ("backend", "entry"),
    [
        ("hooks", "backward"),
        ("hooks", "step"),
        ("loop", "backward"),
        ("loop", "step"),
        ("vmap", "step"),
    ],
)  # vmap: rec.step only
def test_a_recorded_parameter_frozen_later_is_named_with_the_fix(
    tmp_path: Path, backend: str, entry: str
) -> None:
    model = partly_frozen_gpt()
    batch = gpt_batch(4, 6, vocab=13)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend=backend) as rec:
        freeze_after_selection(model)  # e.g. a schedule that freezes layers mid-training
        with pytest.raises(FrozenParamError) as info:
            if entry == "backward":
                rec.backward(gpt_losses(model, batch))
            else:
                rec.step(gpt_losses, batch)
        message = str(info.value)
        assert "'blocks.1.mlp.fc.weight'" in message and "requires_grad=False" in message
        assert "params=" in message and "requires_grad_(True)" in message
        assert not any(m in message for m in AUTOGRAD_MESSAGES)
        assert isinstance(info.value, ParamSelectionError) and isinstance(info.value, ValueError)
        assert all(p.grad is None for p in model.parameters())  # refused before any backward
        model.blocks[1].mlp.fc.weight.requires_grad_(True)
        rec.step(gpt_losses, batch)  # unfrozen again: recording goes on
    assert gradlog.open(tmp_path / "r.gradlog").steps.num_rows == 1


@pytest.mark.parametrize("backend", ["hooks", "loop", "vmap"])
def test_backends_refuse_a_frozen_recorded_parameter_themselves(backend: str) -> None:
    """Without the recorder's own check in front: no autograd error, no silent zeros."""
    model = partly_frozen_gpt()
    batch = gpt_batch(3, 5, vocab=13)
    be = make_backend(backend, model)
    try:
        freeze_after_selection(model)
        with pytest.raises(FrozenParamError, match=r"blocks\.1\.mlp\.fc\.weight"):
            if be.needs_loss_fn:
                be.step(gpt_losses, batch, lambda raw, _: raw, None, lambda _: None)
            else:
                losses = gpt_losses(model, batch)
                be.backward(losses, be.reduce_batch(losses))
    finally:
        be.detach()


@pytest.mark.parametrize("backend", ["hooks", "loop"])
def test_losses_without_grad_name_the_parameters_and_the_fixes(backend: str) -> None:
    model = partly_frozen_gpt()
    batch = gpt_batch(3, 5, vocab=13)
    be = make_backend(backend, model)
    try:
        with torch.no_grad():
            losses = gpt_losses(model, batch)
        with pytest.raises(InputError) as info:
            be.backward(losses, losses.mean())
    finally:
        be.detach()
    message = str(info.value)
    assert "do not require grad" in message and "'blocks.1.ln1.weight'" in message
    assert "use_reentrant=False" in message and "enable_input_require_grads" in message
    assert not any(m in message for m in AUTOGRAD_MESSAGES)


# -- 3. activation checkpointing -------------------------------------------------------------
class CheckpointedGPT(CharGPT):
    """CharGPT whose blocks run under ``torch.utils.checkpoint`` (``mode``: None for plain,
    ``"reentrant"`` or ``"non-reentrant"``)."""

    mode: str | None = None

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode is None:
            return super().forward(idx, position_ids)
        pos = torch.arange(idx.shape[1]).unsqueeze(0)  # (1, T), broadcast as in the parent
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, d)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")  # (B, T, d)
        out: torch.Tensor = self.head(self.ln_f(x))  # (B, T, V)
        return out


def checkpointed_gpt(mode: str | None, **kwargs: Any) -> CheckpointedGPT:
    source = tiny_gpt(**kwargs)
    model = CheckpointedGPT(source.config)
    model.load_state_dict(source.state_dict())
    model.mode = mode
    return model.to(D64).eval()


MODES = ["non-reentrant", "reentrant"]


@pytest.mark.parametrize(
    ("mode", "backend"),
    [("non-reentrant", "hooks"), ("reentrant", "hooks"), ("non-reentrant", "loop")],
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_checkpointed_blocks_give_the_plain_per_datum_gradients(
    mode: str, backend: str, reduction: str
) -> None:
    model = checkpointed_gpt(mode, n_layer=2, tie_weights=True)
    plain = copy.deepcopy(model)
    plain.mode = None
    batch = gpt_batch(4, 6)
    want = backend_grads("loop", plain, batch, reduction=reduction)
    assert_close(backend_grads(backend, model, batch, reduction=reduction), want)


def test_loop_with_reentrant_checkpointing_is_refused_with_the_fix(tmp_path: Path) -> None:
    """torch.autograd.grad (one per datum) cannot run through a reentrant checkpoint."""
    model = checkpointed_gpt("reentrant", n_layer=1)
    refused = pytest.raises(BackendError, match=r"use_reentrant=True.*backend='hooks'.*untouched")
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="loop") as rec, refused:
        rec.step(gpt_losses, gpt_batch(3, 5))
    assert all(p.grad is None for p in model.parameters())


def test_loop_refuses_a_reentrant_checkpoint_hiding_its_parameters() -> None:
    """A segment whose inputs do not lead to its parameters in the outer graph: there,
    autograd.grad gave their gradients as None (recorded as zeros, silently)."""
    from torch.utils.checkpoint import checkpoint

    layer = nn.Linear(3, 3)
    x = torch.randn(4, 3)  # (B, 3), no grad
    x0 = torch.zeros(1, requires_grad=True)  # the segment's only input that needs grad

    def segment(x0: torch.Tensor) -> torch.Tensor:
        return layer(x) + 0 * x0

    be = make_backend("loop", layer, "*")
    losses = checkpoint(segment, x0, use_reentrant=True).pow(2).sum(1)  # (B,)
    with pytest.raises(BackendError, match=r"use_reentrant=True.*untouched"):
        be.backward(losses, losses.mean())
    assert layer.weight.grad is None


def test_loop_records_the_layers_outside_a_reentrant_checkpoint() -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.ModuleDict({"trunk": nn.Linear(3, 3), "head": nn.Linear(3, 2)}).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def losses() -> torch.Tensor:
        h = checkpoint(model["trunk"], x, use_reentrant=True)
        return model["head"](torch.tanh(h)).pow(2).sum(1)  # (B,)

    be = make_backend("loop", model, "head.*")
    got = be.backward(losses(), losses().mean())
    hooks = make_backend("hooks", model, "head.*")
    try:
        model.zero_grad()
        out = losses()
        want = hooks.backward(out, out.mean())
    finally:
        hooks.detach()
    torch.testing.assert_close(got["head.weight"], want["head.weight"])


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_recomputation_is_not_captured_twice(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    model = checkpointed_gpt(mode, n_layer=2)
    computed: list[str] = []
    original = HooksBackend._add

    def counting(self: HooksBackend, entry: Any, *args: Any, **kwargs: Any) -> None:
        computed.append(entry.name)
        original(self, entry, *args, **kwargs)

    monkeypatch.setattr(HooksBackend, "_add", counting)
    owners = [  # 8 modules per block, 16 in all
        n for n, m in model.blocks.named_modules() if any(True for _ in m.parameters(recurse=False))
    ]
    be = make_backend("hooks", model, "blocks.*")
    try:
        assert isinstance(be, HooksBackend)
        losses = gpt_losses(model, gpt_batch(4, 6))
        # non-reentrant: captured in the forward; reentrant: the forward runs without grad
        assert len(be._live) == (len(owners) if mode == "non-reentrant" else 0)
        be.backward(losses, be.reduce_batch(losses))
        assert len(be._live) == len(owners)  # the recomputation captured nothing more
        assert live_captures(be) == []
    finally:
        be.detach()
    assert sorted(computed) == sorted(f"blocks.{n}" for n in owners)  # each module once


def test_checkpointed_and_plain_runs_record_equal_per_datum_gradients(tmp_path: Path) -> None:
    """End to end through the store, three steps of SGD, with the self-check on every step."""
    runs = {}
    for mode in (None, *MODES):
        model = checkpointed_gpt(mode, n_layer=2, tie_weights=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        path = tmp_path / f"{mode}.gradlog"
        with gradlog.GradRecorder(model, path, dtype="float64", check_every=1) as rec:
            for seed in range(3):
                x, y, mask = gpt_batch(4, 6, seed=seed)
                rec.backward(per_token_ce(model(x), y), mask=mask)
                opt.step()
                opt.zero_grad()
        runs[mode] = gradlog.open(path)
    plain = runs[None]
    for mode in MODES:
        assert runs[mode].param_names == plain.param_names
        for name in plain.param_names:
            np.testing.assert_allclose(
                runs[mode].grads(name, dtype=np.float64),
                plain.grads(name, dtype=np.float64),
                rtol=1e-9,
                atol=1e-15,
                err_msg=f"{mode}: {name}",
            )


@pytest.mark.parametrize("mode", MODES)
def test_vmap_with_checkpointing_is_refused_with_the_fix(tmp_path: Path, mode: str) -> None:
    model = checkpointed_gpt(mode, n_layer=1)
    refused = pytest.raises(BackendError, match=r"torch\.utils\.checkpoint.*backend='hooks'")
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="vmap") as rec, refused:
        rec.step(gpt_losses, gpt_batch(3, 5))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_after_a_frozen_embedding_names_the_fix(tmp_path: Path) -> None:
    """The classic trap: a reentrant checkpoint whose input does not require grad (frozen
    embeddings) returns an output without grad, so nothing inside it can be differentiated."""
    model = checkpointed_gpt("reentrant", n_layer=2)
    model.requires_grad_(False)
    model.blocks.requires_grad_(True)  # train (and record) the blocks only
    batch = gpt_batch(3, 5)
    for backend in ("hooks", "loop"):
        with gradlog.GradRecorder(model, tmp_path / f"{backend}.gradlog", backend=backend) as rec:
            with pytest.raises(InputError, match=r"use_reentrant=True.*use_reentrant=False"):
                rec.backward(gpt_losses(model, batch))
            with pytest.raises(InputError, match="enable_input_require_grads"):
                rec.step(gpt_losses, batch)
    model.mode = "non-reentrant"  # the fix: the blocks' gradients reach them again
    want = oracle(model, batch)
    assert_close(backend_grads("hooks", model, batch), want)


# -- 4. bf16 autocast ------------------------------------------------------------------------
def autocast_gpt_losses(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y, mask = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)  # (B, T, V) bf16
    return per_datum_losses(per_token_ce(logits.float(), y), mask, "mean")


def relative_errors(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Per parameter: the median over datums of |g_b - want_b| / |want_b|, for parameters
    whose gradient is not analytically zero (attention key biases are pure noise)."""
    largest = max(float(w.norm()) for w in want.values())
    out = {}
    for name, w in want.items():
        if float(w.norm()) < 1e-6 * largest:
            continue
        B = w.shape[0]
        w64, g64 = w.detach().double().reshape(B, -1), got[name].detach().double().reshape(B, -1)
        out[name] = float(((g64 - w64).norm(dim=1) / w64.norm(dim=1)).median())  # of (B,)
    return out


# Measured (bench_memory.py --sections bf16; small GPT of PEERS.md, d 128, 2 layers, T 64,
# B 16): the median over datums of the relative error of per-datum gradients under bf16
# autocast against float32 without autocast is 5e-3 to 9.9e-3 for the worst parameter of each
# kind (max over datums 1.2e-2), about one bf16 epsilon (2**-7 = 7.8e-3); on this test's GPT
# it is 2.7e-3 to 8.1e-3. The bound is 2.5x the worst measured median.
BF16_RTOL = 2.5e-2


@pytest.mark.parametrize("backend", ["hooks", "loop", "vmap"])
def test_bf16_autocast_per_datum_gradients_against_float32(tmp_path: Path, backend: str) -> None:
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=4, vocab=40, block_size=32, dtype=torch.float32)
    batch = gpt_batch(6, 32, vocab=40)
    want = backend_grads("loop", model, batch)  # float32, no autocast
    with gradlog.GradRecorder(
        model, tmp_path / "r.gradlog", backend=backend, check_every=1
    ) as rec:  # the self-check passes under autocast
        rec.step(autocast_gpt_losses, batch)
    run = gradlog.open(tmp_path / "r.gradlog")
    got = {n: torch.from_numpy(run.grads(n)) for n in run.param_names}
    errors = relative_errors(got, want)
    assert max(errors.values()) < BF16_RTOL, errors
    assert min(errors.values()) > 1e-5, errors  # bf16 really ran


def test_rules_accumulate_bf16_captures_in_float32() -> None:
    """A Linear under autocast: its output gradient is bf16; the per-datum weight gradient is
    the float32 product of that bf16 gradient with the input as autocast's matmul took it
    (rounded to bf16), not a bf16 product, nor one with the unrounded input."""
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 64, 16, generator=gen)  # (B, T, d_in)
    r = torch.randn(4, 64, 8, generator=gen)  # (B, T, d_out): d loss / d output

    def losses_of(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(batch[0])  # (B, T, d_out) bf16
        return (out.float() * batch[1]).sum((1, 2))  # (B,)

    be = make_backend("hooks", layer, reduction="sum")
    try:
        losses = losses_of(layer, (x, r))
        grads = be.backward(losses, losses.sum())
        assert be.low_precision == {"weight": torch.bfloat16, "bias": torch.bfloat16}
    finally:
        be.detach()
    g = r.to(torch.bfloat16).double()  # the captured output gradient, exactly
    a = x.to(torch.bfloat16).double()  # the input autocast's matmul took
    exact = torch.einsum("bto,bti->boi", g, a)  # (B, d_out, d_in)
    assert grads["weight"].dtype == torch.float32
    err = float((grads["weight"].double() - exact).norm() / exact.norm())
    assert err < 1e-6  # float32 accumulation (a bf16 product: ~2e-3)
    unrounded = torch.einsum("bto,bti->boi", g, x.double())  # (B, d_out, d_in)
    assert float((grads["weight"].double() - unrounded).norm() / unrounded.norm()) > 1e-4
    assert float((grads["bias"].double() - g.sum(1)).norm() / g.sum(1).norm()) < 1e-6


class Gate(nn.Module):
    """A raw parameter: no rule, so the torch.func fallback re-runs this module per datum."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class MixedLayers(nn.Module):
    """Layers whose rules re-run or normalise bf16 captures: MultiheadAttention fed by a
    bf16 Linear output, LayerNorm, RMSNorm, GroupNorm, GRU and a raw parameter."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d)
        self.gn = nn.GroupNorm(2, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.gate = Gate(d)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # (B, T, d), bf16 under autocast
        a = self.attn(h, h, h, need_weights=False)[0]  # (B, T, d)
        g = self.gn(a.transpose(1, 2)).transpose(1, 2)  # (B, T, d)
        z = self.ln(a) + self.rms(a) + g + self.gru(a)[0]  # (B, T, d)
        return self.out(self.gate(z))  # (B, T, 3)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_bf16_autocast_with_rules_that_rerun_or_normalise(tmp_path: Path) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MixedLayers()
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))

    def losses_of(m: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=batch[1]):
            out = m(batch[0])
        return out.float().pow(2).sum((1, 2))  # (B,)

    want = backend_grads("loop", model, (x, False), loss_fn=losses_of)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", check_every=1) as rec:
        rec.step(losses_of, (x, True))
    run = gradlog.open(tmp_path / "r.gradlog")
    assert run.attrs["backend"]["fallback"] == ["gate"]  # the raw parameter: torch.func
    got = {n: torch.from_numpy(run.grads(n)) for n in run.param_names}
    errors = relative_errors(got, want)
    assert max(errors.values()) < 2 * BF16_RTOL, errors  # measured 1.4e-2: tiny sizes


def test_the_self_check_allowance_under_autocast_is_what_the_docs_say() -> None:
    assert LOW_PRECISION_RTOL * torch.finfo(torch.bfloat16).eps == 0.0625


# -- 5. LoRA adapters ------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update ``B A x * alpha / r`` (PEFT style)."""

    def __init__(self, base: nn.Linear, r: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


class PeftStyleLinear(nn.Module):
    """The module layout of ``peft.tuners.lora.Linear``: the frozen ``base_layer`` and, per
    adapter name, ``lora_dropout`` / ``lora_A`` / ``lora_B`` in ``ModuleDict``s (names such as
    ``q.lora_A.default.weight``), summed over the active adapters."""

    def __init__(self, base: nn.Linear, r: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base_layer = base
        self.base_layer.requires_grad_(False)
        self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        self.scaling = {"default": alpha / r}
        self.active_adapters = ["default"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        for name in self.active_adapters:
            dropout, a, b = self.lora_dropout[name], self.lora_A[name], self.lora_B[name]
            result = result + b(a(dropout(x))) * self.scaling[name]
        return result


ADAPTERS: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "plain": LoRALinear,
    "peft-style": PeftStyleLinear,
}


def lora_gpt(mode: str | None = None, style: str = "plain") -> CheckpointedGPT:
    """A frozen GPT with LoRA adapters on every query and value projection."""
    model = checkpointed_gpt(mode, n_layer=2)
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for block in model.blocks:
            block.attn.q = ADAPTERS[style](block.attn.q)
            block.attn.v = ADAPTERS[style](block.attn.v)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at 0; non-zero gradients of A need B != 0
                nn.init.normal_(p, std=0.1)
    return model.to(D64)


@pytest.mark.parametrize("style", ADAPTERS)
@pytest.mark.parametrize("backend", ["hooks", "loop", "vmap"])
def test_lora_adapters_on_a_frozen_gpt(tmp_path: Path, backend: str, style: str) -> None:
    model = lora_gpt(style=style)
    batch = gpt_batch(4, 6)
    want = oracle(model, batch)
    assert all(".lora_" in n for n in want) and len(want) == 8
    with gradlog.GradRecorder(
        model, tmp_path / "r.gradlog", backend=backend, dtype="float64", check_every=1
    ) as rec:
        rec.step(gpt_losses, batch)
    run = gradlog.open(tmp_path / "r.gradlog")
    assert sorted(run.param_names) == sorted(want)
    for name, w in want.items():
        np.testing.assert_allclose(
            run.grads(name, dtype=np.float64), w.numpy(), rtol=1e-7, atol=1e-13, err_msg=name
        )
    if backend == "hooks":  # only the adapters are hooked, each by the Linear rule
        modules = run.attrs["backend"]["modules"]
        assert all(m["rule"] == "linear" and ".lora_" in m["module"] for m in modules)
        assert len(modules) == 8


@pytest.mark.parametrize("mode", MODES)
def test_lora_with_checkpointed_blocks(mode: str) -> None:
    model = lora_gpt(mode)
    plain = copy.deepcopy(model)
    plain.mode = None
    batch = gpt_batch(4, 6)
    if mode == "reentrant":  # frozen embeddings: the blocks' input must require grad
        model.tok_emb.register_forward_hook(lambda m, a, out: out.requires_grad_(True))
    assert_close(backend_grads("hooks", model, batch), backend_grads("loop", plain, batch))


class PeftTarget(nn.Module):
    """A small custom model for PEFT (no Hugging Face config): two blocks with ``q`` and ``v``
    projections, an embedding and a head."""

    def __init__(self, V: int = 11, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"q": nn.Linear(d, d), "v": nn.Linear(d, d)}) for _ in range(2)
        )
        self.head = nn.Linear(d, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, T, d)
        for block in self.blocks:
            h = h + torch.tanh(block["q"](h)) * block["v"](h)  # (B, T, d)
        out: torch.Tensor = self.head(h)  # (B, T, V)
        return out


def test_peft_lora_adapters(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q", "v"], lora_dropout=0.0, init_lora_weights=False
    )  # init_lora_weights=False: B is random, not 0, so A's gradients are not 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = peft.get_peft_model(PeftTarget(), config).to(D64)
    x, y, mask = gpt_batch(4, 6)
    recorded = {}
    for backend in ("hooks", "loop"):
        with gradlog.GradRecorder(
            model, tmp_path / f"{backend}.gradlog", backend=backend, dtype="float64", check_every=1
        ) as rec:
            model.zero_grad(set_to_none=True)
            rec.backward(per_token_ce(model(x), y), mask=mask)
        recorded[backend] = gradlog.open(tmp_path / f"{backend}.gradlog")
    names = recorded["hooks"].param_names
    assert all("lora_" in n for n in names)  # PEFT froze the base: it is not recorded
    assert len(names) == 8  # lora_A and lora_B of q and v in two blocks
    for name in names:
        np.testing.assert_allclose(
            recorded["hooks"].grads(name, dtype=np.float64),
            recorded["loop"].grads(name, dtype=np.float64),
            rtol=1e-7,
            atol=1e-13,
            err_msg=name,
        )
    modules = recorded["hooks"].attrs["backend"]["modules"]
    assert len(modules) == 8 and all(m["rule"] == "linear" for m in modules)


# -- the layers benchmark's acceptance (slow: nine fresh processes, a few minutes) ----------
FIXED = 16 << 20
@pytest.mark.slow
def test_recording_one_of_24_layers_costs_a_tenth_of_all_and_a_recorders_fixed_cost() -> None:
    """Peak RSS of SGD steps recorded into a store, each run in fresh processes (the
    benchmark's child; the median of five): extra of recording = recorded run's peak - plain
    run's peak. A tenth, plus a recorder's fixed cost on the CPU that one layer pays in full
    (``FIXED``: the exact norms' 8 MiB block buffer, the writer's first use). Measured
    2026-11-27: one layer ~35-55 MB (two steps of its 14 MiB payload, the one computed and
    the one written, and that cost), all 24 ~450 MB; peaks vary by +-15 MB per process, so
    the bare tenth failed about one run in two (0.078-0.12)."""
    bench = Path(__file__).parent / "benchmarks" / "bench_memory.py"
    peak = {}
    for name in ("plain", "1 of 24", "24 of 24"):
        trials = []
        for _ in range(5):
            done = subprocess.run(
                [sys.executable, str(bench), "--child", f"layers:{name}", "--mem-reps", "2"],
                capture_output=True,
                text=True,
                check=True,
            )
            trials.append(json.loads(done.stdout.strip().splitlines()[-1])["extra"])
        peak[name] = sorted(trials)[2]
    one, every = peak["1 of 24"] - peak["plain"], peak["24 of 24"] - peak["plain"]
    assert every > 0 and one <= every / 10 + FIXED, peak
