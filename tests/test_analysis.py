"""Analysis tests: every score equals a brute-force float64 computation over all records.

Expected values never come from gradlog's analysis: they are computed here with numpy from
the whole run loaded at once (``run.grads`` / ``run.probe_grads`` upcast to float64), with the
formulas of the docstrings written out again. Probe gradients are checked against a naive
per-probe ``torch.autograd.grad`` on a copy of the model at each step, and probes against
training itself: a run with probes reaches bitwise the same parameters as one without.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import sys
import tracemalloc
import warnings
from collections import defaultdict
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from jsonschema import Draft202012Validator
from torch import nn

import gradlog
from gradlog.analysis import parquet_grads
from gradlog.analysis.scan import memory_bytes
from gradlog.errors import (
    InputError,
    MemoryTooSmallError,
    MissingExtraError,
    MissingLearningRateError,
    NonFiniteLossError,
    SelectionError,
)
from gradlog.testing.schemas import validate_store

_NO_DASK = r"pip install 'dask\[array\]' distributed .*'\.\[dask\]'"  # extras.require_extra

N_DATA, N_PROBES, PROBE_IDS = 30, 3, [100, 7, 42]
GOLDEN = Path(__file__).resolve().parent / "golden"


# -- a small recorded run ----------------------------------------------------------------------
def _mlp(d_in: int = 4, hidden: int = 6, d_out: int = 3, dropout: float = 0.0) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, hidden), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(hidden, d_out))


def _data(n: int, d_in: int, d_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=gen), torch.randint(0, d_out, (n,), generator=gen)


def _probe_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")  # (P,)


def _record(path: Path, *, dtype: str = "float32", lr: bool = True) -> None:
    """Two epochs, variable batch sizes, one accumulated step, steps 0, 2, 4, ... and a
    decaying learning rate passed per step."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(N_DATA, 4, 3, seed=1)
    probes = _data(N_PROBES, 4, 3, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    with gradlog.GradRecorder(
        model, path, backend="loop", dtype=dtype, probes=(_probe_loss, probes), probe_ids=PROBE_IDS
    ) as rec:
        step = 0
        for _ in range(2):
            perm = torch.randperm(N_DATA, generator=gen)
            for i, idx in enumerate(perm.split([8, 7, 8, 7])):
                rate = 0.2 / (1 + step) if lr else None
                micro = idx.split([4, len(idx) - 4]) if i == 1 else (idx,)  # accumulation
                for part in micro:
                    losses = F.cross_entropy(model(x[part]), y[part], reduction="none")
                    rec.backward(losses, datum_ids=part, step=step, lr=rate)
                opt.step()
                opt.zero_grad()
                step += 2


@pytest.fixture(scope="module", params=["float32", "float64"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> gradlog.Run:
    path = tmp_path_factory.mktemp("analysis") / "run.gradlog"
    _record(path, dtype=request.param)
    return gradlog.open(path)


# -- brute force ------------------------------------------------------------------------------
class Everything:
    """The whole run in float64 memory."""

    def __init__(self, run: gradlog.Run) -> None:
        rec = run.datums
        self.n = rec.num_rows
        self.step = rec.column("step").to_numpy()
        self.datum = rec.column("datum_id").to_numpy()
        self.row = rec.column("row").to_numpy()
        self.lr = rec.column("lr").to_numpy(zero_copy_only=False).astype(np.float64)
        self.weight = rec.column("weight").to_numpy()
        self.params = run.param_names
        self.g = {p: run.grads(p, dtype=np.float64).reshape(self.n, -1) for p in self.params}
        probes = run.probes
        self.p_step = probes.column("step").to_numpy()
        self.p_id = probes.column("probe_id").to_numpy()
        self.q = {
            p: run.probe_grads(p, dtype=np.float64).reshape(probes.num_rows, -1)
            for p in self.params
        }

    def flat(self, params: list[str], rows: np.ndarray | None = None) -> np.ndarray:
        sel = slice(None) if rows is None else rows
        return np.concatenate([self.g[p][sel] for p in params], axis=1)

    def by_datum(self, values: np.ndarray, mask: np.ndarray | None = None) -> dict[int, float]:
        out: dict[int, float] = defaultdict(float)
        for i in range(self.n):
            if mask is None or mask[i]:
                out[int(self.datum[i])] += float(values[i])
        return dict(out)


def _scores(table: Any) -> dict[int, float]:
    return dict(zip(table.column("datum_id").to_pylist(), table.column("score").to_pylist()))


def _assert_scores(got: dict[int, float], want: dict[int, float], rtol: float = 1e-9) -> None:
    assert set(got) == set(want)
    keys = sorted(want)
    scale = max(abs(v) for v in want.values())
    np.testing.assert_allclose(
        [got[k] for k in keys], [want[k] for k in keys], rtol=rtol, atol=rtol * scale
    )


# -- influence ----------------------------------------------------------------------------------
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("probe", PROBE_IDS)
def test_influence_equals_brute_force(run: gradlog.Run, probe: int, weighted: bool) -> None:
    e = Everything(run)
    params = e.params
    per_record = np.zeros(e.n)
    for i in range(e.n):
        j = np.flatnonzero((e.p_step == e.step[i]) & (e.p_id == probe))
        assert j.size == 1  # every recorded step has every probe
        dot = sum(float(e.g[p][i] @ e.q[p][j[0]]) for p in params)
        per_record[i] = e.lr[i] * (e.weight[i] if weighted else 1.0) * dot
    want = e.by_datum(per_record)
    table = run.influence(probe, top=None, weighted=weighted)
    _assert_scores(_scores(table), want)
    # the ranking: top proponents descending, then top opponents ascending
    top = run.influence(probe, top=3, weighted=weighted).to_pylist()
    pos = sorted(((s, d) for d, s in want.items() if s > 0), key=lambda t: -t[0])[:3]
    neg = sorted(((s, d) for d, s in want.items() if s < 0), key=lambda t: t[0])[:3]
    assert [(r["kind"], r["rank"], r["datum_id"]) for r in top] == [
        *(("proponent", k + 1, d) for k, (_, d) in enumerate(pos)),
        *(("opponent", k + 1, d) for k, (_, d) in enumerate(neg)),
    ]
    np.testing.assert_allclose([r["score"] for r in top], [s for s, _ in [*pos, *neg]],
                               rtol=1e-9)  # opponents keep their negative sign
    n_steps = {d: len(set(e.step[e.datum == d])) for d in want}
    assert {r["datum_id"]: r["n_steps"] for r in table.to_pylist()} == n_steps


def test_influence_of_a_user_gradient_and_of_a_parameter_subset(run: gradlog.Run) -> None:
    e = Everything(run)
    rng = np.random.default_rng(0)
    shapes = {p["name"]: tuple(p["shape"]) for p in run.params.to_pylist()}
    probe = {
        "2.weight": rng.standard_normal(shapes["2.weight"]),
        "0.bias": torch.from_numpy(rng.standard_normal(shapes["0.bias"])),
    }
    want = e.by_datum(e.lr * sum(e.g[p] @ np.asarray(v).reshape(-1) for p, v in probe.items()))
    _assert_scores(_scores(run.influence(probe, top=None)), want)
    only = e.by_datum(e.lr * (e.g["0.bias"] @ probe["0.bias"].numpy()))
    _assert_scores(_scores(run.influence(probe, top=None, params="0.bias")), only)
    # a recorded probe restricted to some parameters
    j = {int(s): k for k, s in enumerate(e.p_step) if e.p_id[k] == 7}
    sub = np.array(
        [e.lr[i] * float(e.g["2.bias"][i] @ e.q["2.bias"][j[int(e.step[i])]]) for i in range(e.n)]
    )
    _assert_scores(_scores(run.influence(7, top=None, params=["2.bias"])), e.by_datum(sub))


@pytest.mark.parametrize("kind", ["tracin", "cosine"])
@pytest.mark.parametrize("params", [None, ["2.bias"], ["0.weight", "2.bias"]])
def test_matrix_influence_and_self_influence_over_parameter_subsets(
        run: gradlog.Run, kind: str, params: Any) -> None:
    """Every query restricted to ``params`` (norms of cosine and self-influence included),
    and the matrix's columns in the order the probe ids were asked (PROBE_IDS is not sorted)
    and for ``None`` (all probes), against brute force per record."""
    e = Everything(run)
    names = e.params if params is None else params
    rtol = 1e-5 if run.params.column("dtype")[0].as_py() == "float32" else 1e-9

    def brute(probe: int, lr: float | None = None) -> dict[int, float]:
        per = np.zeros(e.n)
        rates = e.lr if lr is None else np.full(e.n, lr)
        for i in range(e.n):
            j = np.flatnonzero((e.p_step == e.step[i]) & (e.p_id == probe))[0]
            g = np.concatenate([e.g[p][i] for p in names])
            q = np.concatenate([e.q[p][j] for p in names])
            cos = np.linalg.norm(g) * np.linalg.norm(q) if kind == "cosine" else 1.0
            per[i] = rates[i] * float(g @ q) / cos
        return e.by_datum(per)

    want = {p: brute(p) for p in PROBE_IDS}
    for ids in (PROBE_IDS, [7, 100], None):
        m = run.influence_matrix(ids, kind=kind, params=params)
        if ids is not None:
            assert m.probe_ids.tolist() == ids
        assert sorted(m.probe_ids.tolist()) == sorted(ids or PROBE_IDS)
        for j, probe in enumerate(m.probe_ids.tolist()):
            _assert_scores(dict(zip(m.datum_ids.tolist(), m.scores[:, j].tolist())),
                           want[probe], rtol=rtol)
    for probe in PROBE_IDS:
        _assert_scores(_scores(run.influence(probe, top=None, kind=kind, params=params)),
                       want[probe], rtol=rtol)
    sq = sum((e.g[p] ** 2).sum(1) for p in names)
    _assert_scores(_scores(run.self_influence(params=params)), e.by_datum(e.lr * sq), rtol=rtol)
    # lr= in place of every record's rate
    _assert_scores(_scores(run.influence(7, top=None, kind=kind, params=params, lr=0.5)),
                   brute(7, lr=0.5), rtol=rtol)


def test_a_datum_twice_in_a_step_counts_one_step(tmp_store: Path) -> None:
    """n_steps counts distinct steps, and the score sums both records."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(4, 4, 3, seed=1)
    with gradlog.GradRecorder(model, tmp_store, backend="loop", dtype="float64") as rec:
        for step in range(2):
            rec.backward(F.cross_entropy(model(x), y, reduction="none"),
                         datum_ids=[0, 0, 1, 2], step=step, lr=0.1)
    run = gradlog.open(tmp_store)
    table = run.self_influence()
    got = {r["datum_id"]: r for r in table.to_pylist()}
    assert [got[d]["n_steps"] for d in (0, 1, 2)] == [2, 2, 2]
    sq = sum((run.grads(p, dtype=np.float64).reshape(8, -1) ** 2).sum(1)
             for p in run.param_names)
    ids = run.datums.column("datum_id").to_numpy()
    _assert_scores(_scores(table), {d: 0.1 * float(sq[ids == d].sum()) for d in (0, 1, 2)})
    movers = {r["datum_id"]: r for r in run.movers(top=None).to_pylist()}
    assert [movers[d]["n_steps"] for d in (0, 1, 2)] == [2, 2, 2]


def test_equal_scores_rank_by_ascending_datum_id(tmp_store: Path) -> None:
    """Datums 11 and 3 hold the same example in every batch: equal scores everywhere, ranked
    3 before 11 (README); a zero probe scores every datum 0, "neutral", in id order."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(4, 4, 3, seed=1)
    x[3], y[3] = x[0], y[0]
    with gradlog.GradRecorder(model, tmp_store, backend="loop", dtype="float64") as rec:
        for step in range(2):
            rec.backward(F.cross_entropy(model(x), y, reduction="none"),
                         datum_ids=[11, 5, 7, 3], step=step, lr=0.1)
    run = gradlog.open(tmp_store)
    order = run.self_influence().column("datum_id").to_pylist()
    assert order.index(3) + 1 == order.index(11)
    probe = {p: torch.randn(tuple(s)) for p, s in
             zip(run.param_names, run.params.column("shape").to_pylist())}
    for top in (None, 4):
        order = run.influence(probe, top=top).column("datum_id").to_pylist()
        assert order.index(3) + 1 == order.index(11)
    zero = run.influence({p: v * 0 for p, v in probe.items()}, top=None)
    assert zero.column("datum_id").to_pylist() == [3, 5, 7, 11]
    assert set(zero.column("kind").to_pylist()) == {"neutral"}


def test_influence_errors(run: gradlog.Run) -> None:
    with pytest.raises(SelectionError, match=r"probe 8 is not recorded.*Nearest probe ids: 7"):
        run.influence(8)
    with pytest.raises(SelectionError, match="parameter 'nope' is not recorded"):
        run.influence(7, params="nope")
    with pytest.raises(InputError, match="shape"):
        run.influence({"0.bias": np.zeros(5)})
    with pytest.raises(InputError, match="no entry for"):
        run.influence({"0.bias": np.zeros(6)}, params=["0.bias", "2.bias"])
    with pytest.raises(InputError, match="probe must be"):
        run.influence("7")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="top"):
        run.influence(7, top=0)


def test_self_influence_equals_brute_force(run: gradlog.Run) -> None:
    e = Everything(run)
    rtol = 1e-6 if run.params.column("dtype")[0].as_py() == "float32" else 1e-10
    for weighted in (False, True):
        sq = sum((e.g[p] ** 2).sum(1) for p in e.params)
        want = e.by_datum(e.lr * (e.weight if weighted else 1.0) * sq)
        table = run.self_influence(weighted=weighted)
        _assert_scores(_scores(table), want, rtol=rtol)
        np.testing.assert_allclose(
            table.column("score").to_numpy(), sorted(want.values(), reverse=True), rtol=rtol
        )
    assert run.self_influence(top=4).num_rows == 4


# -- movers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", ["2.weight", ["0.weight", "0.bias"], None])
@pytest.mark.parametrize("steps", [None, slice(4, 12), [2, 8]])
def test_movers_equal_brute_force(run: gradlog.Run, params: Any, steps: Any) -> None:
    e = Everything(run)
    names = [params] if isinstance(params, str) else (params or e.params)
    if steps is None:
        keep = np.ones(e.n, bool)
    elif isinstance(steps, slice):
        keep = (e.step >= steps.start) & (e.step < steps.stop)
    else:
        keep = np.isin(e.step, steps)
    contrib = -(e.lr * e.weight)[:, None] * e.flat(names)  # c_r = -lr_t w_r g_r
    delta = contrib[keep].sum(0)
    norm = float(np.linalg.norm(delta))
    want = e.by_datum(contrib @ delta / norm, keep)
    table = run.movers(params, steps=steps, top=None)
    _assert_scores(_scores(table), want)
    assert float(table.schema.metadata[b"change_norm"]) == pytest.approx(norm, rel=1e-10)
    assert sum(want.values()) == pytest.approx(norm, rel=1e-9)  # scores sum to ||delta||
    np.testing.assert_allclose(
        table.column("fraction").to_numpy(), table.column("score").to_numpy() / norm, rtol=1e-12
    )
    top = run.movers(params, steps=steps, top=2).to_pylist()
    n_pos = min(2, sum(v > 0 for v in want.values()))
    n_neg = min(2, sum(v < 0 for v in want.values()))
    assert [r["kind"] for r in top] == ["proponent"] * n_pos + ["opponent"] * n_neg
    assert top[0]["datum_id"] == max(want, key=lambda d: want[d])


# -- similarity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dot", "cosine"])
def test_similarity_equals_brute_force(run: gradlog.Run, kind: str) -> None:
    e = Everything(run)

    def brute(params: list[str], rows_a: np.ndarray, rows_b: np.ndarray) -> np.ndarray:
        a, b = e.flat(params, rows_a), e.flat(params, rows_b)
        out = a @ b.T
        if kind == "cosine":
            out = out / np.outer(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
        return out

    pos = {int(r): i for i, r in enumerate(e.row)}
    # within a step, across steps, across a datum's trajectory, and everything x everything
    cases = [
        ({"step": 2}, None),
        ({"step": 2}, {"step": 10}),
        ({"datum": [3, 4]}, {"step": slice(0, 6)}),
        (None, None),
    ]
    for a, b in cases:
        rec_a = run.records(**(a or {}))
        rec_b = rec_a if b is None and a is not None else run.records(**(b or {}))
        ia = np.array([pos[r] for r in rec_a.column("row").to_pylist()])
        ib = np.array([pos[r] for r in rec_b.column("row").to_pylist()])
        for params in (["2.weight"], e.params):
            got = run.similarity(params, a=a, b=b, kind=kind)
            np.testing.assert_allclose(got, brute(params, ia, ib), rtol=1e-9, atol=1e-12)
    # a table in the caller's own order keeps that order
    table = run.records(step=6).take([3, 0, 2, 1])
    ia = np.array([pos[r] for r in table.column("row").to_pylist()])
    np.testing.assert_allclose(
        run.similarity(None, a=table, b={"step": 0}, kind=kind),
        brute(e.params, ia, np.flatnonzero(e.step == 0)),
        rtol=1e-9,
    )


def test_similarity_errors(run: gradlog.Run) -> None:
    with pytest.raises(InputError, match="kind"):
        run.similarity(kind="l2")
    with pytest.raises(InputError, match="unknown keys"):
        run.similarity(a={"steps": 3})
    with pytest.raises(InputError, match="a must be"):
        run.similarity(a=3)
    with pytest.raises(SelectionError, match="step 3 is not a committed step"):
        run.similarity(a={"step": 3})


# -- memory --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide_run(tmp_path_factory: pytest.TempPathFactory) -> gradlog.Run:
    """A store of ~4 MiB: 16 steps x 16 data x 16 KiB of gradients."""
    path = tmp_path_factory.mktemp("wide") / "wide.gradlog"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 96), nn.Tanh(), nn.Linear(96, 10))
    x, y = _data(16 * 16, 32, 10, seed=4)
    probes = _data(2, 32, 10, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradlog.GradRecorder(
        model, path, optimizer=opt, probes=(_probe_loss, probes), check_every=0
    ) as rec:
        for idx in torch.arange(16 * 16).split(16):
            rec.backward(
                F.cross_entropy(model(x[idx]), y[idx], reduction="none"), datum_ids=idx % 100
            )
            opt.step()
            opt.zero_grad()
    return gradlog.open(path)


def _peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Result of fn() and the peak of traced allocations above what was live before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_scans_stay_under_a_memory_cap_smaller_than_the_store(wide_run: gradlog.Run) -> None:
    run = wide_run
    grad_bytes = sum(run.params.column("numel").to_pylist()) * 4 * run.datums.num_rows
    cap = 1 << 20
    assert run.nbytes > 3 * cap and grad_bytes > 3 * cap
    run.datums, run.probes  # noqa: B018 - the index is loaded before measuring
    scans: dict[str, Callable[..., Any]] = {
        "influence": lambda m: run.influence(1, top=None, max_memory=m),
        "movers": lambda m: run.movers(None, top=None, max_memory=m),
        "similarity": lambda m: run.similarity(
            a={"step": slice(0, 12)}, kind="cosine", max_memory=m
        ),
        "stats": lambda m: run.stats("0.weight", max_memory=m),
        "influence_matrix": lambda m: run.influence_matrix(max_memory=m).scores,
    }
    for name, scan in scans.items():
        # Once first, unmeasured: a first call also pays one-time costs that are not the
        # scan's working memory (imports; interning the shard paths, where the interpreter's
        # table of interned strings may grow by MiBs, depending on the tests run before).
        scan(cap)
        capped, peak = _peak(lambda scan=scan: scan(cap))
        result = capped.nbytes if isinstance(capped, np.ndarray) else 0  # not counted
        assert peak <= cap + result, f"{name} held {peak} bytes with max_memory={cap}"
        free = scan(None)
        if isinstance(free, dict):
            numbers = {k for k, v in free.items() if isinstance(v, float)}
            assert {k: free[k] for k in numbers} == pytest.approx(
                {k: capped[k] for k in numbers}, rel=1e-9
            ), name
            assert {k: v for k, v in free.items() if k not in numbers} == {
                k: v for k, v in capped.items() if k not in numbers
            }, name
        elif isinstance(free, np.ndarray) and name == "influence_matrix":
            # float32 products (matrix.py): blocks of other sizes round differently, ~1e-7
            # of the product of the norms
            np.testing.assert_allclose(capped, free, rtol=0, atol=1e-6 * abs(free).max(),
                                       err_msg=name)
        elif isinstance(free, np.ndarray):
            np.testing.assert_allclose(capped, free, rtol=1e-9, atol=1e-15, err_msg=name)
        else:  # the block size changes only the summation order
            np.testing.assert_allclose(
                capped.column("score").to_numpy(),
                free.column("score").to_numpy(),
                rtol=1e-9,
                atol=1e-15,
            )


def test_a_cap_below_one_chunk_is_refused_clearly(wide_run: gradlog.Run) -> None:
    with pytest.raises(MemoryTooSmallError, match=r"max_memory=10000 bytes is too small.*>="):
        wide_run.influence(0, max_memory=10_000)
    assert memory_bytes("1.5MiB") == 1536 * 1024 and memory_bytes("2GB") == 2 * 10**9
    with pytest.raises(InputError, match="not a size"):
        memory_bytes("lots")


def test_a_cap_error_quotes_the_callers_cap_and_a_minimum_that_suffices(
    wide_run: gradlog.Run, tmp_path: Path
) -> None:
    """Scans that split the cap (similarity's two sides, export's row groups) or keep their
    own arrays beside it (movers, influence) name the cap the caller passed and a minimum
    with which the call then succeeds."""
    run = wide_run
    q = {"0.weight": np.ones((96, 32))}
    calls: dict[str, Callable[[Any], Any]] = {
        "export parquet": lambda m: run.export(tmp_path / "e.parquet", max_memory=m),
        "export npz": lambda m: run.export(tmp_path / "e.npz", max_memory=m),
        "similarity": lambda m: run.similarity(a={"step": [0, 1]}, b={"step": 2}, max_memory=m),
        "similarity of a with itself": lambda m: run.similarity("0.weight", max_memory=m),
        "movers": lambda m: run.movers(max_memory=m),
        "influence of a probe": lambda m: run.influence(0, max_memory=m),
        "influence of a gradient": lambda m: run.influence(q, max_memory=m),
    }
    for name, call in calls.items():
        with pytest.raises(MemoryTooSmallError, match=r"max_memory=4096 bytes is too small") as e:
            call(4096)  # far too small for one row
        need = int(str(e.value).rsplit(">= ", 1)[1].rstrip("."))
        assert need > 4096, name
        call(need)  # enough, as the message says
        with pytest.raises(MemoryTooSmallError, match=rf"max_memory={need - 1} bytes.*>= {need}"):
            call(need - 1)  # and the least: one byte less is refused


def test_progress_bar(wide_run: gradlog.Run, capsys: pytest.CaptureFixture[str]) -> None:
    wide_run.influence(0, top=2, progress=True)
    assert "influence" in capsys.readouterr().err


# -- learning rates ------------------------------------------------------------------------------
def test_missing_learning_rate_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "nolr.gradlog"
    _record(path, lr=False)
    run = gradlog.open(path)
    for call in (lambda: run.influence(7), run.self_influence, lambda: run.movers("0.bias")):
        with pytest.raises(MissingLearningRateError, match=r"lr=.*optimizer=.*pass lr= here"):
            call()
    e = Everything(run)
    want = e.by_datum(0.5 * sum((e.g[p] ** 2).sum(1) for p in e.params))
    _assert_scores(_scores(run.self_influence(lr=0.5)), want, rtol=1e-6)
    assert run.influence(7, lr=0.5, top=None).num_rows == len(set(e.datum))


# -- probes -------------------------------------------------------------------------------------
def _train(probes: Any, backend: str, steps: int = 6) -> tuple[nn.Module, Any, Path, Any]:
    """A dropout MLP trained with SGD + momentum; returns model, optimizer state, store, rng."""
    root = Path(__import__("tempfile").mkdtemp())
    path = root / "run.gradlog"
    torch.manual_seed(0)
    model = _mlp(dropout=0.3)
    x, y = _data(48, 4, 3, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1], reduction="none")

    with gradlog.GradRecorder(model, path, backend=backend, probes=probes, optimizer=opt) as rec:
        for idx in torch.arange(48).split(8)[:steps]:
            if backend == "vmap":
                rec.step(loss_fn, (x[idx], y[idx]), datum_ids=idx)
            else:
                rec.backward(loss_fn(model, (x[idx], y[idx])), datum_ids=idx)
            opt.step()
            opt.zero_grad()
    return model, copy.deepcopy(opt.state_dict()), path, torch.random.get_rng_state()


@pytest.mark.parametrize("backend", ["loop", "vmap", "hooks"])
def test_probes_do_not_change_training(backend: str) -> None:
    from gradlog.backends import BACKENDS

    if backend not in BACKENDS:
        pytest.skip(f"no {backend} backend in this gradlog")
    probes = (_probe_loss, _data(5, 4, 3, seed=9))
    plain, plain_opt, plain_path, plain_rng = _train(None, backend)
    probed, probed_opt, probed_path, probed_rng = _train(probes, backend)
    try:
        for (name, a), (_, b) in zip(plain.named_parameters(), probed.named_parameters()):
            assert torch.equal(a, b), name  # bitwise
        for k, state in plain_opt["state"].items():
            assert torch.equal(state["momentum_buffer"], probed_opt["state"][k]["momentum_buffer"])
        assert torch.equal(plain_rng, probed_rng)  # the RNG stream training sees
        run_a, run_b = gradlog.open(plain_path), gradlog.open(probed_path)
        for p in run_a.param_names:
            assert np.array_equal(run_a.grads(p), run_b.grads(p))
        assert run_a.probe_ids == [] and run_b.probe_ids == [0, 1, 2, 3, 4]
        assert run_b.probes.num_rows == 5 * run_b.steps.num_rows
    finally:
        shutil.rmtree(plain_path.parent)
        shutil.rmtree(probed_path.parent)


def test_probe_gradients_are_those_at_the_step(tmp_store: Path) -> None:
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(24, 4, 3, seed=1)
    px, py = _data(3, 4, 3, seed=2)
    ptok = torch.randn(3, 5)  # per-token probe losses: (P, T), mean over tokens

    def probe_loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        base = F.cross_entropy(m(batch[0]), batch[1], reduction="none")  # (P,)
        return base[:, None] * (1 + ptok**2)  # (P, T)

    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    expected: dict[int, dict[str, np.ndarray]] = {}
    with gradlog.GradRecorder(
        model, tmp_store, probes=(probe_loss, (px, py)), probe_ids=[5, 6, 9], every=2
    ) as rec:
        for step, idx in enumerate(torch.arange(24).split(6)):
            rec.backward(
                F.cross_entropy(model(x[idx]), y[idx], reduction="none"), datum_ids=idx, step=step
            )
            if step % 2 == 0:  # naive: one forward per probe on a copy, at this step's values
                ref = copy.deepcopy(model)
                named = dict(ref.named_parameters())
                per = {n: [] for n in named}
                for b in range(3):
                    base = F.cross_entropy(ref(px[b : b + 1]), py[b : b + 1])
                    loss = (base * (1 + ptok[b] ** 2)).mean()
                    for n, g in zip(named, torch.autograd.grad(loss, list(named.values()))):
                        per[n].append(g.numpy())
                expected[step] = {n: np.stack(v) for n, v in per.items()}
            opt.step()
            opt.zero_grad()
    run = gradlog.open(tmp_store)
    assert run.probes.column("step").to_pylist() == [0, 0, 0, 2, 2, 2]
    assert run.probe_ids == [5, 6, 9]
    for step, grads in expected.items():
        records = run.probe_records(step=step)
        assert records.column("probe_id").to_pylist() == [5, 6, 9]
        for name, want in grads.items():
            np.testing.assert_allclose(run.probe_grads(name, step=step), want, rtol=1e-5, atol=1e-7)
            norms = records.column(f"norm/{name}").to_numpy()
            np.testing.assert_allclose(
                norms, np.linalg.norm(want.reshape(3, -1), axis=1), rtol=1e-5
            )
    one = run.probe_grads("0.weight", probe=6, step=[0, 2], as_torch=True)
    assert isinstance(one, torch.Tensor) and one.shape == (2, 6, 4)
    validate_store(tmp_store)  # the training part of the store still follows the spec


def test_probe_parts_are_written_before_the_commit(
    tmp_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradlog.store.writer import StoreWriter

    seen: list[int] = []
    original = StoreWriter.commit

    def commit(self: StoreWriter, step_row: Any) -> None:
        part = self.path / "probes" / "index" / f"step-{int(step_row['step']):012d}.parquet"
        assert part.is_file(), "the probe part must exist before the step commits"
        seen.append(int(step_row["step"]))
        original(self, step_row)

    monkeypatch.setattr(StoreWriter, "commit", commit)
    _record(tmp_store)
    assert len(seen) == 8
    # an uncommitted step's probe part is invisible
    run = gradlog.open(tmp_store)
    last = run.steps.column("step").to_pylist()[-1]
    (tmp_store / "steps" / f"step-{last:012d}.parquet").unlink()
    (tmp_store / "probes" / "index" / ".step-000000000099.parquet.tmp").write_bytes(b"junk")
    run = gradlog.open(tmp_store)
    assert last not in run.probes.column("step").to_pylist()
    assert run.probes.num_rows == N_PROBES * run.steps.num_rows


def test_probe_store_follows_the_schemas(run: gradlog.Run) -> None:
    def schema(name: str) -> Draft202012Validator:
        text = files("gradlog.schemas").joinpath(name).read_text(encoding="utf-8")
        loaded = json.loads(text)
        Draft202012Validator.check_schema(loaded)
        return Draft202012Validator(loaded)

    attrs = json.loads((run.path / "probes" / "zarr.json").read_text())["attributes"]
    schema("probes.schema.json").validate(attrs)
    rows = schema("probe_index.schema.json")
    for part in sorted((run.path / "probes" / "index").iterdir()):
        table = pq.read_table(part)
        assert part.name == f"step-{table.column('step')[0].as_py():012d}.parquet"
        assert table.column("probe_id").to_pylist() == PROBE_IDS
        for record in table.to_pylist():
            rows.validate(record)
    r = run.probes.column("row").to_pylist()
    assert r == list(range(len(r)))
    for name in run.param_names:
        meta = json.loads((run.path / "probes" / "grads" / name / "zarr.json").read_text())
        assert meta["codecs"][-1]["name"] == "crc32c"
        assert meta["dimension_names"][0] == "record"
    validate_store(run.path)


def test_probe_argument_errors(tmp_store: Path) -> None:
    model = _mlp()
    x, y = _data(8, 4, 3, seed=1)

    def train_one(**options: Any) -> None:
        with gradlog.GradRecorder(model, tmp_store, overwrite=True, **options) as rec:
            rec.backward(F.cross_entropy(model(x), y, reduction="none"))

    with pytest.raises(InputError, match=r"pair \(loss_fn, batch\)"):
        gradlog.GradRecorder(model, tmp_store, probes=(x, y))
    with pytest.raises(InputError, match="probe_ids must be 8 integers"):
        train_one(probes=(_probe_loss, (x, y)), probe_ids=[1, 2])
    with pytest.raises(InputError, match="distinct"):
        train_one(probes=(_probe_loss, (x, y)), probe_ids=[1] * 8)
    with pytest.raises(InputError, match="depend on the model"):
        train_one(probes=(lambda m, b: torch.ones(3), None))
    with pytest.raises(InputError, match=r"^the probes' loss_fn .*shape \(B,\)"):  # reduced
        train_one(probes=(lambda m, b: F.cross_entropy(m(x), y), None))
    with pytest.raises(NonFiniteLossError, match=r"probe\(s\) \[2\]"):
        train_one(
            probes=(lambda m, b: m(x).sum(1) * torch.tensor([1.0, 1.0, np.inf, *[1.0] * 5]), None)
        )


# -- queries -----------------------------------------------------------------------------------
def test_trajectory(run: gradlog.Run) -> None:
    datum = int(run.datums.column("datum_id")[0].as_py())
    traj = run.trajectory("0.weight", datum)
    records = run.records(datum=datum)
    assert traj.steps.tolist() == records.column("step").to_pylist()
    assert np.array_equal(traj.grads, run.grads("0.weight", datum=datum))
    assert traj.grads.shape == (len(traj.steps), 6, 4) and traj.grads.dtype == np.float32
    assert isinstance(run.trajectory("0.weight", datum, as_torch=True).grads, torch.Tensor)
    with pytest.raises(SelectionError, match="datum 999 has no record"):
        run.trajectory("0.weight", 999)
    with pytest.raises(SelectionError, match="one datum id"):
        run.trajectory("0.weight", [1, 2])  # type: ignore[arg-type]


def test_stats_equal_numpy(run: gradlog.Run) -> None:
    g = run.grads("0.weight", step=[2, 4], dtype=np.float64)
    got = run.stats("0.weight", step=[2, 4])
    assert got["shape"] == [g.shape[0], 6, 4] and got["n_records"] == g.shape[0]
    for key, want in (
        ("norm", np.linalg.norm(g)),
        ("mean", g.mean()),
        ("std", g.std()),
        ("min", g.min()),
        ("max", g.max()),
    ):
        assert got[key] == pytest.approx(want, rel=1e-9, abs=1e-15), key
    norms = run.norms("0.weight", step=[2, 4]).column("norm").to_numpy()
    assert got["record_norm_max"] == norms.max()


def test_export_round_trips(run: gradlog.Run, tmp_path: Path) -> None:
    sel = {"step": slice(2, 9)}
    records = run.records(**sel)
    summary = run.export(tmp_path / "out.parquet", params=["0.weight", "2.bias"], **sel)
    assert summary["records"] == records.num_rows and summary["format"] == "parquet"
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("datum_id").to_pylist() == records.column("datum_id").to_pylist()
    shapes = json.loads(table.schema.metadata[b"gradlog.shapes"])
    assert shapes == {"0.weight": [6, 4], "2.bias": [3]}
    got = parquet_grads(table, "0.weight")  # the column's nested lists carry the shape
    assert got.shape[1:] == (6, 4) and np.array_equal(got, run.grads("0.weight", **sel))
    run.export(tmp_path / "out.npz", **sel)
    with np.load(tmp_path / "out.npz") as z:
        assert z["datum_id"].tolist() == records.column("datum_id").to_pylist()
        for name in run.param_names:
            assert np.array_equal(z[f"grads/{name}"], run.grads(name, **sel))
        assert np.allclose(z["lr"], records.column("lr").to_numpy())
    with pytest.raises(InputError, match="parquet"):
        run.export(tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists()


def test_xarray_and_dask(run: gradlog.Run) -> None:
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    da = run.to_xarray("0.weight", step=[2, 4])
    records = run.records(step=[2, 4])
    assert da.dims == ("record", "dim_0", "dim_1") and da.shape == (records.num_rows, 6, 4)
    assert da.coords["step"].values.tolist() == records.column("step").to_pylist()
    assert da.coords["datum_id"].values.tolist() == records.column("datum_id").to_pylist()
    assert np.array_equal(da.values, run.grads("0.weight", step=[2, 4]))
    by_step = da.groupby("step").sum()  # notebook style
    assert by_step.sizes["step"] == 2
    lazy = run.to_dask("0.weight")
    assert lazy.shape == (run.datums.num_rows, 6, 4)
    assert lazy.chunks[0][0] == 8  # one chunk per step of the first batch size
    assert np.array_equal(lazy.compute(), run.grads("0.weight"))
    sparse = run.to_dask("2.bias", datum=[3, 4])
    assert np.array_equal(sparse.compute(), run.grads("2.bias", datum=[3, 4]))
    assert np.array_equal(run.to_xarray("2.bias", lazy=True).values, run.grads("2.bias"))


def test_xarray_and_dask_missing(run: gradlog.Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xarray", None)
    monkeypatch.setitem(sys.modules, "dask", None)
    monkeypatch.setitem(sys.modules, "dask.array", None)
    with pytest.raises(MissingExtraError, match=r"pip install xarray .*'\.\[xarray\]'"):
        run.to_xarray("0.weight")
    with pytest.raises(ImportError, match=_NO_DASK):
        run.to_dask("0.weight")


def test_plot_figure(run: gradlog.Run, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    fig = run.plot(tmp_path / "f.png", datums=[3, 4], width=640, height=320)
    assert tuple(fig.get_size_inches() * fig.dpi) == (640, 320)
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SelectionError, match="datum 999"):
        run.plot(datums=[999])


def test_analysis_reads_the_golden_v1_store(tmp_path: Path) -> None:
    """Stores written before probes existed: no probes, and every analysis works."""
    stores = sorted(GOLDEN.glob("v1.store"))
    if not stores:
        pytest.skip("no golden v1 store")
    copy_ = tmp_path / "v1.store"
    shutil.copytree(stores[0], copy_)
    run = gradlog.open(copy_)
    assert run.probe_ids == [] and run.probes.num_rows == 0
    with pytest.raises(SelectionError, match="holds no probe: recorded without"):
        run.influence(0)
    name = run.param_names[0]
    shape = run.grads(name, step=run.steps.column("step")[0].as_py()).shape[1:]
    lr = None if run.datums.column("lr").null_count == 0 else 1.0
    table = run.influence({name: np.ones(shape)}, top=None, lr=lr)
    e_g = run.grads(name, dtype=np.float64).reshape(run.datums.num_rows, -1)
    rates = np.full(run.datums.num_rows, 1.0) if lr else run.datums.column("lr").to_numpy()
    assert float(np.sum(table.column("score").to_numpy())) == pytest.approx(
        float(np.sum(rates * e_g.sum(1))), rel=1e-9
    )
    assert run.similarity(name).shape == (run.datums.num_rows,) * 2


def test_norm_form_parameters_are_skipped_by_default_and_refused_by_name(
    tmp_store: Path,
) -> None:
    """A parameter recorded with form 'norm' keeps no gradient: params=None means every
    parameter that keeps gradients; naming a 'norm' one says how to choose others."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data(16, 4, 3, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradlog.GradRecorder(
        model, tmp_store, form={"2.bias": "norm"}, optimizer=opt,
        probes=(_probe_loss, _data(2, 4, 3, seed=2)),
    ) as rec:
        for idx in torch.arange(16).split(4):
            rec.backward(F.cross_entropy(model(x[idx]), y[idx], reduction="none"), datum_ids=idx)
            opt.step()
            opt.zero_grad()
    run = gradlog.open(tmp_store)
    kept = ["0.weight", "0.bias", "2.weight"]
    np.testing.assert_allclose(run.similarity(), run.similarity(kept), rtol=1e-12)
    assert run.movers(top=None) == run.movers(kept, top=None)
    assert run.influence(0, top=None) == run.influence(0, params=kept, top=None)
    assert run.export(tmp_store.parent / "e.npz")["params"] == kept
    for call in (
        lambda: run.similarity("2.bias"),
        lambda: run.movers(["0.bias", "2.bias"]),
        lambda: run.influence(0, params="2.bias"),
        lambda: run.export(tmp_store.parent / "e.npz", params="2.bias"),
    ):
        with pytest.raises(SelectionError, match=r"'2\.bias' .*form 'norm'.*params="):
            call()
    with pytest.raises(SelectionError, match=r"form 'norm'.*run\.norms"):
        run.stats("2.bias")
    assert run.self_influence().num_rows == 16  # from the index norms: every parameter
    assert run.norms("2.bias").num_rows == 16


def test_empty_selections(run: gradlog.Run, tmp_store: Path) -> None:
    model = _mlp()
    with gradlog.GradRecorder(model, tmp_store):
        pass  # nothing recorded
    empty = gradlog.open(tmp_store)
    assert empty.influence({"0.bias": np.zeros(6)}, lr=0.1).num_rows == 0
    assert empty.self_influence(lr=0.1).num_rows == 0
    assert empty.similarity().shape == (0, 0)
    assert empty.stats("0.bias")["norm"] is None
    assert empty.probe_ids == [] and empty.probes.num_rows == 0
    if importlib.util.find_spec("matplotlib") is not None:
        with pytest.raises(InputError, match="nothing to plot"):
            empty.plot()


def test_probes_continue_when_a_run_is_resumed(tmp_store: Path) -> None:
    model = _mlp()
    x, y = _data(24, 4, 3, seed=1)
    probes = (_probe_loss, _data(2, 4, 3, seed=2))

    def train(steps: range, **options: Any) -> None:
        with gradlog.GradRecorder(
            model, tmp_store, probes=probes, probe_ids=[3, 4], **options
        ) as rec:
            for step in steps:
                idx = torch.arange(step % 4 * 6, step % 4 * 6 + 6)
                rec.backward(
                    F.cross_entropy(model(x[idx]), y[idx], reduction="none"),
                    datum_ids=idx,
                    step=step,
                    lr=0.1,
                )

    train(range(3))
    stale = tmp_store / "probes" / "index" / "step-000000000099.parquet"
    shutil.copy(tmp_store / "probes" / "index" / "step-000000000002.parquet", stale)
    train(range(3, 5), resume=True)
    run = gradlog.open(tmp_store)
    assert not stale.exists()  # an uncommitted probe part is discarded on resume
    assert run.probes.column("step").to_pylist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert run.probes.column("row").to_pylist() == list(range(10))
    assert run.probe_grads("0.weight").shape == (10, 6, 4)
    assert run.influence(4, top=None).num_rows == 24
    recorder = gradlog.GradRecorder(model, tmp_store, probes=probes, probe_ids=[7, 8], resume=True)
    with pytest.raises(gradlog.GradlogError, match="probe ids"), recorder as rec:
        rec.backward(F.cross_entropy(model(x[:6]), y[:6], reduction="none"), step=9)


@pytest.mark.slow
def test_influence_example_runs(tmp_path: Path) -> None:
    import subprocess

    example = Path(__file__).resolve().parent.parent / "examples" / "influence.py"
    done = subprocess.run(
        [sys.executable, str(example), "--out", str(tmp_path / "i.gradlog"), "--steps", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "proponent  #1" in done.stdout and "largest self-influence" in done.stdout


def test_scans_refuse_damaged_chunks(tmp_store: Path) -> None:
    from gradlog.errors import StoreCorruptError

    _record(tmp_store)
    array = tmp_store / "grads" / "0.weight"  # chunk files: c/... (format 1), c.<k>... (2)
    files = [f for f in array.rglob("*") if f.is_file() and f.name != "zarr.json"]
    shard = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF  # one flipped byte in the middle of a stored gradient
    shard.write_bytes(bytes(data))
    run = gradlog.open(tmp_store)
    for scan in (
        lambda: run.influence(7),
        lambda: run.movers("0.weight"),
        lambda: run.similarity("0.weight"),
        lambda: run.stats("0.weight"),
    ):
        with pytest.raises(StoreCorruptError):
            scan()
    run.influence(7, params="2.weight")  # the other arrays still read


# -- factored store against the full store of the same run ------------------------------------
def _record_sequence(path: Path, form: str, dtype: str) -> None:
    """A sequence MLP (8 tokens per datum: rank-8 per-datum weight gradients) in ``dtype``,
    hooks backend, every setting seeded, so that each form records the same run."""
    torch.manual_seed(0)
    kind = getattr(torch, dtype)  # a float64 model: the full store's records exact too
    model = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3)).to(kind)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 8, 12, generator=gen), torch.randint(0, 3, (24, 8), generator=gen)
    probes = (torch.randn(2, 8, 12, generator=gen).to(kind),
              torch.randint(0, 3, (2, 8), generator=gen))
    x = x.to(kind)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        per_token = F.cross_entropy(m(b[0]).transpose(1, 2), b[1], reduction="none")  # (B, T)
        return per_token.mean(1)  # (B,)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(), gradlog.GradRecorder(
        model, path, backend="hooks", form=form, dtype=dtype, optimizer=opt,
        probes=(loss_fn, probes), check_every=0,
    ) as rec:
        # factors are asked for even where full would be smaller: they are what is tested
        warnings.filterwarnings("ignore", message=r".*form 'factors' at \d+ rows per datum")
        for step in range(4):
            idx = torch.arange(6 * step, 6 * step + 6)
            rec.step(loss_fn, (x[idx], y[idx]), datum_ids=idx)
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_factored_store_scores_equal_the_full_store(tmp_path: Path, dtype: str) -> None:
    """Influence and similarity computed in factors space (nothing rebuilt) equal those of
    the ``full`` store of the same run, to float rounding of the full store's values."""
    for form in ("full", "factors"):
        _record_sequence(tmp_path / f"{form}.gradlog", form, dtype)
    full, fact = gradlog.open(tmp_path / "full.gradlog"), gradlog.open(tmp_path / "factors.gradlog")
    assert fact.form_name("0.weight") == "factors" and full.form_name("0.weight") == "full"
    rtol = 1e-6 if dtype == "float32" else 1e-8  # float32: the full store's own rounding

    def close(ours: np.ndarray, theirs: np.ndarray) -> None:
        np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=rtol * np.abs(theirs).max())

    some = full.datums.take(np.arange(0, 24, 2))  # a block that is not every record
    for max_memory in (None, 200_000):  # one block; several (x against y blocks)
        kw = {"max_memory": max_memory}
        for probe in full.probe_ids:
            ours = fact.influence(probe, top=None, **kw).sort_by("datum_id")
            theirs = full.influence(probe, top=None, **kw).sort_by("datum_id")
            close(ours.column("score").to_numpy(), theirs.column("score").to_numpy())
        grad = {n: full.probe_grads(n)[0] for n in full.param_names}  # a user gradient
        close(fact.influence(grad, top=None, **kw).sort_by("datum_id").column("score")
              .to_numpy(), full.influence(grad, top=None, **kw).sort_by("datum_id")
              .column("score").to_numpy())
        for kind in ("dot", "cosine"):
            close(fact.similarity("0.weight", kind=kind, **kw),
                  full.similarity("0.weight", kind=kind, **kw))
            close(fact.similarity(a=some, kind=kind, **kw),
                  full.similarity(a=some, kind=kind, **kw))
            close(fact.similarity(a=some, b={"step": 3}, kind=kind, **kw),
                  full.similarity(a=some, b={"step": 3}, kind=kind, **kw))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_user_gradients_are_refused_up_front(
    run: gradlog.Run, tmp_path: Path, bad: float
) -> None:
    """A NaN or inf in a gradient the user gives made every score NaN: influence warned
    about "recorded gradients" and returned an empty table, influence_matrix returned NaN
    scores, run.project a NaN projection. Each now names the parameter and what it holds."""
    shapes = {p["name"]: tuple(p["shape"]) for p in run.params.to_pylist()}
    good = np.ones(shapes["2.weight"])
    g = good.copy()
    g[1, 2] = bad
    what = "NaN" if np.isnan(bad) else "inf"
    message = rf"gradient.* for '2\.weight' holds {what} \(1 of its \d+ entries\)"
    for value in (g, torch.from_numpy(g), torch.from_numpy(g).float().requires_grad_()):
        for kind in ("tracin", "cosine"):
            with pytest.raises(gradlog.InputError, match=message):
                run.influence({"2.weight": value}, kind=kind, params="2.weight")
        with pytest.raises(gradlog.InputError, match=message):
            run.influence_matrix({"2.weight": value[None]}, params="2.weight")
    with pytest.raises(gradlog.InputError, match=message):  # beside a finite parameter
        run.influence_matrix({"2.weight": np.stack([good, g]), "2.bias": np.ones((2, 3))})
    # finite gradients are scored as before
    assert run.influence({"2.weight": good}, params="2.weight", top=None).num_rows > 0
    assert np.isfinite(run.influence_matrix({"2.weight": good[None]}).scores).all()

    path = tmp_path / "proj.gradlog"
    _record_sequence(path, {"form": "projection", "dim": 8}, "float32")  # type: ignore[arg-type]
    proj = gradlog.open(path)
    w = np.ones((10, 12), dtype=np.float32)
    w[0, 0] = bad
    with pytest.raises(gradlog.InputError, match=rf"'0\.weight' holds {what}"):
        proj.project("0.weight", w)
    with pytest.raises(gradlog.InputError, match=rf"'0\.weight' holds {what}"):
        proj.project("0.weight", torch.from_numpy(w)[None])
    with pytest.raises(gradlog.InputError, match=rf"'0\.weight' holds {what}"):
        proj.influence({"0.weight": w}, params="0.weight", kind="tracin")
    assert np.isfinite(proj.project("0.weight", np.ones((10, 12)))).all()


def test_project_puts_a_gradient_in_the_space_of_each_forms_records(tmp_path: Path) -> None:
    """``run.project`` serves a run of mixed forms in one loop: a projection parameter's
    stored projection, the gradient itself where ``run.grads`` returns gradients in the
    parameter's shape; ``norm`` keeps none (refused, naming ``run.norms()``)."""
    from gradlog.forms import project as project_with

    path = tmp_path / "mixed.gradlog"
    forms = {"0.weight": {"form": "projection", "dim": 8}, "2.weight": {"form": "topk", "k": 3},
             "0.bias": "norm", "*": "full"}
    _record_sequence(path, forms, "float32")  # type: ignore[arg-type]
    run = gradlog.open(path)
    assert [run.form_name(n) for n in run.param_names] == ["projection", "norm", "topk", "full"]
    gen = torch.Generator().manual_seed(5)
    w0, w2, b2 = (torch.randn(*s, generator=gen) for s in ((10, 12), (3, 10), (2, 3)))
    torch.testing.assert_close(run.project("0.weight", w0),
                               project_with(w0, run.spec("0.weight")["form_spec"]))
    assert run.project("2.weight", w2) is w2  # topk: its records are kept entries, in shape
    assert run.project("2.bias", b2) is b2  # a batch of two
    np.testing.assert_array_equal(run.project("2.bias", b2[0].numpy()), b2[0].numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the projection's notice)
        records = {n: np.asarray(run.grads(n, step=3), dtype=np.float64)
                   for n in ("0.weight", "2.bias")}
    dots = {n: records[n].reshape(6, -1) @ np.asarray(run.project(n, g[0] if n == "2.bias"
                                                                  else g)).reshape(-1)
            for n, g in (("0.weight", w0), ("2.bias", b2))}
    np.testing.assert_allclose(dots["2.bias"], records["2.bias"] @ b2[0].double().numpy())
    assert dots["0.weight"].shape == (6,)
    with pytest.raises(gradlog.InputError, match=r"'2\.bias'.*shape \(4,\).*\(3,\)"):
        run.project("2.bias", np.ones(4))
    with pytest.raises(gradlog.SelectionError, match=r"'0\.bias'.*'norm'.*run\.norms\(\)"):
        run.project("0.bias", np.ones(10))


def test_self_influence_names_and_leaves_out_a_datum_of_non_finite_score(
        tmp_path: Path) -> None:
    """A datum whose recorded gradient is NaN (``sqrt`` at 0): ``influence`` warned and left
    it out of its ranking, ``self_influence`` sorted its NaN last, so ``top=k`` dropped it in
    silence. Both now name it."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(8, 3)
    x[5] = 0.0

    def losses(m: nn.Module, xb: torch.Tensor) -> torch.Tensor:
        out = m(xb)  # datum 5: sqrt(0) has an infinite slope, times 0: NaN
        return torch.sqrt((out ** 2).sum(1) * (xb.abs().sum(1) > 0)) + 0.1 * out.sum(1)

    path = tmp_path / "nan.gradlog"
    with pytest.warns(UserWarning, match="non-finite"), gradlog.GradRecorder(
            model, path, check_every=0) as rec:
        for step in range(2):
            ids = torch.arange(4 * step, 4 * step + 4)
            rec.backward(losses(model, x[ids]), datum_ids=ids, lr=0.1)
    run = gradlog.open(path)
    with pytest.warns(UserWarning, match=r"1 datum\(s\) have a non-finite score.*ids \[5\]"):
        table = run.self_influence(top=3)
    assert table.num_rows == 3 and 5 not in table.column("datum_id").to_pylist()
    with pytest.warns(UserWarning, match=r"ids \[5\]"):
        assert run.self_influence().num_rows == 7
