"""Store tests: what is written is what an independent computation says, and FORMAT.md holds.

Expected values never come from gradlog: per-datum gradients are recomputed by a naive
per-datum forward + ``torch.autograd.grad``, norms by numpy, layouts from FORMAT.md's rules
written out by hand. Every store written here is validated with ``validate_store``.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator, ValidationError
from torch import nn

import gradlog
from gradlog import errors
from gradlog.store.format import FORMAT_VERSION, array_path
from gradlog.testing.schemas import SCHEMAS, load_schema, validate_store

D_IN, D_OUT, N_DATA = 3, 2, 64


# -- helpers ----------------------------------------------------------------------------------
def _mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, 4), nn.Tanh(), nn.Linear(4, D_OUT)).to(dtype)


def _dataset(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(N_DATA, D_IN, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randn(N_DATA, D_OUT, generator=gen, dtype=torch.float64).to(dtype)
    return x, y


def _losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum(1)  # (B,)


def _oracle(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per-datum losses and gradients by one forward and one autograd.grad per datum, in
    float64, on a float64 copy of the model (so the result does not depend on gradlog)."""
    ref = _mlp_like(model)
    named = dict(ref.named_parameters())
    losses, grads = [], {n: [] for n in named}
    for b in range(len(x)):
        xb, yb = x[b : b + 1].double(), y[b : b + 1].double()
        loss = ((ref(xb) - yb) ** 2).sum()
        gs = torch.autograd.grad(loss, list(named.values()))
        losses.append(loss.item())
        for n, g in zip(named, gs):
            grads[n].append(g.numpy().copy())
    return np.array(losses), {n: np.stack(v) for n, v in grads.items()}


def _mlp_like(model: nn.Module) -> nn.Module:
    ref = _mlp(torch.float64)
    ref.load_state_dict({k: v.detach().double() for k, v in model.state_dict().items()})
    return ref


@dataclass
class Expected:
    """What the run must hold, computed independently while training."""

    records: list[dict[str, Any]] = field(default_factory=list)  # in write order
    grads: dict[str, list[np.ndarray]] = field(default_factory=dict)
    step_grads: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # p.grad

    def grad(self, name: str) -> np.ndarray:
        return np.stack(self.grads[name])


def _train(
    path: Path,
    calls: Sequence[tuple[int, Sequence[int]]],
    *,
    dtype: str = "float64",
    model_dtype: torch.dtype = torch.float64,
    batch_reduction: str = "mean",
    lr: float | None = 0.1,
    **kwargs: Any,
) -> Expected:
    """Train an MLP on ``calls`` = [(step, datum_ids), ...] while recording; a repeated step
    accumulates micro-batches. Returns the independently computed expectation."""
    model = _mlp(model_dtype)
    x_all, y_all = _dataset(model_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exp = Expected(grads={n: [] for n, _ in model.named_parameters()})
    prev: int | None = None
    micro = 0
    with gradlog.GradRecorder(
        model, path, backend="loop", dtype=dtype, batch_reduction=batch_reduction, **kwargs
    ) as rec:
        for step, ids in calls:
            if prev is not None and step != prev:
                exp.step_grads[prev] = {
                    n: p.grad.double().numpy().copy() for n, p in model.named_parameters()
                }
                opt.step()
                opt.zero_grad()
                micro = 0
            x, y = x_all[list(ids)], y_all[list(ids)]
            losses, grads = _oracle(model, x, y)
            rec.backward(_losses(model, x, y), datum_ids=list(ids), step=step, lr=lr)
            weight = 1.0 / len(ids) if batch_reduction == "mean" else 1.0
            for b, datum in enumerate(ids):
                exp.records.append(
                    {
                        "step": step,
                        "micro": micro,
                        "datum_id": datum,
                        "loss": losses[b],
                        "weight": weight,
                        "lr": lr,
                    }
                )
                for n, g in grads.items():
                    exp.grads[n].append(g[b])
            micro += 1
            prev = step
        if prev is not None:
            exp.step_grads[prev] = {
                n: p.grad.double().numpy().copy() for n, p in model.named_parameters()
            }
    return exp


def _reopen(path: Path) -> gradlog.Run:
    validate_store(path)
    return gradlog.open(path)


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _rows_by_rule(sizes: Sequence[int]) -> list[list[int]]:
    """Rows of each backward call, written out from FORMAT.md section 4 (version 2): shards
    hold ``c`` = the first call's size rows, and every call starts at a shard boundary."""
    c, start, out = sizes[0], 0, []
    for n in sizes:
        out.append(list(range(start, start + n)))
        start = -(-(start + n) // c) * c
    return out


def _edit_root_attrs(path: Path, edit: Any) -> None:
    meta_file = path / "zarr.json"
    meta = json.loads(meta_file.read_text())
    edit(meta["attributes"])
    meta_file.write_text(json.dumps(meta))


# -- array paths --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("0.weight", "grads/0.weight"),
        ("blocks.0.attn-qkv_w", "grads/blocks.0.attn-qkv_w"),
        ("a/b", "grads/a%2Fb"),
        ("a b", "grads/a%20b"),
        ("50%", "grads/50%25"),
        ("naïve.w", "grads/na%C3%AFve.w"),
        ("__priv.weight", "grads/%5F_priv.weight"),
        ("_one.weight", "grads/_one.weight"),
        (".hidden", "grads/%2Ehidden"),
        ("..", "grads/%2E."),
        ("../../etc", "grads/%2E.%2F..%2Fetc"),
    ],
)
def test_array_path_follows_the_spec(name: str, path: str) -> None:
    assert array_path(name) == path


# -- round trip -------------------------------------------------------------------------------
CALLS = [(0, _ids(0, 5)), (1, _ids(5, 5)), (2, _ids(10, 3)), (3, _ids(13, 7))]


