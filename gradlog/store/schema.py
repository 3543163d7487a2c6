"""The format's JSON Schemas, and validation against them.

The schemas ship as package data ``gradlog.schemas`` (``schemas/*.schema.json`` in the
source tree) and are read through :mod:`importlib.resources`. Validation needs
``jsonschema``, an optional dependency: it is imported by the functions that validate, never
at import time (``gradlog verify`` falls back to its structural checks without it).
"""

from __future__ import annotations

import functools
import json
from importlib.resources import files
from typing import Any

__all__ = ["SCHEMAS", "load_schema", "violation"]

SCHEMAS = ("root", "index", "steps", "optimizer")
"""Names of the JSON Schemas in ``gradlog.schemas`` (file ``<name>.schema.json``)."""


def load_schema(name: str) -> dict[str, Any]:
    """Load one of the format's JSON Schemas.

    Args:
        name: ``"root"``, ``"index"`` or ``"steps"`` (or the file name, ``"root.schema.json"``).

    Returns:
        The schema as a dict.

    Raises:
        ValueError: ``name`` is not one of :data:`SCHEMAS`.
    """
    stem = name.removesuffix(".json").removesuffix(".schema")
    if stem not in SCHEMAS:
        raise ValueError(f"unknown schema {name!r}; the format has: {', '.join(SCHEMAS)}.")
    text = files("gradlog.schemas").joinpath(f"{stem}.schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.cache
def _validator(name: str) -> Any:
    """A Draft 2020-12 validator of schema ``name``, with format checks; the schema itself is
    checked first."""
    from jsonschema import Draft202012Validator

    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def violation(name: str, instance: Any) -> str | None:
    """How ``instance`` breaks the schema ``name`` (its most relevant error, with where), or
    None when it is valid.

    Raises:
        ImportError: jsonschema is not installed.
    """
    from jsonschema.exceptions import best_match

    error = best_match(_validator(name).iter_errors(instance))
    if error is None:
        return None
    return f"breaks {name}.schema.json at {error.json_path}: {error.message}"
