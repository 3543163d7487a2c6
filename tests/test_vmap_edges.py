"""The vmap backend computes p.grad from the per-datum gradients (no ordinary backward): it
must leave the optimizer the gradient an ordinary backward would, and refuse what it cannot
split by datum."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.errors import InputError

D64 = torch.float64


def _losses(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")  # (B,)


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(4, 3, generator=gen, dtype=D64),
            "y": torch.randint(0, 2, (4,), generator=gen)}


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)  # type: ignore[no-any-return]


def test_an_unused_parameter_keeps_no_grad_as_after_a_plain_backward(tmp_path: Path) -> None:
    """AdamW would otherwise decay it every step."""
    model = _WithUnused().double()
    plain = copy.deepcopy(model)
    _losses(plain, _batch()).mean().backward()
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="vmap",
                              params="used.*") as rec:
        rec.step(_losses, _batch())
    assert plain.unused.weight.grad is None and model.unused.weight.grad is None
    torch.testing.assert_close(model.used.weight.grad, plain.used.weight.grad)


def test_parameter_hooks_run_as_in_an_ordinary_backward(tmp_path: Path) -> None:
    seen: list[str] = []
    model = nn.Linear(3, 2).double()
    model.weight.register_hook(lambda g: g * 0)  # a gradient-masking hook
    model.bias.register_post_accumulate_grad_hook(lambda p: seen.append("post"))
    # (check_every=0: the self-check, as with every backend, sees p.grad masked)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="vmap",
                              check_every=0) as rec:
        rec.step(_losses, _batch())
    assert torch.equal(model.weight.grad, torch.zeros_like(model.weight))
    assert seen == ["post"]


def test_a_per_datum_value_outside_the_batch_tensors_is_refused(tmp_path: Path) -> None:
    """A list of per-datum weights is one leaf for every datum: each datum's loss would be B
    losses, of which the backend kept the first (datum 0's weight for every datum)."""
    model = nn.Linear(3, 2).double()

    def weighted(m: nn.Module, batch: Any) -> torch.Tensor:
        return _losses(m, batch) * torch.tensor(batch["w"], dtype=D64)

    batch: dict[str, Any] = {**_batch(), "w": [1.0, 2.0, 3.0, 4.0]}
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="vmap") as rec, \
            pytest.raises(InputError, match="returned 4 losses"):
        rec.step(weighted, batch)


def test_a_batch_tensor_that_requires_grad_is_refused(tmp_path: Path) -> None:
    model = nn.Linear(3, 2).double()
    batch = _batch()
    batch["x"].requires_grad_(True)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="vmap") as rec, \
            pytest.raises(InputError, match="requires grad"):
        rec.step(_losses, batch)


class _LoRALike(nn.Module):
    """``base(x) + B(A(x))`` with B zero (LoRA at step 0): A's per-datum gradients are all
    exactly 0, yet the loss depends on A; a projection read only through a zero gate likewise."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(3, 2)
        self.lora_A, self.lora_B = nn.Linear(3, 4, bias=False), nn.Linear(4, 2, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.proj = nn.Linear(3, 2)
        self.register_buffer("gate", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) + self.gate * self.proj(x)


def test_a_used_parameter_with_all_zero_gradients_gets_a_zero_grad(tmp_path: Path) -> None:
    """It was taken as unused: .grad left None (so AdamW skipped its weight decay, unlike a
    plain backward), then refused "the loss does not depend on it"."""
    model = _LoRALike().double()
    plain = copy.deepcopy(model)
    _losses(plain, _batch()).mean().backward()
    assert torch.equal(plain.lora_A.weight.grad, torch.zeros(4, 3, dtype=D64))  # autograd's
    calls: list[int] = []
    model.register_forward_hook(lambda *args: calls.append(1))
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="vmap") as rec:
        rec.step(_losses, _batch())
        rec.step(_losses, _batch())
    # 2 vmapped forwards, 1 probe (the graph's verdict is kept), 1 batch forward at the
    # checked step 0 (the losses alone equal the batch's: no coupling)
    assert len(calls) == 4
    for name, p in plain.named_parameters():
        got = dict(model.named_parameters())[name].grad
        assert got is not None, name
        torch.testing.assert_close(got, 2 * p.grad)  # two steps accumulated, no zero_grad
    run = gradlog.open(tmp_path / "r.gradlog")
    assert set(run.param_names) >= {"lora_A.weight", "proj.weight"}
    assert not run.grads("lora_A.weight", step=1).any()
    assert run.grads("lora_B.weight", step=1).any()


class _TwoTasks(nn.Module):
    """A task-B adapter (its B zero, so A's gradient is exactly 0) used by task-B batches."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(5, 6), nn.Linear(6, 3)
        self.lora_A = nn.Parameter(torch.randn(2, 6) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(3, 2))
        self.task = "b"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h)
        return out + (h @ self.lora_A.T) @ self.lora_B.T if self.task == "b" else out


