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

from gradlog._torch_private import tensor_hooks, tensor_post_accumulate_hooks
from gradlog._tree import flatten
from gradlog.backends.base import Backend, LossFn, PerDatumGrads
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
                    "saw all of them. Put per-datum values in the batch as tensors (B, ...)."
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
                f"torch.func.vmap could not differentiate this model per datum: {e}. In-place "
                "updates of buffers (BatchNorm in training mode) and data-dependent control "
                "flow are not supported by vmap; use backend='loop'."
            ) from e
        check(losses)

        # p.grad of every trainable parameter from the same per-datum gradients, as autograd
        # would accumulate it: the parameter's gradient hooks first, then accumulation, then
        # its post-accumulate hooks. A parameter whose every per-datum gradient is exactly 0
        # and that has no .grad yet is taken as unused by the loss and keeps .grad None, as
        # after an ordinary backward (optimizers then skip it: no weight decay, no moments);
        # vmap has no graph to tell it from a used parameter whose gradient is exactly 0 (a
        # layer whose units are all dead), which an ordinary backward gives zeros.
        fresh = [n for n, p in trainable.items() if p.grad is None]
        nonzero = torch.stack([grads[n].any() for n in fresh]).tolist() if fresh else []
        unused = {n for n, used in zip(fresh, nonzero) if not used}  # (one device sync)
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


def _from_checkpoint(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``torch.utils.checkpoint``."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            return True
        tb = tb.tb_next
    return "saved tensor hooks" in str(error)
