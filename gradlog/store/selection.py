"""Step and datum selections (ints, lists, ranges, arrays, tensors, slices) as int64 ids or
masks, checked: never a float, bool or string taken for an id, never an id wrapped past
int64. Imports no torch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gradlog.errors import InputError, SelectionError

__all__ = ["Selector", "as_ids", "in_slice", "one_int"]

Selector = int | Sequence[int] | range | slice | None

_EXPECTED = "expected an int, a list of ints, a range or a slice (ids A..B-1 for slice(A, B))"

# what each kind of id is, and how to pick the last ones by value
_IDS = {
    "step": ("steps are the run's step numbers",
             "the last 3 steps: step=run.steps['step'].to_pylist()[-3:]"),
    "datum": ("datum ids are the ids the datums were recorded with",
              "run.datums['datum_id'] lists them"),
    "probe": ("probe ids are the ids the probes were recorded with", "run.probe_ids lists them"),
}


def _negative(name: str, sel: Any, value: int) -> InputError:
    """Refusal of a negative id or bound: ids are >= 0, so Python's count-from-the-end
    would silently select something else (``slice(-3, None)``: every step)."""
    what, pick = _IDS.get(name, (f"{name} ids are the run's own numbers", "the run lists them"))
    return InputError(
        f"{name}={sel!r}: {what} (>= 0), not positions: {value} does not count from the "
        f"end. Select by value ({pick})."
    )


def one_int(sel: Any) -> int | None:
    """``sel`` as an int when it is one integer: a Python or numpy int, or a 0-d integer
    array or tensor (``idx[3]`` of a batch's ids); None otherwise. Bools are not ids."""
    if isinstance(sel, (bool, np.bool_)):
        return None
    if isinstance(sel, (int, np.integer)):
        return int(sel)
    if hasattr(sel, "detach"):  # a torch tensor, without importing torch
        sel = sel.detach().cpu().numpy()
    if isinstance(sel, np.ndarray) and sel.ndim == 0 and sel.dtype.kind in "iu":
        return int(sel)
    return None


def as_ids(sel: Selector, name: str) -> np.ndarray | None:
    """A selection other than a slice as int64 ids; None stays None.

    Raises:
        SelectionError: ``sel`` is not integers (floats, bools, strings are never ids).
        InputError: an id is negative (ids are >= 0; -1 is no "last").
    """
    if sel is None:
        return None
    if isinstance(sel, slice):
        raise TypeError("internal: slices are resolved before as_ids")
    given = sel  # as the caller wrote it, for messages
    one = one_int(sel)
    if one is not None:
        sel = [one]
    values: np.ndarray | None = None
    if hasattr(sel, "detach"):  # torch, without importing it here
        values = sel.detach().cpu().numpy()
    elif isinstance(sel, np.ndarray):
        values = sel
    elif isinstance(sel, range):
        far = _outside([sel[0], sel[-1]]) if sel else None
        if far is not None:
            raise SelectionError(f"{name}={sel!r}: {name} ids are int64: {far} is outside "
                                 "[-2**63, 2**63 - 1].")
        try:
            n = len(sel)
            values = np.array([sel[0]] if n == 1 else
                              sel.start + sel.step * np.arange(n, dtype=np.int64))
        except (OverflowError, ValueError, MemoryError):  # a step or length past int64
            raise SelectionError(f"{name}={sel!r}: too many ids, or a step past int64; pass "
                                 "a slice for an open range.") from None
    elif isinstance(sel, Iterable) and not isinstance(sel, (str, bytes, dict)):
        try:  # numpy takes 0-d arrays and tensors as their values
            values = np.asarray(list(sel))
        except (TypeError, ValueError):  # ragged
            values = None
    if values is not None and values.dtype == object:  # Python ints beyond 64 bits
        items = values.tolist()
        if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            far = _outside(items)
            if far is not None:
                raise SelectionError(f"{name}={sel!r}: {name} ids are int64: {far} is "
                                     "outside [-2**63, 2**63 - 1].")
    if values is None or values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise SelectionError(f"{name}={sel!r}: {_EXPECTED}.")
    if values.dtype.kind == "u" and values.size and int(values.max()) > _INT64.max:
        raise SelectionError(f"{name}={sel!r}: {name} ids are int64: {int(values.max())} is "
                             "above 2**63 - 1.")
    if values.size and int(values.min()) < 0:
        raise _negative(name, given, int(values.min()))
    return values.astype(np.int64)


_INT64 = np.iinfo(np.int64)


def _outside(values: Any) -> int | None:
    """The first of ``values`` (ints) outside int64, or None."""
    return next((v for v in values if not _INT64.min <= v <= _INT64.max), None)


def in_slice(column: Any, sel: slice, name: str) -> Any:
    """Mask of ``column``'s values in ``[sel.start, sel.stop)`` (an open end: no bound).

    Raises:
        SelectionError: a stride, or bounds that are not ints.
        InputError: a negative bound (ids are >= 0; ``slice(-3, None)`` is no "last 3").
    """
    import pyarrow.compute as pc

    if sel.step not in (None, 1):
        raise SelectionError(
            f"{name}={sel!r}: {name} slices take no stride; pass a range or a list."
        )
    start, stop = (None if b is None else one_int(b) for b in (sel.start, sel.stop))
    if (sel.start is not None and start is None) or (sel.stop is not None and stop is None):
        raise SelectionError(f"{name}={sel!r}: slice bounds must be ints or None.")
    for bound in (start, stop):
        if bound is not None and bound < 0:
            raise _negative(name, sel, bound)
    # bounds beyond int64 bound nothing (stop) or everything (start): ids are int64
    start = None if start is None else min(max(start, _INT64.min), _INT64.max + 1)
    if start is not None and start > _INT64.max:
        return pc.less(column, _INT64.min)  # no id is that large
    mask = pc.greater_equal(column, _INT64.min if start is None else start)
    if stop is not None and stop <= _INT64.max:
        mask = pc.and_(mask, pc.less(column, max(stop, _INT64.min)))
    return mask
