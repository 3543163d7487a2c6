"""Optimizer state at recorded steps: what optimizer-aware influence needs (#19).

Layout (normative text: schemas/FORMAT.md, section 14)::

    RUN.gradlog/
      optimizer/step-S.npz     one file per recorded step S, written after the optimizer's
                               step and before step S's commit marker

Each file is an uncompressed ``.npz`` (a zip of ``.npy`` members, each with its zip crc32;
no object arrays: read with ``allow_pickle=False``) holding:

- ``meta``: a 0-d unicode array, JSON (``schemas/optimizer.schema.json``): the optimizer's
  class and kind (``"adam"`` or ``"sgd"``), the storage dtype, and per recorded parameter the
  hyperparameters of its param group at that step (``lr``, ``betas``, ``eps``, ``amsgrad``,
  ``momentum``, ``dampening``, ``nesterov``, ``weight_decay``) and the optimizer's own step
  count for it (``count``), or ``null`` for a parameter the optimizer did not step.
- ``precond/<param>`` (``adam`` only): the diagonal preconditioner
  ``1 / (sqrt(v_t / (1 - beta2^n)) + eps)`` the optimizer applied at that step, with ``v_t``
  its second moment after the step (``max_exp_avg_sq`` with ``amsgrad``), flattened,
  ``float32`` or the bit pattern of its ``bfloat16`` rounding (``uint16``).

Readers ignore files of uncommitted steps and dot files (temporaries). Stores without an
``optimizer/`` directory (older stores, optimizers gradlog does not read) have no optimizer
state; readers that do not know the directory ignore it. Imports no torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.errors import StoreCorruptError, StoreFormatError
from gradlog.store import fs as sfs
from gradlog.store.dtypes import as_stored, from_storage, storage_dtype
from gradlog.store.fs import StorePath

__all__ = [
    "OPTIMIZER_DIR",
    "OPTIMIZER_DTYPES",
    "OptimizerStep",
    "optimizer_part_name",
    "optimizer_steps",
    "read_optimizer_step",
    "verify_optimizer_state",
    "write_optimizer_step",
]

OPTIMIZER_DIR = "optimizer"
OPTIMIZER_DTYPES = ("float32", "bfloat16")
"""Storage dtypes of the preconditioner."""
_PART = re.compile(r"^step-(\d{12,})\.npz$")


def optimizer_part_name(step: int) -> str:
    """File (in ``optimizer/``) of one step's optimizer state."""
    return f"step-{step:012d}.npz"


def write_optimizer_step(
    root: StorePath,
    step: int,
    meta: Mapping[str, Any],
    precond: Mapping[str, np.ndarray],
    *,
    dtype: str = "float32",
    durable: bool = False,
) -> int:
    """Write step ``step``'s optimizer state; returns the file's size in bytes.

    Args:
        root: The store.
        step: The recorded step.
        meta: The JSON metadata (module doc); ``dtype`` is added.
        precond: Flat float32 preconditioner per parameter (empty for ``sgd``).
        dtype: ``"float32"`` or ``"bfloat16"``.
        durable: fsync the file before it is renamed into place.
    """
    if dtype not in OPTIMIZER_DTYPES:
        raise StoreFormatError(f"optimizer state dtype {dtype!r} is not one of {OPTIMIZER_DTYPES}.")
    stored = storage_dtype(dtype)
    members: dict[str, np.ndarray] = {
        "meta": np.array(json.dumps({**meta, "dtype": dtype}, sort_keys=True))
    }
    for name, values in precond.items():
        members[f"precond/{name}"] = as_stored(np.ascontiguousarray(values, np.float32), stored)
    buffer = io.BytesIO()
    np.savez(buffer, **members)  # type: ignore[arg-type]  # uncompressed zip, crc32 per member
    data = buffer.getvalue()
    directory = root / OPTIMIZER_DIR
    if not sfs.is_object(root):
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / optimizer_part_name(step)
    if durable and isinstance(path, Path):
        import os

        tmp = path.with_name("." + path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        sfs.write_bytes_atomic(path, data)
    return len(data)


def optimizer_steps(root: StorePath) -> list[int]:
    """Steps with an optimizer state file (committed or not), ascending; [] without any."""
    directory = root / OPTIMIZER_DIR
    if not directory.exists():
        return []
    steps = []
    for name in sfs.listdir(directory):
        m = _PART.match(name)
        if m is not None:
            steps.append(int(m.group(1)))
    return sorted(steps)


class OptimizerStep:
    """One step's optimizer state, read lazily (a preconditioner is read when asked for).

    Attributes:
        step: The recorded step.
        meta: Its JSON metadata (module doc).
    """

    def __init__(self, root: StorePath, step: int) -> None:
        self.step = step
        self._root = root
        self._where = root / OPTIMIZER_DIR / optimizer_part_name(step)
        try:
            with self._open() as npz:
                self.meta: dict[str, Any] = json.loads(str(npz["meta"][()]))
                self._files = set(npz.files)
        except (OSError, ValueError, zipfile.BadZipFile, KeyError) as exc:
            raise StoreCorruptError(
                f"{self._where}: the optimizer state of step {step} cannot be read ({exc}). "
                "Delete the file to score that step without it (kind='tracin'), or re-record."
            ) from exc
        dtype = self.meta.get("dtype")
        if dtype not in OPTIMIZER_DTYPES:
            raise StoreFormatError(
                f"{self._where}: optimizer state dtype {dtype!r} is not one this gradlog reads "
                f"({', '.join(OPTIMIZER_DTYPES)}); upgrade gradlog."
            )
        self._dtype = storage_dtype(dtype)

    @contextlib.contextmanager
    def _open(self) -> Iterator[Any]:
        """The file, opened to be read member by member (an object through ranged reads:
        the metadata alone is a few KiB of a file as large as the model), and closed however
        the read ends (``np.load`` of a path leaks it when the zip is bad)."""
        with contextlib.ExitStack() as stack:
            where = self._where
            if isinstance(where, Path):
                source: Any = stack.enter_context(open(where, "rb"))
            else:
                source = stack.enter_context(where.fs.open(where.path, "rb"))
            yield stack.enter_context(np.load(source, allow_pickle=False))

    def close(self) -> None:
        """Nothing to release (each read opens and closes the file): kept for symmetry."""

    def group(self, param: str) -> dict[str, Any] | None:
        """The hyperparameters and step count of ``param`` at this step, or None when the
        optimizer did not step it (or it was not recorded)."""
        found = self.meta.get("params", {}).get(param)
        return dict(found) if found is not None else None

    def preconditioner(self, param: str, dtype: Any = np.float64) -> np.ndarray | None:
        """``param``'s flat preconditioner (``adam``), or None where none is stored."""
        key = f"precond/{param}"
        if key not in self._files:
            return None
        try:
            with self._open() as npz:
                stored = npz[key]
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise StoreCorruptError(
                f"{self._where}: the preconditioner of {param!r} is damaged ({exc}). Delete "
                "the file to score that step without it, or re-record."
            ) from exc
        return np.asarray(from_storage(stored, self._dtype, dtype))


def read_optimizer_step(root: StorePath, step: int) -> OptimizerStep:
    """Step ``step``'s optimizer state.

    Raises:
        StoreCorruptError: the file is unreadable (a damaged zip or crc32).
    """
    return OptimizerStep(root, step)


def verify_optimizer_state(
    root: StorePath, committed: set[int], params: Mapping[str, Mapping[str, Any]]
) -> tuple[list[str], list[str], str]:
    """Check every optimizer state file of a committed step, reading every byte of it:
    ``(problems, notes, summary)`` for ``gradlog verify`` (:mod:`gradlog.store.verify`).

    Problems: a file that does not read (zip, crc32 or JSON damage), metadata that breaks
    ``optimizer.schema.json`` or names a parameter the store does not record, an ``adam``
    file lacking a stepped parameter's preconditioner, or one of the wrong length, or with
    an entry that is negative or not finite (``1 / (sqrt(v) + eps)`` is finite and > 0, or 0
    where the step's gradient was 0). Notes: files of uncommitted steps and temporaries
    (readers ignore them), unknown names, and committed steps without a file while others
    have one (``kind="optimizer"`` refuses those steps with its own error).
    """
    directory = root / OPTIMIZER_DIR
    if not directory.exists():
        return [], [], "no optimizer state"
    problems: list[str] = []
    notes: list[str] = []
    kept: list[int] = []
    for name in sorted(sfs.listdir(directory)):
        m = _PART.match(name)
        if name.startswith("."):
            notes.append(f"temporary {OPTIMIZER_DIR}/{name} (a crash's leftover, ignored)")
        elif m is None:
            notes.append(f"unknown file {OPTIMIZER_DIR}/{name} (ignored by readers)")
        elif int(m.group(1)) not in committed:
            notes.append(f"uncommitted {OPTIMIZER_DIR}/{name} (ignored by readers)")
        else:
            kept.append(int(m.group(1)))
    n_values = 0
    for step in kept:
        where = f"{OPTIMIZER_DIR}/{optimizer_part_name(step)}"
        try:
            state = OptimizerStep(root, step)
            problems += [f"{where}: {p}" for p in _meta_problems(state.meta, params)]
            for param, group in state.meta.get("params", {}).items():
                if state.meta.get("kind") != "adam" or group is None or param not in params:
                    continue
                values = state.preconditioner(param)  # the whole member: its crc32 checked
                if values is None:
                    problems.append(f"{where} lacks the preconditioner of {param!r}.")
                    continue
                n_values += values.size
                numel = int(params[param]["numel"])
                if values.shape != (numel,):
                    problems.append(f"{where}: the preconditioner of {param!r} has shape "
                                    f"{values.shape}, the parameter {numel} entries.")
                elif not (np.isfinite(values) & (values >= 0)).all():
                    problems.append(f"{where}: the preconditioner of {param!r} holds negative "
                                    "or non-finite entries.")
        except (StoreCorruptError, StoreFormatError) as exc:
            problems.append(str(exc))
    missing = sorted(committed - set(kept)) if kept else []
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        notes.append(f"committed step(s) {shown} have no optimizer state "
                     "(kind='optimizer' refuses them)")
    summary = (f"{len(kept)} optimizer state files read ({n_values} preconditioner values), "
               "zip crc32 verified")
    return problems, notes, summary


def _meta_problems(meta: Any, params: Mapping[str, Any]) -> list[str]:
    """How a file's ``meta`` breaks ``optimizer.schema.json`` (validated with ``jsonschema``
    when installed, else its required structure) or names parameters not recorded."""
    try:
        from gradlog.store.schema import violation

        broken = violation("optimizer", meta)
        found = [f"meta {broken}"] if broken is not None else []
    except ImportError:  # jsonschema is optional: the structure gradlog reads
        found = []
        if not isinstance(meta, dict) or meta.get("kind") not in ("adam", "sgd"):
            found.append("meta has no 'kind' of 'adam' or 'sgd'.")
        elif not isinstance(meta.get("params"), dict):
            found.append("meta has no 'params' object.")
    if isinstance(meta, dict) and isinstance(meta.get("params"), dict):
        unknown = sorted(set(meta["params"]) - set(params))
        if unknown:
            found.append(f"meta names parameters the store does not record: {unknown[:5]}.")
    return found
