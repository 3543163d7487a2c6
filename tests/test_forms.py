"""Forms (gradlog.forms): exactness of factors and rows, factored inner products and ghost
norms, ``auto``'s choices, round trips of every form, projections (unbiased, error shrinking
as Johnson-Lindenstrauss predicts, reproducible), top-k selection, and the errors."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradlog.forms.projection as forms_projection
import gradlog.grads as grads
import gradlog.grads.inner as grads_inner
from gradlog.errors import ConfigError, InputError, StoreFormatError
from gradlog.forms import (
    FORMS,
    FactorsForm,
    Form,
    FullForm,
    NormForm,
    ParamInfo,
    ProjectionForm,
    RowsForm,
    TopKForm,
    form_from_spec,
    make_form,
    plan_forms,
    project,
    random_matrix,
    smallest_exact,
)
from gradlog.forms.projection import balanced_ranks, derive_seed, param_seed
from gradlog.grads import (
    Factors,
    Rows,
    batch_sum,
    entries,
    factored_inner,
    factored_sqnorms,
    factors_worthwhile,
    sqnorms,
)

D64 = torch.float64
FORM_SETTINGS = settings(
    max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def rand(*shape: int, dtype: torch.dtype = D64, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def padded_factors(
    B: int, N: int, p: int, q: int, *, dtype: torch.dtype = D64, seed: int = 0, scale: float = 1.0
) -> Factors:
    """Factors with variable lengths per datum; padding rows hold garbage (NaN in ``a``)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn((B, N, p), generator=gen, dtype=dtype)
    a = torch.randn((B, N, q), generator=gen, dtype=dtype)
    lengths = torch.randint(0, N + 1, (B,), generator=gen)
    lengths[0] = N
    keep = torch.arange(N) < lengths.unsqueeze(1)  # (B, N)
    a = a.masked_fill(~keep.unsqueeze(-1), float("nan"))
    return Factors.from_lengths(g, a, lengths, scale=scale)


def loop_dense(f: Factors) -> torch.Tensor:
    """The oracle: per datum, per kept token, the outer product, summed."""
    B, N = f.g.shape[:2]
    out = torch.zeros((B, *f.shape), dtype=f.g.dtype)
    for b in range(B):
        for n in range(N):
            if f.mask is None or bool(f.mask[b, n]):
                out[b] += f.scale * torch.outer(f.g[b, n], f.a[b, n])
    return out


def flat_inner(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).double() @ y.reshape(y.shape[0], -1).double().T


def rows_material(B: int, N: int, V: int, D: int, *, seed: int = 0, scale: float = 1.0) -> Rows:
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, V, (B, N), generator=gen)  # repeats: shared tokens
    index[:, -1] = -1  # a padding slot
    values = torch.randn((B, N, D), generator=gen, dtype=D64)
    return Rows(index, values, V, scale)


# -- factors -------------------------------------------------------------------------------
@FORM_SETTINGS
@given(
    B=st.integers(1, 4),
    N=st.integers(1, 7),
    p=st.integers(1, 6),
    q=st.integers(1, 6),
    scale=st.sampled_from([1.0, 3.0]),
)
@pytest.mark.filterwarnings("ignore:.*the bytes of form .full.:UserWarning")
def test_factors_reconstruct_exactly(B: int, N: int, p: int, q: int, scale: float) -> None:
    f = padded_factors(B, N, p, q, scale=scale)
    want = loop_dense(Factors(f.g, torch.nan_to_num(f.a), f.mask, scale))
    torch.testing.assert_close(f.dense(), want, rtol=1e-10, atol=1e-12)
    form = make_form("factors", ParamInfo.of(f))
    assert isinstance(form, FactorsForm)
    enc = form.encode(f)
    assert not any(torch.isnan(t).any() for t in enc.values())  # padding never leaks
    torch.testing.assert_close(form.decode(enc), want, rtol=1e-10, atol=1e-12)
    compact, lengths = f.compact(f.mask)
    assert torch.equal(lengths, f.mask.sum(1))  # type: ignore[union-attr]
    torch.testing.assert_close(compact.dense(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("orientation", ["linear", "conv1d"])
def test_factors_match_autograd_linear_with_padding_and_bias(orientation: str) -> None:
    """Per-datum gradients of an nn.Linear (weight and bias) from captured input and
    output gradient, padded tokens masked out, against one autograd.grad per datum."""
    B, T, d_in, d_out = 3, 5, 4, 6
    layer = nn.Linear(d_in, d_out).double()
    x = rand(B, T, d_in, seed=1)
    lengths = torch.tensor([5, 2, 0])
    valid = torch.arange(T) < lengths.unsqueeze(1)  # (B, T)
    target = rand(B, T, d_out, seed=2)

    def losses(y: torch.Tensor) -> torch.Tensor:
        per_token = ((torch.tanh(y) - target) ** 2).sum(-1)  # (B, T)
        return (per_token * valid).sum(1)  # (B,)

    y = layer(x)
    y.retain_grad()
    losses(y).sum().backward()
    assert y.grad is not None
    g = y.grad  # (B, T, d_out): each datum's loss only touches its own rows
    if orientation == "linear":
        f = Factors.from_lengths(g, x, lengths)
        weight_of = lambda w: w  # noqa: E731
    else:  # Conv1D keeps the weight as (d_in, d_out) = A^T G
        f = Factors.from_lengths(x, g, lengths)
        weight_of = lambda w: w.transpose(-1, -2)  # noqa: E731
    for b in range(B):
        gw, gb = torch.autograd.grad(losses(layer(x))[b], (layer.weight, layer.bias))
        torch.testing.assert_close(weight_of(f.dense()[b]), gw, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            f.bias(0 if orientation == "linear" else 1)[b], gb, rtol=1e-10, atol=1e-12
        )
    bias = FactorsForm.plan(ParamInfo((d_out,), "dense"))
    assert isinstance(bias, FullForm)  # a bias's factored form is its full form


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_factors_of_16_bit_values_give_the_float32_products(
    narrow: torch.dtype, masked: bool
) -> None:
    """Factors holding widened 16-bit values (a layer under autocast) and marked ``narrow``:
    the same per-datum gradients as without the mark (the products are exact in float32),
    against float64."""
    g = rand(3, 9, 5, seed=3).to(narrow).float()
    a = rand(3, 9, 7, seed=4).to(narrow).float()
    mask = (torch.arange(9) < torch.tensor([[9], [4], [0]])) if masked else None
    f = Factors(g, a, mask, scale=3.0, narrow=narrow)
    want = loop_dense(Factors(g.double(), a.double(), mask, 3.0))
    torch.testing.assert_close(f.dense().double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads.select(f, 1, 3).dense(), f.dense()[1:3])
    assert grads.select(f, 1, 3).narrow == narrow  # (a slice keeps the promise)
    want_sq = want.reshape(3, -1).square().sum(1)  # the exact norms: float64 Gram matrices
    # (factored), or of the gradients formed in float32 (materialised, narrow: on CUDA from
    # the 16-bit operands), squared and summed in float64
    for method, rtol in (("factored", 1e-12), ("materialised", 1e-6)):
        c = f.canonical() if masked else f
        got = grads_inner.factored_sqnorms(c.g, c.a, method=method, narrow=c.narrow)
        torch.testing.assert_close(got * (1.0 if masked else 9.0), want_sq, rtol=rtol,
                                   atol=1e-300)
    torch.testing.assert_close(sqnorms(f), want_sq, rtol=1e-6, atol=1e-300)


@FORM_SETTINGS
@given(B=st.integers(1, 4), N=st.integers(1, 12), p=st.integers(1, 9), q=st.integers(1, 9),
       masked=st.booleans(), scale=st.sampled_from([1.0, 0.5, 3.0]),
       narrow=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 99))
def test_factors_held_in_16_bits_read_as_their_widened_values(
        B: int, N: int, p: int, q: int, masked: bool, scale: float, narrow: torch.dtype,
        seed: int) -> None:
    """Factors held in autocast's 16-bit dtype (the Linear rule keeps its operands so: half
    the memory, no widening copies) give every consumer bitwise what the same factors held
    widened to float32 give: the values, the gradients, their norms, entries, compaction,
    slices, batch sums, the factors and projection forms' arrays, one call's merge with
    another. Oracle: the widened factors (the products are exact in float32)."""
    from gradlog.backends.hooks.accumulate import Accumulator
    from gradlog.backends.hooks.pool import BufferPool

    g16 = rand(B, N, p, seed=seed).to(narrow)
    a16 = rand(B, N, q, seed=seed + 100).to(narrow)
    mask = (torch.rand(B, N, generator=torch.Generator().manual_seed(seed)) < 0.7
            if masked else None)
    held = Factors(g16, a16, mask, scale, narrow)
    wide = Factors(g16.float(), a16.float(), mask, scale, narrow)
    assert held.held[0].dtype == narrow and held.g.dtype == held.dtype == torch.float32
    assert held.g is held.g  # widened once, then kept

    def same(x: Any, y: Any) -> None:
        if isinstance(x, Factors):
            assert x.held[0].dtype == narrow or x.held[0].dtype == torch.float32
            same((x.g, x.a, x.mask, x.scale, x.narrow), (y.g, y.a, y.mask, y.scale, y.narrow))
        elif isinstance(x, (tuple, list)):
            assert len(x) == len(y)
            for u, v in zip(x, y):
                same(u, v)
        elif isinstance(x, dict):
            assert x.keys() == y.keys()
            same(list(x.values()), list(y.values()))
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), (x, y)
        else:
            assert x == y

    same(held, wide)
    same(held.dense(), wide.dense())
    want = loop_dense(Factors(g16.double(), a16.double(), mask, scale))  # and float64's
    torch.testing.assert_close(held.dense().double(), want, rtol=1e-5, atol=1e-6)
    same(held.canonical(), wide.canonical())
    same(held.compact(), wide.compact())
    same(held.bias(0), wide.bias(0))
    same(held.bias(1), wide.bias(1))
    same(grads.select(held, 1, 3).dense(), grads.select(wide, 1, 3).dense())
    flat = torch.randint(0, p * q, (5,), generator=torch.Generator().manual_seed(seed))
    same(entries(held, flat), entries(wide, flat))
    same(batch_sum(held, torch.full((B,), 0.25, dtype=D64)),
         batch_sum(wide, torch.full((B,), 0.25, dtype=D64)))
    same(sqnorms(held), sqnorms(wide))
    for method in ("factored", "materialised"):
        same(factored_sqnorms(*held.masked().held, method=method, narrow=narrow),
             factored_sqnorms(*wide.masked().held, method=method, narrow=narrow))
    unmasked = [Factors(g16, a16, None, scale, narrow),
                Factors(g16.roll(1, 1), a16.roll(2, 1), None, scale, narrow)]  # one group
    widened = [Factors(f.g.clone(), f.a.clone(), None, scale, narrow) for f in unmasked]
    same(grads.grouped_sqnorms(unmasked), grads.grouped_sqnorms(widened))
    form = FactorsForm((p, q), tokens=N)
    same(form.encode(held), form.encode(wide))
    projection = ProjectionForm((p, q), structure="two_sided", kind="gaussian", seed=seed,
                                ranks=(2, 3))
    same(projection.encode(held), projection.encode(wide))

    def merged(f: Factors) -> Any:
        weight = nn.Parameter(torch.zeros(p, q))
        acc = Accumulator({"w": weight}, BufferPool(), B, frozenset({"w"}))
        acc.material["w"] = [f, Factors(*f.held, None, f.scale, f.narrow)]  # two calls
        return acc.merge_materials()["w"]

    same(merged(held), merged(wide))


