"""Device -> host staging: what the recorder hands to the store writer.

The store writer takes host numpy arrays only, and rounds them to the storage dtype unless
they already are (:func:`gradlog.store.dtypes.as_stored`: bfloat16 as its 16-bit pattern).
A CUDA array is rounded here, in torch, on its device (bfloat16 halves the bytes to copy) and
copied into a pinned host buffer without blocking; the writer thread waits on
:attr:`Staged.ready` before reading it. A CPU float32 array is handed over as it is, without
a copy (the writer thread rounds it, bitwise as torch does); others are rounded here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from gradlog.store.dtypes import StorageDtype, bitround_int32

__all__ = ["Staged", "stage", "to_host", "to_storage_torch"]


def to_storage_torch(tensor: torch.Tensor, dtype: StorageDtype) -> torch.Tensor:
    """Round a tensor to the storage dtype, on its own device; returns a tensor of the array
    dtype's size (bfloat16 as its int16 bit pattern). Bitwise what
    :func:`gradlog.store.dtypes.to_storage_numpy` gives for float32 values."""
    if dtype.name in ("float32", "float64", "float16", "int64"):
        return tensor.to(getattr(torch, dtype.name))
    if dtype.name == "bfloat16":
        return tensor.to(torch.bfloat16).view(torch.int16)
    assert dtype.keepbits is not None  # every other storage dtype is bitroundN
    bits = tensor.to(torch.float32, copy=True).contiguous().view(torch.int32)
    return bitround_int32(bits, dtype.keepbits).view(torch.float32)  # type: ignore[no-any-return]


class Staged(NamedTuple):
    """Arrays and norms on their way to the writer.

    Attributes:
        arrays: Parameter -> array name -> host array (float32, or already in its storage
            array dtype). Those copied from a CUDA device are valid only once :attr:`ready`
            has synchronized.
        norms: Parameter -> its records' exact norms ``(B,)`` float64 on the host, valid
            (like ``arrays``) once :attr:`ready` has synchronized.
        ready: A ``torch.cuda.Event`` recorded after the last device copy (its
            ``synchronize()`` waits for them), or None when everything is ready.
    """

    arrays: dict[str, dict[str, np.ndarray]]
    norms: dict[str, np.ndarray]
    ready: Any


def _as_array(stored: torch.Tensor, dtype: StorageDtype) -> np.ndarray:
    """A host tensor's numpy view in the array dtype (bfloat16 bits: int16 -> uint16)."""
    out = stored.numpy()
    return out if out.dtype == dtype.array_dtype else out.view(dtype.array_dtype)


def _plain(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` detached and in ``dtype``, without a dispatcher call where it already is (the
    norms and arrays come from no-grad code: two calls a parameter were ~400 a step)."""
    if t.requires_grad:
        t = t.detach()
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def stage(
    encoded: Mapping[str, Mapping[str, torch.Tensor]],
    dtypes: Mapping[str, Mapping[str, StorageDtype]],
    norms: Mapping[str, torch.Tensor],
) -> Staged:
    """Bring each array and each parameter's norms to host memory (see the module doc for
    where arrays are rounded). CUDA tensors go through pinned buffers without blocking, all
    behind one event: the training thread never waits for the device here.

    Args:
        encoded: Parameter -> its form's arrays ``(B, ...)`` (:func:`gradlog.planning.encode`).
        dtypes: Parameter -> array name -> its storage dtype.
        norms: Parameter -> its records' exact norms ``(B,)`` float64, on any device.
    """
    event = None
    host_norms: dict[str, np.ndarray] = {}
    on_device: dict[torch.device, list[str]] = {}
    for name, sq in norms.items():
        on_device.setdefault(sq.device, []).append(name)
    for device, names in on_device.items():  # one stack per device (was a .numpy() or a
        # blocking .cpu() per parameter, then a copy each: ~150 launches a step on a GPU)
        stacked = torch.stack([_plain(norms[n], torch.float64) for n in names])  # (n, B)
        if device.type == "cuda":  # one pinned copy, no sync
            host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            stacked = host
        host_norms.update(zip(names, stacked.cpu().numpy()))
    host_norms = {name: host_norms[name] for name in norms}  # (the parameters' order)
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name, tensors in encoded.items():
        arrays[name] = {}
        for key, tensor in tensors.items():
            dtype = dtypes[name][key]
            tensor = _plain(tensor)
            if tensor.is_cuda:  # rounded on the device; the copy overlaps the next compute
                stored = to_storage_torch(tensor, dtype)
                host = torch.empty(stored.shape, dtype=stored.dtype, pin_memory=True)
                host.copy_(stored, non_blocking=True)
                if event is None:
                    event = torch.cuda.Event()
                arrays[name][key] = _as_array(host, dtype)
            elif tensor.device.type == "cpu" and tensor.dtype == torch.float32:
                # No copy: the writer thread rounds float32 values (as_stored), bitwise as
                # to_storage_torch would, off the training thread.
                arrays[name][key] = tensor.numpy()
            else:
                arrays[name][key] = to_host(tensor, dtype)
    if event is not None:
        event.record()  # after every copy, on the current stream
    return Staged(arrays, host_norms, event)


def to_host(tensor: torch.Tensor, dtype: StorageDtype) -> np.ndarray:
    """One tensor rounded to its storage dtype, as a host array (blocking)."""
    return _as_array(to_storage_torch(tensor.detach(), dtype).cpu(), dtype)
