"""One writer per store: the writer lease (``gradlog/store/lease.py``, FORMAT.md section 14).

Real second processes: a worker process records a deterministic run and pauses after a
committed step, holding the lease; other processes (further workers, and this test process)
then try to write the store with ``resume=True``, ``overwrite=True`` and as a fresh create.
Every one must get ``StoreLockedError`` naming the holder, and the first run, let go on,
must finish intact: bit for bit the uninterrupted reference run. Then the lease's other
states: a dead holder (taken over), another host's live or expired lease (refused; broken
explicitly), a writer whose lease was broken behind its back (refuses to commit), on local
disks and on object storage (``memory://``; ``s3://`` on a moto server).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import re
import runpy
import signal
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import gradlog
from gradlog.cli.main import app
from gradlog.errors import StoreLockedError
from gradlog.store import lease as lease_module
from gradlog.store.fs import store_path
from gradlog.store.verify import verify

STEPS = 5
LOCKED_EXIT = 3
WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from torch import nn
    import gradlog

    path, mode, pause_at, ready, go, result, endpoint = globals()["ARGS"]
    if endpoint:
        import fsspec
        fsspec.config.conf["s3"] = {"key": "testing", "secret": "testing", "client_kwargs":
                                    {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def losses(step):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        return ((model(x) - y) ** 2).sum(1)

    start = 0
    if mode == "resume":  # replay, unrecorded, what the store already holds
        try:
            done = gradlog.open(path).steps.column("step").to_pylist()
        except gradlog.NotAStoreError:
            done = []
        start = done[-1] + 1 if done else 0
    for step in range(start):
        losses(step).mean().backward()
        opt.step(); opt.zero_grad()
    try:
        with gradlog.GradRecorder(model, path, backend="loop", resume=mode == "resume",
                                  overwrite=mode == "overwrite") as rec:
            for step in range(start, STEPS):
                rec.backward(losses(step), step=step, datum_ids=list(range(4 * step, 4 * step + 4)),
                             lr=0.05)
                opt.step(); opt.zero_grad()
                if step == pause_at:  # hold the lease until told to go on
                    rec.flush()
                    open(ready, "w").close()
                    deadline = time.monotonic() + 120
                    while not os.path.exists(go) and time.monotonic() < deadline:
                        time.sleep(0.01)
    except gradlog.GradlogError as e:
        with open(result, "w") as f:
            json.dump({"type": type(e).__name__, "message": str(e)}, f)
        os._exit(LOCKED_EXIT)
    """
).replace("STEPS", str(STEPS)).replace("LOCKED_EXIT", str(LOCKED_EXIT))


