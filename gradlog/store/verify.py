"""``gradlog verify RUN``: check a store from end to end, reading every byte of its records.

:func:`verify` runs eight checks and reports every problem it finds (it does not stop at the
first):

- **root**: the root ``zarr.json`` parses, names a gradlog store of a known version, its
  ``config_hash`` is the hash of its ``config``, and every parameter's array path is the one
  FORMAT.md section 3 gives;
- **commit log**: every steps part (``steps/``, the commit markers) is readable, named after
  its one step, and holds one row;
- **index**: every committed step has its index parts (micro-batches ``0 .. n_micro-1``), its
  rows are where the steps part says, rows are unique, numbers finite, weights positive;
- **arrays**: every parameter with records has an array of the right dtype, shape and layout
  that covers every committed row;
- **checksums**: every chunk holding a committed record is read and its crc32c verified (and,
  in version 2, the shard index's), so damage anywhere is found, and each ``full`` record's
  norm is compared with the index's exact one, so a shard holding other rows is found too;
- **schemas**: root attributes and every committed index and steps row against the JSON
  Schemas (with ``jsonschema`` when installed; otherwise the structural checks above);
- **probes** (FORMAT.md section 11; "no probes" for a store without them): the probes group
  lists distinct probe ids, every probe part of a committed step is readable, named after its
  step and holds one row per probe in ``probe_ids`` order with finite losses and norms, the
  committed probe rows are ``0 .. n-1`` (a gap is a lost part; a committed step may have no
  probe part), and every probe array covers them with every chunk holding one read and its
  crc32c verified;
- **optimizer** (FORMAT.md section 14): every optimizer state file of a committed step reads
  whole (zip crc32), its metadata names recorded parameters, and each ``adam``
  preconditioner has the parameter's length and finite entries >= 0.

Uncommitted leftovers of a crash (index and probe parts of steps that never committed,
temporaries) are reported as notes, not problems: readers ignore them and ``resume=True``
discards them; so is a writer lease left in the store (first: recording, or killed).
Nothing is written and nothing from the store is executed. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradlog.errors import GradlogError
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.arrays import GradArray
from gradlog.store.dtypes import StorageDtype, norms_disagree
from gradlog.store.fs import StorePath
from gradlog.store.lease import writer_note
from gradlog.store.optimizer import verify_optimizer_state
from gradlog.store.probes import (
    PROBE_INDEX_DIR,
    PROBES_GROUP,
    ProbeArray,
    parse_probe_part_name,
    probe_array_path,
    probe_index_schema,
    read_probe_ids,
)
from gradlog.store.reader import StoreReader
from gradlog.store.schema import violation

__all__ = ["Check", "Report", "verify"]


@dataclass
class Check:
    """One check of :func:`verify`."""

    name: str
    problems: list[str] = field(default_factory=list)
    summary: str = ""
    skipped: str = ""

    @property
    def ok(self) -> bool:
        """True when the check found nothing wrong (a skipped check is not ok)."""
        return not self.problems and not self.skipped


@dataclass
class Report:
    """What :func:`verify` found."""

    path: StorePath
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every check holds: the store is intact."""
        return bool(self.checks) and all(c.ok for c in self.checks)

    def check(self, name: str) -> Check:
        """The check called ``name``."""
        return next(c for c in self.checks if c.name == name)


