"""Backends compute per-datum gradients; ``BACKENDS`` is the closed set, by name."""

from __future__ import annotations

from gradlog.backends.base import Backend, LossFn, PerDatumGrads
from gradlog.backends.loop import LoopBackend
from gradlog.backends.vmap import VmapBackend

__all__ = ["BACKENDS", "Backend", "LossFn", "PerDatumGrads"]

BACKENDS: dict[str, type[Backend]] = {
    LoopBackend.name: LoopBackend,
    VmapBackend.name: VmapBackend,
}
