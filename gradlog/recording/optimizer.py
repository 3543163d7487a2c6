"""Capturing the optimizer's state at recorded steps, for optimizer-aware influence (#19).

After each optimizer step that finishes a recorded step (a post-step hook on the optimizer
passed to ``GradRecorder``), this keeps, per recorded parameter, what the step applied:

- Adam, AdamW: the diagonal preconditioner ``P_t = 1 / (sqrt(v_t / (1 - beta2^n)) + eps)``
  (``v_t`` the second moment after the step, ``max_exp_avg_sq`` with ``amsgrad``; ``n`` the
  optimizer's step count), exactly as torch computes its denominator, 0 where the step's
  ``p.grad`` is 0, and the group's ``lr``, ``betas``, ``n``. Stored float32 (``bfloat16``
  for parameters kept as ``projection``/``topk``, which are estimates anyway, or as
  ``optimizer_state`` says).
- SGD (with or without momentum): the group's ``lr``, ``momentum``, ``dampening``,
  ``nesterov`` and step count; no array (its preconditioner is the identity).

Other optimizers get nothing stored, with one warning: their runs score ``kind="tracin"``
only. The state is copied to the host on the training thread (the next step changes it),
and written on a background thread; :meth:`OptimizerCapture.flush` (called before the step
commits) waits for it, so a committed step's state file precedes its commit marker.
Layout: :mod:`gradlog.store.optimizer`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from gradlog.errors import InputError
from gradlog.planning import format_bytes
from gradlog.store.fs import StorePath
from gradlog.store.optimizer import OPTIMIZER_DTYPES, write_optimizer_step

__all__ = ["OPTIMIZER_STATES", "OptimizerCapture", "optimizer_kind"]

log = logging.getLogger("gradlog")

OPTIMIZER_STATES = ("auto", *OPTIMIZER_DTYPES, "none")
"""Values of ``GradRecorder(optimizer_state=...)``."""

_ESTIMATE_FORMS = ("projection", "topk", "norm")


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper (accelerate's ``AcceleratedOptimizer``)."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    return inner


def optimizer_kind(optimizer: Any) -> str | None:
    """``"adam"`` (Adam, AdamW), ``"sgd"`` (SGD, any momentum), or None (not read)."""
    inner = _unwrap(optimizer)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(inner, torch.optim.SGD):
        return "sgd"
    return None


def _scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _warn_if_not_trained_by(optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> None:
    """Warn when recorded parameters are in none of the optimizer's param groups (another
    optimizer trains them: Lightning's second optimizer): no rate or state is known."""
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    outside = [n for n, p in params.items() if id(p) not in trained]
    if outside:
        warnings.warn(
            f"recorded parameters {outside[:5]}{' ...' if len(outside) > 5 else ''} are in "
            f"none of the param groups of the optimizer given ({type(optimizer).__name__}): "
            "their records carry its rate, influence weights them by it, and "
            "kind='optimizer' scores them 0. Record the parameters each optimizer trains "
            "with a recorder of their own, or pass params= to queries.",
            UserWarning,
            stacklevel=5,
        )