def test_round_trip_float64_equals_naive_per_datum_grads(tmp_store: Path) -> None:
    exp = _train(tmp_store, CALLS, dtype="float64")
    run = _reopen(tmp_store)
    assert run.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for name in run.param_names:
        got = run.grads(name, dtype=np.float64)
        assert got.shape == exp.grad(name).shape
        np.testing.assert_allclose(got, exp.grad(name), rtol=1e-12, atol=1e-14)
    table = run.datums
    assert table.column("datum_id").to_pylist() == [r["datum_id"] for r in exp.records]
    assert table.column("step").to_pylist() == [r["step"] for r in exp.records]
    rows = _rows_by_rule([len(ids) for _, ids in CALLS])
    assert table.column("row").to_pylist() == [r for call in rows for r in call]
    np.testing.assert_allclose(table.column("loss"), [r["loss"] for r in exp.records], rtol=1e-12)
    np.testing.assert_allclose(table.column("weight"), [r["weight"] for r in exp.records])
    assert table.column("lr").to_pylist() == [0.1] * len(exp.records)


def test_float32_storage_is_the_float32_cast(tmp_store: Path) -> None:
    exp = _train(tmp_store, CALLS, dtype="float32")
    run = _reopen(tmp_store)
    for name in run.param_names:
        arr = zarr.open_array(str(tmp_store / array_path(name)), mode="r")
        assert arr.dtype == np.float32
        got = run.grads(name, dtype=np.float32)
        np.testing.assert_array_max_ulp(got, exp.grad(name).astype(np.float32), maxulp=1)
        # norms are exact: computed in float64 before the cast
        norms = np.linalg.norm(exp.grad(name).reshape(len(got), -1), axis=1)
        np.testing.assert_allclose(run.datums.column(f"norm/{name}"), norms, rtol=1e-12)
    assert run.params.column("dtype").to_pylist() == ["float32"] * 4


@pytest.mark.parametrize("batch_reduction", ["mean", "sum"])
def test_weighted_sum_of_records_is_p_grad(tmp_store: Path, batch_reduction: str) -> None:
    calls = [(0, _ids(0, 4)), (0, _ids(4, 3)), (1, _ids(7, 5))]
    exp = _train(tmp_store, calls, batch_reduction=batch_reduction)
    run = _reopen(tmp_store)
    for step, p_grad in exp.step_grads.items():
        weights = np.asarray(run.records(step=step).column("weight"))
        for name, expected in p_grad.items():
            g = run.grads(name, step=step, dtype=np.float64)
            np.testing.assert_allclose(np.tensordot(weights, g, axes=1), expected, rtol=1e-10)


def test_variable_batch_sizes(tmp_store: Path) -> None:
    _train(tmp_store, CALLS)
    run = _reopen(tmp_store)
    steps = run.steps.to_pylist()
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert [s["n_records"] for s in steps] == [5, 5, 3, 7]
    assert [s["first_row"] for s in steps] == [0, 5, 10, 15]  # 13 rounded up to a shard
    assert [s["n_micro"] for s in steps] == [1, 1, 1, 1]
    assert [s["tokens"] for s in steps] == [5, 5, 3, 7]
    assert [s["lr"] for s in steps] == [0.1] * 4
    rows = run.datums.to_pylist()
    for s in steps:
        mine = [r for r in rows if r["step"] == s["step"]]
        assert [r["row"] for r in mine] == list(range(s["first_row"], s["first_row"] + len(mine)))
        assert s["loss_mean"] == pytest.approx(np.mean([r["loss"] for r in mine]), rel=1e-12)
    assert run.grads("0.weight", step=3).shape == (7, 4, 3)


def test_gradient_accumulation_is_one_step_with_micro_batches(tmp_store: Path) -> None:
    calls = [(0, _ids(0, 4)), (0, _ids(4, 3)), (1, _ids(7, 2))]
    exp = _train(tmp_store, calls)
    run = _reopen(tmp_store)
    assert run.datums.column("micro").to_pylist() == [0] * 4 + [1] * 3 + [0] * 2
    np.testing.assert_allclose(run.datums.column("weight"), [1 / 4] * 4 + [1 / 3] * 3 + [1 / 2] * 2)
    steps = run.steps.to_pylist()
    assert [(s["step"], s["n_records"], s["n_micro"], s["first_row"]) for s in steps] == [
        (0, 7, 2, 0),
        (1, 2, 1, 8),  # shards of 4 rows: micro 1 took rows 4..6, step 1 starts at 8
    ]
    assert run.datums.column("row").to_pylist() == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert sorted(p.name for p in (tmp_store / "index").iterdir()) == [
        "step-000000000000-000000.parquet",
        "step-000000000000-000001.parquet",
        "step-000000000001-000000.parquet",
    ]
    assert sorted(p.name for p in (tmp_store / "steps").iterdir()) == [
        "step-000000000000.parquet",
        "step-000000000001.parquet",
    ]
    np.testing.assert_allclose(run.grads("2.weight", step=0), exp.grad("2.weight")[:7], rtol=1e-6)


# -- selection ----------------------------------------------------------------------------------
SEL_CALLS = [(0, [3, 1, 4]), (2, [1, 5, 9, 2]), (4, [6, 5]), (6, [3, 5, 8])]


@pytest.fixture
def sel_run(tmp_store: Path) -> tuple[gradlog.Run, Expected]:
    exp = _train(tmp_store, SEL_CALLS, lr=None)
    return _reopen(tmp_store), exp


