"""From what the caller gives (per-datum or per-token losses) to one loss per datum."""

from __future__ import annotations

import torch

from gradlog.errors import InputError

__all__ = ["per_datum_losses"]


def per_datum_losses(
    losses: torch.Tensor, mask: torch.Tensor | None, token_reduction: str
) -> torch.Tensor:
    """Reduce ``(B,)`` or ``(B, T)`` losses to ``(B,)``: datum b's loss over its own tokens.

    With ``(B, T)`` losses, ``mask`` (bool or 0/1, same shape) marks the tokens that count;
    ``token_reduction`` is ``"mean"`` over a datum's unmasked tokens or their ``"sum"``. A
    datum with no unmasked token has loss 0 and gradient 0. Works under ``torch.func.vmap``.
    """
    if not isinstance(losses, torch.Tensor):
        raise InputError(
            f"losses must be a torch.Tensor of shape (B,) or (B, T), got {type(losses).__name__}."
        )
    if not losses.is_floating_point():
        raise InputError(f"losses must be floating point, got dtype {losses.dtype}.")
    if losses.dim() == 1:
        if mask is not None:
            raise InputError(
                "mask applies to per-token losses of shape (B, T); these losses have shape "
                f"{tuple(losses.shape)}. Drop mask, or pass per-token losses (reduction='none')."
            )
        return losses
    if losses.dim() != 2:
        raise InputError(
            f"losses must have shape (B,) per datum or (B, T) per token, got "
            f"{tuple(losses.shape)}. Compute the loss with reduction='none' and reshape it to "
            "(B, T), e.g. F.cross_entropy(logits.transpose(1, 2), y, reduction='none')."
        )
    if mask is None:
        return losses.mean(1) if token_reduction == "mean" else losses.sum(1)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(losses.shape):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InputError(
            f"mask must be a tensor of the losses' shape {tuple(losses.shape)}, got {shape}."
        )
    keep = mask.to(device=losses.device) != 0  # (B, T)
    total = torch.where(keep, losses, torch.zeros_like(losses)).sum(1)  # (B,)
    if token_reduction == "sum":
        return total
    count = keep.sum(1).clamp_min(1).to(losses.dtype)  # (B,)
    return total / count