@functools.cache
def _context() -> Any:
    """A forkserver that imported torch and gradlog once: workers start in milliseconds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gradlog.recorder", "zarr", "pyarrow.parquet"])
    return ctx


class Worker:
    """A recording process (see WORKER) and its signal files."""

    def __init__(self, tmp: Path, path: str, mode: str, pause_at: int = -1,
                 endpoint: str = "") -> None:
        tag = uuid.uuid4().hex[:8]
        script = tmp / "lease_worker.py"
        if not script.exists():
            script.write_text(WORKER)
        self.ready, self.go, self.result = (tmp / f"{tag}.{n}" for n in ("ready", "go", "result"))
        args = [path, mode, pause_at, str(self.ready), str(self.go), str(self.result), endpoint]
        self.proc = _context().Process(
            target=runpy.run_path, args=(str(script),),
            kwargs={"init_globals": {"ARGS": args}, "run_name": "__main__"},
        )
        self.proc.start()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"worker exited ({self.proc.exitcode}) before pausing: "
                                     f"{self.error()}")
            time.sleep(0.01)

    def finish(self, timeout: float = 120) -> int:
        self.go.touch()
        self.proc.join(timeout)
        return int(self.proc.exitcode if self.proc.exitcode is not None else -1)

    def error(self) -> dict[str, str] | None:
        return json.loads(self.result.read_text()) if self.result.exists() else None


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> gradlog.Run:
    """The uninterrupted run, recorded by the same worker code in this process."""
    tmp = tmp_path_factory.mktemp("lease-reference")
    path = tmp / "ref.gradlog"
    w = Worker(tmp, str(path), "new")
    assert w.finish() == 0, w.error()
    return gradlog.open(path)


def _assert_intact(location: Any, reference: gradlog.Run) -> None:
    """The store at ``location`` is the reference run, bit for bit, and verifies."""
    report = verify(location)
    assert report.ok, [(c.name, c.problems) for c in report.checks]
    run = gradlog.open(location)
    timing = ["time_compute_s", "time_write_s"]
    assert run.steps.drop_columns(timing).equals(reference.steps.drop_columns(timing))
    assert run.datums.equals(reference.datums)
    for name in reference.param_names:
        assert run.grads(name).tobytes() == reference.grads(name).tobytes(), name


def _try_in_this_process(location: Any, mode: str, **options: Any) -> None:
    model = _model()
    gradlog.GradRecorder(model, location, backend="loop", resume=mode == "resume",
                         overwrite=mode == "overwrite", **options).open()


# -- local disk: a live holder in another process ----------------------------------------------
def test_second_writers_are_refused_and_the_first_run_finishes_intact(
    tmp_path: Path, reference: gradlog.Run
) -> None:
    path = tmp_path / "run.gradlog"
    first = Worker(tmp_path, str(path), "new", pause_at=2)
    first.wait_ready()
    holder = lease_module.read_lease(path)
    assert holder is not None and holder.owner["pid"] == first.proc.pid
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    # second writers in their own processes, every mode: refused, naming the holder
    others = [Worker(tmp_path, str(path), mode) for mode in ("resume", "overwrite")]
    for other in others:
        assert other.finish() == LOCKED_EXIT
        error = other.error()
        assert error is not None and error["type"] == "StoreLockedError", error
        assert f"pid {first.proc.pid}" in error["message"] and "running on this host" in (
            error["message"])
    # and from this process, with break_lease=True too: a live holder is never broken
    for mode in ("resume", "overwrite", "new"):
        with pytest.raises(StoreLockedError, match=f"pid {first.proc.pid}"):
            _try_in_this_process(path, mode, break_lease=True)
    with pytest.raises(StoreLockedError, match="running on this host"):
        lease_module.break_lease(path, force=True)
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before  # nothing touched
    assert lease_module.read_lease(path) == holder
    assert first.finish() == 0, first.error()
    _assert_intact(path, reference)
    assert lease_module.read_lease(path) is None  # released at close


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["new", "resume", "overwrite"])
def test_writers_starting_together_one_wins(
    tmp_path: Path, reference: gradlog.Run, mode: str
) -> None:
    path = tmp_path / "run.gradlog"
    if mode == "overwrite":  # something to overwrite: a finished run of other data
        model = nn.Linear(2, 2)
        with gradlog.GradRecorder(model, path) as rec:
            rec.backward(model(torch.randn(3, 2)).sum(1))
    writers = [Worker(tmp_path, str(path), mode, pause_at=0) for _ in range(3)]
    deadline = time.monotonic() + 120
    while sum(w.ready.exists() or w.result.exists() for w in writers) < len(writers):
        assert time.monotonic() < deadline, [w.proc.exitcode for w in writers]
        time.sleep(0.01)
    winners = [w for w in writers if w.ready.exists()]
    assert len(winners) == 1, [w.error() for w in writers]
    for w in writers:
        code = w.finish()
        if w is winners[0]:
            assert code == 0, w.error()
        else:
            error = w.error()
            assert code == LOCKED_EXIT and error is not None, (code, error)
            assert error["type"] == "StoreLockedError", error
    _assert_intact(path, reference)


@pytest.mark.slow
def test_a_dead_holders_lease_is_taken_over(tmp_path: Path, reference: gradlog.Run) -> None:
    path = tmp_path / "run.gradlog"
    first = Worker(tmp_path, str(path), "new", pause_at=1)
    first.wait_ready()
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.join(60)
    left = lease_module.read_lease(path)
    assert left is not None and left.state() == "dead"
    again = Worker(tmp_path, str(path), "resume")  # takes the dead writer's lease over
    assert again.finish() == 0, again.error()
    _assert_intact(path, reference)


# -- other hosts, breaking, lost leases --------------------------------------------------------
def _plant_lease(path: Path, *, age_s: float, host: str = "another-host") -> None:
    now = time.time()
    record = {"owner": {"host": host, "boot_id": "x", "pid_ns": 1, "pid": 4242,
                        "start_ticks": 1, "user": "bob", "command": "python train.py"},
              "token": "f" * 32, "acquired": now - age_s, "renewed": now - age_s,
              "ttl_s": lease_module.LEASE_TTL_S, "gradlog_version": "0.1.0"}
    lease_file = path / lease_module.LEASE_FILE
    lease_file.write_text(json.dumps(record))
    os.utime(lease_file, (now - age_s, now - age_s))


def _record(path: Any, steps: range, **options: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with gradlog.GradRecorder(model, path, **options) as rec:
        for step in steps:
            rec.backward(model(torch.randn(4, 3)).sum(1), step=step)


def test_another_hosts_lease_is_refused_until_expired_and_broken(tmp_store: Path) -> None:
    _record(tmp_store, range(2))
    _plant_lease(tmp_store, age_s=5)
    with pytest.raises(StoreLockedError, match=r"another host.*renewed its lease within"):
        _record(tmp_store, range(2, 3), resume=True, break_lease=True)  # live: not breakable
    with pytest.raises(StoreLockedError, match="another host"):
        _record(tmp_store, range(2), overwrite=True)
    assert gradlog.open(tmp_store).steps.num_rows == 2  # overwrite deleted nothing
    runner = CliRunner()
    result = runner.invoke(app, ["unlock", str(tmp_store)])
    assert result.exit_code == 1 and "--force" in result.output, result.output
    _plant_lease(tmp_store, age_s=lease_module.LEASE_TTL_S + 60)
    with pytest.raises(StoreLockedError, match=r"expired.*break_lease=True"):
        _record(tmp_store, range(2, 3), resume=True)
    _record(tmp_store, range(2, 3), resume=True, break_lease=True)
    assert gradlog.open(tmp_store).steps.column("step").to_pylist() == [0, 1, 2]
    _plant_lease(tmp_store, age_s=5)
    result = runner.invoke(app, ["unlock", str(tmp_store), "--force"])
    assert result.exit_code == 0 and "pid 4242" in result.output, result.output
    assert lease_module.read_lease(tmp_store) is None
    result = runner.invoke(app, ["unlock", str(tmp_store)])
    assert result.exit_code == 0 and "no writer" in result.output, result.output


def test_a_writer_whose_lease_was_taken_refuses_to_commit(tmp_store: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with pytest.raises(StoreLockedError, match="now held by pid 4242"), gradlog.GradRecorder(
        model, tmp_store
    ) as rec:
        for step in range(3):  # steps 0 and 1 committed, step 2 once step 3 begins
            rec.backward(model(torch.randn(4, 3)).sum(1), step=step)
        rec.flush()
        _plant_lease(tmp_store, age_s=0)  # broken and taken by another writer meanwhile
        rec.backward(model(torch.randn(4, 3)).sum(1), step=3)
        rec.flush()
    run = gradlog.open(tmp_store)
    assert run.steps.column("step").to_pylist() == [0, 1]  # nothing committed without it
    assert lease_module.read_lease(tmp_store) is not None  # the other writer's, left alone
    assert lease_module.read_lease(tmp_store).token == "f" * 32  # type: ignore[union-attr]


def test_a_recorder_dropped_unclosed_in_this_process_leaves_a_stale_lease(
    tmp_store: Path,
) -> None:
    model = nn.Linear(3, 2)
    rec = gradlog.GradRecorder(model, tmp_store)
    rec.open()
    rec.backward(model(torch.randn(4, 3)).sum(1))
    with pytest.raises(StoreLockedError, match="This process holds it"):
        gradlog.GradRecorder(model, tmp_store, overwrite=True).open()
    rec.flush()
    del rec  # a notebook cell run again: the old recorder is gone, never closed
    import gc

    gc.collect()
    with gradlog.GradRecorder(model, tmp_store, overwrite=True) as again:
        again.backward(model(torch.randn(2, 3)).sum(1))
    assert gradlog.open(tmp_store).datums.num_rows == 2


def test_no_lease_is_put_into_a_foreign_directory(tmp_path: Path) -> None:
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("x")
    with pytest.raises(gradlog.StoreExistsError, match="not a gradlog store"):
        _record(foreign, range(1), overwrite=True)
    assert sorted(p.name for p in foreign.iterdir()) == ["precious.txt"]


# -- object storage -----------------------------------------------------------------------------
@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://gradlog-lease/{uuid.uuid4().hex}/run.gradlog"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on loopback with bucket ``gradlog-lease``; fsspec points at it."""
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install -e '.[s3]'")
    moto_server = pytest.importorskip("moto.server", reason="pip install 'moto[server]'")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {"key": "testing", "secret": "testing",
                                "client_kwargs": {"endpoint_url": endpoint,
                                                  "region_name": "us-east-1"}}
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing",
                 ).create_bucket(Bucket="gradlog-lease")
    try:
        yield endpoint
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
        server.stop()


