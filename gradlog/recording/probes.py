"""Probes: per-example gradients of held-out examples at every recorded step, for influence
exact in time (``run.influence``), written beside the training records without touching
training (``p.grad``, the optimizer and the RNG stream are left as they are)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from gradlog._torch_private import tensor_version
from gradlog.errors import GradlogError, InputError, NonFiniteLossError
from gradlog.losses import per_datum_losses
from gradlog.recording.inputs import check_mask
from gradlog.recording.staging import to_host
from gradlog.store.dtypes import storage_dtype
from gradlog.store.fs import StorePath
from gradlog.store.probes import ProbeWriter

__all__ = ["ProbeRecorder"]


class ProbeRecorder:
    """Records the probes' gradients once per recorded step.

    Args:
        probes: ``(loss_fn, batch)``; ``loss_fn(model, batch)`` returns per-probe ``(P,)`` or
            per-token ``(P, T)`` losses.
        probe_ids: One distinct int >= 0 per probe, or None (``0 .. P-1``).
        model: The model being trained.
        params: The recorded parameters, by name.
        token_reduction: How per-token losses become a probe's loss.
        dtype: The storage dtype's name.
        durable: ``fsync`` the probe rows before the step commits.
    """

    def __init__(
        self,
        probes: tuple[Any, ...],
        probe_ids: Any,
        model: nn.Module,
        params: Mapping[str, torch.Tensor],
        *,
        token_reduction: str,
        dtype: str,
        durable: bool,
        compression: str = "none",
    ) -> None:
        self.loss_fn, self.batch = probes[0], probes[1]
        self.mask = probes[2] if len(probes) == 3 else None  # of (P, T) per-token losses
        check_mask(self.mask)
        self.probe_ids = probe_ids
        self.model = model
        self.params = params
        self.token_reduction = token_reduction
        self.dtype = dtype
        self.storage = storage_dtype(dtype)
        self.durable = durable
        self.compression = compression
        self._writer: ProbeWriter | None = None  # at the first probe step

    def record(self, step: int, store: StorePath) -> None:
        """Per-probe gradients at the step's parameters, written before the step commits.

        Raises:
            InputError: ``loss_fn`` returned no per-probe losses, or bad ``probe_ids``.
            NonFiniteLossError: a probe's loss is NaN or infinite.
        """
        names = list(self.params)
        tensors = [self.params[n] for n in names]
        cuda = sorted({p.device.index or 0 for p in tensors if p.device.type == "cuda"})
        # A forked RNG: dropout in the probe forward must not shift training's random stream;
        # what it writes in place (buffers, renormalised embeddings) is put back.
        with torch.random.fork_rng(devices=cuda), torch.enable_grad(), _state_kept(self.model):
            try:
                raw = self.loss_fn(self.model, self.batch)
            except (GradlogError, MemoryError, torch.cuda.OutOfMemoryError):
                raise
            except Exception as e:  # a probe batch the model does not take, a loss_fn bug
                raise InputError(
                    f"the probes' loss_fn failed on the probe batch at step {step} "
                    f"({type(e).__name__}: {e}); nothing of this step was written. Check "
                    "that loss_fn(model, batch) runs on the batch given as "
                    "GradRecorder(probes=(loss_fn, batch)) (its shapes, dtype and device) "
                    "outside the recorder.") from e
            try:
                losses = per_datum_losses(raw, self.mask, self.token_reduction)
            except InputError as e:  # the message speaks of "losses" and "mask=": say whose
                said = str(e).replace("Pass mask=", "Pass probes=(loss_fn, batch, mask) with "
                                      "mask=")
                raise type(e)(f"the probes' loss_fn (GradRecorder(probes=(loss_fn, batch))): "
                              f"{said}") from None
            n = losses.shape[0] if losses.dim() == 1 else 0
            if n == 0 or not losses.requires_grad:
                raise InputError(
                    "the probe loss_fn must return per-probe losses (P,) or (P, T) with P >= 1 "
                    "that depend on the model's parameters (not under torch.no_grad(), not "
                    f"detached); got shape {tuple(losses.shape)}."
                )
            ids = self._ids(n)
            finite = torch.isfinite(losses.detach())
            if not bool(finite.all()):
                bad = ids[torch.nonzero(~finite).flatten().cpu().numpy()[:10]].tolist()
                raise NonFiniteLossError(
                    f"the loss of probe(s) {bad} is NaN or infinite at step {step}; nothing of "
                    "this step was written. Check the probe batch and loss_fn."
                )
            out = _per_probe_grads(losses, names, tensors)
        if self._writer is None:
            specs = {name: (tuple(p.shape), self.dtype) for name, p in self.params.items()}
            self._writer = ProbeWriter(store, specs, ids.tolist(), durable=self.durable,
                                       compression=self.compression)
        self._writer.append(
            step=step,
            losses=losses.detach().double().cpu().numpy(),
            grads={k: to_host(g, self.storage) for k, g in out.items()},
            norms={
                k: torch.linalg.vector_norm(g.reshape(n, -1).double(), dim=1).cpu().numpy()
                for k, g in out.items()
            },
        )

    def close(self) -> None:
        """Finish the probe arrays."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _ids(self, n: int) -> np.ndarray:
        if self.probe_ids is None:
            return np.arange(n, dtype=np.int64)
        raw = self.probe_ids
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


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """After the probe forward, the model's buffers (the same objects, with the same values:
    written in place, through ``.data``, or assigned anew) and the weights of its embeddings
    with a ``max_norm`` as before it: ``nn.Embedding(max_norm=...)`` renormalises the rows
    it looks up in place, ``spectral_norm`` steps its power iteration, a BatchNorm in
    training mode its statistics; training would go on from those. Another parameter the
    forward writes in place is refused (it cannot be put back; a write through ``.data``
    leaves no trace to see)."""
    buffers = [(m, n, t, t.detach().clone()) for m in model.modules()
               for n, t in m.named_buffers(recurse=False)]
    tables = [(m.weight, m.weight.detach().clone()) for m in model.modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
    params = list(model.named_parameters())
    before = [tensor_version(t) for t, _ in tables] + [tensor_version(p) for _, p in params]
    yield
    with torch.no_grad():
        for module, name, t, copy in buffers:
            if getattr(module, name, None) is not t:
                setattr(module, name, t)  # (assigned anew: the training's own object back)
            t.copy_(copy)
        for (t, copy), version in zip(tables, before, strict=False):
            if tensor_version(t) != version:
                t.copy_(copy)
    ours = {id(t) for t, _ in tables}
    moved = [n for (n, p), v in zip(params, before[len(tables):], strict=True)
             if id(p) not in ours and tensor_version(p) != v]
    if moved:
        raise InputError(
            f"the probes' forward wrote parameters {moved[:4]} in place, which changes "
            "training; nothing of this step was written. Record without probes=, or keep "
            "the model's forward from writing its parameters.")


def _per_probe_grads(
    losses: torch.Tensor, names: list[str], tensors: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``d losses[b] / d theta`` per probe, by ``torch.autograd.grad`` (never ``p.grad``).

    One backward batched over the probes (``is_grads_batched``: vmap over the graph's
    backward); where some operation has no batching rule, one backward per probe instead.
    """
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
