"""The hooks backend's contract: observation only (bitwise-identical training), gradient
accumulation, skipped steps, what it records about itself, and the errors it raises."""

from __future__ import annotations

import copy
import warnings
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
import gradlog.backends.hooks
from gradlog.backends import BACKENDS
from gradlog.backends.base import graph_nodes
from gradlog.backends.hooks import HooksBackend
from gradlog.backends.hooks.graph import TAG
from gradlog.errors import BackendError, UnsupportedLayerError
from gradlog.losses import per_datum_losses
from gradlog.params import select_params
from gradlog.testing.zoo import gpt_batch, mlp, mlp_batch, per_token_ce, tiny_gpt

D64 = torch.float64


def backend(model: nn.Module, reduction: str = "mean", params: str = "*") -> HooksBackend:
    be = BACKENDS["hooks"](
        model, select_params(model, [params]), batch_reduction=reduction, randomness="different"
    )
    assert isinstance(be, HooksBackend)
    be.attach()
    return be


def loop_grads(
    model: nn.Module, losses_of: Callable[[], torch.Tensor], reduction: str = "mean"
) -> dict[str, torch.Tensor]:
    be = BACKENDS["loop"](
        model, select_params(model, ["*"]), batch_reduction=reduction, randomness="different"
    )
    model.zero_grad(set_to_none=True)
    losses = losses_of()
    return be.backward(losses, be.reduce_batch(losses))


def hooks_grads(
    model: nn.Module, losses_of: Callable[[], torch.Tensor], reduction: str = "mean"
) -> dict[str, torch.Tensor]:
    be = backend(model, reduction)
    try:
        model.zero_grad(set_to_none=True)
        losses = losses_of()
        return be.backward(losses, be.reduce_batch(losses))
    finally:
        be.detach()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-6, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}"
        )


def no_hooks_left(model: nn.Module) -> bool:
    modules = all(not m._forward_hooks for m in model.modules())
    params = all(not p._backward_hooks for p in model.parameters())
    return modules and params


def test_auto_is_the_hooks_backend(tmp_path: Path) -> None:
    assert BACKENDS["auto"] is HooksBackend
    model = mlp()
    x, y = mlp_batch(4)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="auto") as rec:
        rec.backward(F.cross_entropy(model(x), y, reduction="none"))
    run = gradlog.open(tmp_path / "r.gradlog")
    assert run.config["backend"] == "auto"
    assert run.attrs["backend"]["name"] == "hooks"  # what actually ran
    assert no_hooks_left(model)


# -- observation only ------------------------------------------------------------------------
class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.rnn = nn.LSTM(6, 6, batch_first=True)
        self.head = nn.Linear(6, 11)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(idx))[0])


def gpt_case() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], torch.Tensor]:
    x, y, mask = gpt_batch(5, 6)
    return tiny_gpt(tie_weights=True, n_layer=2), lambda m: per_token_ce(m(x), y), mask


def lstm_case() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LSTMLM().to(D64)
    x, y, _ = gpt_batch(4, 5)
    return model, lambda m: per_token_ce(m(x), y), None


@pytest.mark.parametrize("case", [gpt_case, lstm_case])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_training_is_bitwise_identical(tmp_path: Path, case: Callable[[], Any], dtype: str) -> None:
    model, loss_fn, mask = case()
    model = model.to(getattr(torch, dtype))
    plain, recorded = copy.deepcopy(model), copy.deepcopy(model)

    def train(m: nn.Module, rec: Any) -> None:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for step in range(3):
            raw = loss_fn(m)
            if rec is None:
                per_datum_losses(raw, mask, "mean").mean().backward()
            else:
                rec.backward(raw, mask=mask, step=step)
            opt.step()
            opt.zero_grad()

    train(plain, None)
    with gradlog.GradRecorder(
        recorded, tmp_path / "r.gradlog", backend="hooks", check_every=1
    ) as rec:
        train(recorded, rec)
    for (name, a), b in zip(plain.named_parameters(), recorded.parameters()):
        assert torch.equal(a, b), name  # hooks only observe: bitwise the same training
    assert gradlog.open(tmp_path / "r.gradlog").steps.num_rows == 3


