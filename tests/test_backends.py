"""Every backend against the independent oracle (one forward per datum), in float64."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradlog
from gradlog.losses import per_datum_losses
from gradlog.testing.oracle import naive_per_datum_grads
from gradlog.testing.zoo import gpt_batch, mlp, mlp_batch, per_token_ce, tiny_gpt

BACKENDS = ["loop", "vmap", "hooks"]


class Case:
    """A model, a batch, and how to compute its losses batched and per datum."""

    def __init__(self, kind: str, B: int = 5) -> None:
        self.kind = kind
        self.B = B
        self.mask: torch.Tensor | None = None
        if kind == "mlp":
            self.model = mlp()
            self.batch: Any = mlp_batch(B)
        else:
            self.model = tiny_gpt(tie_weights=kind == "gpt_tied")
            x, y, mask = gpt_batch(B, 6)
            self.batch, self.mask = (x, y), mask

    def loss_fn(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        if self.kind == "mlp":
            return F.cross_entropy(model(x), y, reduction="none")  # (B,)
        return per_token_ce(model(x), y)  # (B, T); position ids broadcast as [1, T]

    def oracle(self, token_reduction: str) -> dict[str, torch.Tensor]:
        def datum_loss(b: int) -> torch.Tensor:
            one = tuple(t[b : b + 1] for t in self.batch)
            mask = None if self.mask is None else self.mask[b : b + 1]
            return per_datum_losses(self.loss_fn(self.model, one), mask, token_reduction)[0]

        return naive_per_datum_grads(datum_loss, dict(self.model.named_parameters()), self.B)

    def record(self, rec: Any, backend: str) -> torch.Tensor:
        if backend == "vmap":
            return rec.step(self.loss_fn, self.batch, mask=self.mask)  # type: ignore[no-any-return]
        losses = self.loss_fn(self.model, self.batch)
        return rec.backward(losses, mask=self.mask)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["mlp", "gpt", "gpt_tied"])
@pytest.mark.parametrize("batch_reduction", ["mean", "sum"])
@pytest.mark.parametrize("token_reduction", ["mean", "sum"])
def test_per_datum_grads_match_oracle(
    tmp_path: Any, backend: str, kind: str, batch_reduction: str, token_reduction: str
) -> None:
    if kind == "mlp" and token_reduction == "sum":
        pytest.skip("per-datum losses have no tokens to reduce")
    case = Case(kind)
    expected = case.oracle(token_reduction)
    path = tmp_path / "run.gradlog"
    with gradlog.GradRecorder(
        case.model,
        path,
        backend=backend,
        dtype="float64",
        batch_reduction=batch_reduction,
        token_reduction=token_reduction,
        check_every=1,
    ) as rec:
        case.record(rec, backend)
    run = gradlog.open(path)
    assert set(run.param_names) == set(expected)
    weight = 1.0 / case.B if batch_reduction == "mean" else 1.0
    for name, p in case.model.named_parameters():
        got = run.grads(name, dtype=np.float64)
        np.testing.assert_allclose(got, expected[name].numpy(), rtol=1e-6, atol=1e-12, err_msg=name)
        # p.grad is the weighted sum of the per-datum gradients
        np.testing.assert_allclose(
            p.grad.numpy(),
            weight * expected[name].sum(0).numpy(),
            rtol=1e-6,
            atol=1e-12,
            err_msg=name,
        )
    np.testing.assert_allclose(np.asarray(run.datums.column("weight")), weight)


def _train(model: torch.nn.Module, case: Case, steps: int, record: str | None, path: Any) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rec = gradlog.GradRecorder(model, path, backend=record or "loop", dtype="float64")
    if record:
        rec.open()
    try:
        for step in range(steps):
            if record == "vmap":
                rec.step(case.loss_fn, case.batch, mask=case.mask, step=step)
            elif record in ("loop", "hooks"):
                rec.backward(case.loss_fn(model, case.batch), mask=case.mask, step=step)
            else:  # what the user's loop does without gradlog
                losses = per_datum_losses(case.loss_fn(model, case.batch), case.mask, "mean")
                losses.mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        if record:
            rec.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_recording_does_not_change_training(tmp_path: Any, backend: str) -> None:
    case = Case("gpt")
    plain, recorded = copy.deepcopy(case.model), copy.deepcopy(case.model)
    _train(plain, case, 3, None, tmp_path / "a.gradlog")
    _train(recorded, case, 3, backend, tmp_path / "b.gradlog")
    for (name, a), b in zip(plain.named_parameters(), recorded.parameters()):
        if backend in ("loop", "hooks"):  # the ordinary backward itself: bitwise
            assert torch.equal(a, b), name
        else:  # vmap sums per-datum gradients: equal to float tolerance
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert gradlog.open(tmp_path / "b.gradlog").steps.num_rows == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_entry_point_on_every_backend(tmp_path: Any, backend: str) -> None:
    case = Case("mlp", B=4)
    expected = case.oracle("mean")
    with gradlog.GradRecorder(
        case.model, tmp_path / "r.gradlog", backend=backend, dtype="float64"
    ) as rec:
        losses = rec.step(case.loss_fn, case.batch, datum_ids=[7, 3, 9, 1])
    assert losses.shape == (4,) and not losses.requires_grad
    run = gradlog.open(tmp_path / "r.gradlog")
    assert run.datums.column("datum_id").to_pylist() == [7, 3, 9, 1]
    np.testing.assert_allclose(
        run.grads("0.weight", datum=9, dtype=np.float64)[0],
        expected["0.weight"][2].numpy(),
        rtol=1e-6,
    )


def test_vmap_handles_dict_batches(tmp_path: Any) -> None:
    case = Case("mlp", B=3)
    expected = case.oracle("mean")

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")

    x, y = case.batch
    with gradlog.GradRecorder(
        case.model, tmp_path / "r.gradlog", backend="vmap", dtype="float64"
    ) as rec:
        rec.step(loss_fn, {"x": x, "y": y})
    got = gradlog.open(tmp_path / "r.gradlog").grads("2.weight", dtype=np.float64)
    np.testing.assert_allclose(got, expected["2.weight"].numpy(), rtol=1e-6)


def test_selected_params_only(tmp_path: Any) -> None:
    case = Case("gpt")
    with gradlog.GradRecorder(
        case.model, tmp_path / "r.gradlog", params=["blocks.*.mlp.*", "head.weight"]
    ) as rec:
        case.record(rec, "loop")
    names = gradlog.open(tmp_path / "r.gradlog").param_names
    assert names and all(
        (n.startswith("blocks.") and ".mlp." in n) or n == "head.weight" for n in names
    )
    assert "head.weight" in names


# -- dropout inside a module the torch.func fallback re-runs ------------------------------------

class _NoisyBlock(torch.nn.Module):
    """Own parameters (no rule: the torch.func fallback) around nn.Dropout and nn.Dropout2d,
    one of them called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.shift = torch.nn.Parameter(torch.zeros(4, 3, 3))
        self.drop, self.drop2d = torch.nn.Dropout(0.3), torch.nn.Dropout2d(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4, 3, 3)
        y = self.drop2d(x * self.scale.view(4, 1, 1)) + self.shift
        return self.drop(torch.tanh(self.drop(y)) * self.scale.view(4, 1, 1))


