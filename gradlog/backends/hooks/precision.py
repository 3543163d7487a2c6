"""Autocast, as the hooks backend sees it.

Under ``torch.autocast`` captured inputs and output gradients may be bfloat16 or float16 while
parameters are float32: rules run with autocast off and widen them; the dtypes seen here set
the tolerance of the checks (:func:`gradlog.backends.base.check_tolerance`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

__all__ = ["autocast_dtype", "narrow_dtype", "no_autocast"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs ``device_type`` ops in here, or None when it is off (or this
    torch cannot say)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # torch without these signatures
        return None


def no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Rules compute in the parameters' dtype even if the caller's backward runs in autocast."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return contextlib.nullcontext()
    except TypeError:  # torch without the device_type argument: always disable it
        pass
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type without autocast support
        return contextlib.nullcontext()


def narrow_dtype(grads: list[torch.Tensor | None],
                 params: tuple[nn.Parameter, ...]) -> torch.dtype | None:
    """The dtype of the call's output gradients if it is a narrower floating dtype than its
    parameters' (the layer ran under autocast), else None."""
    dtype = params[0].dtype
    if all(g is None or g.dtype == dtype for g in grads) and all(
            p.dtype == dtype for p in params):
        return None  # the usual case, without finfo lookups
    bits = min((torch.finfo(p.dtype).bits for p in params if p.is_floating_point()), default=0)
    for g in grads:
        if g is not None and g.is_floating_point() and torch.finfo(g.dtype).bits < bits:
            return g.dtype
    return None
