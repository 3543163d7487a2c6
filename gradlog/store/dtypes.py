"""Storage dtypes: how gradients are rounded before they are written, and read back.

Every storage dtype is stored with codecs of the Zarr v3 core specification, so any Zarr v3
reader can decode the arrays (FORMAT.md section 4.2):

=============  ==================  =====================================================
name           array data type     value stored
=============  ==================  =====================================================
``float32``    ``float32``         the float32 cast (lossless for float32 models)
``float64``    ``float64``         the float64 cast
``float16``    ``float16``         IEEE half; gradients below 6.1e-5 lose precision and
                                   below 6e-8 become 0 (underflow): allowed, not advised
``bfloat16``   ``uint16``          the bit pattern of the bfloat16 rounding
                                   (round to nearest even); read as ``bits << 16``
``bitroundN``  ``float32``         float32 with the mantissa rounded to N bits (1..22),
                                   round to nearest even, as numcodecs' BitRound; gains
                                   only with a compressor (default lz4 + bitshuffle)
=============  ==================  =====================================================

The rounding happens in torch (on the gradient's device) or numpy, before the bytes reach the
codecs; reads always return float32 (or the dtype asked for). Imports no torch at import time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradlog.errors import ConfigError, InputError

__all__ = [
    "COMPRESSIONS",
    "READ_DTYPES",
    "STORAGE_DTYPE_NAMES",
    "StorageDtype",
    "as_stored",
    "bitround_int32",
    "default_compression",
    "from_storage",
    "norms_disagree",
    "read_dtype",
    "storage_dtype",
    "to_storage_numpy",
]

_BITROUND = re.compile(r"^bitround([0-9]{1,2})$")
STORAGE_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "bitroundN")
"""The storage dtypes, for messages (``bitroundN``: N kept mantissa bits, 1..22)."""

COMPRESSIONS = ("none", "lz4", "zstd")
"""Compressors: none, or blosc (bitshuffle, level 1) with lz4 or zstd."""


@dataclass(frozen=True)
class StorageDtype:
    """One storage dtype.

    Attributes:
        name: Its name in the configuration and parameter specs (``"bitround9"``).
        array_dtype: numpy dtype of the Zarr array holding it (``uint16`` for bfloat16).
        keepbits: Kept mantissa bits for BitRound, else None.
        lossy: Whether a float32 gradient may change when stored.
    """

    name: str
    array_dtype: np.dtype[Any]
    keepbits: int | None = None
    lossy: bool = False

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return int(self.array_dtype.itemsize)


_SIGNIFICANT_BITS = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8}


def norms_disagree(values: np.ndarray, norms: np.ndarray,
                   dtype: StorageDtype) -> tuple[np.ndarray, np.ndarray]:
    """Which stored records ``values`` (read back, ``(n, ...)``) do not have their exact
    ``norms`` (float64, computed before the cast): ``(disagree, overflowed)`` masks ``(n,)``.

    The cast moves a norm by at most the dtype's relative rounding (``float16`` adds 2^-25
    per entry below its normal range); forming a record may differ from forming its norm by
    float32 rounding: 1e-3 relative allows both. Non-finite norms are not compared (their
    records are flagged so); ``overflowed``: finite records stored as inf (``float16`` past
    65504), not counted as disagreeing.
    """
    flat = values.reshape(len(values), int(np.prod(values.shape[1:])))  # (n may be 0)
    if flat.shape[1] >= 1024 and flat.dtype in (np.float32, np.float64):  # BLAS dots: 4x the
        sq = np.fromiter((np.dot(r, r) for r in flat), np.float64, len(flat))  # einsum's pace
    else:  # (float32 sums of squares: ~1e-6 relative, far inside the tolerance below)
        sq = np.einsum("ij,ij->i", flat, flat, dtype=np.float64)  # no float64 copy
    got = np.sqrt(sq)
    finite = np.isfinite(norms)
    overflowed = finite & ~np.isfinite(got)
    bits = dtype.keepbits + 1 if dtype.keepbits is not None else _SIGNIFICANT_BITS.get(
        dtype.name, 24)
    floor = 2.0**-25 * np.sqrt(flat.shape[1]) if dtype.name == "float16" else 0.0
    close = np.abs(got - norms) <= (4 * 2.0**-bits + 1e-3) * norms + floor
    return finite & ~overflowed & ~close, overflowed


def storage_dtype(name: str) -> StorageDtype:
    """The storage dtype called ``name``.

    Raises:
        ConfigError: ``name`` is not a storage dtype; the message lists them.
    """
    if name in ("float32", "float64", "float16"):
        return StorageDtype(name, np.dtype(name), lossy=name == "float16")
    if name == "bfloat16":
        return StorageDtype(name, np.dtype("uint16"), lossy=True)
    m = _BITROUND.match(name) if isinstance(name, str) else None
    if m is not None and 1 <= int(m.group(1)) <= 22:
        return StorageDtype(name, np.dtype("float32"), keepbits=int(m.group(1)), lossy=True)
    raise ConfigError(
        f"dtype={name!r} is not a storage dtype; pass one of {list(STORAGE_DTYPE_NAMES)} "
        "(bitroundN keeps N of float32's 23 mantissa bits, 1 <= N <= 22, e.g. 'bitround9')."
    )


INDEX_DTYPE = StorageDtype("int64", np.dtype("int64"))
"""How forms' index arrays (``topk``, ``rows``) are stored: int64, never rounded."""


