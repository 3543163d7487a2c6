"""``nn.Conv1d`` / ``nn.Conv2d`` with any stride, padding (incl. ``"same"`` and non-zero
padding modes), dilation and groups.

A convolution is a Linear layer over the unfolded input patches: with ``U`` = unfold(x)
(B, C_in*k, L) and ``G`` (B, C_out, L), datum b's weight gradient is ``G_b U_b^T`` per group,
exactly the batch's weight gradient restricted to one datum. Conv1d runs as a Conv2d of
height 1.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from gradlog._torch_private import conv_reversed_padding
from gradlog.errors import BackendError
from gradlog.rules.base import Capture, RuleResult, attributes, register_rule

__all__ = ["conv"]


@register_rule(nn.Conv1d, nn.Conv2d, name="conv", covers=attributes("weight", "bias"))
def conv(module: nn.Conv1d | nn.Conv2d, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """Per-datum weight ``G_b U_b^T`` (per group) and bias ``sum_l g_{b,:,l}``."""
    B = cap.batch_size
    nd = 1 if isinstance(module, nn.Conv1d) else 2
    x, g = cap.input, cap.grad_output  # (B, C_in, *in_spatial), (B, C_out, *out_spatial)
    if x.dim() == nd + 1 and B == 1:  # unbatched call
        x, g = x.unsqueeze(0), g.unsqueeze(0)
    if x.dim() != nd + 2 or x.shape[0] != B or g.shape[0] != B:
        raise BackendError(
            f"{type(module).__name__} input {tuple(x.shape)}: expected (B={B}, C, ...) with the "
            "batch first."
        )
    dtype = module.weight.dtype
    c_out = module.out_channels
    groups = module.groups
    out: RuleResult = {}
    g = g.to(dtype).reshape(B, c_out, -1)  # (B, C_out, L)
    if "weight" in wanted:
        padding: tuple[int, ...]
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, conv_reversed_padding(module), mode=mode)  # padded input
            padding = (0,) * nd
        else:
            padding = tuple(module.padding)
        kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
        if nd == 1:  # as a 2-D convolution of height 1
            x = x.unsqueeze(2)  # (B, C_in, 1, L_in)
            kernel, stride = (1, kernel[0]), (1, stride[0])
            dilation, padding = (1, dilation[0]), (0, padding[0])
        cols = F.unfold(x.to(dtype), kernel, dilation=dilation, padding=padding, stride=stride)
        # cols: (B, C_in*k, L) with channels outermost, matching weight's (C_in/groups, *k)
        if cols.shape[-1] != g.shape[-1]:
            raise BackendError(
                f"{type(module).__name__}: unfolded {cols.shape[-1]} positions but the output "
                f"gradient has {g.shape[-1]}; please report this with the layer's options."
            )
        cols = cols.reshape(B, groups, -1, cols.shape[-1])  # (B, groups, C_in/groups*k, L)
        gg = g.reshape(B, groups, c_out // groups, -1)  # (B, groups, C_out/groups, L)
        lhs = gg.reshape(B * groups, -1, gg.shape[-1])  # (B*groups, C_out/g, L)
        rhs = cols.reshape(B * groups, -1, cols.shape[-1]).transpose(1, 2)  # (.., L, C_in/g*k)
        w = cap.empty((B * groups, lhs.shape[1], rhs.shape[2]), dtype, x.device)
        w.baddbmm_(lhs, rhs, beta=0.0, alpha=cap.scale)  # (B*groups, C_out/g, C_in/g*k)
        out["weight"] = w.reshape(B, *module.weight.shape)  # (B, *weight)
    if "bias" in wanted:
        out["bias"] = g.sum(2).mul_(cap.scale)  # (B, C_out)
    return out