# -- steps, micro-batches, skipped steps -----------------------------------------------------
def record_steps(
    model: nn.Module,
    path: Path,
    backend_name: str,
    batches: list[Any],
    steps: list[int],
    every: int = 1,
) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradlog.GradRecorder(
        model, path, backend=backend_name, dtype="float64", every=every, check_every=1
    ) as rec:
        for (x, y, mask), step in zip(batches, steps):
            rec.backward(per_token_ce(model(x), y), mask=mask, step=step)
            if step != steps[-1] and steps[steps.index(step) + 1] == step:
                continue  # the next micro-batch accumulates into the same step
            opt.step()
            opt.zero_grad()
    return gradlog.open(path)


def test_gradient_accumulation_across_micro_batches(tmp_path: Path) -> None:
    batches = [gpt_batch(4, 6, seed=1), gpt_batch(3, 6, seed=2), gpt_batch(4, 6, seed=3)]
    steps = [0, 0, 1]  # two micro-batches of different sizes, then one step
    model = tiny_gpt(tie_weights=True)
    runs = {
        name: record_steps(copy.deepcopy(model), tmp_path / f"{name}.gradlog", name, batches, steps)
        for name in ("hooks", "loop")
    }
    hooks, loop = runs["hooks"], runs["loop"]
    assert hooks.datums.column("step").to_pylist() == [0] * 7 + [1] * 4
    np.testing.assert_array_equal(hooks.datums.column("weight"), loop.datums.column("weight"))
    for name in loop.param_names:
        np.testing.assert_allclose(
            hooks.grads(name, dtype=np.float64),
            loop.grads(name, dtype=np.float64),
            rtol=1e-6,
            atol=1e-12,
            err_msg=name,
        )


def test_skipped_steps_train_normally_and_hold_nothing(tmp_path: Path) -> None:
    batches = [gpt_batch(4, 6, seed=s) for s in range(5)]
    model = tiny_gpt()
    hooked = copy.deepcopy(model)
    run = record_steps(hooked, tmp_path / "h.gradlog", "hooks", batches, list(range(5)), every=2)
    loop = record_steps(model, tmp_path / "l.gradlog", "loop", batches, list(range(5)), every=2)
    assert run.steps.column("step").to_pylist() == [0, 2, 4]
    for name in loop.param_names:
        np.testing.assert_allclose(
            run.grads(name, dtype=np.float64),
            loop.grads(name, dtype=np.float64),
            rtol=1e-6,
            atol=1e-12,
        )
    for a, b in zip(model.parameters(), hooked.parameters()):
        assert torch.equal(a, b)


def test_captures_are_released_after_each_backward() -> None:
    model = tiny_gpt()
    be = backend(model)
    try:
        for seed in range(3):
            x, y, mask = gpt_batch(4, 6, seed=seed)
            losses = per_datum_losses(per_token_ce(model(x), y), mask, "mean")
            if seed == 1:  # a backward gradlog does not record (every=N skips it)
                losses.mean().backward()
            else:
                be.backward(losses, losses.mean())
            live = [r() for r in be._live]
            assert all(c is None or c.args is None for c in live)  # no activations held
            # nor the calls themselves: the graph's nodes live on with `losses` (in a loop,
            # through the next forward) and must not keep them (nor their lists) alive
            assert all(c is None for c in live)
            assert not [n for n in graph_nodes(losses.grad_fn) if n.metadata.get(TAG)]
        with torch.no_grad():
            model(x)  # nothing captured without grad
        assert all(r() is None or r().args is None for r in be._live)
    finally:
        be.detach()
    assert no_hooks_left(model)


def test_results_held_by_the_caller_are_never_overwritten() -> None:
    model = tiny_gpt(tie_weights=True)
    batches = [gpt_batch(4, 6, seed=s) for s in range(4)]

    def run(be: HooksBackend, b: int) -> dict[str, torch.Tensor]:
        x, y, mask = batches[b]
        model.zero_grad(set_to_none=True)
        losses = per_datum_losses(per_token_ce(model(x), y), mask, "mean")
        return be.backward(losses, losses.mean())

    be = backend(model)
    try:
        first = run(be, 0)  # the dict itself is kept
        copies = {n: g.clone() for n, g in first.items()}
        view = run(be, 1)["tok_emb.weight"].numpy()  # only a numpy view of one result is kept
        view_copy = view.copy()
        rows = run(be, 2)["blocks.0.mlp.fc.weight"][1:]  # only a slice is kept
        rows_copy = rows.clone()
        reused = run(be, 3)  # the dropped results of step 2 may be reused here
        for name, g in first.items():
            assert torch.equal(g, copies[name]), name
        np.testing.assert_array_equal(view, view_copy)
        assert torch.equal(rows, rows_copy)
        assert all(
            g.untyped_storage().data_ptr() != first[n].untyped_storage().data_ptr()
            for n, g in reused.items()
        )
    finally:
        be.detach()


