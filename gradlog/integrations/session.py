"""Recording inside a trainer that runs the backward itself (transformers, Lightning).

A trainer computes a loss, scales it (``1/k`` for ``k`` accumulated micro-batches, an AMP
loss scale), and calls ``.backward()`` on it. gradlog needs that backward to go through
:meth:`GradRecorder.backward`, which runs the batch's one ordinary backward and captures the
per-datum gradients. :meth:`RecordingSession.loss` returns the batch loss as a scalar whose
autograd node defers: when the trainer's backward reaches it with the trainer's scale ``c``,
it runs ``GradRecorder.backward`` on the per-datum losses (reentrant autograd, as
``torch.utils.checkpoint`` does), so that ``p.grad`` receives ``c`` times the gradient of the
batch loss, exactly what the trainer's own backward would have accumulated.

The recorder's backward of the batch loss carries ``c`` (``GradRecorder._seed_scale``), as
the trainer's own would: ``p.grad`` of every leaf, the model's or not, is bitwise the
trainer's, and an fp16 backward keeps its loss scale. Per-datum gradients and losses are
recorded unscaled; each record's weight includes ``c`` divided by the AMP loss scale (the
trainer unscales ``p.grad`` by it before the optimizer step), so that ``sum_b w_b g_b`` over
a step's micro-batches is the gradient the optimizer steps with (``1/(k B)`` for ``k``
accumulated micro-batches of ``B``). A step the AMP scaler skipped (its scaled gradients
overflowed) is kept as recorded, with a warning naming it when the scale's drop shows it.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradlog.errors import InputError
from gradlog.losses import per_datum_losses
from gradlog.recorder import GradRecorder

__all__ = ["RecordingSession", "world_size"]


def world_size() -> int:
    """Processes of the torch.distributed run this process is in (1 without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())


class _Deferred(torch.autograd.Function):
    """A scalar whose backward runs the session's recorded backward of the real losses."""

    @staticmethod
    def forward(  # type: ignore[override, unused-ignore]
        ctx: Any, anchor: torch.Tensor, value: torch.Tensor, run: Any
    ) -> torch.Tensor:
        ctx.run = run
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override, unused-ignore]
        run, ctx.run = ctx.run, None  # once: the graph holds the batch's tensors until then
        if run is None:
            raise InputError(
                "gradlog: the loss of a recorded batch was backpropagated twice; a recorded "
                "step runs one backward per batch."
            )
        with torch.enable_grad():  # autograd runs a Function's backward without grad mode
            run(grad)
        return None, None, None


