"""Projections of a group of records of one shape taken in one pass (gradlog.forms.grouped):
each record keeps its own projection and exact norm, against the float64 oracle (its
per-datum gradients formed in float64, projected with its own seeded matrices) and against
the record encoded alone; the forms' matrices stay theirs; groups never mix what differs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradlog.forms.grouped as grouped
from gradlog import planning
from gradlog.forms import ParamInfo, ProjectionForm, form_from_spec
from gradlog.grads import Factors

D64 = torch.float64


def _factors(k: int, B: int, N: int, p: int, q: int, *, seed: int, scale: float = 1.0,
             narrow: torch.dtype | None = None) -> list[Factors]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        g, a = torch.randn(B, N, p, generator=gen), torch.randn(B, N, q, generator=gen)
        if narrow is not None:  # held in 16 bits, as the hooks backend keeps them under autocast
            g, a = g.to(narrow), a.to(narrow)
        out.append(Factors(g, a, scale=scale, narrow=narrow))
    return out


def _form(material: Any, name: str, dim: int = 64) -> ProjectionForm:
    # (planned as a projection even where dim holds the gradient itself, a square case)
    return ProjectionForm.plan(ParamInfo.of(material, name=name), dim=dim)


def _oracle(form: ProjectionForm, f: Factors) -> tuple[torch.Tensor, torch.Tensor]:
    """Datum b's projection ``P0^T G_b P1`` and squared norm from its gradient in float64."""
    g, a = (t.double() for t in f.held)
    grad = f.scale * torch.einsum("bnp,bnq->bpq", g, a)  # (B, p, q)
    p0, p1 = (m.double() for m in form.matrices("cpu", torch.float32))
    return p0.T @ grad @ p1, grad.reshape(grad.shape[0], -1).square().sum(1)


