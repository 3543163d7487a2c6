"""The losses' checks read after the backward, as on a GPU.

On CUDA the checks of a batch's losses (a NaN loss, ignored labels a mean would count, exact
zeros of unknown origin) are read after the backward where setting ``p.grad`` back to None
undoes it (:func:`gradlog.backends.base.restorable_leaves`): read before it, the host waited
for the whole forward before launching the backward's first kernel. These tests run that
path on the CPU (``LATE_CHECK_DEVICES`` patched to include it) against a recorder that read
them first, and check the conditions under which the checks are still read first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradlog
import gradlog.backends.base as base
from gradlog.errors import InputError, NonFiniteLossError
from gradlog.testing.zoo import gpt_batch, per_token_ce, tiny_gpt

D64 = torch.float64


@pytest.fixture
def late(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "LATE_CHECK_DEVICES", frozenset({"cpu", "cuda"}))


def _nan_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    poison = torch.ones(x.shape[0], 1, dtype=D64)
    poison[2] = float("nan")
    return per_token_ce(model(x), y) * poison  # (B, T): datum 2's loss NaN


def _run(path: Path, refuse: str | None, mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Three batches recorded, the second refused first (``refuse``: how) when given; the
    stored per-datum gradients of the recorded steps, by step."""
    torch.manual_seed(0)
    model = tiny_gpt(dtype=D64)
    x, y, _ = gpt_batch(4, 6)
    y[1, 3:] = -100
    keep = y != -100
    with gradlog.GradRecorder(model, path, dtype="float64", batch_grad="sum") as rec:
        for step in range(3):
            model.zero_grad(set_to_none=True)
            if step == 1 and refuse == "nan":
                with pytest.raises(NonFiniteLossError,
                                   match=r"datum\(s\) \[2\].*after the backward.*set back"):
                    rec.backward(_nan_losses(model, x, y), mask=keep, step=step)
                assert all(p.grad is None for p in model.parameters())
            if step == 1 and refuse == "ignored":
                with pytest.raises(InputError,
                                   match=r"ignore_index=-100.*after the backward.*Run the fo"):
                    rec.backward(per_token_ce(model(x), y), step=step)
                assert all(p.grad is None for p in model.parameters())
            rec.backward(per_token_ce(model(x), y), mask=keep, step=step)
    run = gradlog.open(path)
    names = [n for n, _ in model.named_parameters()]
    return {int(s): {n: run.grads(n, step=int(s), dtype=np.float64) for n in names}
            for s in sorted(set(run.steps.column("step").to_pylist()))}


@pytest.mark.parametrize("refuse", ["nan", "ignored"])
def test_a_batch_refused_after_its_backward_leaves_p_grad_and_the_store_as_before(
        tmp_path: Path, late: None, refuse: str) -> None:
    """Refused after the backward: ``p.grad`` is None again, the spot check's verdict of the
    refused backward is dropped (it would be raised by the next step), and a fresh forward
    of the same batch records exactly what a run that never saw the refused one records."""
    got = _run(tmp_path / "late.gradlog", refuse)
    want = _run(tmp_path / "plain.gradlog", None)
    assert got.keys() == want.keys() == {0, 1, 2}
    for step, grads in want.items():
        for name, g in grads.items():
            np.testing.assert_array_equal(got[step][name], g, err_msg=f"{step} {name}")


def test_without_the_late_path_the_same_losses_may_be_retried(tmp_path: Path) -> None:
    """Read before the backward (the CPU, here unpatched), a refused batch keeps its graph:
    the same losses are then recorded with ``mask=``."""
    torch.manual_seed(0)
    model = tiny_gpt(dtype=D64)
    x, y, _ = gpt_batch(4, 6)
    y[1, 3:] = -100
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", dtype="float64") as rec:
        losses = per_token_ce(model(x), y)
        with pytest.raises(InputError, match="ignore_index=-100") as refused:
            rec.backward(losses)
        assert "after the backward" not in str(refused.value)
        rec.backward(losses, mask=y != -100)


