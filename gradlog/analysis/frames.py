"""Gradients as labelled (xarray) and out-of-core (dask) arrays.

Both are optional dependencies: ``pip install -e '.[xarray]'`` / ``'.[dask]'``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from gradlog.analysis.extras import require_extra
from gradlog.analysis.gradients import decoded, guard_unselected, record_shape
from gradlog.analysis.tasks import StoreRef, read_rows
from gradlog.errors import MissingExtraError
from gradlog.store.reader import Selector, StoreReader

__all__ = ["AXES", "MissingExtraError", "param_axes", "to_dask", "to_xarray"]


def to_dask(run: StoreReader, param: str, step: Selector = None, datum: Selector = None) -> Any:
    """``param``'s gradients of the selected records as a lazy dask array ``(n, *shape)``.

    Nothing is read here, whatever the size: select, reduce or persist it as dask allows
    (``to_xarray`` gives the same data with named dimensions and record coordinates).

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


# Axis names of a parameter by the class of the module holding it and its attribute name
# (torch's own meaning of each axis); a parameter not listed keeps dim_0, dim_1, ...
AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("Linear", "weight"): ("out", "in"),
    ("Linear", "bias"): ("out",),
    ("NonDynamicallyQuantizableLinear", "weight"): ("out", "in"),
    ("NonDynamicallyQuantizableLinear", "bias"): ("out",),
    ("Conv1D", "weight"): ("in", "out"),  # GPT-2 (transformers): x @ weight
    ("Conv1D", "bias"): ("out",),
    ("Conv1d", "weight"): ("out", "in", "kernel"),
    ("Conv2d", "weight"): ("out", "in", "kernel_h", "kernel_w"),
    ("Conv3d", "weight"): ("out", "in", "kernel_d", "kernel_h", "kernel_w"),
    ("Conv1d", "bias"): ("out",),
    ("Conv2d", "bias"): ("out",),
    ("Conv3d", "bias"): ("out",),
    ("Embedding", "weight"): ("token", "feature"),
    ("EmbeddingBag", "weight"): ("token", "feature"),
    ("LayerNorm", "weight"): ("feature",),
    ("LayerNorm", "bias"): ("feature",),
    ("RMSNorm", "weight"): ("feature",),
    ("GroupNorm", "weight"): ("channel",),
    ("GroupNorm", "bias"): ("channel",),
}
"""``(module class, attribute) -> axis names`` used by :func:`param_axes`."""


def param_axes(run: StoreReader, param: str) -> tuple[str, ...]:
    """Names of the axes of ``param``'s gradients as :func:`to_xarray` labels them.

    The parameter's own axes where the run says which module holds it (the ``hooks`` backend
    records each module's class): ``("out", "in")`` for an ``nn.Linear`` weight, ``("out",)``
    for its bias, ``("token", "feature")`` for an embedding, ... (:data:`AXES`); otherwise
    ``dim_0, dim_1, ...``; ``proj_0, ...`` for the projected vectors of a ``projection``.
    """
    spec = run.spec(param)
    if spec["form"] == "projection":
        return tuple(f"proj_{i}" for i in range(len(run.form(param).out_shape)))
    ndim = len(spec["shape"])
    for module in run.attrs.get("backend", {}).get("modules", []):
        if param in module.get("params", ()):
            prefix = f"{module['module']}." if module["module"] else ""
            attr = param[len(prefix):] if param.startswith(prefix) else param
            names = AXES.get((module.get("class", ""), attr))
            if names is not None and len(names) == ndim:
                return names
    return tuple(f"dim_{i}" for i in range(ndim))


def to_xarray(
    run: StoreReader,
    param: str,
    step: Selector = None,
    datum: Selector = None,
    *,
    lazy: bool | None = None,
    max_memory: int | str | None = None,
) -> Any:
    """``param``'s gradients as an ``xarray.DataArray``: dimension ``record`` first, then the
    parameter's own axes.

    Dimensions: ``record``, then :func:`param_axes` (``out``, ``in`` for an ``nn.Linear``
    weight; ``dim_0 ...`` where the run does not say; ``proj_0 ...`` for a parameter recorded
    as a random projection: the projected vectors, as ``Run.grads`` returns them).
    Coordinates along ``record``: ``step``, ``micro``, ``datum_id``, ``row``, ``loss``,
    ``weight``, ``lr`` (NaN where unknown) and ``norm`` (the record's exact norm of
    ``param``). Attributes: ``run``, ``param``, ``form``.

    Args:
        run: The run.
        param: The parameter.
        step: Step selection, as ``Run.records``.
        datum: Datum selection, as ``Run.records``.
        lazy: True: the data is a dask array (:func:`to_dask`), read when computed. False:
            numpy, read now (a read of every record is refused above ``max_memory``, as
            ``Run.grads``). None (default): lazy when dask is installed.
        max_memory: For a read now of every record (``lazy`` False or without dask): the
            most bytes it may load (default 256 MiB).
    """
    xr = require_extra("xarray", "xarray", "Run.to_xarray")
    records = run.records(step, datum)
    if lazy is None:
        lazy = importlib.util.find_spec("dask") is not None
    if lazy:
        data = to_dask(run, param, step, datum)
        if data.dtype != np.float32:  # float32, as run.grads and the eager read
            data = data.astype(np.float32)
    else:
        run.spec(param)
        rows = np.asarray(records.column("row"), dtype=np.int64)
        if step is None and datum is None:
            guard_unselected(run, param, rows, np.float32, max_memory, "to_xarray")
        data = decoded(run, param, rows, np.float32)
    dims = ["record", *param_axes(run, param)]
    coords: dict[str, Any] = {
        name: (
            "record",
            np.asarray(
                records.column(name).to_numpy(zero_copy_only=False),
                dtype=np.float64 if name == "lr" else None,
            ),
        )
        for name in ("step", "micro", "datum_id", "row", "loss", "weight", "lr")
        if name in records.column_names
    }
    norm = f"norm/{param}"
    if norm in records.column_names:
        coords["norm"] = ("record", np.asarray(records.column(norm).to_numpy(), np.float64))
    return xr.DataArray(
        data, dims=dims, coords=coords, name=param,
        attrs={"run": str(run.path), "param": param, "form": run.form_name(param)},
    )
