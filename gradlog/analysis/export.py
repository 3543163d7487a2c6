"""Export records with their gradients to one parquet or npz file, streamed in bounded memory.

- **parquet**: one row per record: ``step, micro, datum_id, row, loss, weight, lr`` and one
  column ``grads/<param>`` per parameter holding the gradient with its shape: nested
  fixed-size lists, one level per axis (a ``(4, 6)`` weight is
  ``fixed_size_list<fixed_size_list<float32, 6>, 4>``; a scalar parameter a plain float
  column), so the type alone gives the shape; :func:`parquet_grads` reads a column back as
  an array ``(n_records, *shape)``. The schema metadata ``gradlog.shapes`` also maps each
  parameter to its shape (JSON). Written one row group per block of steps.
- **npz**: arrays ``step, micro, datum_id, row, loss, weight, lr`` (``lr`` NaN where null) and
  ``grads/<param>`` of shape ``(n_records, *shape)``, as ``numpy.load`` reads them. Each array
  is streamed into the archive, never held whole.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.analysis.scan import ScanArgs, ScanOptions, blocks, least_budget
from gradlog.analysis.selection import params_of
from gradlog.analysis.space import reader
from gradlog.errors import InputError, SelectionError
from gradlog.store.reader import Selector, StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FORMATS", "GRADS", "export", "parquet_grads"]

FORMATS = ("parquet", "npz")
GRADS = "grads/"
"""Prefix of a parameter's gradients in every export (``grads/<param>``), as in the store
(``grads/<param>`` arrays) and the API (``run.grads``)."""
_INDEX = ("step", "micro", "datum_id", "row", "loss", "weight", "lr")


def export(
    run: StoreReader,
    out: str | os.PathLike[str],
    *,
    format: str | None = None,
    params: str | Sequence[str] | None = None,
    step: Selector = None,
    datum: Selector = None,
    **scan: Unpack[ScanArgs],
) -> dict[str, Any]:
    """Write the selected records and their gradients to ``out`` (module doc for layouts).

    Args:
        run: The run.
        out: The file to write (replaced if it exists).
        format: ``"parquet"`` or ``"npz"``; default: from the file's extension.
        params: Parameters to export (default: every parameter that keeps gradients: those
            recorded with form ``norm`` keep only norms, in ``run.norms()``, and are skipped;
            naming one is a ``SelectionError``). The summary lists those exported.
        step: Step selection, as ``Run.records``.
        datum: Datum selection, as ``Run.records``.
        **scan: ``max_memory``, ``progress`` (:class:`~gradlog.analysis.scan.ScanArgs`);
            an export runs in this process (no ``scheduler``).

    Returns:
        A summary: ``path``, ``format``, ``records``, ``params``, ``bytes`` (of the file).
    """
    opts = ScanOptions(**scan).local_only("export")
    path = Path(out)
    if format is None:
        format = path.suffix.lstrip(".").lower()
    if format not in FORMATS:
        raise InputError(
            f"export format {format!r} is not one of {list(FORMATS)}; pass format= or use a "
            "file name ending in .parquet or .npz."
        )
    names = params_of(run, params, gradients=True)
    records = run.records(step, datum)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = _parquet if format == "parquet" else _npz
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        writer(run, tmp, names, records, opts)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return {
        "path": str(path),
        "format": format,
        "records": records.num_rows,
        "params": names,
        "bytes": path.stat().st_size,
    }


def _parquet(
    run: StoreReader, path: Path, names: list[str], records: Any, opts: ScanOptions
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    readers = {n: reader(run, n) for n in names}
    fields = [records.schema.field(c) for c in _INDEX]
    fields += [
        pa.field(f"{GRADS}{n}", _nested_type(pa.from_numpy_dtype(r.dtype), r.shape))
        for n, r in readers.items()
    ]
    shapes = {n: list(r.shape) for n, r in readers.items()}
    schema = pa.schema(fields, metadata={"gradlog.shapes": json.dumps(shapes)})
    rows = records.column("row").to_numpy()
    keys = records.column("step").to_numpy()
    # Row groups hold every parameter of their rows: plan them on the widest parameter, with
    # the others' bytes as the caller's own bytes per row (they are read one after another).
    widest = max(readers.values(), key=lambda r: r.row_bytes)
    others = sum(r.row_bytes for r in readers.values()) - widest.row_bytes
    total = sum(rows.size * r.row_bytes for r in readers.values())
    name = next(n for n, r in readers.items() if r is widest)
    budget = opts.budget
    opts.require("export", [  # the blocks below get half of it
        (name, widest, 2 * least_budget(widest, rows, per_row_bytes=2 * others))
    ])
    with (
        pq.ParquetWriter(path, schema, compression="zstd") as out,
        opts.bar(total, "export") as bar,
    ):
        for blk in blocks(
            widest, rows, budget=budget // 2, keys=keys, per_row_bytes=2 * others, what="export"
        ):
            part = records.slice(blk.positions.start, blk.positions.stop - blk.positions.start)
            columns = [part.column(c) for c in _INDEX]
            for r in readers.values():
                data = blk.data if r is widest else r.read(rows[blk.positions])
                flat = pa.array(data.reshape(-1), pa.from_numpy_dtype(r.dtype))
                columns.append(_nested(flat, r.shape))
                bar.update(data.nbytes)
            out.write_table(pa.Table.from_arrays(columns, schema=schema))
            del columns, data, flat  # before the next block is read
        if rows.size == 0:
            out.write_table(schema.empty_table())


def _npz(run: StoreReader, path: Path, names: list[str], records: Any, opts: ScanOptions) -> None:
    rows = records.column("row").to_numpy()
    keys = records.column("step").to_numpy()
    readers = {n: reader(run, n) for n in names}
    total = sum(rows.size * r.row_bytes for r in readers.values())
    budget = opts.budget
    opts.require("export", [(n, r, least_budget(r, rows)) for n, r in readers.items()])
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf,
        opts.bar(total, "export") as bar,
    ):
        for column in _INDEX:
            values = records.column(column)
            if column == "lr":
                arr = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64)
            else:
                arr = values.to_numpy()
            with zf.open(f"{column}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)
        for name, r in readers.items():
            with zf.open(f"{GRADS}{name}.npy", "w", force_zip64=True) as f:
                header = {
                    "descr": np.lib.format.dtype_to_descr(r.dtype),
                    "fortran_order": False,
                    "shape": (int(rows.size), *r.shape),
                }
                np.lib.format.write_array_header_2_0(f, header)
                for blk in blocks(r, rows, budget=budget, keys=keys, what=name):
                    f.write(np.ascontiguousarray(blk.data).reshape(-1).view(np.uint8).data)
                    bar.update(blk.data.nbytes)


def _nested_type(value: Any, shape: Sequence[int]) -> Any:
    """``fixed_size_list`` nested once per axis of ``shape``, innermost last."""
    import pyarrow as pa

    for size in reversed(shape):
        value = pa.list_(value, int(size))
    return value


def _nested(flat: Any, shape: Sequence[int]) -> Any:
    """The flat values of ``n`` records as ``n`` nested fixed-size lists of ``shape``."""
    import pyarrow as pa

    for size in reversed(shape):
        flat = pa.FixedSizeListArray.from_arrays(flat, int(size))
    return flat


def parquet_grads(table: Any, param: str) -> np.ndarray:
    """A parameter's gradients from a parquet export: ``(n_records, *shape)``, no copy.

    Args:
        table: The export read by ``pyarrow.parquet.read_table`` (or a slice of it).
        param: The parameter name (its column is ``grads/<param>``).

    Returns:
        The gradients, rows following the table's rows.

    Raises:
        SelectionError: the table has no column ``grads/<param>``.
    """
    name = GRADS + param
    if name not in table.column_names:
        have = [c[len(GRADS):] for c in table.column_names if c.startswith(GRADS)]
        raise SelectionError(
            f"the export has no gradients of {param!r} (no column {name!r}); it holds {have}."
        )
    column = table.column(name).combine_chunks()
    shape: list[int] = []
    values = column
    while hasattr(values.type, "list_size"):  # one fixed-size list level per axis
        shape.append(int(values.type.list_size))
        values = values.flatten()
    return np.asarray(values.to_numpy(zero_copy_only=False)).reshape(len(column), *shape)
