"""The store's root metadata: reading it, and telling one run from another that replaced it
at the same path (``overwrite=True``). Imports no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradlog.errors import NotAStoreError, StoreFormatError
from gradlog.store import format as fmt
from gradlog.store.fs import StorePath

__all__ = ["identity", "read_root_attrs", "records_rate_of_recorded_group", "stamp"]


def read_root_attrs(path: StorePath) -> dict[str, Any]:
    """The root attributes of the store at ``path``, checked (``gradlog.store.format``).

    Raises:
        NotAStoreError: no store there.
        StoreFormatError: unreadable or invalid root metadata.
    """
    meta_file = path / "zarr.json"
    if not path.exists():
        raise NotAStoreError(f"{path} does not exist. Record a run first (gradlog train).")
    if not meta_file.is_file():
        raise NotAStoreError(
            f"{path} is not a gradlog store: it has no zarr.json. A store is the directory "
            "that GradRecorder(model, path) or `gradlog train --out PATH` created."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{meta_file} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("node_type") != "group":
        raise StoreFormatError(f"{path} is not a Zarr group (zarr.json has no node_type 'group').")
    attrs = meta.get("attributes", {})
    if not isinstance(attrs, dict):
        raise StoreFormatError(f"{meta_file}: 'attributes' must be a JSON object.")
    fmt.check_root_attrs(attrs, str(path))
    return attrs


def identity(attrs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """What tells one run from another that replaced it at the same path: its ``run_id``
    (stores before it: None), creation time and configuration hash."""
    return attrs.get("run_id"), attrs.get("created"), attrs.get("config_hash")


def stamp(path: StorePath) -> tuple[int, int, int] | None:
    """A local store's root metadata file's inode, mtime and size; None elsewhere."""
    if not isinstance(path, Path):
        return None
    try:
        st = (path / "zarr.json").stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def records_rate_of_recorded_group(attrs: dict[str, Any]) -> bool:
    """Whether a record's learning rate, when taken from the optimizer, is that of its first
    param group holding a recorded parameter (stores with ``run_id``, from 2026-11-26), not
    of its first param group (earlier stores: there a rate other than the kept state's came
    from group 0, not from ``lr=``)."""
    return "run_id" in attrs