@pytest.mark.parametrize(
    ("step", "datum", "keep"),
    [
        (2, None, lambda s, d: s == 2),
        ([0, 6], None, lambda s, d: s in (0, 6)),
        (range(2, 7, 2), None, lambda s, d: s in (2, 4, 6)),  # a range lists steps
        (slice(2, 5), None, lambda s, d: 2 <= s < 5),
        (slice(4, None), None, lambda s, d: s >= 4),
        (None, 5, lambda s, d: d == 5),
        (None, [3, 9], lambda s, d: d in (3, 9)),
        ([2, 6], [5, 8], lambda s, d: s in (2, 6) and d in (5, 8)),
        (None, slice(3, 6), lambda s, d: 3 <= d < 6),  # datum ids 3, 4, 5
        (slice(2, None), slice(None, 5), lambda s, d: s >= 2 and d < 5),
        (None, slice(100, 200), lambda s, d: False),  # a range of ids, like a step slice
        (torch.tensor(2), torch.tensor(5), lambda s, d: s == 2 and d == 5),  # 0-d tensors
        (np.array(4), np.int64(6), lambda s, d: s == 4 and d == 6),  # 0-d array, numpy int
        (torch.tensor([0, 6]), np.array([3, 5]), lambda s, d: s in (0, 6) and d in (3, 5)),
        (None, None, lambda s, d: True),
    ],
)
def test_selection(sel_run: tuple[gradlog.Run, Expected], step: Any, datum: Any, keep: Any) -> None:
    run, exp = sel_run
    want = [i for i, r in enumerate(exp.records) if keep(r["step"], r["datum_id"])]
    records = run.records(step=step, datum=datum).to_pylist()
    assert [(r["step"], r["datum_id"]) for r in records] == [
        (exp.records[i]["step"], exp.records[i]["datum_id"]) for i in want
    ]
    assert all(r["lr"] is None for r in records)
    for name in run.param_names:
        got = run.grads(name, step=step, datum=datum, dtype=np.float64)
        np.testing.assert_allclose(got, exp.grad(name)[want], rtol=1e-12, atol=1e-14)
    torch_grads = run.grads("0.bias", step=step, datum=datum, as_torch=True)
    assert isinstance(torch_grads, torch.Tensor) and torch_grads.shape == (len(want), 4)


def test_norms_equal_numpy_norms_of_grads(sel_run: tuple[gradlog.Run, Expected]) -> None:
    run, _ = sel_run
    norms = run.norms()
    assert norms.num_rows == run.datums.num_rows * len(run.param_names)
    for name in run.param_names:
        g = run.grads(name, dtype=np.float64)
        mine = norms.filter(np.asarray(norms.column("param")) == name)
        assert mine.column("row").to_pylist() == run.datums.column("row").to_pylist()
        np.testing.assert_allclose(
            mine.column("norm"), np.linalg.norm(g.reshape(len(g), -1), axis=1), rtol=1e-12
        )
    one = run.norms("2.bias", step=4)
    assert one.column("datum_id").to_pylist() == [6, 5]


def test_params_table(sel_run: tuple[gradlog.Run, Expected]) -> None:
    run, _ = sel_run
    model = _mlp()
    assert run.params.to_pylist() == [
        {"name": n, "shape": list(p.shape), "numel": p.numel(), "dtype": "float64", "form": "full"}
        for n, p in model.named_parameters()
    ]


def test_unknown_selections_raise_selection_error_with_nearby_values(
    sel_run: tuple[gradlog.Run, Expected],
) -> None:
    run, _ = sel_run
    with pytest.raises(errors.SelectionError, match=r"0\.weight"):
        run.grads("0.weigth")
    with pytest.raises(errors.SelectionError, match=r"step 3 .*2, 4"):
        run.grads("0.bias", step=3)
    with pytest.raises(errors.SelectionError, match=r"step 7 .*6"):
        run.records(step=[0, 7])
    with pytest.raises(errors.SelectionError, match=r"datum 7 .*6, 8"):
        run.grads("0.bias", datum=7)
    with pytest.raises(errors.SelectionError, match=r"datum 4 .*at the selected steps"):
        run.records(step=2, datum=4)
    with pytest.raises(LookupError):  # the builtin it refines
        run.norms("nope")


def test_scalar_selectors_select_like_the_int(sel_run: tuple[gradlog.Run, Expected]) -> None:
    run, _ = sel_run
    with pytest.raises(errors.SelectionError, match=r"step 3 is not a committed step"):
        run.records(step=torch.tensor(3))  # not silently nothing
    with pytest.raises(errors.SelectionError, match=r"step 999 is not a committed step"):
        run.records(step=np.array(999))
    with pytest.raises(errors.SelectionError, match=r"datum 7 has no record"):
        run.grads("0.bias", datum=torch.tensor(7))
    want = run.trajectory("0.weight", 5)
    for datum in (torch.tensor(5), np.array(5), np.int32(5)):
        got = run.trajectory("0.weight", datum)
        assert np.array_equal(got.steps, want.steps) and np.array_equal(got.grads, want.grads)
    assert run.norms("0.bias", datum=torch.tensor(5)).num_rows == want.steps.size


@pytest.mark.parametrize(
    "bad",
    [2.0, "2", b"2", True, np.float64(2.0), np.array(2.0), torch.tensor(2.0), torch.tensor(True),
     [1.5], [True, False], ["2"], [[0, 2]], {"step": 2}, object(), slice(0.5, 3), slice(0, 4, 2)],
    ids=repr,
)
def test_non_integer_selectors_are_refused(
    sel_run: tuple[gradlog.Run, Expected], bad: Any
) -> None:
    run, _ = sel_run
    for kwargs in ({"step": bad}, {"datum": bad}):
        with pytest.raises(errors.SelectionError, match=r"(step|datum)="):
            run.records(**kwargs)
        with pytest.raises(errors.SelectionError, match=r"(step|datum)="):
            run.grads("0.bias", **kwargs)


