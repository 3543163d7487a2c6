"""Top-k sparse backprop (gradlog.sparse): the masked path against a hand-chained reference,
the compact path against the masked path, recording against the loop oracle, hook hygiene and
argument errors."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradlog
from gradlog.backends import BACKENDS
from gradlog.errors import ConfigError
from gradlog.params import select_params
from gradlog.sparse import sparse_backprop
from gradlog.testing.zoo import gpt_batch, per_token_ce, tiny_gpt

D64 = torch.float64
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sparse_backprop.py"


def seq_mlp(*, bias: bool = True, inplace: bool = False, seed: int = 0) -> nn.Sequential:
    """Linear -> Tanh -> Linear -> act -> Linear on (B, T, 5) inputs, float64."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(5, 12, bias=bias),
        nn.Tanh(),
        nn.Linear(12, 10, bias=bias),
        nn.ReLU(inplace=True) if inplace else nn.Tanh(),
        nn.Linear(10, 7, bias=bias),
    ).to(D64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=D64) * 0.5)
    return model


def seq_batch(B: int = 4, T: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 5, generator=g, dtype=D64), torch.randint(0, 7, (B, T), generator=g)


def mlp_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return per_token_ce(model(x), y).mean(1)  # (B,)


def keep_top(g: torch.Tensor, k: int, per: str) -> torch.Tensor:
    """Independent reference of the sparsification: a full sort, not topk."""
    rows = g.reshape(g.shape[0], -1) if per == "datum" else g.reshape(-1, g.shape[-1])
    if k >= rows.shape[1]:
        return g
    order = rows.abs().argsort(dim=1, descending=True, stable=True)[:, :k]  # (rows, k)
    keep = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, order, True)
    return (rows * keep).reshape(g.shape)


def grads_of(model: nn.Module, run: Callable[[], torch.Tensor], **sparse: Any) -> dict[str, Any]:
    """p.grad of every parameter after backward of run(), under sparse_backprop if asked."""
    model.zero_grad(set_to_none=True)
    if sparse:
        with sparse_backprop(model, **sparse):
            run().backward()
    else:
        run().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    rtol: float = 1e-10,
    atol: float = 1e-12,
) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


