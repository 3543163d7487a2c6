"""Crash safety: ``kill -9`` a recording process anywhere, then open, verify and resume.

A worker subprocess records a deterministic run (a seeded model and data: each step's records
are a pure function of the step). It kills itself with SIGKILL at the k-th store operation
(shard write, a shard write cut in half, index part, array metadata, sync, commit), or the
test kills it after a random delay. Then:

- the store opens and ``verify`` passes: every committed step is intact, bit for bit equal to
  the same step of an uninterrupted reference run, and nothing else is visible;
- a second worker with ``resume=True`` continues after the last committed step, and the
  finished store equals the reference run, step for step and bit for bit.

The default run covers one point per kind of operation; ``-m slow`` adds 24 random points.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import random
import runpy
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gradlog
from gradlog.store.verify import verify

STEPS = 8
WORKER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    import gradlog
    from gradlog.store import writer as w

    args = globals().get("ARGS") or sys.argv[1:]  # ARGS when run by a forkserver child
    path, steps, crash_at, resume = args[0], int(args[1]), int(args[2]), args[3]
    form = args[4] if len(args) > 4 else "full"  # "topk": a compact form for 0.weight
    ops = [0]
    armed = [False]  # store creation is not counted: resume starts from a created store

    def crash_here():
        ops[0] += armed[0]
        return armed[0] and ops[0] == crash_at

    def wrap(name):
        real = getattr(w, name)
        def wrapped(*args, **kwargs):
            if crash_here():  # die before this operation
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        setattr(w, name, wrapped)

    real_write = w._write_file
    def write_file(file, buffers):
        if crash_here():  # die in the middle of this shard: half of its bytes written
            data = b"".join(memoryview(b).cast("B") for b in buffers)
            real_write(file, [data[: max(1, len(data) // 2)]])
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(file, buffers)
    real_replace = os.replace
    def replace(src, dst):  # the rename of a written temporary: die just before it
        if crash_here():
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)
    if crash_at:
        w._write_file = write_file
        for name in ("_write_parquet_atomic", "_write_json_atomic", "_syncfs"):
            wrap(name)
        os.replace = replace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    def batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        b = 3 + step % 3  # variable batch sizes: shards are not always full
        return torch.randn(b, 6, generator=g), torch.randn(b, 3, generator=g)
    def losses(step):
        x, y = batch(step)
        return ((model(x) - y) ** 2).sum(1)

    start = 0
    if resume == "resume" and os.path.exists(os.path.join(path, "zarr.json")):
        committed = gradlog.open(path).steps.column("step").to_pylist()
        start = committed[-1] + 1 if committed else 0
    for step in range(start):  # replay training up to the resume point, unrecorded
        losses(step).mean().backward()
        opt.step(); opt.zero_grad()
    forms = {} if form == "full" else {"form": {"0.weight": form}}
    with gradlog.GradRecorder(model, path, backend="loop", resume=resume == "resume",
                              queue_bytes=1 << 12, **forms) as rec:
        armed[0] = True
        print("ready", flush=True)
        for step in range(start, steps):
            ids = list(range(10 * step, 10 * step + len(batch(step)[0])))
            rec.backward(losses(step), step=step, datum_ids=ids, lr=0.05)
            opt.step(); opt.zero_grad()
    print("done", flush=True)
    """
)


def _worker_script(tmp: Path) -> Path:
    script = tmp / "worker.py"
    if not script.exists():
        script.write_text(WORKER)
    return script


