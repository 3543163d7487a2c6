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


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Embedding(10, 8), nn.Linear(8, 5), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, heads: str = "ab") -> torch.Tensor:
        h = self.body(x)
        return sum((getattr(self, k)(h) for k in heads), torch.zeros(()))


def _record_a_silent_probe(path: Path, compression: str) -> gradlog.Run:
    """Probes whose loss does not use head ``b``: their gradients of it are zero, so its
    probe chunks (a step's probes each) hold zeros alone; head ``a``'s do not."""
    torch.manual_seed(0)
    model = _TwoHeads()
    px, py = torch.randint(0, 10, (2, 5)), torch.randint(0, 5, (2, 5))

    def probe_losses(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0], "a").transpose(1, 2), batch[1],
                               reduction="none").mean(1)

    with gradlog.GradRecorder(model, path, compression=compression,
                              probes=(probe_losses, (px, py))) as rec:
        for step in range(2):
            x, y = torch.randint(0, 10, (4, 5)), torch.randint(0, 5, (4, 5))
            rec.backward(F.cross_entropy(model(x).transpose(1, 2), y,
                                         reduction="none").mean(1), step=step, lr=0.1)
    return gradlog.open(path)


def _chunk_files(run: gradlog.Run, name: str) -> list[Path]:
    directory = run.path / probe_array_path(name)
    array = zarr.open_array(str(directory), mode="r")
    rest = (0,) * (len(array.shape) - 1)
    return [directory / array.metadata.encode_chunk_key((c, *rest))
            for c in range(array.cdata_shape[0])]


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_an_all_zero_probe_chunk_is_written_and_read_as_zeros(tmp_path: Path,
                                                              compression: str) -> None:
    """A probe gradient of zero (a parameter its loss does not use; every token masked) left
    its chunk unwritten (zarr's default for a chunk of fill values), and the plain reader
    took that for damage: every influence query and `gradlog verify` failed. Every chunk
    is now written; one missing from a store written before reads as zeros where the probe
    parts record norms of 0 for its rows."""
    from gradlog.store.verify import verify

    run = _record_a_silent_probe(tmp_path / "r.gradlog", compression)
    assert set(run.probes.column("norm/b.weight").to_pylist()) == {0.0}
    files = _chunk_files(run, "b.weight")
    assert len(files) == 2 and all(f.is_file() for f in files)
    assert verify(run.path).ok
    want = run.influence(0, top=None)
    files[1].unlink()  # as zarr left it before
    run = gradlog.open(run.path)
    assert not run.read_probe_rows("b.weight", np.arange(4)).any()
    assert run.read_probe_rows("a.weight", np.arange(4)).any()
    assert run.influence(0, top=None).equals(want)
    assert verify(run.path).ok


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_lost_probe_chunk_of_a_nonzero_gradient_is_refused(tmp_path: Path,
                                                             compression: str) -> None:
    """A chunk holding a probe's nonzero gradient, lost: refused on every read path. zarr's
    own path (compressed) read it as its fill value, zeros, and influence scores were then
    zero in silence; the probe parts' exact norms are now the witness."""
    from gradlog.store.verify import verify

    run = _record_a_silent_probe(tmp_path / "r.gradlog", compression)
    _chunk_files(run, "a.weight")[1].unlink()  # step 1's probes
    run = gradlog.open(run.path)
    with pytest.raises(StoreCorruptError, match="c/1/0"):
        run.read_probe_rows("a.weight", np.arange(4))
    with pytest.raises(StoreCorruptError):
        run.influence(0, params="a.weight", top=None)
    assert not verify(run.path).ok


@pytest.mark.parametrize(("n", "row_bytes", "want"), [
    (100, 262144, 50),  # 64 fit; 50 divides 100: a step is two whole chunks
    (100, 1024, 100),
    (97, 262144, 64),  # a prime count of large rows: as many as fit
    (7, 10 << 20, 1),
    (1, 100, 1),
])
def test_probe_chunks_hold_whole_steps_where_they_can(n: int, row_bytes: int, want: int) -> None:
    assert probe_chunk_rows(n, row_bytes) == want