class _NoisyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = _NoisyBlock(), torch.nn.Linear(36, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)).flatten(1))  # type: ignore[no-any-return]


def test_dropout_masks_are_replayed_in_the_torch_func_fallback() -> None:
    """The block was refused ("cannot reproduce the batch's masks"); now each datum's re-run
    applies its rows of the masks the batch drew (the loop oracle differentiates through the
    same masks: both forwards start from one RNG state)."""
    from gradlog.testing.oracle import assert_like_loop

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _NoisyNet().double().train()
    x = torch.randn(5, 4, 3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 0])
    described = assert_like_loop(
        model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert described["fallback"] == ["block"]


def test_dropout_replay_leaves_the_training_rng_stream_unchanged(tmp_path: Any) -> None:
    def run(record: bool) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = _NoisyNet().double().train()
            x = torch.randn(5, 4, 3, 3, dtype=torch.float64)
            y = torch.tensor([0, 1, 2, 1, 0])
            if record:
                with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
                    rec.backward(F.cross_entropy(model(x), y, reduction="none"))
            else:
                F.cross_entropy(model(x), y, reduction="none").mean().backward()
            return torch.rand(3)  # the next draw of training's stream

    assert torch.equal(run(True), run(False))


def test_dropout_in_a_fallback_module_called_twice_on_one_input_is_refused() -> None:
    """Two calls on the same tensors drew different masks, and a rule cannot tell which
    call's backward it computes: refused, never the other call's masks."""
    from gradlog.errors import BackendError
    from gradlog.testing.oracle import backend_grads

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = _NoisyBlock().double().train()
    x = torch.randn(3, 4, 3, 3, dtype=torch.float64)
    with pytest.raises(BackendError, match="more than once on the same inputs"):
        backend_grads(block, lambda: (block(x) * block(x)).sum((1, 2, 3)))


class _Functional(torch.nn.Module):
    """Own parameters (the torch.func fallback) around F.dropout calls, one in a child
    module's forward (transformers' eager attention), beside an nn.Dropout layer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.inner, self.drop = torch.nn.Tanh(), torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x * self.scale, 0.5, self.training)
        h = self.drop(torch.tanh(h))
        return F.dropout(h * self.scale, p=0.2, training=self.training) + x


def test_a_functional_dropout_in_a_fallback_module_is_replayed() -> None:
    """F.dropout in the module's own forward was refused ("draws random numbers"); its
    masks are now noted and replayed per datum, in call order with nn.Dropout's."""
    from gradlog.testing.oracle import assert_like_loop

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Functional().double().train()
    x = torch.randn(6, 5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    described = assert_like_loop(model, lambda: model(x).pow(2).sum((1, 2)))
    assert described["fallback"] == [""]


def test_functional_dropout_replay_leaves_the_training_rng_stream_unchanged(
        tmp_path: Any) -> None:
    def run(record: bool) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = _Functional().double().train()
            x = torch.randn(6, 5, 3, dtype=torch.float64)
            if record:
                with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
                    rec.backward(model(x).pow(2).sum((1, 2)))
            else:
                model(x).pow(2).sum().backward()
            return torch.rand(3)

    assert torch.equal(run(True), run(False))


def test_random_draws_that_are_not_dropout_in_a_fallback_module_are_refused() -> None:
    """torch.rand in the module's own forward cannot be replayed: refused, not recorded
    with other draws."""
    from gradlog.errors import BackendError
    from gradlog.testing.oracle import backend_grads

    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + torch.rand_like(x)

    model = Noisy().double().train()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(BackendError, match="random"):
        backend_grads(model, lambda: (model(x) ** 2).sum(1))


class _DropPath(torch.nn.Module):
    """timm's and transformers' drop path (one mask per datum), or with ``kind="noise"`` a
    module named so whose output is not its input times a mask."""

    def __init__(self, rate: float, kind: str = "mask") -> None:
        super().__init__()
        self.drop_prob, self.kind = rate, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        if self.kind == "noise":
            return x + torch.rand_like(x)
        keep = 1 - self.drop_prob
        mask = (keep + torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype)).floor_()
        return x.div(keep) * mask


class _ScaledResidual(torch.nn.Module):
    """BEiT's and ConvNeXt's layer: a layer-scale parameter (no rule: the torch.func
    fallback re-runs the layer) and a drop path on the branch."""

    def __init__(self, kind: str = "mask") -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.gamma = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.drop_path = _DropPath(0.5, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.gamma * torch.tanh(self.fc(x)))


def test_dropouts_at_rate_0_draw_nothing_to_replay(tmp_path: Any) -> None:
    """A dropout layer at rate 0 (nn.TransformerEncoderLayer(dropout=0.0)) noted a mask of
    ones on every call, so a second forward on the same batch (an extra evaluation under
    the open recorder) made the next backward refuse: "called more than once on the same
    inputs ... drew masks"."""
    model = torch.nn.Sequential(_ScaledResidual(), torch.nn.Dropout(0.0)).double().train()
    model[0].drop_path.drop_prob = 0.0
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        model(x).sum().backward()  # (not recorded)
        rec.backward(model(x).pow(2).sum((1, 2)))
    assert len(gradlog.open(tmp_path / "r.gradlog").steps) == 1


def _re_run_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers re-run per datum, as before their own parameters were taken op by op
    (gradlog/backends/hooks/containers.py): the fallback these tests are about."""
    from gradlog.backends.hooks import containers

    monkeypatch.setattr(containers.Containers, "enter", lambda self, entry: False)


@pytest.mark.parametrize("by_ops", [False, True])
def test_a_libraries_drop_path_is_replayed_in_the_torch_func_fallback(
        by_ops: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop paths (named ``...DropPath``, with a ``drop_prob``) were not replayed, so BEiT's
    and ConvNeXt's layers were refused in training ("draws random numbers"); their masks
    are now rebuilt and applied per datum, as nn.Dropout's. Taken op by op, the layer
    scale needs no replay."""
    from gradlog.testing.oracle import assert_like_loop

    if not by_ops:
        _re_run_containers(monkeypatch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(_ScaledResidual(), _ScaledResidual()).double().train()
    x = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    described = assert_like_loop(model, lambda: model(x).pow(2).sum((1, 2)))
    assert sorted(described["fallback"]) == ([] if by_ops else ["0", "1"])


@pytest.mark.parametrize("by_ops", [False, True])
def test_a_drop_path_that_is_not_a_mask_is_refused(by_ops: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Matched by name, so each call is checked: a module named so that adds noise is
    refused, never re-run with other draws. Taken op by op, nothing is re-run: the noise
    is what the forward drew, and the records are the loop's."""
    from gradlog.errors import BackendError
    from gradlog.testing.oracle import assert_like_loop, backend_grads

    if not by_ops:
        _re_run_containers(monkeypatch)
    model = torch.nn.Sequential(_ScaledResidual("noise")).double().train()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    if by_ops:
        assert_like_loop(model, lambda: model(x).pow(2).sum((1, 2)))
        return
    with pytest.raises(BackendError, match="named like a drop path"):
        backend_grads(model, lambda: model(x).pow(2).sum((1, 2)))


def test_the_oracle_compares_each_parameter_to_its_own_scale() -> None:
    """``assert_like_loop``'s absolute tolerance passes a parameter whose gradients are
    1e-8 of the model's however wrong they are (DeBERTa's relative position table was so):
    each parameter is also compared to its own largest entry; ones below 1e-9 of the
    model's largest (a key bias, rounding noise of a zero gradient) are left to atol."""
    from gradlog.testing.oracle import _each_to_its_own_scale

    want = {"big": torch.ones(2, 3), "small": torch.full((2, 3), 1e-8),
            "noise": torch.full((2, 3), 1e-12)}
    got = {n: t.clone() for n, t in want.items()}
    got["noise"] = -got["noise"]  # (noise: its sign is rounding's)
    _each_to_its_own_scale(got, want, 1e-9, "here")
    got["small"] = got["small"] * torch.tensor([[1.0], [2.0]])  # (one datum's doubled)
    with pytest.raises(AssertionError, match=r"here small: off by"):
        _each_to_its_own_scale(got, want, 1e-9, "here")
