"""Gradient similarity between records: dot products or cosines, within or across steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.analysis.scan import blocks, least_budget, memory_bytes, progress_bar, require_memory
from gradlog.analysis.selection import params_of, reader, records_of
from gradlog.errors import InputError

if TYPE_CHECKING:
    from gradlog.store.reader import Run

__all__ = ["KINDS", "similarity"]

KINDS = ("dot", "cosine")


def similarity(
    run: Run,
    params: str | Sequence[str] | None = None,
    *,
    a: Any = None,
    b: Any = None,
    kind: str = "dot",
    max_memory: int | str | None = None,
    progress: bool = False,
    scheduler: Any = None,
) -> np.ndarray:
    """Similarity of the gradients of two sets of records.

    Args:
        run: The run.
        params: A parameter, a list of them (their gradients concatenated), or None: every
            parameter that keeps gradients (those recorded with form ``norm`` keep only
            norms and are skipped; naming one is a ``SelectionError``).
        a: The rows' records: None (every record), a dict ``{"step": ..., "datum": ...}`` as
            :meth:`Run.records` takes, or a table from ``run.records(...)``.
        b: The columns' records, likewise; None with ``a`` given means the same as ``a``.
        kind: ``"dot"`` (``<g_i, g_j>``) or ``"cosine"`` (0 where a gradient is zero).
        max_memory: Working-memory cap of the scan (bytes or ``"512MiB"``); the result
            (``len(a) x len(b)`` float64) is not counted.
        progress: Show a progress bar (local scans).
        scheduler: Run the scan on Dask, as :func:`gradlog.analysis.influence` does: one
            task per pair of blocks of the local plan (equal to the local result on one
            machine; BLAS builds may round ``x @ y.T`` differently elsewhere).

    Returns:
        float64 array ``(len(a), len(b))``; row ``i`` is the ``i``-th record of ``a`` in the
        order of its table (row order for a dict), column ``j`` likewise for ``b``.
    """
    if kind not in KINDS:
        raise InputError(f"kind={kind!r} is not one of {list(KINDS)}.")
    budget = memory_bytes(max_memory)
    names = params_of(run, params, gradients=True)
    rec_a = records_of(run, a, "a")
    rec_b = rec_a if b is None and a is not None else records_of(run, b, "b")
    same = rec_b is rec_a or (a is None and b is None)
    rows_a, order_a = _sorted_rows(rec_a)
    rows_b, order_b = _sorted_rows(rec_b)
    steps_a = rec_a.column("step").to_numpy()[order_a]
    steps_b = rec_b.column("step").to_numpy()[order_b]
    readers = {n: reader(run, n) for n in names}
    # each side's blocks get half of max_memory (a block of a and one of b are held at once)
    require_memory(budget, "similarity", [
        (n, r, 2 * least_budget(r, rows, per_row_bytes=r.numel * 8))
        for n, r in readers.items() for rows in (rows_a, rows_b)
    ])
    if scheduler is not None:  # the same blocks, as Dask tasks (gradlog.analysis.tasks)
        from gradlog.analysis.tasks import similarity_parts

        parts = similarity_parts(
            run, names, (rows_a, steps_a), (rows_b, steps_b), same, budget // 2, scheduler
        )
        return _finish(*parts, kind, order_a, order_b)
    out = np.zeros((rows_a.size, rows_b.size), dtype=np.float64)
    sq_a = np.zeros(rows_a.size, dtype=np.float64)
    sq_b = np.zeros(rows_b.size, dtype=np.float64)
    half = budget // 2
    with progress_bar(progress, None, "similarity") as bar:
        for name in names:
            r = readers[name]
            f64 = r.numel * 8  # each block is multiplied as a float64 copy
            first = True
            for blk_a in blocks(
                r,
                rows_a,
                budget=half,
                keys=steps_a,
                per_row_bytes=f64,
                on_read=bar.update,
                what=name,
            ):
                x = blk_a.data.astype(np.float64)
                own = np.einsum("ij,ij->i", x, x)
                sq_a[blk_a.positions] += own
                if same and blk_a.positions == slice(0, rows_a.size):  # all of a, in memory
                    out += x @ x.T
                    sq_b += own
                    del x
                    continue
                for blk_b in blocks(
                    r,
                    rows_b,
                    budget=half,
                    keys=steps_b,
                    per_row_bytes=f64,
                    on_read=bar.update,
                    what=name,
                    # no read-ahead: an inner pass left early (the next outer block) would
                    # leave its reads in flight beside the next pass's, over the budget
                    prefetch=False,
                ):
                    y = blk_b.data.astype(np.float64)
                    out[blk_a.positions, blk_b.positions] += x @ y.T
                    if first:
                        sq_b[blk_b.positions] += np.einsum("ij,ij->i", y, y)
                    del y
                first = False
                del x
    return _finish(out, sq_a, sq_b, kind, order_a, order_b)


def _finish(
    out: np.ndarray,
    sq_a: np.ndarray,
    sq_b: np.ndarray,
    kind: str,
    order_a: np.ndarray,
    order_b: np.ndarray,
) -> np.ndarray:
    """Cosines from the squared norms if asked, rows and columns in the callers' orders."""
    if kind == "cosine":
        scale = np.outer(np.sqrt(sq_a), np.sqrt(sq_b))
        out = np.divide(out, scale, out=np.zeros_like(out), where=scale > 0)
    if np.array_equal(order_a, np.arange(order_a.size)) and np.array_equal(
        order_b, np.arange(order_b.size)
    ):
        return out
    result = np.empty_like(out)  # back to the callers' orders
    result[np.ix_(order_a, order_b)] = out
    return result


def _sorted_rows(records: Any) -> tuple[np.ndarray, np.ndarray]:
    rows = records.column("row").to_numpy().astype(np.int64)
    order = np.argsort(rows, kind="stable")
    return rows[order], order
