"""Statistics of a slice of gradients (``gradlog show``), streamed in bounded memory."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.analysis import tasks
from gradlog.analysis.scan import ScanArgs, ScanOptions, blocks
from gradlog.analysis.space import block_moments, reader
from gradlog.store.reader import Selector, StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["stats"]


def stats(
    run: StoreReader,
    param: str,
    step: Selector = None,
    datum: Selector = None,
    **scan: Unpack[ScanArgs],
) -> dict[str, Any]:
    """Statistics of ``param``'s gradients over the selected records, in float64.

    Returns:
        dict with ``param``, ``n_records``, ``shape`` (of the slice, records first), ``norm``
        (the L2 norm of the whole slice), ``mean``, ``std`` (population), ``min``, ``max``,
        and ``record_norm_min`` / ``record_norm_max`` (the exact per-record norms of the
        index). Values are None for an empty slice.

    ``**scan``: ``max_memory``, ``progress``, ``scheduler``
    (:class:`~gradlog.analysis.scan.ScanArgs`); on Dask the result is the local scan's.
    """
    opts = ScanOptions(**scan)
    budget = opts.budget
    r = reader(run, param)
    records = run.records(step, datum)
    rows = records.column("row").to_numpy()
    steps = records.column("step").to_numpy()
    bar = opts.bar(None, "stats")
    if opts.scheduler is not None:  # the same blocks, as Dask tasks (gradlog.analysis.tasks)
        parts: Iterable[tuple[int, float, float, float, float]] = tasks.stats_moments(
            run, param, rows, steps, budget, opts.scheduler
        )
    else:
        parts = (
            block_moments(blk.data)
            for blk in blocks(
                r, rows, budget=budget, keys=steps, per_row_bytes=r.numel * 8,
                on_read=bar.update, what=param,
            )
        )
    count, mean, m2 = 0, 0.0, 0.0  # Chan et al.'s parallel variance, merged block by block
    lo, hi = np.inf, -np.inf
    with bar:
        merged = list(parts)
    for n, bmean, bm2, blo, bhi in merged:
        if n == 0:
            continue
        delta = bmean - mean
        total = count + n
        mean += delta * n / total
        m2 += bm2 + delta * delta * count * n / total
        count = total
        lo = float(np.minimum(lo, blo))  # NaN propagates (min() would drop it)
        hi = float(np.maximum(hi, bhi))
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
        norms = run.record_norms(records, param)
        out.update(
            norm=float(np.sqrt(m2 + count * mean * mean)),
            mean=mean,
            std=float(np.sqrt(m2 / count)),
            min=lo,
            max=hi,
            record_norm_min=float(norms.min()),
            record_norm_max=float(norms.max()),
        )
    elif rows.size and r.numel == 0:  # a zero-size parameter: no element, norms of 0
        norms = run.record_norms(records, param)
        out.update(norm=0.0, record_norm_min=float(norms.min()),
                   record_norm_max=float(norms.max()))
    return out
