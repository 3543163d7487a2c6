"""The head's weight gradient, accumulated in place chunk by chunk.

Backpropagating a chunk of rows through ``F.linear`` the ordinary way gives a new ``(V, d)``
weight gradient per chunk, which is then added to the running sum: two weight-sized tensors
live at once (three if the previous chunk's is still referenced), as much as a large share of
the logits chunking saves. Inside :func:`accumulating_head`, a call ``F.linear(x, w, b)`` on
the head's own (detached) weight ``w`` goes through :class:`_LinearInto` instead, whose
backward adds ``g^T x`` straight into the accumulator (``addmm_``) and ``g`` summed over rows
into the bias accumulator, and returns only the gradient of ``x``: no per-chunk weight
gradient is ever allocated. Any other use of ``w`` in ``fn`` (a penalty on the weight) still
reaches it through autograd, and the caller adds that as before.

Used where it is exact: the weight in float32 or float64 (the accumulator's own dtype) and no
autocast on the weight's device; otherwise ``F.linear`` runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx
from torch.overrides import TorchFunctionMode

__all__ = ["accumulating_head"]


class _LinearInto(torch.autograd.Function):
    """``F.linear(x, w, b)`` whose backward accumulates the weight/bias gradients in place."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,  # (..., d)
        weight: torch.Tensor,  # (V, d)
        bias: torch.Tensor | None,  # (V,)
        acc_w: torch.Tensor,  # (V, d), weight.dtype
        acc_b: torch.Tensor | None,  # (V,)
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.acc = (acc_w, acc_b)  # type: ignore[attr-defined]
        return F.linear(x, weight, bias)  # (..., V)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor  # (..., V)
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        x, weight = ctx.saved_tensors  # (..., d), (V, d)
        acc_w, acc_b = ctx.acc
        g = grad_out.reshape(-1, grad_out.shape[-1])  # (rows, V)
        acc_w.addmm_(g.t(), x.reshape(-1, x.shape[-1]))  # (V, d) += (V, rows) @ (rows, d)
        if acc_b is not None:
            acc_b.add_(g.sum(0))  # (V,)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None  # (..., d)
        return grad_x, None, None, None, None


class _Redirect(TorchFunctionMode):
    """Routes ``F.linear`` calls on the head's weight ``w`` to :class:`_LinearInto`."""

    def __init__(
        self,
        w: torch.Tensor,
        b: torch.Tensor | None,
        acc_w: torch.Tensor,
        acc_b: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.w, self.b, self.acc_w, self.acc_b = w, b, acc_w, acc_b

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and not _autocast_on(self.w.device.type):
            x, weight, bias = _linear_args(args, kwargs)
            if weight is self.w and (bias is None or bias is self.b):
                acc_b = self.acc_b if bias is not None else None
                return _LinearInto.apply(x, weight, bias, self.acc_w, acc_b)
        return func(*args, **kwargs)


def _autocast_on(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _linear_args(args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    names = ("input", "weight", "bias")
    values = list(args) + [None] * (3 - len(args))
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
    return values[0], values[1], values[2]


@contextlib.contextmanager
def accumulating_head(
    w: torch.Tensor,  # (V, d), a detached leaf requiring grad
    b: torch.Tensor | None,  # (V,)
    acc_w: torch.Tensor,  # (V, d)
    acc_b: torch.Tensor | None,  # (V,)
) -> Iterator[None]:
    """While the block runs, ``F.linear(x, w, b)`` accumulates its gradients into ``acc_*``.

    A no-op (``F.linear`` unchanged) unless the accumulator has the weight's own dtype, so the
    sum is exactly what autograd's ``g^T x`` plus ``+=`` would give.
    """
    if acc_w.dtype != w.dtype or (acc_b is not None and b is not None and acc_b.dtype != b.dtype):
        yield
        return
    with _Redirect(w, b, acc_w, acc_b):
        yield
