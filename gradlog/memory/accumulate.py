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

Used where it is exact: the accumulator in the weight's own dtype. Without autocast the
product is added with ``addmm_``. Under autocast (a float32 weight, a 16-bit autocast dtype)
the call runs as autocast runs it, on 16-bit casts of ``x``, the weight (cast once per
accumulator, as autocast's cache would) and the bias, and its backward adds the same 16-bit
product ``g^T x`` that autograd would hand back, widened by the add: per chunk that is one
16-bit temporary where autograd allocated a float32 weight gradient, widened it and added it
(at hidden 4096 and V 128K, ~10 GB of memory traffic a chunk became ~6 GB); the bias rows are
summed straight into float32. Other cases run ``F.linear`` unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx
from torch.overrides import TorchFunctionMode

__all__ = ["Casts", "accumulating_head"]

Casts = dict[torch.dtype, tuple[torch.Tensor, "torch.Tensor | None"]]
"""16-bit casts of a head's weight and bias, by dtype (:func:`accumulating_head`)."""


class _LinearInto(torch.autograd.Function):
    """``F.linear(x, w, b)`` whose backward adds the weight and bias gradients into their
    accumulators in place. Under autocast ``w`` and ``b`` are 16-bit casts of the head's: the
    weight's product ``g^T x`` is then autograd's 16-bit one, widened by the add, and the
    bias rows are summed in the accumulator's dtype (autograd rounds that sum to 16 bits, on
    CUDA in an order of its own)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,  # (..., d)
        weight: torch.Tensor,  # (V, d)
        bias: torch.Tensor | None,  # (V,)
        acc_w: torch.Tensor,  # (V, d), weight.dtype or (16-bit weight) float32
        acc_b: torch.Tensor | None,  # (V,)
        owner: torch.Tensor | None = None,  # the head's weight, when ``weight`` is its cast
    ) -> torch.Tensor:
        # (``owner`` only ties the output to the graph: a cast made without grad and an
        # input needing none, frozen features, would leave this backward, which fills the
        # accumulators, unrun and the head's gradients zero)
        ctx.save_for_backward(x, weight)
        ctx.acc = (acc_w, acc_b)  # type: ignore[attr-defined]
        return F.linear(x, weight, bias)  # (..., V)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor  # (..., V)
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        x, weight = ctx.saved_tensors  # (..., d), (V, d)
        acc_w, acc_b = ctx.acc
        g = grad_out.reshape(-1, grad_out.shape[-1])  # (rows, V)
        rows = x.reshape(-1, x.shape[-1])  # (rows, d)
        if acc_w.dtype == weight.dtype:
            acc_w.addmm_(g.t(), rows)  # (V, d) += (V, rows) @ (rows, d)
        else:  # a 16-bit product, widened by the add: no float32 temporary
            acc_w.add_(torch.mm(g.t(), rows))  # (V, d)
        if acc_b is not None:
            acc_b.add_(g.sum(0, dtype=acc_b.dtype))  # (V,)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None  # (..., d)
        return grad_x, None, None, None, None, None


class _Redirect(TorchFunctionMode):
    """Routes ``F.linear`` calls on the head's weight ``w`` to :class:`_LinearInto`."""

    def __init__(
        self,
        w: torch.Tensor,
        b: torch.Tensor | None,
        acc_w: torch.Tensor,
        acc_b: torch.Tensor | None,
        casts: Casts,
    ) -> None:
        super().__init__()
        self.w, self.b, self.acc_w, self.acc_b = w, b, acc_w, acc_b
        self.casts = casts

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(args, kwargs)
            if weight is self.w and (bias is None or bias is self.b):
                acc_b = self.acc_b if bias is not None else None
                narrow = _autocast_dtype(self.w.device.type)
                if narrow is None:
                    return _LinearInto.apply(x, weight, bias, self.acc_w, acc_b)
                if _narrows(x, weight, bias, self.acc_w, narrow):
                    w16, b16 = self._narrowed(narrow)
                    return _LinearInto.apply(x.to(narrow), w16, b16 if bias is not None else None,
                                             self.acc_w, acc_b, self.w)
        return func(*args, **kwargs)

    def _narrowed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias cast to ``dtype``, once for all the chunks of a pass (autocast's
        cache would cast them in each chunk's re-run: ~3 GB of memory traffic a chunk at V
        128K, d 4096)."""
        cast = self.casts.get(dtype)
        if cast is None:
            with torch.no_grad():
                cast = (self.w.to(dtype), None if self.b is None else self.b.to(dtype))
            self.casts[dtype] = cast
        return cast


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype on ``device_type``, None when autocast is off there."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


_NARROW = (torch.float16, torch.bfloat16)


def _narrows(x: Any, weight: torch.Tensor, bias: torch.Tensor | None, acc_w: torch.Tensor,
             dtype: torch.dtype) -> bool:
    """Whether autocast would run ``F.linear(x, weight, bias)`` on 16-bit casts of all three
    (it casts float32 and 16-bit inputs, never float64) and the accumulator is float32."""
    tensors = [t for t in (x, weight, bias) if t is not None]
    return (dtype in _NARROW and acc_w.dtype == torch.float32
            and all(isinstance(t, torch.Tensor) and t.dtype in (torch.float32, *_NARROW)
                    for t in tensors))


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
    casts: Casts | None = None,
) -> Iterator[None]:
    """While the block runs, ``F.linear(x, w, b)`` accumulates its gradients into ``acc_*``.

    A no-op (``F.linear`` unchanged) unless the accumulator has the weight's own dtype, so the
    sum is exactly what autograd's ``g^T x`` plus ``+=`` would give. ``casts`` keeps the
    16-bit casts of ``w`` and ``b`` under autocast; share one between the chunks of a pass
    (``w`` and ``b`` must not change meanwhile).
    """
    if acc_w.dtype != w.dtype or (acc_b is not None and b is not None and acc_b.dtype != b.dtype):
        yield
        return
    with _Redirect(w, b, acc_w, acc_b, {} if casts is None else casts):
        yield
