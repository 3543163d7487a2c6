"""Gradient arrays of format version 2, chunk by chunk: the bytes zarr would write, directly.

A version 2 gradient array is a Zarr v3 array whose chunk grid holds one **shard** per
``rows_per_shard`` records (FORMAT.md section 4): shard ``s`` of parameter ``p`` is the file
``grads/<p>/c.<s>.0...`` (default chunk key encoding, separator ``.``: no directory per shard,
which measured 2-3x faster to create than ``c/<s>/0/0``). It holds the rows
``s * rows_per_shard ...`` as inner chunks of one row each, each encoded ``bytes`` (little
endian) [+ ``blosc``] + ``crc32c``, followed by the shard index (``(rows_per_shard, 2)`` uint64
offset/length pairs, ``bytes`` + ``crc32c``) at the end: the ``sharding_indexed`` codec of the
Zarr v3 specification.

zarr-python 3.1 spends ~0.3-0.5 ms of asyncio overhead per inner chunk, far more than the
disk needs (tests/benchmarks/RESULTS.md, "Store"); this module writes the same bytes with
one ``writev`` per shard and reads them with ``pread``. zarr-python reads what it writes bit
for bit (tests). Every inner chunk and every index is checksummed, so damage raises
:class:`StoreCorruptError` naming the array and chunk; a missing inner chunk of a row that
the index says was written is damage too, never zeros.

Imports no torch; numcodecs is imported only for compressed arrays.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import crc32c
import numpy as np

from gradlog.errors import StoreCorruptError, StoreFormatError
from gradlog.store.fs import StorePath, open_ranges

__all__ = ["INNER_ROWS", "MISSING", "PACK_MAX_BYTES", "ShardLayout", "crc32c_bytes"]

INNER_ROWS = 1
"""Rows per inner chunk: one datum, so that reading one datum reads only its bytes."""

PACK_MAX_BYTES = 1 << 20
"""Uncompressed shards of fewer row bytes are encoded into one buffer (:meth:`ShardLayout.
encode`); larger ones as views of their rows (no copy: a direct write copies them once)."""

MISSING = np.uint64(2**64 - 1)
"""Offset and length of an inner chunk that a shard does not hold (Zarr v3 sharding)."""

_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}
_MAX_ELEMENTS = 2**53  # far beyond any real tensor; guards against crafted shapes
_BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, ...


def crc32c_bytes(data: Any) -> bytes:
    """The 4 bytes the ``crc32c`` codec appends: CRC-32C of ``data``, little endian."""
    return struct.pack("<I", crc32c.crc32c(data))


def _blosc_config(cname: str, typesize: int) -> dict[str, Any]:
    return {
        "name": "blosc",
        "configuration": {
            "cname": cname,
            "clevel": 1,
            "shuffle": "bitshuffle",
            "typesize": typesize,
            "blocksize": 0,
        },
    }


@dataclass(frozen=True)
class ShardLayout:
    """How one version 2 gradient array is cut into shard files.

    Attributes:
        row_shape: The parameter's shape: one record's gradient.
        array_dtype: numpy dtype of the stored elements (little endian).
        rows_per_shard: Records per shard file (``c`` in FORMAT.md).
        compression: ``"none"``, ``"lz4"`` or ``"zstd"`` (blosc, bitshuffle, level 1).
    """

    row_shape: tuple[int, ...]
    array_dtype: np.dtype[Any]
    rows_per_shard: int
    compression: str = "none"

    @property
    def row_elements(self) -> int:
        """Elements of one record."""
        return math.prod(self.row_shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one record before compression."""
        return self.row_elements * self.array_dtype.itemsize

    @property
    def index_bytes(self) -> int:
        """Bytes of the encoded shard index, checksum included."""
        return self.rows_per_shard * 16 + 4

    @property
    def _dims(self) -> list[int]:
        """Chunk extent of the parameter's axes: all of it (a zero-size axis gets 1)."""
        return [max(1, d) for d in self.row_shape]

    def shard_key(self, shard: int) -> str:
        """File of shard ``shard`` in the array's directory (default encoding, ``.``)."""
        return "c." + ".".join([str(shard)] + ["0"] * len(self.row_shape))

    def shard_of_key(self, key: str) -> int | None:
        """The shard a file name holds, or None for a file that is not a shard."""
        parts = key.split(".")
        zeros = ["0"] * len(self.row_shape)
        if len(parts) != 2 + len(zeros) or parts[0] != "c" or parts[2:] != zeros:
            return None
        return int(parts[1]) if parts[1].isdigit() else None

    def inner_codecs(self) -> list[dict[str, Any]]:
        """The codec chain of one inner chunk."""
        if self.compression == "none":
            return [_BYTES, _CRC]
        return [_BYTES, _blosc_config(self.compression, self.array_dtype.itemsize), _CRC]

    def metadata(self, n_rows: int) -> dict[str, Any]:
        """The array's ``zarr.json`` with ``n_rows`` records."""
        return {
            "shape": [n_rows, *self.row_shape],
            "data_type": self.array_dtype.name,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [self.rows_per_shard, *self._dims]},
            },
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "fill_value": 0 if self.array_dtype.kind in "iu" else 0.0,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [INNER_ROWS, *self._dims],
                        "codecs": self.inner_codecs(),
                        "index_codecs": [_BYTES, _CRC],
                        "index_location": "end",
                    },
                }
            ],
            "attributes": {},
            "dimension_names": ["record", *(f"dim_{i}" for i in range(len(self.row_shape)))],
            "zarr_format": 3,
            "node_type": "array",
            "storage_transformers": [],
        }

    @classmethod
    def from_metadata(cls, meta: Any, where: str) -> ShardLayout:
        """Parse and check an array's ``zarr.json`` written by a version 2 writer.

        Raises:
            StoreFormatError: anything that is not exactly the version 2 layout (with where
                it is); crafted shapes, codecs or dtypes never reach an allocation.
        """

        def bad(why: str) -> StoreFormatError:
            return StoreFormatError(
                f"{where}: {why}; format version 2 arrays are sharded as FORMAT.md section 4 "
                "says. The store was damaged or not written by gradlog: run `gradlog verify`."
            )

        if not isinstance(meta, dict) or meta.get("node_type") != "array":
            raise bad("zarr.json does not describe a Zarr array")
        raw_shape = meta.get("shape")
        if not _int_list(raw_shape) or not raw_shape:
            raise bad(f"shape {raw_shape!r} is not a list of non-negative integers")
        shape = raw_shape
        row_shape = tuple(shape[1:])
        if math.prod(row_shape) > _MAX_ELEMENTS or shape[0] > _MAX_ELEMENTS:
            raise bad(f"shape {shape!r} is impossibly large")
        data_type = meta.get("data_type")
        # a name of the closed set before numpy parses it (a crafted dict or format string
        # made np.dtype raise a bare ValueError)
        if data_type not in ("float16", "float32", "float64", "uint16", "int64"):
            raise bad(f"data_type {data_type!r} is not a storage type")
        dtype = np.dtype(str(data_type))
        grid = meta.get("chunk_grid", {})
        config_grid = grid.get("configuration", {}) if isinstance(grid, dict) else {}
        raw_outer = config_grid.get("chunk_shape") if isinstance(config_grid, dict) else None
        if not (isinstance(grid, dict) and grid.get("name") == "regular" and _int_list(raw_outer)):
            raise bad(f"chunk_grid {grid!r} is not a regular grid")
        outer = raw_outer
        dims = [max(1, d) for d in row_shape]
        if len(outer) != len(shape) or list(outer[1:]) != dims or outer[0] < 1:
            raise bad(f"chunk shape {outer!r} is not (rows_per_shard, *{list(row_shape)})")
        key_encoding = meta.get("chunk_key_encoding")
        if key_encoding != {"name": "default", "configuration": {"separator": "."}}:
            raise bad(f"chunk_key_encoding {key_encoding!r} is not the default with '.'")
        codecs = meta.get("codecs")
        if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)):
            raise bad(f"codecs {codecs!r} are not one sharding_indexed codec")
        shard = codecs[0]
        config = shard.get("configuration", {})
        if shard.get("name") != "sharding_indexed" or not isinstance(config, dict):
            raise bad(f"codec {shard.get('name')!r} is not sharding_indexed")
        if config.get("chunk_shape") != [INNER_ROWS, *dims]:
            raise bad(f"inner chunk shape {config.get('chunk_shape')!r} is not one row")
        if config.get("index_codecs") != [_BYTES, _CRC] or config.get("index_location") != "end":
            raise bad("the shard index is not bytes + crc32c at the end")
        inner = config.get("codecs")
        for compression in ("none", "lz4", "zstd"):
            layout = cls(row_shape, dtype.newbyteorder("<"), int(outer[0]), compression)
            if inner == layout.inner_codecs():
                return layout
        raise bad(f"inner codecs {inner!r} are not bytes [+ blosc] + crc32c")

    # -- writing ------------------------------------------------------------------------------
    def encode(self, rows: np.ndarray) -> list[Any]:
        """Encode up to ``rows_per_shard`` rows as one shard: a list of buffers to write in
        order (``os.writev``); rows past ``len(rows)`` are left out (index entries missing).

        ``rows`` must have the array dtype and be C-contiguous. Uncompressed rows of
        :data:`PACK_MAX_BYTES` or more are not copied; fewer come as one packed buffer.
        """
        n = len(rows)
        if not 1 <= n <= self.rows_per_shard:
            raise ValueError(f"a shard holds 1..{self.rows_per_shard} rows, got {n}")
        if self.compression == "none" and 0 < n * self.row_bytes < PACK_MAX_BYTES:
            return [self._packed(rows)]
        compressor = None
        if self.compression != "none":
            from numcodecs import Blosc

            compressor = Blosc(cname=self.compression, clevel=1, shuffle=Blosc.BITSHUFFLE)
        index = np.full((self.rows_per_shard, 2), MISSING, dtype="<u8")
        parts: list[Any] = []
        offset = 0
        for i in range(n):
            data: Any = rows[i : i + 1]  # (1, *row_shape), a view
            data = compressor.encode(data) if compressor is not None else memoryview(data).cast("B")
            checksum = crc32c_bytes(data)
            length = len(data) + 4
            parts += [data, checksum]
            index[i] = (offset, length)
            offset += length
        index_bytes = index.tobytes()
        parts += [index_bytes, crc32c_bytes(index_bytes)]
        return parts

    def _packed(self, rows: np.ndarray) -> np.ndarray:
        """An uncompressed shard as one buffer, the bytes of the parts above joined: a
        small shard costs one copy of its rows instead of Python work per row (a
        ``projection`` step writes 37 shards of 16 rows on the small GPT)."""
        n, size = len(rows), self.row_bytes
        step = size + 4
        out = np.empty(n * step + self.index_bytes, dtype=np.uint8)
        body = out[: n * step].reshape(n, step)
        body[:, :size] = rows.reshape(n, self.row_elements).view(np.uint8)
        sums = np.fromiter((crc32c.crc32c(row) for row in body[:, :size]), "<u4", count=n)
        body[:, size:] = sums.view(np.uint8).reshape(n, 4)
        index = np.full((self.rows_per_shard, 2), MISSING, dtype="<u8")
        index[:n, 0] = np.arange(n, dtype="<u8") * np.uint64(step)
        index[:n, 1] = step
        tail = out[n * step :]
        tail[:-4] = index.view(np.uint8).reshape(-1)
        tail[-4:] = np.frombuffer(crc32c_bytes(tail[:-4]), dtype=np.uint8)
        return out

    # -- reading ------------------------------------------------------------------------------
    def decode_index(self, encoded: bytes, where: str) -> np.ndarray:
        """The ``(rows_per_shard, 2)`` offset/length table of a shard, checksum verified."""
        if len(encoded) != self.index_bytes:
            raise StoreCorruptError(f"{where}: the shard is truncated (no complete index).")
        body, checksum = encoded[:-4], encoded[-4:]
        if crc32c_bytes(body) != checksum:
            raise StoreCorruptError(f"{where}: the shard index fails its crc32c checksum.")
        return np.frombuffer(body, dtype="<u8").reshape(self.rows_per_shard, 2)

    def decode_row(self, encoded: Any, where: str, out: np.ndarray) -> None:
        """Decode one inner chunk (checksum included) into ``out`` (one row, array dtype)."""
        view = memoryview(encoded)
        if len(view) < 4:
            raise StoreCorruptError(f"{where}: the chunk is truncated.")
        body, checksum = view[:-4], bytes(view[-4:])
        if crc32c_bytes(body) != checksum:
            raise StoreCorruptError(
                f"{where}: the chunk fails its crc32c checksum: its bytes were damaged after "
                "writing. The values are not returned."
            )
        if self.compression == "none":
            if len(body) != self.row_bytes:
                raise StoreCorruptError(
                    f"{where}: the chunk holds {len(body)} bytes, a row has {self.row_bytes}."
                )
            out[...] = np.frombuffer(body, dtype=self.array_dtype).reshape(out.shape)
            return
        if len(body) < _BLOSC_HEADER.size:
            raise StoreCorruptError(f"{where}: the compressed chunk has no blosc header.")
        _, _, _, _, nbytes, _, cbytes = _BLOSC_HEADER.unpack_from(body)
        if nbytes != self.row_bytes or cbytes != len(body):
            raise StoreCorruptError(
                f"{where}: the compressed chunk claims {nbytes} bytes ({cbytes} compressed); "
                f"a row has {self.row_bytes} ({len(body)} stored)."
            )
        from numcodecs import Blosc

        Blosc().decode(body, out=out.reshape(-1).view(np.uint8))

    def read_rows(
        self, path: StorePath, shard: int, positions: Sequence[int], out: np.ndarray, where: str
    ) -> None:
        """Read rows ``positions`` (within the shard) of shard file ``path`` into ``out``.

        Reads the whole file when most of its rows are wanted, else the index and each row
        (``pread`` locally, ranged GETs on object storage: :mod:`gradlog.store.fs`).

        Raises:
            StoreCorruptError: the file is missing, truncated or fails a checksum, or a wanted
                row is not in it.
        """
        if self.row_elements == 0:  # a zero-size parameter's rows are empty: none written
            return
        try:
            with open_ranges(path) as file:
                self._read_rows(file, shard, positions, out, where)
        except FileNotFoundError:
            raise StoreCorruptError(
                f"{where}: shard file {path} is missing, though committed records live in it."
            ) from None

    def _read_rows(
        self, file: Any, shard: int, positions: Sequence[int], out: np.ndarray, where: str
    ) -> None:
        size = file.size
        if size < self.index_bytes:
            raise StoreCorruptError(f"{where}: the shard is truncated ({size} bytes).")
        if file.fd is not None and self.compression == "none" and out.flags.c_contiguous:
            index = self.decode_index(file.pread(self.index_bytes, size - self.index_bytes),
                                      where)
            self._scatter_rows(file.fd, shard, positions, index, size - self.index_bytes, out,
                               where)
            return
        whole = 2 * len(positions) >= self.rows_per_shard
        if whole:
            data = file.pread(size, 0)
            index = self.decode_index(data[size - self.index_bytes :], where)
        else:
            index = self.decode_index(file.pread(self.index_bytes, size - self.index_bytes), where)
        limit = size - self.index_bytes
        for k, pos in enumerate(positions):
            offset, length, chunk_where = self._located(index, shard, pos, limit, where)
            encoded = memoryview(data)[offset : offset + length] if whole else file.pread(
                length, offset
            )
            # a view even for scalar parameters (out[k] would be a numpy scalar, a copy)
            self.decode_row(encoded, chunk_where, out[k : k + 1].reshape(out.shape[1:]))


    def _located(self, index: np.ndarray, shard: int, pos: int, limit: int, where: str
                 ) -> tuple[int, int, str]:
        """Offset and length of inner chunk ``pos`` from the shard's index, checked."""
        offset, length = (int(v) for v in index[pos])
        row = shard * self.rows_per_shard + pos
        chunk_where = f"{where}, inner chunk {pos} (record row {row})"
        if offset == int(MISSING) and length == int(MISSING):
            raise StoreCorruptError(
                f"{chunk_where}: the shard does not hold this committed record."
            )
        if offset + length > limit or length < 4:
            raise StoreCorruptError(
                f"{chunk_where}: the index points outside the shard (offset {offset}, "
                f"length {length}, {limit} data bytes)."
            )
        return offset, length, chunk_where

    def _scatter_rows(self, fd: int, shard: int, positions: Sequence[int], index: np.ndarray,
                      limit: int, out: np.ndarray, where: str) -> None:
        """Uncompressed rows of a local shard read straight into ``out``: each run of rows
        that lie one after another in the file is read by ``preadv`` calls whose buffers are
        the rows of ``out`` and their checksums' 4 bytes (no intermediate bytes object, no
        copy: about half the CPU time of reading then decoding). Checksums verified after.
        Few Python objects at once (the scans' memory budgets count a read's overhead)."""
        import os

        pos = np.asarray(positions, dtype=np.int64)
        found = index[pos]  # (n, 2) offset, length
        offsets, lengths = found[:, 0].astype(np.int64), found[:, 1].astype(np.int64)
        bad = np.flatnonzero((found[:, 0] == MISSING) | (lengths < 4)
                             | (offsets + lengths > limit) | (lengths != self.row_bytes + 4))
        if bad.size:  # (the per-row checks' messages)
            k = int(bad[0])
            _, length, chunk_where = self._located(index, shard, int(pos[k]), limit, where)
            raise StoreCorruptError(f"{chunk_where}: the chunk holds {length - 4} bytes, a row "
                                    f"has {self.row_bytes}.")
        flat = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        sums = bytearray(4 * pos.size)
        step = self.row_bytes
        if hasattr(os, "posix_fadvise") and pos.size:  # the kernel reads the span ahead
            first = int(offsets.min())
            os.posix_fadvise(fd, first, int((offsets + lengths).max()) - first,
                             os.POSIX_FADV_WILLNEED)
        breaks = np.flatnonzero(offsets[1:] != offsets[:-1] + lengths[:-1]) + 1
        for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), pos.size]):
            for start in range(a, b, 16):  # runs of consecutive chunks, 16 rows a call
                end = min(b, start + 16)  # (32 buffers: ~6 KB of memoryviews at once)
                buffers: list[Any] = []
                for k in range(start, end):
                    buffers += [flat[k * step : (k + 1) * step],
                                memoryview(sums)[4 * k : 4 * k + 4]]
                got = os.preadv(fd, buffers, int(offsets[start]))
                if got != (end - start) * (step + 4):
                    chunk_where = self._located(index, shard, int(pos[start]), limit, where)[2]
                    raise StoreCorruptError(f"{chunk_where}: read {got} of "
                                            f"{(end - start) * (step + 4)} bytes: the shard is "
                                            "truncated.")
        for k in range(pos.size):
            if crc32c_bytes(flat[k * step : (k + 1) * step]) != bytes(sums[4 * k : 4 * k + 4]):
                chunk_where = self._located(index, shard, int(pos[k]), limit, where)[2]
                raise StoreCorruptError(
                    f"{chunk_where}: the chunk fails its crc32c checksum: its bytes were "
                    "damaged after writing. The values are not returned."
                )


def _int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )
