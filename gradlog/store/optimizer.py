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

import io
import json
import re
import zipfile
from collections.abc import Mapping
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

    def _open(self) -> Any:
        """The file, opened (a local file is read member by member; an object whole)."""
        source: Any = (io.BytesIO(self._where.read_bytes()) if sfs.is_object(self._root)
                       else self._where)
        return np.load(source, allow_pickle=False)

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
