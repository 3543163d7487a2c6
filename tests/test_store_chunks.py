"""Version 2 arrays byte by byte: gradlog writes the bytes zarr-python writes, zarr-python reads
gradlog's shards bit for bit, and the storage dtypes round as documented.

Expected values come from zarr-python and numcodecs themselves (their own writes, their own
BitRound) and from torch's bfloat16/float16 casts, never from gradlog.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from numcodecs import BitRound
from zarr.codecs import BloscCodec, Crc32cCodec

import gradlog
from gradlog import errors
from gradlog.recording.staging import to_storage_torch
from gradlog.store import chunks
from gradlog.store.chunks import ShardLayout
from gradlog.store.dtypes import (
    default_compression,
    from_storage,
    storage_dtype,
    to_storage_numpy,
)

CASES = [
    ((4, 3), "float32"),
    ((5,), "float64"),
    ((), "float32"),
    ((2, 3), "uint16"),
    ((7,), "float16"),
    ((2, 1, 3), "float32"),
]


def _write_shards(directory: Path, layout: ShardLayout, data: np.ndarray) -> None:
    directory.mkdir(parents=True)
    (directory / "zarr.json").write_text(json.dumps(layout.metadata(len(data))))
    c = layout.rows_per_shard
    for start in range(0, len(data), c):
        file = directory / layout.shard_key(start // c)
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(file, "wb") as f:
            for buf in layout.encode(np.ascontiguousarray(data[start : start + c])):
                f.write(buf)


def _zarr_writes(directory: Path, layout: ShardLayout, data: np.ndarray) -> None:
    dims = [max(1, d) for d in layout.row_shape]
    compressors: list[Any] = [Crc32cCodec()]
    if layout.compression != "none":
        itemsize = layout.array_dtype.itemsize
        blosc = BloscCodec(
            cname=layout.compression, clevel=1, shuffle="bitshuffle", typesize=itemsize, blocksize=0
        )
        compressors.insert(0, blosc)
    arr = zarr.create_array(
        str(directory),
        shape=data.shape,
        shards=(layout.rows_per_shard, *dims),
        chunks=(1, *dims),
        dtype=data.dtype,
        fill_value=0,
        compressors=compressors,
        dimension_names=["record", *(f"dim_{i}" for i in range(len(layout.row_shape)))],
        chunk_key_encoding={"name": "default", "separator": "."},
        config={"write_empty_chunks": True},
    )
    arr[:] = data


@pytest.mark.parametrize(
    ("compression", "packed"),
    [("none", True), ("none", False), ("lz4", False), ("zstd", False)],
    ids=["none-packed", "none-views", "lz4", "zstd"],
)
@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_gradlog_writes_the_bytes_zarr_writes(
    tmp_path: Path, compression: str, shape: tuple[int, ...], dtype: str, packed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small uncompressed shards are packed into one buffer, large ones written as views of
    their rows (forced here): both give zarr's bytes."""
    if not packed:
        monkeypatch.setattr(chunks, "PACK_MAX_BYTES", 0)
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((7, *shape)) * 100).astype(dtype)  # 7 rows: shards 3, 3, 1
    layout = ShardLayout(shape, np.dtype(dtype), 3, compression)
    _write_shards(tmp_path / "mine", layout, data)
    _zarr_writes(tmp_path / "theirs", layout, data)
    mine = json.loads((tmp_path / "mine/zarr.json").read_text())
    theirs = json.loads((tmp_path / "theirs/zarr.json").read_text())
    assert mine == theirs
    for shard in range(3):
        key = layout.shard_key(shard)
        assert (tmp_path / "mine" / key).read_bytes() == (tmp_path / "theirs" / key).read_bytes()
    got = zarr.open_array(str(tmp_path / "mine"), mode="r")[:]
    assert got.dtype == data.dtype
    assert got.tobytes() == data.tobytes()  # bit for bit
    parsed = ShardLayout.from_metadata(theirs, "theirs")
    assert parsed == layout


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    per_shard=st.integers(1, 4),
    wanted=st.lists(st.integers(0, 8), min_size=1, max_size=12),
    compression=st.sampled_from(["none", "lz4"]),
)
def test_layout_reads_any_rows_of_what_zarr_wrote(
    tmp_path_factory: pytest.TempPathFactory,
    rows: int,
    per_shard: int,
    wanted: list[int],
    compression: str,
) -> None:
    tmp = tmp_path_factory.mktemp("z")
    data = np.arange(rows * 6, dtype=np.float32).reshape(rows, 2, 3) * 1.5
    layout = ShardLayout((2, 3), np.dtype("float32"), per_shard, compression)
    _zarr_writes(tmp / "a", layout, data)
    picked = [r for r in wanted if r < rows]
    for shard in sorted({r // per_shard for r in picked}):
        positions = [r - shard * per_shard for r in picked if r // per_shard == shard]
        out = np.empty((len(positions), 2, 3), dtype=np.float32)
        layout.read_rows(str(tmp / "a" / layout.shard_key(shard)), shard, positions, out, "a")
        np.testing.assert_array_equal(out, data[[shard * per_shard + p for p in positions]])


def test_partial_last_shard_reads_as_missing_rows(tmp_path: Path) -> None:
    layout = ShardLayout((3,), np.dtype("float32"), 4)
    data = np.ones((2, 3), dtype=np.float32)
    _write_shards(tmp_path / "a", layout, data)  # one shard with rows 0, 1 of 4
    meta = json.loads((tmp_path / "a/zarr.json").read_text())
    meta["shape"][0] = 4
    (tmp_path / "a/zarr.json").write_text(json.dumps(meta))
    expected = [[1] * 3] * 2 + [[0] * 3] * 2  # zarr: missing inner chunks read as fill value
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "a"))[:], expected)
    out = np.empty((1, 3), dtype=np.float32)
    with pytest.raises(errors.StoreCorruptError, match="does not hold this committed record"):
        layout.read_rows(str(tmp_path / "a" / layout.shard_key(0)), 0, [3], out, "a")


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_every_flipped_byte_of_a_shard_is_detected(tmp_path: Path, compression: str) -> None:
    layout = ShardLayout((2,), np.dtype("float32"), 2, compression)
    data = np.array([[1.5, -2.0], [3.25, 4.0]], dtype=np.float32)
    _write_shards(tmp_path / "a", layout, data)
    shard = tmp_path / "a" / layout.shard_key(0)
    good = shard.read_bytes()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x01
        shard.write_bytes(bytes(bad))
        out = np.empty((2, 2), dtype=np.float32)
        with pytest.raises(errors.StoreCorruptError):
            layout.read_rows(str(shard), 0, [0, 1], out, "a")
    for cut in (0, 5, len(good) - 1):
        shard.write_bytes(good[:cut])
        with pytest.raises(errors.StoreCorruptError):
            layout.read_rows(str(shard), 0, [0], np.empty((1, 2), np.float32), "a")
    shard.unlink()
    with pytest.raises(errors.StoreCorruptError, match="missing"):
        layout.read_rows(str(shard), 0, [0], np.empty((1, 2), np.float32), "a")


