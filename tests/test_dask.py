"""Scans on a ``dask.distributed`` cluster return what the local scans return.

Equality is exact (``==`` on every float64): each Dask task reads the same block as the local
scan and does the same numpy arithmetic on it, and the client adds the task results in the
local scan's order (gradlog.analysis.tasks). Bitwise equality is what the design promises on
one machine, so the tests hold it to that; the local scans themselves are checked against a
brute-force float64 oracle in test_analysis.py, and once more here (rtol 1e-12: a different
summation order).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.analysis.tasks import StoreRef
from gradlog.errors import MissingExtraError, StoreReplacedError

_NO_DASK = r"pip install 'dask\[array\]' distributed .*'\.\[dask\]'"  # extras.require_extra

distributed = pytest.importorskip("distributed", reason="needs the dask extra (dask.distributed)")
pytest.importorskip("dask.array", reason="needs the dask extra (dask.array)")

N_DATA, PROBE_IDS = 40, [5, 9]
# budgets that cut the run into one block, a few blocks, and blocks smaller than a step
BUDGETS = [None, "200KiB", "100KiB"]


def _record(path: Path, dtype: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N_DATA, 8, generator=gen), torch.randint(0, 3, (N_DATA,), generator=gen)
    px, py = torch.randn(2, 8, generator=gen), torch.randint(0, 3, (2,), generator=gen)

    def probe_loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1], reduction="none")

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradlog.GradRecorder(
        model,
        path,
        dtype=dtype,
        probes=(probe_loss, (px, py)),
        probe_ids=PROBE_IDS,
        optimizer=opt,
    ) as rec:
        for step, idx in enumerate(torch.randperm(N_DATA, generator=gen).split([8, 6, 10, 8, 8])):
            losses = F.cross_entropy(model(x[idx]), y[idx], reduction="none")
            rec.backward(losses, datum_ids=idx, step=step)
            opt.step()
            opt.zero_grad()


@pytest.fixture(scope="module", params=["float32", "bitround9"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> gradlog.Run:
    path = tmp_path_factory.mktemp("dask") / "run.gradlog"
    _record(path, request.param)
    return gradlog.open(path)


@pytest.fixture(scope="module")
def client() -> Iterator[object]:
    """A LocalCluster in this process (threads): fast enough for the default suite."""
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


def _same_table(a: object, b: object) -> None:
    assert a.column_names == b.column_names  # type: ignore[attr-defined]
    for name in a.column_names:  # type: ignore[attr-defined]
        assert a.column(name).to_pylist() == b.column(name).to_pylist(), name  # type: ignore[attr-defined]


def test_to_dask_on_a_cluster(run: gradlog.Run, client: object) -> None:
    for param in run.param_names:
        lazy = run.to_dask(param)
        assert np.array_equal(lazy.compute(), run.grads(param))
        part = run.to_dask(param, step=[1, 3], datum=None)
        assert np.array_equal(client.compute(part).result(), run.grads(param, step=[1, 3]))  # type: ignore[attr-defined]


def test_to_dask_graph_carries_no_gradient(run: gradlog.Run) -> None:
    """Tasks read the store by path: the graph holds row numbers, not gradient data."""
    lazy = run.to_dask("0.weight")
    graph = pickle.dumps(dict(lazy.__dask_graph__()))
    data = run.grads("0.weight")
    assert len(graph) < data.nbytes / 4
    assert data[0].tobytes() not in graph


@pytest.mark.parametrize(
    ("max_memory", "weighted"), [(None, False), (None, True), ("200KiB", False), ("100KiB", True)]
)
def test_influence_on_a_cluster_equals_local(
    run: gradlog.Run, client: object, max_memory: str | None, weighted: bool
) -> None:
    for probe in PROBE_IDS:
        local = run.influence(probe, top=None, weighted=weighted, max_memory=max_memory)
        remote = run.influence(
            probe, top=None, weighted=weighted, max_memory=max_memory, scheduler=client
        )
        _same_table(local, remote)
    top = run.influence(PROBE_IDS[0], top=3, params="2.weight", scheduler="distributed")
    _same_table(top, run.influence(PROBE_IDS[0], top=3, params="2.weight"))


def test_influence_with_a_user_gradient_on_a_cluster(run: gradlog.Run, client: object) -> None:
    gen = np.random.default_rng(0)
    vector = {
        name: gen.standard_normal(run.grads(name, step=0).shape[1:]) for name in run.param_names
    }
    for max_memory in BUDGETS:
        local = run.influence(vector, top=None, max_memory=max_memory)
        remote = run.influence(vector, top=None, max_memory=max_memory, scheduler=client)
        _same_table(local, remote)


def test_influence_on_a_cluster_equals_brute_force(run: gradlog.Run, client: object) -> None:
    """An independent oracle: every record's gradient and the probe's, in float64."""
    probe = PROBE_IDS[1]
    records = run.datums
    probes = run.probe_records(probe=probe)
    at = dict(zip(probes.column("step").to_pylist(), range(probes.num_rows)))
    expected: dict[int, float] = {}
    for name in run.param_names:
        g = run.grads(name, dtype=np.float64).reshape(records.num_rows, -1)
        q = run.probe_grads(name, probe=probe, dtype=np.float64).reshape(probes.num_rows, -1)
        for i, (step, datum, lr) in enumerate(
            zip(
                records.column("step").to_pylist(),
                records.column("datum_id").to_pylist(),
                records.column("lr").to_pylist(),
            )
        ):
            expected[datum] = expected.get(datum, 0.0) + lr * float(g[i] @ q[at[step]])
    got = run.influence(probe, top=None, scheduler=client, max_memory="100KiB")
    scores = dict(zip(got.column("datum_id").to_pylist(), got.column("score").to_pylist()))
    assert scores.keys() == expected.keys()
    for datum, value in expected.items():
        assert scores[datum] == pytest.approx(value, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("max_memory", BUDGETS)
def test_stats_on_a_cluster_equals_local(
    run: gradlog.Run, client: object, max_memory: str | None
) -> None:
    for param in run.param_names:
        for sel in ({}, {"step": [0, 2, 4]}, {"datum": [3, 4, 5]}):
            local = run.stats(param, max_memory=max_memory, **sel)
            assert run.stats(param, max_memory=max_memory, scheduler=client, **sel) == local


def test_dask_default_scheduler_is_the_active_client(run: gradlog.Run, client: object) -> None:
    """``scheduler="dask"``: Dask's default, which is the active Client here."""
    local = run.influence(PROBE_IDS[0], top=None)
    _same_table(run.influence(PROBE_IDS[0], top=None, scheduler="dask"), local)
    _same_table(run.influence(PROBE_IDS[0], top=None, scheduler="threads"), local)