class RecordingSession:
    """One :class:`GradRecorder` driven by a trainer's callback.

    Args:
        path: The store's directory.
        options: :class:`GradRecorder` options (``params``, ``dtype``, ``every``, ...).
    """

    def __init__(self, path: str | os.PathLike[str], options: dict[str, Any]) -> None:
        for fixed in ("model", "optimizer"):
            if fixed in options:
                raise InputError(
                    f"{fixed}= is taken from the trainer; drop it from the gradlog callback's "
                    "options."
                )
        self.path = path
        self.options = dict(options)
        self.recorder: GradRecorder | None = None
        self.model: nn.Module | None = None
        self._committed: int | None = None  # last step in the store when training resumed
        self._losses = 0  # batches that went through loss() since start()
        # the trainer's AMP loss scale (a GradScaler's; 1 without one): set by the callback
        self.amp_scale: Callable[[], float] = lambda: 1.0
        self._scaled: tuple[int, float] | None = None  # last recorded step, its AMP scale

    @property
    def recording(self) -> bool:
        return self.recorder is not None

    def start(
        self, model: nn.Module, optimizer: Any, *, resuming: bool, wrapped: nn.Module | None = None
    ) -> None:
        """Open the store: a new one, or with ``resuming`` the store of the interrupted run
        (records of steps it already committed are kept and those steps are not recorded
        again).

        Args:
            model: The trainer's model (the user's module, unwrapped).
            optimizer: The trainer's optimizer (each step's learning rate).
            resuming: Whether the trainer resumes from a checkpoint.
            wrapped: The model as the trainer runs it (a ``DistributedDataParallel``, or
                the FSDP2-sharded model). When several processes train
                (torch.distributed), every rank records into the one store through it:
                DDP's gradient sync (off for accumulated micro-batches) is read from it.
        """
        if self.recorder is not None:
            return
        options = dict(self.options)
        options.setdefault("resume", resuming)
        if options["resume"]:
            self._committed = _last_committed(self.path)
        if world_size() > 1:  # every rank into the one store (gradlog.distributed)
            options.setdefault("distributed", True)
            if options["distributed"] and wrapped is not None:
                model = wrapped
        self.recorder = GradRecorder(model, self.path, optimizer=optimizer, **options)
        self.recorder.open()
        self.model = model
        self._losses = 0

    def check_used(self, how: str) -> None:
        """After a training step: refuse a trainer whose loss never came through
        :meth:`loss` (nothing would be recorded). ``how`` says what the user must do."""
        if self.recorder is not None and self._losses == 0:
            self.close(failed=True)  # (refused: not also warned that nothing was recorded)
            raise InputError(f"gradlog recorded nothing during a training step: {how}")

    def close(self, *, failed: bool = False) -> None:
        """Commit the last step and close the store (``failed``: see GradRecorder.close)."""
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            self._note_skipped(None)
            recorder.close(failed=failed)

    def _note_skipped(self, step: int | None) -> None:
        """Before step ``step`` (None: at the end): warn if the AMP scaler skipped the last
        recorded step, which its scale's drop shows (a GradScaler halves it on overflow)."""
        last = self._scaled
        if last is None or last[0] == step:
            return
        self._scaled = None
        if self.amp_scale() < last[1]:
            warnings.warn(
                f"the AMP loss scaler skipped step {last[0]} (its scaled fp16 gradients "
                "overflowed; the optimizer did not step): its records are kept as recorded, "
                "their gradients mostly non-finite. Leave it out of queries "
                f"(steps= without {last[0]}).",
                UserWarning,
                stacklevel=2,
            )

    def loss(
        self,
        losses: torch.Tensor,
        *,
        datum_ids: Any,
        step: int,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The batch loss (a scalar) for the trainer to backpropagate; its backward records
        datum b's gradient of ``losses[b]`` at ``step``.

        Outside training (no recorder open, or gradients disabled, as in evaluation) it is the
        plain batch loss.
        """
        recorder = self.recorder
        self._losses += 1
        token_reduction = self.options.get("token_reduction", "mean")
        recording = recorder is not None and torch.is_grad_enabled() and losses.requires_grad
        with warnings.catch_warnings():
            if recording:  # (the recorder's backward warns of them, once a batch)
                warnings.filterwarnings("ignore", message=r"per-token losses .* exact zeros")
            reduced = per_datum_losses(losses, mask, token_reduction)  # (B,)
        batch_reduction = self.options.get("batch_reduction", "mean")
        batch = reduced.mean() if batch_reduction == "mean" else reduced.sum()
        if recorder is None or not torch.is_grad_enabled() or not reduced.requires_grad:
            return batch
        if datum_ids is None:
            raise InputError(
                "gradlog needs each datum's id (its index in the training set) with the batch; "
                "see the integration's docs for where it comes from."
            )
        anchor = torch.zeros((), device=batch.device, requires_grad=True)

        def run(scale: torch.Tensor) -> None:
            self._backward(losses, datum_ids, step, mask, reduced, batch, float(scale))

        out: torch.Tensor = _Deferred.apply(anchor, batch.detach(), run)
        return out

    def _backward(
        self,
        losses: torch.Tensor,
        datum_ids: Any,
        step: int,
        mask: torch.Tensor | None,
        reduced: torch.Tensor,
        batch: torch.Tensor,
        scale: float,
    ) -> None:
        recorder, model = self.recorder, self.model
        if recorder is None or model is None:
            raise InputError("gradlog: the recorder was closed before the batch's backward.")
        if self._committed is not None and step <= self._committed:
            (batch * scale).backward()  # already in the store from before the resume
            return
        if not bool(torch.isfinite(reduced.detach()).all()):
            # refused by the recorder before any backward (p.grad untouched)
            recorder.backward(losses, datum_ids=datum_ids, step=step, mask=mask)
            return
        if not math.isfinite(scale) or scale == 0:
            raise InputError(
                f"the trainer scaled the loss by {scale}; gradlog records only batches whose "
                "loss is scaled by a finite, nonzero factor."
            )
        # The recorded backward carries the trainer's whole scale, as its own would: p.grad
        # of every leaf (the model's or not) is what the trainer expects, and an fp16
        # backward keeps its loss scale (unscaled, small gradients underflow)
        self._note_skipped(step)
        self._scaled = (step, self.amp_scale())
        recorder._weight_scale = scale / self.amp_scale()  # the accumulation's 1/k
        recorder._seed_scale = scale
        try:
            recorder.backward(losses, datum_ids=datum_ids, step=step, mask=mask)
        finally:
            recorder._weight_scale = recorder._seed_scale = 1.0


def grad_scaler_scale(scaler: Any) -> float:
    """The loss scale of a ``torch.amp.GradScaler`` (1 when there is none or it is off)."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return 1.0
    return float(scaler.get_scale())


def _last_committed(path: str | os.PathLike[str]) -> int | None:
    from gradlog.errors import NotAStoreError
    from gradlog.run import Run

    try:
        steps = Run(path).steps.column("step").to_pylist()
    except NotAStoreError:
        return None
    return max(steps) if steps else None
