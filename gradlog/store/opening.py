"""Creating a store, or opening an existing one to continue it (``resume=True``).

Creating never deletes what is not a gradlog store, nor follows a symbolic link to delete.
Resuming checks that the stored run is of this format version and was recorded with the same
configuration and parameters, then discards what a crashed attempt left past the last
committed step: uncommitted index, rank and probe parts, temporaries, and (when nothing was
committed) the arrays of the crashed attempt's plan. Rows past the committed ones are
overwritten by the continued run. Nothing is written outside the store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.errors import StoreExistsError, StoreFormatError, StoreResumeError
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.chunks import ShardLayout
from gradlog.store.dtypes import StorageDtype
from gradlog.store.fs import StorePath
from gradlog.store.lease import LEASE_FILE
from gradlog.store.probes import (
    PROBE_INDEX_DIR,
    PROBES_GROUP,
    parse_probe_part_name,
    probe_array_path,
)
from gradlog.store.ranks import RANKS_DIR
from gradlog.store.reader import StoreReader

__all__ = [
    "Committed",
    "create",
    "discard_uncommitted",
    "inside",
    "is_store",
    "open_to_resume",
    "read_layouts",
    "refuse_foreign",
    "refuse_links",
    "remove_arrays",
]


def is_store(path: StorePath) -> bool:
    """Whether ``path`` holds a gradlog store (its root ``zarr.json`` says so)."""
    try:
        meta = json.loads((path / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("attributes", {}).get("format") == fmt.FORMAT_NAME


def inside(root: StorePath, path: StorePath) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``root`` or below it."""
    if not isinstance(root, Path) or not isinstance(path, Path):
        return True  # an ObjectPath cannot leave its store (gradlog.store.fs); no links
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root + os.sep)


def _group_json(attributes: Mapping[str, Any]) -> bytes:
    """A Zarr v3 group's ``zarr.json`` (what zarr-python writes for one)."""
    meta = {"attributes": dict(attributes), "zarr_format": 3, "node_type": "group"}
    return json.dumps(meta, indent=2).encode("utf-8")


# -- creation -----------------------------------------------------------------------------------
def _entries(path: StorePath) -> list[str]:
    """What ``path`` holds besides the writer lease (and its temporaries)."""
    if not path.is_dir():
        return []
    return [e for e in sfs.listdir(path)
            if e != LEASE_FILE and not e.startswith("." + LEASE_FILE)]


def refuse_foreign(path: StorePath) -> None:
    """Refuse ``path`` before any write when it holds something that is not a gradlog
    store (a writer never puts its lease, or anything else, into a foreign directory).

    Raises:
        StoreExistsError: ``path`` is a file, or a directory with entries but no store.
    """
    if not path.exists():
        return
    if isinstance(path, Path) and not path.is_dir():
        raise StoreExistsError(
            f"{path} exists and is a file, not a gradlog store; refusing to write into or "
            "delete it. Choose another path."
        )
    if _entries(path) and not is_store(path):
        raise StoreExistsError(
            f"{path} exists and is not a gradlog store; refusing to write into "
            "or delete it. Choose another path."
        )


def create(path: StorePath, root_attrs: Mapping[str, Any], overwrite: bool) -> None:
    """Create an empty store at ``path`` with ``root_attrs`` (replacing a gradlog store there
    with ``overwrite``). The caller holds the store's writer lease
    (:mod:`gradlog.store.lease`), which is kept.

    Raises:
        StoreExistsError: ``path`` holds something else, a store without ``overwrite``, or a
            symbolic link to a store.
    """
    refuse_foreign(path)
    if _entries(path):  # a gradlog store (refuse_foreign let nothing else through)
        if not overwrite:
            raise StoreExistsError(
                f"{path} already holds a gradlog run. Pass overwrite=True to replace it, "
                "resume=True to continue it, or choose another path."
            )
        if path.is_symlink():
            raise StoreExistsError(
                f"{path} is a symbolic link; refusing to delete what it points "
                "to. Pass the store's real path."
            )
        for entry in _entries(path):  # all but the lease this writer holds; zarr.json last
            if entry == "zarr.json":
                continue  # replaced below: the path stays a store until it is a new one
            target = path / entry
            if isinstance(target, Path) and (target.is_symlink() or not target.is_dir()):
                target.unlink()  # a link is removed, never followed
            elif target.is_dir():
                sfs.remove_tree(target)
            else:
                target.unlink()
    # a group is its zarr.json (written whole, atomically; zarr's mode="w" would first clear
    # the directory, lease included)
    sfs.write_bytes_atomic(path / "zarr.json", _group_json(root_attrs))
    (path / fmt.GRADS_GROUP).mkdir(exist_ok=True)
    sfs.write_bytes_atomic(path / fmt.GRADS_GROUP / "zarr.json", _group_json({}))
    (path / fmt.INDEX_DIR).mkdir()
    (path / fmt.STEPS_DIR).mkdir()