def verify(path: str | os.PathLike[str] | StorePath, *, max_problems: int = 50) -> Report:
    """Check the store at ``path``; see the module docstring for what is checked.

    Args:
        path: The store's directory.
        max_problems: Problems listed per check, at most (the count is always given).

    Returns:
        The :class:`Report`; ``report.ok`` says whether the store is intact.
    """
    root = sfs.store_path(path)
    report = Report(root)
    check = Check("root")
    report.checks.append(check)
    try:
        run = StoreReader(root, cross_check=False)  # the checks below report each problem
    except GradlogError as e:
        check.problems.append(str(e))
        for name in ("commit log", "index", "arrays", "checksums", "schemas", "probes",
                     "optimizer"):
            report.checks.append(Check(name, skipped="the store does not open"))
        return report
    attrs = run.attrs
    _check_root(attrs, check)
    check.summary = (
        f"format version {run.format_version}, {len(attrs['params'])} parameters, "
        f"config_hash {str(attrs.get('config_hash', ''))[:12]}..."
    )
    steps, step_rows = _check_commit_log(root, report)
    records = _check_index(root, attrs, steps, report)
    arrays = _check_arrays(run, records, report)
    _check_checksums(run, arrays, records, report)
    _check_schemas(attrs, step_rows, records, report)
    _check_probes(run, steps, report)
    check = Check("optimizer")
    report.checks.append(check)
    problems, notes, check.summary = verify_optimizer_state(root, set(steps), attrs["params"])
    check.problems += problems
    report.notes += notes
    if (writer := writer_note(root)) is not None:  # a fact, not damage: never a FAIL
        report.notes.insert(0, f"writer: {writer.text}")
    for c in report.checks:
        if len(c.problems) > max_problems:
            extra = len(c.problems) - max_problems
            c.problems[max_problems:] = [f"... and {extra} more problems"]
    return report


# -- root -----------------------------------------------------------------------------------
def _check_root(attrs: dict[str, Any], check: Check) -> None:
    config = attrs.get("config")
    if not isinstance(config, dict):
        check.problems.append("root attribute 'config' is missing or not an object.")
        return
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    expected = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    if attrs.get("config_hash") != expected:
        check.problems.append(
            f"config_hash {attrs.get('config_hash')!r} is not the sha256 of the canonical JSON "
            f"of config ({expected}): the configuration was edited after recording."
        )
    for name, spec in attrs["params"].items():
        numel = math.prod(spec["shape"])
        if spec.get("numel") != numel:
            check.problems.append(f"parameter {name!r}: numel {spec.get('numel')} != {numel}.")


# -- commit log -------------------------------------------------------------------------------
def _check_commit_log(
    root: StorePath, report: Report
) -> tuple[dict[int, dict[str, Any]], list[Any]]:

    check = Check("commit log")
    report.checks.append(check)
    directory = root / fmt.STEPS_DIR
    steps: dict[int, dict[str, Any]] = {}
    rows: list[Any] = []
    if not directory.is_dir() and not sfs.is_object(root):  # object stores: no empty dirs
        check.problems.append(f"{directory} is missing: the store has no commit log.")
        return steps, rows
    parts = _parts(
        root, fmt.STEPS_DIR, "a steps part", _steps_part, fmt.steps_schema(), check, report,
        temporary="an interrupted commit",
    )
    for entry, step, table in parts:
        if table.num_rows != 1:
            check.problems.append(f"{fmt.STEPS_DIR}/{entry} holds {table.num_rows} rows, not 1.")
            continue
        row = table.to_pylist()[0]
        if row["step"] != step:
            check.problems.append(
                f"{fmt.STEPS_DIR}/{entry} holds step {row['step']}, its name says {step}."
            )
            continue
        steps[row["step"]] = row
        rows.append(row)
    check.summary = f"{len(steps)} committed steps" + (
        f" ({min(steps)}..{max(steps)})" if steps else ""
    )
    return steps, rows


