"""FSDP2 and compact forms under torch.distributed: two gloo ranks on CPU, spawned here as
processes (tests/fsdp_worker.py), record exactly what one process records for the
concatenated batch: every record, its weight, its gradient in the stored form, and
``p.grad`` (gathered from FSDP2's shards)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gradlog
from gradlog.store.verify import verify

WORKER = Path(__file__).with_name("fsdp_worker.py")
sys.path.insert(0, str(WORKER.parent))
# the workers import this checkout's gradlog, installed or not
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(WORKER.parent.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
from fsdp_worker import model_and_data, recorder_options, save_grads, train  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


CPU_FSDP2 = pytest.mark.skipif(not hasattr(torch.cpu.Stream, "record_event"),
                               reason="this torch's FSDP2 runs on CUDA only (on the CPU "
                               "since torch 2.7 or so: CPU streams got record_event)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(store: Path, steps: int, strategy: str, form: str, *extra: str) -> list[int]:
    """Both ranks' processes; their exit codes (logs printed, shown on failure)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", str(port), str(store), str(steps),
             strategy, form, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_ENV,
        )
        for r in range(2)
    ]
    codes = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        codes.append(p.returncode)
        print(f"--- rank {r} (exit {p.returncode})\n{out.decode(errors='replace')[-4000:]}")
    return codes


def _single_process(path: Path, steps: int, form: str) -> Path:
    """The oracle: one process, the whole global batch of every call."""
    model, data = model_and_data(steps)
    with gradlog.GradRecorder(model, path, check_every=1, **recorder_options(form)) as rec:
        train(model, data, rec, 0, on_grads=lambda s: save_grads(model, Path(f"{path}.grads"),
                                                                 s, 0))
    return path


def _assert_same(got_path: Path, want_path: Path) -> None:
    got, want = gradlog.open(got_path), gradlog.open(want_path)
    assert got.param_names == want.param_names  # the user's names, nothing of FSDP's
    assert got.params.column("form").to_pylist() == want.params.column("form").to_pylist()
    assert got.attrs["params"] == want.attrs["params"]  # forms, seeds, dimensions, arrays
    for column in ("step", "n_records", "tokens"):
        assert got.steps.column(column).to_pylist() == want.steps.column(column).to_pylist()
    for step in want.steps.column("step").to_pylist():
        a = got.records(step=step)
        b = want.records(step=step)
        order_a = np.argsort(np.asarray(a.column("datum_id")))
        order_b = np.argsort(np.asarray(b.column("datum_id")))
        assert np.asarray(a.column("datum_id"))[order_a].tolist() == \
            np.asarray(b.column("datum_id"))[order_b].tolist()
        for column in ("weight", "loss", *(f"norm/{n}" for n in want.param_names)):
            np.testing.assert_allclose(np.asarray(a.column(column))[order_a],
                                       np.asarray(b.column(column))[order_b],
                                       rtol=1e-5, atol=1e-7, err_msg=f"{column} step {step}")
        forms = dict(zip(want.param_names, want.params.column("form").to_pylist()))
        for name in (n for n in want.param_names if forms[n] != "norm"):  # norm: in the index
            np.testing.assert_allclose(got.grads(name, step=step)[order_a],
                                       want.grads(name, step=step)[order_b],
                                       rtol=1e-4, atol=1e-6, err_msg=f"{name} step {step}")
        pa = np.load(f"{got_path}.grads/step-{step}.npz")
        pb = np.load(f"{want_path}.grads/step-{step}.npz")
        assert sorted(pa.files) == sorted(pb.files)
        for key in pb.files:  # p.grad: all-reduced (DDP) or reduce-scattered (FSDP2)
            np.testing.assert_allclose(pa[key], pb[key], rtol=1e-5, atol=1e-7, err_msg=key)


@CPU_FSDP2
def test_fsdp2_tiny_gpt_records_what_one_process_records(tmp_path: Path) -> None:
    store = tmp_path / "fsdp.gradlog"
    assert _run_ranks(store, 3, "fsdp2", "full") == [0, 0]
    report = verify(store)
    assert report.ok, [c.problems for c in report.checks]
    run = gradlog.open(store)
    assert run.attrs["backend"]["distributed"]["strategy"] == "fsdp2"
    classes = {m["class"] for m in run.attrs["backend"]["modules"]}
    assert "FSDPLinear" in classes and not run.attrs["backend"]["fallback"]
    assert run.steps.column("n_micro").to_pylist() == [2, 4, 2]
    _assert_same(store, _single_process(tmp_path / "one.gradlog", 3, "full"))


@pytest.mark.filterwarnings("ignore:parameter .* was recorded as a random projection")
@pytest.mark.parametrize(
    ("strategy", "form"),
    [pytest.param("ddp", "auto:2000", marks=pytest.mark.slow),
     pytest.param("fsdp2", "projection", marks=[pytest.mark.slow, CPU_FSDP2]),
     pytest.param("ddp", "projection", marks=pytest.mark.slow),
     pytest.param("fsdp2", "auto:2000", marks=[pytest.mark.slow, CPU_FSDP2])],
)
def test_compact_forms_record_what_one_process_records(
    tmp_path: Path, strategy: str, form: str
) -> None:
    """One plan for both ranks: the same forms, seeds and dimensions as one process plans
    for the global batch (auto splits its budget over the step's records of both ranks)."""
    store = tmp_path / "ranks.gradlog"
    assert _run_ranks(store, 3, strategy, form) == [0, 0]
    assert verify(store).ok
    one = _single_process(tmp_path / "one.gradlog", 3, form)
    forms = set(gradlog.open(one).params.column("form").to_pylist())
    assert forms - {"full"}, forms  # the test exercises compact forms
    _assert_same(store, one)


@pytest.mark.slow
@CPU_FSDP2
def test_fsdp2_rank_killed_mid_step_leaves_a_store_that_resumes(tmp_path: Path) -> None:
    store = tmp_path / "fsdp.gradlog"
    codes = _run_ranks(store, 4, "fsdp2", "auto:2000", "2")  # rank 1 SIGKILLed in step 2
    assert codes[1] == -9 and codes[0] != 0
    run = gradlog.open(store)
    assert run.steps.column("step").to_pylist() == [0, 1]  # step 2 never committed
    assert verify(store).ok
    assert _run_ranks(store, 4, "fsdp2", "auto:2000", "-", "resume") == [0, 0]
    report = verify(store)
    assert report.ok, [c.problems for c in report.checks]
    _assert_same(store, _single_process(tmp_path / "one.gradlog", 4, "auto:2000"))
