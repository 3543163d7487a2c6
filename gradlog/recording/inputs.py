"""Checks of what a ``backward``/``step`` call is given, before any backward runs, and of
what the backend returns: datum ids, learning rates, losses, per-datum gradient shapes."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from gradlog.backends import PerDatumGrads
from gradlog.errors import GradlogError, InputError, NonFiniteLossError, UnsupportedLayerError
from gradlog.grads import batch_size, material_shape
from gradlog.losses import DeviceChecks

__all__ = [
    "INT64_MAX",
    "LossChecks",
    "check_grad_shapes",
    "check_mask",
    "datum_ids_array",
    "lr_value",
    "on_step_of",
    "optimizer_lr",
    "tokens_of",
]

_COUPLING_LAYERS = (nn.modules.batchnorm._BatchNorm,)


INT64_MAX = 2**63 - 1
"""The largest step or datum id: the store keeps them as int64."""


def datum_ids_array(datum_ids: Any, batch: int) -> np.ndarray:
    """``datum_ids`` as int64 ``(B,)``.

    Raises:
        InputError: not one integer >= 0 per datum.
    """
    if isinstance(datum_ids, torch.Tensor):
        ids = datum_ids.detach().cpu().numpy()
    else:
        try:
            ids = np.asarray(datum_ids)
        except (TypeError, ValueError):
            ids = np.asarray([None])
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise InputError(
            f"datum_ids must be a 1-D sequence of integers (each datum's index in your "
            f"dataset), got {type(datum_ids).__name__} of shape {ids.shape} and dtype {ids.dtype}."
        )
    if ids.size and int(ids.min()) < 0:
        raise InputError(
            f"datum_ids must be >= 0 (each datum's index in your dataset), got {int(ids.min())}."
        )
    if ids.size and int(ids.max()) > INT64_MAX:  # uint64 ids would wrap to negative int64
        raise InputError(
            f"datum_ids must be <= 2**63 - 1 (the store keeps them as int64), got "
            f"{int(ids.max())}. Map your ids into that range (e.g. your dataset's row index)."
        )
    if len(ids) != batch:
        raise InputError(
            f"datum_ids has {len(ids)} entries but losses hold {batch} datums; pass one id per "
            "datum, in the order of the batch."
        )
    return ids.astype(np.int64)


def lr_value(lr: Any, what: str) -> float:
    """``lr`` as a float, refused unless it is one finite number: a NaN or infinite rate
    would be stored, and the run would then read as damaged and score NaN influence."""
    value = lr
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy() if value.numel() == 1 else None
    if isinstance(value, np.ndarray):
        value = value.reshape(()).item() if value.size == 1 else None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InputError(
            f"{what}={lr!r} must be a number (the learning rate applied at this step), got "
            f"{type(lr).__name__}. The step was refused before any backward: p.grad is "
            "unchanged and earlier steps are committed."
        )
    value = float(value)
    if not np.isfinite(value):
        raise InputError(
            f"{what}={value} is not finite. The step was refused before any backward: p.grad "
            "is unchanged and earlier steps are committed. Pass the learning rate applied at "
            "this step" + (" as lr=." if what != "lr" else " (or lr=None to record none).")
        )
    return value


def optimizer_lr(optimizer: Any, params: Iterable[Any] = ()) -> float:
    """The learning rate of ``optimizer``'s first param group holding one of ``params`` (the
    recorded parameters; the first group if none does), checked as ``lr=``. Groups at
    other rates are read per parameter from the optimizer's state at query time."""
    mine = {id(p) for p in params}
    groups = optimizer.param_groups
    at = next((i for i, g in enumerate(groups) if any(id(p) in mine for p in g["params"])), 0)
    return lr_value(groups[at]["lr"], f"the optimizer's learning rate (param_groups[{at}]['lr'])")


