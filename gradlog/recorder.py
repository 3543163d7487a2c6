"""``GradRecorder``: the facade that wraps the user's training loop.

It validates inputs, reduces losses to one per datum, asks the backend for per-datum
gradients, self-checks them against ``p.grad``, and hands them to the store writer.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn

from gradlog._version import __version__
from gradlog.backends import BACKENDS, Backend, LossFn, PerDatumGrads
from gradlog.config import RecorderConfig
from gradlog.errors import (
    GradientCheckError,
    GradlogError,
    InputError,
    NonFiniteLossError,
    UnsupportedLayerError,
)
from gradlog.losses import per_datum_losses
from gradlog.params import select_params
from gradlog.store import format as fmt
from gradlog.store.writer import ParamSpec, StoreWriter

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
        backend: ``"loop"`` (one backward per datum, the reference) or ``"vmap"``
            (``torch.func``; needs :meth:`step`).
        batch_reduction: ``"mean"`` or ``"sum"``: what ``p.grad`` is the gradient of.
        token_reduction: For ``(B, T)`` losses: ``"mean"`` over a datum's unmasked tokens,
            or ``"sum"``.
        dtype: Storage dtype of the gradients (``"float32"`` or ``"float64"``).
        every: Record every N-th step only (``step % every == 0``).
        check_every: Self-check ``sum_b w_b g_b == p.grad`` on the first recorded step and
            every N-th after it (0: never).
        check_rtol: Relative tolerance of the self-check.
        optimizer: If given, each step's learning rate is read from its first param group
            when ``lr`` is not passed.
        overwrite: Replace an existing gradlog store at ``path``.
        metadata: JSON-serialisable user metadata stored with the run.
        vmap_randomness: ``torch.func.vmap`` randomness for the vmap backend.
    """

    def __init__(
        self,
        model: nn.Module,
        path: str | os.PathLike[str],
        *,
        params: str | Sequence[str] = "*",
        backend: str = "loop",
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
        )
        self.model = model
        self.path = path
        self.optimizer = optimizer
        self.overwrite = overwrite
        self.params = select_params(model, self.config.params)
        self._backend: Backend | None = None
        self._writer: StoreWriter | None = None
        self._coupling = [
            (n, m) for n, m in model.named_modules() if isinstance(m, _COUPLING_LAYERS)
        ]
        self._last_step: int | None = None
        self._pending: dict[str, Any] | None = None  # the step being recorded, until committed
        self._next_datum = 0
        self._n_checked = 0
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
        self.close()

    def open(self) -> None:
        """Create the store and start recording (``with`` does this)."""
        if self._writer is not None:
            raise GradlogError("this GradRecorder is already recording; use one per run.")
        storage = np.dtype(self.config.dtype)
        specs = {
            name: ParamSpec(
                name=name,
                shape=tuple(p.shape),
                dtype=storage.name,
                param_dtype=str(p.dtype).removeprefix("torch."),
            )
            for name, p in self.params.items()
        }
        self._backend = BACKENDS[self.config.backend](
            self.model,
            self.params,
            batch_reduction=self.config.batch_reduction,
            randomness=self.config.vmap_randomness,
        )
        self._backend.attach()
        attrs = self._root_attrs()
        attrs["backend"] = self._backend.describe()
        try:
            self._writer = StoreWriter(
                self.path, attrs=attrs, specs=specs, overwrite=self.overwrite
            )
        except BaseException:
            self._backend.detach()
            self._backend = None
            raise
        log.info(
            "gradlog: recording %d parameters (%s per datum per step) into %s",
            len(self.params),
            _fmt_bytes(self.bytes_per_record),
            self.path,
        )

    def close(self) -> None:
        """Commit the last step, remove hooks and finish the store (``with`` does this)."""
        try:
            if self._pending is not None and self._writer is not None:
                self._commit()
        finally:
            if self._backend is not None:
                self._backend.detach()
                self._backend = None
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
        """Stored bytes of one datum's gradients (all recorded parameters)."""
        itemsize = np.dtype(self.config.dtype).itemsize
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
            lr: The learning rate applied at this step (stored for influence).
            mask: For ``(B, T)`` losses, which tokens count (bool or 0/1).

        Returns:
            The per-datum losses ``(B,)``, detached.
        """
        self._require_open()
        assert self._backend is not None  # for mypy: _require_open checked it
        reduced = per_datum_losses(losses, mask, self.config.token_reduction)
        self._check_losses(reduced, datum_ids)
        if not reduced.requires_grad:
            raise InputError(
                "losses do not require grad: compute them from the model's output inside the "
                "training step (not under torch.no_grad()) and do not .detach() them."
            )
        step = self._resolve_step(step)
        if not self._records(step):
            self._backend.reduce_batch(reduced).backward()
            self._last_step = step
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
        step = self._resolve_step(step)
        seen_tokens: list[int] = []

        def reduce(raw: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            seen_tokens.append(raw.shape[1] if raw.dim() == 2 else 1)  # tokens per datum
            return self._reduce(raw, mask)

        if not self._records(step):
            reduced = reduce(loss_fn(self.model, batch), mask)
            self._check_losses(reduced, datum_ids)
            self._backend.reduce_batch(reduced).backward()
            self._last_step = step
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

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = 0 if self._last_step is None else self._last_step + 1
        elif isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise InputError(f"step must be an int, got {type(step).__name__}.")
        step = int(step)
        if step < 0:
            raise InputError(f"step must be >= 0, got {step}.")
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
        check = self._due_for_check()
        before = self._snapshot_grads() if check else {}

        t0 = time.perf_counter()
        losses, grads = compute()
        batch = losses.shape[0]
        for name, g in grads.items():
            if tuple(g.shape) != (batch, *self.params[name].shape):
                raise GradlogError(
                    f"backend {self.config.backend!r} returned per-datum gradients of shape "
                    f"{tuple(g.shape)} for {name!r}; expected {(batch, *self.params[name].shape)}"
                    ". A broadcast batch dimension (e.g. position ids of shape [1, T]) was "
                    "taken for a datum; please report this with the model."
                )
        weight = 1.0 / batch if self.config.batch_reduction == "mean" else 1.0
        if check:
            self._self_check(before, grads, weight)
        t1 = time.perf_counter()

        ids = (
            _ids_to_numpy(datum_ids, batch)
            if datum_ids is not None
            else np.arange(self._next_datum, self._next_datum + batch, dtype=np.int64)
        )
        self._next_datum = max(self._next_datum, int(ids.max()) + 1)
        if lr is None and self.optimizer is not None:
            lr = float(self.optimizer.param_groups[0]["lr"])
        storage = getattr(torch, self.config.dtype)
        host = {n: g.detach().to(storage).cpu().numpy() for n, g in grads.items()}
        norms = {
            n: torch.linalg.vector_norm(g.detach().reshape(batch, -1).double(), dim=1).cpu().numpy()
            for n, g in grads.items()
        }
        loss_np = losses.detach().double().cpu().numpy()
        micro = 0 if self._pending is None else self._pending["n_micro"]
        start, stop = self._writer.append(
            step=step,
            micro=micro,
            datum_ids=ids,
            losses=loss_np,
            weights=np.full(batch, weight),
            lr=None if lr is None else float(lr),
            grads=host,
            norms=norms,
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
        p["tokens"] += tokens
        p["loss_sum"] += float(loss_np.sum())
        p["time_compute_s"] += t1 - t0
        p["time_write_s"] += t2 - t1
        self._last_step = step
        self.records_written += batch
        return losses.detach()

    def _commit(self) -> None:
        assert self._writer is not None and self._pending is not None
        p = self._pending
        row = {k: v for k, v in p.items() if k != "loss_sum"}
        row["loss_mean"] = p["loss_sum"] / max(1, p["n_records"])
        self._writer.commit(row)
        self._pending = None
        self.steps_recorded += 1

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
        for name, p in self.params.items():
            if p.grad is None:
                raise GradientCheckError(
                    f"{name!r} has no .grad after the backward, though it is recorded: the loss "
                    "does not depend on it. Exclude it with params=..."
                )
            prior = before[name]
            delta = p.grad.detach() - (0 if prior is None else prior)
            total = grads[name].detach().sum(0) * weight
            err = float(torch.linalg.vector_norm((delta - total).double()))
            results.append((name, err, float(torch.linalg.vector_norm(delta.double())), p.dtype))
        # Rounding error follows the size of the intermediate values, not of the result: a
        # gradient that is analytically zero (attention key biases) is pure rounding noise of
        # the model's other gradients. So the floor scales with the largest gradient.
        largest = max((scale for _, _, scale, _ in results), default=0.0)
        for name, err, scale, dtype in results:
            floor = 1e3 * torch.finfo(dtype).eps * largest
            if err > self.config.check_rtol * scale + floor:
                raise GradientCheckError(
                    f"self-check failed for {name!r}: the weighted sum of per-datum gradients "
                    f"differs from p.grad by {err:.3g} (|p.grad| {scale:.3g}, rtol "
                    f"{self.config.check_rtol}). Per-datum gradients of this parameter are wrong. "
                    "Likely causes: a layer that mixes datums (batch statistics, a batch-level "
                    "loss term), an in-place change of the parameter during the step, or a "
                    "backend bug; compare with backend='loop'. Nothing of this batch was written."
                )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
