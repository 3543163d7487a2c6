"""A run read in a notebook: lazy labelled views, the guard on reading every record at once,
exports that keep shapes, and one vocabulary across outputs (issue 20)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.analysis import param_axes, parquet_grads

B, STEPS = 6, 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(tokens)))  # (B, T, 3)


def _record(path: Path, backend: str = "hooks") -> gradlog.Run:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    with gradlog.GradRecorder(model, path, backend=backend, optimizer=opt) as rec:
        for step in range(STEPS):
            x = torch.randint(0, 11, (B, 4), generator=gen)
            y = torch.randint(0, 3, (B, 4), generator=gen)
            losses = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # (B, T)
            rec.backward(losses, datum_ids=torch.arange(B) + step % 2 * B)
            opt.step()
            opt.zero_grad()
    return gradlog.open(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> gradlog.Run:
    return _record(tmp_path_factory.mktemp("nb") / "nb.gradlog")


# -- the guard on reading every record --------------------------------------------------------
def test_unselected_read_above_max_memory_names_a_selection(run: gradlog.Run) -> None:
    total = run.datums.num_rows * 3 * 5 * 4  # head.weight, float32
    with pytest.raises(gradlog.ReadTooLargeError, match=r"step=0\) \(that step's 6 records\)"):
        run.grads("head.weight", max_memory=total - 1)
    with pytest.raises(ValueError, match=r"run\.to_dask\('head\.weight'\)"):
        run.grads("head.weight", max_memory="100B")
    # at the budget, or with a selection of any size, it reads
    full = run.grads("head.weight", max_memory=total)
    assert full.shape == (STEPS * B, 3, 5)
    np.testing.assert_array_equal(run.grads("head.weight", step=[0, 1, 2], max_memory=1), full)


def test_the_default_budget_applies(run: gradlog.Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gradlog.analysis.scan, "DEFAULT_MAX_MEMORY", 64)
    with pytest.raises(gradlog.ReadTooLargeError, match="over max_memory=64 B"):
        run.grads("head.weight")
    with pytest.raises(gradlog.ReadTooLargeError):
        run.to_xarray("head.weight", lazy=False)
    assert run.grads("head.weight", step=1).shape == (B, 3, 5)


# -- labelled, lazy views -----------------------------------------------------------------------
def test_to_xarray_is_lazy_with_named_dimensions(run: gradlog.Run) -> None:
    pytest.importorskip("xarray")
    dask_array = pytest.importorskip("dask.array")
    arr = run.to_xarray("head.weight")
    assert isinstance(arr.data, dask_array.Array)  # nothing read yet
    assert arr.dims == ("record", "out", "in") and arr.shape == (STEPS * B, 3, 5)
    records = run.records()
    for name in ("step", "micro", "datum_id", "row", "loss", "weight"):
        assert arr.coords[name].values.tolist() == records.column(name).to_pylist(), name
    np.testing.assert_allclose(
        arr.coords["norm"].values, records.column("norm/head.weight").to_numpy()
    )
    np.testing.assert_array_equal(arr.values, run.grads("head.weight"))
    assert run.to_xarray("head.bias").dims == ("record", "out")
    assert run.to_xarray("emb.weight", step=1).dims == ("record", "token", "feature")
    assert run.to_xarray("norm.weight", lazy=False).dims == ("record", "feature")
    by_datum = arr.sel(record=arr.datum_id == 3).sum("record")  # notebook style
    np.testing.assert_allclose(by_datum.values, run.grads("head.weight", datum=3).sum(0))


def test_axis_names_without_module_classes(tmp_path: Path) -> None:
    run = _record(tmp_path / "loop.gradlog", backend="loop")  # records no module classes
    assert param_axes(run, "head.weight") == ("dim_0", "dim_1")


# -- exports keep shapes; one vocabulary ------------------------------------------------------
def test_parquet_export_keeps_shapes(run: gradlog.Run, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    run.export(tmp_path / "e.parquet", step=[1, 2])
    table = pq.read_table(tmp_path / "e.parquet")
    for name in run.param_names:
        column = table.schema.field(f"grads/{name}").type
        shape = []
        while hasattr(column, "list_size"):
            shape.append(column.list_size)
            column = column.value_type
        assert tuple(shape) == tuple(run.grads(name, step=1).shape[1:]), name
        np.testing.assert_array_equal(parquet_grads(table, name), run.grads(name, step=[1, 2]))
    assert table.slice(3, 2).column("grads/head.weight").to_pylist() == (
        run.grads("head.weight", step=[1, 2])[3:5].tolist()
    )
    with pytest.raises(gradlog.SelectionError, match="no gradients of 'nope'"):
        parquet_grads(table, "nope")


def test_one_name_for_gradients_in_every_export(run: gradlog.Run, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    run.export(tmp_path / "e.npz")
    run.export(tmp_path / "e.parquet")
    with np.load(tmp_path / "e.npz") as z:
        npz = sorted(k for k in z.files if "/" in k)
    parquet = sorted(c for c in pq.read_table(tmp_path / "e.parquet").column_names if "/" in c)
    assert npz == parquet == sorted(f"grads/{n}" for n in run.param_names)


def test_movers_and_influence_share_proponent_opponent(run: gradlog.Run) -> None:
    kinds = set(run.movers("head.weight", top=None).column("kind").to_pylist())
    assert kinds <= {"proponent", "opponent", "neutral"} and "proponent" in kinds
