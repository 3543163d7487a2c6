"""Stores on object storage through fsspec: ``memory://`` always, ``s3://`` against a local
moto server (PyPI ``moto[server]`` and ``s3fs``, the ``s3`` extra) started on loopback.

The oracle is the same training recorded into a local directory: records, gradients, norms
and steps must be identical, after a writer failure and a resume too.
"""

from __future__ import annotations

import json
import socket
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
import gradlog.store.writer as writer_module
from gradlog.cli.main import app
from gradlog.errors import GradlogError, StoreFormatError, StoreWriteError
from gradlog.store.fs import ObjectPath, store_path
from gradlog.store.verify import verify

STEPS = 5


def _data() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for s in range(STEPS):
        batch = 6 if s != 3 else 4  # a smaller call: rows jump to the next shard
        out.append((torch.randn(batch, 5, generator=g), torch.randint(0, 3, (batch,), generator=g),
                    torch.arange(10 * s, 10 * s + batch)))
    return out


def _train(location: Any, *, fail_commit_of: int | None = None, resume: bool = False) -> None:
    """Train the tiny model for STEPS steps, recording into ``location``; replay (unrecorded)
    the steps a resumed store already holds. ``fail_commit_of``: the commit of that step
    fails as if the store became unreachable."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    first = 0
    if resume:
        done = gradlog.open(location).steps.column("step").to_pylist()
        first = max(done) + 1 if done else 0
        for x, y, _ in data[:first]:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    with gradlog.GradRecorder(model, location, resume=resume, check_every=1) as rec:
        for step in range(first, STEPS):
            x, y, ids = data[step]
            opt.zero_grad()
            rec.backward(nn.functional.cross_entropy(model(x), y, reduction="none"),
                         datum_ids=ids, step=step, lr=0.1)
            opt.step()
            if fail_commit_of == step:
                rec.flush()


def _assert_same_run(got: gradlog.Run, want: gradlog.Run) -> None:
    assert got.param_names == want.param_names
    assert got.steps.drop_columns(["time_compute_s", "time_write_s"]).equals(
        want.steps.drop_columns(["time_compute_s", "time_write_s"]))
    assert got.datums.equals(want.datums)
    for name in want.param_names:
        np.testing.assert_array_equal(got.grads(name), want.grads(name))
        np.testing.assert_array_equal(got.grads(name, step=3, datum=[31, 33]),
                                      want.grads(name, step=3, datum=[31, 33]))


@pytest.fixture(scope="module")
def local_oracle(tmp_path_factory: pytest.TempPathFactory) -> gradlog.Run:
    path = tmp_path_factory.mktemp("oracle") / "run.gradlog"
    _train(path)
    return gradlog.open(path)


@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://gradlog-tests/{uuid.uuid4().hex}/run.gradlog"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    """A bucket on a moto S3 server on loopback; fsspec's s3 defaults point at it."""
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install -e '.[s3]'")
    moto_server = pytest.importorskip(
        "moto.server", reason="S3 tests need a local S3 server: pip install 'moto[server]'"
    )
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {
        "key": "testing", "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
    }
    import boto3

    boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    ).create_bucket(Bucket="gradlog-tests")
    try:
        yield "s3://gradlog-tests"
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
        server.stop()


@pytest.fixture(params=["memory", "s3"])
def url(request: pytest.FixtureRequest, memory_url: str) -> str:
    if request.param == "memory":
        return memory_url
    bucket = request.getfixturevalue("s3_bucket")
    return f"{bucket}/{uuid.uuid4().hex}/run.gradlog"


