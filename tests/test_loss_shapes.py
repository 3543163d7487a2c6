"""Loss shapes that would record wrong per-datum gradients without an error: per-token losses
flattened to (B*T,), and per-token losses whose ignore_index padding a mean would count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.errors import InputError
from gradlog.testing.oracle import naive_per_datum_grads

D64 = torch.float64
B, T, V = 3, 5, 7


def _lm() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A per-token model (B, T) -> (B, T, V), its inputs, and labels padded with -100."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(V, 4), nn.Linear(4, V)).to(D64)
    ids = torch.randint(0, V, (B, T), generator=gen)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[1, 3:] = -100  # datum 1: 3 labelled tokens of 5
    labels[2, 1:] = -100  # datum 2: 1 of 5
    return model, ids, labels


def test_flattened_per_token_losses_are_refused_naming_the_shape_and_the_fix(
        tmp_path: Path) -> None:
    """Language-model code flattens logits to (B*T, V); the hooks backend refused that with
    a message about a shared output, the store would have held B*T 'datums'."""
    model, ids, labels = _lm()
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        logits = model(ids)  # (B, T, V)
        flat = F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="none")  # (B*T,)
        with pytest.raises(InputError, match=r"shape \(15,\).*\(3, 5, 7\).*losses\.view\(3, 5\)"):
            rec.backward(flat)
    assert all(p.grad is None for p in model.parameters())  # refused before any backward


def test_per_datum_losses_of_a_flat_batch_are_accepted(tmp_path: Path) -> None:
    """A (B,) loss whose model saw (B, d) rows is not mistaken for flattened tokens."""
    model = nn.Linear(4, 3).double()
    x = torch.randn(6, 4, dtype=D64)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        rec.backward(F.cross_entropy(model(x), torch.arange(6) % 3, reduction="none"))


@pytest.mark.parametrize("layout", ["transposed", "flattened_then_viewed"])
def test_ignored_labels_without_a_mask_are_refused(tmp_path: Path, layout: str) -> None:
    """Without mask=, the mean over each datum's T tokens counted the -100 positions (loss 0):
    datum 2 got a fifth of its gradient, silently."""
    model, ids, labels = _lm()
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        logits = model(ids)  # (B, T, V)
        if layout == "transposed":
            losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        else:
            losses = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1),
                                     reduction="none").view(B, T)
        with pytest.raises(InputError, match=r"ignore_index=-100.*6 positions.*mask=\(labels"):
            rec.backward(losses)
        # a mask that keeps the padded positions (an attention mask) is refused the same way
        with pytest.raises(InputError, match="the mask keeps 6 positions"):
            rec.backward(losses, mask=torch.ones(B, T, dtype=torch.bool))
    assert all(p.grad is None for p in model.parameters())


def test_ignored_labels_with_their_mask_record_each_datums_mean(tmp_path: Path) -> None:
    model, ids, labels = _lm()
    keep = labels != -100
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        losses = F.cross_entropy(model(ids).transpose(1, 2), labels, reduction="none")
        rec.backward(losses, mask=keep)
    got = gradlog.open(tmp_path / "r.gradlog").grads("1.weight", step=0)

    def datum_loss(b: int) -> torch.Tensor:
        lab = labels[b][keep[b]]
        return F.cross_entropy(model(ids[b : b + 1])[0][keep[b]], lab)  # mean over its tokens

    params = dict(model.named_parameters())
    want = naive_per_datum_grads(datum_loss, {"1.weight": params["1.weight"]}, B)["1.weight"]
    torch.testing.assert_close(torch.from_numpy(got).double(), want, rtol=1e-5, atol=1e-7)


def test_ignored_labels_with_a_token_sum_need_no_mask(tmp_path: Path) -> None:
    model, ids, labels = _lm()
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", token_reduction="sum") as rec:
        rec.backward(F.cross_entropy(model(ids).transpose(1, 2), labels, reduction="none"))


def test_exact_zero_losses_of_unknown_origin_warn(tmp_path: Path) -> None:
    """Per-token losses not from cross_entropy (a chunked head, a custom loss) whose zeros may
    be ignored labels: gradlog cannot read the labels, so it warns."""
    model, ids, labels = _lm()
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec:
        logits = model(ids)  # (B, T, V)
        keep = labels != -100
        raw = -logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1))[..., 0]
        losses = raw * keep  # (B, T): zeros at the padded positions
        with pytest.warns(UserWarning, match="exact zeros and no mask"):
            rec.backward(losses)


@pytest.mark.parametrize("amp", [False, True])
def test_a_refused_batch_records_from_the_same_losses_with_its_mask(
        tmp_path: Path, amp: bool) -> None:
    """The losses' checks are read late, after the hooks backend's walk of the graph (it then
    overlaps the forward's device work): a batch refused for its ignored labels, then
    recorded from the same losses with ``mask=``, records what a fresh forward records. The
    refused call leaves nothing hooked and keeps what the forward noted (under autocast, the
    dtypes the datum check's tolerance allows for); a GPT with shared position outputs."""
    from gradlog.testing.zoo import gpt_batch, tiny_gpt

    x, y, _ = gpt_batch(4, 6)
    y[1, 3:] = -100
    y[3, 1:] = -100
    keep = y != -100
    runs = {}
    for name in ("again", "fresh"):
        torch.manual_seed(0)
        model = tiny_gpt(dtype=torch.float32 if amp else D64)
        path = tmp_path / f"{name}.gradlog"
        with gradlog.GradRecorder(model, path, dtype="float64") as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                logits = model(x)  # (B, T, V)
            losses = F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none")
            if name == "again":
                with pytest.raises(InputError, match=r"ignore_index=-100.*8 positions"):
                    rec.backward(losses)
                assert all(p.grad is None for p in model.parameters())
                assert rec._backend._autocast == ({torch.bfloat16} if amp else set())
            rec.backward(losses, mask=keep)
        runs[name] = gradlog.open(path)
    for param in runs["fresh"].param_names:
        torch.testing.assert_close(torch.from_numpy(runs["again"].grads(param)),
                                   torch.from_numpy(runs["fresh"].grads(param)), rtol=1e-12,
                                   atol=1e-15, msg=param)


def test_exact_zero_losses_through_a_trainers_session_warn_once(tmp_path: Path) -> None:
    """The Trainer/Lightning session reduces the losses itself, then the recorder again in
    the trainer's backward: each warned of the same zeros (found in review)."""
    import warnings

    from gradlog.integrations.session import RecordingSession
    from gradlog.testing.zoo import gpt_batch, tiny_gpt

    torch.manual_seed(0)
    model = tiny_gpt(dtype=D64)
    x, y, keep = gpt_batch(4, 6)
    session = RecordingSession(tmp_path / "r.gradlog", {})
    session.start(model, torch.optim.SGD(model.parameters(), lr=0.1), resuming=False)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            raw = -model(x).log_softmax(-1).gather(-1, y.unsqueeze(-1))[..., 0]  # (B, T)
            session.loss(raw * keep, datum_ids=torch.arange(4), step=0).backward()
    finally:
        session.close()
    assert [str(w.message)[:34] for w in seen] == ["per-token losses of shape (4, 6) h"]
