"""Conformance checks of a store against the format specification (``schemas/FORMAT.md``).

:func:`validate_store` validates what a reader sees (root attributes, every committed index
row and steps row) against the format's JSON Schemas (:mod:`gradlog.store.schema`, which also
serves ``gradlog verify``), and then checks the rules a JSON Schema cannot express (config
hash, array paths, array shapes, row ranges, part file names). jsonschema is a test-only
dependency: it is imported by the functions that need it, never at import time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from gradlog.store import format as fmt
from gradlog.store.dtypes import storage_dtype
from gradlog.store.reader import StoreReader
from gradlog.store.schema import SCHEMAS, load_schema, violation

__all__ = ["SCHEMAS", "load_schema", "validate_store"]

_INDEX_PART = re.compile(r"^step-\d{12,}-\d{6,}\.parquet$")
_STEPS_PART = re.compile(r"^step-\d{12,}\.parquet$")


def validate_store(path: str | os.PathLike[str]) -> None:
    """Validate the store at ``path`` against the format specification.

    Checks the root attributes, every committed index row and every steps row against the JSON
    Schemas, and: ``config_hash`` is the sha256 of the canonical JSON of ``config``; every
    parameter's ``array`` is ``array_path(name)`` and its ``numel`` the product of its shape;
    the ``norm/<param>`` columns are exactly one per parameter; numbers are finite; rows are
    unique and each step's records fill ``first_row .. first_row + n_records - 1`` with micro
    numbers ``0 .. n_micro - 1``; every array exists when the run has records, with the spec's
    dtype, trailing shape, dimension names and a final ``crc32c`` codec, and is longer than
    every committed row; every part file is named after the step (and micro) it holds.

    Raises:
        jsonschema.ValidationError: the first violation found, with where it is.
        gradlog.errors.GradlogError: the store cannot be opened at all.
    """
    run = StoreReader(path)
    root = Path(path)
    attrs = run.attrs
    _check_schema("root", attrs, f"{root}/zarr.json attributes")
    _check_root_rules(attrs, root)

    records = run.datums.to_pylist()
    for record in records:
        _check_schema("index", record, f"{root} index row {record.get('row')}")
    steps = run.steps.to_pylist()
    for step_row in steps:
        _check_schema("steps", step_row, f"{root} steps row of step {step_row.get('step')}")
    _check_tables(attrs, records, steps, root, run.sharded)
    _check_arrays(attrs, records, root, run.sharded)
    if run.sharded:
        _check_sharded_rows(attrs, records, root)
    _check_part_files(root)


# -- helpers ---------------------------------------------------------------------------------
def _fail(message: str) -> NoReturn:
    from jsonschema import ValidationError

    raise ValidationError(message)


def _check_schema(name: str, instance: Any, where: str) -> None:
    broken = violation(name, instance)
    if broken is not None:
        _fail(f"{where}: {broken}")


def _check_root_rules(attrs: dict[str, Any], root: Path) -> None:
    canonical = json.dumps(attrs["config"], sort_keys=True, separators=(",", ":"))
    expected = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    if attrs["config_hash"] != expected:
        _fail(
            f"{root}: config_hash {attrs['config_hash']} is not the sha256 of the canonical "
            f"JSON of config ({expected})."
        )
    for name, spec in attrs["params"].items():
        if spec["array"] != fmt.array_path(name):
            _fail(
                f"{root}: parameter {name!r} points at array {spec['array']!r}, expected "
                f"{fmt.array_path(name)!r}."
            )
        for key, entry in spec.get("arrays", {}).items():
            path = fmt.form_array_path(name, spec["form"], key)
            if entry["path"] != path:
                _fail(f"{root}: array {key!r} of {name!r} is at {entry['path']!r}, not {path!r}.")
        if "form_spec" in spec and spec["form_spec"]["shape"] != spec["shape"]:
            _fail(f"{root}: the form_spec of {name!r} has another shape than the parameter.")
        numel = math.prod(spec["shape"])
        if spec["numel"] != numel:
            _fail(f"{root}: parameter {name!r} has numel {spec['numel']}, its shape gives {numel}.")


def _check_tables(
    attrs: dict[str, Any],
    records: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    root: Path,
    sharded: bool,
) -> None:
    norm_columns = {fmt.norm_column(name) for name in attrs["params"]}
    for record in records:
        present = {k for k in record if k.startswith(fmt.NORM_PREFIX)}
        if present != norm_columns:
            _fail(
                f"{root}: index row {record['row']} has norm columns {sorted(present)}, "
                f"expected one per parameter: {sorted(norm_columns)}."
            )
        numbers = [record["loss"], record["weight"], record["lr"], *(record[c] for c in present)]
        if not all(v is None or math.isfinite(v) for v in numbers):
            _fail(f"{root}: index row {record['row']} holds a non-finite number: {record}.")
    rows = [r["row"] for r in records]
    if len(set(rows)) != len(rows):
        _fail(f"{root}: the committed index rows repeat a row number.")

    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    for row in steps:
        step = row["step"]
        mine = by_step.get(step, [])
        first, n = row["first_row"], row["n_records"]
        rows = sorted(r["row"] for r in mine)
        contiguous = rows == list(range(first, first + n))
        if not sharded and not contiguous:  # unsharded (version 1): a step's rows follow
            _fail(
                f"{root}: step {step} claims rows {first}..{first + n - 1}, its index rows are "
                f"{rows}."
            )
        if len(rows) != n or (rows and rows[0] != first):
            _fail(f"{root}: step {step} claims {n} rows from {first}, its index rows are {rows}.")
        micros = sorted({r["micro"] for r in mine})
        if micros != list(range(row["n_micro"])):
            _fail(f"{root}: step {step} has n_micro {row['n_micro']} but micro numbers {micros}.")
        loss_mean = float(np.mean([r["loss"] for r in mine]))
        if not math.isclose(row["loss_mean"], loss_mean, rel_tol=1e-9, abs_tol=1e-12):
            _fail(f"{root}: step {step} has loss_mean {row['loss_mean']}, its records {loss_mean}.")
        numbers = [row["lr"], row["loss_mean"], row["time_compute_s"], row["time_write_s"]]
        if not all(v is None or math.isfinite(v) for v in numbers):
            _fail(f"{root}: the steps row of step {step} holds a non-finite number: {row}.")


def _arrays_of(spec: dict[str, Any]) -> list[tuple[str, list[int], Any]]:
    """``(path, row shape, numpy dtype)`` of every array of a parameter: its form's
    (version 3) or its one gradient array."""
    if "arrays" not in spec:
        return [(spec["array"], spec["shape"], storage_dtype(spec["dtype"]).array_dtype)]
    return [
        (e["path"], e["shape"],
         np.dtype("int64") if e["kind"] == "int64" else storage_dtype(spec["dtype"]).array_dtype)
        for e in spec["arrays"].values()
    ]


def _check_arrays(
    attrs: dict[str, Any], records: list[dict[str, Any]], root: Path, sharded: bool
) -> None:
    max_row = max((r["row"] for r in records), default=-1)
    for name, spec in attrs["params"].items():
        for path, shape, dtype in _arrays_of(spec):
            _check_array(name, path, shape, dtype, bool(records), max_row, root, sharded)


def _check_array(name: str, path: str, shape: list[int], dtype: Any, has_records: bool,
                 max_row: int, root: Path, sharded: bool) -> None:
    import zarr

    meta_file = root / path / "zarr.json"
    if not meta_file.is_file():
        if has_records:
            _fail(f"{root}: parameter {name!r} has records but no array at {path}.")
        return  # arrays are created at the first append
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    arr = zarr.open_array(str(root / path), mode="r")
    where = f"{root}: array {path} of {name!r}"
    if list(arr.shape[1:]) != list(shape):
        _fail(f"{where} has shape {arr.shape}; expected (n_rows, *{shape}).")
    if arr.dtype != dtype:
        _fail(f"{where} has dtype {arr.dtype}; the spec says {dtype}.")
    if arr.shape[0] <= max_row:
        _fail(f"{where} has {arr.shape[0]} rows; committed rows reach {max_row}.")
    dims = ["record", *(f"dim_{i}" for i in range(len(shape)))]
    if meta.get("dimension_names") != dims:
        _fail(f"{where} has dimension_names {meta.get('dimension_names')}; expected {dims}.")
    codecs = [c.get("name") for c in meta.get("codecs", [])]
    if sharded:
        config = meta["codecs"][0].get("configuration", {}) if codecs else {}
        inner = [c.get("name") for c in config.get("codecs", [])]
        index = [c.get("name") for c in config.get("index_codecs", [])]
        if (
            codecs != ["sharding_indexed"]
            or inner[-1:] != ["crc32c"]
            or index[-1:] != ["crc32c"]
        ):
            _fail(
                f"{where} has codecs {codecs} (inner {inner}, index {index}); version 2 "
                "arrays are sharded with crc32c on every inner chunk and on the index."
            )
    elif not codecs or codecs[-1] != "crc32c":
        _fail(f"{where} has codecs {codecs}; the chain must end with crc32c.")


def _check_sharded_rows(
    attrs: dict[str, Any], records: list[dict[str, Any]], root: Path
) -> None:
    """Sharded stores (version 2 on): each backward call's rows are consecutive and start at
    a shard boundary."""
    shards = set()
    for spec in attrs["params"].values():
        for path, _, _ in _arrays_of(spec):
            meta_file = root / path / "zarr.json"
            if meta_file.is_file():
                meta = json.loads(meta_file.read_text(encoding="utf-8"))
                shards.add(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    if len(shards) > 1:
        _fail(f"{root}: the arrays have different shard sizes {sorted(shards)}; one is required.")
    c = shards.pop() if shards else 1
    calls: dict[tuple[int, int], list[int]] = {}
    for record in records:
        calls.setdefault((record["step"], record["micro"]), []).append(record["row"])
    for (step, micro), rows in calls.items():
        if rows != list(range(rows[0], rows[0] + len(rows))) or rows[0] % c:
            _fail(
                f"{root}: the records of step {step} micro-batch {micro} have rows {rows}; a "
                f"call's rows are consecutive and start at a multiple of the shard size {c}."
            )


def _check_part_files(root: Path) -> None:
    import pyarrow.parquet as pq

    parts = (
        (fmt.INDEX_DIR, _INDEX_PART, ("step", "micro")),
        (fmt.STEPS_DIR, _STEPS_PART, ("step",)),
    )
    for directory, pattern, columns in parts:
        folder = root / directory
        if not folder.is_dir():
            _fail(f"{root}: the {directory}/ directory is missing.")
        for name in sorted(os.listdir(folder)):
            if name.startswith("."):
                continue  # temporaries of an interrupted write
            if not pattern.match(name):
                _fail(f"{folder}: {name!r} is not a part file name of the format.")
            table = pq.read_table(folder / name, columns=list(columns))
            keys = set(zip(*(table.column(c).to_pylist() for c in columns)))
            names = {_part_name(key) for key in keys}
            if names != {name}:
                _fail(
                    f"{folder / name} holds rows of (step, micro) {sorted(keys)}; a part is "
                    "named after the one step (and micro) it holds."
                )
            if directory == fmt.STEPS_DIR and table.num_rows != 1:
                _fail(f"{folder / name}: a steps part holds one row, not {table.num_rows}.")


def _part_name(key: tuple[int, ...]) -> str:
    """File name of the part of ``(step,)`` or ``(step, micro)``, written out from FORMAT.md."""
    digits = "-".join(f"{value:0{width}d}" for value, width in zip(key, (12, 6)))
    return f"step-{digits}.parquet"