@pytest.mark.parametrize(("B", "N", "p", "q"), [(4, 16, 24, 20), (3, 300, 6, 5), (1, 2, 3, 4)])
@pytest.mark.parametrize("narrow", [None, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_grouped_factor_norms_are_each_records_own(
        B: int, N: int, p: int, q: int, narrow: torch.dtype | None, scale: float) -> None:
    """Factors of one shape take their exact norms in one stacked pass (the encoder groups a
    step's Linear records): each record's norms are those it gets alone (the materialised
    path forms float32 gradients, whose rounding may follow the stacked batch's blocking),
    and the float64 oracle's (its gradients formed in float64, squared and summed)."""
    fs = []
    for k in range(4):
        g, a = rand(B, N, p, seed=2 * k).float(), rand(B, N, q, seed=2 * k + 1).float()
        if narrow is not None:
            g, a = g.to(narrow).float(), a.to(narrow).float()
        fs.append(Factors(g, a, scale=scale, narrow=narrow))
    assert len({grads.factor_group(f) for f in fs}) == 1
    got = grads.grouped_sqnorms(fs)
    for f, norms in zip(fs, got):
        assert norms.shape == (B,) and norms.dtype == torch.float64
        torch.testing.assert_close(norms, sqnorms(f), rtol=5e-7, atol=0)
        want = loop_dense(Factors(f.g.double(), f.a.double(), scale=scale))
        torch.testing.assert_close(norms, want.reshape(B, -1).square().sum(1), rtol=1e-6,
                                   atol=1e-300)
    masked = Factors(fs[0].g, fs[0].a, torch.ones(B, N, dtype=torch.bool))
    assert grads.factor_group(masked) is None  # masked rows are zeroed first: alone
    assert grads.factor_group(fs[0]) != grads.factor_group(
        Factors(fs[0].g, fs[0].a, scale=2 * scale, narrow=narrow))


def test_grouped_factor_norms_stack_a_bounded_share_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's stacked copy (and a ghost norm's float64 widening of it) is bounded by
    MAX_ELEMENTS: 7B-sized q/k/v/o records of a step would otherwise take tens of GB."""
    fs = [Factors(rand(2, 5, 3, seed=k).float(), rand(2, 5, 4, seed=50 + k).float())
          for k in range(7)]
    whole = grads.grouped_sqnorms(fs)
    passes: list[int] = []
    real = grads_inner.factored_sqnorms

    def counted(g: torch.Tensor, a: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        passes.append(g.shape[0])
        return real(g, a, **kwargs)

    monkeypatch.setattr(grads_inner, "factored_sqnorms", counted)
    monkeypatch.setattr(grads_inner, "MAX_ELEMENTS", 3 * 2 * 5 * (3 + 4))  # 3 records a pass
    parts = grads.grouped_sqnorms(fs)
    assert passes == [6, 6, 2]  # datums per pass
    for a, b in zip(parts, whole):
        torch.testing.assert_close(a, b, rtol=5e-7, atol=0)


def test_the_16_bit_matmul_call_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path of ``outer_sums`` (``bmm`` into float32 from 16-bit operands), called on
    the meta device so that CI without a GPU runs its signature and shapes."""
    from gradlog.grads.material import MixedMatmul, outer_sums

    if not MixedMatmul.available:
        pytest.skip("this torch has no bmm with out_dtype (torch < 2.8): the float32 path runs")
    monkeypatch.setattr(MixedMatmul, "devices", frozenset({"meta"}))
    left = torch.empty(2, 5, 3, device="meta")
    right = torch.empty(2, 5, 4, device="meta")
    out = torch.empty(2, 3, 4, device="meta")
    got = outer_sums(left, right, 2.0, out, torch.bfloat16)
    assert got is out and got.shape == (2, 3, 4) and got.dtype == torch.float32
    assert MixedMatmul.available  # not refused


def test_factors_refuse_an_unknown_narrow_dtype() -> None:
    with pytest.raises(InputError, match="narrow"):
        Factors(rand(1, 2, 3, seed=0), rand(1, 2, 3, seed=1), narrow=torch.float32)


def test_factors_worthwhile_matches_the_byte_count() -> None:
    assert factors_worthwhile(63, 128, 128) and not factors_worthwhile(64, 128, 128)
    assert factors_worthwhile(2047, 4096, 4096) and not factors_worthwhile(2048, 4096, 4096)
    for T in range(1, 80):
        info = ParamInfo((128, 128), "factors", T)
        assert isinstance(smallest_exact(info), FactorsForm) == factors_worthwhile(T, 128, 128)


def test_factors_encode_pads_and_compacts_to_tokens() -> None:
    f = padded_factors(4, 6, 3, 5, seed=3)
    want = f.dense()
    wide = FactorsForm((3, 5), tokens=9)
    enc = wide.encode(f)
    assert enc["g"].shape == (4, 9, 3)
    torch.testing.assert_close(wide.decode(enc), want, rtol=1e-12, atol=1e-12)
    longest = int(f.mask.sum(1).max())  # type: ignore[union-attr]
    narrow = FactorsForm((3, 5), tokens=longest)  # fewer slots than N: rows that count move up
    torch.testing.assert_close(narrow.decode(narrow.encode(f)), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(InputError, match="tokens= at least"):
        FactorsForm((3, 5), tokens=longest - 1).encode(f)


@pytest.mark.parametrize("dtype", [torch.float32, D64])
@pytest.mark.parametrize("method", ["factored", "materialised", "auto"])
def test_factored_inner_and_norms_equal_materialised(
    dtype: torch.dtype, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grads_inner, "MAX_ELEMENTS", 300)  # force several chunks
    fx = padded_factors(5, 7, 6, 4, dtype=dtype, seed=4).canonical()
    fy = padded_factors(3, 5, 6, 4, dtype=dtype, seed=5, scale=2.0).canonical()
    dx, dy = fx.dense(), fy.dense()
    # materialised in the inputs' own dtype; tolerance relative to |x| |y| (Cauchy-Schwarz)
    want = (dx.reshape(5, -1) @ dy.reshape(3, -1).T).double()
    scale = torch.outer(
        dx.reshape(5, -1).double().norm(dim=1), dy.reshape(3, -1).double().norm(dim=1)
    )
    rtol = 1e-6 if dtype == torch.float32 else 1e-10
    for out_dtype in (dtype, D64):
        got = factored_inner(fx.g, fx.a, fy.g, fy.a, dtype=out_dtype, method=method).double()
        assert ((got - want).abs() <= rtol * scale + 1e-30).all(), (got - want).abs().max()
        norms = factored_sqnorms(fx.g, fx.a, dtype=out_dtype, method=method).double()
        want_n = dx.reshape(5, -1).double().square().sum(1)
        torch.testing.assert_close(norms, want_n, rtol=rtol, atol=0)
    # the form's own methods, and the ghost norm through sqnorms() of the material
    form = FactorsForm((6, 4), tokens=7)
    enc = form.encode(fx)
    torch.testing.assert_close(
        form.inner(enc, enc), flat_inner(dx, dx), rtol=rtol, atol=rtol * float(scale.max())
    )
    torch.testing.assert_close(
        sqnorms(fx), dx.reshape(5, -1).double().square().sum(1), rtol=rtol, atol=0
    )


@pytest.mark.parametrize("n", [10, 4096 * 3, 4096 * 250 + 17])
def test_float64_norms_of_float32_gradients_are_accurate(n: int) -> None:
    x = rand(3, n, dtype=torch.float32, seed=n) * rand(3, n, dtype=torch.float32, seed=1) ** 4
    want = x.double().square().sum(1)
    got = grads.dense_sqnorms(x)
    assert got.dtype == D64
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)  # squared and summed in float64
    torch.testing.assert_close(sqnorms(x), want, rtol=1e-13, atol=0)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 9),
    n=st.integers(1, 40000),
    scratch=st.sampled_from([None, 1, 64, 1 << 18]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]),
    one_pass=st.booleans(),  # the GPU's way (one vector_norm per block), run here
)
def test_float64_sqnorms_are_float64_sums(B: int, n: int, scratch: int | None,
                                          dtype: torch.dtype, one_pass: bool) -> None:
    import gradlog.grads.norms as norms

    x = (rand(B, n, dtype=torch.float64, seed=n) * 3).to(dtype)
    devices = frozenset({"cpu"}) if one_pass else frozenset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norms, "ONE_PASS_DEVICES", devices)
        got = grads.float64_sqnorms(x, None if scratch is None else torch.empty(scratch,
                                                                                dtype=D64))
    want = x.double().square().sum(1)  # the naive float64 sum: the oracle
    assert got.dtype == D64 and got.shape == (B,)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)  # float64 rounding only


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 5),
    N=st.integers(0, 12),
    V=st.integers(1, 9),
    pad=st.floats(0, 0.5),
    scale=st.sampled_from([1.0, 0.25, 3.0]),
    distinct=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_rows_sqnorms_are_the_dense_gradients_norms(
    B: int, N: int, V: int, pad: float, scale: float, distinct: bool, seed: int
) -> None:
    """Rows.sqnorms (repeated rows merged, padding left out even when it holds NaN, distinct
    rows), Rows.dense and Rows.unique against the naive float64 dense gradients."""
    gen = torch.Generator().manual_seed(seed)
    if distinct and N <= V:  # each datum's rows distinct (a position embedding)
        index = torch.stack([torch.randperm(V, generator=gen)[:N] for _ in range(B)])
    else:
        index = torch.randint(0, V, (B, N), generator=gen)
    index = torch.where(torch.rand(B, N, generator=gen) < pad, -1, index)  # (B, N)
    values = torch.randn(B, N, 3, generator=gen, dtype=torch.float32)
    values = torch.where((index < 0).unsqueeze(-1), float("nan"), values)
    r = grads.Rows(index, values, V, scale)
    want = torch.zeros(B, V, 3, dtype=D64)
    magnitude = torch.zeros(B, V, 3, dtype=D64)  # sum of |terms|: float32 sums' error bound
    for b in range(B):
        for n in range(N):
            if index[b, n] >= 0:
                want[b, index[b, n]] += scale * values[b, n].double()
                magnitude[b, index[b, n]] += scale * values[b, n].double().abs()
    want_sq = want.reshape(B, -1).square().sum(1)
    torch.testing.assert_close(r.sqnorms(), want_sq, rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(sqnorms(r), want_sq, rtol=1e-12, atol=1e-300)
    bound = N * torch.finfo(torch.float32).eps * magnitude + 1e-30
    assert ((r.dense().double() - want).abs() <= bound).all()  # float32 sums
    u = r.unique()  # distinct rows, sorted, padding after them, the scale folded in
    assert ((u.dense().double() - want).abs() <= bound).all()
    for b in range(B):
        used = u.index[b][u.index[b] >= 0].tolist()
        assert used == sorted(set(used)) and u.index[b, len(used):].eq(-1).all()
        assert u.values[b, len(used):].eq(0).all() and u.scale == 1.0


def test_float64_sqnorms_keep_one_buffer_per_thread_in_any_grad_mode() -> None:
    """The CPU's kept block buffer, first made under inference mode (an analysis), is written
    after it by a recording; threads at once each widen into their own."""
    import threading

    xs = [rand(9, 300_000 + i, dtype=torch.float32, seed=i) for i in range(3)]
    wants = [x.double().square().sum(1) for x in xs]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(5):
                with torch.inference_mode():
                    first = grads.float64_sqnorms(xs[i])
                torch.testing.assert_close(first, wants[i], rtol=1e-13, atol=0)
                torch.testing.assert_close(grads.float64_sqnorms(xs[i]), wants[i], rtol=1e-13,
                                           atol=0)
        except BaseException as e:  # raised again in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_float64_sqnorms_of_a_step_of_gradients() -> None:
    x = rand(32, 4096 * 70 + 3, dtype=torch.float32, seed=3)  # several scratch blocks
    torch.testing.assert_close(
        grads.float64_sqnorms(x), x.double().square().sum(1), rtol=1e-13, atol=0)


def test_norms_of_factors_take_the_way_counted_cheaper_and_repeat_to_the_bit() -> None:
    """The ghost norm or the materialised gradients by count alone, whatever the machine's
    load: both are exact but round differently (the materialised gradients are float32),
    and a timed choice per process once made identical runs store different norms."""
    g, a = rand(3, 64, 128, seed=1), rand(3, 64, 128, seed=2)  # the counts are close here
    want = torch.bmm(g.double().transpose(1, 2), a.double()).reshape(3, -1).square().sum(1)
    first = sqnorms(grads.Factors(g.float(), a.float()))
    torch.testing.assert_close(first, want, rtol=1e-6, atol=0)
    for _ in range(3):
        assert torch.equal(sqnorms(grads.Factors(g.float(), a.float())), first)
    assert grads_inner.norm_method(g, a) == (
        "factored" if grads_inner.prefer_factored(3, 64, 3, 64, 128, 128, pairs=3)
        else "materialised")
    assert grads_inner.norm_method(rand(2, 4, 256), rand(2, 4, 256)) == "factored"  # 4 tokens
    assert grads_inner.norm_method(rand(2, 4096, 8), rand(2, 4096, 8)) == "materialised"


def test_prefer_factored_follows_the_counts() -> None:
    assert grads_inner.prefer_factored(1, 8, 1, 8, 256, 256)  # few tokens: factored
    assert not grads_inner.prefer_factored(100, 512, 100, 512, 512, 512)  # many long pairs
    assert grads_inner.prefer_factored(32, 64, 32, 64, 256, 256, pairs=32)  # ghost norm
    assert not grads_inner.prefer_factored(16, 512, 16, 512, 512, 512, pairs=16)


@pytest.mark.parametrize("source", ["factors", "rows", "dense"])
def test_batch_sum_and_entries_without_materialising(source: str) -> None:
    m = material_of(source)
    full = grads.dense(m)  # (4, *shape)
    w = torch.tensor([0.25, 1.0, -2.0, 0.5], dtype=D64)
    want = torch.einsum("b,b...->...", w, full)
    torch.testing.assert_close(batch_sum(m, w), want, rtol=1e-10, atol=1e-12)
    index = torch.tensor([0, 3, full[0].numel() - 1, 7])
    torch.testing.assert_close(
        entries(m, index), full.reshape(4, -1)[:, index], rtol=1e-10, atol=1e-12
    )


# -- rows ----------------------------------------------------------------------------------
def test_rows_exact_distinct_and_zero_rows_dropped() -> None:
    r = rows_material(4, 9, 6, 3, scale=2.0)
    values = r.values.clone()
    values[1, 0] = 0.0  # a padding_idx row: zero, dropped
    r = Rows(r.index, values, r.num_rows, r.scale)
    want = r.dense()
    u = r.unique()
    torch.testing.assert_close(u.dense(), want, rtol=1e-12, atol=1e-12)
    for b in range(4):
        used = u.index[b][u.index[b] >= 0]
        assert used.tolist() == sorted(set(used.tolist()))  # distinct and sorted
        assert (u.index[b] >= 0).sum() == int(want[b].ne(0).any(-1).sum())
    form = RowsForm((6, 3), tokens=9)
    enc = form.encode(r)
    torch.testing.assert_close(form.decode(enc), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(form.inner(enc, enc), flat_inner(want, want), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(form.sqnorms(enc), want.reshape(4, -1).square().sum(1))
    torch.testing.assert_close(sqnorms(r), want.reshape(4, -1).square().sum(1))
    other = rand(2, 6, 3, seed=9)
    torch.testing.assert_close(
        form.inner_dense(enc, other), flat_inner(want, other), rtol=1e-10, atol=1e-12
    )
    # 6 distinct rows at most: 6 slots hold any datum, 1 slot does not
    torch.testing.assert_close(RowsForm((6, 3), 6).decode(RowsForm((6, 3), 6).encode(r)), want)
    with pytest.raises(InputError, match="distinct rows"):
        RowsForm((6, 3), tokens=1).encode(r)


def test_rows_inner_across_sets_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grads_inner, "MAX_ELEMENTS", 64)
    rx, ry = rows_material(5, 4, 30, 2, seed=1), rows_material(3, 6, 30, 2, seed=2)
    form = RowsForm((30, 2), tokens=6)
    got = form.inner(form.encode(rx), form.encode(ry))
    torch.testing.assert_close(got, flat_inner(rx.dense(), ry.dense()), rtol=1e-10, atol=1e-12)


# -- auto ----------------------------------------------------------------------------------
@FORM_SETTINGS
@given(
    shape=st.one_of(
        st.tuples(st.integers(1, 300), st.integers(1, 300)), st.tuples(st.integers(1, 5000))
    ),
    source=st.sampled_from(["dense", "factors", "rows"]),
    tokens=st.integers(1, 600),
    itemsize=st.sampled_from([2, 4, 8]),
    budget=st.none() | st.integers(0, 400_000),
)
def test_auto_never_larger_than_full(
    shape: tuple[int, ...], source: str, tokens: int, itemsize: int, budget: int | None
) -> None:
    if len(shape) == 1 and source != "dense":
        source = "dense"
    info = ParamInfo(shape, source, tokens, itemsize)
    full = FullForm.plan(info).nbytes_per_record(itemsize)
    exact = make_form("auto", info)
    assert exact.exact and exact.nbytes_per_record(itemsize) <= full
    if source == "factors":
        assert isinstance(exact, FactorsForm) == factors_worthwhile(tokens, shape[1], shape[0])
    chosen = make_form({"form": "auto", "budget": budget}, info)
    nbytes = chosen.nbytes_per_record(itemsize)
    assert nbytes <= full
    if budget is None or exact.nbytes_per_record(itemsize) <= budget:
        assert chosen == exact  # exact whenever it fits
    else:
        assert nbytes <= budget
        assert chosen.name in {"projection", "topk", "norm"}
        if budget // itemsize >= 16:
            assert isinstance(chosen, ProjectionForm)
            assert chosen.dim <= budget // itemsize


def test_plan_forms_shares_a_budget_smallest_first() -> None:
    infos = {
        "emb": ParamInfo((512, 64), "rows", 32, name="emb"),
        "ln": ParamInfo((64,), name="ln"),
        "fc": ParamInfo((256, 64), "factors", 128, name="fc"),
        "head": ParamInfo((512, 64), "factors", 128, name="head"),
    }
    requests = {n: "auto" for n in infos} | {"ln": "full"}
    B = 8
    budget = B * 30_000
    forms = plan_forms(infos, requests, budget_per_step=budget, batch_size=B)
    assert list(forms) == list(infos)
    assert isinstance(forms["ln"], FullForm)
    assert isinstance(forms["emb"], RowsForm)  # smallest exact form fits: kept exact
    assert isinstance(forms["fc"], ProjectionForm) and isinstance(forms["head"], ProjectionForm)
    total = sum(f.nbytes_per_record(4) for f in forms.values())
    assert total <= budget // B
    assert plan_forms(infos, requests)["fc"] == FullForm((256, 64))  # no budget: smallest exact
    with pytest.raises(ConfigError, match="below the"):
        plan_forms(
            infos, {n: "full" for n in infos} | {"fc": "auto"}, budget_per_step=B, batch_size=B
        )


# -- every form: round trip through its own encode / spec / decode --------------------------
FORM_CASES: list[tuple[Any, str]] = [
    ("full", "factors"),
    ("factors", "factors"),
    ("rows", "rows"),
    ("full", "rows"),
    ({"form": "projection", "dim": 12}, "factors"),
    ({"form": "projection", "dim": 12, "kind": "gaussian"}, "rows"),
    ({"form": "projection", "dim": 7, "structure": "dense"}, "factors"),
    ({"form": "projection", "dim": 5}, "dense"),
    ({"form": "topk", "k": 4}, "factors"),
    ({"form": "topk", "fraction": 0.5}, "dense"),
    ("norm", "factors"),
    ("auto", "factors"),
    ({"form": "auto", "budget": 60}, "factors"),
]


def material_of(source: str) -> Material:
    if source == "factors":
        return padded_factors(4, 3, 5, 6, seed=7, scale=0.5)
    if source == "rows":
        return rows_material(4, 5, 7, 3, seed=8)
    return rand(4, 9, seed=9)


Material = Any


def through_store(enc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a store gives back: numpy arrays of the same values."""
    return {k: torch.from_numpy(np.ascontiguousarray(v.numpy())) for k, v in enc.items()}


@pytest.mark.parametrize(("request_", "source"), FORM_CASES)
def test_every_form_round_trips(request_: Any, source: str) -> None:
    m = material_of(source)
    info = ParamInfo.of(m, name="p")
    form = make_form(request_, info)
    assert form.name in FORMS and form.name != "auto"
    again = form_from_spec(json.loads(json.dumps(form.spec())))
    assert again == form and again.spec() == form.spec()
    enc = form.encode(m)
    assert form.check(enc) == (4 if enc else 0)  # 'norm' stores no array
    for key, spec in form.arrays().items():
        assert enc[key].dtype == (torch.int64 if spec.kind == "int64" else D64)
    assert form.nbytes_per_record(8) == sum(t[0].numel() * 8 for t in enc.values())
    back = through_store(enc)
    want = grads.dense(m)
    if form.exact:
        torch.testing.assert_close(again.decode(back), want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            again.inner(back, back), flat_inner(want, want), rtol=1e-10, atol=1e-12
        )
        torch.testing.assert_close(
            again.sqnorms(back), want.reshape(4, -1).square().sum(1), rtol=1e-10, atol=1e-12
        )
    elif isinstance(form, ProjectionForm):
        torch.testing.assert_close(
            back["proj"], project(want, again.spec()), rtol=1e-10, atol=1e-12
        )
        with pytest.raises(InputError, match="does not keep"):
            again.decode(back)
    elif isinstance(form, TopKForm):
        sparse = again.decode(back).reshape(4, -1)
        kept = sparse != 0
        assert (kept.sum(1) <= form.k).all()
        torch.testing.assert_close(sparse[kept], want.reshape(4, -1)[kept])
        torch.testing.assert_close(again.sqnorms(back), sparse.square().sum(1))
        torch.testing.assert_close(again.inner(back, back), flat_inner(sparse, sparse))
    else:
        assert isinstance(form, NormForm) and enc == {} and form.nbytes_per_record() == 0
        with pytest.raises(InputError, match="norm"):
            form.inner(enc, enc)
    if isinstance(form, NormForm):
        return
    # a user's dense gradient (a test example's) against stored records, in the form's space
    other = rand(2, *form.shape, seed=11)
    if isinstance(form, ProjectionForm):
        want_dense = again.inner(back, {"proj": project(other, again.spec())})
    else:  # exact forms: the gradients; topk: the kept entries
        want_dense = flat_inner(again.decode(back), other)
    torch.testing.assert_close(again.inner_dense(back, other), want_dense, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "request_", ["full", "factors", {"form": "projection", "dim": 6}, {"form": "topk", "k": 3}]
)
@pytest.mark.parametrize("tokens", [1, 30])  # ghost norm cheaper / gradients cheaper
@pytest.mark.filterwarnings("ignore:.*the bytes of form .full.:UserWarning")
def test_encode_with_norms_is_encode_plus_exact_norms(request_: Any, tokens: int) -> None:
    f = padded_factors(5, tokens, 4, 3, seed=13, scale=2.0)
    assert grads_inner.prefer_factored(5, tokens, 5, tokens, 4, 3, pairs=5) == (tokens == 1)
    form = make_form(request_, ParamInfo.of(f, name="w"))
    enc, norms = form.encode_with_norms(f)
    for key, t in form.encode(f).items():
        torch.testing.assert_close(enc[key], t, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, f.dense().reshape(5, -1).square().sum(1), rtol=1e-10, atol=0)


# -- projection ----------------------------------------------------------------------------
def estimates(form_of_seed: Any, u: torch.Tensor, v: torch.Tensor, seeds: int) -> torch.Tensor:
    """Projected <u, v> for forms built from seeds 0..seeds-1."""
    out = []
    for s in range(seeds):
        f = form_of_seed(s)
        pu, pv = f.project(u), f.project(v)
        out.append(float((pu.double() * pv.double()).sum()))
    return torch.tensor(out, dtype=D64)


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
@pytest.mark.parametrize("structure", ["dense", "two_sided"])
def test_projected_inner_products_are_unbiased(kind: str, structure: str) -> None:
    u, v = rand(12, 10, seed=1), rand(12, 10, seed=2)
    v = v + 0.5 * u  # correlated: a non-trivial <u, v>
    exact = float((u * v).sum())
    ranks = (4, 4) if structure == "two_sided" else (16,)
    est = estimates(
        lambda s: ProjectionForm((12, 10), structure=structure, kind=kind, seed=s, ranks=ranks),
        u,
        v,
        300,
    )
    # mean within 4 standard errors (the estimate's own spread) of the truth
    assert abs(float(est.mean()) - exact) < 4 * float(est.std()) / math.sqrt(est.numel())
    assert float(est.std()) > 0


def test_projection_error_shrinks_as_johnson_lindenstrauss() -> None:
    """Dense Gaussian: RMS error of <Pu, Pv> is sqrt((|u|^2|v|^2 + <u,v>^2) / r) (exact
    variance); at 4r it halves. Two-sided on a rank-1 gradient: quadrupling both ranks
    halves it too. Tolerances: the RMS over S seeds has relative spread ~1/sqrt(2S)."""
    S = 300
    u, v = rand(256, seed=3), rand(256, seed=4)
    exact = float(u @ v)
    sigma = lambda r: math.sqrt((float(u @ u) * float(v @ v) + exact**2) / r)  # noqa: E731
    tol = 4 / math.sqrt(2 * S)  # 4 standard errors of an RMS estimate
    rms = {}
    for r in (16, 64):
        est = estimates(
            lambda s, r=r: ProjectionForm(
                (256,), structure="dense", kind="gaussian", seed=s, ranks=(r,)
            ),
            u,
            v,
            S,
        )
        rms[r] = float(((est - exact) ** 2).mean().sqrt())
        assert abs(rms[r] / sigma(r) - 1) < tol, (r, rms[r], sigma(r))
    assert abs(rms[64] / rms[16] - 0.5) < 0.5 * 2 * tol

    x = torch.outer(rand(40, seed=5), rand(30, seed=6))  # one token: g a^T
    y = torch.outer(rand(40, seed=7), rand(30, seed=8)) + 0.3 * x
    exact = float((x * y).sum())
    err = {}
    for r in (3, 12):
        est = estimates(
            lambda s, r=r: ProjectionForm(
                (40, 30), structure="two_sided", kind="rademacher", seed=s, ranks=(r, r)
            ),
            x,
            y,
            S,
        )
        err[r] = float(((est - exact) ** 2).mean().sqrt())
    # each side's error ~ 1/sqrt(r_i); with both x4 the product's error roughly halves
    assert 0.35 < err[12] / err[3] < 0.65, err


def test_project_of_full_equals_projection_from_factors() -> None:
    f = padded_factors(3, 5, 8, 6, seed=10, scale=4.0)
    info = ParamInfo.of(f, name="w")
    for options in (
        {"dim": 16},
        {"dim": 16, "kind": "gaussian"},
        {"ranks": [3, 2]},
        {"dim": 10, "structure": "dense"},
    ):
        form = make_form({"form": "projection", **options}, info)
        stored = form.encode(f)["proj"]
        full = f.dense()
        torch.testing.assert_close(project(full, form.spec()), stored, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(project(full[1], form.spec()), stored[1], rtol=1e-10, atol=1e-12)
    two = make_form({"form": "projection", "ranks": [3, 2]}, info)
    assert isinstance(two, ProjectionForm)
    p0, p1 = two.matrices("cpu", D64)
    torch.testing.assert_close(two.project(full[0]), p0.T @ full[0] @ p1)  # P_out^T g P_in


def test_dense_projection_streams_blocks_like_the_cached_matrix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = rand(3, 50, seed=12)
    form = ProjectionForm((50,), structure="dense", kind="gaussian", seed=5, ranks=(6,), block=7)
    cached = form.project(g)
    (whole,) = form.matrices("cpu", torch.float32)
    assert whole.shape == (50, 6)
    torch.testing.assert_close(torch.cat([b for _, b in form.blocks()]), whole, rtol=0, atol=0)
    monkeypatch.setattr(forms_projection, "CACHE_ELEMENTS", 10)
    streamed = ProjectionForm.from_spec(form.spec())
    assert streamed.matrices("cpu", D64) == ()
    torch.testing.assert_close(streamed.project(g), cached, rtol=1e-12, atol=1e-12)


def test_projection_scaling_and_ranks() -> None:
    for kind in ("gaussian", "rademacher"):
        m = random_matrix(4000, 50, kind, 3).double()
        torch.testing.assert_close(
            (m * m).sum(1).mean(), torch.tensor(1.0, dtype=D64), rtol=0.02, atol=0
        )  # E[P P^T] = I: row norms^2 ~ 1
    assert balanced_ranks(1024, 256, 1024) == (32, 32)
    assert balanced_ranks(1024, 8, 1024) == (8, 128)
    assert balanced_ranks(5, 1, 1) == (1, 1)
    form = ProjectionForm.plan(ParamInfo((6, 5), name="x"), dim=10**6)
    assert form.dim <= 30


def test_projection_of_a_parameter_that_fits_in_dim_keeps_it_exact() -> None:
    """A ``dim`` at least a parameter's size gets ``full``: as many numbers, no noise (a
    square sign matrix can be singular), no matmul. Explicit ranks are kept."""
    x = ParamInfo((6, 5), name="x")
    for dim in (10**6, 30):
        assert isinstance(make_form({"form": "projection", "dim": dim}, x), FullForm), dim
    below = make_form({"form": "projection", "dim": 29}, x)
    assert isinstance(below, ProjectionForm) and below.dim <= 29
    bias = ParamInfo((3,), name="classifier.bias")
    assert isinstance(make_form("projection", bias), FullForm)
    asked = make_form({"form": "projection", "ranks": [3]}, bias)
    assert isinstance(asked, ProjectionForm) and asked.ranks == (3,)
    # never factors, though smaller here: they hold the first batch's tokens, no more
    few = ParamInfo((64, 96), "factors", 2, name="w")
    assert isinstance(make_form({"form": "projection", "dim": 320}, few), ProjectionForm)
    assert isinstance(make_form({"form": "projection", "dim": 64 * 96}, few), FullForm)
    # planned so for a whole run, beside parameters that are projected
    infos = {"w": ParamInfo((64, 96), name="w"), "b": ParamInfo((64,), name="b")}
    planned = plan_forms(infos, {"w": "projection", "b": "projection"})
    assert {n: f.name for n, f in planned.items()} == {"w": "projection", "b": "full"}


GOLDEN = {  # sha256[:16] of random_matrix(64, 32, kind, 7).numpy().tobytes(), torch 2.13
    "gaussian": "d8484bdfca125dd9",
    "rademacher": "d572286802494dd4",
}
_CHILD = """
import hashlib, sys
from gradlog.forms import random_matrix
for kind in ("gaussian", "rademacher"):
    m = random_matrix(64, 32, kind, 7)
    print(kind, hashlib.sha256(m.numpy().tobytes()).hexdigest()[:16])
"""


def test_projection_is_reproducible_across_processes_and_cpus() -> None:
    """The same seed gives the same matrices: here, in a fresh process, and in one forced to
    torch's non-vectorised CPU kernels (where float32 randn would differ); the golden values
    catch a change of torch's generator across versions."""
    here = {
        k: hashlib.sha256(random_matrix(64, 32, k, 7).numpy().tobytes()).hexdigest()[:16]
        for k in GOLDEN
    }
    assert here == GOLDEN
    assert torch.equal(random_matrix(9, 4, "gaussian", 1), random_matrix(9, 4, "gaussian", 1))
    for capability in (None, "default"):
        env = dict(os.environ)
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        out = subprocess.run(
            [sys.executable, "-c", _CHILD],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=120,
        ).stdout
        assert dict(line.split() for line in out.strip().splitlines()) == GOLDEN
    assert derive_seed(123, 2, 5) == 3083297125961104447
    assert param_seed(0, "blocks.0.attn.q.weight") == 8610725178200602627
    assert param_seed(0, "a") != param_seed(0, "b") != param_seed(1, "b")


# -- top-k ---------------------------------------------------------------------------------
@FORM_SETTINGS
@given(B=st.integers(1, 4), n=st.integers(1, 40), k=st.integers(1, 45), ties=st.booleans())
def test_topk_keeps_exactly_the_largest(B: int, n: int, k: int, ties: bool) -> None:
    g = rand(B, n, seed=n)
    if ties:  # few distinct magnitudes: ties at the cut
        g = torch.round(g * 2)
    form = TopKForm.plan(ParamInfo((n,)), k=k)
    assert form.k == min(k, n)
    enc = form.encode(g)
    idx, vals = enc["index"], enc["values"]
    assert torch.equal(vals, g.gather(1, idx))  # signed values at their indices
    for b in range(B):
        assert len(set(idx[b].tolist())) == form.k  # distinct entries
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[idx[b]] = False
        if dropped.any():
            assert vals[b].abs().min() >= g[b][dropped].abs().max()
        assert (vals[b].abs()[:-1] >= vals[b].abs()[1:]).all()  # decreasing magnitude


# -- errors --------------------------------------------------------------------------------
def test_errors_name_the_fix() -> None:
    info = ParamInfo((4, 3), "factors", 2, name="w")
    with pytest.raises(ConfigError) as e:
        make_form("sparse", info)
    assert str(list(FORMS)) in str(e.value)
    with pytest.raises(ConfigError, match="takes no option"):
        make_form({"form": "factors", "dim": 3}, info)
    with pytest.raises(ConfigError, match="dim= or ranks="):
        make_form({"form": "projection", "dim": 3, "ranks": [1, 1]}, info)
    with pytest.raises(StoreFormatError, match="this gradlog reads"):
        form_from_spec({"form": "auto", "shape": [4, 3]})
    with pytest.raises(StoreFormatError, match="generator version"):
        form_from_spec({**ProjectionForm.plan(info).spec(), "generator": 99})
    with pytest.raises(StoreFormatError, match="'tokens'"):
        form_from_spec({"form": "factors", "shape": [4, 3], "tokens": "many"})
    with pytest.raises(InputError, match="Plan the form"):
        FactorsForm((4, 3), 2).encode(rand(2, 4, 3))
    with pytest.raises(InputError, match="shape"):
        FullForm((4, 3)).encode(rand(2, 3, 4))
    with pytest.raises(InputError, match="projection's spec"):
        project(rand(4, 3), FullForm((4, 3)).spec())
    with pytest.raises(InputError, match="mask"):
        Factors(rand(2, 3, 4), rand(2, 3, 5), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ConfigError, match="needs tokens"):
        ParamInfo((4, 3), "factors")
    auto_form: Form = FORMS["auto"]((4, 3))
    with pytest.raises(ConfigError, match="only a request"):
        auto_form.encode(rand(2, 4, 3))


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        ({"form": "auto", "budget": 40, "min_projection_dim": "x"}, "min_projection_dim='x'"),
        ({"form": "auto", "min_projection_dim": True}, "min_projection_dim=True"),
        ({"form": "auto", "min_projection_dim": 0}, "min_projection_dim=0"),
        ({"form": "topk", "fraction": True}, "fraction=True"),
        ({"form": "topk", "fraction": "0.1"}, "fraction='0.1'"),
        ({"form": "projection", "structure": "dense", "dim": 4, "block": -1}, "block=-1"),
        ({"form": "projection", "structure": "dense", "dim": 4, "block": "7"}, "block='7'"),
        ({"form": "projection", "structure": "dense", "dim": 4, "block": True}, "block=True"),
        ({"form": "projection", "ranks": "4"}, "ranks='4'"),
        ({"form": "projection", "ranks": [2, True]}, r"ranks=\[2, True\]"),
        ({"form": "projection", "structure": "diagonal"}, "structure='diagonal'"),
    ],
)
def test_bad_form_options_are_config_errors(request_: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_form(request_, ParamInfo((4, 3), "factors", 2, name="w"))


def test_projection_shape_mismatch_names_parameter_and_fix() -> None:
    bias = ParamInfo((6,), name="fc.bias")
    with pytest.raises(ConfigError, match=r"ranks=\[2, 2\].*'fc\.bias'.*\(6,\).*dim="):
        make_form({"form": "projection", "ranks": [2, 2]}, bias)
    with pytest.raises(ConfigError, match=r"ranks=\[4\].*'w'.*\(4, 3\).*dim="):
        make_form({"form": "projection", "ranks": [4]}, ParamInfo((4, 3), name="w"))
    assert make_form({"form": "projection", "ranks": [4], "structure": "dense"},
                     ParamInfo((4, 3), name="w")).ranks == (4,)
    with pytest.raises(ConfigError, match=r"two_sided needs a parameter with >= 2 dimensions.*"
                                          r"'fc\.bias'.*structure='dense'"):
        make_form({"form": "projection", "dim": 4, "structure": "two_sided"}, bias)


def test_plan_forms_errors_name_the_parameter_and_the_fix() -> None:
    infos = {"w": ParamInfo((4, 3), "factors", 2, name="w"), "b": ParamInfo((4,), name="b")}
    request = {"form": "topk", "fraction": 2}
    with pytest.raises(ConfigError, match=r"parameter 'w' \(shape \(4, 3\)\).*fraction=2.*glob"):
        plan_forms(infos, {"w": request, "b": "full"})
    with pytest.raises(ConfigError, match=r"parameter 'b' of shape \(4,\).*first matching"):
        plan_forms(infos, {"w": "full", "b": {"form": "projection", "ranks": [2, 2]}},
                   budget_per_step=100, batch_size=1)


def test_rows_tokens_hint_says_which_tokens_to_raise() -> None:
    rows = Rows(torch.tensor([[0, 1, 2, 3, 4]]), rand(1, 5, 3), 8)
    info = ParamInfo((8, 3), "rows", 5, name="emb")
    requested = make_form({"form": "rows", "tokens": 2}, info)
    assert requested.requested_tokens == 2
    with pytest.raises(InputError, match=r"request's own 'tokens' option \(2; it wins"):
        requested.encode(rows)
    provisioned = make_form("rows", ParamInfo((8, 3), "rows", 2, name="emb"))
    assert provisioned.requested_tokens is None
    with pytest.raises(InputError, match=r"Plan with tokens= at least") as e:
        provisioned.encode(rows)
    assert "request's own" not in str(e.value)


@pytest.mark.parametrize("K", [1, 3])  # K 1: contracted; K 3 (N K > N + K): records formed
@pytest.mark.parametrize("p, q", [(6, 4), (3, 5)])  # both contraction orders
@pytest.mark.parametrize("dtype", [torch.float32, D64])
@pytest.mark.parametrize("numpy_path", [True, False])  # CPU products in numpy; torch (GPU)
def test_factors_inner_dense_equals_the_dense_computation(
    K: int, p: int, q: int, dtype: torch.dtype, numpy_path: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grads_inner, "MAX_ELEMENTS", 200)  # force several chunks
    monkeypatch.setattr(grads_inner, "_on_numpy", lambda *ts: numpy_path)
    f = padded_factors(7, 5, p, q, dtype=dtype, seed=6, scale=0.5)
    form = FactorsForm((p, q), tokens=5)
    enc = form.encode(f)
    w = rand(K, p, q, dtype=dtype, seed=7)
    torch.testing.assert_close(form.decode(enc), loop_dense(f), rtol=1e-5, atol=1e-5)
    # the oracle: the stored records formed and multiplied in float64
    dense = torch.bmm(enc["g"].double().transpose(1, 2), enc["a"].double()).reshape(7, -1)
    want = dense @ w.double().reshape(K, -1).T  # (7, K)
    got = form.inner_dense(enc, w)  # never below float64 whatever the storage
    assert got.dtype == D64 and got.shape == (7, K)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    one = form.inner_dense(enc, w[0].numpy())  # one gradient, numpy
    tol = 1e-12 * float(want.abs().max())
    torch.testing.assert_close(one[:, 0], want[:, 0], rtol=1e-12, atol=tol)
    # the contraction order the shapes pick and the other one give the same numbers
    other = grads_inner.factored_inner_dense(enc["a"], enc["g"], w.transpose(1, 2))
    torch.testing.assert_close(other, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


@pytest.mark.parametrize("method", ["factored", "materialised"])
@pytest.mark.parametrize("limit", [200, 1 << 25])  # several blocks mirrored; one whole Gram
@pytest.mark.parametrize("numpy_path", [True, False])
def test_factored_inner_with_itself_is_symmetric_and_exact(
    method: str, limit: int, numpy_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grads_inner, "MAX_ELEMENTS", limit)
    monkeypatch.setattr(grads_inner, "_on_numpy", lambda *ts: numpy_path)
    f = padded_factors(9, 4, 5, 3, seed=8).canonical()
    dense = loop_dense(f).reshape(9, -1)
    got = factored_inner(f.g, f.a, f.g, f.a, method=method)  # the same tensors: symmetric
    torch.testing.assert_close(got, dense @ dense.T, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, got.T)
    apart = factored_inner(f.g, f.a, f.g.clone(), f.a.clone(), method=method)  # not detected
    torch.testing.assert_close(apart, got, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("counts", [[3, 3, 3], [2, 4, 1, 2]])  # equal groups (views); padded
@pytest.mark.parametrize("p, q", [(6, 4), (3, 5)])
def test_factored_group_dots_pair_each_group_with_its_gradient(
    counts: list[int], p: int, q: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grads_inner, "MAX_ELEMENTS", 150)  # a few groups at a time
    f = padded_factors(9, 5, p, q, dtype=torch.float32, seed=9).canonical()
    w = rand(len(counts), p, q, dtype=torch.float32, seed=10)
    dense = torch.bmm(f.g.double().transpose(1, 2), f.a.double()).reshape(9, -1)
    group = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # (9,)
    want = (dense * w.double().reshape(len(counts), -1)[group]).sum(1)  # (9,)
    got = grads_inner.factored_group_dots(f.g, f.a, w, counts)
    assert got.dtype == D64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


# -- a factored form larger than full warns when planned (issue 20) ---------------------------
def test_factors_larger_than_full_warn_at_plan_time() -> None:
    import warnings

    info = ParamInfo((64, 96), "factors", tokens=512, name="blocks.0.mlp.weight")
    with pytest.warns(UserWarning, match=r"blocks\.0\.mlp\.weight.*13\.3x the bytes of form "
                      r"'full'.*form='full'.*'auto'.*projection"):
        form = make_form("factors", info)
    assert form.nbytes_per_record(4) == 512 * (64 + 96) * 4  # still what was asked for
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # below the break-even (38 rows), and auto: silent
        make_form("factors", ParamInfo((64, 96), "factors", tokens=38, name="w"))
        assert make_form("auto", info).name == "full"
        make_form("rows", ParamInfo((1000, 8), "rows", tokens=512, name="emb"))
    with pytest.warns(UserWarning, match=r"form 'rows' at 512 rows per datum"):
        make_form("rows", ParamInfo((100, 8), "rows", tokens=512, name="emb"))


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 6),
    kinds=st.lists(st.sampled_from(["small", "small16", "wide", "factors", "rows", "f64",
                                    "empty"]), min_size=1, max_size=8),
    forms=st.lists(st.sampled_from(["norm", "full", "topk", "projection"]), min_size=8,
                   max_size=8),
    seed=st.integers(0, 1000),
    stack=st.sampled_from([1, 20, 1 << 20]),  # elements stacked at once
)
def test_a_steps_encoding_gives_each_record_its_own_exact_norm(
        B: int, kinds: list[str], forms: list[str], seed: int, stack: int) -> None:
    """planning.encode (small dense records' norms stacked, others one by one) against each
    record's naive float64 norm and its form's own encoding, over mixed materials, shapes,
    dtypes and forms."""
    import gradlog.grads.norms as norms_module
    from gradlog import planning

    gen = torch.Generator().manual_seed(seed)
    materials: dict[str, Any] = {}
    dense: dict[str, torch.Tensor] = {}
    made: dict[str, Form] = {}
    for i, kind in enumerate(kinds):
        name = f"p{i}.{kind}"
        if kind in ("factors", "rows"):
            shape: tuple[int, ...] = (5, 3)
        else:
            shape = {"wide": (130, 130), "f64": (4,), "empty": (4, 0)}.get(kind, (3, 1 + i % 3))
        if kind == "factors":
            g, a = torch.randn(B, 4, 5, generator=gen), torch.randn(B, 4, 3, generator=gen)
            materials[name] = Factors(g, a)
            dense[name] = torch.einsum("bnp,bnq->bpq", g.double(), a.double())
        elif kind == "rows":
            index = torch.randint(-1, 5, (B, 4), generator=gen)
            r = Rows(index, torch.randn(B, 4, 3, generator=gen), 5)
            materials[name], dense[name] = r, r.dense().double()
        else:
            dtype = {"small16": torch.float16, "f64": D64}.get(kind, torch.float32)
            x = torch.randn(B, *shape, generator=gen).to(dtype)
            materials[name], dense[name] = x, x.double()
        request = {"topk": {"form": "topk", "k": 2},
                   "projection": {"form": "projection", "dim": 8}}.get(forms[i], forms[i])
        made[name] = make_form(request, ParamInfo.of(materials[name], name=name))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norms_module, "_STACK_ELEMENTS", stack)
        arrays, norms = planning.encode(made, materials)
    assert list(norms) == list(materials)
    for name, material in materials.items():
        want = dense[name].reshape(B, -1).square().sum(1).sqrt()
        assert norms[name].dtype == D64 and norms[name].shape == (B,)
        # dense records: float64 rounding only; factors and rows: of their float32 gradients
        rtol = 1e-13 if isinstance(material, torch.Tensor) else 1e-6
        torch.testing.assert_close(norms[name], want, rtol=rtol, atol=0)
        own = made[name].encode(material)  # (factors: projected by another way, joint)
        assert sorted(arrays[name]) == sorted(own)
        for key, value in own.items():
            torch.testing.assert_close(arrays[name][key], value, rtol=rtol * 10, atol=rtol)