@pytest.mark.parametrize("far", [2**63, 2**64, -(2**70), np.uint64(2**63), [1, 2**70],
                                 np.array([2**63], dtype=np.uint64), range(2**63 - 1, 2**63 + 1)],
                         ids=repr)
def test_ids_beyond_int64_are_refused_not_wrapped(
    sel_run: tuple[gradlog.Run, Expected], far: Any
) -> None:
    """uint64 2**63 cast to int64 would wrap to -2**63: refused, as Python ints past 64 bits."""
    run, _ = sel_run
    for kwargs in ({"step": far}, {"datum": far}):
        with pytest.raises(errors.SelectionError, match=r"ids are int64"):
            run.grads("0.bias", **kwargs)


def test_slices_past_int64_bound_nothing(sel_run: tuple[gradlog.Run, Expected]) -> None:
    run, _ = sel_run
    every = run.datums.num_rows
    assert run.records(datum=slice(0, 2**70)).num_rows == every
    assert run.records(step=slice(0, None)).num_rows == every
    assert run.records(datum=slice(2**63, None)).num_rows == 0


def _record_readers(run: gradlog.Run, kw: dict[str, Any], out: Path) -> list[Any]:
    """Every reader that takes a step/datum selection, called with ``kw``."""
    return [
        lambda: run.records(**kw),
        lambda: run.grads("0.bias", **kw),
        lambda: run.norms(**kw),
        lambda: run.stats("0.bias", **kw),
        lambda: run.export(out, format="npz", params="0.bias", **kw),
        lambda: run.similarity("0.bias", a=kw),
        lambda: run.to_dask("0.bias", **kw),
    ]


@pytest.mark.parametrize(
    "bad",
    [slice(-3, None), slice(None, -1), slice(2, -1), -1, [2, -2], range(-3, 0),
     np.array([-1]), torch.tensor(-2), slice(-(2**70), None)],
    ids=repr,
)
def test_negative_ids_are_refused_not_counted_from_the_end(
    sel_run: tuple[gradlog.Run, Expected], bad: Any, tmp_path: Path
) -> None:
    """Steps and datum ids are >= 0: a negative one is no position from the end (slice(-3,
    None) selected every step, slice(None, -1) none), on every path that reads records."""
    run, _ = sel_run
    message = r"not positions: -\d+ does not count from the end"
    for key in ("step", "datum"):
        for call in _record_readers(run, {key: bad}, tmp_path / "x.npz"):
            with pytest.raises(errors.InputError, match=message):
                call()
    with pytest.raises(errors.InputError, match=message):
        run.movers("0.bias", steps=bad)
    with pytest.raises(errors.InputError, match=r"run\.steps\['step'\]"):
        run.records(step=slice(-3, None))  # how to select the last steps
    if isinstance(bad, int):
        with pytest.raises(errors.InputError, match=message):
            run.trajectory("0.bias", bad)
        with pytest.raises(errors.InputError, match=r"probe=-1: probe ids .* not positions"):
            run.probe_grads("0.bias", probe=bad)
    assert not (tmp_path / "x.npz").exists()


@pytest.mark.parametrize("dtype", [np.int32, np.float16, "bogus", None, torch.float16, bool])
def test_grads_refuse_dtypes_other_than_float32_and_float64(
    sel_run: tuple[gradlog.Run, Expected], dtype: Any
) -> None:
    """An integer dtype truncated the gradients and the read then blamed the store
    (StoreCorruptError); others gave numpy's TypeError."""
    run, exp = sel_run
    with pytest.raises(errors.InputError, match=r"grads\(dtype=.*float32 .* or float64"):
        run.grads("0.weight", step=0, dtype=dtype)
    for ok, want in ((np.float64, np.float64), ("float32", np.float32),
                     (torch.float64, np.float64), (np.dtype("float32"), np.float32)):
        got = run.grads("0.weight", step=0, dtype=ok)
        assert got.dtype == want
        np.testing.assert_allclose(got, exp.grad("0.weight")[:3], rtol=1e-6)


def test_datum_slices_everywhere(sel_run: tuple[gradlog.Run, Expected]) -> None:
    run, _ = sel_run
    ids = np.asarray(run.datums.column("datum_id"))
    keep = (ids >= 3) & (ids < 6)
    assert run.records(datum=slice(3, 6)).column("row").to_pylist() == list(
        np.asarray(run.datums.column("row"))[keep]
    )
    assert np.array_equal(run.grads("0.weight", datum=slice(3, 6)), run.grads("0.weight")[keep])
    assert run.norms(datum=slice(3, 6)).num_rows == 4 * int(keep.sum())
    assert run.stats("0.bias", datum=slice(3, 6))["n_records"] == int(keep.sum())
    assert run.similarity("0.bias", a={"datum": slice(3, 6)}).shape == (keep.sum(), keep.sum())


def test_a_parameter_list_is_a_clear_selection_error(
    sel_run: tuple[gradlog.Run, Expected],
) -> None:
    run, _ = sel_run
    names = ["0.weight", "0.bias"]
    for call in (
        lambda: run.grads(names),  # type: ignore[arg-type]
        lambda: run.stats(names),  # type: ignore[arg-type]
        lambda: run.trajectory(names, 5),  # type: ignore[arg-type]
        lambda: run.to_dask(names),  # type: ignore[arg-type]
        lambda: run.norms(3),  # type: ignore[arg-type]
    ):
        with pytest.raises(errors.SelectionError, match=r"one parameter name"):
            call()
    both = run.norms(names, step=2)  # norms is a long table: several parameters are natural
    assert both.to_pylist() == pa.concat_tables(
        [run.norms(n, step=2) for n in names]
    ).sort_by([("row", "ascending")]).to_pylist()


