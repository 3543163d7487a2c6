"""The step pipeline behind :class:`gradlog.GradRecorder`: one recorded backward call goes
begin (step, learning rate, checks) -> backward (the backend's per-datum gradients) ->
self-check -> probes -> encode (forms) -> stage (host arrays) -> hand over (the writer) ->
account (the step in progress, committed by :class:`StepLifecycle`).

Each stage is its own component; this module wires them: :meth:`StepPipeline.open` builds
them around a started backend and writer, :meth:`StepPipeline.record` runs a batch through.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from gradlog import planning
from gradlog.backends import BACKENDS, Backend, PerDatumGrads
from gradlog.config import RecorderConfig, RecordingOptions
from gradlog.distributed import Distributed, check_backend, detect
from gradlog.errors import BackendError, InputError
from gradlog.recording import handoff
from gradlog.recording.agreement import share_plan
from gradlog.recording.encoding import FormEncoder
from gradlog.recording.inputs import (
    LossChecks,
    check_grad_shapes,
    on_step_of,
    optimizer_lr,
    tokens_of,
)
from gradlog.recording.lifecycle import StepLifecycle
from gradlog.recording.optimizer import OptimizerCapture
from gradlog.recording.probes import ProbeRecorder
from gradlog.recording.selfcheck import SelfCheck
from gradlog.recording.state import PendingStep
from gradlog.sparse import active_settings, check_settings
from gradlog.store.writer import StoreWriter

__all__ = ["Compute", "StepPipeline", "make_backend"]

log = logging.getLogger("gradlog")

Compute = Callable[[], tuple[torch.Tensor, PerDatumGrads]]
"""Runs a batch's backward: its per-datum losses ``(B,)`` and per-datum gradients."""


def make_backend(
    model: nn.Module, params: Mapping[str, nn.Parameter], config: RecorderConfig,
    watch_ops: str = "auto",
) -> Backend:
    """The configured backend, attached to the model; which parameters hand over their
    factors or sparse rows (``keep_material``) follows their forms."""
    check_backend(model, BACKENDS[config.backend].name)
    backend = BACKENDS[config.backend](
        model,
        params,
        batch_reduction=config.batch_reduction,
        randomness=config.vmap_randomness,
        **({"batch_grad": "sum"} if config.batch_grad == "sum" else {}),
        **({"watch_ops": watch_ops} if BACKENDS[config.backend].name == "hooks" else {}),
    )
    backend.keep_material = planning.keeps_material(config, list(params))
    backend.defer_checks = True  # settled in StepPipeline.record, once the step is encoded
    backend.attach()
    if config.batch_grad == "sum":
        # Fused calls form their per-datum gradients in the backward anyway (their sum is
        # the weight gradient): forms that encode dense gradients take them as they are,
        # rather than factors they would form again for the exact norms.
        backend.dense_when_fused = planning.dense_when_fused(config, backend.fused_params)
    return backend


