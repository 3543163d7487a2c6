"""When op-level capture watches the forward (``watch_ops``): every forward of a model that
uses a parameter outside its modules; only the first forwards of one whose modules cover
every use; and a use that first appears on an unwatched forward is refused by an exact check
of every entry, never recorded wrong in silence. Each step against the loop oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.backends import BACKENDS
from gradlog.backends.hooks import HooksBackend
from gradlog.backends.hooks import operations as ops
from gradlog.backends.hooks.checks import SpotCheck
from gradlog.errors import BackendError, InputError
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
    # new uses (3 calls, then 2) on unwatched forwards: checked at every entry, and learnt
    # only by a watched forward that has them (a passing check proves nothing of a use that
    # gave no gradient): 3 calls come back unwatched once more before one is watched
    assert full[0] == 3


def test_watch_ops_is_validated() -> None:
    with pytest.raises(BackendError, match="watch_ops"):
        HooksBackend(nn.Linear(2, 2), {}, batch_reduction="mean", randomness="different",
                     watch_ops="never")


class _ByHandLM(nn.Module):
    """Per-token losses (B, T) from an embedding and a head; ``by_hand`` adds one row of the
    embedding matrix by hand (a free use touching few entries)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)
        self.by_hand = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)  # (B, T, d)
        if self.by_hand:
            h = h + self.emb.weight[3]
        return self.head(h)  # (B, T, V)


def _token_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # (B, T)


def _rows_off(run: Any, model: nn.Module, step: int) -> list[int]:
    """Rows of ``emb.weight`` where the stored records' mean is not ``p.grad``."""
    got = torch.from_numpy(run.grads("emb.weight", step=step, dtype=np.float64)).mean(0)
    return torch.nonzero((got - model.emb.weight.grad).abs().amax(1) > 1e-6).flatten().tolist()


def test_a_failed_full_check_read_after_encoding_still_watches_the_next_forward(
        tmp_path: Path) -> None:
    """The recorder reads the backward's checks after encoding the step: a use first seen on
    an unwatched forward fails its every-entry check then, and only a check that passed may
    teach the watcher its uses (found in review: learnt before the read, the next forward with
    the same use went unwatched and unchecked, and its records were stored wrong)."""
    torch.manual_seed(0)
    model = _ByHandLM().to(D64)
    gen = torch.Generator().manual_seed(1)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", dtype="float64") as rec:
        for step in range(ops.SCANS + 2):  # the by-hand use from the first unwatched forward
            model.zero_grad(set_to_none=True)
            model.by_hand = step >= ops.SCANS
            x, y = torch.randint(0, 64, (4, 6), generator=gen), torch.randint(0, 64, (4, 6),
                                                                             generator=gen)
            if step == ops.SCANS:
                with pytest.raises(BackendError, match="watch_ops='always'"):
                    rec.backward(_token_losses(model, x, y), step=step)
            else:
                rec.backward(_token_losses(model, x, y), step=step)
            assert step != ops.SCANS + 1 or rec._backend._ops.always  # watched: a free use
    run = gradlog.open(tmp_path / "r.gradlog")
    assert ops.SCANS not in run.steps.column("step").to_pylist()
    assert _rows_off(run, model, ops.SCANS + 1) == []


def test_a_batch_refused_by_its_loss_checks_is_checked_in_full_when_retried(
        tmp_path: Path) -> None:
    """The losses' checks are read after the op-use walk: a batch refused for its ignored
    labels undoes what the walk noted, so a retry on the same graph with ``mask=`` is still
    compared at every entry and refused like a fresh call (found in review: the retry was
    recorded wrong)."""
    outcomes = []
    for retry in (False, True):
        torch.manual_seed(0)
        model = _ByHandLM().to(D64)
        gen = torch.Generator().manual_seed(1)
        with gradlog.GradRecorder(model, tmp_path / f"{retry}.gradlog") as rec:
            for step in range(ops.SCANS + 2):
                model.zero_grad(set_to_none=True)
                model.by_hand = step == ops.SCANS + 1
                x, y = torch.randint(0, 64, (4, 6), generator=gen), torch.randint(
                    0, 64, (4, 6), generator=gen)
                y[1, 3:] = -100
                losses = _token_losses(model, x, y)
                if retry and model.by_hand:
                    with pytest.raises(InputError, match="ignore_index"):
                        rec.backward(losses, step=step)
                try:
                    rec.backward(losses, mask=y != -100, step=step)
                    outcomes.append("recorded")
                except BackendError as e:
                    outcomes.append("refused" if "every entry" in str(e) else str(e))
    n = ops.SCANS + 2
    assert outcomes[:n] == outcomes[n:] and outcomes[-1] == "refused", outcomes


