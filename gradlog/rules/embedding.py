"""``nn.Embedding``: sparse rows, at most N non-zero rows per datum (N = its index count).

Datum b's gradient adds its output gradient ``g_{b,n}`` to row ``idx_{b,n}``. The rule returns
these rows as :class:`~gradlog.grads.Rows`; the backend adds them into the
``(B, V, D)`` result with one ``index_add_`` (the backend interface returns dense per-datum
gradients, so that tensor is allocated once, zeroed, and never densified twice; a tied head
adds its dense part into the same tensor). Shared indices (``[1, T]`` or ``[T]`` position ids)
arrive expanded to the batch size: each datum uses the shared indices with its own output
gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from gradlog.errors import BackendError
from gradlog.grads import Rows
from gradlog.rules.base import (
    Capture,
    RuleResult,
    attributes,
    one_feature_dim,
    register_rule,
)

__all__ = ["embedding"]


@register_rule(nn.Embedding, name="embedding", feature_dims=one_feature_dim,
               covers=attributes("weight"))
def embedding(module: nn.Embedding, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """Rows ``idx_{b,n}`` of datum b get ``g_{b,n}``; ``padding_idx`` rows get nothing;
    ``scale_grad_by_freq`` divides by each index's count in the whole call (as autograd
    does, so per-datum gradients sum to ``p.grad``)."""
    if "weight" not in wanted:
        return {}
    B, D = cap.batch_size, module.embedding_dim
    idx, g = cap.input, cap.grad_output  # (B, *S) int, (B, *S, D)
    if idx.dim() == 0 or idx.shape[0] != B or tuple(g.shape) != (*idx.shape, D):
        raise BackendError(
            f"Embedding indices of shape {tuple(idx.shape)} with output gradient "
            f"{tuple(g.shape)}: expected (B={B}, ...) and (B, ..., {D})."
        )
    index = idx.reshape(B, -1)  # (B, N)
    values = g.reshape(B, -1, D).to(module.weight.dtype)  # (B, N, D)
    if module.padding_idx is not None:
        pad = index == module.padding_idx  # (B, N)
        values = values.masked_fill(pad.unsqueeze(-1), 0.0)  # (B, N, D)
    if module.scale_grad_by_freq:
        used = idx[0] if cap.expanded else idx  # the indices autograd counted
        counts = torch.bincount(used.reshape(-1), minlength=module.num_embeddings)  # (V,)
        values = values / counts[index].unsqueeze(-1).to(values.dtype)  # (B, N, D)
    return {"weight": Rows(index, values, module.num_embeddings, cap.scale)}