def test_a_replaced_store_is_refused(run: gradlog.Run) -> None:
    ref = StoreRef.of(run)
    assert ref.open().path == run.path
    stale = StoreRef(ref.path, ("0" * 32, *ref.identity[1:]))  # another run_id
    with pytest.raises(StoreReplacedError, match="replaced"):
        stale.open()


def test_scheduler_without_dask(run: gradlog.Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dask", None)
    with pytest.raises(MissingExtraError, match=_NO_DASK):
        run.influence(PROBE_IDS[0], scheduler="distributed")
    with pytest.raises(MissingExtraError, match=_NO_DASK):
        run.stats("0.weight", scheduler="distributed")


@pytest.mark.slow
def test_scans_on_a_process_cluster(run: gradlog.Run) -> None:
    """Workers in other processes: they open the store by path, results are the same."""
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        _same_table(
            run.influence(PROBE_IDS[0], top=None, max_memory="100KiB", scheduler=c),
            run.influence(PROBE_IDS[0], top=None, max_memory="100KiB"),
        )
        assert run.stats("0.weight", scheduler=c) == run.stats("0.weight")
        assert np.array_equal(run.to_dask("0.weight").compute(), run.grads("0.weight"))


@pytest.mark.parametrize("max_memory", BUDGETS)
def test_movers_on_a_cluster_equals_local(
    run: gradlog.Run, client: object, max_memory: str | None
) -> None:
    for params in (None, "0.weight"):
        for steps in (None, range(1, 4)):
            local = run.movers(params, steps=steps, top=None, max_memory=max_memory)
            remote = run.movers(
                params, steps=steps, top=None, max_memory=max_memory, scheduler=client
            )
            _same_table(local, remote)
            assert remote.schema.metadata == local.schema.metadata  # the change's norm


@pytest.mark.parametrize("max_memory", [None, "100KiB"])  # 200KiB: ~500 tiny pair tasks
def test_similarity_on_a_cluster_equals_local(
    run: gradlog.Run, client: object, max_memory: str | None
) -> None:
    selections: list[dict[str, Any]] = [
        {},
        {"a": {"step": [1, 3]}},
        {"a": {"step": 0}, "b": {"datum": [3, 4, 5, 6]}},
        {"a": run.records(step=[4, 2]), "b": {"step": range(1, 4)}},
    ]
    for sel in selections:
        for kind in ("dot", "cosine"):
            local = run.similarity(kind=kind, max_memory=max_memory, **sel)
            remote = run.similarity(kind=kind, max_memory=max_memory, scheduler=client, **sel)
            assert np.array_equal(remote, local)


def test_a_relative_store_path_reaches_the_workers(
    run: gradlog.Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers may run elsewhere: tasks carry the store's absolute path."""
    monkeypatch.chdir(run.path.parent)
    relative = gradlog.open(run.path.name)
    ref = StoreRef.of(relative)
    assert Path(ref.path).is_absolute() and Path(ref.path) == run.path.absolute()
    lazy = relative.to_dask("2.bias")
    monkeypatch.chdir(run.path.parent.parent)  # a worker's working directory
    assert np.array_equal(lazy.compute(scheduler="sync"), run.grads("2.bias"))
