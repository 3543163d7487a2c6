"""An independent oracle for per-datum gradients: each datum's own forward and backward.

Unlike the ``loop`` backend, which differentiates each datum's loss through the batch's shared
graph, the oracle runs the model on a batch of one. It agrees with every backend exactly when
the model does not couple datums, which is what gradlog's semantics assume.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["naive_per_datum_grads"]


def naive_per_datum_grads(
    datum_loss: Callable[[int], torch.Tensor],
    params: Mapping[str, nn.Parameter],
    batch_size: int,
) -> dict[str, torch.Tensor]:
    """Per-datum gradients ``(B, *shape)`` from one separate forward+backward per datum.

    Args:
        datum_loss: ``datum_loss(b)`` runs the model on datum ``b`` alone and returns its
            scalar loss.
        params: Parameters to differentiate, by name.
        batch_size: Number of datums B.
    """
    names = list(params)
    out = {n: torch.zeros((batch_size, *params[n].shape), dtype=params[n].dtype) for n in names}
    for b in range(batch_size):
        loss = datum_loss(b)
        grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            if g is not None:
                out[n][b] = g.detach()
    return out
