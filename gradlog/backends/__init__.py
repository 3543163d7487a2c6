"""Backends compute per-datum gradients; ``BACKENDS`` is the closed set, by name."""

from __future__ import annotations

from gradlog.backends.base import Backend, LossFn, PerDatumGrads
from gradlog.backends.hooks import HooksBackend
from gradlog.backends.loop import LoopBackend
from gradlog.backends.vmap import VmapBackend

__all__ = ["BACKENDS", "Backend", "LossFn", "PerDatumGrads"]

BACKENDS: dict[str, type[Backend]] = {
    # "auto" picks the best backend for the model; today that is always hooks (which falls
    # back per module to torch.func where it has no rule). The run's attributes record the
    # backend that ran (describe()["name"]), so "auto" stays reproducible.
    "auto": HooksBackend,
    HooksBackend.name: HooksBackend,
    LoopBackend.name: LoopBackend,
    VmapBackend.name: VmapBackend,
}
