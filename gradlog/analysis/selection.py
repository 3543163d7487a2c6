"""What an analysis runs over: parameters, records, their learning rates, array readers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.analysis.scan import ArrayReader
from gradlog.errors import InputError, SelectionError, StoreFormatError

if TYPE_CHECKING:
    from gradlog.store.reader import Run

__all__ = [
    "MissingLearningRateError",
    "estimated",
    "params_of",
    "reader",
    "record_coefficients",
    "records_of",
    "space_vector",
]

_FORMS = ("full", "factors", "rows", "topk", "projection")
"""Forms the scans read: ``full``; ``factors``, ``rows`` and ``topk`` rebuilt block by block
(exact; ``topk`` its kept entries); ``projection`` in its projected space (estimates)."""


def estimated(run: Run, names: Sequence[str]) -> list[str]:
    """The parameters among ``names`` whose scores are estimates: recorded as projections
    (inner products of projections estimate the gradients', unbiased) or top-k entries."""
    return [n for n in names if run._check_param(n).get("form", "full") in ("projection", "topk")]


def space_vector(run: Run, param: str, grad: Any) -> Any:
    """A gradient the user gives for ``param`` in the space its records are compared in:
    projected for a ``projection`` parameter, as given otherwise."""
    if run._check_param(param).get("form", "full") != "projection":
        return grad
    if hasattr(grad, "detach"):  # torch, without importing it here
        grad = grad.detach().cpu().numpy()
    arr = np.asarray(grad)
    return run.project(param, arr if arr.dtype.kind == "f" else arr.astype(np.float32))


class MissingLearningRateError(InputError):
    """The learning rate an analysis needs was not recorded (it is null in the index)."""


def params_of(
    run: Run, params: str | Sequence[str] | None, *, gradients: bool = False
) -> list[str]:
    """Recorded parameter names selected by ``params`` (None: all), checked.

    With ``gradients`` (analyses that read gradients), None selects every parameter that
    keeps them: those recorded with form ``norm`` keep only their norms and are skipped;
    naming one is a :class:`~gradlog.errors.SelectionError`.
    """
    if params is None:
        names = run.param_names
        if gradients:
            names = [n for n in names if run._check_param(n).get("form", "full") != "norm"]
            if not names:
                raise SelectionError(
                    f"every parameter of {run.path} was recorded with form 'norm': only each "
                    "record's exact norm is kept, so there are no gradients to compare. Use "
                    "run.norms() or run.self_influence()."
                )
    elif isinstance(params, str):
        names = [params]
    elif isinstance(params, Iterable):
        names = list(params)
    else:
        raise SelectionError(
            f"params={params!r}: expected a parameter name, a list of names, or None."
        )
    if not names:
        raise SelectionError("no parameter selected: pass a parameter name, a list, or None.")
    for name in names:
        spec = run._check_param(name)
        if gradients and spec.get("form", "full") == "norm":
            raise SelectionError(
                f"parameter {name!r} was recorded with form 'norm': only each record's exact "
                "norm is kept (run.norms(param)), so it cannot enter similarities, influence, "
                "movement or exports. Select other parameters with params= (params=None "
                "selects every parameter that keeps gradients)."
            )
    return names


def reader(run: Run, param: str, *, probes: bool = False) -> ArrayReader:
    """A reader of ``param``'s gradient array (or of its probe array), opened on first read.

    Values come back float32 (float64 for float64 storage), lossy storage dtypes widened.
    """
    from gradlog.store.dtypes import storage_dtype

    spec = run._check_param(param)
    form = spec.get("form", "full")
    if form == "norm":
        raise SelectionError(  # params= selections are refused earlier, by params_of
            f"parameter {param!r} was recorded with form 'norm': only each record's exact norm "
            "is kept (read it with run.norms(param)), so it has no gradients to read. Choose a "
            "parameter recorded with another form."
        )
    if form not in _FORMS:
        raise StoreFormatError(
            f"parameter {param!r} is stored in form {form!r}, which this gradlog's analysis "
            f"does not read (it reads {', '.join(_FORMS)}). Upgrade gradlog."
        )
    stored = storage_dtype(spec["dtype"])
    out = np.float64 if stored.array_dtype == np.float64 else np.float32
    if probes:  # probes are stored full; a projected parameter's are projected alike

        def read(rows: np.ndarray) -> np.ndarray:
            full = np.asarray(run._probe_array(param).read(rows, out))
            return np.asarray(space_vector(run, param, full), dtype=out)

        shape = run.form(param).out_shape if form == "projection" else spec["shape"]
        return ArrayReader(
            read,
            shape,
            out,
            stored_itemsize=stored.itemsize,
            chunk_rows=lambda: run._probe_array(param).chunk_rows,
            sharded=False,
        )

    if form != "full" and run.format_version >= 3:
        _note_estimates(run, param, form)
        return _form_reader(run, param, spec, out, stored.itemsize)

    def read_grads(rows: np.ndarray) -> np.ndarray:
        return _read_sorted(run._grad_array(param), rows, out)

    sharded = run.format_version >= 2  # gradlog's own shard reader; version 1 reads via zarr
    return ArrayReader(
        read_grads,
        spec["shape"],
        out,
        stored_itemsize=stored.itemsize,
        chunk_rows=lambda: run._grad_array(param).rows_per_chunk(),
        sharded=sharded,
    )


_ESTIMATES = {
    "projection": "a random projection: inner products, norms and scores computed from it are "
    "unbiased estimates (Johnson-Lindenstrauss error ~ sqrt(2/dim) of the product of norms)",
    "topk": "its top-k entries: inner products and scores use those entries only",
}


def _note_estimates(run: Run, param: str, form: str) -> None:
    """Say once per run and parameter that its scores are estimates."""
    import warnings

    if form not in _ESTIMATES:
        return
    noted: set[str] = run.__dict__.setdefault("_estimates_noted", set())
    if param not in noted:
        noted.add(param)
        warnings.warn(
            f"parameter {param!r} was recorded as {_ESTIMATES[form]}; exact norms stay in "
            "run.norms().",
            UserWarning,
            stacklevel=3,
        )


def _form_reader(
    run: Run, param: str, spec: Mapping[str, Any], out: Any, itemsize: int
) -> ArrayReader:
    """Rows of a parameter kept in another form than ``full``: a projection's vectors
    (compared in projected space), or the rebuilt gradients of factors, rows and top-k."""
    form = run.form(param)
    first = next(iter(spec["arrays"]))

    def read(rows: np.ndarray) -> np.ndarray:
        arrays = run.read_form_arrays(param, rows)
        data = arrays["proj"] if form.name == "projection" else form.decode(arrays)
        return np.asarray(data.numpy(), dtype=out)

    shape = form.out_shape if form.name == "projection" else spec["shape"]
    stored = max(1, form.nbytes_per_record(itemsize))
    return ArrayReader(
        read,
        shape,
        out,
        stored_itemsize=max(1, stored // max(1, int(np.prod(shape, dtype=np.int64)))),
        chunk_rows=lambda: run._grad_array(param, first).rows_per_chunk(),
        sharded=True,
    )


def _read_sorted(array: Any, rows: np.ndarray, dtype: Any) -> np.ndarray:
    """``array.read(rows, dtype)`` for sorted rows, without its scatter buffers.

    For sharded (format version 2) arrays each shard's rows are decoded straight into their
    place in the result by the verified shard reader (``ShardLayout.read_rows``: checksums,
    missing rows and truncation raise ``StoreCorruptError``), which saves two of the four
    passes over the data that ``GradArray.read``'s any-order scatter makes (a zeroed result and
    a per-shard block): measured, it makes scans about 2x faster on CPU. Other arrays go
    through ``GradArray.read``.
    """

    from gradlog.store.dtypes import from_storage

    layout = getattr(array, "layout", None)
    if layout is None or rows.size == 0 or bool(np.any(np.diff(rows) <= 0)):
        return np.asarray(array.read(rows, dtype))
    stored = np.empty((rows.size, *array.shape), dtype=layout.array_dtype)
    shards = rows // layout.rows_per_shard
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(shards)) + 1, [rows.size]])
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        shard = int(shards[a])
        key = layout.shard_key(shard)
        layout.read_rows(
            array.directory / key,
            shard,
            (rows[a:b] - shard * layout.rows_per_shard).tolist(),
            stored[a:b],
            f"{array.root}: {array.where}, chunk {key}",
        )
    return np.asarray(from_storage(stored, array.dtype, dtype))


