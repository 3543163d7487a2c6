"""``batch_grad="sum"``: Linear layers whose batch weight gradient is the sum of the records.

The hooks backend keeps the user's backward untouched by default, so a recorded Linear layer
costs two weight-gradient matmuls: autograd's own ``G^T A`` for ``p.grad`` and the per-datum
``G_b^T A_b``. With ``batch_grad="sum"`` the backend replaces the output of each plain
``nn.Linear`` (and transformers' ``Conv1D``) it records by :class:`FusedLinear`, whose
backward returns ``sum_b w_b G_b^T A_b`` from the per-datum gradients the rule just computed
as the weight gradient, so autograd's weight-gradient matmul never runs (ExpandedWeights and
``vmap`` do the same). ``p.grad`` then equals the ordinary gradient to float rounding (the
sum runs in another order), not bitwise; DESIGN.md section 2 allows exactly this.

Nothing else changes: autograd still accumulates ``p.grad`` (tied weights, gradient
accumulation and DDP's reducer hooks behave as usual), the input and bias gradients are the
ordinary ones, and a backward gradlog does not record (``torch.autograd.grad`` for probes, a
user's own ``loss.backward()``) gets the batch matmul ``G^T A`` computed here instead. The
forward is not repeated: like :class:`gradlog.sparse.compact.CompactLinear`, the function takes the
output the module already computed, outside autograd's view of its inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradlog._torch_private import is_functorch_wrapped
from gradlog.rules.linear import is_gpt2_conv1d

__all__ = ["FusedLinear", "FusedLink", "fusable", "fuse_output"]


class FusedLink:
    """Between one forward call and its backward: the output to hand over, then the batch
    weight gradient the hooks backend computed from that call's per-datum gradients."""

    __slots__ = ("on_grad", "out", "weight_grad")

    def __init__(self, out: torch.Tensor) -> None:
        self.out: torch.Tensor | None = out
        self.weight_grad: torch.Tensor | None = None
        # the hooks backend's handler of the output gradient (instead of a tensor hook on the
        # output: one Python call less per layer); it sets weight_grad, and returns False
        # when it let the gradient pass (a backward it does not record: kept for the next)
        self.on_grad: Callable[[torch.Tensor], bool] | None = None


class FusedLinear(torch.autograd.Function):
    """``y = x W^T + b`` (``transposed``: ``y = x W + b``, W stored (d_in, d_out)) whose weight
    gradient comes from the per-datum gradients when the hooks backend has computed them."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        link: FusedLink,
        transposed: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.link = link
        ctx.transposed = transposed
        ctx.has_bias = bias is not None
        out, link.out = link.out, None
        if out is None:  # pragma: no cover - each link serves one call
            raise RuntimeError("FusedLinear link reused")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        link: FusedLink = ctx.link
        if link.on_grad is not None and link.on_grad(grad):
            link.on_grad = None  # per-datum gradients of this call, their sum in weight_grad
        if torch.is_grad_enabled():  # create_graph=True: gradients that will be differentiated
            link.weight_grad = None  # (the records' sum is not): the ordinary products below
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        d_out = grad.shape[-1]
        g = grad.reshape(-1, d_out)  # (N, d_out)
        grad_x = grad_w = grad_b = None
        if need_x:
            w = weight.t() if ctx.transposed else weight  # (d_out, d_in)
            grad_x = g.mm(w).view(*grad.shape[:-1], w.shape[1])  # (..., d_in)
        if need_w:
            grad_w, link.weight_grad = link.weight_grad, None
            if grad_w is None:  # a backward gradlog does not record: the batch matmul
                x2 = x.reshape(-1, x.shape[-1])  # (N, d_in)
                # the products autograd's own linear backward forms (same operands, same
                # order), so that steps gradlog does not record train as without it
                grad_w = x2.t().mm(g) if ctx.transposed else g.t().mm(x2)
        if need_b and ctx.has_bias:
            grad_b = g.sum(0)  # (d_out,)
        return grad_x, grad_w, grad_b, None, None


def fusable(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` forward (subclasses overriding it compute something else), or
    transformers' GPT-2 ``Conv1D`` (matched by name: transformers is never imported)."""
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    return is_gpt2_conv1d(module)


def fuse_output(
    module: nn.Module, args: tuple[Any, ...], output: Any
) -> tuple[torch.Tensor, FusedLink] | None:
    """The module's output re-rooted on :class:`FusedLinear` and its link, or None when this
    call is not a plain float Linear call (autocast, unusual shapes: left to autograd)."""
    weight = module.weight
    x = args[0] if len(args) == 1 else None
    if (
        not isinstance(x, torch.Tensor)
        or not isinstance(output, torch.Tensor)
        or not isinstance(weight, torch.Tensor)
        or not weight.requires_grad
        or output.dtype != weight.dtype  # autocast ran the matmul in a narrower dtype
        or x.dtype != weight.dtype
        or x.dim() < 1
        or is_functorch_wrapped(output)  # inside torch.func transforms: plain autograd Functions
    ):
        return None
    transposed = not isinstance(module, nn.Linear)
    d_in, d_out = (weight.shape[0], weight.shape[1]) if transposed else (
        weight.shape[1], weight.shape[0])
    if tuple(output.shape) != (*x.shape[:-1], d_out) or x.shape[-1] != d_in:
        return None
    bias = module.bias if isinstance(getattr(module, "bias", None), torch.Tensor) else None
    link = FusedLink(output.detach())
    return FusedLinear.apply(x, weight, bias, link, transposed), link
