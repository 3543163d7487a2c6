"""The commit protocol: what makes a step visible to readers (FORMAT.md, "Commit").

A step is committed by its **steps part** ``steps/step-S.parquet`` (the commit log), written
after every shard and index part of the step. Readers see only committed steps, so a crash
leaves a consistent prefix. With ``durable`` the step's files are synced to disk before its
steps part is written; the steps part itself becomes durable with the next sync (or the one
at close): a power loss can only lose it, leaving its step uncommitted, never half there.

Under torch.distributed (:mod:`gradlog.store.ranks`) a rank ``r > 0`` writes its rank part
instead, and rank 0 writes the steps part once every rank's part is there.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gradlog.store import format as fmt
from gradlog.store.durability import Files
from gradlog.store.fs import StorePath
from gradlog.store.lease import Lease
from gradlog.store.ranks import merge_rows, rank_part, wait_for_ranks

__all__ = ["CommitLog"]


class CommitLog:
    """Tracks what a writer wrote since its last commit, and commits steps.

    The writer thread notes each file it writes (:meth:`wrote`) and the seconds it spent
    (:attr:`write_seconds`); at a step's end, :meth:`take` hands them to :meth:`commit`, which
    runs on the writer thread or, with ``durable``, on a second thread so that syncing one step
    overlaps writing the next.

    Args:
        root: The store.
        files: The file operations (:class:`~gradlog.store.durability.Files`).
        durable: Sync a step's files before writing its commit marker.
        rank, world_size: This writer's rank among ``world_size`` (rank 0 commits).
        rank_timeout_s: How long rank 0 waits for the other ranks' parts of a step.
        last_committed: The last step committed before this writer started (resume).
        lease: The writer's lease (rank 0): verified, and renewed when due, before each
            commit marker is written (:mod:`gradlog.store.lease`); None on other ranks.
    """

    def __init__(
        self,
        root: StorePath,
        files: Files,
        *,
        durable: bool,
        rank: int,
        world_size: int,
        rank_timeout_s: float,
        last_committed: int | None,
        lease: Lease | None = None,
    ) -> None:
        self.root = root
        self.files = files
        self.durable = durable
        self.rank = rank
        self.world_size = world_size
        self.rank_timeout_s = rank_timeout_s
        self.last_committed = last_committed  # the last step whose marker was written
        self.lease = lease
        self._schema = fmt.steps_schema()
        self.write_seconds = 0.0  # writer-thread time of the step being written
        self._unsynced: set[StorePath] = set()  # written since the last sync (fsync fallback)
        self._unsynced_markers: list[StorePath] = []  # commit markers not yet synced

    def wrote(self, path: StorePath) -> None:
        """Note a file written for the step in progress (synced before its commit)."""
        self._unsynced.add(path)

    def take(self) -> tuple[set[StorePath], float]:
        """The files written and the writer's seconds since the last :meth:`take`."""
        written, self._unsynced = self._unsynced, set()
        seconds, self.write_seconds = self.write_seconds, 0.0
        return written, seconds

    def commit(self, row: Mapping[str, Any], written: set[StorePath], seconds: float) -> None:
        """Commit the step of ``row`` (its steps row): sync ``written`` (with ``durable``),
        then write the commit marker (a rank part on ranks > 0). ``time_write_s`` becomes
        ``seconds`` plus the sync's."""
        import pyarrow as pa

        row = dict(row)
        step = int(row["step"])
        t0 = time.perf_counter()
        if self.durable:  # the step's data reach the disk before its commit marker exists
            self.files.sync(self.root, written)
        row["time_write_s"] = seconds + time.perf_counter() - t0
        if self.rank > 0:  # this rank's share; rank 0 commits the step
            marker = rank_part(self.root, step, self.rank)
        else:
            marker = self.root / fmt.STEPS_DIR / fmt.step_part_name(step)
            if self.world_size > 1:
                others = wait_for_ranks(self.root, step, self.world_size, self.rank_timeout_s)
                row.update(merge_rows(row, others))
            if self.lease is not None:  # a writer that lost its lease never commits
                self.lease.check(f"the commit of step {step}")
        self.files.write_parquet(pa.Table.from_pylist([row], schema=self._schema), marker)
        self._unsynced_markers.append(marker)
        self.last_committed = step

    def sync_all(self) -> None:
        """Sync whatever is unsynced: the last commit markers, metadata written at close."""
        if self.durable:
            self.files.sync(self.root, {*self._unsynced, *self._unsynced_markers})
            self._unsynced.clear()
            self._unsynced_markers.clear()