# -- index ------------------------------------------------------------------------------------
def _check_index(
    root: StorePath, attrs: dict[str, Any], steps: dict[int, dict[str, Any]], report: Report
) -> list[dict[str, Any]]:

    check = Check("index")
    report.checks.append(check)
    directory = root / fmt.INDEX_DIR
    schema = fmt.index_schema(list(attrs["params"]))
    parts: dict[tuple[int, int], list[dict[str, Any]]] = {}
    if not directory.is_dir() and not sfs.is_object(root):
        check.problems.append(f"{directory} is missing.")
        return []
    for entry, (step, micro), table in _parts(
        root, fmt.INDEX_DIR, "an index part", _index_part, schema, check, report, steps
    ):
        rows = table.to_pylist()
        keys = {(r["step"], r["micro"]) for r in rows}
        if keys != {(step, micro)}:
            check.problems.append(
                f"{fmt.INDEX_DIR}/{entry} holds (step, micro) {sorted(keys)}, its name says "
                f"{(step, micro)}."
            )
            continue
        parts[(step, micro)] = rows
    records: list[dict[str, Any]] = []
    version = attrs["format_version"]
    for step, row in sorted(steps.items()):
        mine: list[dict[str, Any]] = []
        for micro in range(row["n_micro"]):
            if (step, micro) not in parts:
                check.problems.append(
                    f"committed step {step} misses its index part for micro-batch {micro}."
                )
                continue
            call = parts[(step, micro)]
            got = [r["row"] for r in call]
            if got != list(range(got[0], got[0] + len(got))):
                check.problems.append(
                    f"step {step} micro-batch {micro}: rows {got[:6]}... are not consecutive."
                )
            mine += call
        extra = sorted(m for s, m in parts if s == step and m >= row["n_micro"])
        if extra:
            check.problems.append(
                f"step {step} has index parts of micro-batches {extra} beyond its n_micro "
                f"{row['n_micro']}."
            )
        rows_of_step = sorted(r["row"] for r in mine)
        if len(mine) != row["n_records"] or (rows_of_step and rows_of_step[0] != row["first_row"]):
            check.problems.append(
                f"step {step}: the steps part says {row['n_records']} records from row "
                f"{row['first_row']}, its index parts hold {len(mine)} from "
                f"{rows_of_step[0] if rows_of_step else None}."
            )
        if version == 1 and rows_of_step != list(
            range(row["first_row"], row["first_row"] + len(rows_of_step))
        ):
            check.problems.append(f"step {step}: rows are not consecutive (format version 1).")
        if mine:
            mean = float(np.mean([r["loss"] for r in mine]))
            if not math.isclose(row["loss_mean"], mean, rel_tol=1e-9, abs_tol=1e-12):
                check.problems.append(
                    f"step {step}: loss_mean {row['loss_mean']} != the mean of its records' "
                    f"losses {mean}."
                )
        records += mine
    seen: set[int] = set()
    norm_columns = [fmt.norm_column(n) for n in attrs["params"]]
    for r in records:
        where = f"record (step {r['step']}, datum {r['datum_id']}, row {r['row']})"
        if r["row"] in seen:
            check.problems.append(f"{where}: row {r['row']} is used twice.")
        seen.add(r["row"])
        if r["row"] < 0 or r["datum_id"] < 0 or r["micro"] < 0:
            check.problems.append(f"{where}: a negative row, datum id or micro-batch.")
        if not (math.isfinite(r["weight"]) and r["weight"] > 0):
            check.problems.append(f"{where}: weight {r['weight']} is not a positive number.")
        values = [r["loss"]]
        if r["lr"] is not None:
            values.append(r["lr"])
        if not all(math.isfinite(v) for v in values):
            check.problems.append(f"{where}: a non-finite loss or lr.")
        flagged = [c.removeprefix("norm/") for c in norm_columns if not math.isfinite(r[c])]
        if flagged:  # recorded so, with a warning (FORMAT.md section 7): a fact, not damage
            report.notes.append(f"{where}: non-finite gradient of {flagged} (flagged).")
        if any(r[c] < 0 for c in norm_columns):
            check.problems.append(f"{where}: a negative norm.")
    check.summary = f"{len(records)} committed records in {len(parts)} index parts"
    return sorted(records, key=lambda r: r["row"])


def _nulls(table: Any) -> list[str]:
    """Non-nullable columns holding nulls: columns a part lacks read as nulls."""
    return [f.name for f in table.schema if not f.nullable and table.column(f.name).null_count]


def _steps_part(entry: str) -> tuple[int, int] | None:
    """``(step, step)`` of a steps part's name, else None."""
    parsed = fmt.parse_part_name(entry)
    return None if parsed is None or parsed[1] is not None else (parsed[0], parsed[0])


