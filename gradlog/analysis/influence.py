"""Influence over the recorded steps: which training data influenced a probe, and by how much.

Score of a training datum ``d`` for a probe ``z``::

    score(d, z) = sum over records r of d at steps t where z has a gradient:
                  lr_t * [w_r] * < g_r , g_t(z) >

summed over the selected parameters. ``g_r`` is the datum's recorded gradient at step ``t``,
``g_t(z)`` the probe's gradient recorded at the same step (same parameter values, before the
optimizer step), ``lr_t`` the step's learning rate (each parameter's own param group's where
the groups' rates differ and the run kept the optimizer's state:
:func:`~gradlog.analysis.optimizer.param_coefficients`) and ``w_r`` the record's weight (``1/B``
with ``batch_reduction="mean"``), included only with ``weighted=True``.

Sign and scale. Plain SGD moves the parameters by ``-lr_t * sum_b w_b g_b`` at step ``t``, so
to first order datum ``r``'s part of that step changes the probe's loss by
``-lr_t * w_r * <g_r, g_t(z)>``. With ``weighted=True`` the score is exactly minus that change,
summed over the recorded steps: **a positive score means training on the datum decreased the
probe's loss (a proponent), a negative score that it increased it (an opponent)**, in units of
the probe's loss. The default ``weighted=False`` is TracIn as published (Pruthi et al. 2020),
``B`` times larger for a constant batch size ``B``: the same ranking, scores comparable across
runs with different batch sizes. Steps that were not recorded (``every > 1``) contribute
nothing. That is ``kind="tracin"``; ``kind="optimizer"`` follows the optimizer that trained
the model (Adam's preconditioner, momentum) from its recorded state, and ``kind="cosine"``
normalises each term (:mod:`gradlog.analysis.optimizer`). The default is ``"optimizer"`` when
the run kept its optimizer's state, else ``"tracin"``.

Everything is accumulated in float64, streaming one block of steps at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.analysis import tasks
from gradlog.analysis.optimizer import (
    OptimizerView,
    check_kind,
    param_coefficients,
    probe_reader,
    probe_sqnorms,
)
from gradlog.analysis.scan import ScanArgs, ScanOptions, blocks, least_budget
from gradlog.analysis.selection import (
    check_finite,
    finite_scores,
    params_of,
    per_datum,
    ranked,
    summed_sqnorms,
)
from gradlog.analysis.space import (
    ops_of,
    probe_cost,
    probe_read,
    reader,
    space_vector,
    step_dots,
)
from gradlog.errors import InputError
from gradlog.store.reader import StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["influence", "record_influence", "self_influence"]

Probe = int | Mapping[str, Any]


def _vector(value: Any, shape: Sequence[int], name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    arr = np.asarray(value, dtype=np.float64)
    numel = int(np.prod(shape, dtype=np.int64))
    if arr.size != numel or (arr.ndim > 1 and tuple(arr.shape) != tuple(shape)):
        raise InputError(
            f"the probe gradient for {name!r} has shape {tuple(arr.shape)}; the parameter's "
            f"shape is {tuple(shape)}."
        )
    return check_finite(arr.reshape(numel), name, "probe gradient")


def record_influence(
    run: StoreReader,
    probe: Probe,
    *,
    kind: str | None = None,
    params: str | Sequence[str] | None = None,
    weighted: bool = False,
    lr: float | None = None,
    **scan: Unpack[ScanArgs],
) -> tuple[Any, np.ndarray]:
    """Per-record influence scores: ``(records, scores)``, one score per record of ``records``.

    See :func:`influence` for the arguments; ``records`` are the training records that count
    (those at steps where the probe has a gradient), in row order.
    """
    import pyarrow.compute as pc  # heavy: imported by the queries that use it

    kind = check_kind(run, kind)
    opts = ScanOptions(**scan)
    if kind == "optimizer":
        opts.local_only("influence with kind='optimizer'")
    if isinstance(probe, Mapping):
        names = params_of(run, list(probe) if params is None else params, gradients=True)
        missing = [n for n in names if n not in probe]
        if missing:
            raise InputError(
                f"the probe gradient has no entry for {missing}; give one array per parameter "
                f"(keys: {list(probe)}), or select parameters with params=."
            )
        raw = {n: _vector(probe[n], run.spec(n)["shape"], n) for n in names}
        vectors = {n: _vector(space_vector(run, n, raw[n].reshape(run.spec(n)["shape"])),
                              reader(run, n).shape, n) for n in names}
        records = run.datums
        probe_rows = probe_steps = None
    else:
        if isinstance(probe, bool) or not isinstance(probe, (int, np.integer)):
            raise InputError(
                f"probe must be a recorded probe id (int) or a dict {{param: gradient}}, got "
                f"{type(probe).__name__}."
            )
        names = params_of(run, params, gradients=True)
        mine = run.probe_records(probe=int(probe))
        records = run.datums.filter(
            pc.is_in(run.datums.column("step"), value_set=mine.column("step"))
        )
        probe_steps = mine.column("step").to_numpy()
        probe_rows = mine.column("row").to_numpy()
        vectors, raw = {}, {}
    rows = records.column("row").to_numpy()
    steps = records.column("step").to_numpy()
    per_param = None
    if kind == "optimizer":  # lr_t is in the probe's factor lr_t c P_t
        coef = (records.column("weight").to_numpy().astype(np.float64) if weighted
                else np.ones(rows.size))
    else:
        coef, per_param = param_coefficients(run, records, names, lr=lr, weighted=weighted,
                                             what="influence")
    dots = np.zeros(rows.size, dtype=np.float64)
    if rows.size == 0:
        return records, dots
    # position -> probe row at that record's step (probe rows ascend with steps)
    at = (probe_rows[np.searchsorted(probe_steps, steps)]
          if probe_rows is not None and probe_steps is not None else None)
    readers = {n: reader(run, n, space=True) for n in names}
    if kind == "optimizer":
        view = OptimizerView(run, steps, lr)
        step_of_row = None
        if at is None:  # a fixed gradient, times each step's factor: one row per step
            at = np.searchsorted(np.unique(steps), steps)
        else:
            assert probe_rows is not None and probe_steps is not None  # a recorded probe
            step_of_row = dict(zip(probe_rows.tolist(), probe_steps.tolist()))
        probe_readers = {
            n: _optimizer_probes(run, n, view, steps, raw.get(n), step_of_row) for n in names
        }
        vectors = {}
    else:
        probe_readers = {} if at is None else {n: reader(run, n, probes=True) for n in names}
    if per_param is None:
        scores = coef * _dots(run, names, readers, probe_readers, rows, steps, at, vectors, opts,
                              dots)
    else:  # param groups at other rates: each parameter's products times its own
        scores = dots
        for n in names:
            scores += per_param[n] * _dots(
                run, [n], {n: readers[n]}, {n: probe_readers[n]} if probe_readers else {},
                rows, steps, at, vectors, opts, np.zeros(rows.size, dtype=np.float64))
    if kind == "cosine":
        scores = _cosine(run, names, records, probe, scores, probe_steps, raw)
    return records, scores


def _optimizer_probes(
    run: StoreReader,
    name: str,
    view: OptimizerView,
    steps: np.ndarray,
    fixed: np.ndarray | None,
    step_of_row: dict[int, int] | None,
) -> Any:
    """A reader of the probe rows times ``lr_t c P_t``: recorded probe rows (by store
    row), or the fixed gradient once per scored step (by position in the unique steps)."""
    out = run.value_dtype(name)
    if fixed is not None:
        unique = np.unique(steps)
        return probe_reader(run, name, lambda ids: np.broadcast_to(fixed, (ids.size, fixed.size)),
                            lambda i: int(unique[i]), view, out)
    assert step_of_row is not None  # recorded probes: the caller mapped their rows

    def full_rows(ids: np.ndarray) -> np.ndarray:
        return run.read_probe_rows(name, ids, np.float64)

    return probe_reader(run, name, full_rows, step_of_row.__getitem__, view, out)


def _cosine(
    run: StoreReader,
    names: Sequence[str],
    records: Any,
    probe: Probe,
    scores: np.ndarray,
    probe_steps: np.ndarray | None,
    raw: Mapping[str, np.ndarray],
) -> np.ndarray:
    """TracIn scores divided by the two gradients' norms over ``names`` (exact: the index's
    norms, a fixed gradient's own); 0 where either is zero."""
    sq = summed_sqnorms(run, records, names)
    if probe_steps is None:  # a fixed gradient
        probe_sq = np.full(sq.size, sum(float(np.dot(raw[n], raw[n])) for n in names))
    else:
        assert not isinstance(probe, Mapping)  # a recorded probe: its steps were given
        mine = run.probe_records(probe=int(probe))
        per_step = probe_sqnorms(run, mine, names)
        probe_sq = per_step[np.searchsorted(probe_steps, records.column("step").to_numpy())]
    scale = np.sqrt(sq * probe_sq)  # (NaN stays NaN: a record with a non-finite gradient)
    return np.asarray(np.divide(scores, scale, out=np.where(np.isnan(scale), np.nan, 0.0),
                                where=scale > 0))


