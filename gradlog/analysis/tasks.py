"""Scans as Dask tasks: the same blocks as the local scan, read by workers from the store.

``scheduler=`` on :func:`~gradlog.analysis.influence`, :func:`~gradlog.analysis.stats`,
:func:`~gradlog.analysis.movers`, :func:`~gradlog.analysis.similarity` and their ``Run``
methods runs the scan on Dask instead of in the calling process. It takes what
``dask.compute(..., scheduler=...)`` takes: a ``dask.distributed.Client``, ``"distributed"``
(the active Client), ``"threads"``, ``"processes"``, ``"sync"``, or ``"dask"`` (Dask's own
default: the active Client if there is one).

One task per block of the local scan's plan (:func:`gradlog.analysis.scan.block_plan`): the
client plans from the index (parquet, small), and each task gets the store's path and its
block's rows, opens the store itself (workers need the store's path: a shared file system),
reads and checks the rows exactly as the local scan does, and returns a small float64 result
(one number per record, a block's moments, a parameter-sized sum, or the products of two
blocks for similarity). Nothing of the store's gradient data passes
through the client, and nothing is written to the store. Because each task does the local
scan's arithmetic on the same block, and the client adds the results up in the local order,
results are bitwise those of the local scan on machines with the same numpy build and CPU;
across different machines numpy's SIMD kernels (and BLAS, for similarity's products) may
differ in the last bit.

Each task holds what one block of the local scan holds: at most ``max_memory`` (a third of it
when the plan reads ahead), per worker thread.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.analysis.extras import require_extra
from gradlog.analysis.gradients import decoded
from gradlog.analysis.scan import block_plan
from gradlog.analysis.space import block_moments, ops_of, probe_cost, reader, step_dots
from gradlog.errors import StoreReplacedError
from gradlog.store import root
from gradlog.store.reader import StoreReader

__all__ = [
    "StoreRef",
    "compute",
    "influence_dots",
    "movement",
    "read_rows",
    "similarity_parts",
    "stats_moments",
]


@dataclass(frozen=True)
class StoreRef:
    """What a task needs to open a store: its path (and, to refuse a store replaced since
    the client planned, the run's identity: :func:`gradlog.store.root.identity`)."""

    path: str
    identity: tuple[Any, ...]

    @classmethod
    def of(cls, run: StoreReader) -> StoreRef:
        # absolute: a worker's working directory is not the client's
        path = run.path.absolute() if isinstance(run.path, Path) else run.path
        return cls(str(path), root.identity(run.attrs))

    def open(self) -> StoreReader:
        """The store, opened in the task's process (root JSON only: the index is not read;
        the client cross-checked it when it opened the run)."""
        run = StoreReader(self.path, cross_check=False)
        if root.identity(run.attrs) != self.identity:
            raise StoreReplacedError(
                f"{self.path} was replaced by another run while a Dask scan read it; open it "
                "again (gradlog.open) and run the scan again."
            )
        return run


def compute(tasks: Sequence[Any], scheduler: Any) -> list[Any]:
    """``dask.compute`` of delayed ``tasks`` on ``scheduler`` (module doc)."""
    dask = require_extra("dask", "dask", "scheduler= (scans on Dask)")
    if not tasks:
        return []
    if isinstance(scheduler, str) and scheduler == "dask":
        return list(dask.compute(*tasks))
    return list(dask.compute(*tasks, scheduler=scheduler))


def _delayed() -> Any:
    return require_extra("dask", "dask", "scheduler= (scans on Dask)").delayed


# -- tasks (run on workers) ----------------------------------------------------------------
def _space_reader(run: StoreReader, name: str) -> Any:
    """The reader a local scan compares ``name``'s records with (its form's space); the
    client said once that scores are estimates."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return reader(run, name, space=True)


def read_rows(rows: np.ndarray, ref: StoreRef, param: str, dtype: Any) -> np.ndarray:
    """Task: rows ``rows`` (ascending store rows) of ``param``'s gradients, ``(n, *shape)``."""
    run = ref.open()
    with warnings.catch_warnings():  # to_dask warned once, for the whole array
        warnings.simplefilter("ignore", UserWarning)
        return decoded(run, param, np.asarray(rows, dtype=np.int64), dtype)  # as Run.grads


def _dots_fixed(ref: StoreRef, name: str, rows: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Task: ``<g_r, q>`` for the block's records (influence with a user gradient)."""
    r = _space_reader(ref.open(), name)
    return ops_of(r).dots(r.read(rows), q)


def _dots_probe(
    ref: StoreRef, name: str, rows: np.ndarray, steps: np.ndarray, probe_rows: np.ndarray
) -> np.ndarray:
    """Task: ``<g_r, g_t(probe)>`` for the block's records, the probe's row at each step."""
    run = ref.open()
    r = _space_reader(run, name)
    extra = np.asarray(reader(run, name, probes=True).read(probe_rows))
    return step_dots(ops_of(r), r.read(rows), steps, extra)


def _moments(ref: StoreRef, name: str, rows: np.ndarray) -> tuple[int, float, float, float, float]:
    """Task: a block's (count, mean, sum of squared deviations, min, max)."""
    return block_moments(reader(ref.open(), name).read(rows))


# -- plans (run on the client) -------------------------------------------------------------
def influence_dots(
    run: StoreReader,
    names: Sequence[str],
    rows: np.ndarray,
    steps: np.ndarray,
    at: np.ndarray | None,
    vectors: Mapping[str, np.ndarray],
    budget: int,
    scheduler: Any,
) -> np.ndarray:
    """Per record ``sum over names of <g_r, probe gradient>``, as
    :func:`gradlog.analysis.influence.record_influence` computes it locally."""
    delayed = _delayed()
    ref = StoreRef.of(run)
    tasks: list[Any] = []
    where: list[slice] = []
    for name in names:
        train = reader(run, name, space=True)
        if at is None:
            q = vectors[name]
            plan, _ = block_plan(train, rows, budget=budget - q.nbytes, keys=steps, what=name)
            shared = delayed(q)  # one key: sent to a worker once, not once per task
            for i0, i1 in plan:
                tasks.append(delayed(_dots_fixed, pure=True)(ref, name, rows[i0:i1], shared))
                where.append(slice(i0, i1))
            continue
        probes = reader(run, name, probes=True)
        plan, _ = block_plan(
            train, rows, budget=budget, keys=steps, extra_cost=probe_cost(probes, at), what=name
        )
        for i0, i1 in plan:
            task = delayed(_dots_probe, pure=True)(
                ref, name, rows[i0:i1], steps[i0:i1], np.unique(at[i0:i1])
            )
            tasks.append(task)
            where.append(slice(i0, i1))
    dots = np.zeros(rows.size, dtype=np.float64)
    for positions, part in zip(where, compute(tasks, scheduler)):
        dots[positions] += part  # in the local scan's order: parameter by parameter
    return dots


def stats_moments(
    run: StoreReader, param: str, rows: np.ndarray, steps: np.ndarray, budget: int, scheduler: Any
) -> list[tuple[int, float, float, float, float]]:
    """The blocks' moments of :func:`gradlog.analysis.stats`, in the local scan's order."""
    delayed = _delayed()
    ref = StoreRef.of(run)
    r = reader(run, param)
    plan, _ = block_plan(r, rows, budget=budget, keys=steps, per_row_bytes=r.numel * 8, what=param)
    tasks = [delayed(_moments, pure=True)(ref, param, rows[i0:i1]) for i0, i1 in plan]
    return compute(tasks, scheduler)


def _weighted_sum(ref: StoreRef, name: str, rows: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """Task: ``sum_r coef_r g_r`` over the block's records."""
    r = _space_reader(ref.open(), name)
    return ops_of(r).weighted_sum(coef, r.read(rows))


def movement(
    run: StoreReader,
    names: Sequence[str],
    rows: np.ndarray,
    keys: np.ndarray,
    coef: np.ndarray,
    budget: int,
    scheduler: Any,
) -> tuple[np.ndarray, float]:
    """Per record ``<g_r, delta>`` and ``||delta||^2`` of
    :func:`gradlog.analysis.movement.record_movement`: two passes, as locally."""
    delayed = _delayed()
    ref = StoreRef.of(run)
    plans = {}
    sums: list[Any] = []
    for name in names:
        r = reader(run, name, space=True)
        own = 2 * r.numel * 8  # delta and einsum's output, as the local scan counts them
        plans[name], _ = block_plan(r, rows, budget=budget - own, keys=keys, what=name)
        for i0, i1 in plans[name]:
            sums.append(delayed(_weighted_sum, pure=True)(ref, name, rows[i0:i1], coef[i0:i1]))
    parts = iter(compute(sums, scheduler))
    deltas = {}
    norm_sq = 0.0
    for name in names:
        delta = np.zeros(reader(run, name, space=True).numel, dtype=np.float64)
        for _ in plans[name]:
            delta += next(parts)  # block by block, in the local order
        norm_sq += float(delta @ delta)
        deltas[name] = delta
    tasks: list[Any] = []
    where: list[slice] = []
    for name in names:
        shared = delayed(deltas[name])
        for i0, i1 in plans[name]:
            tasks.append(delayed(_dots_fixed, pure=True)(ref, name, rows[i0:i1], shared))
            where.append(slice(i0, i1))
    proj = np.zeros(rows.size, dtype=np.float64)
    for positions, part in zip(where, compute(tasks, scheduler)):
        proj[positions] += part
    return proj, norm_sq


def _squares(ref: StoreRef, name: str, rows: np.ndarray) -> np.ndarray:
    """Task: each record's squared norm."""
    r = _space_reader(ref.open(), name)
    return ops_of(r).sqnorms(r.read(rows))


def _products(
    ref: StoreRef, name: str, rows_a: np.ndarray, rows_b: np.ndarray | None
) -> np.ndarray:
    """Task: ``<x_i, y_j>`` of two blocks in float64 (``x`` with itself when ``rows_b`` is
    None)."""
    r = _space_reader(ref.open(), name)
    return ops_of(r).inner(r.read(rows_a), None if rows_b is None else r.read(rows_b))


def similarity_parts(
    run: StoreReader,
    names: Sequence[str],
    a: tuple[np.ndarray, np.ndarray],
    b: tuple[np.ndarray, np.ndarray],
    same: bool,
    budget: int,
    scheduler: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dots, squared norms of a, of b)`` of :func:`gradlog.analysis.similarity`, from the
    local scan's blocks (``a``, ``b``: sorted rows and their steps), added in its order."""
    delayed = _delayed()
    ref = StoreRef.of(run)
    (rows_a, steps_a), (rows_b, steps_b) = a, b
    layout: list[tuple[str, list[tuple[int, int]], list[tuple[int, int]] | None]] = []
    tasks: list[Any] = []
    for name in names:
        r = reader(run, name, space=True)
        f64 = r.numel * 8  # each block is multiplied as a float64 copy
        plan_a, _ = block_plan(r, rows_a, budget=budget, keys=steps_a, per_row_bytes=f64, what=name)
        task = functools.partial(delayed, pure=True)
        tasks += [task(_squares)(ref, name, rows_a[i0:i1]) for i0, i1 in plan_a]
        if same and plan_a == [(0, rows_a.size)]:  # all of a in one block: its Gram matrix
            tasks.append(task(_products)(ref, name, rows_a, None))
            layout.append((name, plan_a, None))
            continue
        plan_b, _ = block_plan(r, rows_b, budget=budget, keys=steps_b, per_row_bytes=f64, what=name)
        tasks += [task(_squares)(ref, name, rows_b[j0:j1]) for j0, j1 in plan_b]
        tasks += [
            task(_products)(ref, name, rows_a[i0:i1], rows_b[j0:j1])
            for i0, i1 in plan_a
            for j0, j1 in plan_b
        ]
        layout.append((name, plan_a, plan_b))
    results = iter(compute(tasks, scheduler))
    out = np.zeros((rows_a.size, rows_b.size), dtype=np.float64)
    sq_a = np.zeros(rows_a.size, dtype=np.float64)
    sq_b = np.zeros(rows_b.size, dtype=np.float64)
    for _, blocks_a, blocks_b in layout:
        own = [next(results) for _ in blocks_a]
        for (i0, i1), part in zip(blocks_a, own):
            sq_a[i0:i1] += part
        if blocks_b is None:
            out += next(results)
            sq_b += own[0]
            continue
        for (j0, j1), part in zip(blocks_b, [next(results) for _ in blocks_b]):
            sq_b[j0:j1] += part
        for i0, i1 in blocks_a:
            for j0, j1 in blocks_b:
                out[i0:i1, j0:j1] += next(results)
    return out, sq_a, sq_b
