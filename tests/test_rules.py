"""Every rule of the hooks backend against the loop oracle: float64, both batch reductions,
hypothesis over shapes and layer options (few examples each, derandomised for CI)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gradlog.backends import BACKENDS
from gradlog.errors import BackendError, UnsupportedLayerError
from gradlog.params import select_params
from gradlog.rules import RULES, Capture, find_rule, register_rule

D64 = torch.float64
RULE_SETTINGS = settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
SLOW_RULE_SETTINGS = settings(RULE_SETTINGS, max_examples=8)


def per_datum(
    model: nn.Module, forward: Callable[[], torch.Tensor], backend: str, reduction: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Per-datum gradients of every trainable parameter, and the backend's description."""
    be = BACKENDS[backend](
        model, select_params(model, ["*"]), batch_reduction=reduction, randomness="different"
    )
    be.attach()
    try:
        model.zero_grad(set_to_none=True)
        losses = forward()  # (B,)
        grads = be.backward(losses, be.reduce_batch(losses))
        return grads, be.describe()
    finally:
        be.detach()


def assert_like_loop(
    model: nn.Module, forward: Callable[[], torch.Tensor], rule: str | None = None
) -> None:
    """hooks == loop for both batch reductions; ``rule``: the rule expected on the module."""
    for reduction in ("mean", "sum"):
        got, described = per_datum(model, forward, "hooks", reduction)
        want, _ = per_datum(model, forward, "loop", reduction)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(
                got[name],
                want[name],
                rtol=1e-6,
                atol=1e-12,
                msg=lambda m, n=name, r=reduction: f"{n} ({r}): {m}",
            )
        if rule is not None:
            assert {m["rule"] for m in described["modules"]} == {rule}, described
            assert (described["fallback"] != []) == (rule == "torch.func")


