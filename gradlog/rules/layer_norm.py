"""``nn.LayerNorm`` and ``nn.RMSNorm`` over the trailing ``normalized_shape``, any leading dims.

The affine weight multiplies the normalised input ``x_hat``, so datum b's weight gradient is
``sum_n g_{b,n} * x_hat_{b,n}`` and its bias gradient ``sum_n g_{b,n}``. ``x_hat`` is recomputed
from the captured input with the same functional op as the forward (one elementwise pass).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from gradlog.errors import BackendError
from gradlog.rules.base import Capture, RuleResult, attributes, register_rule, widen

__all__ = ["layer_norm", "per_datum_sum", "rms_norm"]

_WEIGHT_BIAS = attributes("weight", "bias")  # not e.g. prune's weight_orig


def per_datum_sum(t: torch.Tensor, batch_size: int, n_trailing: int) -> torch.Tensor:
    """Sum ``t`` (B, ..., *trailing) over the middle dimensions: (B, *trailing)."""
    trailing = t.shape[t.dim() - n_trailing :]
    if t.dim() < n_trailing + 1 or t.shape[0] != batch_size:
        raise BackendError(
            f"normalisation input of shape {tuple(t.shape)} has no batch dimension of size "
            f"B={batch_size} before its normalised dimensions {tuple(trailing)}."
        )
    return t.reshape(batch_size, -1, *trailing).sum(1)  # (B, *trailing)


def _normalized_dims(module: nn.Module) -> int:
    return len(cast(tuple[int, ...], module.normalized_shape))


def _affine(
    x_hat: torch.Tensor, cap: Capture, wanted: frozenset[str], n_trailing: int, dtype: torch.dtype
) -> RuleResult:
    B = cap.batch_size
    g = cap.grad_output.to(dtype)  # (B, ..., *shape)
    out: RuleResult = {}
    if "weight" in wanted:
        out["weight"] = per_datum_sum(g * x_hat.to(dtype), B, n_trailing).mul_(cap.scale)
    if "bias" in wanted:
        out["bias"] = per_datum_sum(g, B, n_trailing).mul_(cap.scale)  # (B, *shape)
    return out


@register_rule(nn.LayerNorm, name="layer_norm", feature_dims=_normalized_dims,
               covers=_WEIGHT_BIAS)
def layer_norm(module: nn.LayerNorm, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """LayerNorm: ``x_hat = (x - mean) / sqrt(var + eps)`` over ``normalized_shape``."""
    shape, dtype = tuple(module.normalized_shape), _param_dtype(module)
    x = widen(cap.input, dtype)  # autocast: normalise in the parameters' precision
    x_hat = F.layer_norm(x, shape, None, None, module.eps)  # (B, ..., *shape)
    return _affine(x_hat, cap, wanted, len(shape), dtype)


def _param_dtype(module: nn.Module) -> torch.dtype:
    weight = getattr(module, "weight", None)  # (a plain attribute read: no generator)
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    return next(module.parameters()).dtype


if hasattr(nn, "RMSNorm"):  # torch >= 2.4

    @register_rule(nn.RMSNorm, name="rms_norm", feature_dims=_normalized_dims,
                   covers=attributes("weight"))
    def rms_norm(module: nn.RMSNorm, cap: Capture, wanted: frozenset[str]) -> RuleResult:
        """RMSNorm: ``x_hat = x / sqrt(mean(x^2) + eps)`` over ``normalized_shape``."""
        shape, dtype = tuple(module.normalized_shape), _param_dtype(module)
        x = widen(cap.input, dtype)  # autocast: normalise in the parameters' precision
        x_hat = F.rms_norm(x, shape, None, module.eps)  # (B, ..., *shape)
        return _affine(x_hat, cap, wanted, len(shape), dtype)
