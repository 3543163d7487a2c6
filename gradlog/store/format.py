"""Constants and checks of the store format (the normative text is schemas/FORMAT.md).

Imports no torch: ``gradlog info`` and readers stay fast.
"""

from __future__ import annotations

import math
import re
from typing import Any
from urllib.parse import quote

from gradlog.errors import StoreFormatError, StoreVersionError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_DIR",
    "STEPS_DIR",
    "array_path",
    "check_root_attrs",
    "form_array_path",
    "index_part_name",
    "index_schema",
    "norm_column",
    "normalised_specs",
    "record_bytes",
    "step_part_name",
    "steps_schema",
]

FORMAT_NAME = "gradlog"
FORMAT_VERSION = 3
"""The newest format this code writes and reads; readers refuse newer stores and read every
older one (version 1: unsharded arrays read through zarr-python; version 2: sharded arrays,
one shard per backward call and parameter, lossy storage dtypes; version 3: forms, each
parameter's arrays named in its spec; schemas/CHANGES.md)."""

V1_DTYPES = ("float32", "float64")
"""Storage dtypes of format version 1; version 2 adds the lossy ones (gradlog.store.dtypes)."""

_MAX_NUMEL = 2**53

GRADS_GROUP = "grads"
INDEX_DIR = "index"
STEPS_DIR = "steps"
NORM_PREFIX = "norm/"

_SAFE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_PART = re.compile(r"^step-(\d{12,})(?:-(\d{6,}))?\.parquet$")  # widths are minimums


def array_path(param: str) -> str:
    """Path of a parameter's gradient array inside the store.

    Parameter names are used verbatim when they are plain (letters, digits, ``_ . -``);
    anything else is percent-encoded so that no name can escape the ``grads`` group.
    """
    name = param if _SAFE.match(param) else quote(param, safe="")
    if name.startswith("__") or name in {".", ".."} or name.startswith("."):
        name = "%" + format(ord(name[0]), "02X") + name[1:]  # zarr reserves these names
    return f"{GRADS_GROUP}/{name}"


def form_array_path(param: str, form: str, array: str) -> str:
    """Path of one array of a parameter's form (format version 3): ``full`` keeps its one
    array at :func:`array_path`; other forms keep ``<array_path>/<array>``."""
    if form == "full":
        return array_path(param)
    if not _SAFE.match(array) or array.startswith("."):
        raise StoreFormatError(f"form array name {array!r} is not a plain name.")
    return f"{array_path(param)}/{array}"


def record_bytes(spec: dict[str, Any]) -> int:
    """Stored bytes of one record of a parameter, from its spec (its form's arrays; the
    whole tensor before version 3); the norm in the index not counted."""
    from gradlog.store.dtypes import storage_dtype

    itemsize = storage_dtype(str(spec["dtype"])).itemsize
    arrays = spec.get("arrays", {"grad": {"shape": spec["shape"], "kind": "float"}})
    return sum(
        math.prod(a["shape"]) * (8 if a["kind"] == "int64" else itemsize) for a in arrays.values()
    )


def norm_column(param: str) -> str:
    """Index column holding the per-record gradient norm of ``param``."""
    return NORM_PREFIX + param


def index_part_name(step: int, micro: int) -> str:
    """File of the index rows of one ``backward`` call (micro-batch) of a step."""
    return f"step-{step:012d}-{micro:06d}.parquet"


def step_part_name(step: int) -> str:
    """File of a step's row in the steps table; its presence commits the step."""
    return f"step-{step:012d}.parquet"


def parse_part_name(name: str) -> tuple[int, int | None] | None:
    """``(step, micro)`` of a part file name, or None for a file that is not a part."""
    m = _PART.match(name)
    if m is None:
        return None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) is not None else None)


def check_root_attrs(attrs: dict[str, Any], where: str) -> None:
    """Check the parts of the root attributes a reader relies on; cheap, no jsonschema.

    Raises:
        StoreFormatError: not a gradlog store, or malformed attributes.
        StoreVersionError: written by a newer format version.
    """
    if attrs.get("format") != FORMAT_NAME:
        raise StoreFormatError(
            f"{where} is a Zarr group but not a gradlog store (its attribute 'format' is "
            f"{attrs.get('format')!r}, expected {FORMAT_NAME!r})."
        )
    version = attrs.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StoreFormatError(f"{where}: format_version {version!r} is not a positive integer.")
    if version > FORMAT_VERSION:
        raise StoreVersionError(
            f"{where} was written in gradlog format version {version} (by gradlog "
            f"{attrs.get('gradlog_version', '?')}); this gradlog reads versions up to "
            f"{FORMAT_VERSION}. Upgrade gradlog: pip install -U gradlog."
        )
    params = attrs.get("params")
    if not isinstance(params, dict):
        raise StoreFormatError(f"{where}: attribute 'params' must be an object of param specs.")
    config = attrs.get("config", {})
    if not isinstance(config, dict):
        raise StoreFormatError(
            f"{where}: attribute 'config' must be an object (the recorder's configuration), "
            f"not {type(config).__name__}."
        )
    for name, spec in params.items():
        if not isinstance(spec, dict):
            raise StoreFormatError(f"{where}: spec of parameter {name!r} is not an object.")
        shape = spec.get("shape")
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise StoreFormatError(
                f"{where}: parameter {name!r} has shape {shape!r}; expected a list of "
                "non-negative integers."
            )
        if math.prod(shape) > _MAX_NUMEL:
            raise StoreFormatError(
                f"{where}: parameter {name!r} has the impossible shape {shape!r}."
            )
        dtype = spec.get("dtype")
        if version == 1 and dtype not in V1_DTYPES:
            raise StoreFormatError(
                f"{where}: parameter {name!r} has dtype {dtype!r}; format version 1 stores "
                f"hold {list(V1_DTYPES)}."
            )
        if version > 1:
            from gradlog.store.dtypes import storage_dtype

            try:
                storage_dtype(str(dtype))
            except ValueError:
                raise StoreFormatError(
                    f"{where}: parameter {name!r} has dtype {dtype!r}, not a storage dtype of "
                    "format version 2 (float32, float64, float16, bfloat16, bitround1..22)."
                ) from None
        if spec.get("array") != array_path(name):
            raise StoreFormatError(
                f"{where}: parameter {name!r} points at array {spec.get('array')!r}; the format "
                f"requires {array_path(name)!r}."
            )
        if version >= 3:
            _check_form_fields(name, spec, where)