@functools.cache
def _context() -> Any:
    """A forkserver that imported torch and gradlog once: each worker is a fresh process
    forked from it in milliseconds instead of a new interpreter importing torch (~3 s)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gradlog.recorder", "zarr", "pyarrow.parquet"])
    return ctx


def _start(
    tmp: Path, path: Path, crash_at: int = 0, resume: bool = False, form: str = "full"
) -> Any:
    args = [str(path), str(STEPS), str(crash_at), "resume" if resume else "new", form]
    proc = _context().Process(
        target=runpy.run_path,
        args=(str(_worker_script(tmp)),),
        kwargs={"init_globals": {"ARGS": args}, "run_name": "__main__"},
    )
    proc.start()
    return proc


def _run(
    tmp: Path, path: Path, crash_at: int = 0, resume: bool = False, form: str = "full"
) -> int:
    """Run the worker to its end or its death; returns its exit code (-9: killed)."""
    if not crash_at:  # nothing to kill: run it here, it is the same code
        argv = sys.argv
        sys.argv = [
            str(_worker_script(tmp)),
            str(path),
            str(STEPS),
            "0",
            "resume" if resume else "new",
            form,
        ]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        finally:
            sys.argv = argv
        return 0
    proc = _start(tmp, path, crash_at, resume, form)
    proc.join(300)
    if proc.exitcode not in (0, -signal.SIGKILL):
        raise AssertionError(f"the worker failed with exit code {proc.exitcode} (see stderr)")
    if proc.exitcode == -signal.SIGKILL:
        _log_kill(path, f"operation {crash_at}{' of a resume' if resume else ''}")
    return int(proc.exitcode)


def _log_kill(path: Path, where: str) -> None:
    """With GRADLOG_KILL_LOG set, note each kill (tests/benchmarks/RELIABILITY.md counts)."""
    log = os.environ.get("GRADLOG_KILL_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{path.parent.name}\t{where}\n")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("reference")
    path = tmp / "ref.gradlog"
    assert _run(tmp, path) == 0
    assert gradlog.open(path).steps.num_rows == STEPS
    return path


def _assert_prefix_of_reference(path: Path, reference: Path) -> list[int]:
    """Every committed step of ``path`` equals the reference's, bit for bit."""
    report = verify(path)
    assert report.ok, [(c.name, c.problems) for c in report.checks]
    run, ref = gradlog.open(path), gradlog.open(reference)
    committed = run.steps.column("step").to_pylist()
    assert committed == list(range(len(committed)))  # a prefix
    timing = ["time_compute_s", "time_write_s"]
    got_steps = run.steps.drop_columns(timing).to_pylist()
    assert got_steps == ref.steps.drop_columns(timing).to_pylist()[: len(committed)]
    if committed:
        assert run.records(step=committed).to_pylist() == ref.records(step=committed).to_pylist()
        for name in run.param_names:
            got = run.grads(name, step=committed)
            want = ref.grads(name, step=committed)
            assert got.tobytes() == want.tobytes(), name
    return committed


def _crash_and_resume(tmp: Path, reference: Path, crash_at: int) -> list[int]:
    path = tmp / f"crash-{crash_at}.gradlog"
    code = _run(tmp, path, crash_at=crash_at)
    assert code == -signal.SIGKILL, f"the worker finished before operation {crash_at}"
    committed = _assert_prefix_of_reference(path, reference)
    assert _run(tmp, path, resume=True) == 0
    assert _assert_prefix_of_reference(path, reference) == list(range(STEPS))
    assert not verify(path).notes  # the crash's leftovers were discarded or overwritten
    return committed


# Store operations, counted from the recorder's open: step 0 writes its arrays' metadata
# (1-8: a temporary and its rename, per array), 4 shards (9-12), its index part (13, and its
# rename 14), then syncs (15) and commits (16, rename 17) on the syncer thread while the writer
# thread goes on with step 1 (8 shards, its index part): from there the two threads' operations
# interleave, so later numbers name a kind of operation only roughly.
POINTS = {
    2: "rename of the first array's metadata",
    4: "rename of the second array's metadata",
    10: "a shard of step 0, cut in half",
    14: "rename of step 0's index part",
    17: "rename of step 0's commit marker",
    31: "a shard of step 1, cut in half",
}
SLOW_POINTS = {
    1: "the first operation",
    13: "step 0's index part",
    15: "the sync before step 0's commit",
    18: "right after step 0's commit",
    36: "the sync before step 1's commit",
    38: "rename of step 1's commit marker",
}


@pytest.mark.parametrize("crash_at", list(POINTS), ids=list(POINTS.values()))
def test_kill_9_at_a_store_operation_then_verify_and_resume(
    tmp_path: Path, reference: Path, crash_at: int
) -> None:
    _crash_and_resume(tmp_path, reference, crash_at)


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", list(SLOW_POINTS), ids=list(SLOW_POINTS.values()))
def test_kill_9_at_more_store_operations(tmp_path: Path, reference: Path, crash_at: int) -> None:
    _crash_and_resume(tmp_path, reference, crash_at)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(16))