def test_gradients_being_accumulated_are_checked_before_the_backward(
        tmp_path: Path, late: None) -> None:
    """With ``p.grad`` holding an earlier micro-batch's gradient, None would not undo the
    backward: the checks are read before it, ``p.grad`` is kept bitwise and the same
    losses may be retried."""
    torch.manual_seed(0)
    model = tiny_gpt(dtype=D64)
    x, y, _ = gpt_batch(4, 6)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", dtype="float64") as rec:
        rec.backward(per_token_ce(model(x), y), step=0)  # micro-batch 1 of the step
        before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        losses = _nan_losses(model, x, y)
        with pytest.raises(NonFiniteLossError) as refused:
            rec.backward(losses, step=0)
        assert "after the backward" not in str(refused.value)
        for n, p in model.named_parameters():
            assert p.grad is not None and torch.equal(p.grad, before[n]), n


def test_an_optimizer_in_the_backward_is_checked_before_it(tmp_path: Path, late: None) -> None:
    """A hook on a parameter's gradient accumulation (an optimizer stepping in the backward)
    acts on it: it would have run on a refused batch, so the checks are read before."""
    torch.manual_seed(0)
    model = tiny_gpt(dtype=D64)
    x, y, _ = gpt_batch(4, 6)
    stepped: list[str] = []
    handle = model.head.weight.register_post_accumulate_grad_hook(
        lambda p: stepped.append("step"))
    with (gradlog.GradRecorder(model, tmp_path / "r.gradlog", dtype="float64") as rec,
          pytest.raises(NonFiniteLossError) as refused):
        rec.backward(_nan_losses(model, x, y))
    assert "after the backward" not in str(refused.value)
    handle.remove()
    assert stepped == []


