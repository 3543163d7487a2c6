"""The index checked against the steps table: a committed step is never read as having no
records (FORMAT.md section 8).

The steps table commits steps; the index holds their records, one part per backward call. A
part deleted or cut short after the commit (a damaged copy, a stray ``rm``) would otherwise
read as a step with fewer records, or none: ``run.grads(step=...)`` empty, influence
silently skipping the step. The reader checks the part names when a store is opened and
refreshed (a LIST of ``index/``), and each step's record count when it reads the index.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradlog.errors import StoreCorruptError
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.fs import StorePath

__all__ = ["check_index_parts", "check_record_counts"]


def check_index_parts(path: StorePath, steps: Any) -> None:
    """Every step of ``steps`` (the steps table) has its index parts ``0 .. n_micro-1``.

    Raises:
        StoreCorruptError: naming the first missing part and how many more are missing.
    """
    if not steps.num_rows:
        return
    present = set()
    directory = path / fmt.INDEX_DIR
    if directory.is_dir() or sfs.is_object(path):
        for entry in sfs.listdir(directory):
            parsed = fmt.parse_part_name(entry)
            if parsed is not None:
                present.add((parsed[0], parsed[1] or 0))
    missing = [
        fmt.index_part_name(int(s), m)
        for s, n in zip(steps.column("step").to_pylist(), steps.column("n_micro").to_pylist())
        for m in range(int(n))
        if (int(s), m) not in present
    ]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise StoreCorruptError(
            f"{path}: the index part {fmt.INDEX_DIR}/{missing[0]}{more} of committed steps "
            "are missing: their records cannot be read. The store was damaged (a deleted "
            "file); run `gradlog verify` on it, and restore it from a copy."
        )


def check_record_counts(path: StorePath, steps: Any, index: Any) -> None:
    """Each step of ``steps`` has exactly its ``n_records`` rows in ``index`` (the committed
    records): a short part, or one of another size in its place, is damage.

    Raises:
        StoreCorruptError: naming the step, its parts and both counts.
    """
    want = dict(zip(steps.column("step").to_pylist(), steps.column("n_records").to_pylist()))
    got_steps, counts = np.unique(np.asarray(index.column("step")), return_counts=True)
    got = dict(zip(got_steps.tolist(), counts.tolist()))
    bad = [(s, int(n), got.get(s, 0)) for s, n in want.items() if got.get(s, 0) != int(n)]
    if bad:
        step, n, found = bad[0]
        parts = fmt.index_part_name(step, 0).rsplit("-", 1)[0] + "-*.parquet"
        more = f" ({len(bad) - 1} more steps alike)" if len(bad) > 1 else ""
        raise StoreCorruptError(
            f"{path}: committed step {step} has {n} records in "
            f"{fmt.STEPS_DIR}/{fmt.step_part_name(step)} but {found} rows in its index "
            f"parts {fmt.INDEX_DIR}/{parts}{more}. The store was damaged (a truncated or "
            "replaced part); run `gradlog verify` on it."
        )
    # each record has a row of its own, and a step's rows begin at its first_row: an index
    # part rewritten to point at another step's rows would read that step's gradients
    rows = np.asarray(index.column("row"))
    if np.unique(rows).size != rows.size:
        values, counts = np.unique(rows, return_counts=True)
        raise StoreCorruptError(
            f"{path}: row {int(values[counts > 1][0])} belongs to several records of the "
            f"index parts {fmt.INDEX_DIR}/: the store was damaged (a rewritten or replaced "
            "part); run `gradlog verify` on it."
        )
    first = dict(zip(steps.column("step").to_pylist(), steps.column("first_row").to_pylist()))
    order = np.argsort(np.asarray(index.column("step")), kind="stable")
    by_step, starts = np.unique(np.asarray(index.column("step"))[order], return_index=True)
    lowest = np.minimum.reduceat(rows[order], starts) if starts.size else starts
    wrong = [(int(s), int(lo)) for s, lo in zip(by_step.tolist(), lowest.tolist())
             if s in first and lo != int(first[s])]
    if wrong:
        step, lo = wrong[0]
        raise StoreCorruptError(
            f"{path}: committed step {step} begins at row {first[step]} in "
            f"{fmt.STEPS_DIR}/{fmt.step_part_name(step)} but its index parts begin at row {lo}: "
            "the store was damaged (a rewritten or replaced part); run `gradlog verify` on it."
        )