@pytest.mark.parametrize(
    "breakage",
    [
        lambda m: m.update(shape="big"),
        lambda m: m.update(shape=[3, -1]),
        lambda m: m.update(shape=[3, 2**40, 2**40]),
        lambda m: m.update(data_type="object"),
        lambda m: m.update(data_type="int32"),  # int64 is a form's index array
        lambda m: m.update(node_type="group"),
        lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[3, 5]),
        lambda m: m["chunk_grid"].update(name="rectilinear"),
        lambda m: m.update(chunk_key_encoding={"name": "v2"}),
        lambda m: m["chunk_key_encoding"]["configuration"].update(separator="/"),
        lambda m: m["codecs"][0]["configuration"].update(chunk_shape=[2, 2]),
        lambda m: m["codecs"][0]["configuration"].update(index_location="start"),
        lambda m: m["codecs"][0]["configuration"]["codecs"].pop(),  # no crc32c
        lambda m: m["codecs"][0].update(name="transpose"),
        lambda m: m.update(codecs=[]),
    ],
)
def test_crafted_array_metadata_is_refused(breakage: Any) -> None:
    meta = ShardLayout((2,), np.dtype("float32"), 3).metadata(6)
    assert ShardLayout.from_metadata(json.loads(json.dumps(meta)), "x").rows_per_shard == 3
    breakage(meta)
    with pytest.raises(errors.StoreFormatError, match="format version 2 arrays are sharded"):
        ShardLayout.from_metadata(meta, "x")