def test_the_losses_are_read_after_the_step_is_encoded(
        tmp_path: Path, late: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Late, a steady step's losses' checks are read with the backward's own, after the
    encoding: no read of the device between the forward and the end of the encoding."""
    from gradlog.losses import DeviceChecks
    from gradlog.recording.encoding import FormEncoder

    order: list[str] = []
    for cls, method, mark in ((DeviceChecks, "settle", "losses read"),
                              (FormEncoder, "encode", "encoded")):
        original = getattr(cls, method)

        def marked(self: Any, *args: Any, _o: Any = original, _m: str = mark,
                   **kwargs: Any) -> Any:
            out = _o(self, *args, **kwargs)
            order.append(_m)
            return out

        monkeypatch.setattr(cls, method, marked)
    torch.manual_seed(0)
    model = tiny_gpt(dtype=D64)
    x, y, keep = gpt_batch(4, 6)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", form="norm") as rec:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            rec.backward(per_token_ce(model(x), y), mask=keep)
    # (the first step's datum check reads every verdict inside the backward, after it)
    assert order[2:] == ["encoded", "losses read"], order


def test_exact_zeros_of_unknown_origin_still_warn_when_read_late(
        tmp_path: Path, late: None) -> None:
    torch.manual_seed(0)
    model = tiny_gpt(dtype=D64)
    x, y, keep = gpt_batch(4, 6)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        logits = model(x)
        raw = -logits.log_softmax(-1).gather(-1, y.unsqueeze(-1))[..., 0]
        with pytest.warns(UserWarning, match="exact zeros and no mask"):
            rec.backward(raw * keep)  # (B, T): zeros where keep is False


def test_a_refused_first_batch_plans_no_forms(tmp_path: Path, late: None) -> None:
    """A first batch of one datum has no datum check to read its losses early: refused, it
    planned the run's forms (`auto`: rows for its 4 tokens), and every later batch of 6
    tokens was refused. The losses are now read before the forms are planned (found in
    review)."""
    forms = {}
    for refused in (True, False):
        torch.manual_seed(0)
        model = tiny_gpt(dtype=D64, block_size=8)
        path = tmp_path / f"{refused}.gradlog"
        with gradlog.GradRecorder(model, path, dtype="float64", form="auto") as rec:
            if refused:
                xb, yb, kb = gpt_batch(1, 4, seed=1)
                with pytest.raises(NonFiniteLossError, match="after the backward"):
                    rec.backward(per_token_ce(model(xb), yb) * float("nan"), mask=kb, step=0)
                model.zero_grad(set_to_none=True)
            x, y, keep = gpt_batch(4, 6)
            rec.backward(per_token_ce(model(x), y), mask=keep, step=0)
        forms[refused] = gradlog.open(path).params.column("form").to_pylist()
    assert forms[True] == forms[False]


def _head_outside(temperature_grad: float | None) -> tuple[Any, ...]:
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh()).to(D64)
    head = torch.nn.Linear(7, 3).to(D64)  # trained, not in the recorded model
    temp = torch.tensor(1.0, dtype=D64, requires_grad=True)  # a learned temperature
    if temperature_grad is not None:
        temp.grad = torch.tensor(temperature_grad, dtype=D64)
    x, y = torch.randn(4, 5, dtype=D64), torch.tensor([0, 1, 2, 1])
    poison = torch.tensor([1.0, float("nan"), 1.0, 1.0], dtype=D64)
    return body, head, temp, x, y, poison


def test_leaves_outside_the_model_are_set_back_too(tmp_path: Path, late: None) -> None:
    """A head outside the recorded model and a learned temperature get the refused batch's
    gradient in its backward: their ``.grad`` is set back to None with the model's (found in
    review: they kept NaN, and the next ``opt.step()`` trained on it)."""
    body, head, temp, x, y, poison = _head_outside(None)
    with gradlog.GradRecorder(body, tmp_path / "r.gradlog", dtype="float64") as rec:
        losses = F.cross_entropy(head(body(x)) / temp, y, reduction="none") * poison
        with pytest.raises(NonFiniteLossError, match="after the backward"):
            rec.backward(losses)
    assert temp.grad is None and all(
        p.grad is None for p in [*body.parameters(), *head.parameters()])


def test_a_leaf_outside_the_model_holding_a_gradient_keeps_the_checks_first(
        tmp_path: Path, late: None) -> None:
    body, head, temp, x, y, poison = _head_outside(0.5)
    with gradlog.GradRecorder(body, tmp_path / "r.gradlog", dtype="float64") as rec:
        losses = F.cross_entropy(head(body(x)) / temp, y, reduction="none") * poison
        with pytest.raises(NonFiniteLossError) as refused:
            rec.backward(losses)
    assert "after the backward" not in str(refused.value)
    assert temp.grad is not None and temp.grad.item() == 0.5
    assert all(p.grad is None for p in [*body.parameters(), *head.parameters()])


def test_a_users_hook_on_a_parameters_gradient_keeps_the_checks_first(
        tmp_path: Path, late: None) -> None:
    """An optimizer fused into the backward by ``p.register_hook`` (LOMO) would step on a
    refused batch: with a hook of the user's on a gradient the checks are read before the
    backward (gradlog's own hooks do not count; found in review)."""
    body, head, _, x, y, poison = _head_outside(None)
    ran: list[str] = []
    handle = body[0].weight.register_hook(lambda g: ran.append("hook"))
    with gradlog.GradRecorder(body, tmp_path / "r.gradlog", dtype="float64") as rec:
        losses = F.cross_entropy(head(body(x)), y, reduction="none") * poison
        with pytest.raises(NonFiniteLossError) as refused:
            rec.backward(losses)
    handle.remove()
    assert ran == [] and "after the backward" not in str(refused.value)


def test_an_interrupt_in_the_backward_of_a_refused_batch_is_not_replaced(
        tmp_path: Path, late: None) -> None:
    """Ctrl-C during the backward of a batch whose losses then fail their checks: the
    interrupt reaches the caller, not ``NonFiniteLossError`` (a loop that skips refused
    batches would have swallowed it; found in review); ``p.grad`` is set back all the same."""
    body, head, _, x, y, poison = _head_outside(None)

    def interrupt(grad: torch.Tensor) -> None:
        raise KeyboardInterrupt

    with gradlog.GradRecorder(body, tmp_path / "r.gradlog", dtype="float64") as rec:
        h = body(x)
        h.register_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            rec.backward(F.cross_entropy(head(h), y, reduction="none") * poison)
    assert all(p.grad is None for p in [*body.parameters(), *head.parameters()])


@pytest.mark.parametrize("read_late", [False, True])
def test_the_exact_zeros_warning_points_at_the_callers_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_late: bool) -> None:
    if read_late:
        monkeypatch.setattr(base, "LATE_CHECK_DEVICES", frozenset({"cpu", "cuda"}))
    torch.manual_seed(0)
    model = tiny_gpt(dtype=D64)
    x, y, keep = gpt_batch(4, 6)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        raw = -model(x).log_softmax(-1).gather(-1, y.unsqueeze(-1))[..., 0]
        with pytest.warns(UserWarning, match="exact zeros") as seen:
            rec.backward(raw * keep)
    assert [Path(w.filename).name for w in seen] == [Path(__file__).name]