# -- format and commit rule ---------------------------------------------------------------------
def test_schemas_are_valid_and_shipped() -> None:
    for name in SCHEMAS:
        Draft202012Validator.check_schema(load_schema(name))
        assert load_schema(f"{name}.schema.json") == load_schema(name)
    with pytest.raises(ValueError, match="root, index, steps"):
        load_schema("nope")
    shipped = {p.name for p in files("gradlog.schemas").iterdir()}
    assert {"FORMAT.md", "CHANGES.md"} <= shipped
    changes = files("gradlog.schemas").joinpath("CHANGES.md").read_text(encoding="utf-8")
    assert f"## Version {FORMAT_VERSION} " in changes


def test_root_attributes(tmp_store: Path) -> None:
    _train(tmp_store, CALLS[:3], metadata={"run": "a"})
    attrs = _reopen(tmp_store).attrs
    assert attrs["format"] == "gradlog" and attrs["format_version"] == 3
    assert attrs["config"]["compression"] == "none"  # "auto" resolves, by dtype
    assert attrs["gradlog_version"] == gradlog.__version__
    assert attrs["config"]["metadata"] == {"run": "a"}
    assert attrs["backend"]["name"] == "loop"
    assert attrs["model"] == {"class": "Sequential", "n_parameters": 4 * 3 + 4 + 2 * 4 + 2}
    assert attrs["params"]["0.weight"] == {
        "shape": [4, 3],
        "numel": 12,
        "dtype": "float64",
        "param_dtype": "float64",
        "form": "full",
        "array": "grads/0.weight",
        "form_spec": {"form": "full", "shape": [4, 3]},
        "arrays": {"grad": {"path": "grads/0.weight", "shape": [4, 3], "kind": "float"}},
    }
    meta = json.loads((tmp_store / "grads/0.weight/zarr.json").read_text())
    assert meta["dimension_names"] == ["record", "dim_0", "dim_1"]
    # batches 5, 5, 3: shards of 5 rows; the last call took rows 10..12: trimmed to 13
    assert meta["shape"] == [13, 4, 3]
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [5, 4, 3]
    assert meta["data_type"] == "float64"
    [shard] = meta["codecs"]
    assert shard["name"] == "sharding_indexed"
    assert shard["configuration"]["chunk_shape"] == [1, 4, 3]  # one record per inner chunk
    assert [c["name"] for c in shard["configuration"]["codecs"]] == ["bytes", "crc32c"]
    assert [c["name"] for c in shard["configuration"]["index_codecs"]] == ["bytes", "crc32c"]
    assert shard["configuration"]["index_location"] == "end"
    assert meta["chunk_key_encoding"]["configuration"]["separator"] == "."
    names = sorted(p.name for p in (tmp_store / "grads/0.weight").iterdir())
    assert names == ["c.0.0.0", "c.1.0.0", "c.2.0.0", "zarr.json"]


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda a: a.pop("config_hash"), id="no-config_hash"),
        pytest.param(lambda a: a["config"].update(every=2), id="stale-config_hash"),
        pytest.param(lambda a: a.update(extra=1), id="unknown-root-key"),
        pytest.param(lambda a: a["config"].pop("dtype"), id="config-misses-dtype"),
        pytest.param(lambda a: a["params"]["0.bias"].update(numel=5), id="wrong-numel"),
        pytest.param(
            lambda a: a["params"]["0.bias"].update(
                form="sparkle",
                form_spec={"form": "sparkle", "shape": [4]},
                arrays={"grad": {"path": "grads/0.bias/grad", "shape": [4], "kind": "float"}},
            ),
            id="unknown-form",
        ),
        pytest.param(lambda a: a.update(created="yesterday"), id="bad-created"),
    ],
)
def test_validate_store_detects_a_broken_root(tmp_store: Path, breakage: Any) -> None:
    _train(tmp_store, CALLS[:2])
    validate_store(tmp_store)
    _edit_root_attrs(tmp_store, breakage)
    gradlog.open(tmp_store)  # still opens: the damage is past the reader's cheap checks
    with pytest.raises(ValidationError):
        validate_store(tmp_store)


def test_a_parameter_shape_unlike_its_arrays_is_refused(tmp_store: Path) -> None:
    """Rows of a (4, 3) array read back as (3, 4) would be other numbers in each place."""
    _train(tmp_store, CALLS[:2])
    _edit_root_attrs(tmp_store, lambda a: a["params"]["0.weight"].update(
        shape=a["params"]["0.weight"]["shape"][::-1]))
    with pytest.raises(errors.StoreFormatError, match=r"'0.weight' has shape .* rows of shape"):
        gradlog.open(tmp_store).grads("0.weight")


def test_validate_store_detects_a_broken_index_and_arrays(tmp_store: Path) -> None:
    _train(tmp_store, CALLS[:2])
    part = tmp_store / "index/step-000000000001-000000.parquet"
    table = pq.read_table(part)
    good = table
    weights = table.column("weight").to_pylist()
    table = table.set_column(
        table.schema.get_field_index("weight"), "weight", pa.array([0.0] * len(weights))
    )
    pq.write_table(table, part)
    with pytest.raises(ValidationError, match="weight"):
        validate_store(tmp_store)
    pq.write_table(good, part)
    validate_store(tmp_store)
    shutil.rmtree(tmp_store / "grads/2.bias")
    with pytest.raises(ValidationError, match="no array"):
        validate_store(tmp_store)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("index/step-000000000001-000000.parquet", "index/step-000000000009-000000.parquet"),
        ("index/step-000000000001-000000.parquet", "index/step-000000000001-000003.parquet"),
        ("steps/step-000000000001.parquet", "steps/step-000000000002.parquet"),
        ("steps/step-000000000001.parquet", "steps/step-1.parquet"),
    ],
)
def test_validate_store_detects_a_misnamed_part(tmp_store: Path, source: str, target: str) -> None:
    _train(tmp_store, CALLS[:2])
    (tmp_store / source).rename(tmp_store / target)
    # a committed step's index part gone from its name: the reader refuses the store at open
    with pytest.raises((ValidationError, errors.StoreCorruptError)):
        validate_store(tmp_store)


