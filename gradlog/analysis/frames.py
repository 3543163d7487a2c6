"""Gradients as labelled (xarray) and out-of-core (dask) arrays.

Both are optional dependencies: ``pip install 'gradlog[xarray]'`` / ``'gradlog[dask]'``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradlog.analysis.extras import require_extra
from gradlog.analysis.gradients import decoded, record_shape
from gradlog.analysis.tasks import StoreRef, read_rows
from gradlog.errors import MissingExtraError
from gradlog.store.reader import Selector, StoreReader

__all__ = ["MissingExtraError", "to_dask", "to_xarray"]


def to_dask(run: StoreReader, param: str, step: Selector = None, datum: Selector = None) -> Any:
    """``param``'s gradients of the selected records as a lazy dask array ``(n, *shape)``.

    Chunks follow the store's chunk (or shard) files on the record axis (one backward call's
    rows); nothing is read until computed, and every read is checksum-verified and decoded
    like ``Run.grads`` (float32; float64 for float64 storage), compact forms included
    (factors, rows and top-k rebuilt per chunk; a projection's projected vectors, shape
    ``(n, *ranks)``; ``norm`` keeps no gradient and raises ``SelectionError``). Rows follow
    ``Run.records``.

    Each chunk is a task that opens the store by its path and reads its rows
    (:func:`gradlog.analysis.tasks.read_rows`), so the array computes on any Dask scheduler,
    a ``dask.distributed`` cluster included (its workers must see the store's path), and the
    graph carries only row numbers, never gradient data.
    """
    shape, array = record_shape(run, param)  # a wrong name is named before dask is needed
    da = require_extra("dask.array", "dask", "Run.to_dask")
    from dask.base import tokenize

    rows = run.rows(step, datum)
    dtype = run.value_dtype(param)
    if rows.size == 0:
        return da.zeros((0, *shape), dtype=dtype)
    per_file = int(run.array(param, array).rows_per_chunk())
    # chunk boundaries where the rows cross into the next chunk file
    files = rows // per_file
    cuts = np.flatnonzero(np.diff(files)) + 1
    sizes = tuple(int(v) for v in np.diff(np.concatenate([[0], cuts, [rows.size]])))
    ref = StoreRef.of(run)
    token = tokenize(ref, param, rows)
    row_chunks = da.from_array(rows, chunks=(sizes,), name=f"gradlog-rows-{token}")
    return row_chunks.map_blocks(
        read_rows,
        ref,
        param,
        dtype,
        chunks=(sizes, *((d,) for d in shape)),
        new_axis=list(range(1, 1 + len(shape))),
        dtype=dtype,
        meta=np.empty((0,) * (1 + len(shape)), dtype=dtype),
        name=f"gradlog-{param}-{token}",
    )


def to_xarray(
    run: StoreReader,
    param: str,
    step: Selector = None,
    datum: Selector = None,
    *,
    lazy: bool = False,
) -> Any:
    """``param``'s gradients as an ``xarray.DataArray`` with dimension ``record`` first.

    Coordinates along ``record``: ``step``, ``datum_id``, ``row``, ``loss``, ``weight``,
    ``lr`` (NaN where unknown). The other dimensions are ``dim_0 ...`` as in the store, or
    ``proj_0 ...`` for a parameter recorded as a random projection (the projected vectors,
    as ``Run.grads`` returns them); attribute ``form`` names the form. With ``lazy=True``
    the data is a dask array (:func:`to_dask`), otherwise numpy.
    """
    xr = require_extra("xarray", "xarray", "Run.to_xarray")
    records = run.records(step, datum)
    if lazy:
        data = to_dask(run, param, step, datum)
    else:
        run.spec(param)
        data = decoded(run, param, np.asarray(records.column("row"), dtype=np.int64), np.float32)
    form = run.form_name(param)
    axis = "proj" if form == "projection" else "dim"  # projected vectors: their own axes
    dims = ["record", *(f"{axis}_{i}" for i in range(data.ndim - 1))]
    coords = {
        name: (
            "record",
            np.asarray(
                records.column(name).to_numpy(zero_copy_only=False),
                dtype=np.float64 if name == "lr" else None,
            ),
        )
        for name in ("step", "datum_id", "row", "loss", "weight", "lr")
    }
    return xr.DataArray(
        data, dims=dims, coords=coords, name=param,
        attrs={"run": str(run.path), "param": param, "form": form},
    )