def test_kill_9_at_random_store_operations(tmp_path: Path, reference: Path, seed: int) -> None:
    crash_at = random.Random(seed).randint(1, 130)  # a run has ~140 operations
    path = tmp_path / "crash.gradlog"
    if _run(tmp_path, path, crash_at=crash_at) == 0:
        return  # past the end of the run: nothing to recover
    _assert_prefix_of_reference(path, reference)
    assert _run(tmp_path, path, resume=True) == 0
    assert _assert_prefix_of_reference(path, reference) == list(range(STEPS))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_kill_9_after_a_random_delay(tmp_path: Path, reference: Path, seed: int) -> None:
    path = tmp_path / "crash.gradlog"
    proc = _start(tmp_path, path, crash_at=10**9)  # counts operations, never dies by itself
    deadline = time.monotonic() + 60
    while not (path / "zarr.json").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(random.Random(seed).uniform(0.0, 0.15))
    with contextlib.suppress(ProcessLookupError):  # if it finished first, all of it is there
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    if proc.exitcode == -signal.SIGKILL:
        _log_kill(path, "a random delay")
    _assert_prefix_of_reference(path, reference)
    assert _run(tmp_path, path, resume=True) == 0
    assert _assert_prefix_of_reference(path, reference) == list(range(STEPS))


def test_the_reference_run_is_deterministic(tmp_path: Path, reference: Path) -> None:
    """The comparison above is meaningful only if a run's bytes are a function of its steps:
    a worker process (with its store operations counted) writes what this process wrote."""
    again = tmp_path / "again.gradlog"
    assert _run(tmp_path, again, crash_at=10**9) == 0
    assert _assert_prefix_of_reference(again, reference) == list(range(STEPS))
    np.testing.assert_array_equal(
        gradlog.open(again).datums.column("row"), gradlog.open(reference).datums.column("row")
    )


@pytest.fixture(scope="module")
def topk_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("topk-reference")
    path = tmp / "ref.gradlog"
    assert _run(tmp, path, form="topk") == 0
    assert gradlog.open(path).attrs["params"]["0.weight"]["form"] == "topk"
    return path


# A compact form is planned at the first backward: the root attributes are rewritten with the
# planned forms (operations 1-2), then the form's arrays and group and the other arrays are
# created (3-14), the shards written (15-19), the index part (20-21), then the sync and the
# commit (22-25). A crash before the commit leaves forms in the root attributes and, from 7
# on, a group at grads/0.weight: the resumed run must plan again, not read it as an array.
FORM_POINTS = {
    3: "after the planned forms are stored",
    7: "after the form's group is created",
    16: "a shard of step 0, cut in half",
    22: "after step 0's index part",
}


@pytest.mark.parametrize("crash_at", list(FORM_POINTS), ids=list(FORM_POINTS.values()))
def test_kill_9_in_the_first_step_of_a_compact_form_run_then_resume(
    tmp_path: Path, topk_reference: Path, crash_at: int
) -> None:
    path = tmp_path / f"crash-{crash_at}.gradlog"
    assert _run(tmp_path, path, crash_at=crash_at, form="topk") == -signal.SIGKILL
    assert _assert_prefix_of_reference(path, topk_reference) == []  # nothing committed
    assert _run(tmp_path, path, resume=True, form="topk") == 0
    assert _assert_prefix_of_reference(path, topk_reference) == list(range(STEPS))
    assert not verify(path).notes


def _crash_twice(tmp: Path, reference: Path, first_at: int, second_at: int) -> None:
    """Killed while recording, then killed again while resuming, then resumed to the end:
    no step committed before a kill is ever lost, and the end is the reference run."""
    path = tmp / "crash.gradlog"
    if _run(tmp, path, crash_at=first_at) == 0:
        return  # past the end of the run: nothing to recover
    before = _assert_prefix_of_reference(path, reference)
    killed = _run(tmp, path, crash_at=second_at, resume=True)  # the dead writer's lease too
    during = _assert_prefix_of_reference(path, reference)
    assert during[: len(before)] == before, "a committed step was lost by a resume"
    if killed == 0:
        assert during == list(range(STEPS))
        return
    assert _run(tmp, path, resume=True) == 0
    assert _assert_prefix_of_reference(path, reference) == list(range(STEPS))
    assert not verify(path).notes


def test_kill_9_mid_resume_then_resume_again(tmp_path: Path, reference: Path) -> None:
    _crash_twice(tmp_path, reference, 31, 14)  # the resumed run dies at its first commit


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_kill_9_at_random_points_of_a_run_and_of_its_resume(
    tmp_path: Path, reference: Path, seed: int
) -> None:
    rng = random.Random(100 + seed)
    _crash_twice(tmp_path, reference, rng.randint(1, 130), rng.randint(1, 90))