@pytest.mark.slow
def test_s3_second_writers_in_other_processes_are_refused(
    tmp_path: Path, reference: gradlog.Run, s3_endpoint: str
) -> None:
    url = f"s3://gradlog-lease/{uuid.uuid4().hex}/run.gradlog"
    first = Worker(tmp_path, url, "new", pause_at=2, endpoint=s3_endpoint)
    first.wait_ready()
    for mode in ("resume", "overwrite", "new"):
        other = Worker(tmp_path, url, mode, endpoint=s3_endpoint)
        assert other.finish() == LOCKED_EXIT
        error = other.error()
        assert error is not None and error["type"] == "StoreLockedError", error
        assert f"pid {first.proc.pid}" in error["message"]
    assert first.finish() == 0, first.error()
    _assert_intact(url, reference)
    assert lease_module.read_lease(url) is None


def test_s3_conditional_create_admits_one_of_many(s3_endpoint: str) -> None:
    """Eight threads create the same lease at once: S3's If-None-Match lets exactly one in."""
    root = store_path(f"s3://gradlog-lease/{uuid.uuid4().hex}/run.gradlog")
    won: list[Any] = []
    lost: list[BaseException] = []
    barrier = threading.Barrier(8)

    def take() -> None:
        barrier.wait()
        try:
            won.append(lease_module._create(root / lease_module.LEASE_FILE,
                                            uuid.uuid4().hex.encode()))
        except BaseException as e:  # pragma: no cover - reported below
            lost.append(e)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not lost and sorted(won) == [False] * 7 + [True]


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_object_store_lease_in_one_process(
    backend: str, memory_url: str, request: pytest.FixtureRequest
) -> None:
    url = memory_url
    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
        url = f"s3://gradlog-lease/{uuid.uuid4().hex}/run.gradlog"
    model = nn.Linear(3, 2)
    with gradlog.GradRecorder(model, url) as rec:
        rec.backward(model(torch.randn(4, 3)).sum(1))
        for mode in ("resume", "overwrite", "new"):
            with pytest.raises(StoreLockedError, match="This process holds it"):
                _try_in_this_process(url, mode)
        rec.backward(model(torch.randn(4, 3)).sum(1))
    assert gradlog.open(url).steps.num_rows == 2
    assert lease_module.read_lease(url) is None
    # a lease taken behind the writer's back: it refuses to commit
    with pytest.raises(StoreLockedError, match="gone"), gradlog.GradRecorder(
        model, url, resume=True
    ) as rec:
        rec.backward(model(torch.randn(4, 3)).sum(1))
        rec.flush()
        (store_path(url) / lease_module.LEASE_FILE).unlink()  # broken from another host
        rec.backward(model(torch.randn(4, 3)).sum(1))  # commits the step before: refused
        rec.flush()
    assert gradlog.open(url).steps.num_rows == 2


