"""Gradient similarity between records: dot products or cosines, within or across steps."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.analysis import tasks
from gradlog.analysis.scan import ScanArgs, ScanOptions, blocks, least_budget
from gradlog.analysis.selection import params_of, records_of
from gradlog.analysis.space import ops_of, reader
from gradlog.errors import InputError
from gradlog.store.reader import StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["KINDS", "similarity"]

KINDS = ("dot", "cosine")


def similarity(
    run: StoreReader,
    params: str | Sequence[str] | None = None,
    *,
    a: Any = None,
    b: Any = None,
    kind: str = "dot",
    **scan: Unpack[ScanArgs],
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
        **scan: ``max_memory`` (the result, ``len(a) x len(b)`` float64, is not counted),
            ``progress``, ``scheduler`` (:class:`~gradlog.analysis.scan.ScanArgs`): on Dask,
            one task per pair of blocks of the local plan (equal to the local result on one
            machine; BLAS builds may round ``x @ y.T`` differently elsewhere).

    Records of ``factors``, ``rows`` and ``topk`` parameters are compared through their
    form's inner products (:mod:`gradlog.analysis.space`), never rebuilt.

    Returns:
        float64 array ``(len(a), len(b))``; row ``i`` is the ``i``-th record of ``a`` in the
        order of its table (row order for a dict), column ``j`` likewise for ``b``.
    """
    if kind not in KINDS:
        raise InputError(f"kind={kind!r} is not one of {list(KINDS)}.")
    opts = ScanOptions(**scan)
    budget = opts.budget
    names = params_of(run, params, gradients=True)
    rec_a = records_of(run, a, "a")
    rec_b = rec_a if b is None and a is not None else records_of(run, b, "b")
    same = rec_b is rec_a or (a is None and b is None)
    rows_a, order_a = _sorted_rows(rec_a)
    rows_b, order_b = _sorted_rows(rec_b)
    steps_a = rec_a.column("step").to_numpy()[order_a]
    steps_b = rec_b.column("step").to_numpy()[order_b]
    readers = {n: reader(run, n, space=True) for n in names}
    # each side's blocks get half of max_memory (a block of a and one of b are held at once)
    opts.require("similarity", [
        (n, r, 2 * least_budget(r, rows, per_row_bytes=r.numel * 8))
        for n, r in readers.items() for rows in (rows_a, rows_b)
    ])
    if opts.scheduler is not None:  # the same blocks, as Dask tasks (gradlog.analysis.tasks)
        parts = tasks.similarity_parts(
            run, names, (rows_a, steps_a), (rows_b, steps_b), same, budget // 2, opts.scheduler
        )
        return _finish(*parts, kind, order_a, order_b)
    out = np.zeros((rows_a.size, rows_b.size), dtype=np.float64)
    sq_a = np.zeros(rows_a.size, dtype=np.float64)
    sq_b = np.zeros(rows_b.size, dtype=np.float64)
    half = budget // 2
    with opts.bar(None, "similarity") as bar:
        for name in names:
            r = readers[name]
            ops = ops_of(r)
            side = functools.partial(  # each block is multiplied as a float64 copy
                blocks, r, budget=half, per_row_bytes=r.numel * 8, on_read=bar.update, what=name
            )
            first = True
            for blk_a in side(rows_a, keys=steps_a):
                x = blk_a.data
                if same and blk_a.positions == slice(0, rows_a.size):  # all of a, in memory
                    gram, own = ops.gram(x)  # one symmetric pass gives the norms too
                    out += gram
                    sq_a += own
                    sq_b += own
                    del x, gram
                    continue
                sq_a[blk_a.positions] += ops.sqnorms(x)
                # no read-ahead: an inner pass left early (the next outer block) would leave
                # its reads in flight beside the next pass's, over the budget
                for blk_b in side(rows_b, keys=steps_b, prefetch=False):
                    y = blk_b.data
                    out[blk_a.positions, blk_b.positions] += ops.inner(x, y)
                    if first:
                        sq_b[blk_b.positions] += ops.sqnorms(y)
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
        # 0 where either gradient is zero; NaN stays NaN (a record with a non-finite gradient)
        out = np.divide(out, scale, out=np.where(np.isnan(scale), np.nan, 0.0), where=scale > 0)
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
