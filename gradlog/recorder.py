"""``GradRecorder``: the facade that wraps the user's training loop.

It takes the options (:func:`gradlog.config.split_options`), checks each call's inputs and
hands recorded batches to the step pipeline (:mod:`gradlog.recording`), which computes,
self-checks, encodes and writes them.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import warnings
from types import TracebackType
from typing import Any

import torch
from torch import nn

from gradlog import planning
from gradlog.backends import Backend, LossFn, PerDatumGrads
from gradlog.config import RecorderConfig, RecordingOptions, split_options
from gradlog.errors import GradlogError, InputError
from gradlog.forms import Form
from gradlog.losses import DeviceChecks, per_datum_losses
from gradlog.params import check_differentiable, select_params
from gradlog.recording.encoding import FormEncoder
from gradlog.recording.inputs import check_mask, lr_value
from gradlog.recording.pipeline import StepPipeline
from gradlog.store.writer import StoreWriter

__all__ = ["GradRecorder"]

log = logging.getLogger("gradlog")


class GradRecorder:
    """Records the per-datum gradient of every selected parameter at every step.

    Use it as a context manager around the training loop and call :meth:`backward` (or
    :meth:`step`) where the loop called ``loss.backward()``::

        with gradlog.GradRecorder(model, "runs/demo.gradlog", form="factors") as rec:
            for x, y, idx in loader:
                losses = F.cross_entropy(model(x), y, reduction="none")  # (B,)
                rec.backward(losses, datum_ids=idx)
                opt.step(); opt.zero_grad()

    Afterwards ``p.grad`` holds the gradient of ``losses.mean()`` (or ``.sum()``), exactly as
    the ordinary backward would leave it; each record stores its weight ``w_b`` so that
    ``sum_b w_b g_b == p.grad``.

    Args:
        model: The model being trained. It is never wrapped, renamed or modified.
        path: Directory of the new store, conventionally ``NAME.gradlog``.
        config: What is recorded, built beforehand (then no option of it is passed here).
        **options: Each field of :class:`gradlog.RecorderConfig` (what is recorded:
            ``params``, ``backend``, ``dtype``, ``form``, ``every``, ...) and of
            :class:`gradlog.config.RecordingOptions` (how this process records:
            ``optimizer``, ``overwrite``, ``resume``, ``probes``, ...), by name; each is
            documented there.

    Raises:
        ConfigError: an unknown option (with the likeliest meant one) or an invalid value.
        InputError: ``model`` is not a module, or invalid recording options.
    """

    def __init__(
        self,
        model: nn.Module,
        path: str | os.PathLike[str],
        config: RecorderConfig | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        self.config, self.options = split_options(config, options)
        self.model = model
        self.path = path
        self.params = select_params(model, self.config.params)
        planning.check_requests(self.config, self.params)
        self._encoder = FormEncoder(self.config, self.options, self.params, path)
        self._pipeline: StepPipeline | None = None  # while recording
        # Set by gradlog.integrations around their backward. The factor a trainer scaled this
        # micro-batch's loss by for gradient accumulation (1/k): part of each stored weight,
        # so that sum_b w_b g_b is the gradient the optimizer steps with. And the whole
        # factor it scaled the loss by (1/k times an AMP loss scale): the batch loss's, so
        # that p.grad is the trainer's own (an fp16 backward needs the loss scale).
        self._weight_scale = 1.0
        self._seed_scale = 1.0
        self._scaled: tuple[int, float] | None = None  # (step, scale) of the last scaler=
        # Forwards with grad before the first rec.backward/rec.step: a loop that kept its
        # loss.backward() records nothing, which close() then says (the hook goes at the
        # first call, so a recorded step pays nothing for it)
        self._unrecorded: Any = None
        self._forwards_unrecorded = 0

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> GradRecorder:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # An exception leaving the block: the step in progress is committed only when it is
        # known to be complete; otherwise it is left uncommitted, as after a crash.
        self.close(failed=exc is not None)

    def open(self) -> None:
        """Create the store and start recording (``with`` does this)."""
        if self._pipeline is not None:
            raise GradlogError("this GradRecorder is already recording; use one per run.")
        self._pipeline = StepPipeline.open(
            self.model, self.params, self.config, self.options, self.path, self._encoder
        )
        self._unrecorded = self.model.register_forward_hook(self._count_unrecorded)
        log.info(
            "gradlog: recording %d parameters (%s per datum per step) into %s",
            len(self.params),
            planning.format_bytes(self.bytes_per_record),
            self.path,
        )

    def close(self, *, failed: bool = False) -> None:
        """Commit the last step, remove hooks and finish the store (``with`` does this).

        Args:
            failed: True when training failed (``with`` passes it when an exception leaves
                the block): the step in progress is then committed only if it is known to be
                complete (a later step was begun, or the optimizer stepped after its last
                micro-batch), else left uncommitted as after a crash; ``resume=True``
                records it again.
        """
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close(failed=failed)
        if self._unrecorded is not None:
            self._unrecorded.remove()
            self._unrecorded = None
            if self._forwards_unrecorded and not failed:
                warnings.warn(
                    f"the model ran {self._forwards_unrecorded} forward(s) with gradients "
                    "inside this GradRecorder, but rec.backward / rec.step was never called: "
                    "nothing was recorded. Replace loss.backward() with "
                    "rec.backward(per_datum_losses) (losses of shape (B,) or (B, T), not "
                    "reduced).", stacklevel=2)

    def _count_unrecorded(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._forwards_unrecorded += 1

    def _recording_called(self) -> None:
        """The first rec.backward/rec.step: the loop records, the forward count can go."""
        if self._unrecorded is not None:
            self._unrecorded.remove()
            self._unrecorded = None

    def flush(self) -> None:
        """Wait until everything recorded so far is written and every completed step is
        committed (the step in progress commits when the next one begins, or at close).

        Raises:
            StoreWriteError: the background writer failed.
        """
        self._require_open().writer.flush()

    # -- what is recorded -------------------------------------------------------------------
    @property
    def forms(self) -> dict[str, Form] | None:
        """Each parameter's form: planned at the first recorded backward (None before)."""
        return self._encoder.forms

    @property
    def plan(self) -> str | None:
        """The plan's bytes table (form and bytes per step per parameter), as logged."""
        return self._encoder.plan

    @property
    def bytes_per_record(self) -> int:
        """Stored bytes of one datum's gradients (all recorded parameters; by their forms once
        planned, else as ``full``)."""
        return self._encoder.bytes_per_record

    @property
    def steps_recorded(self) -> int:
        """Steps committed so far."""
        return 0 if self._pipeline is None else self._pipeline.lifecycle.steps_recorded

    @property
    def records_written(self) -> int:
        """Records handed to the writer so far."""
        return 0 if self._pipeline is None else self._pipeline.lifecycle.records_written

    @property
    def rules(self) -> dict[str, Any] | None:
        """Which rule computes each recorded parameter: the modules hooked and their rules,
        those re-run per datum (``"fallback"``) and the ops of the forwards so far that took a
        parameter outside its modules (``"ops"``). The store's ``attrs["backend"]`` holds
        this as it was when recording started, before any forward (None before that)."""
        return None if self._backend is None else self._backend.describe()

    @property
    def _backend(self) -> Backend | None:
        return None if self._pipeline is None else self._pipeline.backend

    @property
    def _writer(self) -> StoreWriter | None:
        return None if self._pipeline is None else self._pipeline.writer

    # -- recording --------------------------------------------------------------------------
    def backward(
        self,
        losses: torch.Tensor,
        *,
        datum_ids: Any = None,
        step: int | None = None,
        lr: float | None = None,
        mask: torch.Tensor | None = None,
        scaler: Any = None,
    ) -> torch.Tensor:
        """Replaces ``loss.backward()``: backward of the batch loss, recording per datum.

        Args:
            losses: Per-datum losses ``(B,)`` or per-token losses ``(B, T)``, not reduced.
            datum_ids: One int per datum (its index in the dataset); default: a counter.
            step: The optimizer step (non-decreasing; repeating it accumulates micro-batches
                into one step); default: the previous step + 1.
            lr: The learning rate applied at this step (stored for influence); default:
                the optimizer's, if one was given. A NaN, infinite or non-numeric rate is
                refused with :class:`~gradlog.errors.InputError` before any backward.
            mask: For ``(B, T)`` losses, which tokens count (bool or 0/1).
            scaler: The ``torch.amp.GradScaler`` of an fp16 step: the batch loss is
                backpropagated times its scale, as ``scaler.scale(loss).backward()`` would,
                so that ``scaler.step(optimizer)`` unscales what it expects; the records
                stay unscaled. A step it then skips (overflow) is named in a warning at
                the next step.

        Returns:
            The per-datum losses ``(B,)``, detached.
        """
        pipeline = self._require_open()
        self._recording_called()
        backend, lifecycle = pipeline.backend, pipeline.lifecycle
        check_mask(mask)  # before anything of this call is noted
        lifecycle.note_attempt(step)
        # The checks that read the losses' values (a NaN, ignored labels) wait for the device:
        # read together as late as p.grad allows, after the backend's walks of the graph.
        loss_checks = DeviceChecks()
        reduced = self._reduce(losses, mask, loss_checks)
        pipeline.check_losses(reduced, datum_ids, loss_checks)
        check_differentiable(self.params, reduced)  # frozen parameters, losses without grad
        lr = None if lr is None else lr_value(lr, "lr")
        step = lifecycle.resolve(step)
        seed = self._seed_scale * self._loss_scale(scaler, step, reduced.device)

        def batch_loss() -> torch.Tensor:
            loss = backend.reduce_batch(reduced)
            return loss if seed == 1.0 else loss * seed

        if not lifecycle.records(step):
            loss_checks.settle()
            batch_loss().backward()
            lifecycle.skip(step, int(reduced.shape[0]), datum_ids)
            return reduced.detach()

        def compute() -> tuple[torch.Tensor, PerDatumGrads]:
            backend.seed_scale = seed
            try:
                if not backend.settles_loss_checks:
                    loss_checks.settle()
                    return reduced, backend.backward(reduced, batch_loss())
                backend.loss_checks = loss_checks  # read before it touches p.grad, after walks
                return reduced, backend.backward(reduced, batch_loss())
            finally:  # (never left for a later call to read, nor holding this graph)
                backend.loss_checks = None
                backend.seed_scale = 1.0

        tokens_per_datum = losses.shape[1] if losses.dim() == 2 else 1
        return pipeline.record(compute, step, datum_ids, lr, mask, tokens_per_datum,
                               self._weight_scale, seed)

    def step(
        self,
        loss_fn: LossFn,
        batch: Any,
        *,
        datum_ids: Any = None,
        step: int | None = None,
        lr: float | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Functional entry point, supported by every backend.

        ``loss_fn(model, batch)`` returns per-datum ``(B,)`` or per-token ``(B, T)`` losses;
        the rest is as :meth:`backward`. Returns the per-datum losses ``(B,)``, detached.
        """
        pipeline = self._require_open()
        self._recording_called()
        backend, lifecycle = pipeline.backend, pipeline.lifecycle
        check_mask(mask)  # before anything of this call is noted
        lifecycle.note_attempt(step)
        lr = None if lr is None else lr_value(lr, "lr")
        step = lifecycle.resolve(step)
        seen_tokens: list[int] = []

        def reduce(raw: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            seen_tokens.append(raw.shape[1] if raw.dim() == 2 else 1)  # tokens per datum
            return self._reduce(raw, mask)

        if not lifecycle.records(step):
            reduced = reduce(loss_fn(self.model, batch), mask)
            pipeline.check_losses(reduced, datum_ids)
            check_differentiable(self.params, reduced)
            backend.reduce_batch(reduced).backward()
            lifecycle.skip(step, int(reduced.shape[0]), datum_ids)
            return reduced.detach()

        def compute() -> tuple[torch.Tensor, PerDatumGrads]:
            return backend.step(
                loss_fn, batch, reduce, mask, lambda r: pipeline.check_losses(r, datum_ids)
            )

        return pipeline.record(compute, step, datum_ids, lr, mask, lambda: seen_tokens[-1],
                               self._weight_scale)

    # -- internals --------------------------------------------------------------------------
    def _loss_scale(self, scaler: Any, step: int, device: torch.device) -> float:
        """``scaler``'s loss scale (1: None, or disabled), set up on ``device`` as its
        ``scale(loss)`` does (``scaler.step`` needs that); warns when its drop (a GradScaler
        halves it on overflow) shows it skipped the last step recorded with it."""
        if scaler is None:
            return 1.0
        if not all(callable(getattr(scaler, k, None)) for k in ("get_scale", "is_enabled",
                                                                 "scale")):
            raise InputError(f"scaler= takes a torch.amp.GradScaler; got {type(scaler).__name__}.")
        if not scaler.is_enabled():
            return 1.0
        scaler.scale(torch.ones((), device=device))  # (its scale made there, if not yet)
        scale = float(scaler.get_scale())
        last, self._scaled = self._scaled, (step, scale)
        if last is not None and last[0] != step and scale < last[1]:
            warnings.warn(
                f"the AMP loss scaler skipped step {last[0]} (its scaled fp16 gradients "
                "overflowed; the optimizer did not step): its records are kept as recorded. "
                f"Leave it out of queries (steps= without {last[0]}).", UserWarning, stacklevel=3)
        return scale

    def _reduce(self, raw: torch.Tensor, mask: torch.Tensor | None,
                checks: DeviceChecks | None = None) -> torch.Tensor:
        return per_datum_losses(raw, mask, self.config.token_reduction, checks)

    def _require_open(self) -> StepPipeline:
        if self._pipeline is None:
            raise GradlogError(
                "GradRecorder is not recording: use it as `with GradRecorder(...) as rec:` "
                "(or call rec.open() first), and call rec.backward() inside the block."
            )
        return self._pipeline


def _options_signature() -> inspect.Signature:
    """``GradRecorder.__init__``'s signature with every option spelled out (for ``help()``
    and editors), taken from the fields of :class:`RecorderConfig` and
    :class:`RecordingOptions`, where they are declared and documented."""
    own = inspect.signature(GradRecorder.__init__)
    fixed = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    options = []
    for cls in (RecorderConfig, RecordingOptions):
        for f in dataclasses.fields(cls):
            default = f.default
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            options.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                             default=default, annotation=f.type))
    return own.replace(parameters=[*fixed, *options])


GradRecorder.__init__.__signature__ = _options_signature()  # type: ignore[attr-defined]