def test_uncommitted_index_parts_and_temporaries_are_invisible(tmp_store: Path) -> None:
    _train(tmp_store, CALLS[:2])
    before = _reopen(tmp_store).datums
    # what a crash after writing step 7's index part (but before its commit) leaves behind
    table = pq.read_table(tmp_store / "index/step-000000000001-000000.parquet")
    step_col = table.schema.get_field_index("step")
    table = table.set_column(
        step_col, table.schema.field("step"), pa.array([7] * table.num_rows, pa.int64())
    )
    pq.write_table(table, tmp_store / "index/step-000000000007-000000.parquet")
    (tmp_store / "index/.step-000000000008-000000.parquet.tmp").write_bytes(b"partial")
    (tmp_store / "steps/.step-000000000007.parquet.tmp").write_bytes(b"partial")
    run = _reopen(tmp_store)
    assert run.datums.equals(before)
    assert run.steps.column("step").to_pylist() == [0, 1]
    with pytest.raises(errors.SelectionError):
        run.records(step=7)


def test_open_while_recording_sees_the_committed_prefix(tmp_store: Path) -> None:
    model = _mlp()
    x, y = _dataset()
    with gradlog.GradRecorder(model, tmp_store, backend="loop") as rec:
        empty = gradlog.open(tmp_store)
        assert empty.steps.num_rows == 0 and empty.datums.num_rows == 0
        assert empty.grads("0.weight").shape == (0, 4, 3)
        assert empty.grads("2.bias", step=slice(0, None)).shape == (0, 2)
        assert empty.norms().num_rows == 0
        validate_store(tmp_store)
        rec.backward(_losses(model, x[:3], y[:3]), step=0)
        rec.backward(_losses(model, x[3:5], y[3:5]), step=0)
        pending = gradlog.open(tmp_store)  # step 0 has index parts but is not committed
        assert pending.steps.num_rows == 0 and pending.datums.num_rows == 0
        assert pending.grads("0.bias").shape == (0, 4)
        rec.backward(_losses(model, x[5:9], y[5:9]), step=1)
        rec.flush()  # step 0's commit is queued when step 1 begins; flush waits for it
        run = gradlog.open(tmp_store)
        assert run.steps.column("step").to_pylist() == [0]
        assert run.datums.column("datum_id").to_pylist() == [0, 1, 2, 3, 4]
        assert run.refresh().datums.num_rows == 5
    assert run.refresh().datums.num_rows == 9
    validate_store(tmp_store)


def test_refresh_rereads_forms_and_grown_arrays(tmp_store: Path) -> None:
    """A run opened before recording starts (a dashboard): forms are planned at the first
    backward and arrays grow as steps commit; refresh() (or a first read after commits) must
    see them, not report damage."""
    model = _mlp()
    x, y = _dataset()

    def probe_loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (m(batch) ** 2).sum(1)

    form = {"0.weight": "factors", "2.bias": "norm"}
    with gradlog.GradRecorder(
        model, tmp_store, form=form, probes=(probe_loss, x[-2:]), probe_ids=[7, 9]
    ) as rec:
        watching = gradlog.open(tmp_store)
        unread = gradlog.open(tmp_store)  # first read only after steps are committed
        assert watching.params.column("form").to_pylist() == ["full"] * 4
        assert watching.steps.num_rows == 0 and watching.probes.num_rows == 0
        for step in range(2):
            rec.backward(_losses(model, x[4 * step : 4 * step + 4], y[4 * step : 4 * step + 4]))
        rec.flush()
        watching.refresh()
        assert watching.probe_grads("0.bias").shape == (2, 4)  # opens the probe array
        for step in range(2, 6):
            rec.backward(_losses(model, x[4 * step : 4 * step + 4], y[4 * step : 4 * step + 4]))
        rec.flush()
        watching.refresh()
        fresh = gradlog.open(tmp_store)
        for run in (watching, unread):
            assert run.steps.column("step").to_pylist() == [0, 1, 2, 3, 4]
            assert run.params.to_pylist() == fresh.params.to_pylist()
            assert run.params.column("form").to_pylist() == ["factors", "full", "full", "norm"]
            assert np.array_equal(run.grads("0.weight", step=0), fresh.grads("0.weight", step=0))
            with pytest.raises(errors.SelectionError, match="form 'norm'"):
                run.grads("2.bias")
            assert run.probe_grads("0.bias").shape == (10, 4)
            assert np.array_equal(run.probe_grads("2.weight"), fresh.probe_grads("2.weight"))


def test_empty_run_reads_as_empty(tmp_store: Path) -> None:
    with gradlog.GradRecorder(_mlp(), tmp_store, backend="loop"):
        pass
    run = _reopen(tmp_store)
    assert run.steps.num_rows == 0 and run.datums.num_rows == 0
    for name, shape in [("0.weight", (4, 3)), ("0.bias", (4,)), ("2.weight", (2, 4))]:
        assert run.grads(name).shape == (0, *shape)
        assert run.grads(name, as_torch=True).shape == (0, *shape)
    assert not (tmp_store / "grads/0.weight").exists()  # arrays come with the first records