def test_dropped_results_are_reused_on_cpu() -> None:
    model = tiny_gpt()
    x, y, mask = gpt_batch(4, 6)
    be = backend(model)
    try:
        ptrs = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            losses = per_datum_losses(per_token_ce(model(x), y), mask, "mean")
            ptrs.append(be.backward(losses, losses.mean())["head.weight"].data_ptr())
        if gradlog.backends.hooks._BASELINE is not None:  # reference counts readable here
            assert ptrs[1] == ptrs[2] or ptrs[0] in ptrs[1:]  # memory came back to the pool
    finally:
        be.detach()


def test_results_let_go_of_later_are_reused() -> None:
    # A writer holds a step's gradients while the next backward runs and lets go after it:
    # that memory still comes back, and never while it is held.
    model = tiny_gpt()
    x, y, mask = gpt_batch(4, 6)
    be = backend(model)

    def run() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        losses = per_datum_losses(per_token_ce(model(x), y), mask, "mean")
        return be.backward(losses, losses.mean())

    try:
        held = run()
        kept = {n: g.clone() for n, g in held.items()}
        ptrs = {n: g.data_ptr() for n, g in held.items()}
        second = run()  # `held` is still held: none of its memory may be handed out
        assert not {g.data_ptr() for g in second.values()} & set(ptrs.values())
        for n, g in held.items():
            assert torch.equal(g, kept[n]), n
        del held, second
        third = run()
        if gradlog.backends.hooks._BASELINE is not None:  # reference counts readable here
            assert {g.data_ptr() for g in third.values()} & set(ptrs.values())
    finally:
        be.detach()


def test_step_entry_point(tmp_path: Path) -> None:
    model = tiny_gpt()
    x, y, mask = gpt_batch(4, 6)
    want = loop_grads(model, lambda: per_datum_losses(per_token_ce(model(x), y), mask, "mean"))
    with gradlog.GradRecorder(
        model, tmp_path / "r.gradlog", backend="hooks", dtype="float64", check_every=1
    ) as rec:
        rec.step(lambda m, b: per_token_ce(m(b[0]), b[1]), (x, y), mask=mask)
    run = gradlog.open(tmp_path / "r.gradlog")
    for name in want:
        np.testing.assert_allclose(
            run.grads(name, dtype=np.float64), want[name].numpy(), rtol=1e-6, atol=1e-12
        )


def test_an_unrelated_forward_between_forward_and_backward_is_ignored() -> None:
    model = tiny_gpt()
    x, y, mask = gpt_batch(4, 6)
    x2, _, _ = gpt_batch(3, 5, seed=9)

    def losses_of() -> torch.Tensor:
        losses = per_datum_losses(per_token_ce(model(x), y), mask, "mean")
        model(x2)  # e.g. a logging forward with grad enabled, another batch size, no backward
        return losses

    assert_same(hooks_grads(model, losses_of), loop_grads(model, losses_of))


# -- what the backend says about itself ------------------------------------------------------
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.gate = nn.Parameter(torch.ones(4))  # a raw parameter of the model itself
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, x, x, need_weights=False)[0] * self.gate)


def test_describe_lists_rules_and_fallbacks_in_the_run(tmp_path: Path) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Mixed().to(D64)
    x = torch.randn(3, 5, 4, dtype=D64)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="hooks", check_every=1) as rec:
        rec.backward(model(x).pow(2).sum((1, 2)))
    described = gradlog.open(tmp_path / "r.gradlog").attrs["backend"]
    rules = {m["module"]: (m["rule"], m["params"]) for m in described["modules"]}
    assert rules == {
        "": ("torch.func", ["gate"]),
        "attn": (
            "multihead_attention",
            [
                "attn.in_proj_bias",
                "attn.in_proj_weight",
                "attn.out_proj.bias",
                "attn.out_proj.weight",
            ],
        ),
        "out": ("linear", ["out.bias", "out.weight"]),
    }
    assert described["fallback"] == [""]  # the model itself, for its raw parameter


