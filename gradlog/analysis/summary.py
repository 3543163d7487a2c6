"""Statistics of a slice of gradients (``gradlog show``), streamed in bounded memory."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.analysis.scan import blocks, memory_bytes
from gradlog.analysis.selection import reader

if TYPE_CHECKING:
    from gradlog.store.reader import Run, Selector

__all__ = ["block_moments", "stats"]


def block_moments(data: np.ndarray) -> tuple[int, float, float, float, float]:
    """A block's (count, mean, sum of squared deviations, min, max), in float64."""
    x = data.astype(np.float64)
    n = int(x.size)
    if n == 0:
        return 0, 0.0, 0.0, float(np.inf), float(-np.inf)
    bmean = float(x.mean())
    x -= bmean
    return n, bmean, float(np.einsum("ij,ij->", x, x)), float(data.min()), float(data.max())


def stats(
    run: Run,
    param: str,
    step: Selector = None,
    datum: Selector = None,
    *,
    max_memory: int | str | None = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Statistics of ``param``'s gradients over the selected records, in float64.

    Returns:
        dict with ``param``, ``n_records``, ``shape`` (of the slice, records first), ``norm``
        (the L2 norm of the whole slice), ``mean``, ``std`` (population), ``min``, ``max``,
        and ``record_norm_min`` / ``record_norm_max`` (the exact per-record norms of the
        index). Values are None for an empty slice.

    ``scheduler`` runs the scan on Dask (:mod:`gradlog.analysis.tasks`): same result.
    """
    from gradlog.store import format as fmt

    budget = memory_bytes(max_memory)
    r = reader(run, param)
    records = run.records(step, datum)
    rows = records.column("row").to_numpy()
    steps = records.column("step").to_numpy()
    if scheduler is not None:  # the same blocks, as Dask tasks (gradlog.analysis.tasks)
        from gradlog.analysis.tasks import stats_moments

        parts: Iterable[tuple[int, float, float, float, float]] = stats_moments(
            run, param, rows, steps, budget, scheduler
        )
    else:
        parts = (
            block_moments(blk.data)
            for blk in blocks(
                r, rows, budget=budget, keys=steps, per_row_bytes=r.numel * 8, what=param
            )
        )
    count, mean, m2 = 0, 0.0, 0.0  # Chan et al.'s parallel variance, merged block by block
    lo, hi = np.inf, -np.inf
    for n, bmean, bm2, blo, bhi in parts:
        if n == 0:
            continue
        delta = bmean - mean
        total = count + n
        mean += delta * n / total
        m2 += bm2 + delta * delta * count * n / total
        count = total
        lo = min(lo, blo)
        hi = max(hi, bhi)
    out: dict[str, Any] = {
        "param": param,
        "n_records": int(rows.size),
        "shape": [int(rows.size), *r.shape],
        "norm": None,
        "mean": None,
        "std": None,
        "min": None,
        "max": None,
        "record_norm_min": None,
        "record_norm_max": None,
    }
    if count:
        norms = records.column(fmt.norm_column(param)).to_numpy()
        out.update(
            norm=float(np.sqrt(m2 + count * mean * mean)),
            mean=mean,
            std=float(np.sqrt(m2 / count)),
            min=lo,
            max=hi,
            record_norm_min=float(norms.min()),
            record_norm_max=float(norms.max()),
        )
    elif rows.size and r.numel == 0:
        out.update(norm=0.0)
    return out
