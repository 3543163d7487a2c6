"""A container's own parameters op by op (gradlog/backends/hooks/containers.py): a module
without a rule that holds raw parameters beside children with theirs (a layer scale) leaves
them to op calls when every op on them is plainly batched, else is re-run per datum as
before; either way against the loop oracle, with the datum check and without it (a backward
hook of the user's), nested, called twice, under SDPA's attention dropout, and transformers'
BEiT with SDPA in training (refused before)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog.rules.func as func
from gradlog.testing.oracle import assert_like_loop

D64 = torch.float64
B, T, D = 3, 5, 4
Counter = Callable[[Any, str], list[int]]  # (conftest's calls_to)


class Scaled(nn.Module):
    """``x + gamma * fc(x)`` and variants of how the container uses its own parameter."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.gamma = nn.Parameter(torch.randn(D))
        self.kind = kind
        self.register_buffer("table", torch.randn(B, D))  # (as long as the batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "scale":
            return x + self.gamma * h
        if self.kind == "twice":  # (two ops on it)
            return x + self.gamma * h + torch.tanh(h) / (1 + self.gamma.square())
        if self.kind == "exp_view":  # (a function of it alone, then a view: tracked steps)
            return x + self.gamma.exp().view(1, 1, D) * h
        if self.kind == "attention":  # (SDPA's dropout inside: a re-run cannot replay it)
            q = h.unflatten(-1, (2, 2)).transpose(1, 2)  # (B, heads, T, 2)
            a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3 if self.training else 0)
            return x + self.gamma * a.transpose(1, 2).flatten(2)
        if self.kind == "permuted":  # (sequence first inside: (T, B, d))
            return x + (h.transpose(0, 1) * self.gamma).transpose(0, 1)
        if self.kind == "unbind":  # (pieces of a tuple: not seen by op capture)
            first, *_ = self.gamma.unbind(0)
            return x + self.gamma * h + first * torch.tanh(h)
        if self.kind == "table":  # (a buffer of B rows, scaled: not the batch's)
            return x + h * (self.table * self.gamma).sum(0)
        if self.kind == "arange":  # (positions times learnt frequencies, T == B)
            angles = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.gamma
            return x + h * torch.cos(angles)
        if self.kind == "cat":  # (a token over the batch: copied, then concatenated)
            token = self.gamma.view(1, 1, D).expand(x.shape[0], 1, D)
            return torch.cat([token, h], 1)[:, 1:] + torch.cat([token, x], 1)[:, :-1]
        raise KeyError(self.kind)


class Model(nn.Module):
    def __init__(self, kind: str, nested: bool = False, twice: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.block = Scaled(kind)
        self.outer = nn.Parameter(torch.randn(D)) if nested else None
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.inp(x))
        if self.twice:
            h = self.block(h)
        return h * self.outer if self.outer is not None else h