def records_of(run: Run, selection: Any, what: str) -> Any:
    """The records a selection names: None (all), ``{"step": ..., "datum": ...}``, or a
    pyarrow table with a ``row`` column (e.g. ``run.records(...)``)."""
    if selection is None:
        return run.datums
    if isinstance(selection, Mapping):
        unknown = set(selection) - {"step", "datum"}
        if unknown:
            raise InputError(
                f"{what}={dict(selection)!r}: unknown keys {sorted(unknown)}; a selection takes "
                "'step' and 'datum', as run.records(step=..., datum=...)."
            )
        return run.records(selection.get("step"), selection.get("datum"))
    if hasattr(selection, "column_names") and "row" in selection.column_names:
        return selection
    raise InputError(
        f"{what} must be None (every record), a dict such as {{'step': 3}} or "
        f"{{'step': range(10), 'datum': [1, 2]}}, or a table from run.records(); got "
        f"{type(selection).__name__}."
    )


def record_coefficients(records: Any, *, lr: float | None, weighted: bool, what: str) -> np.ndarray:
    """Per record: its learning rate (or ``lr`` when given), times its weight if ``weighted``.

    Raises:
        MissingLearningRateError: a record's learning rate is null and ``lr`` is not given.
    """
    n = records.num_rows
    if lr is not None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not np.isfinite(lr):
            raise InputError(f"lr={lr!r} must be a finite number.")
        rates = np.full(n, float(lr))
    else:
        column = records.column("lr")
        if column.null_count:
            missing = records.filter(column.is_null()).column("step").to_pylist()
            steps = sorted(set(missing))
            raise MissingLearningRateError(
                f"{what} weights every step by its learning rate, but step(s) "
                f"{', '.join(map(str, steps[:5]))}{' ...' if len(steps) > 5 else ''} were "
                "recorded without one (lr is null). Record with rec.backward(..., lr=...) or "
                "GradRecorder(..., optimizer=opt), or pass lr= here to use one constant rate."
            )
        rates = column.to_numpy(zero_copy_only=False).astype(np.float64)
    if weighted:
        rates = rates * records.column("weight").to_numpy().astype(np.float64)
    return rates