def on_step_of(optimizer: Any, hook: Callable[..., None]) -> Any:
    """Register ``hook`` to run after each step of ``optimizer`` (or of the torch optimizer a
    wrapper holds, e.g. accelerate's ``AcceleratedOptimizer``); its handle, or None."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        return None
    try:
        return inner.register_step_post_hook(hook)
    except (AttributeError, RuntimeError, TypeError):  # an optimizer without the hooks
        return None


class LossChecks:
    """Refuses a batch whose per-datum gradients would be meaningless: no datum, a NaN or
    infinite loss, or a layer that couples the datums (BatchNorm in training mode)."""

    def __init__(self, model: nn.Module) -> None:
        self._coupling = [
            (n, m) for n, m in model.named_modules() if isinstance(m, _COUPLING_LAYERS)
        ]

    def __call__(self, reduced: torch.Tensor, datum_ids: Any,
                 checks: DeviceChecks | None = None) -> None:
        """Check the per-datum losses ``(B,)`` of a batch and its ``datum_ids``; with
        ``checks``, the losses' finiteness is read when they are settled, not now.

        Raises:
            InputError: an empty batch or malformed ids.
            NonFiniteLossError: a NaN or infinite loss, naming the datums.
            UnsupportedLayerError: a coupling layer in training mode.
        """
        batch = reduced.shape[0]
        if batch == 0:
            import torch.distributed as dist

            alone = ("; under torch.distributed a rank cannot skip a step alone (the other "
                     "ranks would wait for it in DDP's and gradlog's collectives): give every "
                     "rank at least one datum a step (DistributedSampler pads; drop_last=True "
                     "drops a short last batch)" if dist.is_available() and dist.is_initialized()
                     and dist.get_world_size() > 1 else "")
            raise InputError(f"losses hold no datum (batch size 0); skip empty batches{alone}.")
        ids = None if datum_ids is None else datum_ids_array(datum_ids, batch)
        finite = torch.isfinite(reduced.detach())

        def refuse() -> None:
            bad = torch.nonzero(~finite).flatten().tolist()[:10]
            named = ids[bad].tolist() if ids is not None else bad
            raise NonFiniteLossError(
                f"the loss of datum(s) {named} (batch positions {bad}) is NaN or infinite, so "
                "their gradients are meaningless. The step was refused: p.grad is as it was "
                "before this call and earlier steps are committed. Skip this batch or fix the "
                "loss (e.g. clamp log arguments, check for empty masks)."
            )

        if checks is not None:
            checks.add(~finite.all(), refuse)
        elif not bool(finite.all()):
            refuse()
        for name, module in self._coupling:
            if module.training:
                raise UnsupportedLayerError(
                    f"{type(module).__name__} {name!r} is in training mode: it normalises "
                    "with statistics of the whole batch, so a datum's gradient depends on the "
                    "other datums and per-datum gradients are not defined. Fixes: put it in "
                    "eval mode (module.eval()), replace it with GroupNorm or LayerNorm, or use "
                    "a batch of one. This can never be supported for training-mode BatchNorm."
                )


def check_grad_shapes(
    grads: PerDatumGrads, batch: int, params: Mapping[str, torch.Tensor], backend: str
) -> None:
    """Every per-datum gradient is ``(B, *param.shape)``.

    Raises:
        GradlogError: a backend returned another batch dimension (a broadcast one, e.g.
            position ids of shape ``[1, T]``, taken for a datum).
    """
    for name, g in grads.items():
        got = (batch_size(g), *material_shape(g))
        if got != (batch, *params[name].shape):
            raise GradlogError(
                f"backend {backend!r} returned per-datum gradients of shape "
                f"{got} for {name!r}; expected {(batch, *params[name].shape)}"
                ". A broadcast batch dimension (e.g. position ids of shape [1, T]) was "
                "taken for a datum; please report this with the model."
            )


def check_mask(mask: Any) -> None:
    """Refuse a token mask that is not bool or 0/1: a value such as 0.5 would count its token
    fully (the mask selects tokens, it does not weight them), which no caller means.

    Raises:
        InputError: ``mask`` is not a tensor, or holds a value other than 0 and 1.
    """
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise InputError(
            f"mask must be a bool (or 0/1) tensor of the per-token losses' shape (B, T), got "
            f"{type(mask).__name__}."
        )
    if mask.dtype == torch.bool:
        return
    other = (mask != 0) & (mask != 1)  # (B, T)
    if bool(other.any()):
        value = mask[other].flatten()[0].item()
        raise InputError(
            f"mask holds {value!r} (and {int(other.sum())} values in all) other than 0 and 1; "
            "it selects the tokens that count, it does not weight them. Pass a bool mask "
            "(e.g. labels != -100); to weight tokens, multiply the per-token losses by the "
            "weights before GradRecorder.backward."
        )


def tokens_of(mask: torch.Tensor | None, batch: int, per_datum: int) -> int:
    """Tokens a batch counts: its unmasked tokens, else ``batch * per_datum``."""
    if mask is not None:
        return int((mask != 0).sum())
    return batch * per_datum
