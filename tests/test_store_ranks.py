"""Several ranks' writers on one store, in one process (the protocol of FORMAT.md section 13,
without torch.distributed): disjoint rows, rank parts, rank 0's commit, a missing rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradlog
import gradlog.store.writer as writer_module
from gradlog.errors import StoreWriteError
from gradlog.store import format as fmt
from gradlog.store.verify import verify
from gradlog.store.writer import ParamSpec, StoreWriter

SPECS = {"w": ParamSpec("w", (3, 2), "float32", "float32"), "b": ParamSpec("b", (), "float32",
                                                                           "float32")}
ATTRS = {
    "format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "gradlog_version": "0.2.0",
    "torch_version": "2.4.0", "created": "2025-01-01T00:00:00+00:00",
    "model": {"class": "M", "n_parameters": 7},
    "config": {"params": ["*"], "backend": "loop", "batch_reduction": "mean",
               "token_reduction": "mean", "dtype": "float32", "every": 1, "check_every": 0,
               "check_rtol": 1e-4, "vmap_randomness": "different", "metadata": {},
               "compression": "none"},
    "backend": {"name": "loop", "distributed": {"world_size": 2, "torch_backend": "gloo"}},
}
ATTRS["config_hash"] = __import__("hashlib").sha256(
    __import__("json").dumps(ATTRS["config"], sort_keys=True, separators=(",", ":")).encode()
).hexdigest()


def _writers(path: Path, world: int, resume: bool = False) -> list[StoreWriter]:
    first = StoreWriter(path, attrs=ATTRS, specs=SPECS, durable=False, resume=resume,
                        rank=0, world_size=world)
    return [first] + [
        StoreWriter(path, attrs=ATTRS, specs=SPECS, durable=False, rank=r, world_size=world)
        for r in range(1, world)
    ]


def _record(writers: list[StoreWriter], steps: list[list[list[int]]], first_step: int = 0,
            first_id: int = 0) -> dict[int, tuple[np.ndarray, np.ndarray, float]]:
    """``steps[s][m][r]``: rank r's batch size in micro-round m of step s. Returns what was
    written per datum id: (w gradient, b gradient, weight)."""
    world = len(writers)
    rng = np.random.default_rng(0)
    written = {}
    next_id = first_id
    for s, rounds in enumerate(steps, start=first_step):
        pending = [dict(step=s, first_row=None, n_records=0, n_micro=0, tokens=0, lr=None,
                        loss_sum=0.0, time_compute_s=0.0, time_write_s=0.0) for _ in writers]
        for m, sizes in enumerate(rounds):
            for r, w in enumerate(writers):
                b = sizes[r]
                ids = np.arange(next_id + sum(sizes[:r]), next_id + sum(sizes[:r]) + b)
                gw = rng.standard_normal((b, 3, 2)).astype(np.float32)
                gb = rng.standard_normal(b).astype(np.float32)
                weight = 1.0 / (world * b)
                losses = rng.random(b)
                start, _ = w.append(
                    step=s, micro=m * world + r, datum_ids=ids, losses=losses,
                    weights=np.full(b, weight), lr=None, grads={"w": gw, "b": gb},
                    norms={"w": np.linalg.norm(gw.reshape(b, -1), axis=1), "b": np.abs(gb)},
                    plan=sizes,
                )
                p = pending[r]
                p["first_row"] = start if p["first_row"] is None else p["first_row"]
                p["n_records"] += b
                p["n_micro"] += 1
                p["tokens"] += b
                p["loss_sum"] += float(losses.sum())
                for i, d in enumerate(ids.tolist()):
                    written[d] = (gw[i], gb[i], weight)
            next_id += sum(sizes)
        for w, p in reversed(list(zip(writers, pending))):  # rank 0 last: it waits anyway
            row = {k: v for k, v in p.items() if k != "loss_sum"}
            row["loss_mean"] = p["loss_sum"] / p["n_records"]
            w.commit(row)
    return written


sizes = st.integers(1, 5)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), world=st.integers(2, 3))
def test_ranks_write_disjoint_rows_and_commit_together(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, world: int
) -> None:
    steps = data.draw(st.lists(st.lists(st.lists(sizes, min_size=world, max_size=world),
                                        min_size=1, max_size=2), min_size=1, max_size=3))
    path = tmp_path_factory.mktemp("ranks") / "run.gradlog"
    writers = _writers(path, world)
    written = _record(writers, steps)
    for w in reversed(writers):
        w.close()
    report = verify(path)
    assert report.ok, [c.problems for c in report.checks]
    run = gradlog.open(path)
    assert run.steps.column("n_micro").to_pylist() == [world * len(r) for r in steps]
    assert run.steps.column("n_records").to_pylist() == [sum(map(sum, r)) for r in steps]
    ids = run.datums.column("datum_id").to_pylist()
    assert sorted(ids) == sorted(written)
    rows = run.datums.column("row").to_pylist()
    assert len(set(rows)) == len(rows)
    c = steps[0][0] and max(steps[0][0])
    for micro_rows in _rows_by_part(run):
        assert micro_rows[0] % c == 0  # every rank's call starts at a shard boundary
    got_w, got_b = run.grads("w"), run.grads("b")
    for i, d in enumerate(ids):
        np.testing.assert_array_equal(got_w[i], written[d][0])
        np.testing.assert_array_equal(got_b[i], written[d][1])
    np.testing.assert_allclose(
        np.asarray(run.steps.column("loss_mean")),
        [np.mean(run.records(step=s).column("loss")) for s in run.steps.column("step").to_pylist()],
    )


def _rows_by_part(run: gradlog.Run) -> list[list[int]]:
    table = run.datums
    parts: dict[tuple[int, int], list[int]] = {}
    for s, m, r in zip(table.column("step").to_pylist(), table.column("micro").to_pylist(),
                       table.column("row").to_pylist()):
        parts.setdefault((s, m), []).append(r)
    return list(parts.values())


def test_a_missing_rank_leaves_its_step_uncommitted_and_resume_discards_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "RANK_COMMIT_TIMEOUT_S", 0.3)
    path = tmp_path / "run.gradlog"
    writers = _writers(path, 2)
    _record(writers, [[[2, 3]], [[2, 2]]])
    # step 2: rank 1 writes its records but dies before its rank part
    w0, w1 = writers
    _record([w0], [[[2, 2]]], first_step=2, first_id=100)  # rank 0's share (plan of 1 rank)
    with pytest.raises(StoreWriteError, match=r"rank\(s\) \[1\] did not finish step 2"):
        w0.close()
    w1.close()
    run = gradlog.open(path)
    assert run.steps.column("step").to_pylist() == [0, 1]
    assert verify(path).ok
    # rank 1 had written a rank part of step 2 in an earlier attempt: resume removes it
    (path / "ranks" / fmt.index_part_name(2, 1)).write_bytes(
        (path / "ranks" / fmt.index_part_name(1, 1)).read_bytes()
    )
    writers = _writers(path, 2, resume=True)
    assert not (path / "ranks" / fmt.index_part_name(2, 1)).exists()
    _record(writers, [[[1, 2]]], first_step=2, first_id=200)
    for w in reversed(writers):
        w.close()
    run = gradlog.open(path)
    assert run.steps.column("step").to_pylist() == [0, 1, 2]
    assert sorted(run.records(step=2).column("datum_id").to_pylist()) == [200, 201, 202]
    assert verify(path).ok