def _dots(
    run: StoreReader,
    names: Sequence[str],
    readers: Mapping[str, Any],
    probe_readers: Mapping[str, Any],
    rows: np.ndarray,
    steps: np.ndarray,
    at: np.ndarray | None,
    vectors: Mapping[str, np.ndarray],
    opts: ScanOptions,
    dots: np.ndarray,
) -> np.ndarray:
    """``<g_r, probe>`` per record summed over ``names``: with the fixed vectors
    ``vectors``, or with the probe row ``at[i]`` of ``probe_readers`` per record."""
    budget = opts.budget
    needs = []  # a fixed gradient is held beside the blocks; a probe's rows are read with them
    for name, train in readers.items():
        if at is None:
            needs.append((name, train, least_budget(train, rows) + vectors[name].nbytes))
            continue
        probes = probe_readers[name]
        needs.append((name, train, least_budget(train, rows, extra_cost=probe_cost(probes, at))))
    opts.require("influence", needs)

    if opts.scheduler is not None:  # the same blocks, as Dask tasks (gradlog.analysis.tasks)
        return tasks.influence_dots(run, names, rows, steps, at, vectors, budget, opts.scheduler)
    total = sum(rows.size * r.row_bytes for r in readers.values())
    with opts.bar(total, "influence") as bar:
        for name in names:
            train = readers[name]
            ops = ops_of(train)
            if at is None:
                q = vectors[name]
                for blk in blocks(
                    train, rows, budget=budget - q.nbytes, keys=steps, on_read=bar.update, what=name
                ):
                    dots[blk.positions] += ops.dots(blk.data, q)
                continue
            probes = probe_readers[name]
            for blk in blocks(
                train,
                rows,
                budget=budget,
                keys=steps,
                extra_cost=probe_cost(probes, at),
                extra_read=probe_read(probes, at),
                on_read=bar.update,
                what=name,
            ):
                assert blk.extra is not None  # extra_read gave it
                dots[blk.positions] += step_dots(ops, blk.data, steps[blk.positions], blk.extra)
    return dots


