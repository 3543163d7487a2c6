"""Autocast, as the hooks backend sees it.

Under ``torch.autocast`` captured inputs and output gradients may be bfloat16 or float16 while
parameters are float32: rules run with autocast off and widen them; the dtypes seen here set
the tolerance of the checks (:func:`gradlog.backends.base.check_tolerance`).
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch import nn

__all__ = ["autocast_dtype", "call_precision", "narrow_dtype", "no_autocast", "rule_precision"]


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


def call_precision(call: Any, grads: list[torch.Tensor | None]) -> torch.dtype | None:
    """The narrow dtype ``p.grad`` of the call's parameters was rounded in: its gradients'
    (:func:`narrow_dtype`), or, for a module re-run per datum (the fallback, or a rule that
    re-runs it: an RNN, whose CPU kernels ran in autocast's dtype and return float32) or
    matched by what it looks like (a mixture's experts and router: their matmuls ran in
    autocast's dtype, their outputs widened back to float32), the autocast dtype its
    forward ran under. The
    closed-form layers' own dtypes tell (Linear's output gradients are autocast's)."""
    from gradlog.rules.base import MATCHED

    entry = call.entry
    narrow = narrow_dtype(grads, entry.params)
    if narrow is None and call.autocast is not None and (
            entry.fallback or entry.rule.uses_torch_func or entry.rule in MATCHED):
        return cast(torch.dtype, call.autocast)
    return narrow


def rule_precision(call: Any, rule: Any) -> contextlib.AbstractContextManager[Any]:
    """How a call's rule runs: a closed form in the parameters' dtype (:func:`no_autocast`);
    a re-run of the module (``uses_torch_func``) under the autocast its forward ran under, so
    it computes the same function, data-dependent choices included (a router's top-k on
    16-bit logits: re-run in float32, ties and near-ties picked other experts)."""
    device = call.entry.params[0].device.type
    if rule.uses_torch_func and call.autocast is not None:
        return torch.autocast(device_type=device, dtype=call.autocast)
    return no_autocast(device)
