"""Commits of a step recorded by several ranks (torch.distributed) into one store.

Every rank writes its own records (rows and index parts) and, once they are written (and
synced, with ``durable``), its **rank part** ``ranks/step-S-R.parquet``: the step's summary
row over that rank's records only. Rank 0 waits until the parts of ranks ``1 .. W-1`` are
there, merges them with its own summary, and writes the ordinary steps part, which commits
the step for every reader (FORMAT.md, "Distributed recording"). Readers never look at
``ranks/``. Rank 0 waits by listing ``ranks/``: object stores list what was PUT before (S3
since 2020) and local file systems always did, so no message passes between the writers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gradlog.errors import StoreWriteError
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.fs import StorePath

__all__ = ["RANKS_DIR", "merge_rows", "rank_part", "wait_for_ranks"]

RANKS_DIR = "ranks"


def rank_part(root: StorePath, step: int, rank: int) -> StorePath:
    """Where rank ``rank`` writes its summary of step ``step``."""
    return root / RANKS_DIR / fmt.index_part_name(step, rank)


def wait_for_ranks(
    root: StorePath, step: int, world_size: int, timeout_s: float
) -> list[dict[str, Any]]:
    """The rank parts of ranks ``1 .. world_size-1`` for ``step``, once all are written.

    Raises:
        StoreWriteError: some are still missing after ``timeout_s`` seconds (a rank crashed
            or stopped recording); the step stays uncommitted.
    """
    wanted = {fmt.index_part_name(step, r): r for r in range(1, world_size)}
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        present = set(sfs.listdir(root / RANKS_DIR)) & set(wanted)
        if len(present) == len(wanted):
            break
        if time.monotonic() > deadline:
            missing = sorted(wanted[name] for name in set(wanted) - present)
            raise StoreWriteError(
                f"rank(s) {missing} did not finish step {step} within {timeout_s:.0f} s (no "
                f"{RANKS_DIR}/ part): a rank crashed or left the run. Step {step} is not "
                "committed; earlier steps are intact. Restart every rank with resume=True."
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    schema = fmt.steps_schema()
    rows = []
    for name in sorted(wanted):
        table = sfs.read_parquet(root / RANKS_DIR / name, schema=schema)
        rows.append(table.to_pylist()[0])
    return rows


def merge_rows(own: Mapping[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps row of a step from its ranks' rows (``own``: rank 0's)."""
    rows = [dict(own), *others]
    n = sum(int(r["n_records"]) for r in rows)
    return {
        "step": int(own["step"]),
        "first_row": min(int(r["first_row"]) for r in rows),
        "n_records": n,
        "n_micro": sum(int(r["n_micro"]) for r in rows),
        "tokens": sum(int(r["tokens"]) for r in rows),
        "lr": own.get("lr"),
        "loss_mean": sum(float(r["loss_mean"]) * int(r["n_records"]) for r in rows) / max(1, n),
        # wall time: the ranks ran side by side
        "time_compute_s": max(float(r["time_compute_s"]) for r in rows),
        "time_write_s": max(float(r["time_write_s"]) for r in rows),
    }