def datum_loss(y: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A non-linear loss per datum of any (B, ...) output: (B,)."""
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    return (torch.tanh(y) * w).reshape(y.shape[0], -1).sum(1)  # (B,)


def built(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory().to(D64)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=D64)


lead_dims = st.lists(st.integers(1, 3), min_size=0, max_size=2)


# -- Linear family ---------------------------------------------------------------------------
@RULE_SETTINGS
@given(
    B=st.integers(1, 4),
    lead=lead_dims,
    d_in=st.integers(1, 5),
    d_out=st.integers(1, 5),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear(B: int, lead: list[int], d_in: int, d_out: int, bias: bool, seed: int) -> None:
    layer = built(lambda: nn.Linear(d_in, d_out, bias=bias), seed)
    x = randn(B, *lead, d_in, seed=seed)  # (B, ..., d_in)
    assert_like_loop(layer, lambda: datum_loss(layer(x)), rule="linear")


class Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D``: a Linear with weight (d_in, d_out), by class name."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"  # its stand-in: matched by name and library


class _TemporalConv1D(nn.Module):
    """A user's own layer named ``Conv1D``: a temporal convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 3, 3) * 0.3)
        self.bias = nn.Parameter(torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias, padding=1)


class _OtherConv1D(Conv1D):
    """A user's layer named ``Conv1D`` with GPT-2's layout and another function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight + self.bias)


_TemporalConv1D.__name__ = _TemporalConv1D.__qualname__ = "Conv1D"
_OtherConv1D.__name__ = _OtherConv1D.__qualname__ = "Conv1D"
_OtherConv1D.__module__ = __name__


@pytest.mark.parametrize("kind", ["temporal", "gpt2-layout"])
def test_a_users_layer_named_conv1d_is_not_taken_for_gpt2s(kind: str) -> None:
    """GPT-2's rule was found by the bare class name: a temporal convolution named Conv1D
    crashed inside it ('please report this'), one with GPT-2's layout but another forward
    got the linear formula (refused by the checks only). Both fall back to torch.func, as
    the loop oracle; transformers' own class keeps the rule."""
    layer = built(lambda: _TemporalConv1D() if kind == "temporal" else _OtherConv1D(4, 3), 0)
    x = randn(3, 3, 8, seed=1) if kind == "temporal" else randn(3, 2, 3, seed=1)
    assert find_rule(layer) is None
    assert_like_loop(layer, lambda: datum_loss(layer(x)), rule="torch.func")
    transformers = pytest.importorskip("transformers")
    real = transformers.pytorch_utils.Conv1D(4, 3)
    assert find_rule(real) is not None and find_rule(real).name == "conv1d_gpt2"


@RULE_SETTINGS
@given(
    B=st.integers(1, 4),
    lead=lead_dims,
    d_in=st.integers(1, 5),
    d_out=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_gpt2_conv1d(B: int, lead: list[int], d_in: int, d_out: int, seed: int) -> None:
    layer = built(lambda: Conv1D(d_out, d_in), seed)
    x = randn(B, *lead, d_in, seed=seed)
    assert_like_loop(layer, lambda: datum_loss(layer(x)), rule="conv1d_gpt2")


# -- Embedding -------------------------------------------------------------------------------
@RULE_SETTINGS
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 5),
    V=st.integers(2, 9),
    D=st.integers(1, 4),
    padding=st.booleans(),
    by_freq=st.booleans(),
    layout=st.sampled_from(["batched", "per-datum scalar", "shared [1, T]", "shared [T]"]),
    seed=st.integers(0, 2**16),
)
def test_embedding(
    B: int, T: int, V: int, D: int, padding: bool, by_freq: bool, layout: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pad = int(torch.randint(0, V, (), generator=gen)) if padding else None
    emb = built(lambda: nn.Embedding(V, D, padding_idx=pad, scale_grad_by_freq=by_freq), seed)
    other = randn(B, T, D, seed=seed)  # a batched stream the shared embedding is added to
    if layout == "batched":
        idx = torch.randint(0, V, (B, T), generator=gen)  # (B, T), some hitting padding_idx
        assert_like_loop(emb, lambda: datum_loss(emb(idx)), rule="embedding")
    elif layout == "per-datum scalar":
        idx = torch.randint(0, V, (B,), generator=gen)  # (B,)
        assert_like_loop(emb, lambda: datum_loss(emb(idx)), rule="embedding")
    else:  # position-id style: one index row shared by every datum, broadcast by an add
        ids = torch.randint(0, V, (T,), generator=gen)  # (T,)
        ids = ids.unsqueeze(0) if layout == "shared [1, T]" else ids  # (1, T) or (T,)
        assert_like_loop(emb, lambda: datum_loss(other + emb(ids)), rule="embedding")


@pytest.mark.parametrize("by_freq", [False, True])
def test_embedding_of_int32_ids(by_freq: bool) -> None:
    """torch looks up int32 ids as well as int64 ones (data pipelines often hold int32):
    the rule refused them ("Rows.index ... must be int64"), the loop recorded them."""
    emb = built(lambda: nn.Embedding(9, 3, padding_idx=2, scale_grad_by_freq=by_freq), 0)
    idx = torch.randint(0, 9, (3, 5), generator=torch.Generator().manual_seed(1),
                        dtype=torch.int32)
    assert_like_loop(emb, lambda: datum_loss(emb(idx)), rule="embedding")


def test_embedding_shared_ids_through_subtraction_and_expand() -> None:
    emb = built(lambda: nn.Embedding(7, 3), 0)
    other = randn(4, 5, 3, seed=1)
    ids = torch.tensor([[0, 3, 3, 6, 1]])  # (1, T): a repeated index, HF-style broadcast
    assert_like_loop(emb, lambda: datum_loss(other - emb(ids)), rule="embedding")
    assert_like_loop(emb, lambda: datum_loss(torch.sub(other, emb(ids), alpha=0.5)))
    assert_like_loop(emb, lambda: datum_loss(torch.add(emb(ids), other, alpha=-3.0)))
    assert_like_loop(emb, lambda: datum_loss(emb(ids).expand(4, -1, -1) * other))


def test_shared_output_broadcast_by_another_op_is_refused_before_the_backward() -> None:
    emb = built(lambda: nn.Embedding(7, 3), 0)
    other = randn(4, 5, 3, seed=1)
    ids = torch.tensor([[0, 3, 3, 6, 1]])  # (1, T)
    be = BACKENDS["hooks"](
        emb, select_params(emb, ["*"]), batch_reduction="mean", randomness="different"
    )
    be.attach()
    try:
        losses = datum_loss(other * emb(ids))  # a product broadcasts it: not supported
        with pytest.raises(BackendError, match=r"MulBackward0.*expand\(B, -1\)"):
            be.backward(losses, losses.mean())
    finally:
        be.detach()
    assert emb.weight.grad is None  # refused before the backward: p.grad untouched


def test_shared_output_of_a_batch_of_one_records_whatever_its_consumer() -> None:
    """With one datum there is nothing to split: the output's own gradient is the datum's,
    whatever op broadcasts it (a product, refused above with B > 1)."""
    emb = built(lambda: nn.Embedding(7, 3), 0)
    other = randn(1, 5, 3, seed=1)
    ids = torch.tensor([0, 3, 3, 6, 1])  # (T,): shared, no batch dimension
    assert_like_loop(emb, lambda: datum_loss(other * emb(ids)), rule="embedding")


# -- normalisation ---------------------------------------------------------------------------
@RULE_SETTINGS
@given(
    B=st.integers(1, 4),
    lead=lead_dims,
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layer_norm(B: int, lead: list[int], shape: list[int], bias: bool, seed: int) -> None:
    norm = built(lambda: nn.LayerNorm(shape, bias=bias), seed)
    with torch.no_grad():  # off the default (1, 0) so the affine gradients are generic
        for p in norm.parameters():
            p.add_(randn(*p.shape, seed=seed + 1))
    x = randn(B, *lead, *shape, seed=seed)
    assert_like_loop(norm, lambda: datum_loss(norm(x)), rule="layer_norm")


@pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="nn.RMSNorm needs torch >= 2.4")
@RULE_SETTINGS
@given(
    B=st.integers(1, 4),
    lead=lead_dims,
    D=st.integers(1, 6),
    eps=st.sampled_from([None, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm(B: int, lead: list[int], D: int, eps: float | None, seed: int) -> None:
    norm = built(lambda: nn.RMSNorm(D, eps=eps), seed)
    x = randn(B, *lead, D, seed=seed)
    assert_like_loop(norm, lambda: datum_loss(norm(x)), rule="rms_norm")


@RULE_SETTINGS
@given(
    B=st.integers(1, 4),
    groups=st.integers(1, 3),
    per_group=st.integers(1, 3),
    spatial=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_group_norm(B: int, groups: int, per_group: int, spatial: list[int], seed: int) -> None:
    C = groups * per_group
    if not spatial and per_group == 1:
        per_group, C = 2, 2 * groups  # one value per group normalises to 0: keep it generic
    norm = built(lambda: nn.GroupNorm(groups, C), seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(randn(*p.shape, seed=seed + 1))
    x = randn(B, C, *spatial, seed=seed)
    assert_like_loop(norm, lambda: datum_loss(norm(x)), rule="group_norm")


# -- convolutions ----------------------------------------------------------------------------
@st.composite
def conv_options(draw: st.DrawFn) -> dict[str, Any]:
    nd = draw(st.sampled_from([1, 2]))
    groups = draw(st.integers(1, 2))
    kernel = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2))
    stride = draw(st.integers(1, 2))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    padding: int | str = draw(st.sampled_from([0, 1, 2, "same", "valid"]))
    if padding == "same" and stride != 1:
        padding = 1  # torch refuses padding="same" with strides
    size = dilation * (kernel - 1) + 1 + draw(st.integers(0, 3))
    if mode in ("reflect", "circular") and isinstance(padding, int):
        padding = min(padding, size - 1)
    if mode != "zeros" and padding == "same":
        padding = "valid" if dilation * (kernel - 1) >= size else "same"
    return {
        "nd": nd,
        "groups": groups,
        "in_ch": groups * draw(st.integers(1, 2)),
        "out_ch": groups * draw(st.integers(1, 2)),
        "kernel": kernel,
        "dilation": dilation,
        "stride": stride,
        "padding": padding,
        "mode": mode,
        "bias": draw(st.booleans()),
        "size": size,
        "B": draw(st.integers(1, 3)),
    }


@RULE_SETTINGS
@given(o=conv_options(), seed=st.integers(0, 2**16))
def test_conv(o: dict[str, Any], seed: int) -> None:
    cls = nn.Conv1d if o["nd"] == 1 else nn.Conv2d
    conv = built(
        lambda: cls(
            o["in_ch"],
            o["out_ch"],
            o["kernel"],
            stride=o["stride"],
            padding=o["padding"],
            dilation=o["dilation"],
            groups=o["groups"],
            bias=o["bias"],
            padding_mode=o["mode"],
        ),
        seed,
    )
    x = randn(o["B"], o["in_ch"], *[o["size"]] * o["nd"], seed=seed)
    assert_like_loop(conv, lambda: datum_loss(conv(x)), rule="conv")


# -- attention and recurrent layers (torch.func rules) ---------------------------------------
@st.composite
def mha_options(draw: st.DrawFn) -> dict[str, Any]:
    heads = draw(st.integers(1, 2))
    return {
        "heads": heads,
        "E": heads * draw(st.integers(1, 3)),
        "batch_first": draw(st.booleans()),
        "kdim": draw(st.sampled_from([None, 2])),
        "bias": draw(st.booleans()),
        "add_bias_kv": draw(st.booleans()),
        "padding_mask": draw(st.booleans()),
        "attn_mask": draw(st.sampled_from([None, "2d", "3d"])),
        "need_weights": draw(st.booleans()),
        "B": draw(st.integers(1, 3)),
        "L": draw(st.integers(1, 4)),
        "S": draw(st.integers(2, 4)),
    }


def _mha_case(o: dict[str, Any], seed: int, dropout: float = 0.0, weights_in_loss: bool = True
              ) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """A MultiheadAttention of options ``o`` and the per-datum losses of one call of it."""
    B, L, S, E, heads = o["B"], o["L"], o["S"], o["E"], o["heads"]
    attn = built(
        lambda: nn.MultiheadAttention(
            E,
            heads,
            dropout=dropout,
            bias=o["bias"],
            add_bias_kv=o["add_bias_kv"],
            kdim=o["kdim"],
            vdim=o["kdim"],
            batch_first=o["batch_first"],
        ),
        seed,
    )
    q = randn(B, L, E, seed=seed)  # (B, L, E)
    kv = randn(B, S, o["kdim"] or E, seed=seed + 1)  # (B, S, kdim)
    if not o["batch_first"]:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)  # sequence first
    kpm = None
    if o["padding_mask"]:  # datum 0 ignores its last key; the same dtype as the attn_mask
        kpm = torch.zeros(B, S, dtype=D64 if o["attn_mask"] == "3d" else torch.bool)
        kpm[0, -1] = -1e4 if o["attn_mask"] == "3d" else True
    S_total = S  # with add_bias_kv the module pads the mask itself
    mask = None
    if o["attn_mask"] == "2d":
        mask = torch.zeros(L, S_total, dtype=torch.bool)
        mask[:, 0] = L > 1  # some queries may not see key 0
        mask[0, 0] = False
    elif o["attn_mask"] == "3d":
        mask = randn(B * heads, L, S_total, seed=seed + 2)  # additive float mask per datum/head

    def forward() -> torch.Tensor:
        out, weights = attn(
            q, kv, kv, key_padding_mask=kpm, attn_mask=mask, need_weights=o["need_weights"]
        )
        out = out if o["batch_first"] else out.transpose(0, 1)  # (B, L, E)
        loss = datum_loss(out)
        if weights is not None and weights_in_loss:
            loss = loss + datum_loss(weights, seed=2)  # weights are (B, L, S) either way
        return loss

    return attn, forward


@SLOW_RULE_SETTINGS
@given(o=mha_options(), seed=st.integers(0, 2**16))
def test_multihead_attention(o: dict[str, Any], seed: int) -> None:
    attn, forward = _mha_case(o, seed)
    assert_like_loop(attn, forward, rule="multihead_attention")


@SLOW_RULE_SETTINGS
@given(o=mha_options(), seed=st.integers(0, 2**16), weights_in_loss=st.booleans())
def test_multihead_attention_in_training_with_dropout_records_the_batchs_own_masks(
        o: dict[str, Any], seed: int, weights_in_loss: bool) -> None:
    """Attention dropout's masks, drawn inside the attention, cannot be drawn again by a
    re-run: in training the records come from the batch's own backward through the
    projections, equal to the loop oracle's on the same masks (both forwards seeded alike).
    add_bias_kv's biases, and attention weights in the loss, are refused."""
    from gradlog.testing.oracle import assert_like_loop as assert_like_loop_seeded

    attn, forward = _mha_case(o, seed, dropout=0.5, weights_in_loss=weights_in_loss)
    attn.train()
    if o["add_bias_kv"] or (o["need_weights"] and weights_in_loss):
        with pytest.raises((UnsupportedLayerError, BackendError), match="attention dropout"):
            assert_like_loop_seeded(attn, forward)
        return
    described = assert_like_loop_seeded(attn, forward, rtol=1e-6, atol=1e-9)
    assert {m["rule"] for m in described["modules"]} == {"multihead_attention"}, described


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_with_its_in_projection_frozen_records_its_out_projection(
        need_weights: bool) -> None:
    """Nothing to take back through the attention when no in-projection is recorded (on
    data that needs no gradient, there is no graph to take it through: it was refused)."""
    from gradlog.testing.oracle import assert_like_loop as assert_like_loop_seeded

    attn = built(lambda: nn.MultiheadAttention(4, 2, dropout=0.5), 0).train()
    attn.in_proj_weight.requires_grad_(False)
    attn.in_proj_bias.requires_grad_(False)
    x = randn(3, 2, 4, seed=0)  # (T, B, E), no gradient

    def forward() -> torch.Tensor:
        return datum_loss(attn(x, x, x, need_weights=need_weights)[0].transpose(0, 1))

    described = assert_like_loop_seeded(attn, forward, rtol=1e-6, atol=1e-9)
    assert {m["rule"] for m in described["modules"]} == {"multihead_attention"}


@pytest.mark.parametrize("training", [True, False])
def test_multihead_attention_with_its_output_changed_in_place(training: bool) -> None:
    """An in-place op on the layer's output (a view of the out-projection's) replaces the
    output's autograd node: what was noted is held by the out-projection's, which stays
    (it was refused in training)."""
    from gradlog.testing.oracle import assert_like_loop as assert_like_loop_seeded

    attn = built(lambda: nn.MultiheadAttention(4, 2, dropout=0.5), 0).train(training)
    x = randn(3, 2, 4, seed=0).requires_grad_()  # (T, B, E)

    def forward() -> torch.Tensor:
        out = attn(x, x, x, need_weights=False)[0]
        out.mul_(2.0).relu_()
        return datum_loss(out.transpose(0, 1))

    assert_like_loop_seeded(attn, forward, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("training", [False, True])
def test_multihead_attention_with_a_datum_whose_keys_are_all_masked(training: bool) -> None:
    """That datum's gradients are NaN, the others' their own (the loop oracle's are all NaN:
    the NaN spreads through its batched backward). With need_weights the gradients kept
    while the backward passed are matched NaN for NaN (in training it was refused). In
    training one datum alone draws other dropout masks: the NaNs are compared there."""
    from gradlog.testing.oracle import backend_grads, naive_per_datum_grads

    attn = built(lambda: nn.MultiheadAttention(4, 2, dropout=0.5), 0).train(training)
    x = randn(3, 2, 4, seed=0)  # (T, B, E)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    pad[1] = True

    w = randn(2, 3, 4, seed=1)  # each datum's own loss weights

    def losses(b: slice) -> torch.Tensor:
        xb = x[:, b]
        y = attn(xb, xb, xb, key_padding_mask=pad[b])[0].transpose(0, 1)  # (B, T, E)
        return (torch.tanh(y) * w[b]).sum((1, 2))

    got, _, described = backend_grads(attn, lambda: losses(slice(None)))
    assert {m["rule"] for m in described["modules"]} == {"multihead_attention"}
    want = naive_per_datum_grads(lambda b: losses(slice(b, b + 1))[0],
                                 dict(attn.named_parameters()), 2)
    for name, g in want.items():
        if not training:
            torch.testing.assert_close(got[name][0], g[0], rtol=1e-6, atol=1e-9)
        assert got[name][0].isfinite().all()
        assert got[name][1].isnan().all() and g[1].isnan().all()


def test_multihead_attentions_noted_projections_do_not_outlive_their_graph() -> None:
    """A forward whose backward never comes (a refused step, a discarded forward) takes
    what was noted of it with its graph: it never keeps the graph, nor the calls hooked in
    it, alive (they were then taken for the next backward's)."""
    import gc

    from gradlog.rules import attention

    attn = built(lambda: nn.MultiheadAttention(4, 2, dropout=0.5), 0).train()
    be = BACKENDS["hooks"](attn, select_params(attn, ["*"]), batch_reduction="mean",
                           randomness="different")
    be.attach()
    try:
        x = randn(3, 2, 4, seed=0)
        out = attn(x, x, x, need_weights=False)[0]
        assert len(attention._FRAMES[attn]) == 1
        del out
        gc.collect()
        assert len(attention._FRAMES[attn]) == 0
    finally:
        be.detach()


@st.composite
def rnn_options(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["RNN", "LSTM", "GRU"]))
    return {
        "kind": kind,
        "layers": draw(st.integers(1, 2)),
        "bidirectional": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "proj": draw(st.sampled_from([0, 2])) if kind == "LSTM" else 0,
        "initial_state": draw(st.booleans()),
        "use_final": draw(st.booleans()),
        "B": draw(st.integers(1, 3)),
        "T": draw(st.integers(1, 4)),
    }


@SLOW_RULE_SETTINGS
@given(o=rnn_options(), seed=st.integers(0, 2**16))
def test_recurrent(o: dict[str, Any], seed: int) -> None:
    B, T, H, n_in = o["B"], o["T"], 3, 2
    kwargs: dict[str, Any] = {"proj_size": o["proj"]} if o["kind"] == "LSTM" else {}
    rnn = built(
        lambda: getattr(nn, o["kind"])(
            n_in,
            H,
            num_layers=o["layers"],
            bias=o["bias"],
            batch_first=o["batch_first"],
            bidirectional=o["bidirectional"],
            **kwargs,
        ),
        seed,
    )
    x = randn(B, T, n_in, seed=seed)
    if not o["batch_first"]:
        x = x.transpose(0, 1)  # (T, B, n_in)
    n_states = o["layers"] * (2 if o["bidirectional"] else 1)
    h0 = randn(n_states, B, o["proj"] or H, seed=seed + 1)  # (layers*dirs, B, H_out)
    state: Any = (h0, randn(n_states, B, H, seed=seed + 2)) if o["kind"] == "LSTM" else h0

    def forward() -> torch.Tensor:
        out, final = rnn(x, state) if o["initial_state"] else rnn(x)
        out = out if o["batch_first"] else out.transpose(0, 1)  # (B, T, dirs*H_out)
        loss = datum_loss(out)
        if o["use_final"]:  # gradients reaching h_n (and c_n) count too
            for h in final if isinstance(final, tuple) else (final,):
                loss = loss + datum_loss(h.transpose(0, 1), seed=3)
        return loss

    assert_like_loop(rnn, forward, rule="rnn")


def test_rnn_on_packed_sequences_matches_loop() -> None:
    """Packed sequences were refused ("not supported yet"); the rule groups datums by length
    (more cases: tests/test_opacus_shapes.py)."""
    rnn = built(lambda: nn.GRU(2, 3, batch_first=True), 0)
    x = randn(3, 4, 2, seed=0)

    def forward() -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([4, 2, 1]), batch_first=True)
        out, _ = rnn(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return datum_loss(padded)

    assert_like_loop(rnn, forward, rule="rnn")


# -- the registry ----------------------------------------------------------------------------
class Scale(nn.Module):
    """y = x * weight, elementwise over the last dimension."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_third_party_rule_is_used_and_exact() -> None:
    calls: list[int] = []

    def scale_rule(module: Scale, cap: Capture, wanted: frozenset[str]) -> dict[str, Any]:
        calls.append(cap.batch_size)
        x, g = cap.input, cap.grad_output  # (B, ..., d)
        return {"weight": (g * x).reshape(cap.batch_size, -1, x.shape[-1]).sum(1) * cap.scale}

    register_rule(Scale, name="scale")(scale_rule)
    try:
        layer = built(lambda: Scale(3), 0)
        x = randn(4, 5, 3, seed=0)
        assert_like_loop(layer, lambda: datum_loss(layer(x)), rule="scale")
        assert calls and set(calls) == {4}
    finally:
        RULES.pop(Scale)
    assert find_rule(Scale(2)) is None  # unregistered again: the torch.func fallback applies


class Offset(nn.Module):
    """y = x + bias on (B, d): datum b's bias gradient is its output gradient itself."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


def test_a_rule_returning_a_captured_tensor_cannot_corrupt_the_backward() -> None:
    def lazy(module: Offset, cap: Capture, wanted: frozenset[str]) -> dict[str, Any]:
        g = cap.grad_output  # (B, d)
        return {"bias": g if cap.scale == 1 else g * cap.scale}  # the captured tensor itself

    register_rule(Offset, name="offset")(lazy)
    try:
        layer = built(lambda: Offset(3), 0)
        x = randn(4, 3, seed=0)
        # called twice: the backend adds the second call's result into the first one's
        assert_like_loop(layer, lambda: datum_loss(torch.tanh(layer(layer(x)))), rule="offset")
        plain = built(lambda: Offset(3), 0)
        datum_loss(torch.tanh(plain(plain(x)))).sum().backward()
        per_datum(layer, lambda: datum_loss(torch.tanh(layer(layer(x)))), "hooks", "sum")
        assert torch.equal(layer.bias.grad, plain.bias.grad)  # autograd's tensors untouched
    finally:
        RULES.pop(Offset)


def test_a_rule_leaving_out_a_parameter_it_was_asked_for_is_an_error() -> None:
    """Its records would read as zeros that no check compares (the spot check samples
    records only): a rule of the RNN's was asked for a parametrized weight and returned
    none. An error naming the rule and what it left out."""
    register_rule(Offset, name="offset")(lambda module, cap, wanted: {})
    try:
        layer = built(lambda: Offset(3), 0)
        with pytest.raises(BackendError, match=r"rule 'offset' .* returned no per-datum "
                                               r"gradients for \['bias'\]"):
            per_datum(layer, lambda: datum_loss(layer(randn(4, 3, seed=0))), "hooks", "sum")
    finally:
        RULES.pop(Offset)


class _ScaledEmbedding(nn.Embedding):
    """transformers' scaled word embeddings (BART's, Gemma 3's): the lookup times a constant;
    ``shifted``: a forward computing something else (a learned position table's)."""

    def __init__(self, shifted: bool = False) -> None:
        super().__init__(11, 3, padding_idx=0)
        self.shifted = shifted

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shifted:
            return super().forward((ids + 2) % 11)
        return super().forward(ids) * 3.5


@pytest.mark.parametrize("shifted", [False, True])
def test_an_embedding_scaling_its_lookup_gets_the_embeddings_rows_scaled(shifted: bool) -> None:
    """Such a subclass had no rule (its own forward): re-run per datum, its per-datum
    gradients materialised, (B, V, D), for a vocabulary of 262K in Gemma 3. A replay finds
    the constant; a forward computing otherwise keeps the re-run, right either way."""
    layer = built(lambda: _ScaledEmbedding(shifted), 0)
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(0))
    ids[0, :2] = 0  # (padding rows get nothing)
    got, described = per_datum(layer, lambda: datum_loss(layer(ids)), "hooks", "mean")
    want, _ = per_datum(layer, lambda: datum_loss(layer(ids)), "loop", "mean")
    torch.testing.assert_close(got["weight"], want["weight"], rtol=1e-6, atol=1e-12)
    assert described["modules"][0]["rule"] == "scaled_embedding"
    assert described["fallback"] == ([""] if shifted else [])  # (re-run: said so)
    from gradlog.rules.embedding import _SCALES

    assert _SCALES.get(layer) == (None if shifted else pytest.approx(3.5))


def test_subclasses_keep_a_rule_only_without_their_own_forward() -> None:
    class Plain(nn.Linear):
        pass

    class Custom(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2.0

    assert find_rule(Plain(2, 2)) is RULES[nn.Linear]
    assert find_rule(Custom(2, 2)) is None
    layer = built(lambda: Custom(3, 2), 0)
    x = randn(4, 3, seed=0)
    assert_like_loop(layer, lambda: datum_loss(layer(x)), rule="torch.func")


def test_register_rule_validates_keys() -> None:
    with pytest.raises(TypeError):
        register_rule()
    with pytest.raises(TypeError):
        register_rule(int)(lambda module, cap, wanted: {})  # type: ignore[arg-type]


def test_row_grads_are_summed_into_a_tied_dense_gradient() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 3)
            self.head = nn.Linear(3, 6, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.emb(idx)))  # (B, T, V)

    model = built(Tied, 0)
    idx = torch.randint(0, 6, (3, 4))
    assert_like_loop(
        model, lambda: F.cross_entropy(model(idx).transpose(1, 2), idx, reduction="none").mean(1)
    )
