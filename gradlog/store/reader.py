"""Reading a run back: ``gradlog.open(path) -> Run``.

Opening reads JSON and parquet only; nothing in a store is ever executed. Only committed steps
(those with a row in ``steps/``) are visible, so a run being written or cut short by a crash
reads as a consistent prefix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.errors import NotAStoreError, SelectionError, StoreFormatError
from gradlog.store import format as fmt

__all__ = ["Run"]

Selector = int | Sequence[int] | range | slice | None


def _read_root_attrs(path: Path) -> dict[str, Any]:
    meta_file = path / "zarr.json"
    if not path.exists():
        raise NotAStoreError(f"{path} does not exist. Record a run first (gradlog train).")
    if not meta_file.is_file():
        raise NotAStoreError(
            f"{path} is not a gradlog store: it has no zarr.json. A store is the directory "
            "that GradRecorder(model, path) or `gradlog train --out PATH` created."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{meta_file} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("node_type") != "group":
        raise StoreFormatError(f"{path} is not a Zarr group (zarr.json has no node_type 'group').")
    attrs = meta.get("attributes", {})
    if not isinstance(attrs, dict):
        raise StoreFormatError(f"{meta_file}: 'attributes' must be a JSON object.")
    fmt.check_root_attrs(attrs, str(path))
    return attrs


def _read_parts(directory: Path, schema: Any) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    if directory.is_dir():
        for entry in sorted(os.listdir(directory)):
            if fmt.parse_part_name(entry) is None:
                continue  # temporaries (dot files) and foreign files
            try:
                tables.append(pq.read_table(directory / entry, schema=schema))
            except (OSError, pa.ArrowInvalid) as e:
                raise StoreFormatError(f"{directory / entry} is not a valid part: {e}") from None
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def _as_list(sel: Selector, name: str) -> np.ndarray | None:
    if sel is None:
        return None
    if isinstance(sel, slice):
        raise TypeError("internal: slices are resolved before _as_list")
    if isinstance(sel, (int, np.integer)) and not isinstance(sel, bool):
        return np.array([int(sel)], dtype=np.int64)
    try:
        values = np.asarray(list(sel if isinstance(sel, Iterable) else [sel]))
    except TypeError:
        values = np.asarray([])
    if values.size and not np.issubdtype(values.dtype, np.integer):
        raise SelectionError(
            f"{name}={sel!r}: expected an int, a list of ints, a range or a slice."
        )
    return values.astype(np.int64)


class Run:
    """A recorded run, opened for reading.

    Attributes:
        path: The store's directory.
        attrs: The root attributes (format, versions, config, parameter specs).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open the store at ``path``; see :func:`gradlog.open` for the errors raised."""
        self.path = Path(path)
        self.attrs = _read_root_attrs(self.path)
        self._specs: dict[str, dict[str, Any]] = self.attrs["params"]

    def __repr__(self) -> str:
        return (
            f"Run({str(self.path)!r}, steps={self.steps.num_rows}, "
            f"records={self.datums.num_rows}, params={len(self._specs)})"
        )

    # -- metadata ---------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        return int(self.attrs["format_version"])

    @property
    def config(self) -> dict[str, Any]:
        """The recorder configuration the run was recorded with."""
        return dict(self.attrs.get("config", {}))

    @property
    def param_names(self) -> list[str]:
        """Recorded parameter names, in recording order."""
        return list(self._specs)

    @cached_property
    def params(self) -> Any:
        """pyarrow table: name, shape, numel, dtype, form of every recorded parameter."""
        import pyarrow as pa

        names = self.param_names
        return pa.table(
            {
                "name": names,
                "shape": pa.array([self._specs[n]["shape"] for n in names], pa.list_(pa.int64())),
                "numel": pa.array([self._specs[n].get("numel", 0) for n in names], pa.int64()),
                "dtype": [self._specs[n].get("dtype", "") for n in names],
                "form": [self._specs[n].get("form", "full") for n in names],
            }
        )

    @cached_property
    def steps(self) -> Any:
        """pyarrow table of committed steps (step, first_row, n_records, lr, loss_mean, ...)."""
        table = _read_parts(self.path / fmt.STEPS_DIR, fmt.steps_schema())
        return table.sort_by("step")

    @cached_property
    def datums(self) -> Any:
        """pyarrow table of every committed record (step, datum_id, row, loss, weight, lr,
        and ``norm/<param>`` per parameter), in row order."""
        import pyarrow as pa
        import pyarrow.compute as pc

        table = _read_parts(self.path / fmt.INDEX_DIR, fmt.index_schema(self.param_names))
        committed = self.steps.column("step")
        table = table.filter(pc.is_in(table.column("step"), value_set=pa.array(committed)))
        return table.sort_by("row")

    def refresh(self) -> Run:
        """Forget cached tables, so that steps committed since opening become visible."""
        for name in ("steps", "datums"):
            self.__dict__.pop(name, None)
        return self

    @property
    def nbytes(self) -> int:
        """Bytes the store occupies on disk."""
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    # -- selection --------------------------------------------------------------------------
    def _check_param(self, param: str) -> dict[str, Any]:
        if param not in self._specs:
            import difflib

            near = difflib.get_close_matches(param, self.param_names, n=5, cutoff=0.3)
            hint = f" Did you mean: {', '.join(near)}?" if near else ""
            raise SelectionError(
                f"parameter {param!r} is not recorded in {self.path}.{hint} "
                f"Recorded: {', '.join(self.param_names[:20])}"
                + (" ..." if len(self.param_names) > 20 else "")
            )
        return self._specs[param]

    def records(self, step: Selector = None, datum: Selector = None) -> Any:
        """pyarrow table of the records at ``step`` (int, list, range or slice) and
        ``datum`` (datum_id or list of them), in row order."""
        import pyarrow as pa
        import pyarrow.compute as pc

        table = self.datums
        if isinstance(step, slice):
            if step.step not in (None, 1):
                raise SelectionError("step slices take no stride; pass a range or a list.")
            mask = pc.greater_equal(table.column("step"), step.start or np.iinfo(np.int64).min)
            if step.stop is not None:
                mask = pc.and_(mask, pc.less(table.column("step"), step.stop))
            table = table.filter(mask)
        else:
            steps = _as_list(step, "step")
            if steps is not None:
                known = np.asarray(self.steps.column("step"))
                missing = np.setdiff1d(steps, known)
                if missing.size:
                    raise SelectionError(
                        f"step {int(missing[0])} is not a committed step of {self.path}. "
                        f"{_nearby(known, int(missing[0]), 'steps')}"
                    )
                table = table.filter(pc.is_in(table.column("step"), value_set=pa.array(steps)))
        datums = _as_list(datum, "datum")
        if datums is not None:
            present = np.asarray(table.column("datum_id"))
            missing = np.setdiff1d(datums, present)
            if missing.size:
                raise SelectionError(
                    f"datum {int(missing[0])} has no record"
                    f"{' at the selected steps' if step is not None else ''} in {self.path}. "
                    f"{_nearby(np.unique(present), int(missing[0]), 'datum ids')}"
                )
            table = table.filter(pc.is_in(table.column("datum_id"), value_set=pa.array(datums)))
        return table

    # -- data -------------------------------------------------------------------------------
    def grads(
        self,
        param: str,
        step: Selector = None,
        datum: Selector = None,
        *,
        as_torch: bool = False,
        dtype: Any = np.float32,
    ) -> Any:
        """Per-datum gradients of ``param`` for the selected records.

        Returns an array ``(n_records, *shape)`` whose rows follow :meth:`records` with the
        same selection (in row order: by step, then by position in the batch).
        """
        import zarr

        spec = self._check_param(param)
        rows = np.asarray(self.records(step, datum).column("row"), dtype=np.int64)
        if rows.size == 0:  # arrays are created at the first append: they may not exist yet
            out = np.zeros((0, *spec["shape"]), dtype=dtype)
        else:
            arr = zarr.open_array(str(self.path / fmt.array_path(param)), mode="r")
            if rows[-1] - rows[0] + 1 == rows.size:  # contiguous: one slice read
                out = np.asarray(arr[int(rows[0]) : int(rows[-1]) + 1], dtype=dtype)
            else:
                out = np.asarray(arr.oindex[rows], dtype=dtype)
        if as_torch:
            import torch

            return torch.from_numpy(out)
        return out

    def norms(self, param: str | None = None, step: Selector = None, datum: Selector = None) -> Any:
        """Long pyarrow table (step, datum_id, row, param, norm) of exact per-record norms."""
        import pyarrow as pa

        names = self.param_names if param is None else [param]
        for name in names:
            self._check_param(name)
        table = self.records(step, datum)
        n = table.num_rows
        parts = [
            pa.table(
                {
                    "step": table.column("step"),
                    "datum_id": table.column("datum_id"),
                    "row": table.column("row"),
                    "param": pa.array([name] * n, pa.string()),
                    "norm": table.column(fmt.norm_column(name)),
                }
            )
            for name in names
        ]
        return pa.concat_tables(parts).sort_by([("row", "ascending")]) if parts else None


def _nearby(known: np.ndarray, value: int, what: str) -> str:
    if known.size == 0:
        return f"The run has no committed {what} yet."
    order = np.argsort(np.abs(known.astype(np.int64) - value), kind="stable")[:5]
    near = ", ".join(str(int(v)) for v in np.sort(known[order]))
    return f"Nearest {what}: {near} ({known.size} in all, {int(known.min())}..{int(known.max())})."