# -- semantics ------------------------------------------------------------------------------
@pytest.mark.parametrize("per", ["token", "datum"])
@pytest.mark.parametrize("mode", ["masked", "compact"])
@pytest.mark.parametrize("keep", [{"k": 3}, {"fraction": 0.25}])
def test_equals_hand_chained_reference(per: str, mode: str, keep: dict[str, Any]) -> None:
    model = seq_mlp()
    x, y = seq_batch()
    x.requires_grad_(True)
    l1, _, l2, _, l3 = model

    def k_of(n: int) -> int:
        return keep["k"] if "k" in keep else max(1, -(-n // 4))  # ceil(n / 4)

    # Reference: autograd.grad node by node, sparsifying each Linear's output gradient.
    h1 = l1(x)
    a1 = torch.tanh(h1)
    h2 = l2(a1)
    a2 = torch.tanh(h2)
    h3 = l3(a2)
    loss = mlp_losses(lambda _: h3, x, y).mean()
    want: dict[str, torch.Tensor] = {}
    (g3,) = torch.autograd.grad(loss, h3)
    g3 = keep_top(g3, k_of(7 * (3 if per == "datum" else 1)), per)
    want["4.weight"], want["4.bias"], ga2 = torch.autograd.grad(h3, [l3.weight, l3.bias, a2], g3)
    (g2,) = torch.autograd.grad(a2, h2, ga2)
    g2 = keep_top(g2, k_of(10 * (3 if per == "datum" else 1)), per)
    want["2.weight"], want["2.bias"], ga1 = torch.autograd.grad(h2, [l2.weight, l2.bias, a1], g2)
    (g1,) = torch.autograd.grad(a1, h1, ga1)
    g1 = keep_top(g1, k_of(12 * (3 if per == "datum" else 1)), per)
    want["0.weight"], want["0.bias"], want["x"] = torch.autograd.grad(
        h1, [l1.weight, l1.bias, x], g1
    )

    x.grad = None
    got = grads_of(model, lambda: mlp_losses(model, x, y).mean(), per=per, mode=mode, **keep)
    got["x"] = x.grad
    assert_close(got, want)
    dense = grads_of(model, lambda: mlp_losses(model, x, y).mean())
    assert not torch.allclose(dense["0.weight"], want["0.weight"])  # the test is not vacuous


@pytest.mark.parametrize("per", ["token", "datum"])
@pytest.mark.parametrize("keep", [{"k": 2}, {"fraction": 0.3}, {"k": 10_000}])
def test_compact_equals_masked_on_gpt(per: str, keep: dict[str, Any]) -> None:
    model = tiny_gpt(n_layer=2, n_embd=16, vocab=13)
    x, y, _ = gpt_batch(4, 8, vocab=13)

    def loss() -> torch.Tensor:
        return per_token_ce(model(x), y).mean()

    masked = grads_of(model, loss, per=per, **keep)
    compact = grads_of(model, loss, per=per, mode="compact", **keep)
    assert_close(compact, masked)
    if "k" in keep and keep["k"] > 1000:  # k beyond every row keeps everything: dense
        assert_close(masked, grads_of(model, loss), rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_inplace_activation_after_a_sparsified_layer(bias: bool) -> None:
    """ReLU(inplace=True) after a Linear on (B, T, d) (whose output is a view) changes
    nothing, in either mode."""
    x, y = seq_batch()
    x.requires_grad_(True)
    results = []
    for inplace, mode in [(False, "masked"), (True, "masked"), (True, "compact")]:
        model = seq_mlp(bias=bias, inplace=inplace)
        if not inplace:
            model[3] = nn.ReLU()
        x.grad = None
        got = grads_of(model, lambda m=model: mlp_losses(m, x, y).mean(), k=2, mode=mode)
        got["x"] = x.grad
        results.append(got)
    assert_close(results[1], results[0])
    assert_close(results[2], results[0])


@pytest.mark.parametrize("mode", ["masked", "compact"])
def test_observers_see_the_sparsified_gradient(mode: str) -> None:
    """A forward hook registered after the context's (like gradlog's hooks backend) hooks the
    output it is given and receives at most k non-zeros per row."""
    model = seq_mlp()
    x, y = seq_batch()
    seen: list[torch.Tensor] = []

    def observe(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.append(g))

    with sparse_backprop(model, k=2, mode=mode) as sb:
        handles = [m.register_forward_hook(observe) for m in model if isinstance(m, nn.Linear)]
        mlp_losses(model, x, y).mean().backward()
        for h in handles:
            h.remove()
    assert len(seen) == 3 and sb.calls == 3
    for g in seen:
        assert int((g.reshape(-1, g.shape[-1]) != 0).sum(1).max()) <= 2


def test_decided_at_forward_and_alias_of_returned_input() -> None:
    """An identity module is sparsified at an alias of its output; the input's other use
    keeps its full gradient."""
    x = torch.randn(3, 6, dtype=D64, requires_grad=True)
    ident = nn.Identity()
    with sparse_backprop(ident, k=1, where=nn.Identity):
        out = ident(x)
    assert out is not x
    (out * 2 + x).sum().backward()  # after the context exited: still sparsified
    got = x.grad
    assert got is not None
    assert int((got != 1).sum()) == 3  # one entry per row got the extra 2, the rest 1 only
    with torch.no_grad(), sparse_backprop(ident, k=1, where=nn.Identity):
        assert ident(x) is x  # no gradient, nothing to do


# -- recording ------------------------------------------------------------------------------
def _record(
    model: nn.Module, path: Path, backend: str, batches: list[Any], sparse: dict[str, Any]
) -> tuple[gradlog.Run, dict[str, torch.Tensor]]:
    ctx = sparse_backprop(model, **sparse) if sparse else None
    if ctx is not None:
        ctx.__enter__()
    try:
        with gradlog.GradRecorder(model, path, backend=backend, check_every=1) as rec:
            for step, (x, y, mask) in enumerate(batches):
                model.zero_grad(set_to_none=True)
                rec.backward(per_token_ce(model(x), y), mask=mask, step=step)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return gradlog.open(path), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "sparse",
    [
        {"k": 3},
        {"fraction": 0.2, "mode": "compact"},
        {"k": 20, "per": "datum", "mode": "compact", "where": "blocks.*"},
    ],
    ids=["masked-token", "compact-token", "compact-datum-blocks"],
)
def test_recording_equals_loop_oracle(tmp_path: Path, sparse: dict[str, Any]) -> None:
    model = tiny_gpt(n_layer=1, n_embd=8)
    batches = [gpt_batch(3, 6, seed=s) for s in (1, 2)]
    hooks, hooks_grad = _record(model, tmp_path / "h.gradlog", "hooks", batches, sparse)
    loop, loop_grad = _record(copy.deepcopy(model), tmp_path / "l.gradlog", "loop", batches, sparse)
    dense, _ = _record(copy.deepcopy(model), tmp_path / "d.gradlog", "hooks", batches, {})
    assert hooks.attrs["backend"]["name"] == "hooks"
    stored = hooks.attrs["backend"]["sparse_backprop"]
    assert len(stored) == 1 and stored[0]["mode"] == sparse.get("mode", "masked")
    assert stored[0]["k"] == sparse.get("k") and stored[0]["per"] == sparse.get("per", "token")
    assert loop.attrs["backend"]["sparse_backprop"] == stored
    assert "sparse_backprop" not in dense.attrs["backend"]
    differs = False
    for name in hooks.param_names:
        got, want = hooks.grads(name), loop.grads(name)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
        differs = differs or not torch.allclose(
            torch.as_tensor(want), torch.as_tensor(dense.grads(name))
        )
    assert differs  # sparsification changed the recorded gradients
    assert_close(hooks_grad, loop_grad)

    from gradlog.testing.schemas import validate_store

    validate_store(tmp_path / "h.gradlog")


def test_hooks_backend_attached_before_the_context() -> None:
    """Hook order: a backend attached first still captures the sparsified gradient."""
    model = tiny_gpt(n_layer=1, n_embd=8)
    x, y, mask = gpt_batch(4, 6)
    params = select_params(model, ["*"])

    def per_datum(name: str) -> dict[str, torch.Tensor]:
        be = BACKENDS[name](model, params, batch_reduction="mean", randomness="different")
        be.attach()
        try:
            with sparse_backprop(model, k=2, mode="compact"):
                model.zero_grad(set_to_none=True)
                losses = (per_token_ce(model(x), y) * mask).sum(1) / mask.sum(1)
                return be.backward(losses, be.reduce_batch(losses))
        finally:
            be.detach()

    assert_close(per_datum("hooks"), per_datum("loop"), rtol=1e-9, atol=1e-12)


def test_per_datum_gradients_do_not_depend_on_the_batch() -> None:
    model = tiny_gpt(n_layer=1, n_embd=8)
    x, y, _ = gpt_batch(4, 6)
    params = select_params(model, ["*"])
    be = BACKENDS["hooks"](model, params, batch_reduction="sum", randomness="different")
    be.attach()
    try:
        with sparse_backprop(model, fraction=0.3, per="datum", mode="compact"):
            losses = per_token_ce(model(x), y).sum(1)
            full = be.backward(losses, losses.sum())
            losses = per_token_ce(model(x[2:]), y[2:]).sum(1)
            half = be.backward(losses, losses.sum())
    finally:
        be.detach()
    assert_close({n: g[2:] for n, g in full.items()}, half, rtol=1e-9, atol=1e-12)


def test_context_entered_while_recording_is_refused(tmp_store: Path) -> None:
    model = tiny_gpt(n_layer=1, n_embd=8)
    x, y, _ = gpt_batch(2, 6)
    with gradlog.GradRecorder(model, tmp_store, backend="hooks") as rec:
        rec.backward(per_token_ce(model(x), y))
        with sparse_backprop(model, k=2):
            model.zero_grad(set_to_none=True)
            losses = per_token_ce(model(x), y)
            with pytest.raises(ConfigError, match="Enter sparse_backprop before"):
                rec.backward(losses)
            assert all(p.grad is None for p in model.parameters())  # refused before backward


# -- hygiene --------------------------------------------------------------------------------
def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("mode", ["masked", "compact"])
def test_hooks_removed_on_exit_and_on_exception(mode: str) -> None:
    model = tiny_gpt(n_layer=1, n_embd=8)
    before_params = {n: id(p) for n, p in model.named_parameters()}
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    x, y, _ = gpt_batch(2, 6)
    with sparse_backprop(model, k=2, mode=mode) as sb:
        assert sb.active and _hook_count(model) == len(sb.modules) == 7
        per_token_ce(model(x), y).mean().backward()
    assert _hook_count(model) == 0 and not sb.active
    assert gradlog.sparse.active_settings(model) == []
    with pytest.raises(RuntimeError, match="boom"), sparse_backprop(model, k=2, mode=mode):
        model(x)
        raise RuntimeError("boom")
    assert _hook_count(model) == 0 and gradlog.sparse.active_settings(model) == []
    assert {n: id(p) for n, p in model.named_parameters()} == before_params
    after = model.state_dict()
    assert list(after) == list(before_state)
    assert all(torch.equal(after[k], v) for k, v in before_state.items())


def test_selection_by_names_classes_and_types() -> None:
    model = tiny_gpt(n_layer=2, n_embd=8)
    assert list(sparse_backprop(model, k=1, where="blocks.*.mlp.fc").modules) == [
        "blocks.0.mlp.fc",
        "blocks.1.mlp.fc",
    ]
    assert len(sparse_backprop(model, k=1).modules) == 13  # every nn.Linear
    assert len(sparse_backprop(model, k=1, where="Linear").modules) == 13
    both = sparse_backprop(model, k=1, where=["head", nn.LayerNorm], mode="compact")
    assert both.compact == ["head"] and len(both.modules) == 6
    assert both.describe()["where"] == ["head", "torch.nn.modules.normalization.LayerNorm"]


def test_overlapping_contexts_are_refused() -> None:
    model = tiny_gpt(n_layer=1, n_embd=8)
    with sparse_backprop(model, k=1, where="blocks.*") as outer:
        with pytest.raises(ConfigError, match="already sparsified"), sparse_backprop(model, k=2):
            pass
        with pytest.raises(ConfigError, match="already active"), outer:
            pass
        with sparse_backprop(model, k=2, where="head"):
            assert [s["where"] for s in gradlog.sparse.active_settings(model)] == [
                ["blocks.*"],
                ["head"],
            ]
    assert _hook_count(model) == 0


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"k": 2, "fraction": 0.1}, "pass one of them"),
        ({}, "pass k=<int >= 1>"),
        ({"fraction": 0.0}, r"in \(0, 1\]"),
        ({"fraction": 1.5}, r"in \(0, 1\]"),
        ({"fraction": True}, r"in \(0, 1\]"),
        ({"k": 0}, "int >= 1"),
        ({"k": 2.5}, "int >= 1"),
        ({"k": True}, "int >= 1"),
        ({"k": 1, "per": "row"}, "per='token'"),
        ({"k": 1, "mode": "fast"}, "compact"),
        ({"k": 1, "where": "nothing.*"}, "selects no module"),
        ({"k": 1, "where": []}, "is empty"),
        ({"k": 1, "where": [3]}, "takes glob strings"),
        ({"k": 1, "where": nn.Tanh, "mode": "compact"}, "mode='masked'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], fix: str) -> None:
    with pytest.raises(ConfigError, match=fix) as info:
        sparse_backprop(seq_mlp(), **kwargs)
    assert isinstance(info.value, ValueError)


def test_fraction_rounds_up_per_node() -> None:
    settings = sparse_backprop(seq_mlp(), fraction=0.05).settings
    assert [settings.k_for(n) for n in (100, 1024, 10, 1)] == [5, 52, 1, 1]


def test_example_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "4", "--no-plot", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "dense" in done.stdout and "compact" in done.stdout


# -- per="child": at each node, only the input with the largest gradient (L1) gets it -------
class _Graph(nn.Module):
    """A hand-made graph with nodes of one, two and three differentiable children."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W1 = nn.Parameter(torch.randn(3, 4, generator=g, dtype=D64))
        self.b1 = nn.Parameter(torch.randn(4, generator=g, dtype=D64))
        self.w2 = nn.Parameter(torch.randn(4, generator=g, dtype=D64))
        self.c = torch.randn(12, generator=g, dtype=D64) * 3  # a constant: no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x @ self.W1  # Mm: children x (no grad), W1
        z = a + self.b1  # Add: children Mm, b1 (broadcast over rows)
        t = torch.tanh(z)  # one child
        u = t * self.w2  # Mul: children tanh, w2
        v = torch.cat([u, t, z], dim=-1)  # Cat: three children
        return (v * self.c).sum()  # Mul with a constant, Sum: one child each


def _keep(grads: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """The rule, by hand: the k largest L1 norms keep theirs (first wins a tie), zeros else."""
    norms = [float(g.abs().sum()) for g in grads]
    order = sorted(range(len(grads)), key=lambda i: (-norms[i], i))[:k]
    return [g if i in order else torch.zeros_like(g) for i, g in enumerate(grads)]


def _graph_oracle(m: _Graph, x: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Hand-derived backward of ``_Graph`` under the rule, node by node in reverse order."""
    with torch.no_grad():
        a = x @ m.W1
        z = a + m.b1
        t = torch.tanh(z)
        g_v = m.c.expand(x.shape[0], 12)  # (5, 12): d sum(v * c) / d v
        g_u, g_t_cat, g_z_cat = _keep([g_v[:, :4], g_v[:, 4:8], g_v[:, 8:]], k)  # Cat
        g_t_mul, g_w2 = _keep([g_u * m.w2, (g_u * t).sum(0)], k)  # Mul (input order: t, w2)
        g_z_tanh = (g_t_cat + g_t_mul) * (1 - t**2)  # tanh sums its two parents first
        g_a, g_b1 = _keep([g_z_cat + g_z_tanh, (g_z_cat + g_z_tanh).sum(0)], k)  # Add
        g_W1 = x.t() @ g_a  # Mm: x has no gradient, W1 is its only child
    return {"W1": g_W1, "b1": g_b1, "w2": g_w2}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("k", [1, 2])
def test_child_rule_equals_hand_derived_backward(seed: int, k: int) -> None:
    model = _Graph(seed)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(10 + seed), dtype=D64)
    expected = _graph_oracle(model, x, k)
    dense = dict(zip(["W1", "b1", "w2"], torch.autograd.grad(model(x), list(model.parameters()))))
    with sparse_backprop(model, k=k, per="child") as ctx:
        model(x).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-12, atol=1e-12)
    assert ctx.calls == 3  # Cat, Mul and Add chose; Mm (x has no gradient) has one child
    # not vacuous: the rule changed at least one gradient
    assert any(not torch.allclose(expected[n], dense[n]) for n in expected)