def test_record_read_verify(url: str, local_oracle: gradlog.Run) -> None:
    _train(url)
    run = gradlog.open(url)
    assert isinstance(run.path, ObjectPath) and str(run.path).endswith("/run.gradlog")
    _assert_same_run(run, local_oracle)
    np.testing.assert_array_equal(run.similarity("0.weight", kind="cosine"),
                                  local_oracle.similarity("0.weight", kind="cosine"))
    assert run.stats("2.weight", step=range(1, 4)) == local_oracle.stats("2.weight",
                                                                         step=range(1, 4))
    report = verify(url)
    assert report.ok, [c.problems for c in report.checks]
    result = CliRunner().invoke(app, ["verify", url])
    assert result.exit_code == 0, result.output
    assert "intact" in result.output
    result = CliRunner().invoke(app, ["info", url, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["path"] == str(run.path)


def test_resume_after_a_failed_commit(
    url: str, local_oracle: gradlog.Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer_module._write_parquet_atomic

    def unreachable_at_step_2(table: Any, path: Any) -> None:
        if path.name == "step-000000000002.parquet":
            raise OSError("connection reset (injected)")
        real(table, path)

    monkeypatch.setattr(writer_module, "_write_parquet_atomic", unreachable_at_step_2)
    with pytest.raises(StoreWriteError, match="Steps up to 1 are committed"):
        _train(url, fail_commit_of=2)
    monkeypatch.setattr(writer_module, "_write_parquet_atomic", real)
    assert gradlog.open(url).steps.column("step").to_pylist() == [0, 1]
    assert verify(url).ok  # the uncommitted step's parts are only notes
    _train(url, resume=True)
    _assert_same_run(gradlog.open(url), local_oracle)
    assert verify(url).ok


def test_file_urls_are_local_paths(tmp_path: Path, local_oracle: gradlog.Run) -> None:
    _train(f"file://{tmp_path}/run.gradlog")
    assert store_path(f"file://{tmp_path}/run.gradlog") == tmp_path / "run.gradlog"
    _assert_same_run(gradlog.open(tmp_path / "run.gradlog"), local_oracle)


@pytest.mark.parametrize("rel", ["..", "../other", "a/../../b", "/abs", "a//b", "./x"])
def test_object_paths_never_leave_the_store(rel: str) -> None:
    root = store_path("memory://bucket/run.gradlog")
    with pytest.raises(StoreFormatError, match="never reads or writes outside"):
        root / rel


def test_crafted_store_cannot_make_gradlog_write_outside(memory_url: str) -> None:
    _train(memory_url)
    fs = fsspec.filesystem("memory")
    root = memory_url.removeprefix("memory://")
    parent = root.rsplit("/", 1)[0]
    before = set(fs.find(parent))
    meta = json.loads(fs.cat_file(f"{root}/zarr.json"))
    meta["attributes"]["params"]["0.weight"]["array"] = "../../escaped"
    fs.pipe_file(f"{root}/zarr.json", json.dumps(meta).encode())
    with pytest.raises(GradlogError, match="array"):
        gradlog.open(memory_url)
    with pytest.raises(GradlogError):
        _train(memory_url, resume=True)
    # a foreign entry named like a traversal in the commit log directory is never followed
    after = {p for p in fs.find(parent) if not p.startswith(root + "/")}
    assert after == {p for p in before if not p.startswith(root + "/")}


def test_unknown_protocol_is_a_clear_error() -> None:
    with pytest.raises(GradlogError, match="cannot open"):
        gradlog.open("nosuchproto://x/run.gradlog")


def test_probes_on_object_storage_are_refused(memory_url: str) -> None:
    model = nn.Linear(3, 2)
    probes = (lambda m, b: m(b).sum(1), torch.randn(2, 3))
    with pytest.raises(GradlogError, match="object storage"), gradlog.GradRecorder(
        model, memory_url, probes=probes
    ) as rec:
        rec.backward(model(torch.randn(4, 3)).sum(1))


def test_overwrite_replaces_only_a_gradlog_store(memory_url: str) -> None:
    from gradlog.errors import StoreExistsError

    model = nn.Linear(3, 2)
    for batch in (4, 2):
        with gradlog.GradRecorder(model, memory_url, overwrite=True) as rec:
            rec.backward(model(torch.randn(batch, 3)).sum(1))
    assert gradlog.open(memory_url).datums.num_rows == 2
    with pytest.raises(StoreExistsError, match="already holds a gradlog run"):
        gradlog.GradRecorder(model, memory_url).open()
    foreign = memory_url.rsplit("/", 1)[0] + "/foreign"
    fsspec.filesystem("memory").pipe_file(foreign.removeprefix("memory://") + "/data.bin", b"x")
    with pytest.raises(StoreExistsError, match="not a gradlog store"):
        gradlog.GradRecorder(model, foreign, overwrite=True).open()
    assert fsspec.filesystem("memory").cat_file(foreign.removeprefix("memory://") + "/data.bin")


def test_planned_steps_on_object_storage_records(memory_url: str) -> None:
    """``planned_steps=`` asks for the free space where the store lives: an object store has
    no local disk to ask (the check once crashed on its path), so the recording just goes on."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    from gradlog.store.fs import store_path  # how the CLI passes --storage-option

    with gradlog.GradRecorder(model, store_path(memory_url, {}), planned_steps=2) as rec:
        for _ in range(2):
            model.zero_grad()
            rec.backward(((model(x) - y) ** 2).sum(1))
    assert gradlog.open(memory_url).steps.num_rows == 2
