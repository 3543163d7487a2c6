"""``nn.Embedding``: sparse rows, at most N non-zero rows per datum (N = its index count).

Datum b's gradient adds its output gradient ``g_{b,n}`` to row ``idx_{b,n}``. The rule returns
these rows as :class:`~gradlog.grads.Rows`; the backend adds them into the
``(B, V, D)`` result with one ``index_add_`` (the backend interface returns dense per-datum
gradients, so that tensor is allocated once, zeroed, and never densified twice; a tied head
adds its dense part into the same tensor). Shared indices (``[1, T]`` or ``[T]`` position ids)
arrive expanded to the batch size: each datum uses the shared indices with its own output
gradient. A subclass whose forward scales the lookup by a constant (transformers' scaled
word embeddings) gets the same rows, scaled, once a replay has found the constant.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from gradlog.errors import BackendError
from gradlog.grads import Rows
from gradlog.rules.base import (
    Capture,
    RuleResult,
    attributes,
    forward_call,
    one_feature_dim,
    register_rule,
)

__all__ = ["embedding", "is_scaled_embedding", "scaled_embedding"]


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
    index = idx.reshape(B, -1).long()  # (B, N) (int32 ids too: torch takes both)
    values = g.reshape(B, -1, D).to(module.weight.dtype)  # (B, N, D)
    if module.padding_idx is not None:
        pad = index == module.padding_idx  # (B, N)
        values = values.masked_fill(pad.unsqueeze(-1), 0.0)  # (B, N, D)
    if module.scale_grad_by_freq:
        used = idx[0] if cap.expanded else idx  # the indices autograd counted
        counts = torch.bincount(used.reshape(-1), minlength=module.num_embeddings)  # (V,)
        values = values / counts[index].unsqueeze(-1).to(values.dtype)  # (B, N, D)
    return {"weight": Rows(index, values, module.num_embeddings, cap.scale)}


def is_scaled_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass with a forward of its own (transformers' scaled word
    embeddings: BART's, Gemma 3's, ...), which :func:`scaled_embedding` replays."""
    return isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward


_SCALES: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()
_REPLAY_ELEMENTS = 1 << 23  # at most this many entries in each of the replay's two tables


@register_rule(name="scaled_embedding", accepts=is_scaled_embedding,
               feature_dims=one_feature_dim, covers=attributes("weight"))
def scaled_embedding(module: nn.Embedding, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """``c * embedding(idx)`` for a constant ``c`` (``embed_scale``): the rows of
    :func:`embedding`, scaled. The first call is replayed in float64 at two random weights
    against ``F.embedding``; ``c`` is their ratio, the same at both (a forward computing
    otherwise, or scaling by something else than a constant, is re-run per datum: without
    this rule every such embedding's per-datum gradients were materialised, (B, V, D))."""
    from gradlog.rules.func import generic
    from gradlog.rules.replay import replays

    tensors = [t for t in (*cap.args, *cap.kwargs.values()) if isinstance(t, torch.Tensor)]
    if len(tensors) != 1 or tensors[0].is_floating_point() or module.max_norm is not None:
        return generic(module, cap, wanted)
    idx = tensors[0]
    # The replay's tables hold only the rows this call reads (its indices renumbered), not
    # the vocabulary: Gemma 3's, 262K x 2560, twice in float64, would take 10 GiB.
    used, renumbered = torch.unique(idx, return_inverse=True)
    rows = max(used.numel(), -1 if module.padding_idx is None else module.padding_idx + 1)
    if rows * module.embedding_dim > _REPLAY_ELEMENTS and module not in _SCALES:
        return generic(module, cap, wanted)
    made: dict[str, torch.Tensor] = {}  # (built on the first call only: replays caches)

    def probe() -> tuple[torch.Tensor, torch.Tensor]:
        if not made:
            generator = torch.Generator().manual_seed(0)
            made["w"] = torch.randn(2, rows, module.embedding_dim, dtype=torch.float64,
                                    generator=generator).to(idx.device)
        return renumbered, made["w"]

    def theirs() -> torch.Tensor:
        ids, w = probe()
        return torch.stack([forward_call(module, {"weight": w_}, (ids,)) for w_ in w])

    def ours() -> tuple[torch.Tensor]:
        ids, w = probe()
        plain = torch.stack([F.embedding(ids, w_, module.padding_idx) for w_ in w])
        got = theirs()
        made["c"] = (got * plain).sum() / (plain * plain).sum().clamp_min(1e-300)
        return (made["c"] * plain,)

    if replays(module, "", theirs, ours, 1) and "c" in made:  # (the first call's verdict)
        _SCALES[module] = float(made["c"])
    if not replays(module, "", theirs, ours, 1) or module not in _SCALES:
        return generic(module, cap, wanted)
    out = embedding(module, cap, wanted)
    rows = out.get("weight")
    if isinstance(rows, Rows):
        out["weight"] = Rows(rows.index, rows.values, rows.num_rows, rows.scale * _SCALES[module])
    return out
