"""Streaming reads of gradient arrays in bounded memory.

Every analysis reads gradients through :func:`blocks`: the selected rows of one parameter's
array, a few steps at a time, each block as large as ``max_memory`` allows. A block never
splits a step unless one step alone is over the budget (then it is split by rows), so
per-step work (a probe's gradient at that step, its learning rate) stays simple. The next two
blocks are read on background threads while the caller works on the current one, so disk
reads, decoding and arithmetic overlap; each of the three blocks gets a third of the budget.

What ``max_memory`` bounds: the gradient data a scan holds at once, counting the readers'
buffers, and the analysis' own temporaries (which each analysis declares as bytes per row).
Measured with tracemalloc: gradlog's shard reader (format version 2) holds the rows as stored
and decoded plus one shard file; zarr-python (version 1 arrays, probe arrays) holds about
``3 r`` rows to read ``r >= c`` rows of an array with chunks of ``c`` rows (``2 c + r`` inside
one chunk) plus about 16 KiB per chunk in flight. It does not bound what scales with the number
of records (the index table, one score per record, the result), which the caller holds anyway.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from gradlog.errors import InputError, MemoryTooSmallError

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "ArrayReader",
    "Block",
    "PlanArgs",
    "ScanArgs",
    "ScanOptions",
    "block_plan",
    "blocks",
    "least_budget",
    "memory_bytes",
    "progress_bar",
    "require_memory",
]

DEFAULT_MAX_MEMORY = 256 << 20
"""Default working-memory cap of a scan: 256 MiB."""

# zarr-python's bookkeeping per read and per chunk in flight (measured, 3.1): small next to
# real chunks, but it dominates for tiny parameters (biases).
_PER_READ = 32 << 10
_PER_CHUNK = 16 << 10
_CONCURRENCY = 10  # zarr's default async.concurrency: chunks decoded at once
_PREFETCH = 2  # blocks read ahead on threads: one thread's disk wait overlaps another's decode

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 1 << 10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 1 << 20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 1 << 30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 1 << 40,
}


def memory_bytes(value: int | float | str | None) -> int:
    """``max_memory`` in bytes: an int, or a string such as ``"512MiB"``, ``"2GB"``."""
    if value is None:
        return DEFAULT_MAX_MEMORY
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise InputError(
                f"max_memory={value!r} is not a size; pass bytes (an int) or a string such as "
                "'512MiB' or '2GB'."
            )
        value = float(m.group(1)) * _UNITS[unit]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InputError(f"max_memory={value!r} must be a positive number of bytes.")
    return int(value)


class ScanArgs(TypedDict, total=False):
    """The keywords every scan takes (``**scan`` of the analyses and their ``Run`` methods);
    :class:`ScanOptions` checks them."""

    max_memory: int | str | None
    """Working-memory cap of the scan: bytes, or a string such as ``"512MiB"`` (default
    256 MiB)."""
    progress: bool
    """Show a tqdm progress bar (local scans; on Dask, use Dask's dashboard)."""
    scheduler: Any
    """Run the scan on Dask (:mod:`gradlog.analysis.tasks`): a ``dask.distributed.Client``,
    ``"distributed"``, ``"dask"`` or any scheduler ``dask.compute`` takes; None: here."""


@dataclass(frozen=True)
class ScanOptions:
    """How a scan runs: the checked :class:`ScanArgs` (one place for their defaults)."""

    max_memory: int | str | None = None
    progress: bool = False
    scheduler: Any = None

    def __post_init__(self) -> None:
        memory_bytes(self.max_memory)  # refuse a malformed size before any read

    @property
    def budget(self) -> int:
        """``max_memory`` in bytes."""
        return memory_bytes(self.max_memory)

    def bar(self, total: int | None, desc: str) -> Any:
        """A tqdm bar over bytes for a local scan (a no-op object without ``progress``)."""
        return progress_bar(self.progress and self.scheduler is None, total, desc)

    def require(self, what: str, needs: Sequence[tuple[str, ArrayReader, int]]) -> None:
        """:func:`require_memory` with this ``max_memory``."""
        require_memory(self.budget, what, needs)

    def local_only(self, what: str) -> ScanOptions:
        """These options, refusing ``scheduler`` for a scan that runs here only."""
        if self.scheduler is not None:
            raise InputError(f"{what} runs in this process only; drop scheduler=.")
        return self


class ArrayReader:
    """Reads rows of one gradient array (record axis first) as ``(n, numel)`` blocks.

    Args:
        read: ``read(rows)`` returns the rows (sorted int64 store rows) as
            ``(n, *shape)`` of ``dtype``, decoded (lossy storage dtypes widened).
        shape: The parameter's shape.
        dtype: The dtype ``read`` returns.
        stored_itemsize: Bytes per element as stored.
        chunk_rows: Rows per chunk file (a shard for sharded arrays).
        sharded: True for gradlog's sharded arrays (read row by row from each shard file),
            False for arrays read through zarr-python (whole chunks decoded).
        ops: The arithmetic on what ``read`` returns: None for ``(n, *shape)`` arrays
            (read as ``(n, numel)``); a form's operations
            (:class:`gradlog.analysis.space.FormOps`) for its stored arrays, taken as
            ``read`` returns them.
    """

    def __init__(
        self,
        read: Callable[[np.ndarray], np.ndarray],
        shape: Sequence[int],
        dtype: Any,
        *,
        stored_itemsize: int,
        chunk_rows: Callable[[], int] | int,
        sharded: bool,
        ops: Any = None,
        direct: Callable[[], bool] | bool = False,
    ) -> None:
        self._read = read
        self._direct = direct
        self.ops = ops
        self.shape = tuple(int(d) for d in shape)
        self.numel = int(np.prod(self.shape, dtype=np.int64))
        self.dtype = np.dtype(dtype)
        self.row_bytes = max(1, self.numel * self.dtype.itemsize)
        self.stored_row_bytes = max(1, self.numel * stored_itemsize)
        self._chunk_rows = chunk_rows
        self.sharded = sharded

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk (or shard) file; opens the array on first use."""
        if callable(self._chunk_rows):
            self._chunk_rows = max(1, int(self._chunk_rows()))
        return self._chunk_rows

    @property
    def direct(self) -> bool:
        """Whether reads land in their result without decoding buffers (uncompressed local
        arrays: gradlog.store.chunks' scatter reads, ProbeArray's plain chunks)."""
        if callable(self._direct):
            self._direct = bool(self._direct())
        return self._direct

    def read_cost(self, rows: np.ndarray) -> int:
        """Bytes a read of ``rows`` (sorted) holds at its peak (output + decoding)."""
        n = int(rows.size)
        if n == 0:
            return 0
        c = self.chunk_rows
        out = n * self.row_bytes  # what the caller gets
        if self.dtype.itemsize * self.numel != self.stored_row_bytes:
            out += n * self.stored_row_bytes  # decoded in the stored dtype first
        if self.direct:  # a shard's index (16 bytes a row) and a few int64 per row read;
            # a probe chunk not wanted whole is read into a buffer
            extra = 20 * c + 64 * n if self.sharded else c * self.stored_row_bytes
            return int(out + extra + _PER_READ)
        if self.sharded:
            # gradlog's shard reader (gradlog.store.arrays): the rows as stored, then shard by
            # shard the decoded rows of that shard plus the whole file when at least half of
            # its rows are wanted (else one row at a time)
            _, per_shard = np.unique(rows // c, return_counts=True)
            k = int(per_shard.max())
            buffer = c if 2 * k >= c else 1
            return int(out + (n + k + buffer) * self.stored_row_bytes + _PER_READ)
        span = int(rows[-1] - rows[0]) + 1
        if span != n:  # orthogonal read: only the chunks that hold a selected row
            touched = int(np.unique(rows // c).size)
            data = 3 * touched * c
        else:
            touched = (int(rows[-1]) // c) - (int(rows[0]) // c) + 1
            data = 3 * span if span >= c else 2 * c + span
        in_flight = min(touched, _CONCURRENCY)
        return int(out + data * self.stored_row_bytes + in_flight * _PER_CHUNK + _PER_READ)

    def read(self, rows: np.ndarray) -> Any:
        """Rows ``rows`` (sorted) as an ``(n, numel)`` array of :attr:`dtype` (a form's
        stored arrays when :attr:`ops` is set)."""
        if self.ops is not None:
            return self._read(rows)
        if rows.size == 0:
            return np.zeros((0, self.numel), dtype=self.dtype)
        return np.asarray(self._read(rows), dtype=self.dtype).reshape(rows.size, self.numel)


@dataclass
class Block:
    """One read of a scan. Its arrays are released when the scan reads the next block (so a
    consumer's loop variable never keeps two blocks alive): copy what must outlive it.

    Attributes:
        positions: The block's positions in the scan's ``rows`` (a slice, ascending).
        data: ``(n, numel)`` gradients of those rows, storage dtype (a form's arrays for a
            reader with ``ops``).
        extra: The companion block (see :func:`blocks`), or None.
    """

    positions: slice
    data: Any
    extra: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`data`."""
        if isinstance(self.data, np.ndarray):
            return int(self.data.nbytes)
        return sum(int(t.nbytes) for t in self.data.values())

    def release(self) -> None:
        """Drop the arrays (the scan calls this before reading the next block)."""
        self.data = None
        self.extra = None


def _boundaries(keys: np.ndarray) -> np.ndarray:
    """Start positions of the runs of equal consecutive keys, plus the end."""
    if keys.size == 0:
        return np.zeros(1, dtype=np.int64)
    starts = np.flatnonzero(np.diff(keys)) + 1
    return np.concatenate([[0], starts, [keys.size]]).astype(np.int64)


class PlanArgs(TypedDict, total=False):
    """How :func:`block_plan` cuts a scan into blocks (also taken by :func:`blocks`)."""

    keys: np.ndarray | None
    """One key per row (the step); blocks hold whole runs of equal keys unless a run alone
    is over the budget."""
    per_row_bytes: int
    """The caller's own temporaries per row of a block (e.g. a float64 copy)."""
    extra_cost: Callable[[int, int], int] | None
    """For a block's positions ``[i0, i1)``, the bytes of a companion read done with it
    (the probe gradients of the block's steps)."""
    what: str
    """Name of the array, for errors."""
    prefetch: bool
    """Read ahead on background threads (default True)."""


def blocks(
    reader: ArrayReader,
    rows: np.ndarray,
    *,
    budget: int,
    extra_read: Callable[[int, int], np.ndarray] | None = None,
    on_read: Callable[[int], None] | None = None,
    **plan_args: Unpack[PlanArgs],
) -> Iterator[Block]:
    """Yield the rows ``rows`` (ascending) of ``reader``'s array in blocks within ``budget``.

    With ``prefetch``, the next two blocks are read on background threads while the caller
    works on the current one (one thread's disk wait overlaps the other's decoding and the
    caller's arithmetic); each of the three blocks then gets a third of the budget. With less
    room, fewer blocks are read ahead, down to none.

    Args:
        reader: The array.
        rows: Sorted store rows to read.
        budget: Bytes the scan may hold at once.
        extra_read: For a block's positions ``[i0, i1)``, the companion array whose bytes
            ``extra_cost`` counts.
        on_read: Called with the bytes of each block read (progress bars).
        **plan_args: How the blocks are cut (:class:`PlanArgs`).

    Raises:
        MemoryTooSmallError: ``budget`` cannot hold the smallest possible block.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return
    plan, depth = block_plan(reader, rows, budget=budget, **plan_args)
    from concurrent.futures import Future, ThreadPoolExecutor

    # A companion (a block's probe rows) is read on a thread of its own beside the block's
    # rows: one file's disk wait overlaps the other's decoding.
    beside = (ThreadPoolExecutor(max_workers=depth, thread_name_prefix="gradlog-scan-extra")
              if depth and extra_read is not None else None)

    def emit(i0: int, i1: int) -> Block:
        if beside is None:
            data = reader.read(rows[i0:i1])
            return Block(slice(i0, i1), data,
                         extra_read(i0, i1) if extra_read is not None else None)
        assert extra_read is not None  # (beside exists only with it)
        companion = beside.submit(extra_read, i0, i1)
        try:
            data = reader.read(rows[i0:i1])
        except BaseException:
            companion.cancel()  # (one already running ends before the scan returns)
            raise
        return Block(slice(i0, i1), data, companion.result())

    if depth == 0:
        for i0, i1 in plan:
            block = emit(i0, i1)
            if on_read is not None:
                on_read(block.nbytes)
            yield block
            block.release()
        return

    from collections import deque

    pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="gradlog-scan")
    pending: deque[Future[Block]] = deque(pool.submit(emit, *r) for r in plan[:depth])
    try:
        for k in range(len(plan)):
            block = pending.popleft().result()
            if k + depth < len(plan):
                pending.append(pool.submit(emit, *plan[k + depth]))
            if on_read is not None:
                on_read(block.nbytes)
            yield block
            block.release()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)  # never leave a read running behind the caller
        if beside is not None:
            beside.shutdown(wait=True)


def block_plan(
    reader: ArrayReader,
    rows: np.ndarray,
    *,
    budget: int,
    keys: np.ndarray | None = None,
    per_row_bytes: int = 0,
    extra_cost: Callable[[int, int], int] | None = None,
    what: str = "",
    prefetch: bool = True,
) -> tuple[list[tuple[int, int]], int]:
    """The blocks :func:`blocks` reads, as position ranges ``[i0, i1)``, and how many of
    them it reads ahead. Scans on Dask (:mod:`gradlog.analysis.tasks`) make one task per
    block of this plan, so each task does exactly the arithmetic of the local scan.

    Raises:
        MemoryTooSmallError: ``budget`` cannot hold the smallest possible block.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return [], 0
    depth = _PREFETCH if prefetch else 0  # blocks read ahead, each on its own thread
    plan: list[tuple[int, int]] | None = None
    while depth > 0:  # each block in flight, and the caller's, gets an equal share
        try:
            plan = _plan(reader, rows, budget // (depth + 1), keys, per_row_bytes, extra_cost, what)
        except MemoryTooSmallError:
            plan = None
        if plan is not None and len(plan) > 1:
            break
        plan, depth = None, depth - 1
    if plan is None:
        depth = 0
        plan = _plan(reader, rows, budget, keys, per_row_bytes, extra_cost, what)
    return plan, depth


def _plan(
    reader: ArrayReader,
    rows: np.ndarray,
    budget: int,
    keys: np.ndarray | None,
    per_row_bytes: int,
    extra_cost: Callable[[int, int], int] | None,
    what: str,
) -> list[tuple[int, int]]:
    """Position ranges ``[i0, i1)`` of the blocks: whole runs of keys, as many as fit."""
    n = rows.size
    bounds = _boundaries(keys if keys is not None else np.zeros(n, dtype=np.int64))

    def cost(i0: int, i1: int) -> int:
        extra_bytes = extra_cost(i0, i1) if extra_cost is not None else 0
        return reader.read_cost(rows[i0:i1]) + (i1 - i0) * per_row_bytes + extra_bytes

    def largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
        """Largest k in [lo, hi] with fits(k), given fits(lo) (binary search)."""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    plan: list[tuple[int, int]] = []
    b, n_runs = 0, bounds.size - 1  # runs of equal keys: [bounds[b], bounds[b + 1])
    while b < n_runs:
        i0 = int(bounds[b])
        if cost(i0, int(bounds[b + 1])) <= budget:  # whole runs, as many as fit
            e = largest(b + 1, n_runs, functools.partial(_fits, cost, i0, bounds, budget))
            plan.append((i0, int(bounds[e])))
            b = e
            continue
        j, i1 = i0, int(bounds[b + 1])  # one run (a step) alone is over the budget: by rows
        while j < i1:
            if cost(j, j + 1) > budget:
                need = cost(j, j + 1)
                raise MemoryTooSmallError(
                    f"max_memory={budget} bytes is too small to read {what or 'this array'}: "
                    f"one row there is {reader.row_bytes} bytes, stored in chunks of "
                    f"{reader.chunk_rows} rows, and reading it needs about {need} bytes. Pass "
                    f"max_memory >= {need}."
                )
            k = largest(j + 1, i1, functools.partial(_fits, cost, j, None, budget))
            plan.append((j, k))
            j = k
        b += 1
    return plan


def least_budget(
    reader: ArrayReader,
    rows: np.ndarray,
    *,
    per_row_bytes: int = 0,
    extra_cost: Callable[[int, int], int] | None = None,
) -> int:
    """The least ``budget`` a scan of ``rows`` (as :func:`blocks` takes them) runs in: what its
    smallest block, one row, holds. That is the same for every row (one row touches one chunk
    of each array), so the first row's is every row's; 0 for no rows."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return 0
    extra = extra_cost(0, 1) if extra_cost is not None else 0
    return int(reader.read_cost(rows[:1]) + per_row_bytes + extra)


def require_memory(
    max_memory: int, what: str, needs: Sequence[tuple[str, ArrayReader, int]]
) -> None:
    """Refuse ``max_memory`` below what an analysis needs, before it starts.

    Analyses give their scans a share of ``max_memory`` (similarity half to each side) or
    less what they hold beside them (movers' change vector), so :func:`blocks`' own error
    would quote that share. They check here first, with ``needs``: per scan, the parameter,
    its reader and the ``max_memory`` that scan needs (its :func:`least_budget` mapped back).

    Raises:
        MemoryTooSmallError: naming ``max_memory`` as the caller passed it and the least one
            with which every scan of the analysis fits.
    """
    if not needs:
        return
    name, r, need = max(needs, key=lambda n: n[2])
    if max_memory < need:
        raise MemoryTooSmallError(
            f"max_memory={max_memory} bytes is too small for {what}: one row of {name} is "
            f"{r.row_bytes} bytes, stored in chunks of {r.chunk_rows} rows, and {what} needs "
            f"about {need} bytes to read it. Pass max_memory >= {need}."
        )


def _fits(
    cost: Callable[[int, int], int], i0: int, bounds: np.ndarray | None, budget: int, k: int
) -> bool:
    """Whether positions ``[i0, end)`` fit, with ``end = bounds[k]`` (or ``k``)."""
    return cost(i0, int(bounds[k]) if bounds is not None else k) <= budget


def progress_bar(enabled: bool, total: int | None, desc: str) -> Any:
    """A tqdm bar over bytes (a no-op object when disabled)."""
    from tqdm.auto import tqdm  # ~0.3 s to import: not for `gradlog info`

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not enabled,
        leave=False,
    )