def test_lease_renewal_touches_the_file(tmp_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease_module, "_RENEW_EVERY_S", 0.0)
    model = nn.Linear(3, 2)
    with gradlog.GradRecorder(model, tmp_store) as rec:
        lease_file = tmp_store / lease_module.LEASE_FILE
        old = time.time() - 1000
        os.utime(lease_file, (old, old))
        rec.backward(model(torch.randn(4, 3)).sum(1))
        rec.flush()
        info = lease_module.read_lease(tmp_store)
        assert info is not None and time.time() - info.renewed < 60
    np.testing.assert_equal(gradlog.open(tmp_store).steps.num_rows, 1)


# -- what readers are told of a lease left in the store ----------------------------------------
def _plant_own_host_lease(path: Path, pid: int, start_ticks: int, *, age_s: float = 1) -> None:
    """A lease of this host (same host name, boot id and pid namespace) held by ``pid``."""
    _plant_lease(path, age_s=age_s, host=lease_module._identity()["host"])
    lease_file = path / lease_module.LEASE_FILE
    record = json.loads(lease_file.read_text())
    me = lease_module._identity()
    record["owner"].update(boot_id=me["boot_id"], pid_ns=me["pid_ns"], pid=pid,
                           start_ticks=start_ticks)
    lease_file.write_text(json.dumps(record))
    os.utime(lease_file, (time.time() - age_s, time.time() - age_s))


def _info_and_verify(path: Path) -> tuple[str, dict[str, Any], str, dict[str, Any]]:
    runner = CliRunner()
    info = runner.invoke(app, ["info", str(path)], terminal_width=200)
    info_json = runner.invoke(app, ["info", str(path), "--json"])
    checked = runner.invoke(app, ["verify", str(path)], terminal_width=200)
    checked_json = runner.invoke(app, ["verify", str(path), "--json"])
    for result in (info, info_json, checked, checked_json):
        assert result.exit_code == 0, result.output  # a left lease is no damage
    return (" ".join(info.output.replace("│", " ").split()), json.loads(info_json.output),
            " ".join(checked.output.split()), json.loads(checked_json.output))