def test_only_modules_owning_recorded_parameters_are_hooked() -> None:
    model = tiny_gpt(n_layer=2)
    be = backend(model, params="blocks.1.attn.q.weight")
    try:
        # (the root's own hooks push and pop the op-level capture around its forward)
        hooked = [m for m in model.modules() if m._forward_hooks and m is not model]
        assert hooked == [model.blocks[1].attn.q]
        assert [m["module"] for m in be.describe()["modules"]] == ["blocks.1.attn.q"]
    finally:
        be.detach()
    assert no_hooks_left(model)


# -- uses outside the owning module; refusals, each with the fix -----------------------------
class TiedByHand(nn.Module):
    """The head reuses the embedding matrix through F.linear in the parent's forward: the
    embedding's hooks see one of its two uses, op-level capture the other."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.emb(idx)), self.emb.weight)  # (B, T, V)


def test_a_parameter_used_outside_its_module_is_exact_with_pgrad_unchanged() -> None:
    model = TiedByHand().to(D64)
    x, y, _ = gpt_batch(3, 4, vocab=7)
    model.zero_grad(set_to_none=True)
    per_token_ce(model(x), y).mean(1).mean().backward()
    expected = model.emb.weight.grad.clone()

    def losses_of() -> torch.Tensor:
        return per_token_ce(model(x), y).mean(1)

    assert_same(hooks_grads(model, losses_of), loop_grads(model, losses_of))
    model.zero_grad(set_to_none=True)
    be = backend(model)
    try:
        losses = losses_of()
        be.backward(losses, losses.mean())
    finally:
        be.detach()
    assert torch.equal(model.emb.weight.grad, expected)  # observation only: bitwise


class OnlyByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.proj.weight)  # proj itself is never called


def test_a_parameter_only_used_outside_the_models_forward_is_refused() -> None:
    model = OnlyByHand().to(D64)
    be = backend(model, params="proj.weight")
    try:
        x = torch.randn(3, 4, dtype=D64)
        losses = F.linear(x, model.proj.weight).pow(2).sum(1)  # in the loss code, not the model
        with pytest.raises(BackendError, match=r"proj\.weight.*no hooked module call"):
            be.backward(losses, losses.mean())
    finally:
        be.detach()
    assert_same(hooks_grads(model, lambda: model(x).pow(2).sum(1)),  # in its forward: exact
                loop_grads(model, lambda: model(x).pow(2).sum(1)))


def test_a_flattened_batch_is_recorded_and_a_time_major_one_refused() -> None:
    """A Linear on ``x.reshape(B*T, d)`` (each datum's rows together, a view proves it) is
    recorded as the loop oracle's; it was refused. Rows flattened time-major are refused
    before the backward, p.grad untouched."""
    layer = nn.Linear(3, 2).to(D64)
    x = torch.randn(4, 5, 3, dtype=D64)
    flat = lambda: layer(x.reshape(20, 3)).reshape(4, 5, 2).pow(2).sum((1, 2))  # noqa: E731
    assert_same(hooks_grads(layer, flat), loop_grads(layer, flat))
    layer.zero_grad(set_to_none=True)
    be = backend(layer)
    try:
        time_major = layer(x.transpose(0, 1).reshape(20, 3)).reshape(5, 4, 2).transpose(0, 1)
        losses = time_major.pow(2).sum((1, 2))  # (B,)
        with pytest.raises(BackendError, match=r"\(20, 2\).*B=4.*each datum's rows together"):
            be.backward(losses, losses.mean())
    finally:
        be.detach()
    assert layer.weight.grad is None


class NoisyParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x) * self.scale


def test_dropout_in_a_recomputed_module_is_replayed() -> None:
    """The torch.func fallback re-runs NoisyParent per datum with the masks its Dropout
    drew in the batch's forward (it was refused): exact against the loop oracle, whose
    forward draws the same masks from the same seed."""
    model = NoisyParent().to(D64)
    x = torch.randn(4, 3, dtype=D64)
    torch.manual_seed(5)
    got = hooks_grads(model, lambda: model(x).pow(2).sum(1))
    torch.manual_seed(5)
    want = loop_grads(model, lambda: model(x).pow(2).sum(1))
    assert_same(got, want)
    assert bool((want["scale"] == 0).any())  # some masks dropped entries: dropout was active


class DynamicShapes(nn.Module):
    """A raw parameter in a forward that torch.func.vmap cannot batch (nonzero)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 3, dtype=D64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positives = [float(torch.nonzero(row > 0).shape[0]) for row in x]  # per datum
        counts = torch.tensor(positives, dtype=x.dtype).unsqueeze(1)  # (B, 1)
        return x * self.w * (1.0 + counts)


def test_fallback_switches_to_a_per_datum_loop_where_vmap_cannot_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = DynamicShapes()
    x = torch.randn(5, 3, dtype=D64)
    with caplog.at_level("WARNING", logger="gradlog"):
        got = hooks_grads(model, lambda: torch.tanh(model(x)).sum(1))
    assert "cannot batch DynamicShapes" in caplog.text
    assert_same(got, loop_grads(model, lambda: torch.tanh(model(x)).sum(1)))


def test_batchnorm_in_training_mode_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="hooks") as rec:
        with pytest.raises(UnsupportedLayerError, match=r"BatchNorm1d.*eval"):
            rec.backward(model(x)[:, 0])
        model.eval()  # frozen statistics: per-datum gradients are defined
        rec.backward(model(x)[:, 0])