@pytest.mark.parametrize("tasks", [("b", "a"), ("a", "b")])
def test_whether_a_zero_gradient_parameter_is_used_is_asked_at_every_step(
        tmp_path: Path, tasks: tuple[str, str]) -> None:
    """vmap settled once per parameter whether all-zero gradients meant used (a zero .grad)
    or unused (None) and remembered it: an adapter used by one batch and not the next got
    a zero .grad where autograd leaves None (AdamW then decayed it: 5% off in 2 steps), or
    None where autograd gives zeros. Each step now asks its own forward's graph."""

    def losses(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")

    def train(record: bool) -> tuple[list[bool], torch.Tensor]:
        torch.manual_seed(0)
        model = _TwoTasks()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        g = torch.Generator().manual_seed(1)
        grads = []
        rec = gradlog.GradRecorder(model, tmp_path / f"{record}", backend="vmap",
                                   optimizer=opt) if record else None
        if rec is not None:
            rec.open()
        for task in tasks:
            model.task = task
            batch = (torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g))
            if rec is not None:
                rec.step(losses, batch)
            else:
                losses(model, batch).mean().backward()
            grads.append(model.lora_A.grad is None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rec is not None:
            rec.close()
        return grads, model.lora_A.detach().clone()

    (plain_none, plain_a), (none, a) = train(False), train(True)
    assert none == plain_none == [t == "a" for t in tasks]
    assert torch.equal(a, plain_a)


def test_an_embedding_scaling_by_the_batchs_counts_is_refused(tmp_path: Path) -> None:
    """``scale_grad_by_freq=True`` divides by each token's count in the batch: vmap, which
    differentiates each datum alone, used the datum's counts (records 0.5-0.8 off, and p.grad
    with them). Refused before anything runs; the hooks backend counts over the batch."""
    model = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Flatten(),
                          nn.Linear(12, 3))
    x, y = torch.randint(0, 10, (4, 3)), torch.randint(0, 3, (4,))
    with gradlog.GradRecorder(model, tmp_path / "run", backend="vmap") as rec, pytest.raises(
            gradlog.GradlogError, match="scale_grad_by_freq"):
        rec.step(lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"), (x, y))
    assert all(p.grad is None for p in model.parameters())


def test_a_sequence_first_rnn_vmap_cannot_batch_names_the_backends_that_can(
        tmp_path: Path) -> None:
    """A GRU on (T, B, d) writes each datum's state into a zero state the batch shares:
    vmap refuses it; the message named only BatchNorm and the loop backend."""
    model = nn.GRU(4, 4)  # batch_first=False

    def losses(m: nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
        return m(batch[0].transpose(0, 1))[0].pow(2).sum((0, 2))  # (B,)

    x = torch.randn(3, 5, 4)  # (B, T, d): vmap splits dimension 0
    with gradlog.GradRecorder(model, tmp_path / "run", backend="vmap") as rec, pytest.raises(
            gradlog.GradlogError, match="backend='hooks'"):
        rec.step(losses, (x,))