def _index_part(entry: str) -> tuple[int, tuple[int, int]] | None:
    """``(step, (step, micro))`` of an index part's name, else None."""
    parsed = fmt.parse_part_name(entry)
    if parsed is None or parsed[1] is None:
        return None
    return parsed[0], (parsed[0], int(parsed[1]))


def _probe_part(entry: str) -> tuple[int, int] | None:
    """``(step, step)`` of a probe part's name, else None."""
    step = parse_probe_part_name(entry)
    return None if step is None else (step, step)


def _parts(
    root: StorePath,
    sub: str,
    kind: str,
    parse: Callable[[str], tuple[int, Any] | None],
    schema: Any,
    check: Check,
    report: Report,
    steps: dict[int, dict[str, Any]] | None = None,
    temporary: str = "an interrupted write",
) -> Iterator[tuple[str, Any, Any]]:
    """``(entry, key, table)`` of every readable part in ``root/sub`` whose name ``parse``
    takes (to ``(step, key)``) and, given ``steps``, of a committed step. Temporaries and
    uncommitted parts are noted; bad names, unreadable parts and missing columns are
    problems of ``check``."""
    directory = root / sub
    entries = sorted(sfs.listdir(directory)) if directory.is_dir() or sfs.is_object(root) else []
    for entry in entries:
        where = f"{sub}/{entry}"
        if entry.startswith("."):
            report.notes.append(f"temporary {where} ({temporary})")
            continue
        parsed = parse(entry)
        if parsed is None:
            check.problems.append(f"{where} is not {kind} name.")
            continue
        if steps is not None and parsed[0] not in steps:
            report.notes.append(f"uncommitted {where} (ignored by readers)")
            continue
        try:
            table = sfs.read_parquet(directory / entry, schema=schema)
        except Exception as e:
            check.problems.append(f"{where} does not read: {e}")
            continue
        if _nulls(table):
            check.problems.append(f"{where} lacks column(s) {_nulls(table)}.")
            continue
        yield entry, parsed[1], table


# -- arrays and checksums -------------------------------------------------------------------
def _check_arrays(
    run: StoreReader, records: list[dict[str, Any]], report: Report
) -> dict[str, Any]:
    check = Check("arrays")
    report.checks.append(check)
    arrays: dict[str, Any] = {}
    max_row = max((r["row"] for r in records), default=-1)
    for name, spec in run.attrs["params"].items():
        # version 3: every array of the parameter's form (none for 'norm'); before: one
        entries = spec.get("arrays", {"grad": {"path": spec["array"]}})
        for key, entry in entries.items():
            if not (run.path / entry["path"] / "zarr.json").is_file() and not records:
                continue  # arrays come with the first records
            try:
                array = GradArray(run.path, name, spec, run.format_version, key)
            except GradlogError as e:
                check.problems.append(str(e))
                continue
            if array.n_rows <= max_row:
                check.problems.append(
                    f"array {entry['path']} declares {array.n_rows} rows; committed rows "
                    f"reach {max_row}."
                )
            arrays[entry["path"]] = array
    check.summary = f"{len(arrays)} arrays" + (
        f", {max_row + 1} rows" if records else ", no records yet"
    )
    return arrays