def test_child_rule_zeroes_all_but_one_child_of_a_linear() -> None:
    layer = nn.Linear(6, 3).to(D64)
    x = torch.randn(4, 6, dtype=D64, requires_grad=True)
    with sparse_backprop(layer, k=1, per="child"):
        layer(x).pow(2).sum().backward()
    grads = [layer.bias.grad, x.grad, layer.weight.grad]  # addmm's inputs: bias, x, weight^T
    assert grads[0] is not None and grads[1] is not None and grads[2] is not None
    assert sum(bool(g.abs().sum() > 0) for g in grads) == 1


def test_child_rule_keeping_every_child_is_dense() -> None:
    model = _Graph(0)
    x = torch.randn(5, 3, dtype=D64)
    dense = torch.autograd.grad(model(x), list(model.parameters()))
    with sparse_backprop(model, k=3, per="child"):
        sparse = torch.autograd.grad(model(x), list(model.parameters()))
    for d, s in zip(dense, sparse):
        torch.testing.assert_close(s, d, rtol=0, atol=0)


def test_child_rule_is_refused_by_the_recorder(tmp_store: Path) -> None:
    model = seq_mlp()
    x, y = seq_batch()
    with (
        sparse_backprop(model, k=1, per="child"),
        gradlog.GradRecorder(model, tmp_store, backend="hooks") as rec,
        pytest.raises(ConfigError, match=r"per='child'.*cannot record"),
    ):
        rec.backward(mlp_losses(model, x, y))


def test_child_rule_has_no_compact_mode() -> None:
    with pytest.raises(ConfigError, match="no compact backward"):
        sparse_backprop(_Graph(0), k=1, per="child", mode="compact")
