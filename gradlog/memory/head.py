"""``chunked_linear_loss``: the two autograd schedules (recompute in backward, gradients in
forward) that run a head and its loss one chunk of rows at a time. The module docstring of
:mod:`gradlog.memory` explains them."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from gradlog._torch_private import backward_keeps_graph
from gradlog.errors import DoubleBackwardError, InputError
from gradlog.memory.accumulate import Casts, accumulating_head
from gradlog.memory.autocast import (
    AutocastState,
    autocast_state,
    involves_float16,
    no_autocast,
    note_autocast,
    replayed,
)
from gradlog.memory.chunk import ChunkInfo, running_chunk
from gradlog.memory.rows import (
    GPU_MIN_ROWS,
    bounds,
    chunk_sizes,
    flatten_labels,
    take_rows,
    valid_rows,
)

__all__ = ["RowLossFn", "chunked_linear_loss"]

RowLossFn = Callable[[torch.Tensor, nn.Module, Any], torch.Tensor]
"""``fn(x_chunk, linear, labels_chunk) -> losses_chunk``: ``(rows, d)`` -> ``(rows,)``."""


def _refuse_double_backward() -> None:
    # Autograd runs a Function's backward with grad mode on exactly when create_graph=True.
    if torch.is_grad_enabled():
        raise DoubleBackwardError(
            "chunked_linear_loss does not support double backward: backward was called with "
            "create_graph=True through it, but its gradients are computed chunk by chunk "
            "without a graph, so their own gradients would be missing. Call backward without "
            "create_graph, or use the unchunked head where you need higher-order gradients."
        )


def _reduce_mean(losses: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    # Divide by the global count of valid rows, not per chunk: unequal chunks weigh right.
    if valid is None:
        return losses.sum() / max(losses.numel(), 1)
    return losses.sum() / valid.sum().clamp_min(1).to(losses.dtype)


def _reduce_sum(losses: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return losses.sum()


def _reduce_none(losses: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return losses


# The closed set of reductions: an unknown name's error lists these keys.
_REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "mean": _reduce_mean,
    "sum": _reduce_sum,
    "none": _reduce_none,
}


def chunked_linear_loss(
    x: torch.Tensor,
    linear: nn.Module,
    labels: Any,
    fn: RowLossFn,
    *,
    chunk_size: int | Sequence[int] | None = None,
    reduction: str = "mean",
    ignore_index: int | None = -100,
    memory_budget_bytes: int | None = None,
    preserve_rng_state: bool = True,
    grad_in_forward: bool | None = None,
) -> torch.Tensor:
    """A linear layer followed by a per-row loss, without ever holding all rows' logits.

    Equal, up to float rounding, to the unchunked ``fn(x.reshape(N, d), linear, labels)``
    followed by the reduction, in value and in the gradients of ``x``, ``linear.weight`` and
    ``linear.bias``; peak memory holds one chunk of logits instead of all ``N`` rows.

    Args:
        x: Hidden states ``(..., d)``; the leading dimensions are flattened to ``N`` rows.
        linear: The head, usually an ``nn.Linear`` (``weight`` ``(V, d)``, ``bias`` ``(V,)``
            or ``None``). Any module with a ``weight`` tensor and an optional ``bias`` works;
            gradients are computed for exactly these two tensors (and ``x``), so while
            gradients are enabled a head with another trainable parameter (a learned
            temperature) is refused: its gradient would be lost. Parameters the weight is
            computed from (a tied or scaled weight) get theirs through it.
        labels: Per-row targets for ``fn``: a tensor whose leading dimensions are ``x``'s
            (``(B, T)`` for ``x`` ``(B, T, d)``; trailing dimensions allowed, e.g. teacher
            logits ``(B, T, V)``) or already flattened to ``(N, ...)``; or a tuple, list or
            dict of such tensors (e.g. ``{"tokens": ..., "old_logp": ..., "adv": ...}``); or
            ``None``. Every tensor is flattened like ``x`` and split along its row dimension;
            the structure is kept and non-tensor leaves reach every chunk unchanged. Labels get
            no gradient (a label tensor that requires grad is refused).
        fn: ``fn(x_chunk, linear, labels_chunk)`` returns the losses of the chunk's rows,
            shape ``(rows,)``, e.g. ``F.cross_entropy(linear(x).float(), y,
            reduction="none")``. It must be a pure function of its arguments and the
            random-number state: the recompute schedule calls it twice per chunk (dropout is
            replayed, see ``preserve_rng_state``). It must return finite values on rows whose
            label is ``ignore_index``; their loss and gradient are zeroed afterwards
            (``cross_entropy(..., ignore_index=...)`` returns 0 there; index a one-hot target
            with ``y.clamp_min(0)``). Put the float32 upcast inside ``fn``: it runs in the
            caller's autocast state, also when re-run in backward.
        chunk_size: Rows per chunk (an int; the last chunk takes the remainder), the list of
            chunk sizes (positive ints summing to ``N``), or ``None`` to derive it from
            ``memory_budget_bytes``.
        reduction: ``"mean"`` over valid rows (the sum divided by the number of valid rows of
            the whole input; 0 when none is valid, where torch's cross entropy gives NaN),
            ``"sum"``, or ``"none"``: per-row losses shaped like ``x``'s leading dimensions,
            e.g. ``(B, T)``, which ``GradRecorder.backward`` takes for per-datum recording.
        ignore_index: When ``labels`` is an integer tensor with one label per row, rows whose
            label equals it are invalid: loss 0, no gradient, not counted by ``"mean"``.
            ``None``, or any other kind of labels, counts every row.
        memory_budget_bytes: With ``chunk_size=None``: bytes of float32 logits one chunk may
            hold, ``rows = budget // (V * 4)``. By default 16 MiB, but at least ``d // 32``
            rows (logits 1/32 of the weight's size; fewer rows leave a GPU waiting on
            memory): 131 rows at V = 32K and d 1024, 32 at 128K and d 1024, 128 at d 4096;
            on a GPU at least 1024 rows (:data:`~gradlog.memory.GPU_MIN_ROWS`: each chunk
            reads and updates weight-sized tensors, which smaller chunks repeat too often);
            see :data:`~gradlog.memory.DEFAULT_MEMORY_BUDGET_BYTES`. ``fn``'s own peak is a
            small multiple of it (logits, their upcast, softmax, its gradient).
        preserve_rng_state: Save the random-number state (CPU, and the device of ``x``) before
            each chunk's forward and restore it for the backward re-run, as
            ``torch.utils.checkpoint`` does, so dropout inside ``fn`` draws the same masks; the
            global state is left as forward left it. ``False`` skips the small cost when ``fn``
            draws no random numbers.
        grad_in_forward: Schedule for ``"mean"``/``"sum"``: ``True`` computes the gradients in
            forward (no recomputation), ``False`` recomputes in backward. ``None`` (default)
            picks ``True`` unless float16 is involved (``x``, the weight or the autocast dtype):
            a ``GradScaler`` scales the loss to keep float16 gradients from underflowing, and
            gradients computed before that scaling would not get its protection.
            ``reduction="none"`` always recomputes.

    Returns:
        A scalar (``"mean"``, ``"sum"``) or the per-row losses of shape ``x.shape[:-1]``
        (``"none"``), in the dtype ``fn`` returns (float32 when ``fn`` upcasts).

    Raises:
        InputError: ``x``, ``linear``, ``labels``, ``chunk_size``, ``memory_budget_bytes``,
            ``reduction``, ``grad_in_forward`` or the losses ``fn`` returns are malformed, or
            ``linear`` has trainable parameters besides ``weight`` and ``bias``.
        DoubleBackwardError: In backward, when called with ``create_graph=True`` (double
            backward is not supported: the chunk gradients are computed without a graph).
    """
    if reduction not in _REDUCTIONS:
        raise InputError(
            f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}. Use 'none' for "
            "per-row losses (e.g. for GradRecorder.backward)."
        )
    if grad_in_forward and reduction == "none":
        raise InputError(
            "grad_in_forward=True needs a scalar loss (reduction 'mean' or 'sum'): with "
            "reduction='none' the upstream gradient of each row is known only in backward. "
            "Drop grad_in_forward."
        )
    weight, bias = _head_tensors(linear)
    if torch.is_grad_enabled():
        _refuse_other_trainable(linear, weight, bias)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(
            f"x must be a tensor of hidden states (..., d) with at least one row dimension, got "
            f"{shape}. For a single row, pass x.unsqueeze(0)."
        )
    lead = tuple(x.shape[:-1])
    n_rows, d = math.prod(lead), x.shape[-1]
    if weight.dim() == 2 and weight.shape[1] != d:
        raise InputError(
            f"x has {d} features (last dimension) but linear.weight has shape "
            f"{tuple(weight.shape)}, i.e. expects {weight.shape[1]}. Pass the hidden states that "
            "feed this head."
        )
    rows_labels = flatten_labels(labels, lead, n_rows, "labels")
    sizes = chunk_sizes(chunk_size, memory_budget_bytes, n_rows, weight.shape[0], d,
                        min_rows=GPU_MIN_ROWS if x.device.type == "cuda" else 0)
    needs = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    grad_wanted = torch.is_grad_enabled() and any(needs)
    plan = _Plan(
        fn=fn,
        linear=linear,
        labels=rows_labels,
        lead_shape=lead,
        bounds=bounds(sizes),
        needs=needs,
        preserve_rng_state=preserve_rng_state and grad_wanted,
        autocast=autocast_state(x.device),
    )
    x_rows = x.reshape(n_rows, d)  # (N, d); a view when x is contiguous
    valid = valid_rows(labels, n_rows, ignore_index)  # (N,) bool, or None: every row counts
    if grad_wanted and reduction != "none":
        if grad_in_forward is None:
            grad_in_forward = not involves_float16(x, weight, plan.autocast)
        if grad_in_forward:
            return cast(
                torch.Tensor,
                _GradInForward.apply(x_rows, weight, bias, plan, reduction, valid),  # ()
            )
    losses = cast(torch.Tensor, _Recompute.apply(x_rows, weight, bias, plan))  # (N,)
    if valid is not None:
        losses = losses.masked_fill(~valid, 0)  # loss 0 and no gradient for ignored rows
    out = _REDUCTIONS[reduction](losses, valid)
    return out.reshape(lead) if reduction == "none" else out


@dataclass
class _Plan:
    """Everything the autograd functions need besides their tensor inputs."""

    fn: RowLossFn
    linear: nn.Module
    labels: Any  # the labels with every tensor flattened to (N, ...)
    lead_shape: tuple[int, ...]  # x.shape[:-1]
    bounds: list[tuple[int, int]]  # [start, stop) rows of each chunk
    needs: tuple[bool, bool, bool]  # gradient wanted for x, weight, bias
    preserve_rng_state: bool
    autocast: AutocastState
    rng_states: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)


class _Recompute(torch.autograd.Function):
    """Per-row losses ``(N,)``: forward without a graph, backward re-runs chunk by chunk."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,  # (N, d)
        weight: torch.Tensor,  # (V, d)
        bias: torch.Tensor | None,  # (V,)
        plan: _Plan,
    ) -> torch.Tensor:
        # Autograd runs forward under no_grad: no chunk keeps a graph.
        rng_device = _rng_device_module(x.device)
        out: torch.Tensor | None = None
        for start, stop in plan.bounds:
            if plan.preserve_rng_state:
                plan.rng_states.append(_get_rng_state(x.device, rng_device))
            rows = _call_fn(plan, x[start:stop], plan.linear, start, stop)  # (rows,)
            if out is None:
                out = rows.new_empty((x.shape[0],))  # (N,), in fn's dtype
            out[start:stop] = rows
        ctx.save_for_backward(x, weight, bias)  # type: ignore[arg-type]  # bias may be None
        ctx.plan = plan  # type: ignore[attr-defined]
        note_autocast(ctx, plan.autocast)
        return cast(torch.Tensor, out)  # bounds hold at least one (maybe empty) chunk

    @staticmethod
    def backward(
        ctx: Any,
        grad_rows: torch.Tensor,  # (N,)
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        _refuse_double_backward()
        x, weight, bias = ctx.saved_tensors  # (N, d), (V, d), (V,) or None
        need = ctx.needs_input_grad
        needs = (bool(need[0]), bool(need[1]), bool(need[2]))
        grad_x, grad_w, grad_b, _ = _chunk_grads(
            ctx.plan, needs, x, weight, bias, grad_rows, replay=True, keep_rows=False
        )
        return grad_x, grad_w, grad_b, None


class _GradInForward(torch.autograd.Function):
    """The reduced scalar loss; forward also computes its gradients, backward scales them."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,  # (N, d)
        weight: torch.Tensor,  # (V, d)
        bias: torch.Tensor | None,  # (V,)
        plan: _Plan,
        reduction: str,
        valid: torch.Tensor | None,  # (N,) bool
    ) -> torch.Tensor:
        # d loss / d row: 1 for "sum", 1/count for "mean"; 0 on ignored rows.
        dtype = torch.promote_types(x.dtype, torch.float32)
        if valid is None:
            row_weights = torch.ones(x.shape[0], dtype=dtype, device=x.device)  # (N,)
            count = torch.tensor(max(x.shape[0], 1), dtype=dtype, device=x.device)
        else:
            row_weights = valid.to(dtype)  # (N,)
            count = row_weights.sum().clamp_min(1)
        if reduction == "mean":
            row_weights = row_weights / count  # (N,)
        grad_x, grad_w, grad_b, rows = _chunk_grads(
            plan, plan.needs, x, weight, bias, row_weights, replay=False, keep_rows=True
        )
        rows = cast(torch.Tensor, rows)  # (N,)
        if valid is not None:
            rows = rows.masked_fill(~valid, 0)  # (N,)
        # The gradients are handed over (not saved tensors): the first backward owns them.
        # x, weight and bias are saved for any later backward (retain_graph), which recomputes.
        ctx.grads = [grad_x, grad_w, grad_b]  # type: ignore[attr-defined]
        ctx.row_weights = row_weights  # type: ignore[attr-defined]
        ctx.plan = plan  # type: ignore[attr-defined]
        note_autocast(ctx, plan.autocast)
        ctx.save_for_backward(x, weight, bias)  # type: ignore[arg-type]  # bias may be None
        return _REDUCTIONS[reduction](rows, valid)  # ()

    @staticmethod
    def backward(
        ctx: Any,
        grad_loss: torch.Tensor,  # ()
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None]:
        _refuse_double_backward()
        grads: list[torch.Tensor | None] | None = ctx.grads
        if grads is not None and backward_keeps_graph():
            # A backward that keeps the graph (retain_graph: another backward follows, e.g.
            # gradlog's datum check): scaled copies, the precomputed gradients stay for it.
            scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in grads]
            return scaled[0], scaled[1], scaled[2], None, None, None
        if grads is not None:
            # First backward: give the gradients away (AccumulateGrad can adopt them without
            # a copy), scaled in place unless the upstream gradient is 1 (plain backward()).
            ctx.grads = None
            # (meta tensors hold no value to compare: scale, a no-op there)
            if grad_loss.device.type == "meta" or not bool((grad_loss == 1).all()):
                for g in grads:
                    if g is not None:
                        g.mul_(grad_loss.to(g.dtype))
            return grads[0], grads[1], grads[2], None, None, None
        # A later backward through a retained graph: recompute, exactly as _Recompute does.
        x, weight, bias = ctx.saved_tensors  # (N, d), (V, d), (V,) or None
        need = ctx.needs_input_grad
        needs = (bool(need[0]), bool(need[1]), bool(need[2]))
        grad_rows = ctx.row_weights * grad_loss.to(ctx.row_weights.dtype)  # (N,)
        grad_x, grad_w, grad_b, _ = _chunk_grads(
            ctx.plan, needs, x, weight, bias, grad_rows, replay=True, keep_rows=False
        )
        return grad_x, grad_w, grad_b, None, None, None


def _chunk_grads(
    plan: _Plan,
    needs: tuple[bool, bool, bool],
    x: torch.Tensor,  # (N, d)
    weight: torch.Tensor,  # (V, d)
    bias: torch.Tensor | None,  # (V,)
    grad_rows: torch.Tensor,  # (N,)
    *,
    replay: bool,
    keep_rows: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run ``fn`` chunk by chunk under autograd; backpropagate ``grad_rows`` through each.

    Returns the gradients of ``x``, weight and bias (None where not wanted) and, with
    ``keep_rows``, the per-row losses ``(N,)``. With ``replay`` (a backward that recomputes),
    each chunk runs in the forward's autocast and random-number state; without, it runs in the
    caller's and records the random-number state before each chunk.
    """
    need_x, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    # Detached leaves to differentiate against. The real module sees them through
    # functional_call, so a fn calling linear(x) works and hooks on the module fire.
    w = weight.detach().requires_grad_(need_w)  # (V, d)
    b = None if bias is None else bias.detach().requires_grad_(need_b)  # (V,)
    params = {"linear.weight": w} if b is None else {"linear.weight": w, "linear.bias": b}
    call = _FnCall(plan)
    grad_x = torch.empty_like(x) if need_x else None  # (N, d)
    # Accumulate over chunks in at least float32: summing bf16 partial gradients would lose
    # what the unchunked matmul keeps.
    grad_w = torch.zeros_like(weight, dtype=_acc_dtype(weight)) if need_w else None  # (V, d)
    grad_b = (
        torch.zeros_like(bias, dtype=_acc_dtype(bias)) if need_b and bias is not None else None
    )  # (V,)
    rows_out: torch.Tensor | None = None  # (N,)
    casts: Casts = {}  # under autocast: the weight's 16-bit cast, once for all chunks
    rng_device = _rng_device_module(x.device)
    with contextlib.ExitStack() as stack:
        if replay and plan.preserve_rng_state:
            stack.enter_context(
                torch.random.fork_rng(  # (torch 2.4 looks the device type's module up
                    devices=[x.device] if rng_device is not None else [],  # even for none)
                    device_type=x.device.type if rng_device is not None else "cpu",
                )
            )
        if replay:  # backward may run outside (or inside another) autocast region
            stack.enter_context(replayed(plan.autocast))
        stack.enter_context(torch.enable_grad())
        for i, (start, stop) in enumerate(plan.bounds):
            if replay and plan.preserve_rng_state:
                _set_rng_state(x.device, rng_device, plan.rng_states[i])
            elif plan.preserve_rng_state:  # forward: record, for a later replay
                plan.rng_states.append(_get_rng_state(x.device, rng_device))
            x_chunk = x[start:stop].detach().requires_grad_(need_x)  # (rows, d)
            redirect = (
                accumulating_head(w, b, grad_w, grad_b, casts)
                if grad_w is not None
                else contextlib.nullcontext()
            )
            with redirect:
                # (F.linear on w: its backward adds into grad_w/grad_b, no per-chunk copy)
                rows = torch.func.functional_call(call, params, (x_chunk, start, stop))  # (rows,)
            if keep_rows:
                if rows_out is None:
                    rows_out = rows.new_empty((x.shape[0],))  # (N,)
                rows_out[start:stop] = rows.detach()
            inputs: list[torch.Tensor] = []
            for tensor, need in ((x_chunk, need_x), (w, need_w), (b, need_b)):
                if need and tensor is not None:
                    inputs.append(tensor)
            grads: Sequence[torch.Tensor | None] = [None] * len(inputs)
            if inputs and rows.requires_grad:  # fn may not depend on any input at all
                with no_autocast(plan.autocast):  # as autograd's engine: fn's switches hold
                    grads = torch.autograd.grad(
                        rows,
                        inputs,
                        grad_outputs=grad_rows[start:stop].to(rows.dtype),
                        allow_unused=True,
                    )
            it = iter(grads)
            g: torch.Tensor | None = None
            if grad_x is not None:
                g = next(it)  # (rows, d)
                if g is None:
                    grad_x[start:stop].zero_()
                else:
                    grad_x[start:stop] = g
            if grad_w is not None and (g := next(it)) is not None:
                grad_w += g  # (V, d)
            if grad_b is not None and (g := next(it)) is not None:
                grad_b += g  # (V,)
            # Release this chunk's gradients and graph before the next chunk allocates its own.
            del grads, it, g, rows, redirect
    return (
        grad_x,
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None or bias is None else grad_b.to(bias.dtype),
        rows_out,
    )


class _FnCall(nn.Module):
    """Calls ``fn(x_chunk, linear, labels_chunk)``; lets functional_call swap the head's tensors."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        self.linear = plan.linear
        self._plan = [plan]  # in a list: keep fn (maybe a Module) out of the module tree

    def forward(self, x_chunk: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return _call_fn(self._plan[0], x_chunk, self.linear, start, stop)


def _call_fn(
    plan: _Plan, x_chunk: torch.Tensor, linear: nn.Module, start: int, stop: int
) -> torch.Tensor:
    info = ChunkInfo(plan.lead_shape, start, stop, torch.is_grad_enabled())
    with running_chunk(info):
        rows = plan.fn(x_chunk, linear, take_rows(plan.labels, start, stop))
    n = stop - start
    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (n,):
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise InputError(
            f"fn must return one loss per row of its chunk, shape ({n},), got {shape}. Compute "
            "the loss with reduction='none' (e.g. F.cross_entropy(linear(x).float(), y, "
            "reduction='none')) and sum any per-class terms over the last dimension."
        )
    if not rows.is_floating_point():
        raise InputError(f"fn must return floating-point losses, got dtype {rows.dtype}.")
    return rows


def _head_tensors(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(linear, nn.Module):
        raise InputError(
            f"linear must be the head module (an nn.Linear), got {type(linear).__name__}. Pass "
            "the module itself, not its weight: fn receives it and calls linear(x)."
        )
    weight = getattr(linear, "weight", None)
    bias = getattr(linear, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 1:
        raise InputError(
            f"linear must have a weight tensor of shape (V, d) like nn.Linear, but "
            f"{type(linear).__name__}.weight is {type(weight).__name__}. Pass the nn.Linear head."
        )
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise InputError(f"linear.bias must be a tensor or None, got {type(bias).__name__}.")
    return weight, bias


def _refuse_other_trainable(
    linear: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Refuse trainable parameters of the head other than ``weight`` and ``bias`` (and those
    the weight or bias is computed from): their gradients would be silently lost, since only
    ``x``, ``weight`` and ``bias`` are differentiated."""
    own = [(n, p) for n, p in linear.named_parameters() if p.requires_grad]
    covered = {id(weight)} | ({id(bias)} if bias is not None else set())
    others = [(n, p) for n, p in own if id(p) not in covered]
    if not others:
        return
    covered |= _leaves_of(weight, bias)  # a weight computed from parameters (tied, scaled)
    lost = [n for n, p in others if id(p) not in covered]
    if not lost:
        return
    raise InputError(
        f"linear ({type(linear).__name__}) has trainable parameter(s) {lost} besides weight and "
        "bias, but chunked_linear_loss differentiates only x, linear.weight and linear.bias: "
        "their gradients would be silently lost. Apply them outside chunked_linear_loss (a "
        "temperature t of a bias-free head: pass x * t, since (t x) W^T = t (x W^T)), freeze "
        "them (p.requires_grad_(False)), or call the head unchunked."
    )


def _leaves_of(*tensors: torch.Tensor | None) -> set[int]:
    """ids of the leaf tensors the autograd graphs of ``tensors`` reach."""
    out: set[int] = set()
    stack: list[Any] = [t.grad_fn for t in tensors if t is not None]  # autograd Nodes
    seen: dict[int, Any] = {}  # (held: torch 2.4 frees an unheld wrapper, reusing its id)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad of a leaf
        if isinstance(variable, torch.Tensor):
            out.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return out


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _rng_device_module(device: torch.device) -> Any | None:
    """``torch.cuda`` (or the like) when ``device`` has its own generator; None for CPU."""
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        return None
    return module


def _get_rng_state(
    device: torch.device, module: Any | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), None if module is None else module.get_rng_state(device)


def _set_rng_state(
    device: torch.device, module: Any | None, state: tuple[torch.Tensor, torch.Tensor | None]
) -> None:
    torch.set_rng_state(state[0])
    if module is not None and state[1] is not None:
        module.set_rng_state(state[1], device)