def test_crafted_blosc_header_is_refused_before_decompressing(tmp_path: Path) -> None:
    layout = ShardLayout((4,), np.dtype("float32"), 1, "lz4")
    _write_shards(tmp_path / "a", layout, np.ones((1, 4), np.float32))
    shard = tmp_path / "a" / layout.shard_key(0)
    raw = bytearray(shard.read_bytes())
    raw[4:8] = (2**31).to_bytes(4, "little")  # claims 2 GiB of output
    body_end = len(raw) - layout.index_bytes - 4
    from gradlog.store.chunks import crc32c_bytes

    raw[body_end : body_end + 4] = crc32c_bytes(bytes(raw[:body_end]))  # a "valid" checksum
    shard.write_bytes(bytes(raw))
    with pytest.raises(errors.StoreCorruptError, match="claims 2147483648 bytes"):
        layout.read_rows(str(shard), 0, [0], np.empty((1, 4), np.float32), "a")


# -- storage dtypes ------------------------------------------------------------------------------
def _gradient_like(n: int = 20000) -> np.ndarray:
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-12, 2, n)
    x[:6] = [0.0, -0.0, 1e-40, -3e-39, 65504.0, 1e-8]  # zeros, float32 subnormals
    return x.astype(np.float32)


@pytest.mark.parametrize("keepbits", [1, 5, 7, 9, 10, 22])
def test_bitround_equals_numcodecs_bitround(keepbits: int) -> None:
    x = _gradient_like()
    want = BitRound(keepbits).encode(x).view(np.float32)
    dtype = storage_dtype(f"bitround{keepbits}")
    assert to_storage_numpy(x, dtype).tobytes() == want.tobytes()
    assert to_storage_torch(torch.from_numpy(x), dtype).numpy().tobytes() == want.tobytes()
    assert from_storage(want, dtype).tobytes() == want.tobytes()
    rel = np.abs(want - x) / np.maximum(np.abs(x), np.finfo(np.float32).tiny)
    assert float(rel[x != 0].max()) <= 2.0 ** -(keepbits + 1) * (1 + 1e-6)  # half a unit


def test_bfloat16_is_torchs_rounding_and_reads_back_as_float32() -> None:
    x = _gradient_like()
    dtype = storage_dtype("bfloat16")
    want = torch.from_numpy(x).to(torch.bfloat16)
    bits_np = to_storage_numpy(x, dtype)
    bits_torch = to_storage_torch(torch.from_numpy(x), dtype).numpy().view(np.uint16)
    assert bits_np.dtype == np.uint16
    np.testing.assert_array_equal(bits_np, want.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(bits_torch, bits_np)
    back = from_storage(bits_np, dtype)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, want.float().numpy())
    np.testing.assert_array_equal(from_storage(bits_np, dtype, np.float64), back.astype(np.float64))


def test_float16_underflows_small_gradients() -> None:
    """Why FORMAT.md advises against float16: tiny gradients flush to zero."""
    x = np.array([1e-3, 6e-5, 1e-7, 1e-9], dtype=np.float32)
    stored = to_storage_numpy(x, storage_dtype("float16"))
    assert stored.dtype == np.float16
    assert stored[-1] == 0 and stored[0] != 0
    back = from_storage(stored, storage_dtype("float16"))
    np.testing.assert_array_equal(back, x.astype(np.float16))


def test_storage_dtype_names() -> None:
    assert storage_dtype("float32").itemsize == 4 and not storage_dtype("float32").lossy
    assert storage_dtype("bfloat16").itemsize == 2 and storage_dtype("bfloat16").lossy
    assert storage_dtype("bitround9").keepbits == 9
    for bad in ("bitround0", "bitround23", "int8", "bfloat", "bitround"):
        with pytest.raises(errors.ConfigError, match="bitroundN"):
            storage_dtype(bad)
    assert default_compression("float32") == "none"
    assert default_compression("bfloat16") == "none"
    assert default_compression("bitround9") == "lz4"
    with pytest.raises(errors.ConfigError, match="bitroundN"):
        gradlog.RecorderConfig(dtype="int8")
    with pytest.raises(errors.ConfigError, match="compression"):
        gradlog.RecorderConfig(compression="gzip")
    assert gradlog.RecorderConfig(dtype="bitround7").compression == "lz4"
    assert gradlog.RecorderConfig(dtype="bitround7", compression="none").compression == "none"


def test_zero_size_layout_round_trips(tmp_path: Path) -> None:
    layout = ShardLayout((0, 3), np.dtype("float32"), 2)
    meta = layout.metadata(2)
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [2, 1, 3]
    assert ShardLayout.from_metadata(meta, "x") == layout
    os.makedirs(tmp_path / "a")
    (tmp_path / "a/zarr.json").write_text(json.dumps(meta))
    assert zarr.open_array(str(tmp_path / "a"))[:].shape == (2, 0, 3)
