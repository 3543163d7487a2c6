"""The background writer: backpressure, errors on the caller's thread, full disks, concurrent
readers, lossy dtypes within their documented error, resume, and crafted stores.

Faults are injected at the store layer (``gradlog.store.writer._write_file``, the one function
that writes shard files, and ``_write_parquet_atomic`` for parquet parts). Expected gradients
come from a naive per-datum ``torch.autograd.grad`` loop, never from gradlog.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradlog
from gradlog import errors
from gradlog.store import writer as writer_module
from gradlog.store.verify import verify
from gradlog.testing.schemas import validate_store

GOLDEN = Path(__file__).resolve().parent / "golden"
B, STEPS = 4, 6


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 5, generator=gen), torch.randn(B, 3, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = next(model.parameters())
    x, y = x.to(p.device, p.dtype), y.to(p.device, p.dtype)
    return ((model(x) - y) ** 2).sum(1)  # (B,)


def _oracle(model: nn.Module, step: int) -> dict[str, np.ndarray]:
    x, y = _batch(step)
    named = dict(model.named_parameters())
    out: dict[str, list[np.ndarray]] = {n: [] for n in named}
    for b in range(B):
        loss = _loss(model, x[b : b + 1], y[b : b + 1]).sum()
        gs = torch.autograd.grad(loss, list(named.values()))
        for n, g in zip(named, gs):
            out[n].append(g.detach().numpy().copy())
    return {n: np.stack(v) for n, v in out.items()}


def _train(
    path: Path,
    steps: range = range(STEPS),
    *,
    before_step: Callable[[int, Any], None] | None = None,
    model: nn.Module | None = None,
    **kwargs: Any,
) -> dict[int, dict[str, np.ndarray]]:
    """Record ``steps``; returns the oracle's per-datum gradients of each step."""
    model = model if model is not None else _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {}
    kwargs.setdefault("backend", "loop")
    with gradlog.GradRecorder(model, path, **kwargs) as rec:
        for step in steps:
            if before_step is not None:
                before_step(step, rec)
            expected[step] = _oracle(model, step)
            ids = range(step * B, step * B + B)
            rec.backward(_loss(model, *_batch(step)), step=step, datum_ids=ids)
            opt.step()
            opt.zero_grad()
    return expected


def _assert_holds(
    path: Path, expected: dict[int, dict[str, np.ndarray]], rtol: float = 1e-5
) -> None:
    run = gradlog.open(path)
    assert run.steps.column("step").to_pylist() == sorted(expected)
    for step, grads in expected.items():
        for name, g in grads.items():
            np.testing.assert_allclose(run.grads(name, step=step), g, rtol=rtol, atol=1e-6)


