"""State a module's forward reads besides its arguments' values: what the ``torch.func``
fallback must find unchanged when it re-runs the module per datum in the backward.

The re-run takes the arguments the batch's forward took. A module whose forward writes
state it reads, batched by datum, is re-run against the state the batch left:

- a cache object among its arguments (transformers' ``Cache`` classes): Jamba's Mamba mixer
  writes each layer's convolution and recurrent states into the cache it is handed, and its
  re-run continued from them: a shape error at B > 1, and at B = 1 gradients 63% off
  (measured), which only the spot check caught. A re-run cannot split the batched state
  inside such an object either (it passes non-tensor arguments whole): a call whose cache
  holds batched state when it is re-run is refused (:func:`batched_in_caches`), naming the
  fix;
- a tensor the module keeps on itself (RecurrentGemma's RG-LRU stores
  ``self.recurrent_states``): its re-run fails on the batch's shape.
  :func:`batched_attributes` explains such a failure; it does not refuse by itself, since a
  module that only stores an activation on itself (for a probe) re-runs correctly.

Batched: a tensor whose first dimension is the batch's.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gradlog._tree import leaves

__all__ = ["batched_attributes", "batched_in_caches"]

_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device,
          torch.Size, slice, range, enum.Enum, type)
_MAX_DEPTH = 4  # a Cache's layers' states: cache -> layers list -> layer -> tensor
_MAX_ITEMS = 4096  # values looked at per call (the rest is not looked at)


def batched_in_caches(args: tuple[Any, ...], kwargs: dict[str, Any],
                      batch_size: int) -> str | None:
    """Where a cache object among a call's arguments (a class named ``...Cache...``, as
    transformers' are) holds a batched tensor, or None (cheap for a call without one)."""
    budget = [_MAX_ITEMS]
    for i, value in enumerate(leaves((args, kwargs))):
        if isinstance(value, (torch.Tensor, *_ATOMS)) or not any(
                "Cache" in cls.__name__ for cls in type(value).__mro__):
            continue
        for path, t in _tensors(value, f"{type(value).__name__} argument #{i}", 1, budget):
            if t.dim() > 0 and t.shape[0] == batch_size:
                return path
    return None


def batched_attributes(module: nn.Module, batch_size: int) -> list[str]:
    """The tensor attributes (not parameters, not buffers) of ``module`` and its submodules
    whose first dimension is the batch's: state a re-run per datum would read."""
    found: list[str] = []
    budget = [_MAX_ITEMS]
    for prefix, m in module.named_modules(remove_duplicate=True):
        for name, value in vars(m).items():
            if name.startswith("_") or name == "training":
                continue  # torch's own bookkeeping (hooks, parameters' dicts)
            for path, t in _tensors(value, f"{prefix or '(the module)'}.{name}", 1, budget):
                if t.dim() > 0 and t.shape[0] == batch_size:
                    found.append(path)
    return found


def _tensors(value: Any, where: str, depth: int, budget: list[int]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors inside ``value`` (lists, tuples, dicts, objects' attributes), ``depth``
    levels down at most."""
    budget[0] -= 1
    if budget[0] < 0 or isinstance(value, _ATOMS) or callable(value):
        return  # (functions and methods hold no state a re-run reads here)
    if isinstance(value, torch.Tensor):
        yield where, value
        return
    if depth > _MAX_DEPTH or isinstance(value, nn.Module):
        return  # (a module argument's state is its own call's, if it is hooked)
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]", depth + 1, budget)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}[{key!r}]", depth + 1, budget)
    elif hasattr(value, "__dict__"):
        for key, item in vars(value).items():
            yield from _tensors(item, f"{where}.{key}", depth + 1, budget)
