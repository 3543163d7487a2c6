"""gradlog inside a Lightning ``Trainer``: ``pip install -e '.[lightning]'``.

Add a :class:`GradlogCallback` to the Trainer's callbacks, and in ``training_step`` return
:func:`recorded_loss` of the per-datum losses instead of their mean::

    def training_step(self, batch, batch_idx):
        x, y, idx = batch                          # idx: each datum's index in the dataset
        losses = F.cross_entropy(self(x), y, reduction="none")     # (B,), or (B, T) + mask
        return recorded_loss(self, losses, datum_ids=idx)          # the batch mean, recorded

Lightning then runs its usual backward on that loss (scaled for ``accumulate_grad_batches``
and by an AMP loss scale), which records datum b's gradient of ``losses[b]`` at the step
``trainer.global_step`` (accumulated micro-batches share their step); ``p.grad`` is what the
backward of ``losses.mean()`` would give (see :mod:`gradlog.integrations.session`).

The callback opens the store when training starts (resuming it when the Trainer resumes from
a checkpoint: steps already in the store are not recorded again) and closes it when training
ends. Supported: one process (CPU or one GPU) and ``strategy="ddp"`` (every rank records its
own batches into the one store, as ``GradRecorder`` does under torch.distributed), any
precision, gradient accumulation, ``ckpt_path=`` resume. Not supported: FSDP (Lightning's
``FSDPStrategy`` is FSDP1) and DeepSpeed, refused at the start.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from gradlog.analysis.frames import MissingExtraError
from gradlog.errors import InputError
from gradlog.integrations.session import RecordingSession, grad_scaler_scale

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - exercised without the extra
    raise MissingExtraError(
        "gradlog.integrations.lightning needs Lightning, which is not installed: "
        "pip install lightning (or, in gradlog's folder, pip install -e '.[lightning]')"
    ) from None

__all__ = ["GradlogCallback", "recorded_loss"]

_STRATEGIES = frozenset({"DDPStrategy"})
"""Multi-process strategies recorded (every rank into the one store)."""


class GradlogCallback(Callback):  # type: ignore[misc, unused-ignore]
    """Records per-datum gradients of a Lightning Trainer's training into a gradlog store.

    Args:
        path: The store's directory.
        **options: :class:`gradlog.GradRecorder` options (``params``, ``dtype``, ``every``,
            ``probes``, ``overwrite``, ...). The model is the LightningModule and each step's
            learning rate comes from its first optimizer; ``resume`` defaults to whether the
            Trainer resumes from a checkpoint.
    """

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        self.session = RecordingSession(path, options)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = getattr(trainer, "strategy", None)
        if trainer.world_size > 1 and type(strategy).__name__ not in _STRATEGIES:
            raise InputError(
                f"gradlog's Lightning callback records one process or the strategies "
                f"{sorted(_STRATEGIES)} (strategy='ddp'); this Trainer runs "
                f"{trainer.world_size} processes with {type(strategy).__name__}. Use "
                "strategy='ddp', or record with GradRecorder in each rank."
            )
        optimizers = trainer.optimizers
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        self.session.amp_scale = lambda: grad_scaler_scale(scaler)
        self.session.start(
            pl_module, optimizers[0] if optimizers else None, resuming=trainer.global_step > 0,
            wrapped=getattr(strategy, "model", None),  # DDP's wrapper of pl_module
        )

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.session.check_used(
            "return gradlog.integrations.lightning.recorded_loss(self, losses, datum_ids=...) "
            "from training_step."
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # committed steps stay, the step in progress only if it is known to be complete
        self.session.close(failed=True)


def recorded_loss(
    module: Any,
    losses: torch.Tensor,
    *,
    datum_ids: Any,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batch loss for ``training_step`` to return, whose backward records per datum.

    Args:
        module: The LightningModule (``self`` in ``training_step``).
        losses: Per-datum ``(B,)`` or per-token ``(B, T)`` losses, not reduced.
        datum_ids: One int per datum: its index in the training set.
        mask: For ``(B, T)`` losses, the tokens that count.

    Returns:
        The scalar batch loss (the mean over data of each datum's loss, or the sum with
        ``batch_reduction="sum"``); outside training it is that loss, not recorded.
    """
    trainer = getattr(module, "_trainer", None) or getattr(module, "trainer", None)
    found = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, GradlogCallback)]
    if len(found) != 1:
        raise InputError(
            f"recorded_loss records through one GradlogCallback among the Trainer's callbacks; "
            f"it has {len(found)}. Pass Trainer(callbacks=[GradlogCallback(path, ...)])."
        )
    step = int(trainer.global_step) if trainer is not None else 0
    return found[0].session.loss(losses, datum_ids=datum_ids, step=step, mask=mask)
