"""Probes: per-datum gradients of held-out examples, recorded beside the training records.

Layout (normative text: schemas/FORMAT.md, section 11)::

    RUN.gradlog/
      probes/zarr.json                 group; attributes: probe_ids
      probes/grads/<param>/            (probe rows, *shape) array per recorded parameter
      probes/index/step-S.parquet      the probe rows of step S: step, probe_id, row, loss, norms

A step's probe part is written before the step's commit marker (``steps/step-S.parquet``),
and readers ignore probe parts of uncommitted steps, so probes follow the commit rule of the
training records. The namespace is optional: stores without probes have no ``probes/`` group,
and readers that do not know it ignore it.

Imports no torch: readers and ``gradlog info`` stay fast.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.errors import GradlogError, StoreCorruptError, StoreFormatError
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.arrays import damaged_chunk
from gradlog.store.dtypes import StorageDtype, as_stored, from_storage, storage_dtype
from gradlog.store.fs import StorePath

__all__ = [
    "PROBES_GROUP",
    "ProbeArray",
    "ProbeWriter",
    "parse_probe_part_name",
    "probe_array_path",
    "probe_index_schema",
    "probe_part_name",
    "read_probe_ids",
    "read_probe_index",
]

PROBES_GROUP = "probes"
PROBE_INDEX_DIR = f"{PROBES_GROUP}/index"
_PROBE_PART = re.compile(r"^step-(\d{12,})\.parquet$")
_CHUNK_TARGET_BYTES = 16 << 20  # the training arrays' rule (FORMAT.md section 4)
_LEAST_KEPT = {"float64": 5e-324, "float32": 1.5e-45, "float16": 6e-8,  # least nonzero value
               "bfloat16": 1.2e-38}  # a cast keeps (normal, for bfloat16 and BitRound)


def probe_array_path(param: str) -> str:
    """Path of a parameter's probe gradient array: ``probes/`` + ``array_path(param)``."""
    return f"{PROBES_GROUP}/{fmt.array_path(param)}"


def probe_part_name(step: int) -> str:
    """File (in ``probes/index/``) of the probe rows of one step."""
    return f"step-{step:012d}.parquet"


def parse_probe_part_name(name: str) -> int | None:
    """The step of a probe part's file name, or None for any other name (temporaries)."""
    m = _PROBE_PART.match(name)
    return int(m.group(1)) if m is not None else None


def probe_index_schema(params: Sequence[str]) -> Any:
    """Arrow schema of the probe index: one row per (step, probe) record."""
    import pyarrow as pa

    columns = [("step", pa.int64()), ("probe_id", pa.int64()), ("row", pa.int64())]
    columns += [("loss", pa.float64()), *((fmt.norm_column(p), pa.float64()) for p in params)]
    return pa.schema([pa.field(name, kind, nullable=False) for name, kind in columns])


def read_probe_ids(path: StorePath) -> list[int] | None:
    """The probe ids of the store at ``path`` (in probe batch order), or None without probes."""
    meta_file = path / PROBES_GROUP / "zarr.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{meta_file} is not valid JSON: {e}") from None
    ids = meta.get("attributes", {}).get("probe_ids") if isinstance(meta, dict) else None
    if not (
        isinstance(ids, list)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        and len(set(ids)) == len(ids)
    ):
        raise StoreFormatError(
            f"{meta_file}: attribute 'probe_ids' must be a list of distinct integers >= 0, got "
            f"{ids!r}."
        )
    return ids