# -- backpressure and errors ------------------------------------------------------------------
def test_a_slow_writer_blocks_backward_and_drops_nothing(
    tmp_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer_module._write_file
    calls: list[float] = []

    def slow(path: Path, buffers: list[Any]) -> int:
        time.sleep(0.02)
        calls.append(time.perf_counter())
        return real(path, buffers)

    monkeypatch.setattr(writer_module, "_write_file", slow)
    stats: dict[str, float] = {}
    times: list[float] = []

    def timed(step: int, rec: Any) -> None:
        times.append(time.perf_counter())
        stats.update(rec._writer.stats)

    expected = _train(tmp_store, before_step=timed, queue_bytes=1, durable=False)
    assert len(calls) == 4 * STEPS  # every shard of every step: nothing dropped
    assert stats["blocked_s"] > 0.05  # backward waited for the writer (4 shards x 20 ms/step)
    assert stats["max_queued_bytes"] <= 4 * B * (5 * 6 + 6 + 6 * 3 + 3)  # one batch at a time
    _assert_holds(tmp_store, expected)
    assert verify(tmp_store).ok


def test_a_generous_queue_does_not_block(tmp_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = writer_module._write_file

    def held(path: Path, buffers: list[Any]) -> int:
        gate.wait(10)  # the writer is stuck until every step was handed over
        return real(path, buffers)

    monkeypatch.setattr(writer_module, "_write_file", held)
    handed = []
    expected = _train(
        tmp_store,
        before_step=lambda s, rec: handed.append(s) if s < STEPS - 1 else gate.set(),
        queue_bytes=1 << 20,
    )
    assert handed == list(range(STEPS - 1))  # backward never waited on the stuck writer
    _assert_holds(tmp_store, expected)


def _enospc_after(monkeypatch: pytest.MonkeyPatch, n_ok: int) -> list[Path]:
    real = writer_module._write_file
    written: list[Path] = []

    def full(path: Path, buffers: list[Any]) -> int:
        if len(written) >= n_ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        written.append(path)
        return real(path, buffers)

    monkeypatch.setattr(writer_module, "_write_file", full)
    return written


def test_a_full_disk_is_a_clear_error_and_committed_steps_stay_intact(
    tmp_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = tmp_store.with_name("reference.gradlog")
    expected = _train(reference)
    _enospc_after(monkeypatch, n_ok=4 * 3 + 2)  # steps 0-2 whole, step 3 dies mid-way
    with pytest.raises(errors.StoreWriteError) as info:
        _train(tmp_store)
    message = str(info.value)
    assert "No space left on device" in message and "step 3 (micro-batch 0)" in message
    assert "Free disk space" in message and "resume=True" in message
    assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()
    run = gradlog.open(tmp_store)
    committed = run.steps.column("step").to_pylist()
    assert committed == [0, 1, 2]
    assert f"Steps up to {committed[-1]} are committed" in message
    _assert_holds(tmp_store, {s: expected[s] for s in committed})
    assert verify(tmp_store).ok  # step 3's partial shards are uncommitted: invisible
    # ... and recording continues after freeing space
    more = _train(tmp_store, range(3, STEPS), resume=True, model=_replayed(3))
    _assert_holds(tmp_store, {**{s: expected[s] for s in committed}, **more})
    for s in more:
        for name in more[s]:
            np.testing.assert_allclose(more[s][name], expected[s][name], rtol=1e-5, atol=1e-7)


def _replayed(steps: int) -> nn.Module:
    """The model after ``steps`` SGD steps of _train, for resuming at ``steps``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        _loss(model, *_batch(step)).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def test_enospc_while_committing_raises_at_exit(
    tmp_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer_module._write_parquet_atomic

    def full(table: Any, where: Any) -> None:
        if "steps" in str(where) and "000000000005" in str(where):  # the last commit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
        real(table, where)

    monkeypatch.setattr(writer_module, "_write_parquet_atomic", full)
    with pytest.raises(errors.StoreWriteError, match=r"commit of step 5.*No space left"):
        _train(tmp_store)  # the error surfaces at exit, from close()
    monkeypatch.undo()
    assert gradlog.open(tmp_store).steps.column("step").to_pylist() == [0, 1, 2, 3, 4]
    assert verify(tmp_store).ok


def test_a_writer_error_surfaces_on_the_callers_next_call(
    tmp_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(path: Path, buffers: list[Any]) -> int:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(writer_module, "_write_file", broken)
    model = _model()
    rec = gradlog.GradRecorder(model, tmp_store, backend="loop")
    rec.open()
    rec.backward(_loss(model, *_batch(0)), step=0)  # queued; fails in the background
    rec._writer._worker.wait_idle()
    main = threading.current_thread()
    with pytest.raises(errors.StoreWriteError, match=r"Permission denied.*Make the store writable"):
        rec.backward(_loss(model, *_batch(1)), step=1)
    assert threading.current_thread() is main
    with pytest.raises(errors.StoreWriteError):
        rec.flush()
    with pytest.raises(errors.StoreWriteError):
        rec.close()
    monkeypatch.undo()
    assert gradlog.open(tmp_store).steps.num_rows == 0


# -- concurrent reader ----------------------------------------------------------------------
def test_a_reader_during_writes_sees_only_consistent_prefixes(
    tmp_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer_module._write_file

    def slowish(path: Path, buffers: list[Any]) -> int:
        time.sleep(0.003)
        return real(path, buffers)

    monkeypatch.setattr(writer_module, "_write_file", slowish)
    steps = range(12)
    result: dict[str, Any] = {}

    def record() -> None:
        try:
            result["expected"] = _train(tmp_store, steps, durable=False)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=record)
    thread.start()
    snapshots = []
    while thread.is_alive() or not snapshots:
        if not (tmp_store / "zarr.json").is_file():
            continue
        try:
            run = gradlog.open(tmp_store)
        except errors.NotAStoreError:
            continue
        committed = run.steps.column("step").to_pylist()
        assert committed == list(range(len(committed)))  # a prefix, in order, no gaps
        assert sorted(set(run.datums.column("step").to_pylist())) == committed
        if committed:
            grads = {n: run.grads(n) for n in run.param_names}  # every committed row reads
            snapshots.append((committed, grads))
    thread.join()
    assert "error" not in result, result.get("error")
    assert len({len(c) for c, _ in snapshots}) >= 2  # saw the run grow
    final = gradlog.open(tmp_store)
    for committed, grads in snapshots:
        for name, g in grads.items():
            np.testing.assert_array_equal(g, final.grads(name, step=committed))


# -- lossy storage dtypes -------------------------------------------------------------------
BOUNDS = {  # largest relative error of one element (FORMAT.md section 4.2): half a unit
    "float32": 0.0,
    "bfloat16": 2.0**-8,
    "bitround9": 2.0**-10,
    "bitround5": 2.0**-6,
}


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_lossy_dtypes_read_as_float32_within_their_documented_error(
    tmp_store: Path, dtype: str
) -> None:
    model = _model().double()
    path_ref = tmp_store.with_name("float32.gradlog")
    ref = _train(path_ref, range(3), model=model, dtype="float32")
    _train(tmp_store, range(3), model=_model().double(), dtype=dtype)
    run = gradlog.open(tmp_store)
    ref_run = gradlog.open(path_ref)
    for step in ref:
        for name in ref[step]:
            got = run.grads(name, step=step)
            exact = ref_run.grads(name, step=step)  # the float32 cast, lossless
            assert got.dtype == np.float32
            bound = BOUNDS[dtype] * np.abs(exact) * (1 + 1e-6)
            assert np.all(np.abs(got - exact) <= bound), (dtype, name)
    # norms are exact whatever the storage dtype: computed before rounding
    np.testing.assert_array_equal(
        run.datums.column("norm/0.weight"), ref_run.datums.column("norm/0.weight")
    )
    assert validate_store(tmp_store) is None and verify(tmp_store).ok


def test_float16_storage_keeps_normal_values_to_its_precision(tmp_store: Path) -> None:
    _train(tmp_store, range(2), dtype="float16")
    run = gradlog.open(tmp_store)
    assert run.params.column("dtype").to_pylist() == ["float16"] * 4
    meta = json.loads((tmp_store / "grads/0.weight/zarr.json").read_text())
    assert meta["data_type"] == "float16"
    assert run.grads("0.weight").dtype == np.float32


@pytest.mark.parametrize("form", ["full", {"form": "projection", "dim": 4}])
def test_float16_overflow_is_said_naming_the_datums(tmp_store: Path, form: Any) -> None:
    """Entries past float16's 65504 are stored as inf: the writer says which datums lost
    their records, and the others are kept to float16's precision."""
    model = nn.Linear(3, 2)
    x = torch.ones(4, 3)
    x[2] *= 1e4  # datum 2's weight gradient reaches ~1e8 (its bias's stays ~1e4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradlog.GradRecorder(model, tmp_store, dtype="float16", form=form) as rec:
            rec.backward((model(x) ** 2).sum(1), datum_ids=[10, 11, 12, 13])
    said = [str(w.message) for w in caught if w.category is errors.NonFiniteGradientWarning]
    assert len(said) == 1 and "datum id(s) [12]" in said[0] and "['weight']" in said[0]
    assert not [w for w in caught if w.category is RuntimeWarning]  # numpy's cast warning
    run = gradlog.open(tmp_store)
    assert run.form("weight").name == ("full" if form == "full" else "projection")
    norms = run.datums.column("norm/weight").to_numpy()
    assert np.isfinite(norms).all() and norms[2] > 65504  # exact, from before the cast
    if form == "full":
        with pytest.warns(errors.NonFiniteGradientWarning, match=r"rows \[2\].*overflowed"):
            got = run.grads("weight")
        assert np.isinf(got[2]).any() and np.isfinite(got[[0, 1, 3]]).all()


# -- resume ----------------------------------------------------------------------------------
def test_resume_continues_after_the_last_committed_step(tmp_store: Path) -> None:
    reference = tmp_store.with_name("reference.gradlog")
    expected = _train(reference)
    _train(tmp_store, range(3))
    more = _train(tmp_store, range(3, STEPS), resume=True, model=_replayed(3))
    _assert_holds(tmp_store, {**{s: expected[s] for s in range(3)}, **more})
    run = gradlog.open(tmp_store)
    assert run.datums.column("datum_id").to_pylist() == list(range(STEPS * B))
    validate_store(tmp_store)
    assert verify(tmp_store).ok


def test_resume_with_default_steps_and_ids_continues_the_counters(tmp_store: Path) -> None:
    model = _model()
    for _ in range(2):
        with gradlog.GradRecorder(model, tmp_store, backend="loop", resume=True) as rec:
            for _ in range(2):
                rec.backward(_loss(model, *_batch(0)))
    run = gradlog.open(tmp_store)
    assert run.steps.column("step").to_pylist() == [0, 1, 2, 3]
    assert run.datums.column("datum_id").to_pylist() == list(range(16))


def test_resume_refuses_another_configuration_naming_both(tmp_store: Path) -> None:
    _train(tmp_store, range(2))
    stored = gradlog.open(tmp_store).attrs["config_hash"]
    with pytest.raises(errors.StoreResumeError) as info:
        _train(tmp_store, range(2, 3), resume=True, dtype="bfloat16")
    message = str(info.value)
    assert stored in message and "dtype: stored 'float32', now 'bfloat16'" in message
    with pytest.raises(errors.StoreResumeError, match="same model"):
        other = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        _train(tmp_store, range(2, 3), resume=True, model=other)
    assert gradlog.open(tmp_store).steps.num_rows == 2  # untouched


def test_resume_refuses_steps_already_committed(tmp_store: Path) -> None:
    _train(tmp_store, range(3))
    model = _model()
    with gradlog.GradRecorder(model, tmp_store, backend="loop", resume=True) as rec:
        with pytest.raises(errors.InputError, match=r"step 2 is already committed.*step 3"):
            rec.backward(_loss(model, *_batch(2)), step=2)
        rec.backward(_loss(model, *_batch(3)), step=3)
    assert gradlog.open(tmp_store).steps.column("step").to_pylist() == [0, 1, 2, 3]


def test_resume_refuses_a_version_1_store_and_overwrite(tmp_path: Path) -> None:
    copy = tmp_path / "v1.store"
    shutil.copytree(GOLDEN / "v1.store", copy)
    with pytest.raises(errors.StoreResumeError, match="format version 1"):
        _train(copy, range(1), resume=True)
    with pytest.raises(errors.StoreExistsError, match="contradict"):
        _train(tmp_path / "new.gradlog", range(1), resume=True, overwrite=True)


def test_resume_discards_what_a_crash_left(tmp_store: Path) -> None:
    reference = tmp_store.with_name("reference.gradlog")
    expected = _train(reference)
    _train(tmp_store, range(2))
    # a crash in step 2: its shards and index part were written, its commit was not
    src = reference
    for part in ("index/step-000000000002-000000.parquet",):
        shutil.copy(src / part, tmp_store / part)
    for param in ("0.weight", "2.bias"):
        zeros = ["0"] * (2 if param.endswith("weight") else 1)
        (tmp_store / "grads" / param / ".".join(["c", "2", *zeros])).write_bytes(b"half a shard")
        (tmp_store / "grads" / param / ".".join(["c", "9", *zeros])).write_bytes(b"far past")
    (tmp_store / "steps/.step-000000000002.parquet.tmp").write_bytes(b"partial")
    assert gradlog.open(tmp_store).steps.num_rows == 2
    more = _train(tmp_store, range(2, STEPS), resume=True, model=_replayed(2))
    assert not (tmp_store / "steps/.step-000000000002.parquet.tmp").exists()
    assert not (tmp_store / "grads/0.weight/c.9.0.0").exists()  # past the trimmed rows
    _assert_holds(tmp_store, {**{s: expected[s] for s in range(2)}, **more})
    assert verify(tmp_store).ok and not verify(tmp_store).notes


def _writer_attrs() -> dict[str, Any]:
    config = {"params": ["*"], "backend": "loop", "batch_reduction": "mean",
              "token_reduction": "mean", "dtype": "float32", "every": 1, "check_every": 0,
              "check_rtol": 1e-4, "vmap_randomness": "different", "metadata": {},
              "compression": "none"}
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return {"format": "gradlog", "format_version": 3, "gradlog_version": "0.2.0",
            "torch_version": "2.4.0", "created": "2025-01-01T00:00:00+00:00",
            "model": {"class": "M", "n_parameters": 7}, "config": config,
            "config_hash": hashlib.sha256(canonical).hexdigest(), "backend": {"name": "loop"}}


def _planned(form: str) -> dict[str, Any]:
    """What the recorder passes to StoreWriter.set_forms: ``w`` in ``form``, ``b`` full."""
    full_w = ({"form": "full", "shape": [3, 2]}, {"grad": {"shape": [3, 2], "kind": "float"}})
    topk_w = ({"form": "topk", "shape": [3, 2], "k": 6},
              {"values": {"shape": [6], "kind": "float"}, "index": {"shape": [6], "kind": "int64"}})
    full_b = ({"form": "full", "shape": []}, {"grad": {"shape": [], "kind": "float"}})
    return {"w": topk_w if form == "topk" else full_w, "b": full_b}


def _append(writer: writer_module.StoreWriter, form: str, batch: int) -> np.ndarray:
    gw = np.arange(batch * 6, dtype=np.float32).reshape(batch, 3, 2) - 5
    grads: dict[str, Any] = {"w": gw, "b": np.ones(batch, dtype=np.float32)}
    if form == "topk":  # every entry kept: the form holds the whole gradient
        grads["w"] = {"values": gw.reshape(batch, 6),
                      "index": np.tile(np.arange(6, dtype=np.int64), (batch, 1))}
    writer.append(step=0, micro=0, datum_ids=np.arange(batch), losses=np.ones(batch),
                  weights=np.full(batch, 1 / batch), lr=None, grads=grads,
                  norms={"w": np.linalg.norm(gw.reshape(batch, -1), axis=1),
                         "b": np.ones(batch)})
    return gw


@pytest.mark.parametrize(("crashed", "resumed"), [("topk", "full"), ("full", "topk"),
                                                  ("topk", "topk")])
def test_resume_with_nothing_committed_plans_forms_and_arrays_afresh(
    tmp_store: Path, crashed: str, resumed: str
) -> None:
    """A crash in the first step leaves planned forms in the root attributes and the arrays
    (or form groups) of that plan; nothing was committed, so the resumed run plans again and
    none of it may be read as, or left beside, the new plan's arrays."""
    specs = {"w": writer_module.ParamSpec("w", (3, 2), "float32", "float32"),
             "b": writer_module.ParamSpec("b", (), "float32", "float32")}
    first = writer_module.StoreWriter(tmp_store, attrs=_writer_attrs(), specs=specs,
                                      durable=False)
    first.set_forms(_planned(crashed))
    _append(first, crashed, batch=8)
    first.flush()  # written, never committed: a crash
    del first  # dropped without close: its lease is stale, as a dead process's
    gc.collect()
    again = writer_module.StoreWriter(tmp_store, attrs=_writer_attrs(), specs=specs,
                                      durable=False, resume=True)
    assert again.last_step is None and again.planned_specs is None
    again.set_forms(_planned(resumed))
    gw = _append(again, resumed, batch=3)  # another shard size than the crashed attempt's
    again.commit({"step": 0, "first_row": 0, "n_records": 3, "n_micro": 1, "tokens": 3,
                  "loss_mean": 1.0, "lr": None, "time_compute_s": 0.0, "time_write_s": 0.0})
    again.close()
    report = verify(tmp_store)
    assert report.ok, [(c.name, c.problems) for c in report.checks]
    run = gradlog.open(tmp_store)
    assert run.attrs["params"]["w"]["form"] == resumed
    np.testing.assert_array_equal(run.grads("w"), gw)
    node = json.loads((tmp_store / "grads/w/zarr.json").read_text())["node_type"]
    assert node == ("array" if resumed == "full" else "group")
    leftovers = {"values", "index"} if crashed == "topk" and resumed == "full" else set()
    assert not leftovers & {p.name for p in (tmp_store / "grads/w").iterdir()}


def _probe_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _loss(model, *batch)


def test_resume_without_probes_discards_the_crashed_attempts_probe_parts(tmp_store: Path) -> None:
    _train(tmp_store, range(4), probes=(_probe_loss, _batch(99)))
    # a crash after step 3's records and probe part were written, before its commit
    (tmp_store / "steps/step-000000000003.parquet").unlink()
    (tmp_store / "probes/index/.step-000000000004.parquet.tmp").write_bytes(b"partial")
    assert sorted(set(gradlog.open(tmp_store).probes.column("step").to_pylist())) == [0, 1, 2]
    more = _train(tmp_store, range(3, 5), resume=True, model=_replayed(3))  # no probes now
    run = gradlog.open(tmp_store)
    assert run.steps.column("step").to_pylist() == [0, 1, 2, 3, 4]
    # step 3 was recorded again without probes: the crashed attempt's probes are not its own
    assert sorted(set(run.probes.column("step").to_pylist())) == [0, 1, 2]
    with pytest.raises(errors.SelectionError, match="step 3 has no probe record"):
        run.probe_grads("2.bias", step=3)
    assert sorted(os.listdir(tmp_store / "probes/index")) == [
        f"step-{s:012d}.parquet" for s in range(3)
    ]
    np.testing.assert_allclose(run.grads("0.weight", step=3), more[3]["0.weight"], rtol=1e-5)
    report = verify(tmp_store)
    assert report.ok and not report.notes, ([c.problems for c in report.checks], report.notes)


def test_resume_never_deletes_outside_the_store(tmp_store: Path, tmp_path: Path) -> None:
    _train(tmp_store, range(1))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "step-000000000007-000000.parquet").write_bytes(b"precious")
    shutil.rmtree(tmp_store / "index")
    (tmp_store / "index").symlink_to(outside, target_is_directory=True)
    with pytest.raises(errors.StoreResumeError, match="symbolic link"):
        _train(tmp_store, range(1, 2), resume=True)
    assert (outside / "step-000000000007-000000.parquet").read_bytes() == b"precious"


# -- crafted stores ---------------------------------------------------------------------------
def _edit(path: Path, rel: str, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((path / rel).read_text())
    edit(meta)
    (path / rel).write_text(json.dumps(meta))


def _reshape(meta: dict[str, Any], width: int) -> None:
    """A consistent array of another row shape than the spec's."""
    meta["shape"][1:] = [width]
    meta["chunk_grid"]["configuration"]["chunk_shape"][1:] = [width]
    meta["codecs"][0]["configuration"]["chunk_shape"][1:] = [width]


@pytest.mark.parametrize(
    ("rel", "edit", "match"),
    [
        (
            "zarr.json",
            lambda m: m["attributes"]["params"]["0.bias"].update(shape=[-4]),
            "non-negative",
        ),
        (
            "zarr.json",
            lambda m: m["attributes"]["params"]["0.bias"].update(shape=[2**40, 2**40]),
            "impossible shape",
        ),
        (
            "zarr.json",
            lambda m: m["attributes"]["params"]["0.bias"].update(dtype="object"),
            "not a storage dtype",
        ),
        (
            "zarr.json",
            lambda m: m["attributes"]["params"].update(
                {"../../x": m["attributes"]["params"]["0.bias"]}
            ),
            "points at array",
        ),
        ("zarr.json", lambda m: m["attributes"].update(params=[1, 2]), "must be an object"),
        ("grads/0.bias/zarr.json", lambda m: m.update(shape=[8, 5]), "chunk shape"),
        ("grads/0.bias/zarr.json", lambda m: _reshape(m, 5), "spec says"),
        ("grads/0.bias/zarr.json", lambda m: m.update(data_type="float64"), "needs uint16"),
        (
            "grads/0.bias/zarr.json",
            lambda m: m["codecs"][0].update(name="gzip"),
            "sharding_indexed",
        ),
    ],
)
def test_crafted_metadata_gives_a_clear_error(
    tmp_store: Path, rel: str, edit: Callable[[dict[str, Any]], None], match: str
) -> None:
    _train(tmp_store, range(2), dtype="bfloat16")
    _edit(tmp_store, rel, edit)
    with pytest.raises(errors.StoreFormatError, match=match):
        gradlog.open(tmp_store).grads("0.bias")
    assert not verify(tmp_store).ok


def test_parameter_names_with_path_separators_stay_inside(tmp_store: Path) -> None:
    model = nn.Sequential()
    model.add_module("/etc/a\\b", nn.Linear(2, 2))
    with gradlog.GradRecorder(model, tmp_store, backend="loop") as rec:
        rec.backward(model(torch.randn(3, 2)).sum(1), step=0)
    inside = {p.relative_to(tmp_store).parts[1] for p in (tmp_store / "grads").iterdir()}
    assert inside == {"%2Fetc%2Fa%5Cb.weight", "%2Fetc%2Fa%5Cb.bias", "zarr.json"}
    assert gradlog.open(tmp_store).grads("/etc/a\\b.weight").shape == (3, 2, 2)
    assert verify(tmp_store).ok


def test_the_recorder_passes_cpu_tensors_without_copies(tmp_store: Path) -> None:
    """On CPU the writer gets host numpy views of the backend's tensors (no staging copy)."""
    model = _model()
    seen = []
    real = writer_module.StoreWriter._stage

    def spy(self: Any, grads: Any) -> Any:
        for value in grads.values():
            arrays = value.values() if isinstance(value, dict) else [value]
            seen.extend((type(a).__name__, bool(a.flags.owndata)) for a in arrays)
        return real(self, grads)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writer_module.StoreWriter, "_stage", spy)
        with gradlog.GradRecorder(model, tmp_store, backend="loop") as rec:
            rec.backward(_loss(model, *_batch(0)), step=0)
    assert seen and set(seen) == {("ndarray", False)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bitround9"])
def test_cuda_recording_equals_cpu_recording(tmp_path: Path, dtype: str) -> None:
    """Device -> pinned host buffers with non_blocking copies: the bytes equal a CPU run's."""
    cpu = tmp_path / "cpu.gradlog"
    gpu = tmp_path / "gpu.gradlog"
    model = _model().double()
    _train(cpu, range(3), model=model, dtype=dtype)
    model_gpu = _model().double().cuda()
    opt = torch.optim.SGD(model_gpu.parameters(), lr=0.1)
    with gradlog.GradRecorder(model_gpu, gpu, backend="loop", dtype=dtype, queue_bytes=1) as rec:
        for step in range(3):
            ids = range(step * B, step * B + B)
            rec.backward(_loss(model_gpu, *_batch(step)), step=step, datum_ids=ids)
            opt.step()
            opt.zero_grad()
    a, b = gradlog.open(cpu), gradlog.open(gpu)
    rtol = {"float32": 1e-6, "bfloat16": 2.0**-7, "bitround9": 2.0**-9}[dtype]
    for name in a.param_names:
        np.testing.assert_allclose(b.grads(name), a.grads(name), rtol=rtol, atol=1e-9)
    assert verify(gpu).ok


def test_the_default_queue_holds_one_batch(tmp_store: Path) -> None:
    model = _model()
    with gradlog.GradRecorder(model, tmp_store, backend="loop") as rec:
        rec.backward(_loss(model, *_batch(0)), step=0)
        payload = B * sum(p.numel() for p in model.parameters()) * 4
        assert rec._writer._worker.capacity == payload
        for step in range(1, 4):
            rec.backward(_loss(model, *_batch(step)), step=step)
        assert rec._writer.stats["max_queued_bytes"] <= 2 * payload
    with pytest.raises(errors.GradlogError, match="queue_bytes"):
        gradlog.GradRecorder(model, tmp_store.with_name("x"), queue_bytes=0).open()


def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev

    def stingy(fd: int, buffers: list[Any]) -> int:  # writes at most 7 bytes per call
        first = bytes(buffers[0])[:7] if buffers else b""
        return real(fd, [first])

    monkeypatch.setattr(os, "writev", stingy)
    parts = [b"abc", b"", np.arange(40, dtype=np.float32), memoryview(b"0123456789")]
    assert writer_module._write_file(tmp_path / "f", parts) == 3 + 160 + 10
    monkeypatch.undo()
    expected = b"abc" + np.arange(40, dtype=np.float32).tobytes() + b"0123456789"
    assert (tmp_path / "f").read_bytes() == expected
