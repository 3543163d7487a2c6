"""The reference backend: one ``autograd.grad`` per datum over the shared graph.

Slow (B backward passes) but exact for any model autograd can differentiate; every other
backend is tested against it, and it stays as the fallback for exotic models.
"""

from __future__ import annotations

import torch

from gradlog.backends.base import Backend, PerDatumGrads

__all__ = ["LoopBackend"]


class LoopBackend(Backend):
    """Per-datum gradients by one ``torch.autograd.grad`` per datum (``retain_graph``)."""

    name = "loop"

    def backward(self, losses: torch.Tensor, batch_loss: torch.Tensor) -> PerDatumGrads:
        names = list(self.params)
        tensors = [self.params[n] for n in names]
        out = {n: torch.zeros((len(losses), *p.shape), dtype=p.dtype, device=p.device)
               for n, p in zip(names, tensors)}
        for b in range(len(losses)):
            grads = torch.autograd.grad(losses[b], tensors, retain_graph=True, allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:  # unused by this datum: its gradient is zero
                    out[n][b] = g
        batch_loss.backward()  # the ordinary backward: p.grad exactly as without gradlog
        return out
