"""The buffer pool: CPU memory for per-datum results, reused across backwards.

Fresh CPU memory is page-faulted in on first touch, and glibc hands large freed blocks back to
the system, so without reuse every step pays the faults again (measured: ~10 ms of a 55 ms
step of the small GPT). A buffer comes back to the pool once gradlog holds the only reference
to it, which is read from Python's and torch's reference counts.
"""

from __future__ import annotations

import sys

import torch

from gradlog._torch_private import storage_use_count

__all__ = ["BufferPool"]

_WATCH = 3  # backwards a held pool buffer is watched for its holder to let go


class BufferPool:
    """CPU buffers for per-datum results, reused by a later backward once gradlog holds the
    only reference to them (the caller has let go of that step's gradients: written, copied
    or dropped). A buffer that anyone still holds (the returned dict, a numpy view, a slice,
    a writer queue) is never reused while held, but is watched for :data:`_WATCH` more
    backwards: the recorder's writer lets go of a step's gradients a step or two later, and
    reusing them then saves faulting in a whole step of fresh memory (422 MiB for the medium
    GPT). Off CPU, torch's caching allocator already reuses memory and the pool stays out of
    the way."""

    def __init__(self) -> None:
        self._lent: list[tuple[torch.Tensor, int]] = []  # (buffer, backwards it was held)
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def reclaim(self) -> None:
        """Make buffers handed out earlier, and now held by nobody else, available again;
        keep watching the others for a few backwards, then forget them (their holders free
        them as usual)."""
        free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        lent, self._lent = self._lent, []
        while lent:
            t, held = lent.pop()
            if _BASELINE is not None and _references(t) == _BASELINE:  # as in _calibrate
                free.setdefault((tuple(t.shape), t.dtype), []).append(t)
            elif _BASELINE is not None and held < _WATCH:
                self._lent.append((t, held + 1))
            del t
        self._free = free

    def release(self) -> None:
        """Drop the buffers this backward did not reuse (the batch size or model changed)."""
        self._free = {}

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """An uninitialised tensor, from the pool where possible."""
        if device.type != "cpu" or _BASELINE is None:
            return torch.empty(shape, dtype=dtype, device=device)
        stack = self._free.get((tuple(shape), dtype))
        t = stack.pop() if stack else torch.empty(shape, dtype=dtype, device=device)
        self._lent.append((t, 0))
        return t


def _references(t: torch.Tensor) -> tuple[int, int]:
    """(Python references to ``t``, references to its storage), as seen by a caller that
    holds ``t`` in exactly one local variable."""
    return sys.getrefcount(t), storage_use_count(t)


def _calibrate() -> tuple[int, int] | None:
    """The counts of a tensor only the pool holds, measured on this interpreter and torch
    exactly the way BufferPool.reclaim measures them; None (no reuse) if they cannot be
    read."""
    lent = [torch.empty(1)]
    t = lent.pop()
    refs = _references(t)
    return None if refs[1] < 0 else refs


_BASELINE = _calibrate()
