"""gradlog inside a Hugging Face ``transformers.Trainer``: ``pip install -e '.[hf]'``.

Three pieces, because a ``Trainer`` computes one loss for the whole batch (a model's
``.loss`` is the mean over the batch's tokens) while gradlog needs one loss per datum:

- :class:`GradlogCallback` opens the store when training begins (resuming the store when
  the Trainer resumes from a checkpoint) and closes it when training ends.
- :class:`GradlogTrainer` (or :class:`GradlogTrainerMixin` on your own ``Trainer``
  subclass) computes per-datum losses from the model's logits and the labels, and returns
  the batch loss whose backward records them. Causal LMs (3-D logits): datum b's loss is
  the mean over its labelled tokens of the next-token cross-entropy, with the causal shift
  and ``-100`` labels ignored, as in the model's own loss; classifiers (2-D logits): the
  cross-entropy of each datum. Override :meth:`GradlogTrainerMixin.per_datum_losses` for
  anything else.
- :class:`IndexedDataset` adds each item's index as ``datum_id``: the datum's id in the
  store. The Trainer's sampler shuffles; the ids follow the data.

What the Trainer trains on. The batch loss is gradlog's: the mean over the batch's data of
each datum's loss, averaged over accumulated micro-batches. The model's own loss is the mean
over all labelled tokens of the accumulated batch; the two are equal when every sequence has
the same number of labelled tokens, and otherwise weigh tokens of short sequences more.

Supported: one process (CPU or one GPU) or several (``torchrun`` / ``accelerate launch``:
DDP; every rank records its own batches into the one store, as ``GradRecorder`` does under
torch.distributed), fp32 / bf16 / fp16 (the loss scale is honoured), gradient accumulation,
``resume_from_checkpoint``. Not supported: DeepSpeed, FSDP1 and ``DataParallel`` (several
devices in one process), each refused with the alternative.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from gradlog.analysis.frames import MissingExtraError
from gradlog.errors import InputError
from gradlog.integrations.session import RecordingSession, grad_scaler_scale

try:
    from transformers import Trainer, TrainerCallback
except ImportError:  # pragma: no cover - exercised without the extra
    raise MissingExtraError(
        "gradlog.integrations.transformers needs transformers, which is not installed: "
        "pip install transformers accelerate (or, in gradlog's folder, pip install -e '.[hf]')"
    ) from None

__all__ = [
    "DATUM_ID",
    "GradlogCallback",
    "GradlogTrainer",
    "GradlogTrainerMixin",
    "IndexedDataset",
    "causal_lm_losses",
]

DATUM_ID = "datum_id"
"""The batch key holding each datum's id (:class:`IndexedDataset` adds it)."""


class IndexedDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """``dataset`` whose items (dicts) also hold ``datum_id``: the item's index."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.dataset[index]
        if not isinstance(item, dict):
            raise InputError(
                f"IndexedDataset wraps datasets whose items are dicts (as a Trainer takes); "
                f"item {index} is a {type(item).__name__}."
            )
        return {**item, DATUM_ID: int(index)}


def causal_lm_losses(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy per token, and which tokens count.

    Args:
        logits: ``(B, T, V)`` from a causal LM.
        labels: ``(B, T)``: the input ids, with ``ignore_index`` where no loss is wanted.

    Returns:
        ``(losses, mask)``, both ``(B, T - 1)``: position ``t`` predicts ``labels[:, t + 1]``.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise InputError(
            f"causal_lm_losses takes logits (B, T, V) and labels (B, T); got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    shifted = logits[:, :-1, :]  # (B, T-1, V)
    targets = labels[:, 1:]  # (B, T-1)
    mask = targets != ignore_index  # (B, T-1)
    upcast = shifted.float() if shifted.dtype in (torch.float16, torch.bfloat16) else shifted
    losses = F.cross_entropy(
        upcast.transpose(1, 2), targets.masked_fill(~mask, 0), reduction="none"
    )  # (B, T-1)
    return losses, mask


class GradlogCallback(TrainerCallback):  # type: ignore[misc, unused-ignore]
    """Records per-datum gradients of a ``Trainer``'s training into a gradlog store.

    Use it with :class:`GradlogTrainer` (or :class:`GradlogTrainerMixin`), which computes the
    per-datum losses it records.

    Args:
        path: The store's directory.
        **options: :class:`gradlog.GradRecorder` options (``params``, ``dtype``, ``every``,
            ``probes``, ``overwrite``, ...). The model and the optimizer (for each step's
            learning rate) come from the Trainer; ``resume`` defaults to whether the Trainer
            resumes from a checkpoint.
    """

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        self.session = RecordingSession(path, options)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        devices = getattr(args, "n_gpu", 1)
        if devices > 1:
            raise InputError(
                f"gradlog's Trainer callback records one device per process; this Trainer runs "
                f"{devices} devices in one process (torch.nn.DataParallel). Launch one process "
                "per device (torchrun / accelerate launch: DDP), or set CUDA_VISIBLE_DEVICES."
            )
        if getattr(args, "deepspeed", None):
            raise InputError(
                "gradlog does not record DeepSpeed training (it partitions and replaces the "
                "parameters' gradients): train with DDP or FSDP2 (fsdp_version 2) instead."
            )
        model = kwargs.get("model")
        if model is None:
            raise InputError("gradlog: the Trainer passed no model to on_train_begin.")
        self.session.start(model, kwargs.get("optimizer"), resuming=state.global_step > 0,
                           wrapped=self.wrapped())

    def wrapped(self) -> Any:
        """The model as the Trainer runs it (DDP): set by :class:`GradlogTrainerMixin`."""
        return None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.check_used(
            "train with gradlog.integrations.transformers.GradlogTrainer (or a Trainer "
            "subclass with GradlogTrainerMixin), which computes the per-datum losses."
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.close()


class GradlogTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before ``Trainer``) to record with a
    :class:`GradlogCallback` among its callbacks. Batches need ``datum_id``
    (:class:`IndexedDataset`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The loss returned below is one micro-batch's mean: the Trainer must average it over
        # accumulated micro-batches (newer Trainers ask through these two attributes).
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False

    def train(self, *args: Any, **kwargs: Any) -> Any:
        for callback in getattr(self.callback_handler, "callbacks", []):  # type: ignore[attr-defined]
            if isinstance(callback, GradlogCallback):  # (fp16: accelerate's GradScaler)
                callback.session.amp_scale = lambda: grad_scaler_scale(
                    getattr(getattr(self, "accelerator", None), "scaler", None))
                # several processes: DDP's wrapper, set before on_train_begin
                callback.wrapped = lambda: getattr(self, "model_wrapped", None)  # type: ignore[method-assign]
        failed = True
        try:
            out = super().train(*args, **kwargs)  # type: ignore[misc]
            failed = False
            return out
        finally:  # also when training fails: hooks off the model, complete steps committed
            for callback in getattr(self.callback_handler, "callbacks", []):  # type: ignore[attr-defined]
                if isinstance(callback, GradlogCallback):
                    callback.session.close(failed=failed)

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()  # type: ignore[misc, unused-ignore]
        columns = getattr(self, "_signature_columns", None)
        if columns is not None and DATUM_ID not in columns:
            columns.append(DATUM_ID)  # so that remove_unused_columns keeps it

    def per_datum_losses(
        self, outputs: Any, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-datum ``(B,)`` or per-token ``(B, T)`` losses, and a token mask (or None)."""
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if logits.dim() == 3 and labels.dim() == 2:
            return causal_lm_losses(logits, labels)
        if logits.dim() == 2 and labels.dim() == 1:
            upcast = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
            return F.cross_entropy(upcast, labels, reduction="none"), None
        raise InputError(
            f"gradlog cannot tell how to compute per-datum losses from logits of shape "
            f"{tuple(logits.shape)} and labels of shape {tuple(labels.shape)}; override "
            "per_datum_losses(outputs, labels) in your Trainer subclass."
        )

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        inputs = dict(inputs)
        datum_ids = inputs.pop(DATUM_ID, None)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise InputError(
                "gradlog's Trainer computes per-datum losses from the batch's 'labels', and "
                "this batch has none. Add labels (for a causal LM: the input ids, -100 where no "
                "loss is wanted)."
            )
        outputs = model(**inputs)
        losses, mask = self.per_datum_losses(outputs, labels)
        session = self._gradlog_session()
        if session.recording and torch.is_grad_enabled() and datum_ids is None:
            raise InputError(
                f"the batch has no {DATUM_ID!r}: wrap the training set in "
                "gradlog.integrations.transformers.IndexedDataset (each item's index is its "
                "datum id), and keep the column with TrainingArguments(remove_unused_columns="
                "False) if your Trainer drops it."
            )
        state = getattr(self, "state", None)
        step = int(state.global_step) if state is not None else 0
        loss = session.loss(losses, datum_ids=datum_ids, step=step, mask=mask)
        return (loss, outputs) if return_outputs else loss

    def _gradlog_session(self) -> RecordingSession:
        handler = getattr(self, "callback_handler", None)
        found = [c for c in getattr(handler, "callbacks", []) if isinstance(c, GradlogCallback)]
        if len(found) != 1:
            raise InputError(
                f"a GradlogTrainer records through one GradlogCallback; it has {len(found)}. "
                "Pass callbacks=[GradlogCallback(path, ...)] to the Trainer."
            )
        return found[0].session


class GradlogTrainer(GradlogTrainerMixin, Trainer):  # type: ignore[misc, unused-ignore]
    """``transformers.Trainer`` with :class:`GradlogTrainerMixin`."""
