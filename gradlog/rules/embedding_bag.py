"""``nn.EmbeddingBag``: each bag is a datum; sparse rows, at most N per bag.

Both call forms: a 2-D input ``(B, N)`` (every row a bag of N indices) and the standard 1-D
input with ``offsets`` (bag b holds ``input[offsets[b]:offsets[b+1]]``; with
``include_last_offset`` the last offset closes the last bag). The bags are laid out as a
padded ``(B, N_max)`` index (positions past a bag's end hold row 0 with a zero value) and
each bag's output gradient ``g_b`` goes to its rows (:class:`~gradlog.grads.Rows`):

- ``sum``: ``g_b`` (times ``per_sample_weights``, when given);
- ``mean``: ``g_b / n_b``, ``n_b`` the bag's indices other than ``padding_idx``;
- ``max``: per feature d, ``g_{b,d}`` goes to the first row of the bag holding the maximum
  (as torch's kernels pick it).

``padding_idx`` entries take no part (nor in a mean's count). The bag count must be the batch
size: one bag per datum. ``scale_grad_by_freq`` is refused (not yet supported): torch's
kernels scale an index's gradient by counts that are not its frequency in the call (measured
on torch 2.13: an index used once in a bag of three gets 1/3), which this rule does not
reproduce; ``backend='loop'`` records it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradlog.errors import BackendError
from gradlog.grads import Rows
from gradlog.rules.base import Capture, RuleResult, attributes, register_rule

__all__ = ["embedding_bag"]


def _call_args(cap: Capture) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(input, offsets, per_sample_weights)`` of a captured ``EmbeddingBag`` call."""
    names = ("input", "offsets", "per_sample_weights")
    found: list[Any] = [cap.args[i] if i < len(cap.args) else cap.kwargs.get(n)
                        for i, n in enumerate(names)]
    return found[0], found[1], found[2]


def _bags(x: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None,
          include_last: bool, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The call's bags as a padded ``(B, N)`` index, a validity mask and the weights."""
    if x.dim() == 2:
        if x.shape[0] != B:
            raise BackendError(
                f"EmbeddingBag input of shape {tuple(x.shape)} holds {x.shape[0]} bags for "
                f"B={B} datums: one bag per datum is expected."
            )
        valid = torch.ones_like(x, dtype=torch.bool)  # (B, N)
        return x, valid, weights
    if offsets is None or x.dim() != 1:
        raise BackendError(
            f"EmbeddingBag input of shape {tuple(x.shape)} without offsets: expected (B, N), "
            "or a 1-D input with offsets."
        )
    off = offsets.to(torch.int64)
    starts = off[:-1] if include_last else off  # (B,)
    ends = off[1:] if include_last else torch.cat([off[1:], off.new_tensor([x.shape[0]])])
    if starts.shape[0] != B:
        raise BackendError(
            f"EmbeddingBag offsets make {starts.shape[0]} bags for B={B} datums: one bag per "
            "datum is expected (pass as many offsets as datums, or reshape the output so "
            "that datum b's bags are row b)."
        )
    lengths = (ends - starts).clamp_min(0)  # (B,)
    n_max = max(int(lengths.max()) if B else 0, 1)
    pos = torch.arange(n_max, device=x.device)  # (N,)
    valid = pos.unsqueeze(0) < lengths.unsqueeze(1)  # (B, N)
    flat = (starts.unsqueeze(1) + pos).clamp(0, max(x.shape[0] - 1, 0))  # (B, N)
    if x.shape[0] == 0:
        index = torch.zeros_like(flat)
        return index, valid, None
    index = x.to(torch.int64)[flat]  # (B, N)
    per = None if weights is None else weights[flat]  # (B, N)
    return index, valid, per


def _refuse(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if getattr(module, "scale_grad_by_freq", False):
        return ("EmbeddingBag(scale_grad_by_freq=True) is not supported yet (torch's kernels "
                "scale by counts this rule does not reproduce); use backend='loop', or "
                "scale_grad_by_freq=False.")
    return None


@register_rule(nn.EmbeddingBag, name="embedding_bag", covers=attributes("weight"),
               refuse=_refuse)
def embedding_bag(module: nn.EmbeddingBag, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """Rows of bag b get its output gradient, as its mode routes it (see the module doc)."""
    if "weight" not in wanted:
        return {}
    B, D = cap.batch_size, module.embedding_dim
    x, offsets, psw = _call_args(cap)
    g = cap.grad_output  # (B, D)
    if tuple(g.shape) != (B, D):
        raise BackendError(
            f"EmbeddingBag output gradient of shape {tuple(g.shape)}: expected (B={B}, {D})."
        )
    index, valid, weights = _bags(x, offsets, psw, module.include_last_offset, B)
    if module.padding_idx is not None:
        valid = valid & (index != module.padding_idx)  # (B, N)
    weight = module.weight
    g = g.to(weight.dtype)
    if module.mode == "max":
        rows = weight.detach()[index.clamp_min(0)]  # (B, N, D)
        rows = rows.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        best = rows.amax(1, keepdim=True)  # (B, 1, D)
        pos = torch.arange(index.shape[1], device=index.device).view(1, -1, 1)  # (1, N, 1)
        first = torch.where(rows == best, pos, index.shape[1]).amin(1, keepdim=True)  # (B,1,D)
        hit = (pos == first) & valid.unsqueeze(-1)  # (B, N, D)
        values = torch.where(hit, g.unsqueeze(1), torch.zeros((), dtype=g.dtype,
                                                                device=g.device))  # (B, N, D)
    else:
        values = g.unsqueeze(1).expand(B, index.shape[1], D)  # (B, N, D)
        if weights is not None:
            values = values * weights.to(g.dtype).unsqueeze(-1)  # (B, N, D)
        if module.mode == "mean":
            count = valid.sum(1).clamp_min(1).to(g.dtype)  # (B,)
            values = values / count.view(B, 1, 1)  # (B, N, D)
        values = values.masked_fill(~valid.unsqueeze(-1), 0.0)  # (B, N, D)
    # Positions outside a bag (and padding_idx) carry zero rows at index 0: they add nothing
    # (the hooks accumulator does not skip Rows' -1 padding).
    index = index.masked_fill(~valid, 0)  # (B, N)
    values = values.masked_fill(~valid.unsqueeze(-1), 0.0)  # (B, N, D)
    return {"weight": Rows(index, values.contiguous(), module.num_embeddings, cap.scale)}