def test_info_and_verify_say_when_the_writer_did_not_close_the_store(tmp_store: Path) -> None:
    """A writer killed (SIGKILL) leaves its lease: info and verify said nothing of it. Each
    lease state the lease module judges (lease.py) is said, live apart from stale."""
    import subprocess

    _record(tmp_store, range(2))
    text, data, checked, checked_data = _info_and_verify(tmp_store)
    assert data["writer"] is None and "writer" not in text and "writer:" not in checked
    assert not any("writer" in n for n in checked_data["notes"])

    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        ticks = lease_module._start_ticks(alive.pid) or 0
        cases = [
            (lambda: _plant_own_host_lease(tmp_store, gone.pid, 1), "dead", False,
             f"its writer did not close the store: pid {gone.pid} on host .* is gone "
             r"\(killed or crashed\), so the run was cut short"),
            (lambda: _plant_own_host_lease(tmp_store, alive.pid, ticks), "alive", True,
             f"a writer is recording into the store now: pid {alive.pid} on host .* runs"),
            (lambda: _plant_lease(tmp_store, age_s=20), "live-elsewhere", True,
             r"a writer on another host holds its lease, renewed 2\d s ago \(within its 300 "
             r"s TTL\): pid 4242 on host 'another-host' .* is recording, or was cut short"),
            (lambda: _plant_lease(tmp_store, age_s=lease_module.LEASE_TTL_S + 60), "expired",
             False, r"its writer did not close the store: pid 4242 on host 'another-host' .*, "
             r"on another host, has not renewed its lease for 36\d s .*gradlog unlock"),
        ]
        for plant, state, live, said in cases:
            plant()
            text, data, checked, checked_data = _info_and_verify(tmp_store)
            assert re.search(rf"writer {said}", text), (state, text)
            assert re.search(rf"note: writer: {said}", checked), (state, checked)
            assert checked.endswith("intact"), checked  # a note, not a FAIL
            assert checked_data["ok"] and re.search(said, checked_data["notes"][0])
            assert data["writer"]["state"] == state and data["writer"]["live"] is live
            assert re.search(said, data["writer"]["note"])
            assert data["writer"]["owner"]["pid"] in (gone.pid, alive.pid, 4242)
    finally:
        alive.kill()
        alive.wait()
    (tmp_store / lease_module.LEASE_FILE).write_text("{not json")
    text, data, checked, _ = _info_and_verify(tmp_store)
    assert data["writer"]["state"] == "damaged" and "--force" in text and "--force" in checked


def test_info_says_a_killed_writer_did_not_close_the_store(tmp_path: Path) -> None:
    """A real writer, paused holding its lease (recording, live), then SIGKILLed (stale)."""
    path = tmp_path / "run.gradlog"
    worker = Worker(tmp_path, str(path), "new", pause_at=1)
    try:
        worker.wait_ready()
        text, data, _, _ = _info_and_verify(path)
        assert data["writer"]["state"] == "alive" and data["writer"]["live"], text
        assert f"a writer is recording into the store now: pid {worker.proc.pid}" in text
    finally:
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.join(60)
    text, data, checked, _ = _info_and_verify(path)
    assert data["writer"]["state"] == "dead" and not data["writer"]["live"]
    assert f"its writer did not close the store: pid {worker.proc.pid}" in text, text
    assert "killed or crashed" in checked and checked.endswith("intact"), checked


def test_unlock_says_it_once(tmp_store: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`gradlog unlock` printed that it broke the lease, and the library logged it too (to
    stderr): the command says it once; break_lease from Python still logs it."""
    _record(tmp_store, range(1))
    _plant_lease(tmp_store, age_s=lease_module.LEASE_TTL_S + 60)
    with caplog.at_level("WARNING", logger="gradlog"):
        result = CliRunner().invoke(app, ["unlock", str(tmp_store)])
    assert result.exit_code == 0, result.output
    assert result.output.count("broke the writer lease") == 1, result.output
    assert not [r for r in caplog.records if "broke the writer lease" in r.getMessage()]
    assert lease_module.read_lease(tmp_store) is None
    _plant_lease(tmp_store, age_s=lease_module.LEASE_TTL_S + 60)
    with caplog.at_level("WARNING", logger="gradlog"):
        lease_module.break_lease(tmp_store)
    assert [r for r in caplog.records if "broke the writer lease" in r.getMessage()]
