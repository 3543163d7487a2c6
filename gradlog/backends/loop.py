"""The reference backend: one ``autograd.grad`` per datum over the shared graph.

Slow (B backward passes) but exact for any model autograd can differentiate; every other
backend is tested against it, and it stays as the fallback for exotic models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradlog._torch_private.nodes import autograd_node_output_dtypes
from gradlog.backends.base import Backend, PerDatumGrads, graph_nodes, is_reentrant_checkpoint
from gradlog.errors import BackendError
from gradlog.memory.autocast import computed_dtypes
from gradlog.params import check_differentiable

__all__ = ["LoopBackend"]

_REENTRANT = (
    "backend='loop' takes one torch.autograd.grad per datum, which "
    "torch.utils.checkpoint(..., use_reentrant=True) does not support (a torch limitation: "
    "the parameters inside such a segment are out of autograd.grad's reach). Use "
    "backend='hooks' (the default), which records through either kind of checkpoint, or "
    "checkpoint with use_reentrant=False. Nothing was computed; p.grad is untouched."
)


class LoopBackend(Backend):
    """Per-datum gradients by one ``torch.autograd.grad`` per datum (``retain_graph``)."""

    name = "loop"

    def backward(self, losses: torch.Tensor, batch_loss: torch.Tensor) -> PerDatumGrads:
        check_differentiable(self.params, losses)  # before autograd's own, vaguer errors
        names = list(self.params)
        tensors = [self.params[n] for n in names]
        # Under autocast, autograd computes (and rounds) gradients in bfloat16/float16: each
        # per-datum gradient and p.grad separately, so their sums differ at that precision.
        narrow = _narrowest_dtype(losses.grad_fn, {p.dtype for p in tensors})
        self.low_precision = {n: narrow for n in names} if narrow is not None else {}
        out = {n: torch.zeros((len(losses), *p.shape), dtype=p.dtype, device=p.device)
               for n, p in zip(names, tensors)}
        # A reentrant checkpoint hides the parameters inside it from autograd.grad (they get
        # no gradient at all, silently) or refuses it: refused here, before anything runs,
        # when a recorded parameter is out of reach (recording only the layers outside a
        # checkpointed trunk is fine).
        if _hidden_by_reentrant_checkpoint(losses.grad_fn, tensors):
            raise BackendError(_REENTRANT)
        for b in range(len(losses)):
            try:
                grads = torch.autograd.grad(losses[b], tensors, retain_graph=True,
                                            allow_unused=True)
            except RuntimeError as e:
                if "use_reentrant=True" not in str(e):
                    raise
                raise BackendError(_REENTRANT) from e
            for n, g in zip(names, grads):
                if g is not None:  # unused by this datum: its gradient is zero
                    out[n][b] = g
        batch_loss.backward()  # the ordinary backward: p.grad exactly as without gradlog
        return out


def _hidden_by_reentrant_checkpoint(root: Any, params: Sequence[torch.Tensor]) -> bool:
    """Whether the graph holds a reentrant checkpoint and some of ``params`` can be reached
    only through it (the walk does not enter checkpoint segments)."""
    reached: set[int] = set()
    checkpoint = False
    for node in graph_nodes(root, descend=lambda node: not is_reentrant_checkpoint(node)):
        if is_reentrant_checkpoint(node):
            checkpoint = True
            continue
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
    return checkpoint and any(id(p) not in reached for p in params if p.requires_grad)


def _narrowest_dtype(root: Any, than: set[torch.dtype]) -> torch.dtype | None:
    """The least precise floating dtype of the tensors in the autograd graph below ``root``
    if it is narrower than every dtype in ``than`` (autocast), else None. Without node
    metadata (older torch), a dtype cast in the graph counts as bfloat16."""
    floats = [d for d in than if d.is_floating_point]
    if root is None or not floats:
        return None
    bits = min(torch.finfo(d).bits for d in floats)
    narrowest: torch.dtype | None = None
    for node in graph_nodes(root):
        dtypes = autograd_node_output_dtypes(node)
        if dtypes is None:
            dtypes = [torch.bfloat16] if type(node).__name__ == "ToCopyBackward0" else []
        dtypes = [*dtypes, *computed_dtypes(node)]  # a chunked head's inner work
        for d in dtypes:
            if d.is_floating_point and torch.finfo(d).bits < bits and (
                    narrowest is None or torch.finfo(d).eps > torch.finfo(narrowest).eps):
                narrowest = d
    return narrowest
