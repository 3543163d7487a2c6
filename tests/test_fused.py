"""``batch_grad="sum"``: the weight gradient of recorded Linear layers is the weighted sum of
their per-datum gradients (gradlog.backends.fused), with autograd's own weight-gradient matmul
skipped. Per-datum gradients are checked against the loop oracle and ``p.grad`` against a plain
backward, float64; the skipped matmul is checked by counting FLOPs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradlog
from gradlog.errors import ConfigError
from gradlog.testing.zoo import gpt_batch, mlp, mlp_batch, per_token_ce, tiny_gpt

D64 = torch.float64
LossFn = Callable[[nn.Module], torch.Tensor]  # per-datum losses (B,)


class Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D`` (weight stored (d_in, d_out)), matched by class name."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"  # its stand-in: matched by name and library


class Reuse(nn.Module):
    """A Linear called twice, an embedding tied to the (Linear) head, GPT-2 Conv1D layers,
    and a frozen Linear with a LoRA-style adapter."""

    def __init__(self, V: int = 7, d: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.mix = nn.Linear(d, d)
        self.c_fc = Conv1D(2 * d, d)
        self.c_proj = Conv1D(d, 2 * d)
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d, 2, bias=False)
        self.lora_b = nn.Linear(2, d, bias=False)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, T, d)
        h = h + torch.tanh(self.mix(h))
        h = h + torch.tanh(self.mix(h))  # the same module again
        h = h + self.c_proj(F.gelu(self.c_fc(h)))
        h = self.base(h) + self.lora_b(self.lora_a(h))
        return self.head(h)  # (B, T, V)


def _case(kind: str) -> tuple[nn.Module, LossFn]:
    torch.manual_seed(0)
    if kind == "mlp":
        model = mlp()
        x, y = mlp_batch(5)
        return model, lambda m: F.cross_entropy(m(x), y, reduction="none")
    if kind in ("gpt", "gpt_tied"):
        model = tiny_gpt(tie_weights=kind == "gpt_tied")
        x, y, mask = gpt_batch(5, 6)
        return model, lambda m: gradlog.losses.per_datum_losses(per_token_ce(m(x), y), mask, "mean")
    model = Reuse().to(D64)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 7, (4, 6), generator=gen)  # (B, T)
    tgt = torch.randint(0, 7, (4, 6), generator=gen)  # (B, T)
    return model, lambda m: per_token_ce(m(idx), tgt).mean(1)


def _record(model: nn.Module, loss_fn: LossFn, path: Path, **options: Any) -> Any:
    with gradlog.GradRecorder(model, path, dtype="float64", check_every=1, **options) as rec:
        model.zero_grad(set_to_none=True)
        rec.backward(loss_fn(model))
    return gradlog.open(path)


@pytest.mark.parametrize("kind", ["mlp", "gpt", "gpt_tied", "reuse"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_records_match_the_oracle_and_p_grad_the_plain_backward(
    tmp_path: Path, kind: str, reduction: str
) -> None:
    model, loss_fn = _case(kind)
    plain = copy.deepcopy(model)
    oracle = copy.deepcopy(model)
    run = _record(model, loss_fn, tmp_path / "sum.gradlog", batch_grad="sum",
                  batch_reduction=reduction)
    want = _record(oracle, loss_fn, tmp_path / "loop.gradlog", backend="loop",
                   batch_reduction=reduction)
    described = run.attrs["backend"]
    assert described["batch_grad"] == "sum" and described["fused"]
    for name in want.param_names:
        np.testing.assert_allclose(run.grads(name), want.grads(name), rtol=1e-9, atol=1e-15,
                                   err_msg=name)
    losses = loss_fn(plain)
    (losses.mean() if reduction == "mean" else losses.sum()).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)


def _flops(model: nn.Module, loss_fn: LossFn, path: Path, batch_grad: str) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with gradlog.GradRecorder(model, path, batch_grad=batch_grad, check_every=0) as rec:
        losses = loss_fn(model)
        with FlopCounterMode(display=False) as counter:
            rec.backward(losses)
    return int(counter.get_total_flops())


def test_the_batch_weight_gradient_matmul_is_skipped(tmp_path: Path) -> None:
    model, loss_fn = _case("gpt")
    both = _flops(copy.deepcopy(model), loss_fn, tmp_path / "a.gradlog", "autograd")
    fused = _flops(copy.deepcopy(model), loss_fn, tmp_path / "s.gradlog", "sum")
    B, T = 5, 6
    skipped = sum(
        2 * B * T * m.in_features * m.out_features
        for m in model.modules() if type(m) is nn.Linear
    )
    assert skipped > 0 and both - fused == skipped


def test_steps_gradlog_does_not_record_train_as_without_it(tmp_path: Path) -> None:
    model, loss_fn = _case("gpt")
    plain = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="nothing was recorded"), gradlog.GradRecorder(
            model, tmp_path / "r.gradlog", batch_grad="sum"):
        loss_fn(model).mean().backward()  # the user's own backward: gradlog records nothing
    loss_fn(plain).mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_autograd_still_accumulates_p_grad(tmp_path: Path) -> None:
    """Post-accumulate hooks (what DDP's reducer and optimizers-in-backward use) fire once per
    backward for every parameter, and micro-batches accumulate as usual."""
    model, loss_fn = _case("gpt")
    plain = copy.deepcopy(model)
    fired: dict[str, int] = {}
    handles = [
        p.register_post_accumulate_grad_hook(
            lambda _, n=name: fired.__setitem__(n, fired.get(n, 0) + 1))
        for name, p in model.named_parameters()
    ]
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", batch_grad="sum",
                              dtype="float64", check_every=1) as rec:
        rec.backward(loss_fn(model), step=0)
        rec.backward(loss_fn(model), step=0)  # a second micro-batch of the same step
    for h in handles:
        h.remove()
    assert fired == {name: 2 for name, _ in model.named_parameters()}
    for _ in range(2):
        loss_fn(plain).mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)
    assert gradlog.open(tmp_path / "r.gradlog").steps.to_pylist()[0]["n_micro"] == 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks(tmp_path: Path, reentrant: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 2)).to(D64)
    x = torch.randn(3, 5, 4, dtype=D64, requires_grad=reentrant)

    def loss_fn(m: nn.Module) -> torch.Tensor:
        h = checkpoint(m[:4], x, use_reentrant=reentrant)
        return m[4](h).pow(2).mean((1, 2))

    want = _record(copy.deepcopy(model), lambda m: m(x).pow(2).mean((1, 2)),
                   tmp_path / "plain.gradlog", backend="loop")
    run = _record(model, loss_fn, tmp_path / "ckpt.gradlog", batch_grad="sum")
    for name in want.param_names:
        np.testing.assert_allclose(run.grads(name), want.grads(name), rtol=1e-10, err_msg=name)


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="batch_grad='sum' applies to the hooks backend"):
        gradlog.GradRecorder(mlp(), "unused.gradlog", backend="vmap", batch_grad="sum")
    with pytest.raises(ConfigError, match="batch_grad='exact' is not one of"):
        gradlog.GradRecorder(mlp(), "unused.gradlog", batch_grad="exact")


def test_the_default_keeps_its_config_hash() -> None:
    """Stores recorded before the option existed resume: the default is not hashed."""
    from gradlog.config import RecorderConfig

    assert "batch_grad" not in RecorderConfig().to_json()
    assert RecorderConfig(batch_grad="sum").to_json()["batch_grad"] == "sum"


@pytest.mark.parametrize("form", ["factors", "norm"])
@pytest.mark.filterwarnings("ignore:.*factors pay off below:UserWarning")  # (tiny test layers)
def test_compact_forms_keep_the_ordinary_batch_product(tmp_path: Path, form: str) -> None:
    """Factored material forms no per-datum gradient to sum: those layers fall back to the
    ordinary batch product inside FusedLinear; records and p.grad stay exact."""
    model, loss_fn = _case("gpt")
    plain, oracle = copy.deepcopy(model), copy.deepcopy(model)
    run = _record(model, loss_fn, tmp_path / "f.gradlog", batch_grad="sum", form=form)
    want = _record(oracle, loss_fn, tmp_path / "loop.gradlog", backend="loop")
    for name in want.param_names:  # exact per-record norms, (step, datum) order alike
        got, expected = run.norms(name), want.norms(name)
        assert got.column("datum_id").equals(expected.column("datum_id"))
        np.testing.assert_allclose(np.asarray(got.column("norm")),
                                   np.asarray(expected.column("norm")), rtol=1e-9,
                                   atol=1e-15, err_msg=name)
    if form == "factors":  # rebuilt from the stored factors
        for name in want.param_names:
            np.testing.assert_allclose(run.grads(name), want.grads(name), rtol=1e-9,
                                       atol=1e-15, err_msg=name)
    loss_fn(plain).mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)


def test_projections_of_fused_layers_come_from_their_formed_gradients(tmp_path: Path) -> None:
    """With batch_grad="sum", projected/top-k/norm Linear weights take the dense per-datum
    gradients the backward forms (their sum is p.grad): same stored projections as a run
    recorded full and projected afterwards."""
    model, loss_fn = _case("gpt")
    plain, reference = copy.deepcopy(model), copy.deepcopy(model)
    form = {"blocks.*.weight": {"form": "projection", "dim": 16}, "*": "full"}
    with gradlog.GradRecorder(model, tmp_path / "p.gradlog", dtype="float64", check_every=1,
                              batch_grad="sum", form=form) as rec:
        rec.backward(loss_fn(model))
        fused, backend = rec._backend.fused_params, rec._backend
        assert fused and backend.dense_when_fused == fused & backend.keep_material  # dense
    run = gradlog.open(tmp_path / "p.gradlog")
    full = _record(reference, loss_fn, tmp_path / "full.gradlog")
    projected = [n for n in run.param_names if run.form(n).name == "projection"]
    assert set(projected) >= {n for n in fused if n.startswith("blocks.")}
    for name in projected:
        with pytest.warns(UserWarning, match="projected"):
            got = run.grads(name)
        want = run.project(name, torch.from_numpy(full.grads(name)))
        # (projection matrices are float32: the recorded and the later projection agree to
        # float32 rounding)
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)
    loss_fn(plain).mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)


def test_calls_that_do_not_fuse_hand_factors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """Under autocast a Linear call is not fused (its output's dtype is not the weight's: the
    weight gradient is autograd's), so a form that encodes dense gradients takes the call's
    factors, as with batch_grad="autograd", rather than per-datum gradients formed only for
    their norms (16 GB a step for a ~1B Llama on a GPU). Without autocast the same calls fuse
    and hand their dense records. Norms equal the autograd mode's."""
    from gradlog.backends.hooks.accumulate import Accumulator

    kinds: dict[str, set[str]] = {}
    add = Accumulator.add

    def noting(self: Accumulator, entry: Any, result: Any, cap: Any, rows: Any = None) -> None:
        for attr, value in result.items():
            kinds.setdefault(entry.names[attr], set()).add(type(value).__name__)
        add(self, entry, result, cap, rows)

    monkeypatch.setattr(Accumulator, "add", noting)
    x, y, mask = gpt_batch(4, 6)
    norms = {}
    for amp, batch_grad in ((True, "sum"), (True, "autograd"), (False, "sum")):
        torch.manual_seed(0)
        model = tiny_gpt(dtype=torch.float32)
        kinds.clear()
        path = tmp_path / f"{amp}{batch_grad}.gradlog"
        with gradlog.GradRecorder(model, path, form="norm", batch_grad=batch_grad) as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                losses = per_token_ce(model(x), y)  # (B, T)
            rec.backward(losses, mask=mask)
        weights = {n for n in kinds if n.endswith("weight") and (".attn." in n or ".mlp." in n)}
        assert weights and {n: kinds[n] for n in weights} == {
            n: {"Factors" if amp else "Tensor"} for n in weights}, kinds
        norms[amp, batch_grad] = {n: np.asarray(gradlog.open(path).norms(n).column("norm"))
                                  for n in weights}
    for name, want in norms[True, "autograd"].items():
        np.testing.assert_allclose(norms[True, "sum"][name], want, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("batch_grad", ["autograd", "sum"])
def test_factors_of_a_module_called_twice_merge_with_their_scale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_grad: str) -> None:
    """A Linear called twice under autocast hands factors per call; merged, they keep the
    backward's scale and their 16-bit promise (``Factors.narrow``): the exact norms equal
    those of the dense records of a ``full`` run of the same step."""
    from gradlog.grads import inner

    promised = []
    real = inner.factored_sqnorms

    def noting(g: torch.Tensor, a: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        promised.append(kwargs.get("narrow"))
        return real(g, a, **kwargs)

    monkeypatch.setattr(inner, "factored_sqnorms", noting)
    norms = {}
    for form in ("norm", "full"):
        model, loss_fn = _case("reuse")
        model = model.float()
        path = tmp_path / f"{form}.gradlog"
        with gradlog.GradRecorder(model, path, form=form, batch_grad=batch_grad) as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = loss_fn(model)
            rec.backward(losses)
        norms[form] = np.asarray(gradlog.open(path).norms("mix.weight").column("norm"))
    np.testing.assert_allclose(norms["norm"], norms["full"], rtol=1e-6)
    assert promised and set(promised) == {torch.bfloat16}, promised
