"""Keep glibc's heap resident while per-datum gradients are computed on the CPU.

Torch allocates CPU tensors with ``malloc``. glibc hands the top of its heap back to the
system whenever more than a threshold of it is free, and serves large blocks with fresh
``mmap`` until its adaptive threshold has grown, so memory freed by one op and needed by the
next is page-faulted in again (and zeroed by the kernel). A plain training step settles into
a pattern with no faults; the per-datum buffers a recorded step holds (the backend reuses its
own, see :class:`gradlog.backends.hooks.pool.BufferPool`) shift the heap so that autograd's
own temporaries fault every step:
measured on the small GPT of tests/benchmarks/bench_compute.py, ~2,000 faults and ~3.7 ms
of a 46 ms step, on the medium ~27,000 faults and ~50 ms of its backward.

:func:`keep_heap_resident` sets two of glibc's ``mallopt`` parameters once per process:
``M_MMAP_THRESHOLD`` to 32 MiB (the ceiling glibc's adaptive threshold reaches by itself) and
``M_TOP_PAD`` to :data:`DEFAULT_PAD_MB` MiB (free memory kept at the top of the heap instead
of being returned), as ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TOP_PAD_`` would if set in the
environment. Freed memory then stays with the process rather than going back to the system:
up to the pad at the top of the heap, and blocks under 32 MiB freed inside it (as glibc does
by itself once its adaptive threshold has grown). It is process-wide and cannot be undone
(glibc has no getter), so it is documented, and skipped:

- with ``GRADLOG_HEAP_PAD_MB=0`` (or another size in MiB to use instead),
- when the user tuned malloc already (``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TRIM_THRESHOLD_`` in the environment),
- off Linux/glibc (musl, macOS, Windows), where there is no ``mallopt`` of this kind.
  A preloaded jemalloc or tcmalloc ignores glibc's settings, which is harmless.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

__all__ = ["DEFAULT_PAD_MB", "ENV", "keep_heap_resident"]

log = logging.getLogger("gradlog")

ENV = "GRADLOG_HEAP_PAD_MB"
DEFAULT_PAD_MB = 32
_M_TOP_PAD = -2  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
_USER_TUNED = ("MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_done: bool | None = None  # the outcome of the first call


def _pad_bytes() -> int:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_PAD_MB << 20
    try:
        mb = float(raw)
    except ValueError:
        log.warning("gradlog: %s=%r is not a size in MiB; using %d.", ENV, raw, DEFAULT_PAD_MB)
        return DEFAULT_PAD_MB << 20
    return max(0, int(mb * (1 << 20)))


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") else None
    except OSError:  # pragma: no cover - a static or unusual interpreter
        return None


def keep_heap_resident() -> bool:
    """Apply the settings of the module docstring once per process; True if they are set
    (by this call or an earlier one)."""
    global _done
    if _done is not None:
        return _done
    pad = _pad_bytes()
    tuned = [k for k in _USER_TUNED if k in os.environ]
    libc = None if pad == 0 or tuned else _libc()
    if libc is None:
        _done = False
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TOP_PAD, pad))
    if ok:
        log.debug("gradlog: glibc heap kept resident (M_TOP_PAD %d MiB)", pad >> 20)
    _done = ok
    return ok
