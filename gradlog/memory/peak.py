"""Peak bytes of the tensors a block of code allocates, on any device (CPU and ``meta`` too).

On CUDA, ``torch.cuda.max_memory_allocated`` answers this; on CPU torch keeps no statistics
(tensors come from malloc, which ``tracemalloc`` does not see, and a process's peak RSS also
counts the allocator's fragmentation and everything else in the process). :class:`TensorPeak`
counts exactly what the block's operators allocate: it sees every operator's outputs below
autograd (a ``TorchDispatchMode``, so the backward's operators too), adds the bytes of each
storage it has not seen yet, and subtracts them when the storage is freed (a ``weakref`` to
the storage, which torch keeps tied to the C++ storage while it lives). On the ``meta`` device
the same operators run without data or arithmetic, so the peak of a step too large for the
machine is measured in milliseconds, and equals the peak of the same step on CPU.

Not counted: tensors created before the block (its inputs, the parameters), and scratch
memory an operator allocates and frees inside its kernel without returning it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from gradlog._torch_private import DispatchMode, storage_key, tree_leaves

__all__ = ["TensorPeak"]


class TensorPeak(DispatchMode):  # type: ignore[misc]
    """Context manager: live and peak bytes of the tensors allocated inside the block.

    Example::

        with TensorPeak() as mem:
            loss = chunked_linear_loss(x, head, y, ce)
            loss.backward()
        print(mem.peak / 2**20, "MiB at most, beyond the inputs")

    Attributes:
        live: Bytes of the storages allocated inside the block that are still alive.
        peak: The largest value ``live`` reached.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage address -> bytes counted

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _see(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage_key(t)
        nbytes = storage.nbytes()
        known = self._sizes.get(key)
        if known is None and key in inputs:
            return  # an in-place operator or a view of a tensor from before the block
        if known is None:
            self._sizes[key] = nbytes
            self.live += nbytes
            weakref.finalize(storage, self._free, key)
        elif known != nbytes:  # resized in place (an out= operator)
            self._sizes[key] = nbytes
            self.live += nbytes - known
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        inputs = {
            storage_key(t)
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, inputs)
        return out