def test_parameter_names_that_need_encoding(tmp_store: Path) -> None:
    model = nn.Sequential()
    model.add_module("__priv", nn.Linear(2, 2).double())
    model.add_module("naïve layer", nn.Linear(2, 1).double())
    x = torch.randn(4, 2, dtype=torch.float64)
    expected = {n: [] for n, _ in model.named_parameters()}
    for b in range(4):
        gs = torch.autograd.grad(model(x[b : b + 1]).sum(), list(model.parameters()))
        for n, g in zip(expected, gs):
            expected[n].append(g.numpy().copy())
    with gradlog.GradRecorder(model, tmp_store, backend="loop", dtype="float64") as rec:
        rec.backward(model(x).sum(1), step=0)
    for rel in ["%5F_priv.weight", "%5F_priv.bias", "na%C3%AFve%20layer.weight"]:
        assert (tmp_store / "grads" / rel / "zarr.json").is_file()
    run = _reopen(tmp_store)
    for name, gs in expected.items():
        np.testing.assert_allclose(run.grads(name, dtype=np.float64), np.stack(gs), rtol=1e-12)
        assert f"norm/{name}" in run.datums.column_names


def test_large_steps_and_datum_ids(tmp_store: Path) -> None:
    big = 10**12
    model = _mlp()
    x, y = _dataset()
    with gradlog.GradRecorder(model, tmp_store, backend="loop") as rec:
        rec.backward(_losses(model, x[:2], y[:2]), datum_ids=[2**40, 7], step=big)
        rec.backward(_losses(model, x[:3], y[:3]), datum_ids=[1, 2, 3], step=big + 1)
    assert (tmp_store / "steps/step-1000000000001.parquet").is_file()
    run = _reopen(tmp_store)
    assert run.steps.column("step").to_pylist() == [big, big + 1]
    assert run.records(datum=2**40).column("step").to_pylist() == [big]


def test_negative_datum_ids_are_refused(tmp_store: Path) -> None:
    model = _mlp()
    x, y = _dataset()
    with (
        gradlog.GradRecorder(model, tmp_store, backend="loop") as rec,
        pytest.raises(errors.InputError, match=">= 0"),
    ):
        rec.backward(_losses(model, x[:2], y[:2]), datum_ids=[0, -1])
    validate_store(tmp_store)


def test_per_token_losses_with_a_fully_masked_datum(tmp_store: Path) -> None:
    model = nn.Linear(3, 2).double()
    x = torch.randn(3, 4, 3, dtype=torch.float64)  # (B, T, d_in)
    y = torch.randn(3, 4, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    exp_loss, exp_w = [], []
    for b in range(3):
        keep = mask[b]
        if keep.any():
            loss = ((model(x[b][keep]) - y[b][keep]) ** 2).sum(-1).mean()
            exp_w.append(torch.autograd.grad(loss, model.weight)[0].numpy().copy())
            exp_loss.append(loss.item())
        else:
            exp_w.append(np.zeros((2, 3)))
            exp_loss.append(0.0)
    with gradlog.GradRecorder(model, tmp_store, backend="loop", dtype="float64") as rec:
        rec.backward(((model(x) - y) ** 2).sum(-1), mask=mask, step=0)  # (B, T)
    run = _reopen(tmp_store)
    np.testing.assert_allclose(run.datums.column("loss"), exp_loss, rtol=1e-12)
    np.testing.assert_allclose(run.grads("weight", dtype=np.float64), np.stack(exp_w), rtol=1e-12)
    assert run.datums.column("norm/weight").to_pylist()[1] == 0.0
    assert run.steps.column("tokens").to_pylist() == [4]


def test_corrupt_chunk_is_detected_not_returned(tmp_store: Path) -> None:
    _train(tmp_store, CALLS[:1])
    chunk = next(
        p for p in (tmp_store / "grads/0.bias").rglob("*") if p.is_file() and p.name != "zarr.json"
    )
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        gradlog.open(tmp_store).grads("0.bias")


# -- reader errors ----------------------------------------------------------------------------
def test_opening_a_missing_path(tmp_path: Path) -> None:
    with pytest.raises(errors.NotAStoreError, match="does not exist"):
        gradlog.open(tmp_path / "nope.gradlog")
    with pytest.raises(FileNotFoundError):
        gradlog.open(tmp_path / "nope.gradlog")


def test_opening_a_plain_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(errors.NotAStoreError, match=r"no zarr\.json"):
        gradlog.open(tmp_path)


def test_opening_a_zarr_group_that_is_not_gradlog(tmp_path: Path) -> None:
    zarr.open_group(str(tmp_path / "other.zarr"), mode="w", attributes={"format": "xarray"})
    with pytest.raises(errors.StoreFormatError, match="not a gradlog store"):
        gradlog.open(tmp_path / "other.zarr")
    zarr.create_array(str(tmp_path / "arr.zarr"), shape=(2,), dtype="f4")
    with pytest.raises(errors.StoreFormatError, match="not a Zarr group"):
        gradlog.open(tmp_path / "arr.zarr")


def test_a_newer_format_version_is_refused(tmp_store: Path) -> None:
    _train(tmp_store, CALLS[:1])
    _edit_root_attrs(tmp_store, lambda a: a.update(format_version=99))
    with pytest.raises(errors.StoreVersionError, match="Upgrade") as info:
        gradlog.open(tmp_store)
    assert "99" in str(info.value) and str(FORMAT_VERSION) in str(info.value)
    assert isinstance(info.value, errors.StoreFormatError)


@pytest.mark.parametrize("version", [0, "1", None, True])
def test_a_malformed_format_version_is_refused(tmp_store: Path, version: Any) -> None:
    _train(tmp_store, CALLS[:1])
    _edit_root_attrs(tmp_store, lambda a: a.update(format_version=version))
    with pytest.raises(errors.StoreFormatError, match="format_version"):
        gradlog.open(tmp_store)


@pytest.mark.parametrize("config", [None, [], "full", 3])
def test_a_config_that_is_not_an_object_is_refused(tmp_store: Path, config: Any) -> None:
    """(Hypothesis found ``"config": null`` escaping ``gradlog.open`` as an AttributeError.)"""
    _train(tmp_store, CALLS[:1])
    _edit_root_attrs(tmp_store, lambda a: a.update(config=config))
    with pytest.raises(errors.StoreFormatError, match="'config' must be an object"):
        gradlog.open(tmp_store)


def test_malformed_json_is_refused(tmp_store: Path) -> None:
    _train(tmp_store, CALLS[:1])
    (tmp_store / "zarr.json").write_text('{"zarr_format": 3, "node_type": ')
    with pytest.raises(errors.StoreFormatError, match="not valid JSON"):
        gradlog.open(tmp_store)


@pytest.mark.parametrize("array", ["../../etc", "grads/../../etc", "grads/0.bias", "/etc"])
def test_array_paths_that_escape_or_disagree_are_refused(tmp_store: Path, array: str) -> None:
    _train(tmp_store, CALLS[:1])
    _edit_root_attrs(tmp_store, lambda a: a["params"]["0.weight"].update(array=array))
    with pytest.raises(errors.StoreFormatError, match=r"0\.weight"):
        gradlog.open(tmp_store)


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.NotAStoreError, FileNotFoundError),
        (errors.StoreExistsError, FileExistsError),
        (errors.StoreFormatError, ValueError),
        (errors.StoreVersionError, ValueError),
        (errors.SelectionError, LookupError),
        (errors.InputError, ValueError),
        (errors.ConfigError, ValueError),
    ],
)
def test_errors_subclass_their_builtins(cls: type, builtin: type) -> None:
    assert issubclass(cls, errors.GradlogError) and issubclass(cls, builtin)