def default_compression(name: str) -> str:
    """The compressor chosen by measurement for a storage dtype (FORMAT.md section 4.3).

    Lossless float32 gains 1.17x from lz4 and 1.17x from zstd: not worth a core on the small
    machines measured, so ``none``. BitRound only pays with a compressor (2.3x at 9 bits), and
    lz4 compresses bitshuffled data as well as zstd at 2.7x the speed, so ``lz4``.
    """
    return "lz4" if storage_dtype(name).keepbits is not None else "none"


def bitround_int32(bits: Any, keepbits: int) -> Any:
    """Round float32 bit patterns held as int32 (numpy array or torch tensor, modified in
    place) to ``keepbits`` mantissa bits, ties to even: numcodecs.BitRound's arithmetic."""
    drop = 23 - keepbits
    bits += ((bits >> drop) & 1) + ((1 << (drop - 1)) - 1)
    bits &= -(1 << drop)  # int32 mask of the kept bits
    return bits


def to_storage_numpy(array: np.ndarray, dtype: StorageDtype) -> np.ndarray:
    """Round a numpy array to the storage dtype; returns an array of ``dtype.array_dtype``."""
    if dtype.name in ("float32", "float64", "float16", "int64"):
        with np.errstate(over="ignore"):  # float16's overflow to inf: the writer notes it
            return np.asarray(array, dtype=dtype.array_dtype)
    if dtype.name == "bfloat16":
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        nan = np.isnan(array)
        out = (rounded >> np.uint32(16)).astype(np.uint16)
        if nan.any():  # the rounding increment must not turn a NaN into an infinity
            out[nan] = np.uint16(0x7FC0)
        return out
    assert dtype.keepbits is not None
    bits = np.array(array, dtype=np.float32, order="C").view(np.int32)  # a copy
    kept: np.ndarray = bitround_int32(bits, dtype.keepbits)
    return kept.view(np.float32)


def as_stored(values: np.ndarray, dtype: StorageDtype) -> np.ndarray:
    """``values`` as an array of ``dtype`` holds them: rounded here unless they already are.

    bfloat16 values already rounded arrive as their 16-bit pattern (uint16, or int16: torch's
    view); values already in another array dtype are rounded again, which changes nothing
    (casts and BitRound are idempotent).
    """
    if dtype.name == "bfloat16" and values.dtype.kind in "iu" and values.dtype.itemsize == 2:
        return values.view(np.uint16)
    if values.dtype == dtype.array_dtype and dtype.keepbits is None:
        return values
    return to_storage_numpy(values, dtype)


def from_storage(stored: np.ndarray, dtype: StorageDtype, out_dtype: Any = np.float32) -> Any:
    """Values of a stored array (``dtype.array_dtype``) as ``out_dtype`` (float32 default)."""
    if dtype.name == "bfloat16":
        widened = np.asarray(stored, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
        return np.asarray(widened.view(np.float32), dtype=out_dtype)
    return np.asarray(stored, dtype=out_dtype)


READ_DTYPES = ("float32", "float64")
"""The dtypes reads return values in (``dtype=`` of ``run.grads``, ``run.probe_grads``)."""


def read_dtype(dtype: Any, method: str) -> Any:
    """``dtype=`` of read ``method`` as the numpy dtype it names, float32 or float64 (numpy's,
    its name, or torch's: the same values), checked before anything is read.

    Raises:
        InputError: another dtype: an integer or narrower one would truncate the gradients
            (and then fail the read's norms check as if the store were damaged).
    """
    name = None
    if dtype is not None and not isinstance(dtype, bool):  # np.dtype(None) is float64
        if type(dtype).__module__ == "torch":  # torch.float64, without importing torch
            name = str(dtype).removeprefix("torch.")
        else:
            try:
                name = np.dtype(dtype).name
            except (TypeError, ValueError):
                name = None
    if name in READ_DTYPES:
        return np.dtype(name)
    shown = repr(dtype) if name is None else name  # np.int32 by name, not its class repr
    raise InputError(
        f"{method}(dtype={shown}): reads return float32 (the default) or float64; pass "
        "np.float32 or np.float64 (or 'float32', 'float64', torch.float32, torch.float64). "
        "For another dtype, cast the result (.astype(...), or .to(...) with as_torch=True)."
    )