def influence(
    run: StoreReader,
    probe: Probe,
    *,
    top: int | None = 10,
    kind: str | None = None,
    params: str | Sequence[str] | None = None,
    weighted: bool = False,
    lr: float | None = None,
    **scan: Unpack[ScanArgs],
) -> Any:
    """Rank training data by their influence on a probe (module doc: sign and scale).

    Args:
        run: The run.
        probe: A probe id recorded in the store (``GradRecorder(..., probes=...)``): its
            gradient at each step is the one recorded at that step, and only steps where it was
            recorded count. Or a dict ``{param: gradient}`` you computed (numpy or torch, the
            parameter's shape): the same vector is used at every recorded step, which is
            TracIn with one fixed test gradient rather than one per checkpoint.
        top: Return the ``top`` proponents (largest positive scores) and the ``top``
            opponents (most negative scores); None: every datum.
        kind: The score (:mod:`gradlog.analysis.optimizer`): ``"tracin"`` (SGD's first
            order), ``"optimizer"`` (the recorded optimizer's: Adam's preconditioner and
            momentum), ``"cosine"``; None: ``"optimizer"`` when the run kept its optimizer's
            state (``GradRecorder(optimizer=...)`` with Adam, AdamW or SGD), else
            ``"tracin"``. The table's schema metadata ``score_kind`` says which.
        params: Parameters to sum over (default: the dict's keys, or every parameter that
            keeps gradients: those recorded with form ``norm`` keep only norms and are
            skipped; naming one is a ``SelectionError``).
        weighted: Multiply by each record's weight ``w_b`` (module doc).
        lr: Use this learning rate for every step instead of the recorded one.
        **scan: ``max_memory``, ``progress``, ``scheduler`` (:class:`ScanArgs`); on Dask
            the result is the local scan's (:mod:`gradlog.analysis.tasks`;
            ``kind="optimizer"`` runs locally only).

    Returns:
        pyarrow table ``kind`` ("proponent" / "opponent"; "neutral" for a zero score with
        ``top=None``), ``rank``, ``datum_id``, ``score``, ``n_steps`` (steps where the datum
        and the probe both have a gradient).

    Raises:
        SelectionError: unknown probe id or parameter.
        MissingLearningRateError: a step has no recorded learning rate and ``lr`` is not given.
    """
    kind = check_kind(run, kind)
    records, scores = record_influence(
        run, probe, kind=kind, params=params, weighted=weighted, lr=lr, **scan
    )
    ids, sums, n_steps = per_datum(
        records.column("datum_id").to_numpy(), records.column("step").to_numpy(), scores
    )
    return ranked(ids, sums, n_steps, top=top, kinds=("proponent", "opponent", "neutral"),
                  metadata={"score_kind": kind})