# -- resumption ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Committed:
    """What an existing store committed: the state a resumed writer continues from.

    Attributes:
        params: The stored parameter specs (root attributes).
        steps: The committed steps (pyarrow table, by step).
        datums: The committed records (pyarrow table, by row).
    """

    params: dict[str, dict[str, Any]]
    steps: Any
    datums: Any

    @property
    def last_step(self) -> int | None:
        """The last committed step, or None."""
        return int(self.steps.column("step")[-1].as_py()) if self.steps.num_rows else None

    @property
    def end_row(self) -> int:
        """One past the last committed row (0 without records)."""
        if not self.datums.num_rows:
            return 0
        return int(np.asarray(self.datums.column("row")).max()) + 1

    @property
    def next_datum_id(self) -> int:
        """One past the largest committed datum id (0 without records)."""
        if not self.datums.num_rows:
            return 0
        return int(np.asarray(self.datums.column("datum_id")).max()) + 1


def open_to_resume(
    path: StorePath, attrs: Mapping[str, Any], wanted: Mapping[str, Mapping[str, Any]]
) -> Committed:
    """Check that the store at ``path`` can be continued by a writer of root attributes
    ``attrs`` and parameter specs ``wanted``, and read what it committed.

    Raises:
        StoreResumeError: another format version, configuration or set of parameters, or a
            part of the store that is a symbolic link or leaves it.
    """
    fixed = [fmt.INDEX_DIR, fmt.STEPS_DIR, fmt.GRADS_GROUP, PROBES_GROUP, PROBE_INDEX_DIR,
             RANKS_DIR]
    refuse_links(path, fixed)  # before reading: nothing is read through a link either
    store = StoreReader(path)
    where = str(path)
    if store.format_version != fmt.FORMAT_VERSION:
        raise StoreResumeError(
            f"{where} is in gradlog format version {store.format_version}; resume=True "
            f"continues version {fmt.FORMAT_VERSION} stores only. Record the rest of the "
            "run into a new store (another path)."
        )
    _check_same_config(store.attrs, attrs, where)
    stored = store.attrs["params"]
    if list(stored) != list(wanted):
        raise StoreResumeError(
            f"{where} records parameters {list(stored)[:8]}..., this recorder "
            f"{list(wanted)[:8]}...; resume with the same model and params= patterns."
        )
    same = ("shape", "numel", "dtype", "param_dtype")
    for name, spec in wanted.items():
        if any(stored[name].get(k) != spec[k] for k in same):
            raise StoreResumeError(
                f"{where}: parameter {name!r} is stored as {stored[name]}, this recorder "
                f"has {dict(spec)}; resume with the same model and dtype."
            )
    subs: list[str] = []
    for name, spec in fmt.normalised_specs(store.attrs).items():  # arrays the writer fills
        subs.extend(str(entry["path"]) for entry in spec["arrays"].values())
        subs.append(probe_array_path(name))
    refuse_links(path, subs)
    return Committed(stored, store.steps, store.datums)


def refuse_links(path: StorePath, rels: list[str]) -> None:
    """Refuse to write into ``path`` if any of the relative paths ``rels``, or a directory
    on the way to one, is a symbolic link or resolves outside the store (a crafted or copied
    store must not make the writer create, truncate or delete files elsewhere).

    Raises:
        StoreResumeError: naming the link.
    """
    if not isinstance(path, Path):
        return  # object stores have no links; ObjectPath refuses '..' (gradlog.store.fs)
    seen: set[Path] = set()
    for rel in rels:
        target = path
        for part in Path(rel).parts:
            target = target / part
            if target in seen:
                continue
            seen.add(target)
            if target.is_symlink() or (target.exists() and not inside(path, target)):
                raise StoreResumeError(
                    f"{target} is a symbolic link or leaves the store; resume=True never "
                    "writes outside the store. Copy the store without links (cp -rL, or "
                    "rsync -L) and resume the copy."
                )