def read_probe_index(path: StorePath, params: Sequence[str], committed: Any) -> Any:
    """Probe index rows of the committed steps (pyarrow table, in row order)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = probe_index_schema(params)
    directory = path / PROBE_INDEX_DIR
    tables = []
    if directory.is_dir():
        for entry in sorted(sfs.listdir(directory)):
            if not _PROBE_PART.match(entry):
                continue  # temporaries (dot files) and foreign files
            try:
                tables.append(sfs.read_parquet(directory / entry, schema=schema))
            except (OSError, pa.ArrowInvalid) as e:
                raise StoreFormatError(f"{directory / entry} is not a valid part: {e}") from None
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    table = table.filter(pc.is_in(table.column("step"), value_set=pa.array(committed)))
    return table.sort_by("row")


class ProbeArray:
    """One parameter's probe gradient array, opened for reading (through zarr-python).

    Raises:
        StoreFormatError: the array's metadata disagrees with the parameter's spec.
    """

    def __init__(self, root: StorePath, name: str, spec: Mapping[str, Any],
                 norms: np.ndarray | None = None) -> None:
        import zarr

        # the probe parts' exact norm of each row (NaN: unknown), the witness that tells an
        # all-zero chunk left unwritten (stores before 2026-11-27) from a lost one
        self.norms = norms

        self.where = f"{root}: probe array {probe_array_path(name)} of {name!r}"
        self.dtype: StorageDtype = storage_dtype(spec["dtype"])
        self.shape = tuple(int(d) for d in spec["shape"])
        directory = root / probe_array_path(name)
        if not (directory / "zarr.json").is_file():
            raise StoreCorruptError(f"{self.where} is missing, though probe records exist.")
        try:
            self.array = zarr.open_array(str(directory), mode="r")
        except Exception as e:  # zarr raises many kinds for metadata it cannot parse
            raise StoreFormatError(
                f"{self.where}: its zarr.json does not open as a Zarr array ({e}); the store was "
                "damaged: run `gradlog verify`."
            ) from None
        if tuple(self.array.shape[1:]) != self.shape or self.array.dtype != self.dtype.array_dtype:
            raise StoreFormatError(
                f"{self.where} has shape {self.array.shape} and dtype {self.array.dtype}; the "
                f"spec says (n, *{list(self.shape)}) of {self.dtype.name}."
            )

        self.directory = directory
        self.plain = _plain_chunks(self.array, self.shape, directory)

    @property
    def chunk_rows(self) -> int:
        return int(self.array.chunks[0])

    def chunk_keys(self, chunk: int) -> list[str]:
        """Keys (in the array's directory) of the chunks holding record chunk ``chunk``."""
        rest = tuple(int(n) for n in self.array.cdata_shape[1:])
        return [self.array.metadata.encode_chunk_key((chunk, *i)) for i in np.ndindex(*rest)]

    def _damaged(self, rows: np.ndarray) -> str:
        """Which chunk of ``rows`` fails to decode (each is read alone), for error messages."""
        bad = damaged_chunk(self.array, np.unique(rows // self.chunk_rows), self.chunk_rows)
        return "a chunk" if bad is None else "chunk " + ", ".join(self.chunk_keys(bad))

    def read(self, rows: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """Rows ``rows`` (sorted) as ``(n, *shape)`` of ``dtype``.

        Raises:
            StoreCorruptError: a chunk fails its checksum, or is missing or reads as zeros
                where the probe parts record a nonzero norm.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return np.zeros((0, *self.shape), dtype=dtype)
        if int(rows[-1]) >= self.array.shape[0]:
            raise StoreCorruptError(
                f"{self.where} has {self.array.shape[0]} rows; probe records reach row "
                f"{int(rows[-1])}."
            )
        try:
            if self.plain:
                stored = self._read_plain(rows)
            elif int(rows[-1]) - int(rows[0]) + 1 == rows.size:
                stored = np.asarray(self.array[int(rows[0]) : int(rows[-1]) + 1])
            else:
                stored = np.asarray(self.array.oindex[rows])
        except ValueError as e:
            raise StoreCorruptError(
                f"{self.where}: {self._damaged(rows)} fails its checksum: {e}"
            ) from None
        zero = ~stored.reshape(rows.size, -1).any(1) if self.norms is not None else None
        if zero is not None and zero.any() and self._nonzero(rows[zero], False):  # (zarr
            keys = [k for c in np.unique(rows[zero] // self.chunk_rows).tolist()  # reads a
                    for k in self.chunk_keys(int(c))]  # missing chunk as zeros, its fill)
            raise StoreCorruptError(
                f"{self.where}: chunk {', '.join(keys[:4])} reads as zeros (missing or "
                "zeroed), though the probe parts record nonzero norms for its rows.")
        return np.asarray(from_storage(stored, self.dtype, dtype))

    def _nonzero(self, rows: np.ndarray, unknown: bool) -> bool:
        """Whether any of ``rows`` has a gradient the storage dtype cannot round to all zeros,
        by the probe parts' norms (``unknown`` where they say nothing): a norm above
        ``sqrt(numel)`` times the dtype's least nonzero value has an entry at least that."""
        norms = self.norms
        if norms is None or int(rows.max()) >= norms.size or np.isnan(norms[rows]).any():
            return unknown
        least = _LEAST_KEPT.get(self.dtype.name, _LEAST_KEPT["bfloat16"])  # (bitroundN)
        return bool((norms[rows] > least * np.sqrt(max(1, int(np.prod(self.shape))))).any())


    def _read_plain(self, rows: np.ndarray) -> np.ndarray:
        """Rows of an uncompressed local array (``bytes`` little endian, then ``crc32c``):
        each chunk file read with one ``preadv`` straight into the result when all its rows
        are wanted (else into a buffer), its checksum verified. zarr-python's path decodes
        through its event loop at about half this speed."""
        from gradlog.store.chunks import crc32c_bytes

        c, row_bytes = self.chunk_rows, self.array.dtype.itemsize * int(np.prod(self.shape))
        out = np.empty((rows.size, *self.shape), dtype=self.array.dtype)
        chunks = rows // c
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(chunks)) + 1, [rows.size]])
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            chunk = int(chunks[a])
            key = self.chunk_keys(chunk)[0]
            whole = b - a == c and int(rows[a]) == chunk * c  # (rows are sorted, distinct)
            body = (memoryview(out[a:b].reshape(-1).view(np.uint8))  # type: ignore[arg-type]
                    if whole else memoryview(bytearray(c * row_bytes)))
            checksum = bytearray(4)
            try:
                fd = os.open(str(self.directory / key), os.O_RDONLY)
            except FileNotFoundError:
                if self._nonzero(rows[a:b], True):
                    raise StoreCorruptError(f"{self.where}: chunk {key} is missing, though "
                                            "probe records with a nonzero gradient live in "
                                            "it.") from None
                out[a:b] = 0  # all-zero, left unwritten by zarr (stores before 2026-11-27)
                continue
            try:
                if hasattr(os, "posix_fadvise"):  # the kernel reads the whole chunk ahead
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                got = os.preadv(fd, [body, checksum], 0)
                extra = os.pread(fd, 1, got)
            finally:
                os.close(fd)
            if got != c * row_bytes + 4 or extra:
                raise StoreCorruptError(f"{self.where}: chunk {key} holds the wrong number of "
                                        f"bytes (a chunk has {c * row_bytes + 4}).")
            if crc32c_bytes(body) != bytes(checksum):
                raise ValueError(f"chunk {key}: crc32c checksum mismatch")
            if not whole:
                block = np.frombuffer(body, dtype=self.array.dtype).reshape(c, *self.shape)
                out[a:b] = block[rows[a:b] - chunk * c]
        return out


def _plain_chunks(array: Any, shape: tuple[int, ...], directory: Any) -> bool:
    """Whether ``array`` is read by :meth:`ProbeArray._read_plain`: a local directory, rows
    chunked alone (whole rows per chunk), codecs ``bytes`` (little endian) then ``crc32c``."""
    if not isinstance(directory, Path) or not hasattr(os, "preadv"):
        return False
    try:
        codecs = [type(c).__name__ for c in array.metadata.codecs]
        endian = getattr(array.metadata.codecs[0], "endian", None)
        chunks = tuple(int(d) for d in array.chunks)
    except (AttributeError, IndexError, TypeError):
        return False
    return (codecs == ["BytesCodec", "Crc32cCodec"] and str(getattr(endian, "value", endian))
            == "little" and chunks[1:] == shape and array.dtype.itemsize > 0)


def _every_chunk_written() -> Any:
    """zarr's configuration under which an array opened or created writes every chunk, an
    all-zero one too (by default it leaves those unwritten, as the fill value): a missing
    chunk is then damage (FORMAT.md section 11)."""
    import zarr

    return zarr.config.set({"array.write_empty_chunks": True})


def probe_chunk_rows(n_probes: int, row_bytes: int) -> int:
    """Rows per probe chunk: the most that fit in 16 MiB and divide the number of probes, so
    a step's probes are whole chunks (read once, straight into place); when no divisor
    fills a quarter of that (a prime number of large rows), as many rows as fit."""
    fit = max(1, min(n_probes, _CHUNK_TARGET_BYTES // row_bytes))
    divisor = max(d for d in range(1, fit + 1) if n_probes % d == 0)
    return divisor if divisor == n_probes or 4 * divisor * row_bytes >= _CHUNK_TARGET_BYTES \
        else fit


class ProbeWriter:
    """Appends the probe records of each recorded step to a store's ``probes/`` namespace.

    When the store already has probes (a resumed run), it continues them: the probe ids must
    be the same, rows continue after the committed ones, and probe parts of uncommitted steps
    are removed.

    Args:
        path: The store (already created or resumed by :class:`~gradlog.store.StoreWriter`).
        specs: The recorded parameters (name -> (shape, storage dtype name)), in order.
        probe_ids: One distinct id >= 0 per probe, in the order of the probe batch.
        durable: ``fsync`` the probe chunks and part of a step before returning.
        compression: The run's (``none``, ``lz4``, ``zstd``): probe arrays are compressed as
            its gradient arrays are.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | StorePath,
        specs: Mapping[str, tuple[tuple[int, ...], str]],
        probe_ids: Sequence[int],
        *,
        durable: bool = False,
        compression: str = "none",
    ) -> None:
        import zarr

        store = sfs.store_path(path)
        if not isinstance(store, Path):
            raise GradlogError(
                f"probes are not supported yet for stores on object storage ({path}); record "
                "into a local directory and copy it, or record without probes."
            )
        self.path = store
        self.specs = dict(specs)
        self.dtypes = {name: storage_dtype(dtype) for name, (_, dtype) in self.specs.items()}
        self.probe_ids = np.asarray(probe_ids, dtype=np.int64)
        self.durable = durable
        self.compression = compression
        self._arrays: dict[str, Any] = {}
        self._capacity = 0
        self.n_rows = 0
        self._schema = probe_index_schema(list(self.specs))
        existing = read_probe_ids(self.path)
        if existing is not None:
            self._resume(existing)
            return
        root = zarr.open_group(str(self.path), mode="r+")
        self._group = root.create_group(
            PROBES_GROUP, attributes={"probe_ids": [int(i) for i in self.probe_ids]}
        )
        self._group.create_group(fmt.GRADS_GROUP)
        (self.path / PROBE_INDEX_DIR).mkdir(parents=True, exist_ok=True)

    def _resume(self, existing: list[int]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        import zarr

        if existing != self.probe_ids.tolist():
            raise StoreFormatError(
                f"{self.path} was recorded with probe ids {existing[:10]}, this recorder has "
                f"{self.probe_ids.tolist()[:10]}: resume with the same probes and probe_ids."
            )
        self._group = zarr.open_group(str(self.path / PROBES_GROUP), mode="r+")
        steps = pa.concat_tables(
            [
                pq.read_table(self.path / fmt.STEPS_DIR / e, columns=["step"])
                for e in sorted(os.listdir(self.path / fmt.STEPS_DIR))
                if fmt.parse_part_name(e) is not None
            ]
            or [pa.table({"step": pa.array([], pa.int64())})]
        ).column("step")
        index = read_probe_index(self.path, list(self.specs), steps)
        self.n_rows = int(np.max(index.column("row").to_numpy())) + 1 if index.num_rows else 0
        committed = set(steps.to_pylist())
        directory = self.path / PROBE_INDEX_DIR
        directory.mkdir(parents=True, exist_ok=True)
        for entry in os.listdir(directory):
            m = _PROBE_PART.match(entry)
            if entry.startswith(".") or (m is not None and int(m.group(1)) not in committed):
                (directory / entry).unlink()  # uncommitted: it will be written again
        for name in self.specs:
            where = self.path / probe_array_path(name)
            if (where / "zarr.json").is_file():
                with _every_chunk_written():
                    self._arrays[name] = zarr.open_array(str(where), mode="r+")
        if self._arrays:
            self._capacity = min(int(a.shape[0]) for a in self._arrays.values())

    def _create_arrays(self) -> None:
        from zarr.codecs import BloscCodec, Crc32cCodec

        n = len(self.probe_ids)
        for name, (shape, _) in self.specs.items():
            dtype = self.dtypes[name].array_dtype
            itemsize = dtype.itemsize
            row_bytes = max(1, int(np.prod(shape, dtype=np.int64)) * itemsize)
            rows = probe_chunk_rows(n, row_bytes)
            blosc = [] if self.compression == "none" else [BloscCodec(
                cname=self.compression, clevel=1,  # type: ignore[arg-type]
                shuffle="bitshuffle", typesize=itemsize)]
            with _every_chunk_written():
                self._arrays[name] = self._group.create_array(
                    fmt.array_path(name),
                    shape=(0, *shape),
                    chunks=(rows, *shape),
                    dtype=dtype,
                    fill_value=0,
                    compressors=[*blosc, Crc32cCodec()],
                    dimension_names=["record", *(f"dim_{i}" for i in range(len(shape)))],
                )

    def append(
        self,
        *,
        step: int,
        losses: np.ndarray,
        grads: Mapping[str, np.ndarray],
        norms: Mapping[str, np.ndarray],
    ) -> None:
        """Write one step's probe gradients, then its probe index part (before the commit).

        ``grads`` hold host numpy arrays, rounded to each storage dtype here unless they
        already are (:func:`gradlog.store.dtypes.as_stored`).
        """
        import pyarrow as pa

        n = len(self.probe_ids)
        if not self._arrays:
            self._create_arrays()
        start, stop = self.n_rows, self.n_rows + n
        if stop > self._capacity:  # grow geometrically: a resize rewrites metadata
            self._capacity = max(stop, 2 * self._capacity)
            for name, arr in self._arrays.items():
                arr.resize((self._capacity, *self.specs[name][0]))
        for name, arr in self._arrays.items():
            arr[start:stop] = as_stored(np.asarray(grads[name]), self.dtypes[name])
        if self.durable:
            self._fsync_rows(start, stop)
        columns: dict[str, Any] = {
            "step": np.full(n, step, dtype=np.int64),
            "probe_id": self.probe_ids,
            "row": np.arange(start, stop, dtype=np.int64),
            "loss": losses.astype(np.float64),
        }
        for name in self.specs:
            columns[fmt.norm_column(name)] = norms[name].astype(np.float64)
        table = pa.table(columns, schema=self._schema)
        sfs.write_parquet_atomic(
            table, self.path / PROBE_INDEX_DIR / probe_part_name(step), durable=self.durable
        )
        self.n_rows = stop

    def _fsync_rows(self, start: int, stop: int) -> None:
        for name, arr in self._arrays.items():
            rows = int(arr.chunks[0])
            tail = "/".join(["0"] * len(self.specs[name][0]))
            for chunk in range(start // rows, (stop - 1) // rows + 1):
                key = f"c/{chunk}" + (f"/{tail}" if tail else "")
                chunk_file = self.path / probe_array_path(name) / key
                if chunk_file.is_file():
                    sfs.fsync_path(chunk_file)

    def close(self) -> None:
        """Trim the arrays to the rows written."""
        for name, arr in self._arrays.items():
            arr.resize((self.n_rows, *self.specs[name][0]))
        self._capacity = self.n_rows
