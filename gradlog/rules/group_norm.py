"""``nn.GroupNorm`` on (B, C, *spatial): per-channel affine over normalised groups.

Datum b's weight gradient is ``sum_s g_{b,c,s} * x_hat_{b,c,s}`` per channel c and its bias
gradient ``sum_s g_{b,c,s}``; ``x_hat`` is recomputed with ``F.group_norm`` without affine.
Statistics are per datum, so GroupNorm never couples the batch (unlike BatchNorm in training).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from gradlog.errors import BackendError
from gradlog.rules.base import Capture, RuleResult, attributes, register_rule, widen

__all__ = ["group_norm"]


@register_rule(nn.GroupNorm, name="group_norm", covers=attributes("weight", "bias"))
def group_norm(module: nn.GroupNorm, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """GroupNorm affine parameters, per channel, summed over spatial positions."""
    B, C = cap.batch_size, module.num_channels
    x, g = cap.input, cap.grad_output  # (B, C, *spatial)
    if x.dim() < 2 or x.shape[0] != B or x.shape[1] != C:
        raise BackendError(f"GroupNorm input {tuple(x.shape)}: expected (B={B}, C={C}, ...).")
    dtype = module.weight.dtype
    g = g.to(dtype).reshape(B, C, -1)  # (B, C, S)
    out: RuleResult = {}
    if "weight" in wanted:
        x = widen(x, dtype)  # autocast: normalise in the parameters' precision
        x_hat = F.group_norm(x, module.num_groups, None, None, module.eps)  # (B, C, *spatial)
        out["weight"] = (g * x_hat.to(dtype).reshape(B, C, -1)).sum(2).mul_(cap.scale)  # (B, C)
    if "bias" in wanted:
        out["bias"] = g.sum(2).mul_(cap.scale)  # (B, C)
    return out