def self_influence(
    run: StoreReader,
    *,
    top: int | None = None,
    params: str | Sequence[str] | None = None,
    weighted: bool = False,
    lr: float | None = None,
) -> Any:
    """Self-influence ``sum_t lr_t [w_r] ||g_r||^2`` per datum (summed over its records).

    Computed from the exact float64 norms of the index: no gradient is read, so it is
    instant. Large values flag data the model keeps being pushed by: outliers, mislabelled
    or memorised examples.

    Returns:
        pyarrow table ``datum_id``, ``score``, ``n_steps``, by descending score (first ``top``).
    """
    import pyarrow as pa  # heavy: imported by the queries that use it

    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise InputError(f"top={top!r} must be a positive int, or None for every datum.")
    names = params_of(run, params)
    records = run.datums
    coef, per_param = param_coefficients(run, records, names, lr=lr, weighted=weighted,
                                         what="self_influence")
    if per_param is None:
        values = coef * summed_sqnorms(run, records, names)
    else:
        values = sum((per_param[n] * summed_sqnorms(run, records, [n]) for n in names),
                     np.zeros(records.num_rows))
    ids, sums, n_steps = per_datum(
        records.column("datum_id").to_numpy(), records.column("step").to_numpy(), values
    )
    finite = finite_scores(ids, sums)  # (a NaN sorted last fell out of top=k in silence)
    ids, sums, n_steps = ids[finite], sums[finite], n_steps[finite]
    order = np.lexsort((ids, -sums))[:top]
    return pa.table(
        {
            "datum_id": pa.array(ids[order], pa.int64()),
            "score": pa.array(sums[order], pa.float64()),
            "n_steps": pa.array(n_steps[order], pa.int64()),
        }
    )
