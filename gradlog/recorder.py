"""``GradRecorder``: the facade that wraps the user's training loop.

It validates inputs, reduces losses to one per datum, asks the backend for per-datum
gradients, self-checks them against ``p.grad``, and hands them to the store writer.
"""

from __future__ import annotations

import datetime
import logging
import numbers
import os
import time
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn

from gradlog import planning
from gradlog._version import __version__
from gradlog.backends import BACKENDS, Backend, LossFn, PerDatumGrads
from gradlog.backends.base import LOW_PRECISION_RTOL
from gradlog.config import RecorderConfig
from gradlog.distributed import Distributed, detect
from gradlog.errors import (
    GradientCheckError,
    GradlogError,
    InputError,
    NonFiniteLossError,
    UnsupportedLayerError,
)
from gradlog.forms import Form, FullForm
from gradlog.grads import (
    Factors,
    Material,
    batch_size,
    batch_sum,
    float64_sqnorms,
    material_shape,
    norm_scratch,
)
from gradlog.losses import per_datum_losses
from gradlog.params import check_differentiable, select_params
from gradlog.sparse import active_settings, check_settings
from gradlog.store import format as fmt
from gradlog.store.dtypes import storage_dtype, to_storage_torch
from gradlog.store.writer import DEFAULT_QUEUE_BYTES, ParamSpec, StoreWriter

__all__ = ["GradRecorder"]

log = logging.getLogger("gradlog")

_COUPLING_LAYERS = (nn.modules.batchnorm._BatchNorm,)


def _ids_to_numpy(datum_ids: Any, batch: int) -> np.ndarray:
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
    if len(ids) != batch:
        raise InputError(
            f"datum_ids has {len(ids)} entries but losses hold {batch} datums; pass one id per "
            "datum, in the order of the batch."
        )
    return ids.astype(np.int64)


def _lr_value(lr: Any, what: str) -> float:
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


def _on_step_of(optimizer: Any, hook: Callable[..., None]) -> Any:
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