def per_datum(
    datum_ids: np.ndarray, steps: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum ``values`` per datum id: (ids ascending, sums, number of distinct steps)."""
    ids, inverse = np.unique(datum_ids, return_inverse=True)
    sums = np.bincount(inverse, weights=values, minlength=ids.size)
    pairs = np.unique(np.stack([inverse, steps]), axis=1)  # distinct (datum, step)
    n_steps = np.bincount(pairs[0], minlength=ids.size) if pairs.size else np.zeros(0, np.int64)
    return ids, sums, n_steps.astype(np.int64)


def ranked(
    ids: np.ndarray,
    scores: np.ndarray,
    n_steps: np.ndarray,
    *,
    top: int | None,
    kinds: tuple[str, str, str],
    extra: Mapping[str, np.ndarray] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Any:
    """A table ``kind, rank, datum_id, score, n_steps[, extra...]``.

    With ``top=k``: the ``k`` largest positive scores (``kinds[0]``, descending) then the ``k``
    most negative (``kinds[1]``, ascending). With ``top=None``: every datum by descending
    score, ``kind`` by sign (``kinds[2]`` for zero). Ties break by datum id.
    """
    import pyarrow as pa

    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise InputError(f"top={top!r} must be a positive int, or None for every datum.")
    desc = np.lexsort((ids, -scores))
    if top is None:
        order = desc
        sign = np.sign(scores[order]).astype(np.int64)
        kind = np.array([kinds[2], kinds[0], kinds[1]], dtype=object)[sign]  # 0, +1, -1
        rank = np.arange(1, order.size + 1)
    else:
        pos = desc[scores[desc] > 0][:top]
        asc = np.lexsort((ids, scores))
        neg = asc[scores[asc] < 0][:top]
        order = np.concatenate([pos, neg]).astype(np.int64)
        kind = np.array([kinds[0]] * pos.size + [kinds[1]] * neg.size, dtype=object)
        rank = np.concatenate([np.arange(1, pos.size + 1), np.arange(1, neg.size + 1)])
    columns: dict[str, Any] = {
        "kind": pa.array(kind.tolist(), pa.string()),
        "rank": pa.array(rank, pa.int64()),
        "datum_id": pa.array(ids[order], pa.int64()),
        "score": pa.array(scores[order], pa.float64()),
        "n_steps": pa.array(n_steps[order], pa.int64()),
    }
    for name, values in (extra or {}).items():
        columns[name] = pa.array(values[order], pa.float64())
    table = pa.table(columns)
    if metadata:
        table = table.replace_schema_metadata(dict(metadata))
    return table
