"""Shard files of ``DIRECT_MIN_BYTES`` or more are written past the page cache (``O_DIRECT``)
where the file system takes it, and buffered where it does not: the bytes on disk are the same
either way, and a store recorded through either path reads back the loop oracle's gradients."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradlog
from gradlog.store import fs
from gradlog.store.verify import verify

DIRECT = getattr(os, "O_DIRECT", 0)
needs_direct = pytest.mark.skipif(not DIRECT, reason="no O_DIRECT on this platform")


def _parts(n: int) -> list[Any]:
    """Buffers as a shard's: rows, 4-byte checksums, an index, of ``n`` payload bytes."""
    rng = np.random.default_rng(n)
    rows = rng.standard_normal(n // 8)
    return [rows[: len(rows) // 2], b"\x01\x02\x03\x04", rows[len(rows) // 2 :],
            memoryview(b"abcd"), np.arange(33, dtype="<u8")]


def _expected(parts: list[Any]) -> bytes:
    return b"".join(memoryview(p).cast("B").tobytes() for p in parts)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The flags of every ``os.open`` of fs (fs's own state reset for the test)."""
    flags: list[int] = []
    real = os.open

    def spy(path: Any, how: int, *args: Any, **kwargs: Any) -> int:
        flags.append(how)
        return real(path, how, *args, **kwargs)

    monkeypatch.setattr(fs.os, "open", spy)
    monkeypatch.setattr(fs, "_no_direct", set())
    return flags


@needs_direct
@pytest.mark.parametrize("n", [fs.DIRECT_MIN_BYTES, fs.DIRECT_MIN_BYTES + 4093, 3 << 20])
def test_large_files_are_written_direct_with_the_same_bytes(
    tmp_path: Path, opened: list[int], n: int
) -> None:
    parts = _parts(n)
    want = _expected(parts)
    assert fs.write_buffers(tmp_path / "shard", parts) == len(want)
    assert (tmp_path / "shard").read_bytes() == want  # cut to size: no padding left
    if fs._no_direct:  # this file system refused: written buffered, and still right
        pytest.skip("the test's file system refuses O_DIRECT")
    assert any(f & DIRECT for f in opened)
    # rewriting a file (a resumed step) replaces it whole
    small = _parts(n // 2)
    fs.write_buffers(tmp_path / "shard", small)
    assert (tmp_path / "shard").read_bytes() == _expected(small)


@needs_direct
@pytest.mark.parametrize("window", [4096, 3 * 4096, 1 << 20])
def test_large_files_go_out_a_window_at_a_time(
    tmp_path: Path, opened: list[int], monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """A shard larger than the aligned buffer's window is copied and written a window at a
    time (the buffer stays one window); the file holds exactly the buffers."""
    monkeypatch.setattr(fs, "_DIRECT_WINDOW", window)
    monkeypatch.setattr(fs._aligned, "buffer", None, raising=False)
    parts = _parts((1 << 20) + 4096 * 5 + 12)  # buffers that straddle windows
    assert fs.write_buffers(tmp_path / "shard", parts) == len(_expected(parts))
    assert (tmp_path / "shard").read_bytes() == _expected(parts)
    if not fs._no_direct:
        assert any(f & DIRECT for f in opened)
        assert len(fs._aligned.buffer) <= window


def test_small_files_stay_buffered(tmp_path: Path, opened: list[int]) -> None:
    parts = _parts(fs.DIRECT_MIN_BYTES // 2)
    fs.write_buffers(tmp_path / "shard", parts)
    assert (tmp_path / "shard").read_bytes() == _expected(parts)
    assert opened and not any(f & DIRECT for f in opened)


@needs_direct
@pytest.mark.parametrize("where", ["open", "write"])
def test_a_file_system_refusing_direct_writes_gets_buffered_ones(
    tmp_path: Path, opened: list[int], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    real_open, real_pwrite = fs.os.open, os.pwrite

    def refuse_open(path: Any, how: int, *args: Any, **kwargs: Any) -> int:
        if how & DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, how, *args, **kwargs)

    def refuse_write(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    if where == "open":
        monkeypatch.setattr(fs.os, "open", refuse_open)
    else:
        monkeypatch.setattr(fs.os, "pwrite", refuse_write)
    parts = _parts(2 << 20)
    assert fs.write_buffers(tmp_path / "a", parts) == len(_expected(parts))
    assert (tmp_path / "a").read_bytes() == _expected(parts)
    assert os.stat(tmp_path).st_dev in fs._no_direct  # not tried again on this file system
    monkeypatch.setattr(fs.os, "open", real_open)
    monkeypatch.setattr(fs.os, "pwrite", real_pwrite)
    opened.clear()
    monkeypatch.setattr(fs.os, "open", lambda *a, **k: opened.append(a[1]) or real_open(*a, **k))
    fs.write_buffers(tmp_path / "b", parts)
    assert (tmp_path / "b").read_bytes() == _expected(parts)
    assert opened and not any(f & DIRECT for f in opened)


def test_other_errors_of_a_direct_write_are_raised(
    tmp_path: Path, opened: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs.os, "pwrite", full)
    if not DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    with pytest.raises(OSError) as e:
        fs.write_buffers(tmp_path / "a", _parts(2 << 20))
    assert e.value.errno == errno.ENOSPC


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_store_with_direct_shards_reads_back_the_oracle(
    tmp_path: Path, opened: list[int], compression: str
) -> None:
    """A Linear(256, 256) at B 16 has 4 MiB shards (written direct, in lanes beside the
    other layer's), its bias 16 KiB ones (buffered); all read back the loop backend's
    per-datum gradients, and verify; compressed shards are encoded in their lanes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))
    x, y = torch.randn(16, 256), torch.randint(0, 64, (16,))
    want = {}
    for backend, path in (("hooks", tmp_path / "h.gradlog"), ("loop", tmp_path / "l.gradlog")):
        with gradlog.GradRecorder(model, path, backend=backend, compression=compression) as rec:
            for step in range(2):
                losses = nn.functional.cross_entropy(model(x + step), y, reduction="none")
                rec.backward(losses, step=step)
        run = gradlog.open(path)
        want[backend] = {n: run.grads(n, step=1) for n in ("0.weight", "0.bias", "2.weight")}
        assert verify(path).ok  # every checksum, whatever path wrote the shard
    for name, g in want["loop"].items():
        np.testing.assert_allclose(want["hooks"][name], g, rtol=1e-5, atol=1e-7)
    assert want["loop"]["0.weight"].shape == (16, 256, 256)
    if DIRECT and not fs._no_direct and compression == "none":
        assert any(f & DIRECT for f in opened)


@pytest.mark.parametrize("failing", ["0.weight", "2.weight"], ids=["own-lane", "helper-lane"])
def test_a_failed_shard_in_any_lane_is_a_clear_error_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Four 4 MiB shards a call go out in lanes (the writer thread's and helpers'); a disk
    that fills while one lane writes stops the run with the writer's error, whichever lane
    it was, and the step is not committed: the steps before it read back whole."""
    import gradlog.store.writer as writer_module
    from gradlog import errors

    real = writer_module._write_file

    def full(path: Any, buffers: list[Any]) -> int:
        where = str(path).replace("\\", "/")
        if f"/{failing}/" in where and "/c.1." in where:  # step 1's shard of that weight
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, buffers)

    monkeypatch.setattr(writer_module, "_write_file", full)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.Tanh())][:-1])
    x = torch.randn(16, 256)
    path = tmp_path / "r.gradlog"
    with (pytest.raises(errors.StoreWriteError, match="No space left on device"),
          gradlog.GradRecorder(model, path) as rec):
        for step in range(3):
            rec.backward((model(x + step) ** 2).sum(1), step=step)
    monkeypatch.undo()
    run = gradlog.open(path)
    assert run.steps.column("step").to_pylist() == [0]
    assert run.grads("2.weight", step=0).shape == (16, 256, 256)
    assert verify(path).ok