class GradRecorder:
    """Records the per-datum gradient of every selected parameter at every step.

    Use it as a context manager around the training loop and call :meth:`backward` (or
    :meth:`step`) where the loop called ``loss.backward()``::

        with gradlog.GradRecorder(model, "runs/demo.gradlog") as rec:
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
        params: Glob pattern(s) over parameter names; only ``requires_grad`` ones are recorded.
        backend: A key of ``gradlog.backends.BACKENDS``: ``"auto"`` (default: the hooks
            backend), ``"hooks"`` (per-datum gradients from the one ordinary backward),
            ``"loop"`` (one backward per datum, the reference) or ``"vmap"`` (``torch.func``;
            needs :meth:`step`).
        batch_reduction: ``"mean"`` or ``"sum"``: what ``p.grad`` is the gradient of.
        token_reduction: For ``(B, T)`` losses: ``"mean"`` over a datum's unmasked tokens,
            or ``"sum"``.
        dtype: Storage dtype of the gradients: ``"float32"`` (lossless, default),
            ``"float64"``, or lossy ``"bfloat16"``, ``"float16"`` (underflows for small
            gradients: not advised) and ``"bitroundN"`` (float32 rounded to N mantissa bits,
            e.g. ``"bitround9"``); schemas/FORMAT.md section 4.2 gives each one's error.
            Reads return float32.
        compression: ``"none"``, ``"lz4"`` or ``"zstd"`` (blosc with bitshuffle); ``"auto"``
            picks ``lz4`` for ``bitroundN`` and ``none`` otherwise (measured: lossless
            compression gains 1.17x on float32 gradients, not worth a core).
        every: Record every N-th step only (``step % every == 0``).
        check_every: Self-check ``sum_b w_b g_b == p.grad`` on the first recorded step and
            every N-th after it (0: never).
        check_rtol: Relative tolerance of the self-check.
        optimizer: If given, each step's learning rate is read from its first param group
            when ``lr`` is not passed.
        overwrite: Replace an existing gradlog store at ``path``.
        metadata: JSON-serialisable user metadata stored with the run.
        vmap_randomness: ``torch.func.vmap`` randomness for the vmap backend.
        batch_grad: ``"autograd"`` (default) keeps ``p.grad`` bitwise what it is without
            gradlog. ``"sum"`` (hooks backend) sets the weight gradient of recorded
            ``nn.Linear``/``Conv1D`` layers to ``sum_b w_b g_b`` of their per-datum gradients
            instead of running autograd's own weight-gradient matmul: one matmul less per
            layer (a recorded step ~10-25% cheaper), ``p.grad`` equal to float rounding.
        probes: ``(loss_fn, batch)`` of held-out examples whose per-datum gradients are
            recorded at every recorded step (same parameters, same storage), for influence
            exact in time (``run.influence``). ``loss_fn(model, batch)`` returns ``(P,)``
            per-probe or ``(P, T)`` per-token losses (reduced like the training losses). The
            probe gradients are taken by ``torch.autograd.grad`` on a separate forward, once
            per recorded step at its first backward call, after the training backward and at
            the same parameter values; ``p.grad``, the optimizer and the RNG stream that
            training sees are untouched (the forward runs under a forked RNG, in the model's
            current train/eval mode). Costs one forward and one backward batched over the
            probes per recorded step (``P`` backwards where vmap cannot batch an operation).
        probe_ids: One distinct int >= 0 per probe (default ``0 .. P-1``).
        resume: Continue the store at ``path`` after its last committed step (e.g. after a
            crash): its configuration must match this one; records of uncommitted steps are
            discarded; steps continue after the last committed one. Without a store at
            ``path``, recording starts a new one.
        queue_bytes: Capacity, in bytes, of the queue feeding the background writer. When
            the disk is slower than training, ``backward`` blocks until there is room
            (nothing is dropped). A batch larger than the capacity waits for an empty queue.
            Default: one batch's gradients, so one batch is written while the next is
            computed (about two batches of gradients in memory at most).
        durable: ``fsync`` each step's data before committing it, so committed steps survive
            power loss, not only a crash of the process.
        distributed: Record every rank of a torch.distributed run into the one store at
            ``path`` (:mod:`gradlog.distributed`). ``None`` (default): when the model is a
            ``DistributedDataParallel`` and the process group has several ranks. Every rank
            opens the recorder with the same arguments; ``datum_ids`` are global (e.g. from
            ``DistributedSampler``); weights are such that ``sum_b w_b g_b`` over all ranks'
            records equals the all-reduced ``p.grad``. ``False``: this process alone.
        form: How each parameter's per-datum gradients are kept (``gradlog.forms``): a form
            for all (``"full"``, the default; ``"factors"``, ``"projection"``, ``"topk"``,
            ``"norm"``, ``"auto"``, or ``{"form": "projection", "dim": 4096}``), or a dict
            ``{glob: form}`` where the first matching glob wins (unmatched: ``full``).
            Planned at the first recorded backward, when token counts are known; the plan
            (bytes per step per parameter) is logged and kept in :attr:`plan`.
        form_budget: Bytes per step shared by the ``auto`` parameters (the most faithful
            forms that fit); None: ``auto`` is the smallest exact form.
        projection_seed: Base seed of the random projections (stored in each parameter's
            spec, so any gradient can be projected alike later: ``run.project``).
        tokens: Rows per datum to provision for ``factors``/``rows`` forms (default: the
            first recorded batch's); a later batch with more tokens per datum is refused.
        planned_steps: Steps the run will record, for the projected store size printed at
            the start (a warning when it exceeds the free disk space).
        records_per_step: Records one step holds (all its micro-batches), over which
            ``form_budget`` is split and for which the plan counts bytes per step. Default:
            the first recorded batch's size, which undercounts under gradient accumulation
            (several ``backward`` calls per step): the forms are planned at the first
            backward, before the step's other micro-batches. If the first recorded step then
            holds more records, :attr:`plan` and the projected size are corrected when it
            commits, with a ``UserWarning`` when that exceeds ``form_budget``.
    """

    def __init__(
        self,
        model: nn.Module,
        path: str | os.PathLike[str],
        *,
        params: str | Sequence[str] = "*",
        backend: str = "auto",
        batch_reduction: str = "mean",
        token_reduction: str = "mean",
        dtype: str = "float32",
        every: int = 1,
        check_every: int = 100,
        check_rtol: float = 1e-4,
        optimizer: torch.optim.Optimizer | None = None,
        overwrite: bool = False,
        metadata: dict[str, Any] | None = None,
        vmap_randomness: str = "different",
        probes: tuple[Callable[[nn.Module, Any], torch.Tensor], Any] | None = None,
        probe_ids: Any = None,
        compression: str = "auto",
        resume: bool = False,
        queue_bytes: int | None = DEFAULT_QUEUE_BYTES,
        durable: bool = True,
        batch_grad: str = "autograd",
        distributed: bool | None = None,
        form: Any = "full",
        form_budget: int | None = None,
        projection_seed: int = 0,
        tokens: int | None = None,
        planned_steps: int | None = None,
        records_per_step: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        self.config = RecorderConfig(
            params=(params,) if isinstance(params, str) else tuple(params),
            backend=backend,
            batch_reduction=batch_reduction,
            token_reduction=token_reduction,
            dtype=dtype,
            every=every,
            check_every=check_every,
            check_rtol=check_rtol,
            vmap_randomness=vmap_randomness,
            metadata=dict(metadata or {}),
            compression=compression,
            batch_grad=batch_grad,
            form=form,
            form_budget=form_budget,
            projection_seed=projection_seed,
        )
        for name, value in (("tokens", tokens), ("planned_steps", planned_steps),
                            ("records_per_step", records_per_step)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InputError(f"{name}={value!r} must be a positive int or None.")
        self.tokens = tokens
        self.planned_steps = planned_steps
        self.records_per_step = records_per_step
        self._planned_records: int | None = None  # records per step of the plan, until checked
        self.forms: dict[str, Form] | None = None  # planned at the first recorded backward
        self.plan: str | None = None  # the plan's bytes table, as logged
        self.model = model
        self.path = path
        self.optimizer = optimizer
        self.overwrite = overwrite
        self.resume = resume
        self.queue_bytes = queue_bytes
        self.durable = durable
        self._distributed = distributed
        self._dist: Distributed | None = None  # set by open()
        self._committed_through: int | None = None  # last step already in a resumed store
        self.params = select_params(model, self.config.params)
        planning.check_requests(self.config, self.params)
        self._backend: Backend | None = None
        self._writer: StoreWriter | None = None
        self._coupling = [
            (n, m) for n, m in model.named_modules() if isinstance(m, _COUPLING_LAYERS)
        ]
        self._last_step: int | None = None
        self._pending: dict[str, Any] | None = None  # the step being recorded, until committed
        # What says the pending step is complete when an exception leaves the block (see
        # _pending_complete): the step the last backward/step call was for, and whether the
        # optimizer stepped after the pending step's last micro-batch.
        self._attempted: int | None = None
        self._optimizer_stepped = False
        self._optimizer_hook: Any = None
        # The factor a trainer scaled this micro-batch's loss by for gradient accumulation
        # (1/k), set by gradlog.integrations around their backward: part of each stored
        # weight, so that sum_b w_b g_b is the gradient the optimizer steps with.
        self._weight_scale = 1.0
        self._next_datum = 0
        self._n_checked = 0
        if probes is not None and not (
            isinstance(probes, tuple) and len(probes) == 2 and callable(probes[0])
        ):
            raise InputError(
                f"probes must be a pair (loss_fn, batch) with loss_fn(model, batch) returning "
                f"per-probe losses, got {type(probes).__name__}."
            )
        self._probes = probes
        self._probe_ids = probe_ids
        self._probe_writer: Any = None  # gradlog.store.probes.ProbeWriter, at the first probe
        self.steps_recorded = 0
        self.records_written = 0

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

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_stepped = True

    def _pending_complete(self) -> bool:
        """Whether the step in progress is known to have all its micro-batches: a later step
        was begun (its backward failed, e.g. a NaN loss), or the optimizer stepped after the
        step's last micro-batch. Under DDP never (other ranks may not have finished it)."""
        p = self._pending
        if p is None:
            return True
        if self._dist is not None:
            return False
        return (self._attempted is not None and self._attempted != p["step"]) or (
            self._optimizer_stepped)

    def open(self) -> None:
        """Create the store and start recording (``with`` does this)."""
        if self._writer is not None:
            raise GradlogError("this GradRecorder is already recording; use one per run.")
        specs = {
            name: ParamSpec(
                name=name,
                shape=tuple(p.shape),
                dtype=self.config.dtype,
                param_dtype=str(p.dtype).removeprefix("torch."),
            )
            for name, p in self.params.items()
        }
        self._backend = BACKENDS[self.config.backend](
            self.model,
            self.params,
            batch_reduction=self.config.batch_reduction,
            randomness=self.config.vmap_randomness,
            **({"batch_grad": "sum"} if self.config.batch_grad == "sum" else {}),
        )
        self._backend.keep_material = planning.keeps_material(self.config, list(self.params))
        self._backend.attach()
        self._optimizer_hook = _on_step_of(self.optimizer, self._on_optimizer_step)
        if self.config.batch_grad == "sum":
            # Fused layers form their per-datum gradients in the backward anyway (their sum
            # is the weight gradient): forms that encode dense gradients take them as they
            # are, rather than factors they would form again for the exact norms.
            self._backend.keep_material = planning.dense_for_fused(
                self.config, self._backend.keep_material, self._backend.fused_params
            )
        attrs = self._root_attrs()
        attrs["backend"] = self._backend.describe()
        # How the backward is sparsified (gradlog.sparse), kept in the backend object: no format
        # change; steps recorded under other settings are refused (check_settings in _record).
        self._sparse: list[dict[str, Any]] = active_settings(self.model)
        if self._sparse:
            attrs["backend"]["sparse_backprop"] = self._sparse
        try:
            self._dist = detect(self.model, self._distributed)
            if self._dist is not None:
                attrs["backend"]["distributed"] = self._dist.describe()
                if self._probes is not None:
                    raise InputError(
                        "probes are not supported under torch.distributed yet: record them "
                        "in a separate single-process run, or pass distributed=False."
                    )
                if planning.keeps_material(self.config, list(self.params)):
                    # Forms are planned from the first batch's token counts, which differ
                    # between ranks; one plan shared by every rank is not built yet.
                    raise InputError(
                        f"form={self.config.form!r} is not supported under torch.distributed "
                        "yet: record distributed runs with form='full' (the default), or "
                        "record compact forms in a single process (distributed=False)."
                    )
            self._writer = self._open_writer(attrs, specs)
        except BaseException:
            self._backend.detach()
            self._backend = None
            raise
        if self.resume and self._writer.last_step is not None:
            self._last_step = self._committed_through = self._writer.last_step
            self._next_datum = self._writer.next_datum_id
        if self._writer.planned_specs is not None:  # resumed: the stored forms hold
            self.forms = planning.forms_from_specs(self._writer.planned_specs)
        log.info(
            "gradlog: recording %d parameters (%s per datum per step) into %s",
            len(self.params),
            _fmt_bytes(self.bytes_per_record),
            self.path,
        )

    def _open_writer(self, attrs: dict[str, Any], specs: dict[str, ParamSpec]) -> StoreWriter:
        """The store writer; under torch.distributed rank 0 creates (or resumes) the store
        before the other ranks join it."""
        dist = self._dist

        def make() -> StoreWriter:
            return StoreWriter(
                self.path,
                attrs=attrs,
                specs=specs,
                overwrite=self.overwrite,
                resume=self.resume,
                queue_bytes=self.queue_bytes,
                durable=self.durable,
                compression=self.config.compression,
                rank=0 if dist is None else dist.rank,
                world_size=1 if dist is None else dist.world_size,
            )

        if dist is None:
            return make()
        writer = None
        if dist.rank == 0:
            try:
                writer = make()
            except BaseException as e:
                dist.agree(e)
                raise
        dist.agree(None)
        try:
            if dist.rank > 0:
                writer = make()
        except BaseException as e:
            dist.all_ok(e)
            raise
        try:  # every rank joined before any writes (rank 0 cleaned a resumed store)
            dist.all_ok(None)
        except GradlogError:
            if writer is not None:
                writer.close()
            raise
        assert writer is not None
        return writer

    def close(self, *, failed: bool = False) -> None:
        """Commit the last step, remove hooks and finish the store (``with`` does this).

        Args:
            failed: True when training failed (``with`` passes it when an exception leaves
                the block): the step in progress is then committed only if it is known to be
                complete (a later step was begun, or the optimizer stepped after its last
                micro-batch), else left uncommitted as after a crash; ``resume=True``
                records it again.
        """
        if failed and not self._pending_complete():
            self._pending = None
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        try:
            if self._pending is not None and self._writer is not None:
                self._commit()
        finally:
            if self._backend is not None:
                self._backend.detach()
                self._backend = None
            if self._probe_writer is not None:
                self._probe_writer.close()
                self._probe_writer = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def _root_attrs(self) -> dict[str, Any]:
        n_params = sum(p.numel() for p in self.model.parameters())
        return {
            "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION,
            "gradlog_version": __version__,
            "torch_version": torch.__version__.split("+")[0],
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": {"class": type(self.model).__name__, "n_parameters": n_params},
            "config": self.config.to_json(),
            "config_hash": self.config.hash(),
        }

    @property
    def bytes_per_record(self) -> int:
        """Stored bytes of one datum's gradients (all recorded parameters; by their forms once
        planned, else as ``full``)."""
        itemsize = storage_dtype(self.config.dtype).itemsize
        if self.forms is not None:
            return sum(f.nbytes_per_record(itemsize) for f in self.forms.values())
        return sum(p.numel() for p in self.params.values()) * itemsize

    # -- recording --------------------------------------------------------------------------
    def backward(
        self,
        losses: torch.Tensor,
        *,
        datum_ids: Any = None,
        step: int | None = None,
        lr: float | None = None,
        mask: torch.Tensor | None = None,
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

        Returns:
            The per-datum losses ``(B,)``, detached.
        """
        self._require_open()
        assert self._backend is not None  # for mypy: _require_open checked it
        self._note_attempt(step)
        reduced = per_datum_losses(losses, mask, self.config.token_reduction)
        self._check_losses(reduced, datum_ids)
        check_differentiable(self.params, reduced)  # frozen parameters, losses without grad
        lr = None if lr is None else _lr_value(lr, "lr")
        step = self._resolve_step(step)
        if not self._records(step):
            self._backend.reduce_batch(reduced).backward()
            self._skip_data(step, reduced, datum_ids)
            return reduced.detach()

        def compute() -> tuple[torch.Tensor, PerDatumGrads]:
            assert self._backend is not None
            return reduced, self._backend.backward(reduced, self._backend.reduce_batch(reduced))

        tokens_per_datum = losses.shape[1] if losses.dim() == 2 else 1
        return self._record(compute, step, datum_ids, lr, mask, tokens_per_datum)

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
        self._require_open()
        assert self._backend is not None
        self._note_attempt(step)
        lr = None if lr is None else _lr_value(lr, "lr")
        step = self._resolve_step(step)
        seen_tokens: list[int] = []

        def reduce(raw: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            seen_tokens.append(raw.shape[1] if raw.dim() == 2 else 1)  # tokens per datum
            return self._reduce(raw, mask)

        if not self._records(step):
            reduced = reduce(loss_fn(self.model, batch), mask)
            self._check_losses(reduced, datum_ids)
            check_differentiable(self.params, reduced)
            self._backend.reduce_batch(reduced).backward()
            self._skip_data(step, reduced, datum_ids)
            return reduced.detach()

        def compute() -> tuple[torch.Tensor, PerDatumGrads]:
            assert self._backend is not None
            return self._backend.step(
                loss_fn, batch, reduce, mask, lambda r: self._check_losses(r, datum_ids)
            )

        return self._record(compute, step, datum_ids, lr, mask, lambda: seen_tokens[-1])

    # -- internals --------------------------------------------------------------------------
    def _reduce(self, raw: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return per_datum_losses(raw, mask, self.config.token_reduction)

    def _require_open(self) -> None:
        if self._writer is None or self._backend is None:
            raise GradlogError(
                "GradRecorder is not recording: use it as `with GradRecorder(...) as rec:` "
                "(or call rec.open() first), and call rec.backward() inside the block."
            )

    def _check_losses(self, reduced: torch.Tensor, datum_ids: Any) -> None:
        batch = reduced.shape[0]
        if batch == 0:
            raise InputError("losses hold no datum (batch size 0); skip empty batches.")
        if datum_ids is not None:
            _ids_to_numpy(datum_ids, batch)
        finite = torch.isfinite(reduced.detach())
        if not bool(finite.all()):
            bad = torch.nonzero(~finite).flatten().tolist()[:10]
            ids = _ids_to_numpy(datum_ids, batch)[bad].tolist() if datum_ids is not None else bad
            raise NonFiniteLossError(
                f"the loss of datum(s) {ids} (batch positions {bad}) is NaN or infinite, so "
                "their gradients are meaningless. The step was refused before any backward: "
                "p.grad is unchanged and earlier steps are committed. Skip this batch or fix the "
                "loss (e.g. clamp log arguments, check for empty masks)."
            )
        for name, module in self._coupling:
            if module.training:
                raise UnsupportedLayerError(
                    f"{type(module).__name__} {name!r} is in training mode: it normalises "
                    "with statistics of the whole batch, so a datum's gradient depends on the "
                    "other datums and per-datum gradients are not defined. Fixes: put it in "
                    "eval mode (module.eval()), replace it with GroupNorm or LayerNorm, or use "
                    "a batch of one. This can never be supported for training-mode BatchNorm."
                )

    def _skip_data(self, step: int, losses: torch.Tensor, datum_ids: Any) -> None:
        """A step not recorded (``every``): the default datum counter still counts its data,
        so that a datum's default id does not depend on ``every`` (one process; under DDP
        the ranks' counts are exchanged only on recorded steps)."""
        self._last_step = step
        if datum_ids is None and self._dist is None:
            self._next_datum += int(losses.shape[0])

    def _note_attempt(self, step: Any) -> None:
        """The step a backward/step call is for, noted before anything can refuse it."""
        if step is None:
            self._attempted = 0 if self._last_step is None else self._last_step + 1
        elif isinstance(step, (int, np.integer)) and not isinstance(step, bool):
            self._attempted = int(step)

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = 0 if self._last_step is None else self._last_step + 1
        elif isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise InputError(f"step must be an int, got {type(step).__name__}.")
        step = int(step)
        if step < 0:
            raise InputError(f"step must be >= 0, got {step}.")
        if self._committed_through is not None and step <= self._committed_through:
            raise InputError(
                f"step {step} is already committed in the resumed store (its last committed "
                f"step is {self._committed_through}); continue with step "
                f"{self._committed_through + 1} or later."
            )
        if self._last_step is not None and step < self._last_step:
            raise InputError(
                f"step {step} comes after step {self._last_step}; steps must not decrease. "
                "Repeat the same step to accumulate micro-batches into it."
            )
        if self._pending is not None and self._pending["step"] != step:
            self._commit()  # a new step began: the previous one is complete
        return step

    def _records(self, step: int) -> bool:
        return step % self.config.every == 0

    def _record(
        self,
        compute: Callable[[], tuple[torch.Tensor, PerDatumGrads]],
        step: int,
        datum_ids: Any,
        lr: float | None,
        mask: torch.Tensor | None,
        tokens_per_datum: int | Callable[[], int],
    ) -> torch.Tensor:
        assert self._writer is not None
        check_settings(self.model, self._sparse)
        if lr is None and self.optimizer is not None:  # checked before the backward, as lr=
            lr = _lr_value(
                self.optimizer.param_groups[0]["lr"],
                "the optimizer's learning rate (param_groups[0]['lr'])",
            )
        check = self._due_for_check()
        before = self._snapshot_grads() if check else {}

        t0 = time.perf_counter()
        losses, grads = compute()
        batch = losses.shape[0]
        for name, g in grads.items():
            got = (batch_size(g), *material_shape(g))
            if got != (batch, *self.params[name].shape):
                raise GradlogError(
                    f"backend {self.config.backend!r} returned per-datum gradients of shape "
                    f"{got} for {name!r}; expected {(batch, *self.params[name].shape)}"
                    ". A broadcast batch dimension (e.g. position ids of shape [1, T]) was "
                    "taken for a datum; please report this with the model."
                )
        if self.forms is None:
            self._plan_forms(grads)
        weight = 1.0 / batch if self.config.batch_reduction == "mean" else 1.0
        sizes = [batch]  # every rank's batch (in rank order)
        offset = 0  # counter-numbered datum ids of the ranks before this one
        if self._dist is not None:
            sizes = self._dist.batch_sizes(batch)
            offset = sum(sizes[: self._dist.rank])
            weight /= self._dist.world_size  # DDP averages p.grad over ranks
        if check:
            self._self_check(before, grads, weight)
        if self._probes is not None and self._pending is None:  # once per step, at micro 0
            self._record_probes(step)
        t1 = time.perf_counter()

        ids = (
            _ids_to_numpy(datum_ids, batch)
            if datum_ids is not None
            else np.arange(self._next_datum + offset, self._next_datum + offset + batch,
                           dtype=np.int64)
        )
        counted = self._next_datum + (sum(sizes) if datum_ids is None else 0)  # every rank's
        self._next_datum = max(counted, int(ids.max()) + 1)
        host, norms = self._encode(grads, batch)
        loss_np = losses.detach().double().cpu().numpy()
        micro = 0 if self._pending is None else self._pending["n_micro"]
        if self._dist is not None:  # rank r's m-th call: micro-batch m * world_size + r
            micro = micro * self._dist.world_size + self._dist.rank
        start, stop = self._writer.append(
            step=step,
            micro=micro,
            datum_ids=ids,
            losses=loss_np,
            weights=np.full(batch, weight * self._weight_scale),
            lr=None if lr is None else float(lr),
            grads=host,
            norms=norms,
            plan=sizes if self._dist is not None else None,
        )
        t2 = time.perf_counter()

        if mask is not None:
            tokens = int((mask != 0).sum())
        else:
            per_datum = tokens_per_datum() if callable(tokens_per_datum) else tokens_per_datum
            tokens = batch * per_datum
        if self._pending is None:
            self._pending = {
                "step": step,
                "first_row": start,
                "n_records": 0,
                "n_micro": 0,
                "tokens": 0,
                "lr": None if lr is None else float(lr),
                "loss_sum": 0.0,
                "time_compute_s": 0.0,
                "time_write_s": 0.0,
            }
        p = self._pending
        p["n_records"] += stop - start
        p["n_micro"] += 1
        self._optimizer_stepped = False
        p["tokens"] += tokens
        p["loss_sum"] += float(loss_np.sum())
        p["time_compute_s"] += t1 - t0
        p["time_write_s"] += t2 - t1
        self._last_step = step
        self.records_written += batch
        return losses.detach()

    def flush(self) -> None:
        """Wait until everything recorded so far is written and every completed step is
        committed (the step in progress commits when the next one begins, or at close).

        Raises:
            StoreWriteError: the background writer failed.
        """
        self._require_open()
        assert self._writer is not None
        self._writer.flush()

    def _commit(self) -> None:
        assert self._writer is not None and self._pending is not None
        p = self._pending
        row = {k: v for k, v in p.items() if k != "loss_sum"}
        row["loss_mean"] = p["loss_sum"] / max(1, p["n_records"])
        self._writer.commit(row)
        self._pending = None
        self.steps_recorded += 1
        if self._planned_records is not None:
            planned, self._planned_records = self._planned_records, None
            if p["n_records"] > planned and self._dist is None:
                self._replan_records(p, planned)

    def _replan_records(self, p: dict[str, Any], planned: int) -> None:
        """The first recorded step held more records than the plan assumed (gradient
        accumulation): correct :attr:`plan` and the projected size, and warn when that
        exceeds ``form_budget``."""
        assert self.forms is not None
        n, itemsize = p["n_records"], storage_dtype(self.config.dtype).itemsize
        per_step = sum(f.nbytes_per_record(itemsize) for f in self.forms.values()) * n
        budget = self.config.form_budget
        if budget is not None and per_step > budget:
            why = (
                f"records_per_step={self.records_per_step}" if self.records_per_step
                else "the first micro-batch's"
            )
            records = f"{planned} record{'s' if planned > 1 else ''}"
            ratio = per_step / max(1, budget)
            warnings.warn(
                f"gradlog: step {p['step']} held {n} records in {p['n_micro']} micro-batches, "
                f"but form_budget={budget:,} (bytes per step) was split over {records} ({why}): "
                f"{ratio:.1f}x the budget per step ({per_step:,} bytes). The forms are fixed "
                "once planned; pass "
                f"GradRecorder(..., records_per_step={n}) (the most records a step holds) in "
                "the next run to split the budget over every record of a step.",
                UserWarning,
                stacklevel=5,  # the user's backward, step or with-block exit
            )
        self.plan = planning.plan_table(
            self.forms, batch=n, itemsize=itemsize, steps=self.planned_steps,
            records_from=f"step {p['step']} held them",
        )
        log.info("gradlog: forms and bytes per step of %s, corrected\n%s", self.path, self.plan)
        if self.planned_steps is not None:
            planning.check_free_space(self.path, per_step * self.planned_steps)

    def _plan_forms(self, grads: PerDatumGrads) -> None:
        """Concrete forms from the first batch's material; log their bytes table and warn
        when the planned steps would not fit on the disk."""
        assert self._writer is not None
        storage = storage_dtype(self.config.dtype)
        forms = planning.plan(self.config, grads, itemsize=storage.itemsize, tokens=self.tokens,
                              records_per_step=self.records_per_step)
        self._writer.set_forms(
            {n: (f.spec(), planning.array_specs(f)) for n, f in forms.items()}
        )
        self.forms = forms
        batch = batch_size(next(iter(grads.values()))) if grads else 0
        records = self.records_per_step or batch  # the step's other micro-batches come later
        self._planned_records = records  # checked when the step commits
        self.plan = planning.plan_table(
            forms, batch=records, itemsize=storage.itemsize, steps=self.planned_steps,
            records_from=(
                f"records_per_step={records}" if self.records_per_step
                else "the first batch's; with gradient accumulation pass records_per_step="
            ),
        )
        log.info("gradlog: forms and bytes per step of %s\n%s", self.path, self.plan)
        if self.planned_steps is not None:
            per_step = sum(f.nbytes_per_record(storage.itemsize) for f in forms.values()) * records
            planning.check_free_space(self.path, per_step * self.planned_steps)

    def _encode(
        self, grads: PerDatumGrads, batch: int
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What the writer takes: per parameter its gradients (``full``) or its form's
        arrays, and exact float64 norms."""
        assert self.forms is not None
        host: dict[str, Any] = {}
        norms: dict[str, np.ndarray] = {}
        coded = {}
        scratch = None  # float64_sqnorms' block buffer, shared by the parameters
        for n, g in grads.items():
            if isinstance(g, torch.Tensor) and isinstance(self.forms[n], FullForm):
                host[n] = g.detach()  # rounded and written by the writer
                if scratch is None or scratch.device != g.device:
                    scratch = norm_scratch(g.device)
                sq = float64_sqnorms(g.detach().reshape(batch, -1), scratch)  # (B,)
                norms[n] = sq.sqrt().cpu().numpy()
            else:
                coded[n] = g
        if coded:
            arrays, coded_norms = planning.encode(self.forms, coded)
            host.update(arrays)
            norms.update(coded_norms)
        return {n: host[n] for n in grads}, {n: norms[n] for n in grads}

    def _record_probes(self, step: int) -> None:
        """Per-probe gradients at the step's parameters, written before the step commits."""
        from gradlog.store.probes import ProbeWriter

        assert self._probes is not None and self._writer is not None
        loss_fn, batch = self._probes
        names = list(self.params)
        tensors = [self.params[n] for n in names]
        cuda = sorted({p.device.index or 0 for p in tensors if p.device.type == "cuda"})
        # A forked RNG: dropout in the probe forward must not shift training's random stream.
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            losses = per_datum_losses(loss_fn(self.model, batch), None, self.config.token_reduction)
            n = losses.shape[0] if losses.dim() == 1 else 0
            if n == 0 or not losses.requires_grad:
                raise InputError(
                    "the probe loss_fn must return per-probe losses (P,) or (P, T) with P >= 1 "
                    "that depend on the model's parameters (not under torch.no_grad(), not "
                    f"detached); got shape {tuple(losses.shape)}."
                )
            ids = self._probe_ids_array(n)
            finite = torch.isfinite(losses.detach())
            if not bool(finite.all()):
                bad = ids[torch.nonzero(~finite).flatten().cpu().numpy()[:10]].tolist()
                raise NonFiniteLossError(
                    f"the loss of probe(s) {bad} is NaN or infinite at step {step}; nothing of "
                    "this step was written. Check the probe batch and loss_fn."
                )
            out = _per_probe_grads(losses, names, tensors)
        if self._probe_writer is None:
            specs = {name: (tuple(p.shape), self.config.dtype) for name, p in self.params.items()}
            self._probe_writer = ProbeWriter(self._writer.path, specs, ids.tolist(),
                                             durable=self.durable)
        storage = storage_dtype(self.config.dtype)
        self._probe_writer.append(
            step=step,
            losses=losses.detach().double().cpu().numpy(),
            grads={k: to_storage_torch(g, storage).cpu().numpy() for k, g in out.items()},
            norms={
                k: torch.linalg.vector_norm(g.reshape(n, -1).double(), dim=1).cpu().numpy()
                for k, g in out.items()
            },
        )

    def _probe_ids_array(self, n: int) -> np.ndarray:
        if self._probe_ids is None:
            return np.arange(n, dtype=np.int64)
        raw = self._probe_ids
        ids = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        integral = ids.size == 0 or np.issubdtype(ids.dtype, np.integer)
        if ids.ndim != 1 or len(ids) != n or not integral:
            raise InputError(
                f"probe_ids must be {n} integers (one per probe returned by the probe loss_fn), "
                f"got {type(raw).__name__} of shape {ids.shape} and dtype {ids.dtype}."
            )
        if int(ids.min()) < 0 or len(np.unique(ids)) != n:
            raise InputError(f"probe_ids must be distinct integers >= 0, got {ids.tolist()}.")
        return ids.astype(np.int64)

    def _due_for_check(self) -> bool:
        every = self.config.check_every
        if every == 0:
            return False
        due = self._n_checked == 0 or self.steps_recorded % every == 0
        return due and (self._pending is None or self._pending["n_micro"] == 0)

    def _snapshot_grads(self) -> dict[str, torch.Tensor | None]:
        return {
            n: None if p.grad is None else p.grad.detach().clone() for n, p in self.params.items()
        }

    def _self_check(
        self, before: dict[str, torch.Tensor | None], grads: PerDatumGrads, weight: float
    ) -> None:
        self._n_checked += 1
        results = []  # (name, error, own scale, dtype)
        totals = [_weighted_sum(grads[name], weight) for name in self.params]
        if self._dist is not None:  # this rank holds its own records only
            if self._dist.syncing():
                totals = self._dist.sum_over_ranks(totals)
            else:  # DDP.no_sync(): p.grad is this rank's own, not yet averaged
                totals = [t * self._dist.world_size for t in totals]
        for name, p, total in zip(self.params, self.params.values(), totals):
            if p.grad is None:
                raise GradientCheckError(
                    f"{name!r} has no .grad after the backward, though it is recorded: the loss "
                    "does not depend on it. Exclude it with params=..."
                )
            prior = before[name]
            delta = p.grad.detach() - (0 if prior is None else prior)
            err = float(torch.linalg.vector_norm((delta - total).double()))
            results.append((name, err, float(torch.linalg.vector_norm(delta.double())), p.dtype))
        # Rounding error follows the size of the intermediate values, not of the result: a
        # gradient that is analytically zero (attention key biases) is pure rounding noise of
        # the model's other gradients. So the floor scales with the largest gradient.
        largest = max((scale for _, _, scale, _ in results), default=0.0)
        narrow = self._backend.low_precision if self._backend is not None else {}
        for name, err, scale, dtype in results:
            floor = 1e3 * torch.finfo(dtype).eps * largest
            rtol = self.config.check_rtol
            if name in narrow:  # autocast: autograd rounded p.grad to bfloat16/float16
                rtol = max(rtol, LOW_PRECISION_RTOL * torch.finfo(narrow[name]).eps)
            if err > rtol * scale + floor:
                raise GradientCheckError(
                    f"self-check failed for {name!r}: the weighted sum of per-datum gradients "
                    f"differs from p.grad by {err:.3g} (|p.grad| {scale:.3g}, rtol "
                    f"{rtol:.3g}). Per-datum gradients of this parameter are wrong. "
                    "Likely causes: a layer that mixes datums (batch statistics, a batch-level "
                    "loss term), an in-place change of the parameter during the step, or a "
                    "backend bug; compare with backend='loop'. Nothing of this batch was written."
                )


def _per_probe_grads(
    losses: torch.Tensor, names: list[str], tensors: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``d losses[b] / d theta`` per probe, by ``torch.autograd.grad`` (never ``p.grad``).

    One backward batched over the probes (``is_grads_batched``: vmap over the graph's
    backward); where some operation has no batching rule, one backward per probe instead.
    """
    import warnings

    n = losses.shape[0]
    out = {name: torch.zeros((n, *p.shape), dtype=p.dtype, device=p.device)
           for name, p in zip(names, tensors)}
    eye = torch.eye(n, dtype=losses.dtype, device=losses.device)  # (P, P): one probe each
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vmap's "performance drop" notes: still correct
            grads = torch.autograd.grad(losses, tensors, grad_outputs=eye, retain_graph=True,
                                        allow_unused=True, is_grads_batched=True)
    except RuntimeError:
        grads = None
    if grads is not None:
        for name, g in zip(names, grads):
            if g is not None:
                out[name].copy_(g)  # (P, *shape)
        return out
    for b in range(n):
        gs = torch.autograd.grad(losses[b], tensors, retain_graph=b < n - 1, allow_unused=True)
        for name, g in zip(names, gs):
            if g is not None:
                out[name][b] = g
    return out


def _weighted_sum(material: Material, weight: float) -> torch.Tensor:
    """``weight * sum_b g_b`` of any material (dense: as before forms, bitwise)."""
    if isinstance(material, torch.Tensor):
        return material.detach().sum(0) * weight
    device = material.g.device if isinstance(material, Factors) else material.values.device
    weights = torch.full((batch_size(material),), weight, dtype=torch.float64, device=device)
    return batch_sum(material, weights)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
