"""Probe arrays: compressed as the run's records are, chunked so a step's probes are whole
chunks, and read straight into place when uncompressed; every read path agrees with
zarr-python's, and a damaged chunk is refused, never returned."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zarr
from torch import nn

import gradlog
from gradlog.errors import StoreCorruptError
from gradlog.store.probes import probe_array_path, probe_chunk_rows


def _record(path: Path, compression: str, n_probes: int) -> gradlog.Run:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    px, py = torch.randn(n_probes, 6), torch.randint(0, 3, (n_probes,))

    def probe_loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1], reduction="none")

    with gradlog.GradRecorder(model, path, compression=compression,
                              probes=(probe_loss, (px, py))) as rec:
        for step in range(4):
            x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
            rec.backward(F.cross_entropy(model(x), y, reduction="none"),
                         datum_ids=torch.arange(4) + 4 * step, step=step)
    return gradlog.open(path)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_probe_rows_read_as_zarr_reads_them(tmp_path: Path, compression: str) -> None:
    run = _record(tmp_path / "r.gradlog", compression, n_probes=6)
    rng = np.random.default_rng(0)
    for name in ("0.weight", "2.bias"):
        array = run.probe_array(name)
        assert array.plain == (compression == "none")
        raw = zarr.open_array(str(run.path / probe_array_path(name)), mode="r")
        n = int(raw.shape[0])
        for rows in (np.arange(n), np.arange(6, 12), np.sort(rng.choice(n, 5, replace=False))):
            np.testing.assert_array_equal(run.read_probe_rows(name, rows), raw[rows.tolist()])


def test_a_damaged_uncompressed_probe_chunk_is_refused(tmp_path: Path) -> None:
    run = _record(tmp_path / "r.gradlog", "none", n_probes=6)
    directory = run.path / probe_array_path("0.weight")
    chunk = next(p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptError, match="checksum"):
        gradlog.open(run.path).read_probe_rows("0.weight", np.arange(6))
    chunk.write_bytes(bytes(data[:-3]))  # truncated
    with pytest.raises(StoreCorruptError, match="bytes"):
        gradlog.open(run.path).read_probe_rows("0.weight", np.arange(6))


@pytest.mark.parametrize(("n", "row_bytes", "want"), [
    (100, 262144, 50),  # 64 fit; 50 divides 100: a step is two whole chunks
    (100, 1024, 100),
    (97, 262144, 64),  # a prime count of large rows: as many as fit
    (7, 10 << 20, 1),
    (1, 100, 1),
])
def test_probe_chunks_hold_whole_steps_where_they_can(n: int, row_bytes: int, want: int) -> None:
    assert probe_chunk_rows(n, row_bytes) == want
