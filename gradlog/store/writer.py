"""Writing a run into a store: the one place that creates arrays and index files.

Layout (normative text: schemas/FORMAT.md)::

    RUN.gradlog/
      zarr.json                      root group; attributes: format, version, config, params
      grads/<param>/                 (records, *shape) array per parameter, appended by rows
      index/step-S-M.parquet         records of one backward call M of step S
      steps/step-S.parquet           the step's summary row; its presence commits step S

Order of writes: gradient rows, then the index part, then (at the step's end) the steps part,
each parquet file written under a temporary name and renamed into place. A reader sees only
committed steps, so a crash leaves a consistent prefix.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.errors import StoreExistsError
from gradlog.store import format as fmt

__all__ = ["ParamSpec", "StoreWriter"]

_CHUNK_TARGET_BYTES = 16 << 20  # one chunk per step per parameter, capped for huge parameters


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter's per-datum gradients are stored."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # storage dtype
    param_dtype: str  # the parameter's own dtype in the model
    form: str = "full"

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "numel": int(np.prod(self.shape, dtype=np.int64)),
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "form": self.form,
            "array": fmt.array_path(self.name),
        }


def _write_parquet_atomic(table: Any, path: Path) -> None:
    import pyarrow.parquet as pq

    tmp = path.with_name("." + path.name + ".tmp")  # dot files are ignored by readers
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _is_store(path: Path) -> bool:
    import json

    try:
        meta = json.loads((path / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("attributes", {}).get("format") == fmt.FORMAT_NAME


class StoreWriter:
    """Creates a store and appends records to it, synchronously.

    Args:
        path: Directory of the new store (conventionally ``NAME.gradlog``).
        attrs: Root attributes beyond the per-parameter specs (format, config, ...).
        specs: The recorded parameters, in recording order.
        overwrite: Replace an existing gradlog store at ``path``. A directory that is not a
            gradlog store is never deleted.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        attrs: Mapping[str, Any],
        specs: Mapping[str, ParamSpec],
        overwrite: bool = False,
    ) -> None:
        import zarr

        self.path = Path(path)
        if self.path.exists():
            empty_dir = self.path.is_dir() and not any(self.path.iterdir())
            if not empty_dir:
                if not _is_store(self.path):
                    raise StoreExistsError(
                        f"{self.path} exists and is not a gradlog store; refusing to write into "
                        "or delete it. Choose another path."
                    )
                if not overwrite:
                    raise StoreExistsError(
                        f"{self.path} already holds a gradlog run. Pass overwrite=True (CLI: "
                        "--overwrite) to replace it, or choose another path."
                    )
                shutil.rmtree(self.path)
        self.specs = dict(specs)
        root = dict(attrs)
        root["params"] = {name: spec.to_json() for name, spec in self.specs.items()}
        self._group = zarr.open_group(str(self.path), mode="w", zarr_format=3, attributes=root)
        self._group.create_group(fmt.GRADS_GROUP)
        (self.path / fmt.INDEX_DIR).mkdir()
        (self.path / fmt.STEPS_DIR).mkdir()
        self._arrays: dict[str, Any] = {}
        self._capacity = 0
        self.n_rows = 0
        self._index_schema = fmt.index_schema(list(self.specs))
        self._steps_schema = fmt.steps_schema()

    def _create_arrays(self, batch: int) -> None:
        from zarr.codecs import BloscCodec, Crc32cCodec

        for name, spec in self.specs.items():
            itemsize = np.dtype(spec.dtype).itemsize
            row_bytes = max(1, int(np.prod(spec.shape, dtype=np.int64)) * itemsize)
            rows = max(1, min(batch, _CHUNK_TARGET_BYTES // row_bytes))
            self._arrays[name] = self._group.create_array(
                fmt.array_path(name),
                shape=(0, *spec.shape),
                chunks=(rows, *spec.shape),
                dtype=spec.dtype,
                fill_value=0,
                compressors=[
                    BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle", typesize=itemsize),
                    Crc32cCodec(),
                ],
                dimension_names=["record", *(f"dim_{i}" for i in range(len(spec.shape)))],
            )

    def _ensure_capacity(self, rows: int) -> None:
        if rows <= self._capacity:
            return
        # Grow geometrically: a resize rewrites metadata, so do it rarely. Rows past the
        # committed ones read as zeros and are never listed in the index.
        self._capacity = max(rows, 2 * self._capacity)
        for name, arr in self._arrays.items():
            arr.resize((self._capacity, *self.specs[name].shape))

    def append(
        self,
        *,
        step: int,
        micro: int,
        datum_ids: np.ndarray,
        losses: np.ndarray,
        weights: np.ndarray,
        lr: float | None,
        grads: Mapping[str, np.ndarray],
        norms: Mapping[str, np.ndarray],
    ) -> tuple[int, int]:
        """Write the records of one backward call; returns their row range ``[start, stop)``."""
        import pyarrow as pa

        batch = len(datum_ids)
        if not self._arrays:
            self._create_arrays(batch)
        start, stop = self.n_rows, self.n_rows + batch
        self._ensure_capacity(stop)
        for name, arr in self._arrays.items():
            arr[start:stop] = grads[name]
        columns: dict[str, Any] = {
            "step": np.full(batch, step, dtype=np.int64),
            "micro": np.full(batch, micro, dtype=np.int32),
            "datum_id": datum_ids.astype(np.int64),
            "row": np.arange(start, stop, dtype=np.int64),
            "loss": losses.astype(np.float64),
            "weight": weights.astype(np.float64),
            "lr": pa.array([lr] * batch, type=pa.float64()),
        }
        for name in self.specs:
            columns[fmt.norm_column(name)] = norms[name].astype(np.float64)
        table = pa.table(columns, schema=self._index_schema)
        _write_parquet_atomic(table, self.path / fmt.INDEX_DIR / fmt.index_part_name(step, micro))
        self.n_rows = stop
        return start, stop

    def commit(self, step_row: Mapping[str, Any]) -> None:
        """Commit a step: write its row of the steps table, after all its records."""
        import pyarrow as pa

        table = pa.Table.from_pylist([dict(step_row)], schema=self._steps_schema)
        name = fmt.step_part_name(int(step_row["step"]))
        _write_parquet_atomic(table, self.path / fmt.STEPS_DIR / name)

    def close(self) -> None:
        """Trim the arrays to the rows written."""
        for name, arr in self._arrays.items():
            arr.resize((self.n_rows, *self.specs[name].shape))
        self._capacity = self.n_rows
