"""What an analysis runs over: parameters, records, their learning rates; and how its
per-record scores become per-datum rankings."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gradlog.errors import InputError, MissingLearningRateError, SelectionError
from gradlog.store.reader import StoreReader

__all__ = [
    "check_finite",
    "check_lr",
    "finite_scores",
    "params_of",
    "per_datum",
    "ranked",
    "record_coefficients",
    "records_of",
    "summed_sqnorms",
]

def params_of(
    run: StoreReader, params: str | Sequence[str] | None, *, gradients: bool = False
) -> list[str]:
    """Recorded parameter names selected by ``params`` (None: all), checked.

    With ``gradients`` (analyses that read gradients), None selects every parameter that
    keeps them: those recorded with form ``norm`` keep only their norms and are skipped;
    naming one is a :class:`~gradlog.errors.SelectionError`.
    """
    if params is None:
        names = run.param_names
        if gradients:
            names = [n for n in names if run.form_name(n) != "norm"]
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
    repeated = sorted(n for n, k in Counter(names).items() if k > 1)
    if repeated:  # each name's products would be summed once per mention
        raise SelectionError(
            f"params names {repeated} more than once: a query sums over the parameters it "
            "selects, so pass each name once."
        )
    for name in names:
        if run.form_name(name) == "norm" and gradients:
            raise SelectionError(
                f"parameter {name!r} was recorded with form 'norm': only each record's exact "
                "norm is kept (run.norms(param)), so it cannot enter similarities, influence, "
                "movement or exports. Select other parameters with params= (params=None "
                "selects every parameter that keeps gradients)."
            )
    return names


def records_of(run: StoreReader, selection: Any, what: str) -> Any:
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


def check_finite(values: np.ndarray, param: str, what: str) -> np.ndarray:
    """``values`` (a gradient the user gave for ``param``), refused unless every entry is
    finite: one NaN or inf makes every score it enters NaN, which rankings would then drop
    or blame on the recorded gradients.

    Raises:
        InputError: an entry is NaN or infinite.
    """
    bad = ~np.isfinite(values)
    if bad.any():
        kinds = " and ".join(k for k, b in (("NaN", np.isnan(values).any()),
                                            ("inf", np.isinf(values).any())) if b)
        raise InputError(
            f"the {what} for {param!r} holds {kinds} ({int(bad.sum())} of its {values.size} "
            "entries): every score it entered would be NaN. Pass a finite gradient (a "
            "non-finite one comes from its loss: check that loss and its inputs)."
        )
    return values


def check_lr(lr: Any) -> float:
    """A query's ``lr=`` as a float: one finite, positive number."""
    if (isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer))
            or not np.isfinite(lr) or lr <= 0):
        raise InputError(
            f"lr={lr!r} must be a finite positive number (the learning rate that replaces "
            "every recorded one), or None to use the recorded ones."
        )
    return float(lr)


def record_coefficients(records: Any, *, lr: float | None, weighted: bool, what: str) -> np.ndarray:
    """Per record: its learning rate (or ``lr`` when given), times its weight if ``weighted``.

    Raises:
        MissingLearningRateError: a record's learning rate is null and ``lr`` is not given.
    """
    n = records.num_rows
    if lr is not None:
        rates = np.full(n, check_lr(lr))
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


def finite_scores(ids: np.ndarray, scores: np.ndarray, stacklevel: int = 3) -> np.ndarray:
    """Which scores are finite; the datums of the others are named in a warning (a ranking
    leaves them out: no rank for them)."""
    finite: np.ndarray = np.isfinite(scores)
    if not finite.all():
        bad = ids[~finite]
        warnings.warn(
            f"{bad.size} datum(s) have a non-finite score and are left out of the ranking "
            f"(ids {bad[:10].tolist()}{' ...' if bad.size > 10 else ''}): a NaN or inf in "
            "their recorded gradients (the recorder warned at those steps) or losses. Select "
            "steps without them, or read their records with run.grads(datum=...).",
            UserWarning, stacklevel=stacklevel,
        )
    return finite


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
    finite = finite_scores(ids, scores, stacklevel=4)
    if not finite.all():
        ids, scores, n_steps = ids[finite], scores[finite], n_steps[finite]
        extra = {k: v[finite] for k, v in (extra or {}).items()}
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


def summed_sqnorms(run: StoreReader, records: Any, names: Sequence[str]) -> np.ndarray:
    """Per record of ``records``: the squared norm of its gradient over ``names``, from the
    index's exact float64 norms (no gradient read)."""
    sq = np.zeros(records.num_rows, dtype=np.float64)
    for name in names:
        norms = run.record_norms(records, name)
        sq += norms * norms
    return sq
