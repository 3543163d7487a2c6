"""Every gradlog reads every golden store of every format version it ever wrote.

The golden stores under ``tests/golden/`` were written by the gradlog that introduced their
format version (``tests/golden/make_golden.py``) and are never regenerated. Their expected
values were read back at that time; here they must come back bit for bit, and agree with an
independent per-datum computation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gradlog
from gradlog.store.format import FORMAT_VERSION

GOLDEN = Path(__file__).resolve().parent / "golden"
STORES = sorted(GOLDEN.glob("v*.store"))
# Largest relative error of one element, by storage dtype (FORMAT.md section 4.2), plus the
# float32 rounding of the (float64) model's per-datum gradients.
TOLERANCE = {"float32": 2e-7, "bfloat16": 2.0**-8, "bitround9": 2.0**-10}


def _version(store: Path) -> int:
    return int(store.name[1:].split(".")[0].split("-")[0])


def _expected(store: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(store.with_suffix(".expected.json").read_text())
    return data


def test_there_is_a_golden_store_per_version() -> None:
    versions = sorted({_version(p) for p in STORES})
    assert versions == list(range(1, FORMAT_VERSION + 1))
    assert {p.name for p in STORES} >= {"v2-bfloat16.store", "v2-bitround9.store"}


@pytest.mark.parametrize("store", STORES, ids=[p.name for p in STORES])
def test_golden_store_reads_back_exactly(store: Path, tmp_path: Path) -> None:
    copy = tmp_path / store.name  # never let a reader touch the fixture itself
    shutil.copytree(store, copy)
    exp = _expected(store)
    run = gradlog.open(copy)
    assert run.format_version == exp["format_version"]
    assert run.attrs["config_hash"] == exp["config_hash"]
    assert run.params.to_pylist() == exp["params"]
    steps = run.steps.drop_columns(["time_compute_s", "time_write_s"]).to_pylist()
    assert steps == exp["steps"]
    assert run.datums.to_pylist() == exp["records"]
    forms = dict(zip(run.param_names, run.params.column("form").to_pylist()))
    for name, values in exp["grads"].items():
        if values is None:  # form 'norm': no gradient kept, and grads() says so
            with pytest.raises(gradlog.errors.SelectionError, match="norms"):
                run.grads(name)
            continue
        got = _grads(run, name, forms[name])
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(values, dtype=np.float32))
    # ... and what the store holds is what a naive per-datum autograd says
    from tests.golden.make_golden import CALLS, _data, _model

    rtol = TOLERANCE[run.attrs["config"]["dtype"]]
    model, (x, y) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    named = dict(model.named_parameters())
    prev = None
    for step, ids in CALLS:
        if prev is not None and step != prev:
            opt.step()  # replay the optimizer as the run did
            opt.zero_grad()
        for datum in ids:
            loss = ((model(x[datum : datum + 1]) - y[datum : datum + 1]) ** 2).sum()
            grads = torch.autograd.grad(loss, list(named.values()))
            assert run.records(step=step, datum=datum).num_rows == 1
            for (name, _), g in zip(named.items(), grads):
                _check_against(run, name, forms[name], step, datum, g, rtol)
        batch_loss = ((model(x[ids]) - y[ids]) ** 2).sum(1).mean()
        batch_loss.backward()
        prev = step


def _grads(run: gradlog.Run, name: str, form: str, **select: Any) -> np.ndarray:
    if form == "projection":
        with pytest.warns(UserWarning, match="projected vectors"):
            return np.asarray(run.grads(name, **select))
    return np.asarray(run.grads(name, **select))


def _check_against(
    run: gradlog.Run, name: str, form: str, step: int, datum: int, g: torch.Tensor, rtol: float
) -> None:
    """A stored record against the datum's autograd gradient ``g``, by its form."""
    norm = run.norms(name, step=step, datum=datum).column("norm").to_pylist()[0]
    np.testing.assert_allclose(norm, float(g.norm()), rtol=1e-6)  # exact in every form
    if form == "norm":
        return
    run.__dict__.pop("_projection_warned", None)
    got = _grads(run, name, form, step=step, datum=datum, dtype=np.float64)[0]
    if form == "projection":  # the stored projection of the gradient
        want = run.project(name, g.float()).double().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    elif form == "topk":  # the k largest entries, zero elsewhere
        flat = g.flatten().numpy()
        k = int(np.count_nonzero(got))
        keep = np.argsort(-np.abs(flat), kind="stable")[:k]
        want = np.zeros_like(flat)
        want[keep] = flat[keep]
        np.testing.assert_allclose(got.flatten(), want, rtol=rtol, atol=1e-7)
    else:
        np.testing.assert_allclose(got, g.numpy(), rtol=rtol, atol=1e-7)