def normalised_specs(attrs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The parameter specs of checked root attributes (:func:`check_root_attrs`) as the
    newest format version writes them, so that nothing above the store branches on versions:
    before version 3 every parameter was ``full``, with its one array ``grad`` at
    :func:`array_path`. Copies: ``attrs`` itself is left as stored."""
    version = int(attrs["format_version"])
    out: dict[str, dict[str, Any]] = {}
    for name, stored in attrs["params"].items():
        spec = dict(stored)
        if version < 3:
            shape = list(spec["shape"])
            spec["form"] = "full"
            spec["form_spec"] = {"form": "full", "shape": shape}
            spec["arrays"] = {"grad": {"path": array_path(name), "shape": shape, "kind": "float"}}
        out[name] = spec
    return out


ARRAY_KINDS = ("float", "int64")
"""Kinds of a form's arrays: gradient values in the storage dtype, or int64 indices."""


def _check_form_fields(name: str, spec: dict[str, Any], where: str) -> None:
    """Version 3: ``form_spec`` names the form, ``arrays`` its arrays at their paths."""
    form, form_spec, arrays = spec.get("form"), spec.get("form_spec"), spec.get("arrays")
    if not isinstance(form, str) or not isinstance(form_spec, dict) or (
        form_spec.get("form") != form
    ):
        raise StoreFormatError(
            f"{where}: parameter {name!r} has form {form!r} and form_spec {form_spec!r}; "
            "version 3 needs a form name and a form_spec object naming the same form."
        )
    if not isinstance(arrays, dict):
        raise StoreFormatError(f"{where}: parameter {name!r} has no 'arrays' object.")
    for key, entry in arrays.items():
        ok = (
            isinstance(entry, dict)
            and isinstance(key, str)
            and _SAFE.match(key) is not None
            and entry.get("kind") in ARRAY_KINDS
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                    for d in entry["shape"])
            and math.prod(entry["shape"]) <= _MAX_NUMEL
        )
        if not ok or entry.get("path") != form_array_path(name, form, key):
            raise StoreFormatError(
                f"{where}: parameter {name!r} array {key!r} is {entry!r}; expected "
                f"{{path: {form_array_path(name, form, key) if ok else '...'!r}, shape: [...], "
                f"kind: one of {list(ARRAY_KINDS)}}}."
            )
    grad = arrays.get("grad")
    if form == "full" and isinstance(grad, dict) and grad.get("shape") != spec.get("shape"):
        raise StoreFormatError(  # rows would be read back in another parameter's shape
            f"{where}: parameter {name!r} has shape {spec.get('shape')!r} but its full array "
            f"holds rows of shape {grad.get('shape')!r}; the store is damaged."
        )


_INDEX_COLUMNS = {
    "step": "int64",
    "micro": "int32",
    "datum_id": "int64",
    "row": "int64",
    "loss": "float64",
    "weight": "float64",
    "lr": "float64",
}
"""Columns of the record index before the per-parameter norms, with their arrow types."""

_STEPS_COLUMNS = {
    "step": "int64",
    "first_row": "int64",
    "n_records": "int64",
    "n_micro": "int32",
    "tokens": "int64",
    "lr": "float64",
    "loss_mean": "float64",
    "time_compute_s": "float64",
    "time_write_s": "float64",
}
"""Columns of the steps table, with their arrow types."""

_NULLABLE = ("lr",)
"""Columns that may be null: the learning rate, where the caller gave none."""


def _fields(columns: dict[str, str]) -> list[Any]:
    import pyarrow as pa

    return [
        pa.field(name, getattr(pa, kind)(), nullable=name in _NULLABLE)
        for name, kind in columns.items()
    ]


def index_schema(params: list[str]) -> Any:
    """Arrow schema of the record index: one row per (step, datum) record."""
    import pyarrow as pa

    norms = [pa.field(norm_column(p), pa.float64(), nullable=False) for p in params]
    return pa.schema(_fields(_INDEX_COLUMNS) + norms)


def steps_schema() -> Any:
    """Arrow schema of the steps table: one row per committed step."""
    import pyarrow as pa

    return pa.schema(_fields(_STEPS_COLUMNS))
