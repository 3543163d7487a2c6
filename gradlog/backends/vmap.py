"""``torch.func`` backend: ``vmap(grad(functional_call))`` over the batch.

Each datum runs the user's loss function alone (batch of one) with the model's parameters
passed functionally, so it needs the loss function: it is reached through ``rec.step``. It
computes per-datum gradients of every trainable parameter (they are summed into ``p.grad``),
so memory grows with the whole model; record few layers of a large model with another backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from gradlog._torch_private import (
    cuda_devices,
    forked_rng,
    tensor_hooks,
    tensor_post_accumulate_hooks,
)
from gradlog._tree import flatten
from gradlog.backends.base import Backend, LossFn, PerDatumGrads, check_tolerance, graph_nodes
from gradlog.errors import BackendError, InputError
from gradlog.params import check_differentiable

__all__ = ["VmapBackend"]


class _LossModule(nn.Module):
    """Lets ``functional_call`` swap the parameters of ``model`` inside ``loss_fn``."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


class VmapBackend(Backend):
    """Per-datum gradients from ``torch.func.vmap(grad(...))`` over the user's loss function."""

    name = "vmap"
    needs_loss_fn = True

    def __init__(self, model: nn.Module, params: Mapping[str, nn.Parameter], *,
                 batch_reduction: str, randomness: str) -> None:
        super().__init__(model, params, batch_reduction=batch_reduction, randomness=randomness)

    def backward(self, losses: torch.Tensor, batch_loss: torch.Tensor) -> PerDatumGrads:
        raise BackendError(
            "backend='vmap' needs the loss function, not finished losses: call "
            "rec.step(loss_fn, batch) with loss_fn(model, batch) -> losses, or use "
            "backend='loop' with rec.backward(losses)."
        )

    def step(
        self,
        loss_fn: LossFn,
        batch: Any,
        reduce: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
        mask: torch.Tensor | None,
        check: Callable[[torch.Tensor], None],
    ) -> tuple[torch.Tensor, PerDatumGrads]:
        check_differentiable(self.params)  # a recorded parameter frozen since selection
        counted = [name for name, m in self.model.named_modules() if isinstance(
            m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq and m.weight.requires_grad]
        if counted:
            raise BackendError(
                f"{counted[:3]} scale their gradient by each token's count in the batch "
                "(scale_grad_by_freq=True): backend='vmap' differentiates each datum alone, "
                "with its own counts, so its records and p.grad would differ from autograd's. "
                "Use backend='hooks' (rec.backward), which counts over the batch.")
        module = _LossModule(self.model, loss_fn)
        trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
        fixed = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
        fixed.update(dict(module.named_buffers()))

        leaves, rebuild = flatten(batch)
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not slots:
            raise InputError("rec.step(loss_fn, batch): batch holds no tensor to split by datum.")
        size = leaves[slots[0]].shape[0] if leaves[slots[0]].dim() else 0
        for i in slots:
            if leaves[i].dim() == 0 or leaves[i].shape[0] != size:
                shapes = [tuple(leaves[j].shape) for j in slots]
                raise InputError(
                    f"every tensor in batch must have the batch size as its first dimension for "
                    f"backend='vmap'; got shapes {shapes}. Pass per-batch constants through "
                    "loss_fn's closure instead of the batch."
                )
        if mask is not None and mask.shape[0] != size:
            raise InputError(f"mask has {mask.shape[0]} rows but the batch has {size} datums.")
        if any(leaves[i].requires_grad for i in slots):
            raise InputError(
                "a batch tensor requires grad (an input to differentiate, e.g. for adversarial "
                "training): backend='vmap' computes parameter gradients only and would leave "
                "its .grad unset. Use backend='hooks' (rec.backward) or 'loop'."
            )

        def datum_loss(
            params: Mapping[str, torch.Tensor], tensors: list[torch.Tensor], mask_b: Any
        ) -> torch.Tensor:
            full = list(leaves)
            for i, t in zip(slots, tensors):
                full[i] = t.unsqueeze(0)  # a batch of one datum
            raw = functional_call(module, {**params, **fixed}, (rebuild(full),))
            loss = reduce(raw, None if mask_b is None else mask_b.unsqueeze(0))  # (1,)
            if loss.numel() != 1:  # a per-datum value the batch split did not reach
                raise InputError(
                    f"loss_fn on a batch of one datum returned {loss.numel()} losses: a "
                    "per-datum value of the batch is not a tensor with the batch first (a "
                    "Python list of weights, or a tensor in loss_fn's closure), so every datum "
                    "saw all of them: put per-datum values in the batch as tensors (B, ...). "
                    "Or per-token losses were flattened to (B*T,) (logits.view(-1, V)): return "
                    "them as (B, T), with mask= for padded tokens."
                )
            return loss[0]

        per_datum = vmap(
            grad_and_value(datum_loss),
            in_dims=(None, 0, None if mask is None else 0),
            randomness=self.randomness,
        )
        try:
            grads, losses = per_datum(trainable, [leaves[i] for i in slots], mask)
        except RuntimeError as e:
            if _from_checkpoint(e):
                raise BackendError(
                    "backend='vmap' cannot differentiate through torch.utils.checkpoint: "
                    "torch.func transforms support neither its reentrant form (an "
                    "autograd.Function without setup_context) nor the non-reentrant one "
                    f"(saved tensor hooks), a torch limitation ({str(e).splitlines()[0][:160]}). "
                    "Use backend='hooks' (the default) or 'loop', which record checkpointed "
                    "models, or turn activation checkpointing off while recording with vmap "
                    "(transformers: model.gradient_checkpointing_disable())."
                ) from e
            raise BackendError(
                f"torch.func.vmap could not differentiate this model per datum: {e}. vmap "
                "supports neither in-place writes of a datum's values into a tensor the batch "
                "shares (a BatchNorm's running statistics in training mode; an RNN's zero "
                "initial state: 'output with shape [1, ...] doesn't match the broadcast "
                "shape'), nor data-dependent control flow (.item(), boolean masks); use "
                "backend='hooks' (the default) or 'loop'."
            ) from e
        check(losses)
        if self.datum_check_due:  # (steps the recorder checks: its self-check cannot here)
            self._check_alone_as_together(loss_fn, batch, reduce, mask, losses)

        # p.grad of every trainable parameter from the same per-datum gradients, as autograd
        # would accumulate it: the parameter's gradient hooks first, then accumulation, then
        # its post-accumulate hooks. A parameter the loss does not depend on keeps .grad None,
        # as after an ordinary backward (optimizers then skip it: no weight decay, no
        # moments); one whose per-datum gradients are all exactly 0 while the loss depends on
        # it (LoRA A while LoRA B is 0, a projection whose outputs the loss never reads, dead
        # units) gets a zero .grad, as autograd gives. vmap has no graph to tell the two
        # apart, so for the all-zero ones the graph of an ordinary forward says (_used_by).
        fresh = [n for n, p in trainable.items() if p.grad is None]
        nonzero = torch.stack([grads[n].any() for n in fresh]).tolist() if fresh else []
        zero = [n for n, used in zip(fresh, nonzero) if not used]  # (one device sync)
        unused = set(zero) - self._used_by(loss_fn, batch, reduce, mask, zero, trainable)
        for name, p in trainable.items():
            g = grads[name]  # (B, *shape)
            if name in unused:
                continue
            total = (g.mean(0) if self.batch_reduction == "mean" else g.sum(0)).detach()
            for hook in tensor_hooks(p):
                replaced = hook(total)
                if replaced is not None:
                    total = replaced
            if p.grad is None:
                p.grad = total.clone()
            else:
                p.grad.add_(total)
            for post in tensor_post_accumulate_hooks(p):
                post(p)

        by_id = {id(p): n for n, p in trainable.items()}
        return losses.detach(), {n: grads[by_id[id(p)]] for n, p in self.params.items()}

    def _check_alone_as_together(
        self, loss_fn: LossFn, batch: Any,
        reduce: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
        mask: torch.Tensor | None, alone: torch.Tensor,
    ) -> None:
        """vmap computes each datum's loss on a batch of one: a loss that couples the datums
        (a batch mean, in-batch negatives) would train on another function, and ``p.grad``,
        summed from the records, agrees with them. So the batch's own losses are compared
        (one forward, the RNG forked); skipped where dropout draws differ by design."""
        if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0
               for m in self.model.modules()):
            return
        tensors = [*self.model.parameters(), *self.model.buffers()]
        with forked_rng(cuda_devices(tensors)), torch.no_grad():
            together = reduce(loss_fn(self.model, batch), mask)
        rtol, atol = check_tolerance({alone.dtype})
        if together.shape != alone.shape or not torch.allclose(
                together.to(alone.dtype), alone.detach(), rtol=rtol * 10, atol=atol):
            gap = (together.to(alone.dtype) - alone.detach()).abs()
            b = int(gap.argmax()) if gap.numel() else 0
            raise BackendError(
                f"backend='vmap' computes each datum's loss alone, and it differs from the "
                f"batch's (datum {b}: {float(alone[b]):.6g} alone, "
                f"{float(together.flatten()[b]):.6g} in the batch): the loss couples the "
                "datums (a batch mean or statistic, in-batch negatives), which vmap would "
                "change, or draws random numbers outside nn.Dropout. Use backend='loop' (or "
                "the hooks backend with rec.backward); for a loss that is random per datum, "
                "check_every=0 skips this check. p.grad is untouched."
            )

    def _used_by(self, loss_fn: LossFn, batch: Any,
                 reduce: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                 mask: torch.Tensor | None, names: list[str],
                 trainable: Mapping[str, torch.Tensor]) -> set[str]:
        """Which of ``names`` the batch's losses depend on: the parameters an ordinary
        forward's autograd graph reaches, by one forward of this batch (the global RNG
        forked, so training's random stream is unchanged), at each step where a parameter's
        per-datum gradients are all 0: whether a branch runs can change from step to step
        (an adapter used by some batches; it was settled once and remembered)."""
        if not names:
            return set()
        tensors = [*self.model.parameters(), *self.model.buffers()]
        with forked_rng(cuda_devices(tensors)), torch.enable_grad():
            root = reduce(loss_fn(self.model, batch), mask).sum().grad_fn
            reached = {id(v) for v in (getattr(node, "variable", None)
                                       for node in graph_nodes(root))
                       if isinstance(v, torch.Tensor)}
            del root  # (frees the graph)
        return {n for n in names if id(trainable[n]) in reached}


def _from_checkpoint(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``torch.utils.checkpoint``."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            return True
        tb = tb.tb_next
    return "saved tensor hooks" in str(error)