def _stored_rows_off(run: Any, grads: dict[int, torch.Tensor]) -> dict[int, list[int]]:
    out = {}
    for step, g in grads.items():
        got = torch.from_numpy(run.grads("emb.weight", step=step, dtype=np.float64)).mean(0)
        out[step] = torch.nonzero((got - g).abs().amax(1) > 1e-6).flatten().tolist()
    return out


def test_a_failed_check_is_never_learnt_by_a_later_one_that_passed(tmp_path: Path) -> None:
    """Found in a second review: the uses of a failed every-entry check stayed pending past
    the watched forward that followed, whose passing spot check then learnt them, so the
    next unwatched forward with the by-hand use was only spot-checked and stored wrong."""
    torch.manual_seed(0)
    model = _ByHandLM().to(D64)
    gen = torch.Generator().manual_seed(1)
    plan = [False] * ops.SCANS + [True, False, True, True]
    stored: dict[int, torch.Tensor] = {}
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", dtype="float64") as rec:
        for step, by_hand in enumerate(plan):
            model.zero_grad(set_to_none=True)
            model.by_hand = by_hand
            x, y = torch.randint(0, 64, (4, 6), generator=gen), torch.randint(
                0, 64, (4, 6), generator=gen)
            try:
                rec.backward(_token_losses(model, x, y), step=step)
                stored[step] = model.emb.weight.grad.clone()
            except BackendError as e:
                assert "every entry" in str(e) and by_hand, (step, e)
    assert ops.SCANS not in stored
    off = _stored_rows_off(gradlog.open(tmp_path / "r.gradlog"), stored)
    assert all(rows == [] for rows in off.values()), off


@pytest.mark.parametrize("warm", [ops.SCANS, ops.SCANS - 1])
def test_forwards_run_before_their_backwards_are_each_verified(tmp_path: Path,
                                                               warm: int) -> None:
    """Two forwards, then their two backwards (accumulation), the first forward unwatched
    or the last one watched: the first backward does not make the second, unwatched
    forward count as verified (found in the second and third reviews: its backward went
    down the watched path and its by-hand use was learnt unchecked)."""
    torch.manual_seed(0)
    model = _ByHandLM().to(D64)
    gen = torch.Generator().manual_seed(1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 64, (4, 6), generator=gen), torch.randint(
            0, 64, (4, 6), generator=gen)

    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        for step in range(warm):
            model.zero_grad(set_to_none=True)
            rec.backward(_token_losses(model, *batch()), step=step)
        model.zero_grad(set_to_none=True)
        model.by_hand = False
        first = _token_losses(model, *batch())
        model.by_hand = True
        second = _token_losses(model, *batch())
        rec.backward(first, step=warm)
        with pytest.raises(BackendError, match="every entry"):
            rec.backward(second, step=warm)


def test_a_failed_datum_check_leaves_no_verdict_to_the_next_step(tmp_path: Path) -> None:
    """The backward's spot check is read before its datum check, so a step refused there
    leaves nothing pending (found in a second review: the next, clean step was refused
    with the earlier one's verdict)."""

    class Summed(_ByHandLM):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            if self.by_hand:  # every row, by hand: a free use the datum check also sees
                h = h + 0.1 * self.emb.weight.sum(0)
            return self.head(h)

    torch.manual_seed(0)
    model = Summed().to(D64)
    gen = torch.Generator().manual_seed(1)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", check_every=1) as rec:
        for step in range(ops.SCANS + 2):
            model.zero_grad(set_to_none=True)
            model.by_hand = step == ops.SCANS
            x, y = torch.randint(0, 64, (4, 6), generator=gen), torch.randint(
                0, 64, (4, 6), generator=gen)
            if model.by_hand:
                with pytest.raises(BackendError, match="do not add up"):
                    rec.backward(_token_losses(model, x, y), step=step)
            else:
                rec.backward(_token_losses(model, x, y), step=step)
    assert gradlog.open(tmp_path / "r.gradlog").steps.column("step").to_pylist() == [
        s for s in range(ops.SCANS + 2) if s != ops.SCANS]