# -- overwrite ----------------------------------------------------------------------------------
def test_overwrite_semantics(tmp_store: Path) -> None:
    _train(tmp_store, CALLS[:2])
    with pytest.raises(errors.StoreExistsError, match="overwrite=True"):
        _train(tmp_store, CALLS[:1])
    assert _reopen(tmp_store).datums.num_rows == 10  # untouched
    _train(tmp_store, CALLS[2:3], overwrite=True)
    run = _reopen(tmp_store)
    assert run.datums.column("datum_id").to_pylist() == _ids(10, 3)
    assert run.steps.column("step").to_pylist() == [2]


def test_a_directory_that_is_not_a_store_is_never_deleted(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    for overwrite in (False, True):
        with pytest.raises(errors.StoreExistsError, match="not a gradlog store"):
            _train(target, CALLS[:1], overwrite=overwrite)
    assert (target / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in target.iterdir()) == ["thesis.tex"]


def test_an_empty_existing_directory_is_used(tmp_path: Path) -> None:
    target = tmp_path / "empty.gradlog"
    target.mkdir()
    _train(target, CALLS[:1])
    assert _reopen(target).datums.num_rows == 5


# -- property -----------------------------------------------------------------------------------
@settings(max_examples=15, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 3)),  # (batch size, step increment)
        min_size=1,
        max_size=5,
    ),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_round_trip_property(plan: list[tuple[int, int]], dtype: str) -> None:
    calls, step, next_id = [], 0, 0
    for i, (size, inc) in enumerate(plan):
        step += inc if i else 0  # increment 0 repeats the step: gradient accumulation
        calls.append((step, _ids(next_id, size)))  # at most 30 ids < N_DATA
        next_id += size
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.gradlog"
        exp = _train(path, calls, dtype=dtype)
        run = _reopen(path)
        assert run.datums.num_rows == len(exp.records)
        cols = ["step", "micro", "datum_id"]
        assert [{k: r[k] for k in cols} for r in run.datums.to_pylist()] == [
            {k: r[k] for k in cols} for r in exp.records
        ]
        distinct = sorted({s for s, _ in calls})
        assert run.steps.column("step").to_pylist() == distinct
        sizes = [sum(len(ids) for s, ids in calls if s == d) for d in distinct]
        assert run.steps.column("n_records").to_pylist() == sizes
        rows = _rows_by_rule([len(ids) for _, ids in calls])
        firsts, seen = [], set()
        for (s, _), call in zip(calls, rows):
            if s not in seen:
                seen.add(s)
                firsts.append(call[0])
        assert run.steps.column("first_row").to_pylist() == firsts
        assert run.datums.column("row").to_pylist() == [r for call in rows for r in call]
        for name in run.param_names:
            want = exp.grad(name)
            if dtype == "float64":
                np.testing.assert_allclose(
                    run.grads(name, dtype=np.float64), want, rtol=1e-12, atol=1e-14
                )
            else:
                np.testing.assert_array_max_ulp(run.grads(name), want.astype(np.float32), maxulp=1)
        assert math.isclose(
            float(np.sum(run.datums.column("loss"))),
            sum(r["loss"] for r in exp.records),
            rel_tol=1e-12,
        )


def test_a_run_replaced_since_it_was_opened_is_refused_not_mixed(tmp_store: Path) -> None:
    """An open Run whose store is overwritten by another run (re-running a notebook cell)
    would read the new run's arrays under its cached records: refused at the next read."""
    _train(tmp_store, [(0, _ids(0, 4)), (1, _ids(4, 4))])
    run = gradlog.open(tmp_store)
    before = run.grads("0.weight", step=0)
    again = gradlog.open(tmp_store)
    np.testing.assert_array_equal(again.grads("0.weight", step=0), before)  # same run: reads
    again.refresh()
    _train(tmp_store, [(0, _ids(8, 4))], dtype="float32", overwrite=True)  # another run
    for read in (lambda: run.grads("0.weight", step=0),  # an array opened before
                 lambda: run.grads("0.bias", step=1),  # one opened now
                 run.refresh):
        with pytest.raises(errors.StoreReplacedError, match="was replaced by another run"):
            read()
    fresh = gradlog.open(tmp_store)
    assert fresh.datums.column("datum_id").to_pylist() == _ids(8, 4)