def _check_checksums(
    run: StoreReader, arrays: dict[str, Any], records: list[dict[str, Any]], report: Report
) -> None:
    check = Check("checksums")
    report.checks.append(check)
    rows = np.asarray([r["row"] for r in records], dtype=np.int64)
    n_files = n_bytes = 0
    for path, array in arrays.items():
        if rows.size == 0:
            break
        full = path == run.attrs["params"][array.name].get("arrays", {}).get(
            "grad", {"path": fmt.array_path(array.name)})["path"]  # the `full` form's array
        norms = np.asarray([r[fmt.norm_column(array.name)] for r in records], dtype=np.float64)
        per_file = array.rows_per_chunk()
        for chunk in np.unique(rows // per_file):
            at = rows // per_file == chunk
            mine = rows[at]
            try:
                values = array.read(mine)  # every committed row of this file, checksums verified
            except GradlogError as e:
                check.problems.append(str(e))
            else:
                if full:  # (file swaps pass their checksums)
                    _check_norms(values, norms[at], array.dtype,
                                 f"{array.where}, rows {mine[0]}..{mine[-1]}", check, report)
            file = array.directory / array.chunk_key(int(chunk))
            n_files += 1
            n_bytes += file.stat().st_size if file.is_file() else 0
    check.summary = (f"{n_files} chunk files read ({n_bytes / 2**20:.1f} MiB), crc32c "
                     "verified, full records' norms against the index")


def _check_norms(values: np.ndarray, norms: np.ndarray, dtype: StorageDtype, where: str,
                 check: Check, report: Report) -> None:
    """Stored full records against their exact norms in the index: a shard of other rows
    (files swapped or copied in from another store) passes its own checksum, not this."""
    bad, overflowed = norms_disagree(values, norms, dtype)
    if overflowed.any():
        report.notes.append(f"{where}: {int(overflowed.sum())} record(s) overflowed {dtype.name} "
                            "when recorded (stored as inf, as the recorder warned).")
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        got = float(np.linalg.norm(values[i].astype(np.float64)))
        check.problems.append(
            f"{where}: {int(bad.sum())} stored record(s) do not have the norm the index gives "
            f"them (first: {got:.6g} stored, {norms[i]:.6g} in the index): the shard holds "
            "other records than its rows' (files swapped or copied in from another store?)."
        )


# -- schemas ----------------------------------------------------------------------------------
def _check_schemas(
    attrs: dict[str, Any],
    step_rows: list[dict[str, Any]],
    records: list[dict[str, Any]],
    report: Report,
) -> None:
    check = Check("schemas")
    report.checks.append(check)
    try:
        import jsonschema  # noqa: F401  (optional: the checks below validate with it)
    except ImportError:
        _structural_root_checks(attrs, check)
        check.summary = (
            "structural checks only (pip install jsonschema for validation against "
            "schemas/*.schema.json)"
        )
        return
    items = [("root", attrs, "root attributes")]
    items += [("steps", r, f"steps row of step {r['step']}") for r in step_rows]
    items += [("index", r, f"index row {r['row']}") for r in records]
    for name, instance, where in items:
        broken = violation(name, instance)
        if broken is not None:
            check.problems.append(f"{where} {broken}")
    check.summary = f"{len(items)} objects valid against schemas/*.schema.json"


# -- probes -----------------------------------------------------------------------------------
def _check_probes(run: StoreReader, steps: dict[int, dict[str, Any]], report: Report) -> None:
    check = Check("probes")
    report.checks.append(check)
    root = run.path
    group = root / PROBES_GROUP
    if not group.is_dir() and not (group / "zarr.json").is_file():
        check.summary = "no probes"
        return
    ids: list[int] | None = None
    try:
        ids = read_probe_ids(root)
    except GradlogError as e:
        check.problems.append(str(e))
    if ids is None and not check.problems:
        check.problems.append(
            f"{PROBES_GROUP}/zarr.json is missing: the store has probe data but not the group "
            "that lists their probe_ids (FORMAT.md section 11)."
        )
    elif ids is not None and not ids:
        check.problems.append(f"{PROBES_GROUP}/zarr.json lists no probe id; it needs one.")
    params = list(run.attrs["params"])
    schema = probe_index_schema(params)
    norm_columns = [fmt.norm_column(n) for n in params]
    parts: dict[int, list[dict[str, Any]]] = {}
    for entry, step, table in _parts(
        root, PROBE_INDEX_DIR, "a probe part", _probe_part, schema, check, report, steps
    ):
        where = f"{PROBE_INDEX_DIR}/{entry}"
        records = table.to_pylist()
        held = sorted({r["step"] for r in records})
        if held != [step]:
            check.problems.append(f"{where} holds steps {held}, its name says {step}.")
            continue
        got = [r["probe_id"] for r in records]
        if ids is not None and got != ids:
            check.problems.append(
                f"{where} holds probe ids {got[:10]}, not probe_ids {ids[:10]} in order (one row "
                "per probe)."
            )
        numbers = [r["row"] for r in records]
        if numbers and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
            check.problems.append(f"{where}: rows {numbers[:6]}... are not consecutive.")
        for r in records:
            values = [r["loss"], *(r[c] for c in norm_columns)]
            if not all(math.isfinite(v) for v in values) or any(r[c] < 0 for c in norm_columns):
                check.problems.append(
                    f"probe {r['probe_id']} at step {step}: a non-finite loss or a negative or "
                    "non-finite norm."
                )
        parts[step] = records
    # Rows are assigned consecutively from 0 in write order, and a resumed run continues after
    # the committed ones: committed probe rows are 0 .. n-1 in step order. A step without a
    # probe part holds none, so a gap means a part was lost.
    in_order = np.asarray([r["row"] for s in sorted(parts) for r in parts[s]], dtype=np.int64)
    rows, counts = np.unique(in_order, return_counts=True)
    if (counts > 1).any():
        check.problems.append(f"probe rows {rows[counts > 1][:8].tolist()} are used twice.")
    elif (np.diff(in_order) < 0).any():
        check.problems.append("probe rows do not follow the order of the steps.")
    max_row = int(rows[-1]) if rows.size else -1
    lost = np.setdiff1d(np.arange(max_row + 1), rows)
    if lost.size:
        check.problems.append(
            f"probe rows {lost[:8].tolist()} are in no committed probe part: a probe part was "
            "lost (probe rows are assigned consecutively from 0, FORMAT.md section 11)."
        )
    n_chunks = 0
    for name, spec in run.attrs["params"].items():
        if not rows.size:
            break  # no probe records: the arrays may not exist yet
        norms = np.full(max_row + 1, np.nan)  # (the witness of all-zero chunks left unwritten)
        norms[in_order] = [r[fmt.norm_column(name)] for s in sorted(parts) for r in parts[s]]
        try:
            array = ProbeArray(root, name, spec, norms)
        except GradlogError as e:
            check.problems.append(str(e))
            continue
        path = probe_array_path(name)
        declared = int(array.array.shape[0])
        if declared <= max_row:
            check.problems.append(
                f"probe array {path} declares {declared} rows; committed probe rows reach "
                f"{max_row}."
            )
            continue
        codecs = getattr(array.array.metadata, "codecs", ())  # v3 metadata has codecs
        if not codecs or type(codecs[-1]).__name__ != "Crc32cCodec":
            check.problems.append(
                f"probe array {path}: its codecs do not end with crc32c, so its chunks carry no "
                "checksum (FORMAT.md section 11)."
            )
        per_chunk = array.chunk_rows
        for chunk in np.unique(rows // per_chunk):
            try:
                array.read(rows[rows // per_chunk == chunk])  # checksums verified
            except GradlogError as e:  # (a missing chunk of zero norms is read as zeros)
                check.problems.append(str(e))
            n_chunks += len(array.chunk_keys(int(chunk)))
    n_probes = len(ids) if ids is not None else "?"
    check.summary = (
        f"{in_order.size} probe records of {len(parts)} steps ({n_probes} probes), "
        f"{n_chunks} chunks read, crc32c verified"
    )


_ROOT_KEYS = {
    "format": str,
    "format_version": int,
    "gradlog_version": str,
    "torch_version": str,
    "created": str,
    "model": dict,
    "config": dict,
    "config_hash": str,
    "backend": dict,
    "params": dict,
}


def _structural_root_checks(attrs: dict[str, Any], check: Check) -> None:
    for key, kind in _ROOT_KEYS.items():
        if not isinstance(attrs.get(key), kind):
            check.problems.append(f"root attribute {key!r} is missing or not a {kind.__name__}.")
    if "run_id" in attrs and not isinstance(attrs["run_id"], str):
        check.problems.append("root attribute 'run_id' is not a str.")
    unknown = sorted(set(attrs) - set(_ROOT_KEYS) - {"run_id"})  # (run_id: optional)
    if unknown:
        check.problems.append(f"unknown root attributes {unknown}.")
