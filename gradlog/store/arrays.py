"""Reading one parameter's gradient array: rows in, float32 (or any dtype) out, verified.

Format version 2 arrays are read shard by shard with :mod:`gradlog.store.chunks` (``pread``
of the shard index and of each wanted row, checksums verified); version 1 arrays through
zarr-python, after checking that every chunk holding a wanted row exists (zarr would return
zeros for a missing chunk) and turning zarr's checksum ``ValueError`` into
:class:`~gradlog.errors.StoreCorruptError` naming the chunk. Either way a damaged store
raises, it never returns wrong numbers.

Imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from gradlog.errors import StoreCorruptError, StoreFormatError
from gradlog.store import format as fmt
from gradlog.store.chunks import ShardLayout
from gradlog.store.dtypes import INDEX_DTYPE, StorageDtype, from_storage, storage_dtype
from gradlog.store.fs import StorePath

__all__ = ["GradArray", "damaged_chunk"]


def damaged_chunk(arr: Any, chunks: Iterable[int], chunk_rows: int) -> int | None:
    """The first of ``chunks`` (record chunks of the zarr-python array ``arr``) that fails to
    decode when read alone (zarr raises ValueError on a checksum mismatch), or None: for
    naming the damaged chunk in an error message."""
    for chunk in chunks:
        lo = int(chunk) * chunk_rows
        try:
            arr[lo : min(lo + chunk_rows, arr.shape[0])]
        except ValueError:
            return int(chunk)
    return None


class GradArray:
    """One parameter's gradient array, opened for reading.

    Args:
        root: The store's directory.
        name: The parameter's name.
        spec: Its parameter spec (root attributes, already checked by the reader).
        version: The store's format version.
        array: Which of the parameter's form arrays (format version 3; ``"grad"`` is the
            ``full`` form's one array, and the only array of older versions).

    Raises:
        StoreCorruptError: the array's ``zarr.json`` is missing.
        StoreFormatError: it is malformed or disagrees with the spec.
    """

    def __init__(
        self, root: StorePath, name: str, spec: dict[str, Any], version: int, array: str = "grad"
    ) -> None:
        self.root = root
        self.name = name
        self.version = version
        entry = spec.get("arrays", {}).get(array) if version >= 3 else None
        if entry is not None:
            self.shape = tuple(int(d) for d in entry["shape"])
            self.dtype: StorageDtype = (
                INDEX_DTYPE if entry["kind"] == "int64" else storage_dtype(spec["dtype"])
            )
            self.rel = str(entry["path"])
        elif array == "grad" and version < 3:
            self.shape = tuple(int(d) for d in spec["shape"])
            self.dtype = storage_dtype(spec["dtype"])
            self.rel = fmt.array_path(name)
        else:
            raise StoreFormatError(
                f"{root}: parameter {name!r} (form {spec.get('form', 'full')!r}) has no array "
                f"{array!r}; its arrays: {sorted(spec.get('arrays', {'grad': 0}))}."
            )
        self.directory = root / self.rel
        self.where = f"array {self.rel} of parameter {name!r}"
        meta_file = self.directory / "zarr.json"
        if not meta_file.is_file():
            raise StoreCorruptError(
                f"{root}: {self.where} is missing (no {meta_file.name}), though the run has "
                "committed records. The store is damaged: run `gradlog verify` on it."
            )
        try:
            self.meta = json.loads(meta_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreFormatError(f"{meta_file} is not valid JSON: {e}") from None
        if not isinstance(self.meta, dict):
            raise StoreFormatError(f"{meta_file} is not a JSON object.")
        where = f"{root}: {self.where}"
        self.layout: ShardLayout | None = None
        if version >= 2:
            self.layout = ShardLayout.from_metadata(self.meta, where)
            if self.layout.row_shape != self.shape:
                raise StoreFormatError(
                    f"{where} holds rows of shape {list(self.layout.row_shape)}, the spec says "
                    f"{list(self.shape)}; the store is damaged."
                )
            if self.layout.array_dtype != self.dtype.array_dtype:
                raise StoreFormatError(
                    f"{where} has data_type {self.layout.array_dtype}, storage dtype "
                    f"{self.dtype.name} needs {self.dtype.array_dtype}."
                )
        else:
            shape = self.meta.get("shape")
            if not isinstance(shape, list) or [*shape[1:]] != list(self.shape):
                raise StoreFormatError(
                    f"{where} has shape {shape!r}, the spec says (n, *{list(self.shape)})."
                )
            if self.meta.get("data_type") != self.dtype.array_dtype.name:
                raise StoreFormatError(
                    f"{where} has data_type {self.meta.get('data_type')!r}, the spec says "
                    f"{self.dtype.name}."
                )

    @property
    def n_rows(self) -> int:
        """Records the array's metadata declares (as last read)."""
        return int(self.meta["shape"][0])

    def read(self, rows: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """Gradients of ``rows`` (int64, any order) as ``(len(rows), *shape)`` of ``dtype``.

        Raises:
            StoreCorruptError: a chunk holding one of the rows is missing or damaged.
        """
        rows = np.asarray(rows, dtype=np.int64)
        stored = self._read_stored(rows)
        return np.asarray(from_storage(stored, self.dtype, dtype))

    def _read_stored(self, rows: np.ndarray) -> np.ndarray:
        out = np.zeros((rows.size, *self.shape), dtype=self.dtype.array_dtype)
        if rows.size == 0 or out.size == 0:
            return out
        if self.layout is None:
            return self._read_v1(rows)
        layout = self.layout
        shards = rows // layout.rows_per_shard
        order = np.argsort(rows, kind="stable")
        # rows grouped by shard, ascending; positions into ``out`` kept for scatter
        bounds = np.flatnonzero(np.diff(shards[order])) + 1
        for group in np.split(order, bounds):
            shard = int(shards[group[0]])
            positions = (rows[group] - shard * layout.rows_per_shard).tolist()
            key = layout.shard_key(shard)
            block = np.empty((len(group), *self.shape), dtype=layout.array_dtype)
            layout.read_rows(
                self.directory / key,
                shard,
                positions,
                block,
                f"{self.root}: {self.where}, chunk {key}",
            )
            out[group] = block
        return out

    def _read_v1(self, rows: np.ndarray) -> np.ndarray:
        import zarr

        arr = zarr.open_array(str(self.directory), mode="r")
        chunk_rows = int(arr.chunks[0])
        if rows.size and int(rows.max()) >= arr.shape[0]:
            raise StoreCorruptError(
                f"{self.root}: {self.where} has {arr.shape[0]} rows, committed records reach "
                f"row {int(rows.max())}; the store is damaged."
            )
        for chunk in np.unique(rows // chunk_rows):
            key = self.chunk_key(int(chunk))
            if not (self.directory / key).is_file():
                raise StoreCorruptError(
                    f"{self.root}: {self.where}, chunk {key} is missing, though committed "
                    "records live in it."
                )
        try:
            if (
                rows.size
                and int(rows[-1]) - int(rows[0]) + 1 == rows.size
                and bool(np.all(np.diff(rows) == 1))
            ):
                return np.asarray(arr[int(rows[0]) : int(rows[-1]) + 1])
            return np.asarray(arr.oindex[rows])
        except ValueError as e:
            bad = damaged_chunk(arr, np.unique(rows // chunk_rows), chunk_rows)
            key = self.chunk_key(bad) if bad is not None else "(unknown)"
            raise StoreCorruptError(
                f"{self.root}: {self.where}, chunk {key}: {e} (the crc32c checksum of its bytes "
                "does not match; the values are not returned)."
            ) from None

    def chunk_key(self, chunk: int) -> str:
        """File of chunk (v1) or shard (v2) ``chunk``, relative to the array's directory."""
        if self.layout is not None:
            return self.layout.shard_key(chunk)
        return "c/" + "/".join([str(chunk)] + ["0"] * len(self.shape))

    def rows_per_chunk(self) -> int:
        """Records per chunk (v1) or shard (v2) file."""
        if self.layout is not None:
            return self.layout.rows_per_shard
        grid = self.meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", [1])
        return int(grid[0])