@dataclass(eq=False)
class StepPipeline:
    """A started recording: the backend, the writer and the stages between them.

    Attributes:
        backend: The attached backend.
        writer: The store writer.
        dist: This process's place in a torch.distributed run, or None.
        encoder: The forms, planned at the first recorded batch.
        lifecycle: Step numbering and the step in progress.
    """

    model: nn.Module
    params: Mapping[str, nn.Parameter]
    config: RecorderConfig
    options: RecordingOptions
    backend: Backend
    writer: StoreWriter
    dist: Distributed | None
    encoder: FormEncoder
    sparse: list[dict[str, Any]]  # how the backward is sparsified (gradlog.sparse), as opened

    def __post_init__(self) -> None:
        config, options = self.config, self.options
        self.lifecycle = StepLifecycle(
            config.every, self._commit, self._committed, distributed=self.dist is not None
        )
        self.check_losses = LossChecks(self.model)
        self.self_check = SelfCheck(self.params, config.check_every, config.check_rtol)
        self.probes = None if options.probes is None else ProbeRecorder(
            options.probes, options.probe_ids, self.model, self.params,
            token_reduction=config.token_reduction, dtype=config.dtype, durable=options.durable,
            compression=config.compression,
        )
        self._optimizer_hook = on_step_of(options.optimizer, self.lifecycle.on_optimizer_step)
        # the optimizer's state at recorded steps, for kind="optimizer" influence (rank 0)
        self.optimizer_state = OptimizerCapture.start(
            options.optimizer, self.params, self.writer.path,
            lambda: None if self.lifecycle.pending is None else self.lifecycle.pending.step,
            dtype=options.optimizer_state, durable=options.durable,
            forms=lambda: None if self.encoder.forms is None
            else {n: f.name for n, f in self.encoder.forms.items()},
        ) if self.dist is None or self.dist.rank == 0 else None
        if options.resume and self.writer.last_step is not None:
            self.lifecycle.resume(self.writer.last_step, self.writer.next_datum_id)
            if config.every > 1:
                warnings.warn(
                    f"resumed with every={config.every}: steps trained but not recorded after "
                    f"the last committed step ({self.writer.last_step}) are not in the store, "
                    "so the default step counter continues right after it and the default "
                    "datum ids with it. Pass step= (the optimizer step) and datum_ids= to "
                    "rec.backward to keep them right.",
                    UserWarning,
                    stacklevel=4,
                )
        if self.writer.planned_specs is not None:  # resumed: the stored forms hold
            self.encoder.resume(self.writer.planned_specs)

    @classmethod
    def open(
        cls,
        model: nn.Module,
        params: Mapping[str, nn.Parameter],
        config: RecorderConfig,
        options: RecordingOptions,
        path: str | os.PathLike[str],
        encoder: FormEncoder,
    ) -> StepPipeline:
        """Attach the backend and create (or resume) the store.

        Raises:
            InputError: probes under torch.distributed.
            StoreExistsError, StoreResumeError: from the writer.
        """
        specs = handoff.param_specs(params, config.dtype)
        backend = make_backend(model, params, config, options.watch_ops)
        attrs = handoff.root_attrs(model, config)
        attrs["backend"] = backend.describe()
        # Kept in the backend description: no format change; steps recorded under other
        # settings are refused (check_settings in record()).
        sparse: list[dict[str, Any]] = active_settings(model)
        if sparse:
            attrs["backend"]["sparse_backprop"] = sparse
        try:
            dist = detect(model, options.distributed)
            if dist is not None:
                attrs["backend"]["distributed"] = dist.describe()
                _refuse_under_distributed(config, options, list(params))
            writer = handoff.open_writer(path, attrs, specs, config, options, dist)
        except BaseException:
            backend.detach()
            raise
        return cls(model, params, config, options, backend, writer, dist, encoder, sparse)

    # -- one backward call ------------------------------------------------------------------
    def record(
        self,
        compute: Compute,
        step: int,
        datum_ids: Any,
        lr: float | None,
        mask: torch.Tensor | None,
        tokens_per_datum: int | Callable[[], int],
        weight_scale: float,
        seed_scale: float = 1.0,
    ) -> torch.Tensor:
        """Run a recorded batch through every stage; its per-datum losses, detached.

        Args:
            compute: The batch's backward.
            step: The resolved step.
            datum_ids: The caller's ids, or None (a counter).
            lr: The checked ``lr=``, or None (then the optimizer's, if any).
            mask: The token mask of ``(B, T)`` losses.
            tokens_per_datum: Tokens per datum (or a function giving them after compute).
            weight_scale: A trainer's scaling of this micro-batch's loss (gradient
                accumulation's ``1/k``): part of each stored weight.
            seed_scale: The factor the batch loss carried into the backward (``1/k`` times
                an AMP loss scale): ``p.grad`` holds it, the per-datum gradients do not.
        """
        with _collection_paused():
            return self._record(compute, step, datum_ids, lr, mask, tokens_per_datum,
                                weight_scale, seed_scale)

    def _record(self, compute: Compute, step: int, datum_ids: Any, lr: float | None,
                mask: torch.Tensor | None, tokens_per_datum: int | Callable[[], int],
                weight_scale: float, seed_scale: float) -> torch.Tensor:
        check_settings(self.model, self.sparse)
        if lr is None and self.options.optimizer is not None:  # checked before the backward
            lr = optimizer_lr(self.options.optimizer, self.params.values())
        lifecycle = self.lifecycle
        check = self.self_check.due(lifecycle.steps_recorded, lifecycle.first_micro())
        before = self.self_check.snapshot() if check else {}
        self.backend.datum_check_due = check

        t0 = time.perf_counter()
        try:
            losses, grads = compute()
            batch = losses.shape[0]
            check_grad_shapes(grads, batch, self.params, self.config.backend)
            weight = 1.0 / batch if self.config.batch_reduction == "mean" else 1.0
            sizes, offset, rank, world = [batch], 0, 0, 1  # every rank's batch (in rank order)
            if self.dist is not None:
                sizes = self.dist.batch_sizes(batch)
                rank, world = self.dist.rank, self.dist.world_size
                offset = sum(sizes[:rank])  # counter-numbered datum ids of the ranks before
                weight /= world  # DDP and FSDP2 average p.grad over ranks
            if self.encoder.forms is None:
                self.backend.settle_late_loss_checks()  # (a refused batch plans nothing)
                if self.dist is None:
                    self.encoder.plan_forms(grads, self.writer.set_forms)
                else:  # one plan for every rank, for the step's records of all ranks
                    share_plan(self.dist, self.encoder, grads, sum(sizes), self.writer.set_forms)
                if self.optimizer_state is not None and self.encoder.plan is not None:
                    line = self.optimizer_state.plan_line()
                    self.encoder.plan += "\n" + line
                    log.info("gradlog: %s", line)
            if check:
                self.self_check.verify(before, grads, weight * seed_scale, self.dist,
                                       self.backend.low_precision)
            if self.probes is not None and lifecycle.pending is None:  # once per step, at micro 0
                self.backend.settle()  # (no probes of a step whose records fail their checks)
                self.probes.record(step, self.writer.path)
            t1 = time.perf_counter()

            staged, norms = self.encoder.encode(grads)
            # The backward's checks are read only now: their wait for the device then also covers
            # the encoding's device work, and no host work sits between two waits (on an H200,
            # ~40 ms of GPT-2 small's step were host work done after the backward's wait).
            self.backend.settle()
        except BaseException as failed:  # this step fails: its checks are read, and dropped,
            # here, not left to the next backward, which would raise them as its own
            try:
                with contextlib.suppress(BackendError):
                    self.backend.settle()
            except Exception:  # the losses' checks read late: the batch's own fault, which
                if isinstance(failed, Exception):  # an error of its backward follows from;
                    raise
                raise failed from None  # but never in place of an interrupt
            raise
        loss_np = losses.detach().double().cpu().numpy()
        ids = lifecycle.datum_ids(datum_ids, batch, sizes, offset)
        rows = self.writer.append(
            step=step,
            micro=lifecycle.micro_index(rank, world),
            datum_ids=ids,
            losses=loss_np,
            weights=np.full(batch, weight * weight_scale),
            lr=lr,
            grads=staged.arrays,
            norms=norms,
            plan=sizes if self.dist is not None else None,
            ready=staged.ready,  # the writer thread waits for the device copies
        )
        t2 = time.perf_counter()

        per_datum = tokens_per_datum() if callable(tokens_per_datum) else tokens_per_datum
        lifecycle.add(
            step, rows, lr, tokens=tokens_of(mask, batch, per_datum),
            loss_sum=float(loss_np.sum()), compute_s=t1 - t0, write_s=t2 - t1,
        )
        return losses.detach()

    def _commit(self, pending: PendingStep) -> None:
        if self.optimizer_state is not None:  # its state file before its commit marker
            self.optimizer_state.flush()
        self.writer.commit(pending.row())

    def _committed(self, pending: PendingStep) -> None:
        self.encoder.committed(pending, distributed=self.dist is not None)

    # -- end --------------------------------------------------------------------------------
    def close(self, *, failed: bool) -> None:
        """Commit the step in progress (unless ``failed`` and not known complete), detach the
        backend and finish the store."""
        if failed and not self.lifecycle.complete():
            self.lifecycle.abandon()
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        try:
            self.lifecycle.commit()
        finally:
            self.backend.detach()
            if self.optimizer_state is not None:
                self.optimizer_state.close()
            if self.probes is not None:
                self.probes.close()
            self.writer.close()


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a step is recorded (restored after,
    if it was on). The hooks, rules and graph walk make thousands of short-lived objects a
    step, most alive until the step ends; left on, the collector ran ~7 young collections
    a step over them and promoted what was alive to the oldest generation, whose full
    collections (every ~30 steps of a 16-layer Llama, ~170 ms each in a process of 300k
    objects) a plain training step never triggers (``bench_host.py``'s GC columns). Garbage
    in cycles made meanwhile is collected after, as usual."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _refuse_under_distributed(
    config: RecorderConfig, options: RecordingOptions, names: list[str]
) -> None:
    """What torch.distributed recording does not support yet.

    Raises:
        InputError: probes.
    """
    if options.probes is not None:
        raise InputError(
            "probes are not supported under torch.distributed yet: record them "
            "in a separate single-process run, or pass distributed=False."
        )
