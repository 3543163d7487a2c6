"""Which data moved a parameter: each datum's share of the parameter's change over a range.

At step ``t`` plain SGD moves the parameters by ``-lr_t * sum_b w_b g_b``; record ``r``'s
part of it is ``c_r = -lr_t * w_r * g_r`` (``lr_t`` each parameter's own param group's where
the groups' rates differ and the run kept the optimizer's state). Over a range of recorded
steps the change that SGD attributes to the records is ``delta = sum_r c_r`` (the
**SGD-attributable change**: it is the actual change of the parameter for plain SGD without
weight decay when every step of the range is recorded; for momentum or Adam, or with skipped
steps, it is the change SGD would have made from the recorded gradients). A datum's score is
the length of its contributions along that change::

    score(d) = sum over records r of d:  < c_r , delta > / ||delta||

so the scores of all data sum to ``||delta||`` (in the parameter's units): a positive score
moved the parameter along its change (a *proponent* of it, the word ``Run.influence`` uses), a
negative one pushed against it (an *opponent*), and
``fraction = score / ||delta||`` is the datum's share. With several parameters, ``delta`` is
their concatenation.

Two streaming passes per parameter (one for ``delta``, one for the projections), float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.analysis import tasks
from gradlog.analysis.optimizer import param_coefficients
from gradlog.analysis.scan import ScanArgs, ScanOptions, blocks, least_budget
from gradlog.analysis.selection import params_of, per_datum, ranked, summed_sqnorms
from gradlog.analysis.space import ops_of, reader
from gradlog.errors import InputError
from gradlog.store.reader import Selector, StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["movers", "record_movement"]


def record_movement(
    run: StoreReader,
    params: str | Sequence[str] | None,
    *,
    steps: Selector = None,
    lr: float | None = None,
    **scan: Unpack[ScanArgs],
) -> tuple[Any, np.ndarray, float]:
    """Per record ``<c_r, delta>`` and ``||delta||``: ``(records, projections, norm)``."""
    opts = ScanOptions(**scan)
    names = params_of(run, params, gradients=True)
    records = run.records(step=steps)
    coef, per_param = param_coefficients(run, records, names, lr=lr, weighted=True,
                                         what="movers")  # lr_t w_r
    rows = records.column("row").to_numpy()
    keys = records.column("step").to_numpy()
    readers = {n: reader(run, n, space=True) for n in names}
    # each scan holds the parameter's change and einsum's output beside its blocks
    opts.require("movers", [
        (n, r, least_budget(r, rows) + 2 * r.numel * 8) for n, r in readers.items()
    ])
    # param groups at other rates: each parameter's change and projections with its own
    parts = ([(names, -coef)] if per_param is None
             else [([n], -per_param[n]) for n in names])  # -lr_t w_r
    scores = np.zeros(rows.size, dtype=np.float64)
    norm_sq = 0.0
    for group, c in parts:
        proj, sq = _movement(run, group, readers, rows, keys, c, opts)
        scores += c * proj
        norm_sq += sq
    return records, scores, float(np.sqrt(norm_sq))


def _movement(run: StoreReader, names: Sequence[str], readers: Mapping[str, Any],
              rows: np.ndarray, keys: np.ndarray, coef: np.ndarray,
              opts: ScanOptions) -> tuple[np.ndarray, float]:
    """``<g_r, delta>`` per record over ``names`` and ``||delta||^2``, ``delta`` the change
    ``sum_r coef_r g_r``."""
    budget = opts.budget
    if opts.scheduler is not None:  # the same blocks, as Dask tasks (gradlog.analysis.tasks)
        return tasks.movement(run, names, rows, keys, coef, budget, opts.scheduler)
    proj = np.zeros(rows.size, dtype=np.float64)
    norm_sq = 0.0
    total = 2 * sum(rows.size * readers[n].row_bytes for n in names)
    with opts.bar(total, "movers") as bar:
        for name in names:
            r = readers[name]
            ops = ops_of(r)
            delta = np.zeros(r.numel, dtype=np.float64)
            own = 2 * delta.nbytes  # delta and einsum's output
            for blk in blocks(
                r, rows, budget=budget - own, keys=keys, on_read=bar.update, what=name
            ):
                delta += ops.weighted_sum(coef[blk.positions], blk.data)
            norm_sq += float(delta @ delta)
            for blk in blocks(
                r, rows, budget=budget - own, keys=keys, on_read=bar.update, what=name
            ):
                proj[blk.positions] += ops.dots(blk.data, delta)
    return proj, norm_sq


def movers(
    run: StoreReader,
    params: str | Sequence[str] | None = None,
    *,
    steps: Selector = None,
    top: int | None = 10,
    lr: float | None = None,
    **scan: Unpack[ScanArgs],
) -> Any:
    """Rank data by how much they moved ``params`` over ``steps`` (module doc).

    Args:
        run: The run.
        params: A parameter name, a list of them (their joint change), or None: every
            parameter that keeps gradients (those recorded with form ``norm`` keep only
            norms and are skipped; naming one is a ``SelectionError``).
        steps: Step selection (int, list, range, slice); None: every recorded step.
        top: The ``top`` data that moved the parameter most along its change (kind
            "proponent", as in ``Run.influence``) and the ``top`` that pushed most against
            it ("opponent"); None: every datum.
        lr: Use this learning rate for every step instead of the recorded one.
        **scan: ``max_memory``, ``progress``, ``scheduler``
            (:class:`~gradlog.analysis.scan.ScanArgs`).

    Returns:
        pyarrow table ``kind``, ``rank``, ``datum_id``, ``score``, ``n_steps``, ``fraction``;
        its schema metadata ``change_norm`` holds ``||delta||`` (the sum of every score).
    """
    records, scores, norm = record_movement(run, params, steps=steps, lr=lr, **scan)
    if not np.isfinite(norm):  # one non-finite record makes the change, and every share, NaN
        sq = summed_sqnorms(run, records, params_of(run, params, gradients=True))
        bad = np.unique(records.column("step").to_numpy()[~np.isfinite(sq)])
        raise InputError(
            f"the change of the selected parameters is not finite: records of step(s) "
            f"{bad[:10].tolist()} have non-finite gradients (the recorder warned at those "
            "steps). Pass steps= without them."
        )
    ids, sums, n_steps = per_datum(
        records.column("datum_id").to_numpy(), records.column("step").to_numpy(), scores
    )
    sums = sums / norm if norm > 0 else np.zeros_like(sums)
    fraction = sums / norm if norm > 0 else np.zeros_like(sums)
    return ranked(
        ids,
        sums,
        n_steps,
        top=top,
        kinds=("proponent", "opponent", "neutral"),  # one vocabulary with influence
        extra={"fraction": fraction},
        metadata={"change_norm": repr(norm)},
    )
