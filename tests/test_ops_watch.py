"""When op-level capture watches the forward (``watch_ops``): every forward of a model that
uses a parameter outside its modules; only the first forwards of one whose modules cover
every use; and a use that first appears on an unwatched forward is refused by an exact check
of every entry, never recorded wrong in silence. Each step against the loop oracle."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gradlog.backends import BACKENDS
from gradlog.backends.hooks import HooksBackend
from gradlog.backends.hooks import operations as ops
from gradlog.backends.hooks.checks import SpotCheck
from gradlog.errors import BackendError
from gradlog.params import select_params

D64 = torch.float64


class Switchable(nn.Module):
    """An embedding and a linear layer; ``extra`` decides, per forward, whether the
    forward also uses one row of the embedding matrix by hand (a free use touching a few
    entries, which a spot check of random entries would likely miss), and ``repeat`` how
    often the linear layer runs (data-dependent module calls, as in a mixture of experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 4)
        self.lin = nn.Linear(4, 4)
        self.extra = False
        self.repeat = 1

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, T, d)
        for _ in range(self.repeat):
            h = torch.tanh(self.lin(h))
        if self.extra:
            h = h + self.emb.weight[3]  # (d,): broadcast over the batch
        return h.pow(2).sum((1, 2))  # (B,)


def _step(be: HooksBackend, model: Switchable, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    losses = model(idx)
    return be.backward(losses, losses.mean())


def _oracle(model: Switchable, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """The loop backend's per-datum gradients, on a twin of ``model`` (no hooks on it)."""
    twin = Switchable().to(D64)
    twin.load_state_dict(model.state_dict())
    twin.extra, twin.repeat = model.extra, model.repeat
    loop = BACKENDS["loop"](twin, select_params(twin, ["*"]), batch_reduction="mean",
                            randomness="different")
    return loop.step(lambda m, b: m(b[0]), (idx,), lambda raw, mask: raw, None,
                     lambda losses: None)[1]


def _calls_of_the_mode(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen = [0]
    original = ops.OpCapture.__torch_function__

    def counting(self: ops.OpCapture, *args: object, **kwargs: object) -> object:
        seen[0] += 1
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ops.OpCapture, "__torch_function__", counting)
    return seen


def _full_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    done = [0]
    original = SpotCheck._check_all

    def counting(self: SpotCheck, *args: object) -> Any:
        done[0] += 1
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(SpotCheck, "_check_all", counting)
    return done


def _backend(model: nn.Module, watch: str = "auto") -> HooksBackend:
    be = HooksBackend(model, select_params(model, ["*"]), batch_reduction="mean",
                      randomness="different", watch_ops=watch)
    be.attach()
    return be


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_module_covered_models_are_watched_only_on_their_first_forwards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls, full = _calls_of_the_mode(monkeypatch), _full_checks(monkeypatch)
    torch.manual_seed(0)
    model = Switchable().to(D64)
    be = _backend(model)
    per_step = []
    for _ in range(5):
        idx = torch.randint(0, 50, (3, 5))
        before = calls[0]
        got = _step(be, model, idx)
        per_step.append(calls[0] - before)
        _assert_exact(got, _oracle(model, idx))
    assert all(n > 0 for n in per_step[:ops.SCANS]) and per_step[ops.SCANS:] == [0] * 3
    assert full[0] == 0  # the unwatched forwards' uses were those of the watched ones


def test_a_model_with_free_uses_is_watched_on_every_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls_of_the_mode(monkeypatch)
    torch.manual_seed(0)
    model = Switchable().to(D64)
    model.extra = True
    be = _backend(model)
    for _ in range(4):
        idx = torch.randint(0, 50, (3, 5))
        before = calls[0]
        got = _step(be, model, idx)
        assert calls[0] > before
        _assert_exact(got, _oracle(model, idx))


def test_a_free_use_first_seen_on_an_unwatched_forward_is_refused_then_watched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    full = _full_checks(monkeypatch)
    torch.manual_seed(0)
    model = Switchable().to(D64)
    be = _backend(model)
    for _ in range(ops.SCANS + 1):
        _step(be, model, torch.randint(0, 50, (3, 5)))
    model.extra = True  # the same module calls, one more use of emb.weight
    with pytest.raises(BackendError, match="watch_ops='always'") as info:
        _step(be, model, torch.randint(0, 50, (3, 5)))
    assert "emb.weight" in str(info.value) and full[0] == 1
    for _ in range(3):  # from the next forward on: watched, captured, exact
        idx = torch.randint(0, 50, (3, 5))
        _assert_exact(_step(be, model, idx), _oracle(model, idx))


def test_watch_always_records_a_late_free_use_exactly() -> None:
    torch.manual_seed(0)
    model = Switchable().to(D64)
    be = _backend(model, "always")
    for step in range(ops.SCANS + 3):
        model.extra = step == ops.SCANS + 1
        idx = torch.randint(0, 50, (3, 5))
        _assert_exact(_step(be, model, idx), _oracle(model, idx))


def test_data_dependent_module_calls_are_checked_at_every_entry_then_learnt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    full = _full_checks(monkeypatch)
    torch.manual_seed(0)
    model = Switchable().to(D64)
    be = _backend(model)
    for repeat in [1, 1, 1, 3, 1, 3, 3, 2]:
        model.repeat = repeat
        idx = torch.randint(0, 50, (3, 5))
        _assert_exact(_step(be, model, idx), _oracle(model, idx))
    # new uses (3 calls, then 2) on unwatched forwards: checked at every entry and learnt
    assert full[0] == 2


def test_watch_ops_is_validated() -> None:
    with pytest.raises(BackendError, match="watch_ops"):
        HooksBackend(nn.Linear(2, 2), {}, batch_reduction="mean", randomness="different",
                     watch_ops="never")