class Outer(nn.Module):
    """A container of a container: its own ``beta`` beside a child holding ``gamma``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Scaled("scale")
        self.beta = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.beta


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.outer = Outer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inp(x))


def _losses(model: nn.Module) -> Callable[[], torch.Tensor]:
    x = torch.randn(B, T, D, dtype=D64, generator=torch.Generator().manual_seed(1))
    return lambda: (model(x) ** 2).flatten(1).sum(1)  # (B,)


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("kind", ["scale", "twice", "exp_view", "attention"])
def test_a_layer_scale_is_taken_op_by_op(kind: str, hooked: bool, calls_to: Counter) -> None:
    torch.manual_seed(0)
    model = Model(kind).double().train()
    if hooked:  # (a backward hook of the user's: no datum check)
        model.inp.weight.register_hook(lambda g: None)
    calls = calls_to(func, "func_grads")
    described = assert_like_loop(model, _losses(model), reductions=("mean", "sum"))
    assert "block" not in described["fallback"]
    assert not calls  # (nothing re-run per datum)


def test_a_copy_of_it_is_left_to_the_re_run(calls_to: Counter) -> None:
    """A parameter expanded over the batch and concatenated (a ``cls_token``): not a plainly
    batched op, so the container is re-run per datum, as before."""
    torch.manual_seed(0)
    model = Model("cat").double()
    calls = calls_to(func, "func_grads")
    described = assert_like_loop(model, _losses(model), reductions=("mean",))
    assert "block" in described["fallback"]
    assert calls


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("kind", ["unbind", "table", "arange"])
def test_what_op_capture_cannot_prove_is_left_to_the_re_run(
        kind: str, hooked: bool, calls_to: Counter) -> None:
    """A use op capture does not see (a piece of ``unbind``: its share of the gradient
    would go uncomputed), or an op on a tensor of B rows not made from the container's
    inputs (a buffer, positions with T == B: read as each datum's): all found by a helper's
    campaign, recorded wrong, some with the datum check on. Each is proved from the graph
    now (every use of the parameter one of the op calls'; the op's batched argument made
    from the call's inputs), and the container is re-run where it is not."""
    torch.manual_seed(0)
    model = Model(kind).double()
    if hooked:  # (a backward hook of the user's: no datum check)
        model.inp.weight.register_hook(lambda g: None)
    x = torch.randn(B, B, D, dtype=D64, generator=torch.Generator().manual_seed(1))
    calls = calls_to(func, "func_grads")
    described = assert_like_loop(model, lambda: (model(x) ** 2).flatten(1).sum(1),
                                 reductions=("mean",))
    assert "block" in described["fallback"]
    assert calls


@pytest.mark.parametrize("T", [5, B])
def test_a_size_of_b_beside_the_batch_leaves_it_to_the_re_run(T: int, calls_to: Counter) -> None:
    """Permuted to ``(T, B, d)`` inside the container, with T == B the op's output would
    pass for batch first (each datum given a position's gradient, recorded wrong where no
    datum check runs): such a container is re-run per datum; with T != B the op's batch is
    not first, re-run too."""
    torch.manual_seed(0)
    model = Model("permuted").double()
    model.inp.weight.register_hook(lambda g: None)  # (no datum check)
    x = torch.randn(B, T, D, dtype=D64, generator=torch.Generator().manual_seed(1))
    calls = calls_to(func, "func_grads")
    described = assert_like_loop(model, lambda: (model(x) ** 2).flatten(1).sum(1),
                                 reductions=("mean",))
    assert "block" in described["fallback"]
    assert calls


@pytest.mark.parametrize("case", ["nested", "called twice", "the root's own too"])
def test_nested_and_reused_containers(case: str, calls_to: Counter) -> None:
    torch.manual_seed(0)
    model: nn.Module = {"nested": lambda: Nested(),
                        "called twice": lambda: Model("scale", twice=True),
                        "the root's own too": lambda: Model("scale", nested=True)}[case]()
    model = model.double()
    calls = calls_to(func, "func_grads")
    described = assert_like_loop(model, _losses(model), reductions=("mean",))
    assert not {"block", "outer", "outer.inner"} & set(described["fallback"])
    assert bool(calls) == (case == "the root's own too")  # (the root's own: re-run)


def test_op_capture_watching_every_forward_gives_the_same() -> None:
    """``watch_ops="always"`` (the mode on for the whole forward, not pushed for the
    container's call alone): the same op calls, the same records."""
    from gradlog.backends.hooks import HooksBackend
    from gradlog.grads import dense

    got = {}
    for watch in ("auto", "always"):
        torch.manual_seed(0)
        model = Model("twice").double()
        params = dict(model.named_parameters())
        backend = HooksBackend(model, params, batch_reduction="mean", randomness="different",
                               watch_ops=watch)
        backend.attach()
        try:
            for _ in range(3):  # (past the forwards "auto" watches whole)
                losses = _losses(model)()
                out = backend.backward(losses, backend.reduce_batch(losses))
                model.zero_grad()
            got[watch] = {n: dense(g) for n, g in out.items()}
            assert "block" not in backend.describe()["fallback"]
        finally:
            backend.detach()
    for name, g in got["auto"].items():
        torch.testing.assert_close(g, got["always"][name], rtol=1e-12, atol=1e-14)


def test_beit_with_sdpa_in_training_records_like_the_loop() -> None:
    """BEiT's layers own ``lambda_1``, ``lambda_2``: re-run per layer, refused under SDPA's
    attention dropout ("draws random numbers"); now taken op by op."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BeitConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_labels=2, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, use_relative_position_bias=True,
        layer_scale_init_value=0.1, drop_path_rate=0.2, use_mean_pooling=True)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.BeitForImageClassification(config).to(D64).train()
    pixels = torch.randn(B, 3, 8, 8, dtype=D64, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 1])
    described = assert_like_loop(
        model, lambda: F.cross_entropy(model(pixel_values=pixels).logits, y, reduction="none"),
        reductions=("mean",), rtol=1e-4, atol=1e-6)
    assert not any(n.endswith(("layers.0", "layers.1")) for n in described["fallback"])


class Checkpointed(nn.Module):
    """:class:`Model` with its container in a reentrant checkpoint (``checkpointed``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.block = Scaled("scale")
        self.checkpointed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        return checkpoint(self.block, h, use_reentrant=True) if self.checkpointed else (
            self.block(h))


def test_a_container_in_a_reentrant_checkpoint_records_every_step() -> None:
    """Its recompute runs inside the backward, after the containers were settled: from the
    third step (op capture no longer watching whole forwards) its ops were captured there
    too and computed beside its re-run, counting ``gamma`` twice (refused by the spot
    check). Inside a backward a container is not deferred."""
    from gradlog.backends.hooks import HooksBackend
    from gradlog.grads import dense

    torch.manual_seed(0)
    model = Checkpointed().double()
    x = torch.randn(B, T, D, dtype=D64, generator=torch.Generator().manual_seed(1))
    model.checkpointed = False  # (the loop cannot take a reentrant checkpoint: its oracle)
    want = {n: g for n, g in _loop(model, x).items()}
    model.checkpointed = True
    backend = HooksBackend(model, dict(model.named_parameters()), batch_reduction="mean",
                           randomness="different")
    backend.attach()
    try:
        for _ in range(4):
            losses = (model(x) ** 2).flatten(1).sum(1)
            got = backend.backward(losses, backend.reduce_batch(losses))
            model.zero_grad()
            for name, g in got.items():
                torch.testing.assert_close(dense(g), want[name], rtol=1e-9, atol=1e-12)
    finally:
        backend.detach()


def _loop(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    from gradlog.testing.oracle import backend_grads

    return backend_grads(model, lambda: (model(x) ** 2).flatten(1).sum(1), "loop", "mean")[0]


class _Joint(nn.Module):
    """A container taking its parent's parameter: ``h + p * q`` in one op (``addcmul``) of
    its own ``p`` and the outer container's ``q``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.p = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return x + torch.addcmul(self.fc(x), self.p, q)


class _JointOuter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Joint()
        self.q = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, self.q) * self.q


class _JointModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.outer = _JointOuter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inp(x))


@pytest.mark.parametrize("hooked", [False, True])
def test_an_op_of_two_containers_parameters_leaves_both_to_the_re_run(hooked: bool) -> None:
    """The inner container could take its ``p`` op by op, its op also computing the outer's
    ``q``, while the outer, unable to prove its own, re-ran and computed ``q`` again:
    counted twice. Containers sharing an op are re-run, both."""
    torch.manual_seed(0)
    model = _JointModel().double()
    if hooked:
        model.inp.weight.register_hook(lambda g: None)
    described = assert_like_loop(model, _losses(model), reductions=("mean",))
    assert {"outer", "outer.inner"} <= set(described["fallback"])