@pytest.mark.parametrize(("p", "q", "B"), [(64, 16, 3), (16, 64, 8), (33, 7, 1), (1, 5, 2),
                                           (3, 300, 4)])
def test_two_sided_projections_of_dense_records_are_matmuls_of_both_sides(
        p: int, q: int, B: int) -> None:
    """The mm and bmm spelt out in ProjectionForm._two_sided_dense (fewer dispatcher calls)
    against matmul of the two sides in either order (exact: the same products), and the
    float64 projection (to rounding)."""
    g = rand(B, p, q, dtype=torch.float32, seed=p * q + B)
    form = ProjectionForm.plan(ParamInfo.of(g), dim=64)  # (also where dim clamps to p q)
    assert form.structure == "two_sided"
    p0, p1 = form.matrices(g.device, torch.float32)
    got = form.encode(g)["proj"]
    r0, r1 = form.ranks
    cheaper_right = p * q * r1 + p * r1 * r0 <= r0 * p * q + r0 * q * r1
    want = p0.T @ (g @ p1) if cheaper_right else (p0.T @ g) @ p1
    torch.testing.assert_close(got.reshape(B, r0, r1), want, rtol=0, atol=0)
    wide = p0.double().T @ g.double() @ p1.double()
    torch.testing.assert_close(got.reshape(B, r0, r1).double(), wide, rtol=1e-5, atol=1e-5)