def _check_same_config(stored: Mapping[str, Any], wanted: Mapping[str, Any], where: str) -> None:
    if stored.get("config_hash") == wanted.get("config_hash"):
        return
    old, new = stored.get("config", {}), wanted.get("config", {})
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    diff = "; ".join(f"{k}: stored {old.get(k)!r}, now {new.get(k)!r}" for k in keys[:8])
    raise StoreResumeError(
        f"{where} was recorded with config_hash {stored.get('config_hash')}, this recorder has "
        f"{wanted.get('config_hash')} ({diff or 'same keys, different values'}). resume=True "
        "continues a store with the same configuration only: pass the stored options, or "
        "record into a new store."
    )


def read_layouts(
    path: StorePath, arrays: Mapping[str, StorageDtype]
) -> tuple[dict[str, ShardLayout], int]:
    """The stored layouts of the arrays ``arrays`` (path in the store -> storage dtype) and
    the rows all of them declare, for continuing a store with committed records.

    Raises:
        StoreResumeError: an array is missing or of another dtype: the store is damaged.
        StoreFormatError: an array's metadata is malformed.
    """
    layouts: dict[str, ShardLayout] = {}
    capacity = 0
    for rel, dtype in arrays.items():
        meta_file = path / rel / "zarr.json"
        if not meta_file.is_file():
            continue
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreFormatError(f"{meta_file} is not valid JSON: {e}") from None
        layout = ShardLayout.from_metadata(meta, str(meta_file))
        if layout.array_dtype != dtype.array_dtype:
            raise StoreResumeError(
                f"{meta_file}: array dtype {layout.array_dtype} is not that of "
                f"storage dtype {dtype.name}; the store is damaged."
            )
        layouts[rel] = layout
        rows = int(meta["shape"][0])
        capacity = rows if not capacity else min(capacity, rows)
    missing = [k for k in arrays if k not in layouts]
    if missing:
        raise StoreResumeError(
            f"{path}: arrays of {missing[:5]} are missing though records were "
            "committed; the store is damaged (run `gradlog verify`)."
        )
    return layouts, capacity


def remove_arrays(path: StorePath, params: Mapping[str, Any]) -> None:
    """Delete every parameter's array or form group (resuming a store without records: the
    run plans its forms again, and a crashed attempt's arrays may be of another plan)."""
    for name in params:
        directory = path / fmt.array_path(name)
        if directory.is_symlink() or not inside(path, directory):
            raise StoreResumeError(
                f"{directory} is a symbolic link or leaves the store; resume=True never "
                "deletes outside the store. Copy the store without links and resume the "
                "copy."
            )
        if directory.exists():
            sfs.remove_tree(directory)


def discard_uncommitted(path: StorePath, steps: Any) -> None:
    """Delete what a crash left past the committed ``steps``: uncommitted index parts and
    temporaries. Rank parts and probe parts of uncommitted steps go too: a step recorded
    again must not be committed on a crashed attempt's part (nor show its probes when it is
    recorded again without probes)."""
    committed = {
        (int(s), int(m))
        for s, n in zip(steps.column("step").to_pylist(), steps.column("n_micro").to_pylist())
        for m in range(n)
    }
    done = {int(s) for s in steps.column("step").to_pylist()}
    for sub in (fmt.INDEX_DIR, fmt.STEPS_DIR, RANKS_DIR, PROBE_INDEX_DIR):
        if sub in (RANKS_DIR, PROBE_INDEX_DIR) and not (path / sub).is_dir():
            continue  # recorded by one process, or without probes
        for entry in sfs.listdir(path / sub):
            parsed = fmt.parse_part_name(entry)
            probe_step = parse_probe_part_name(entry) if sub == PROBE_INDEX_DIR else None
            stale = entry.startswith(".") or (
                sub == fmt.INDEX_DIR
                and parsed is not None
                and (parsed[0], parsed[1] or 0) not in committed
            ) or (sub == RANKS_DIR and parsed is not None and parsed[0] not in done) or (
                probe_step is not None and probe_step not in done
            )
            if stale and (path / sub / entry).is_file():
                (path / sub / entry).unlink()
