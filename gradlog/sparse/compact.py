"""The kept entries of a gradient (top-k per row) and the autograd functions of the masked
and compact (meProp) paths of :func:`~gradlog.sparse.sparse_backprop`."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from gradlog.sparse.settings import SparseSettings

__all__ = ["Alias", "Call", "CompactLinear", "select"]

_COMPACT_DTYPES = (torch.float32, torch.float64)  # sparse-dense matmuls on every device


@dataclass
class _Selection:
    """The kept entries of one gradient, as ``(rows, k)`` positions in its 2-D row view."""

    shape: torch.Size  # the gradient's shape
    index: torch.Tensor  # (rows, k) positions within a row
    values: torch.Tensor  # (rows, k)
    masked: torch.Tensor  # the gradient with zeros elsewhere, in its own shape


def _rows(grad: torch.Tensor, per: str) -> torch.Tensor:
    """The 2-D row view of a gradient: (rows, entries competing for the k places)."""
    if per == "datum":
        return grad.reshape(grad.shape[0], -1)  # (B, n)
    return grad.reshape(-1, grad.shape[-1])  # (rows, n)


def select(grad: torch.Tensor, settings: SparseSettings) -> _Selection | None:
    """Top-k of each row of ``grad`` by magnitude; None when every entry is kept."""
    if grad.dim() == 0 or grad.numel() == 0:
        return None
    flat = _rows(grad, settings.per)  # (rows, n)
    n = flat.shape[1]
    k = settings.k_for(n)
    if k >= n:
        return None
    index = flat.abs().topk(k, dim=1, sorted=False).indices  # (rows, k)
    values = flat.gather(1, index)  # (rows, k)
    masked = flat.new_zeros(flat.shape).scatter_(1, index, values)  # (rows, n)
    return _Selection(grad.shape, index, values, masked.view(grad.shape))


class Call:
    """One compact Linear call: its output until the function takes it, then the selection
    the output's gradient hook made, until the function's backward uses it."""

    __slots__ = ("out", "sel")

    def __init__(self, out: torch.Tensor) -> None:
        self.out: torch.Tensor | None = out
        self.sel: _Selection | None = None


class CompactLinear(torch.autograd.Function):
    """``y = x W^T + b`` whose backward uses only the kept entries of the output gradient.

    The forward returns the output the module already computed (no second matmul): it is
    passed in through ``call``, outside autograd's view of the inputs, so the returned tensor
    is a plain output (in-place ops after the layer, e.g. ``ReLU(inplace=True)``, work).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        call: Call,
        settings: SparseSettings,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.call = call
        ctx.settings = settings
        ctx.has_bias = bias is not None
        out, call.out = call.out, None
        assert out is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        call: Call = ctx.call
        settings: SparseSettings = ctx.settings
        sel, call.sel = call.sel, None
        if sel is None or sel.masked is not grad:  # no hook ran, or a later hook changed it
            sel = select(grad, settings)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        d_out, d_in = weight.shape
        x2 = x.reshape(-1, d_in)  # (N, d_in)
        N = x2.shape[0]
        grad_x = grad_w = grad_b = None
        if sel is None or weight.dtype not in _COMPACT_DTYPES:  # dense: all kept, or a dtype
            g = (grad if sel is None else sel.masked).reshape(N, d_out).to(weight.dtype)
            if need_x:
                grad_x = (g @ weight).to(x.dtype).view(x.shape)  # (..., d_in)
            if need_w:
                grad_w = g.t() @ x2.to(weight.dtype)  # (d_out, d_in)
            if need_b and ctx.has_bias:
                grad_b = g.sum(0)  # (d_out,)
            return grad_x, grad_w, grad_b, None, None
        rows, cols = _coordinates(sel, settings.per, d_out)  # (M,), (M,) in the (N, d_out) view
        values = sel.values.reshape(-1).to(weight.dtype)  # (M,)
        if need_x:
            s = _sparse(torch.stack([rows, cols]), values, (N, d_out))  # (N, d_out), M entries
            grad_x = torch.sparse.mm(s, weight).to(x.dtype).view(x.shape)  # (..., d_in)
        if need_w:
            st = _sparse(torch.stack([cols, rows]), values, (d_out, N))  # (d_out, N)
            grad_w = torch.sparse.mm(st, x2.to(weight.dtype))  # (d_out, d_in)
        if need_b and ctx.has_bias:
            grad_b = values.new_zeros(d_out).index_add_(0, cols, values)  # (d_out,)
        return grad_x, grad_w, grad_b, None, None


class Alias(torch.autograd.Function):
    """The identity, as a new plain tensor sharing the output's memory (no copy).

    The sparsifying hook goes on this tensor rather than on the module's output because a
    Linear's output on ``(B, T, d)`` inputs is a view: an in-place op after the layer
    (``ReLU(inplace=True)``) re-routes the backward around a view's own node, and a hook
    registered on it would never fire. It also keeps a module that returns its input from
    sparsifying the input's other uses.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: Call) -> torch.Tensor:
        out, call.out = call.out, None
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _coordinates(sel: _Selection, per: str, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every kept entry in the ``(N, d_out)`` view of a Linear's output."""
    n_rows, k = sel.index.shape
    if per == "datum":  # a datum's row is its L positions x d_out features, flattened
        per_datum = math.prod(sel.shape) // (n_rows * d_out)  # positions per datum
        base = torch.arange(n_rows, device=sel.index.device).unsqueeze(1) * per_datum  # (B,1)
        rows = (base + sel.index.div(d_out, rounding_mode="floor")).reshape(-1)  # (B*k,)
        return rows, sel.index.remainder(d_out).reshape(-1)
    rows = torch.arange(n_rows, device=sel.index.device).repeat_interleave(k)  # (N*k,)
    return rows, sel.index.reshape(-1)


def _sparse(indices: torch.Tensor, values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    # Invariants hold by construction (distinct in-range indices); checking them costs a pass.
    with warnings.catch_warnings():  # torch 2.11 warns that they are off even when told so
        warnings.filterwarnings("ignore", "Sparse invariant checks are implicitly disabled")
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=False)