class SeqFirst(nn.Module):
    """Token ids (T, B) through sequence-first layers: (T, B, d) throughout. Positions: the
    model's own parameter (T_max, 1, d) sliced (its rule re-runs the model per datum), or an
    Embedding's (T, d) table broadcast over the batch's dimension 1 (shared by the datums)."""

    def __init__(self, trunk: str, positions: str = "param") -> None:
        super().__init__()
        self.trunk, self.positions = trunk, positions
        self.emb = nn.Embedding(5, 4)
        self.pos = nn.Parameter(torch.randn(8, 1, 4))
        self.table = nn.Embedding(8, 4)
        if trunk == "gru":
            self.rnn: nn.Module = nn.GRU(4, 4)  # batch_first=False
        else:
            self.rnn = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0), 1, enable_nested_tensor=False)
        self.head = nn.Linear(4, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx (T, B)
        T = idx.shape[0]
        if self.positions == "param":
            h = self.emb(idx) + self.pos[:T]
        else:
            h = self.emb(idx) + self.table(torch.arange(T))[:, None, :]  # (T, 1, d) broadcast
        out = self.rnn(h)
        return self.head(out[0] if isinstance(out, tuple) else out)  # (T, B, V)


@pytest.mark.parametrize("positions", ["param", "table"])
@pytest.mark.parametrize("trunk", ["gru", "transformer"])
def test_sequence_first_steps_whose_length_equals_the_batch_keep_the_batch_of_earlier_steps(
        trunk: str, positions: str) -> None:
    """At T == B either leading dimension of a (T, B, d) output may be the batch: refused at
    the first step, and read where earlier steps had it (dimension 1) once one settled it.
    A position table broadcast over dimension 1 is shared by the datums at every T."""
    torch.manual_seed(0)
    model = SeqFirst(trunk, positions).to(D64).eval()
    be = backend(model)
    try:
        x = torch.randint(0, 5, (4, 4))
        losses = model(x).pow(2).sum((0, 2))
        with pytest.raises(BackendError, match="no earlier step settled it"):
            be.backward(losses, losses.mean())
        for T in (6, 4, 3, 4):  # T != B settles it; T == B keeps it
            x = torch.randint(0, 5, (T, 4))
            model.zero_grad(set_to_none=True)
            losses = model(x).pow(2).sum((0, 2))
            got = be.backward(losses, losses.mean())
            assert_same(got, loop_grads(model, lambda x=x: model(x).pow(2).sum((0, 2))))
    finally:
        be.detach()


def test_a_sequence_first_position_table_is_refused_without_autograd_node_shapes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before torch 2.6 nodes carry no shapes to prove a broadcast over dimension 1 alone:
    refused there, not split by a guess."""
    from gradlog.backends.hooks import graph, layout

    monkeypatch.setattr(layout, "autograd_node_shapes_known", lambda node: False)
    monkeypatch.setattr(graph, "autograd_node_shapes_known", lambda node: False)
    torch.manual_seed(0)
    model = SeqFirst("gru", "table").to(D64)
    x = torch.randint(0, 5, (6, 4))
    with pytest.raises(BackendError, match="no batch dimension of size B=4 of its own"):
        hooks_grads(model, lambda: model(x).pow(2).sum((0, 2)))


def test_a_models_own_parameter_left_out_of_its_forward_gets_zero_records() -> None:
    """The model's own parameter, unused: re-run per datum (torch.func cannot batch the GRU
    there), no gradient reaches it, and its records are zeros (was: autograd's error)."""
    torch.manual_seed(0)
    model = SeqFirst("gru").to(D64)
    model.spare = nn.Parameter(torch.randn(3, dtype=D64))
    model.pos.requires_grad_(False)  # so that the model's own recorded parameters are unused
    x = torch.randint(0, 5, (6, 4))
    got = hooks_grads(model, lambda: model(x).pow(2).sum((0, 2)))
    assert_same(got, loop_grads(model, lambda: model(x).pow(2).sum((0, 2))))
    assert not got["spare"].any()


# -- activation checkpointing ----------------------------------------------------------------
class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            h = self.inner(x)
        else:
            h = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_each_layer_once(reentrant: bool) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Checkpointed(reentrant).to(D64)
    reference = copy.deepcopy(model)
    reference.reentrant = None  # the same model without checkpointing
    x = torch.randn(4, 3, 4, dtype=D64, requires_grad=reentrant)  # reentrant needs a grad input
    for reduction in ("mean", "sum"):
        got = hooks_grads(model, lambda: model(x).pow(2).sum((1, 2)), reduction)
        want = loop_grads(reference, lambda: reference(x).pow(2).sum((1, 2)), reduction)
        assert_same(got, want)


# -- torch.compile -----------------------------------------------------------------------------
def test_a_compiled_model_records_what_the_eager_one_records_without_recompiling(
        tmp_path: Path) -> None:
    """Dynamo traced gradlog's hooks, guarded on the ids they look up and recompiled at
    every step (its recompile limit was hit). The recorded forward now runs eagerly
    (torch.compiler.set_stance("force_eager") around it): nothing is compiled while
    recording, and the records are the eager model's."""
    if not hasattr(torch.compiler, "set_stance"):
        pytest.skip("torch < 2.6 has no set_stance")
    compiled = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        compiled.append(gm)
        return gm.forward

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))

    xs = [torch.randn(8, 5, 6, dtype=torch.float32) for _ in range(4)]
    ys = [torch.randint(0, 3, (8, 5)) for _ in range(4)]

    def record(model: nn.Module, path: Path) -> dict[str, np.ndarray]:
        with gradlog.GradRecorder(model, path, check_every=1) as rec:
            for x, y in zip(xs, ys):
                model.zero_grad()
                losses = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(1)
                rec.backward(losses)
        run = gradlog.open(path)
        return {n: run.grads(n) for n in run.param_names}

    torch._dynamo.reset()
    eager = record(make(), tmp_path / "eager.gradlog")
    model = torch.compile(make(), backend=backend)
    got = record(model, tmp_path / "compiled.gradlog")
    assert compiled == []  # nothing traced while recording: no recompiles
    assert set(got) == set(eager) and len(got) == 6
    for name in eager:
        np.testing.assert_array_equal(got[name], eager[name])
    model(xs[0])  # outside the recorder the model compiles as usual
    assert len(compiled) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("wrap", ["function", "wrapper module"])
def test_a_recorded_model_called_inside_compiled_code_is_refused_clearly(
        tmp_path: Path, wrap: str) -> None:
    """The recorded model inside a compiled function or a compiled wrapper: dynamo traced
    gradlog's own hook and failed on a forbidden call (an AssertionError from torch's
    internals). Now a refusal that says what to do; the same recorder then records the
    model called eagerly."""
    if not hasattr(torch.compiler, "set_stance"):
        pytest.skip("torch < 2.6 has no set_stance")
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(6, 4)
    outer = (torch.compile(lambda x: model(x), backend="eager") if wrap == "function"
             else torch.compile(nn.Sequential(model), backend="eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's own notes while it traces
        with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
            with pytest.raises(UnsupportedLayerError, match=r"inside a torch\.compile'd"):
                outer(x)
            rec.backward((model(x) ** 2).sum(1))  # the eager call still records
    assert gradlog.open(tmp_path / "r.gradlog").steps.num_rows == 1
    torch._dynamo.reset()