@pytest.mark.parametrize(("extra", "repeat"), [(False, 1), (True, 1), (True, 3)])
def test_one_graph_walk_answers_both_readers_as_a_naive_one_would(extra: bool,
                                                                  repeat: int) -> None:
    """GraphSurvey (one walk for op-use signatures and captured outputs' consumers) against
    a naive oracle over every node of the graph, on a graph with a free use, a module
    called several times and a broadcast add; asked in either order."""
    from gradlog._torch_private import gradient_accumulator
    from gradlog.backends.base import graph_nodes
    from gradlog.backends.hooks.graph import TAG, GraphSurvey

    torch.manual_seed(0)
    model = Switchable()
    model.extra, model.repeat = extra, repeat
    be = _backend(model, "always")
    losses = model(torch.randint(0, 50, (3, 5)))
    root = losses.mean().grad_fn
    held = {n: gradient_accumulator(p) for n, p in model.named_parameters()}
    names = {id(node): n for n, node in held.items()}
    nodes = list(graph_nodes(root))
    edges: dict[str, int] = {}
    calls: dict[int, set[int]] = {}
    consumers: dict[int, set[tuple[int, int]]] = {}
    for node in nodes:
        for _, call in node.metadata.get(TAG, ()):
            calls.setdefault(id(call.entry), set()).add(id(call))
        for slot, (child, nr) in enumerate(node.next_functions):
            if child is None:
                continue
            if id(child) in names:
                edges[names[id(child)]] = edges.get(names[id(child)], 0) + 1
            for out, call in child.metadata.get(TAG, ()):
                if out == nr:
                    consumers.setdefault(id(call), set()).add((id(node), slot))
    assert consumers and calls and len(edges) == len(held)
    wanted = set(consumers) | {0}
    for order in ("uses first", "consumers first"):
        survey = GraphSurvey(root)
        if order == "consumers first":
            found = survey.consumers(wanted)
        got_edges, got_calls = survey.uses(names)
        if order == "uses first":
            found = survey.consumers(wanted)
        assert got_edges == edges
        assert got_calls == {e: len(c) for e, c in calls.items()}
        assert {k: {(id(n), s) for n, s in v} for k, v in found.items()} == consumers
    assert GraphSurvey(None).uses(names) == ({}, {}) and GraphSurvey(None).consumers(wanted) == {}
    be.detach()


class _TiedLater(nn.Module):
    """A head weight also embedded by hand (``F.embedding(extra, out.weight)``), only from a
    later step on, and at first with padding only (no gradient from it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 50, bias=False)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (B, T, d)
        if extra is not None:
            h = h + F.embedding(extra, self.out.weight, padding_idx=0)
        return self.out(h).pow(2).sum((1, 2))  # (B,)


def test_a_new_use_that_gave_no_gradient_is_not_learnt_as_covered() -> None:
    """It appears on an unwatched forward (step 2) embedding padding only: its graph passes
    the full check with nothing to show. Learnt from that, later steps with real tokens
    (only the 4-entry spot check then) lost its gradient from the records."""
    torch.manual_seed(0)
    model = _TiedLater().to(D64)
    be = _backend(model)
    for step in range(5):
        x = torch.randn(3, 4, 8, dtype=D64)
        extra = None if step < 2 else torch.zeros(3, 4, dtype=torch.long)
        if step >= 3:
            extra[0, 1], extra[2, 3] = 7, 11  # type: ignore[index]
        model.zero_grad(set_to_none=True)
        got = be.backward(losses := model(x, extra), losses.mean())
        twin = _TiedLater().to(D64)
        twin.load_state_dict(model.state_dict())
        loop = BACKENDS["loop"](twin, select_params(twin, ["*"]), batch_reduction="mean",
                                randomness="different")
        want = loop.step(lambda m, b: m(*b), (x, extra), lambda raw, mask: raw, None,
                         lambda losses: None)[1]
        _assert_exact(got, want)