@pytest.mark.parametrize(("B", "N", "p", "q", "dim", "factored"), [
    (3, 4, 16, 24, 64, True), (1, 3, 12, 12, 144, True),
    (2, 6, 40, 8, 32, False),  # (the gradients formed, their norms and projections from them)
])
@pytest.mark.parametrize("narrow", [None, torch.bfloat16], ids=["float32", "bf16-held"])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_a_groups_projections_and_norms_are_each_records_own(
        B: int, N: int, p: int, q: int, dim: int, factored: bool, narrow: torch.dtype | None,
        scale: float) -> None:
    fs = _factors(5, B, N, p, q, seed=B * p + q, scale=scale, narrow=narrow)
    forms = [_form(f, f"layer{i}.weight", dim) for i, f in enumerate(fs)]
    keys = {grouped.group_key(form, f) for form, f in zip(forms, fs)}
    assert len(keys) == 1 and None not in keys
    assert forms[0].factored_is_cheaper(fs[0]) == factored  # (the route these shapes take)
    got = grouped.encode_factors(forms, fs)
    assert len(got) == len(fs)
    for form, f, (enc, squares) in zip(forms, fs, got):
        alone, alone_squares = form.encode_with_norms(f)
        assert enc["proj"].shape == (B, *form.ranks) and enc["proj"].dtype == torch.float32
        assert squares.shape == (B,) and squares.dtype == D64
        torch.testing.assert_close(enc["proj"], alone["proj"], rtol=1e-5, atol=1e-5)
        # (formed gradients are float32: their rounding may follow the group's blocking)
        torch.testing.assert_close(squares, alone_squares, rtol=1e-12 if factored else 5e-7,
                                   atol=0)
        want, want_squares = _oracle(form, f)
        torch.testing.assert_close(enc["proj"].double(), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(squares, want_squares, rtol=1e-6, atol=1e-300)


@pytest.mark.parametrize("factored", [True, False])
def test_a_group_goes_a_bounded_share_at_a_time(monkeypatch: pytest.MonkeyPatch,
                                               factored: bool) -> None:
    """The concatenated factors (or the gradients formed from them) are bounded by
    MAX_ELEMENTS (a 7B model's q/k/v/o records of a step would otherwise be copied whole):
    7 records, 3 a pass, the seventh alone."""
    N, p, q, dim = (3, 8, 8, 16) if factored else (6, 40, 8, 32)
    fs = _factors(7, 2, N, p, q, seed=1)
    forms = [_form(f, f"w{i}", dim) for i, f in enumerate(fs)]
    assert forms[0].factored_is_cheaper(fs[0]) == factored
    whole = grouped.encode_factors(forms, fs)
    passes: list[int] = []
    real = grouped.torch.cat

    def counted(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(tensors, *args, **kwargs)
        passes.append(out.shape[0])
        return out

    monkeypatch.setattr(grouped.torch, "cat", counted)
    monkeypatch.setattr(grouped, "MAX_ELEMENTS", 3 * 2 * (N * (p + q) if factored else p * q))
    parts = grouped.encode_factors(forms, fs)
    monkeypatch.undo()
    # g and a of two passes of 3 records; the seventh alone (its own path may cat its parts)
    assert passes[:4] == [6, 6, 6, 6] and 6 not in passes[4:]
    for (x, sx), (y, sy) in zip(parts, whole):
        torch.testing.assert_close(x["proj"], y["proj"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sx, sy, rtol=1e-12, atol=0)


def test_vectors_of_a_group_are_projected_each_with_its_own_matrix() -> None:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 48, generator=gen) for _ in range(6)]
    forms = [_form(x, f"ln{i}.weight", 32) for i, x in enumerate(xs)]
    assert all(f.structure == "dense" for f in forms)
    assert len({grouped.group_key(f, x) for f, x in zip(forms, xs)}) == 1
    got = grouped.project_vectors(forms, xs)
    for form, x, enc in zip(forms, xs, got):
        torch.testing.assert_close(enc["proj"], form.encode(x)["proj"], rtol=1e-6, atol=1e-6)
        (mat,) = form.matrices("cpu", torch.float32)
        torch.testing.assert_close(enc["proj"].double(), x.double() @ mat.double(),
                                   rtol=1e-5, atol=1e-5)


def test_grouping_keeps_each_forms_matrices_once_in_memory() -> None:
    """The stacked matrices are the forms' own (as their specs regenerate them), and each
    form's cached matrices become views into the stack: no second copy."""
    fs = _factors(3, 2, 3, 16, 8, seed=4)
    forms = [_form(f, f"w{i}", 16) for i, f in enumerate(fs)]
    grouped.encode_factors(forms, fs)
    grouped.encode_factors(forms, fs)  # (the stack made once, then reused)
    (stacks, members), = forms[0].stacks.values()
    assert members == tuple(forms)
    for form in forms:
        fresh = form_from_spec(form.spec())
        assert isinstance(fresh, ProjectionForm)
        for mine, stacked, theirs in zip(form.matrices("cpu", torch.float32), stacks,
                                         fresh.matrices("cpu", torch.float32)):
            assert torch.equal(mine, theirs)
            assert mine.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()


def test_what_differs_is_never_grouped() -> None:
    """Masked factors (their padding zeroed first), other ranks, other shapes, scales or
    dtypes, rows and dense matrices: each its own key, or alone (None)."""
    f = _factors(1, 2, 3, 16, 8, seed=0)[0]
    form = _form(f, "w", 16)
    key = grouped.group_key(form, f)
    assert key is not None
    masked = Factors(f.g, f.a, torch.ones(2, 3, dtype=torch.bool))
    assert grouped.group_key(form, masked) is None
    assert grouped.group_key(_form(f, "w", 32), f) != key  # other ranks
    assert grouped.group_key(form, Factors(f.g, f.a, scale=2.0)) != key
    assert grouped.group_key(form, Factors(f.g.double(), f.a.double())) != key
    dense = torch.randn(2, 16, 8)
    assert grouped.group_key(_form(dense, "d", 16), dense) is None  # (a matrix: alone)
    x = torch.randn(2, 20)
    assert grouped.group_key(_form(x, "v", 8), x) != grouped.group_key(
        _form(torch.randn(2, 21), "u", 8), torch.randn(2, 21))


def test_a_steps_encoding_keeps_the_parameters_order_with_groups() -> None:
    """planning.encode hands arrays and norms in the materials' order, whatever it groups,
    each as the record's own encoding gives it."""
    fs = _factors(3, 2, 3, 16, 8, seed=7)
    xs = [torch.randn(2, 12, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    materials: dict[str, Any] = {"v0": xs[0], "f0": fs[0], "v1": xs[1], "f1": fs[1],
                                 "f2": fs[2], "v2": xs[2].double()}
    forms = {n: _form(m, n, 16) for n, m in materials.items()}
    arrays, norms = planning.encode(forms, materials)
    assert list(arrays) == list(materials) and list(norms) == list(materials)
    for name, material in materials.items():
        alone, squares = forms[name].encode_with_norms(material)
        torch.testing.assert_close(arrays[name]["proj"], alone["proj"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(norms[name], squares.sqrt(), rtol=1e-12, atol=0)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(st.tuples(
        st.sampled_from(["factors", "factors16", "masked", "vector", "vector64", "matrix"]),
        st.sampled_from([(6, 4), (4, 6), (9, 3)]),  # (p, q); a vector's size is p * q
        st.sampled_from([1.0, 0.5]),  # factors' scale
        st.sampled_from([8, 16, 54])), min_size=1, max_size=10),  # dim
    B=st.integers(1, 3),
    N=st.integers(1, 5),
    bound=st.sampled_from([40, 400, 1 << 25]),  # MAX_ELEMENTS: groups cut into shares
    seed=st.integers(0, 1000),
)
def test_a_steps_projections_are_each_records_own_whatever_groups_form(
        records: list[tuple[str, tuple[int, int], float, int]], B: int, N: int, bound: int,
        seed: int) -> None:
    """Mixed steps (factors of several shapes, scales and dims, held in 16 bits or masked,
    vectors in two dtypes, dense matrices), groups cut into shares of any size: every
    record's projection and exact norm as its form gives them alone."""
    gen = torch.Generator().manual_seed(seed)
    materials: dict[str, Any] = {}
    forms: dict[str, ProjectionForm] = {}
    for i, (kind, (p, q), scale, dim) in enumerate(records):
        name = f"p{i}.{kind}"
        if kind.startswith("factors") or kind == "masked":
            g, a = torch.randn(B, N, p, generator=gen), torch.randn(B, N, q, generator=gen)
            narrow = torch.bfloat16 if kind == "factors16" else None
            if narrow is not None:
                g, a = g.to(narrow), a.to(narrow)
            mask = torch.rand(B, N, generator=gen) > 0.3 if kind == "masked" else None
            materials[name] = Factors(g, a, mask, scale=scale, narrow=narrow)
        elif kind.startswith("vector"):
            x = torch.randn(B, p * q, generator=gen)
            materials[name] = x.double() if kind == "vector64" else x
        else:
            materials[name] = torch.randn(B, p, q, generator=gen)
        forms[name] = _form(materials[name], name, dim)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grouped, "MAX_ELEMENTS", bound)
        arrays, norms = planning.encode(forms, materials)
    assert list(arrays) == list(materials) and list(norms) == list(materials)
    for name, material in materials.items():
        alone, squares = forms[name].encode_with_norms(material)
        torch.testing.assert_close(arrays[name]["proj"], alone["proj"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(norms[name], squares.sqrt(), rtol=5e-7, atol=1e-300)