def _warn_if_rates_differ(optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> None:
    """Warn when the recorded parameters' param groups have different learning rates and
    no optimizer state will be kept: each record keeps one rate (the first group's)."""
    mine = {id(p) for p in params.values()}
    rates = {_scalar(g["lr"]) for g in optimizer.param_groups
             if any(id(p) in mine for p in g["params"])}
    if len(rates) > 1:
        warnings.warn(
            f"the recorded parameters are in param groups with different learning rates "
            f"({sorted(rates)}) and gradlog keeps no optimizer state for this run: each "
            "record keeps one rate (the first of these groups'), and influence, "
            "self-influence and movers weight every parameter by it. Record with Adam, "
            "AdamW or SGD and optimizer_state='auto' (each parameter's own rate is kept), "
            "or pass lr= to queries of parameters of one group.",
            UserWarning,
            stacklevel=5,
        )


class OptimizerCapture:
    """Keeps the optimizer's state at each recorded step (module doc).

    Args:
        optimizer: The optimizer given to ``GradRecorder``.
        params: Recorded parameters by name.
        root: The store.
        pending_step: Returns the recorded step in progress (None between recorded steps).
        dtype: ``optimizer_state``: ``"auto"``, ``"float32"``, ``"bfloat16"``.
        forms: Returns each parameter's form name once planned (for ``auto``).
        durable: fsync each file.
    """

    def __init__(
        self,
        optimizer: Any,
        params: Mapping[str, torch.nn.Parameter],
        root: StorePath,
        pending_step: Callable[[], int | None],
        *,
        dtype: str,
        forms: Callable[[], Mapping[str, str] | None],
        durable: bool,
    ) -> None:
        self.optimizer = _unwrap(optimizer)
        self.kind = optimizer_kind(optimizer)
        self.params = dict(params)
        self.root = root
        self._pending = pending_step
        self.dtype = dtype
        self._forms = forms
        self.durable = durable
        self._captured: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradlog-optimizer")
        self._writing: Future[int] | None = None
        self.bytes_written = 0
        self._steps_seen = 0
        self._fresh: set[int] = set()  # SGD: parameters without a momentum buffer before
        self._handles = [self.optimizer.register_step_pre_hook(self._before_step),
                         self.optimizer.register_step_post_hook(self._on_step)]

    @classmethod
    def start(
        cls,
        optimizer: Any,
        params: Mapping[str, torch.nn.Parameter],
        root: StorePath,
        pending_step: Callable[[], int | None],
        *,
        dtype: str,
        forms: Callable[[], Mapping[str, str] | None],
        durable: bool,
    ) -> OptimizerCapture | None:
        """A capture for ``optimizer``, or None (no optimizer, ``optimizer_state="none"``,
        or an optimizer whose state gradlog does not read: warned once).

        Raises:
            InputError: ``dtype`` is not one of :data:`OPTIMIZER_STATES`; ``maximize=True``.
        """
        if dtype not in OPTIMIZER_STATES:
            raise InputError(
                f"optimizer_state={dtype!r} is not one of {list(OPTIMIZER_STATES)}: 'auto' "
                "(float32, bfloat16 for projection/topk parameters), a storage dtype, or "
                "'none' to keep no optimizer state."
            )
        if optimizer is None:
            return None
        inner = _unwrap(optimizer)
        if not isinstance(inner, torch.optim.Optimizer):
            return None
        _warn_if_not_trained_by(inner, params)
        if dtype == "none" or optimizer_kind(inner) is None:
            _warn_if_rates_differ(inner, params)
        if dtype == "none":
            return None
        if optimizer_kind(inner) is None:
            warnings.warn(
                f"gradlog keeps no optimizer state for {type(inner).__name__} (it reads Adam, "
                "AdamW and SGD): influence on this run is the SGD first-order score "
                "(kind='tracin'); kind='optimizer' will be refused.",
                UserWarning,
                stacklevel=4,
            )
            return None
        if optimizer_kind(inner) == "adam" and any(callable(getattr(p, "full_tensor", None))
                                                   for p in params.values()):
            warnings.warn(  # (gathering them would take every rank; rank 0 alone keeps state)
                "gradlog keeps no optimizer state for parameters sharded by FSDP2 (DTensors) "
                "yet: influence on this run is the SGD first-order score (kind='tracin'); "
                "kind='optimizer' will be refused.",
                UserWarning,
                stacklevel=4,
            )
            _warn_if_rates_differ(inner, params)
            return None
        mine = {id(p) for p in params.values()}
        for group in inner.param_groups:
            if any(id(p) in mine for p in group["params"]) and group.get("maximize", False):
                raise InputError(
                    "the optimizer has maximize=True for recorded parameters: gradlog's "
                    "influence assumes the optimizer minimises the recorded losses. Record "
                    "with a minimising optimizer (negate the loss), or pass "
                    "optimizer_state='none'."
                )
        return cls(optimizer, params, root, pending_step, dtype=dtype, forms=forms,
                   durable=durable)

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes of stored preconditioner per recorded step, per parameter (0 for SGD)."""
        if self.kind != "adam":
            return {name: 0 for name in self.params}
        return {name: p.numel() * (2 if self._dtype_of(name) == "bfloat16" else 4)
                for name, p in self.params.items()}

    def plan_line(self) -> str:
        """The plan's line for the optimizer state."""
        per = sum(self.bytes_per_step().values())
        what = ("the Adam preconditioner of each recorded parameter" if self.kind == "adam"
                else "SGD hyperparameters only")
        return (f"optimizer state ({type(self.optimizer).__name__}): {per:,} bytes/step "
                f"({format_bytes(per)}; {what}) for kind='optimizer' influence")

    def _dtype_of(self, name: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        forms = self._forms() or {}
        return "bfloat16" if forms.get(name) in _ESTIMATE_FORMS else "float32"

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # SGD's first momentum step sets the buffer to the gradient, undamped: which
        # parameters take it is known only before the step (a warm-up or a resumed
        # optimizer has buffers before this recorder's first step). At every step: Lightning
        # runs the step's backward inside step(closure), after this hook
        if self.kind == "sgd":
            state = self.optimizer.state
            self._fresh = {id(p) for p in self.params.values()
                           if state.get(p, {}).get("momentum_buffer") is None}

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps_seen += 1  # SGD keeps no step count: every step counts, recorded or not
        step = self._pending()
        if step is None or step == self._captured:  # not a recorded step, or already kept
            return
        self._captured = step
        meta, precond = self._snapshot()
        self.flush()  # one file in flight at a time: bounded host memory
        dtype = "float32"
        if precond:
            kinds = {self._dtype_of(n) for n in precond}
            dtype = "bfloat16" if kinds == {"bfloat16"} else "float32"
        self._writing = self._pool.submit(
            write_optimizer_step, self.root, step, meta, precond, dtype=dtype,
            durable=self.durable,
        )

    def _snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The state the step applied, copied to host arrays (module doc)."""
        groups = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                groups[id(p)] = group
        params: dict[str, Any] = {}
        precond: dict[str, np.ndarray] = {}
        for name, p in self.params.items():
            group = groups.get(id(p))
            if group is None or p.grad is None:
                params[name] = None  # not stepped (torch skips a parameter without grad)
                continue
            state = self.optimizer.state.get(p, {})
            if self.kind == "adam" and "exp_avg_sq" not in state:
                params[name] = None
                continue
            entry: dict[str, Any] = {"lr": _scalar(group["lr"]),
                                     "weight_decay": float(group.get("weight_decay", 0.0))}
            if self.kind == "adam":
                beta1, beta2 = (_scalar(b) for b in group["betas"])
                count = int(_scalar(state["step"]))
                amsgrad = bool(group.get("amsgrad", False))
                v = state["max_exp_avg_sq" if amsgrad else "exp_avg_sq"]
                eps = float(group["eps"])
                # torch's own denominator, in float64: (sqrt(v) / sqrt(1 - beta2^n)) + eps
                denom = v.detach().double().sqrt() / math.sqrt(1.0 - beta2**count) + eps
                # 0 where the step's gradient is 0: no datum of the step has a gradient there,
                # and there 1/eps (v = 0: an embedding row no batch touched yet) would swamp
                # a projected probe's estimate for nothing
                touched = p.grad.detach() != 0
                precond[name] = (denom.reciprocal() * touched).float().reshape(-1).cpu().numpy()
                entry.update(betas=[beta1, beta2], eps=eps, amsgrad=amsgrad, count=count)
            else:
                # 1 at the parameter's first momentum step, else the steps seen by this
                # recorder and at least 2 (SGD keeps no count of its own)
                count = 1 if id(p) in self._fresh else max(2, self._steps_seen)
                entry.update(momentum=float(group.get("momentum", 0.0)),
                             dampening=float(group.get("dampening", 0.0)),
                             nesterov=bool(group.get("nesterov", False)), count=count)
            params[name] = entry
        meta = {"optimizer": type(self.optimizer).__name__, "kind": self.kind, "params": params}
        return meta, precond

    def flush(self) -> None:
        """Wait for the state in flight to be written (raises its error, if any)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            self.bytes_written += writing.result()

    def close(self) -> None:
        """Remove the hook, finish writing."""
        for handle in self._handles:
            handle.remove()
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
