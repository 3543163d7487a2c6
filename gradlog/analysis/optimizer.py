"""Score kinds of influence, and the optimizer's part in them (#19).

Three kinds, one vocabulary (``kind=`` of :func:`gradlog.analysis.influence`,
:func:`gradlog.analysis.influence_matrix` and ``gradlog influence --kind``):

``"tracin"``
    ``sum_t lr_t [w_d] <g_t(d), g_t(z)>``: the first-order effect of plain SGD (Pruthi et
    al. 2020).
``"optimizer"``
    The first-order effect of the optimizer that trained the model, from its state kept at
    the recorded steps (``GradRecorder(optimizer=...)``, :mod:`gradlog.recording.optimizer`)::

        sum_t [w_d] lr_t c < P_t g_t(d), g_t(z) >

    ``P_t`` is the diagonal preconditioner the step applied: Adam/AdamW's
    ``1 / (sqrt(v_t / (1 - beta2^n_t)) + eps)`` (its second moment after the step, ``n_t``
    its step count; 0 on entries where the step's gradient ``p.grad`` was 0: no datum of the
    step has a gradient there, and Adam did not move them), the identity for SGD.

    Momentum: ``d``'s gradient enters the momentum at step ``t`` and each later update applies
    a share of it (Adam ``(1 - beta1) beta1^k``, SGD ``a mu^k`` with ``a = 1 - dampening``,
    1 at the first step whose buffer starts as the gradient). The score applies that whole
    share at step ``t``, with step ``t``'s preconditioner and probe gradient: ``c = 1`` for
    Adam, ``a / (1 - mu)`` for SGD (nesterov ``1 + a mu / (1 - mu)``), 1 for plain SGD, where
    ``"optimizer"`` equals ``"tracin"``. That is the one-step form. Carrying the share into
    the later updates with Adam's bias correction and the run's end (``c_t`` from about 3 at
    the first step to ``1 - beta1`` at the last) measured worse (LDS 0.44 against 0.63 for this
    form, TracIn 0.55: ``tests/benchmarks/RESULTS.md``, "Attribution"): the later updates are
    evaluated at step ``t``'s preconditioner and probe gradient, which early in training are
    far from theirs. Adam's dependence of ``v`` on ``d`` is ignored (first order in ``m``).
    AdamW's decoupled weight decay and Adam's L2 term do not depend on the data and add
    nothing. ``lr_t`` is the parameter's group learning rate at that step (``lr=`` replaces
    it).
``"cosine"``
    ``sum_t lr_t [w_d] cos(g_t(d), g_t(z))`` over the selected parameters (the gradient
    cosine baseline of the attribution literature), with the exact norms of the index.

Applying ``lr_t c P_t`` to the probe's gradient, before it is projected for a
``projection`` parameter, gives the same score (``P_t`` is diagonal) while the training
records stay as recorded: projected scores are unbiased estimates of the optimizer-aware
ones, and every form answers every kind.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from gradlog.analysis.gradients import project
from gradlog.analysis.scan import ArrayReader
from gradlog.analysis.selection import check_lr, record_coefficients
from gradlog.errors import InputError, SelectionError, StoreCorruptError, StoreFormatError
from gradlog.store import root
from gradlog.store.format import norm_column
from gradlog.store.optimizer import OptimizerStep, optimizer_steps, read_optimizer_step
from gradlog.store.reader import StoreReader

__all__ = [
    "KINDS",
    "OptimizerView",
    "check_kind",
    "default_kind",
    "momentum_mass",
    "param_coefficients",
    "probe_reader",
    "probe_sqnorms",
    "recorded_kind",
]

KINDS = ("tracin", "optimizer", "cosine")
"""Score kinds of influence (module doc)."""


def recorded_kind(run: StoreReader) -> str | None:
    """``"adam"``, ``"sgd"`` (with momentum), ``"plain-sgd"`` or None: the optimizer whose
    state the run kept (at its first step with state)."""
    steps = optimizer_steps(run.path)
    if not steps:
        return None
    state = read_optimizer_step(run.path, steps[0])
    try:
        kind, groups = state.meta.get("kind"), state.meta.get("params", {}).values()
    finally:
        state.close()
    if kind == "sgd":
        moving = any(g is not None and g.get("momentum", 0.0) != 0.0 for g in groups)
        return "sgd" if moving else "plain-sgd"
    return str(kind) if kind == "adam" else None


def default_kind(run: StoreReader) -> str:
    """``"optimizer"`` when the run kept the state of Adam, AdamW or SGD with momentum;
    else ``"tracin"`` (for plain SGD the two are the same score)."""
    return "optimizer" if recorded_kind(run) in ("adam", "sgd") else "tracin"


def check_kind(run: StoreReader, kind: str | None) -> str:
    """``kind`` checked (None: :func:`default_kind`).

    Raises:
        InputError: an unknown kind; ``"optimizer"`` on a run without optimizer state.
    """
    if kind is None:
        return default_kind(run)
    if kind not in KINDS:
        raise InputError(f"kind={kind!r} is not one of {list(KINDS)}.")
    if kind == "optimizer" and recorded_kind(run) is None:
        strategy = (run.attrs.get("backend", {}).get("distributed") or {}).get("strategy")
        if strategy == "fsdp2":
            raise InputError(
                f"kind='optimizer' needs the optimizer's state, and {run.path} has none: it "
                "was recorded under FSDP2, whose sharded optimizer state gradlog does not "
                "keep yet (the recorder warned). Use kind='tracin' (the SGD score) or "
                "'cosine'."
            )
        raise InputError(
            f"kind='optimizer' needs the optimizer's state, and {run.path} has none: it was "
            "recorded without GradRecorder(optimizer=...), with optimizer_state='none', with "
            "an optimizer gradlog does not read (Adam, AdamW and SGD are read), or by a "
            "gradlog older than 0.x (#19). Use kind='tracin' (the SGD score) or 'cosine'."
        )
    return kind


def momentum_mass(group: dict[str, Any], kind: str) -> float:
    """``c`` of the module doc for one parameter at one step, from its stored
    hyperparameters (and, for SGD, its step count: the first step's buffer is the gradient)."""
    if kind == "adam":
        return 1.0  # (1 - beta1) sum_k beta1^k
    mu = float(group.get("momentum", 0.0))
    if mu == 0.0:
        return 1.0
    first = group.get("count") is not None and int(group["count"]) <= 1
    a = 1.0 if first else 1.0 - float(group.get("dampening", 0.0))
    return 1.0 + a * mu / (1.0 - mu) if group.get("nesterov", False) else a / (1.0 - mu)


def param_coefficients(
    run: StoreReader, records: Any, names: Sequence[str], *, lr: float | None, weighted: bool,
    what: str,
) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
    """Per record, ``lr_t [w_r]`` (:func:`~gradlog.analysis.selection.record_coefficients`),
    and per parameter where param groups gave the parameters different rates.

    A record keeps one learning rate: ``lr=`` of ``rec.backward``, or the rate of the
    optimizer's first param group holding a recorded parameter. At a step where the run kept
    the optimizer's state and the recorded parameters' groups had different rates, each
    parameter's own group rate applies, as in ``kind="optimizer"``; ``lr=`` here replaces
    every rate. A step of such a run without readable state keeps the record's rate, with a
    warning.

    Returns:
        ``(common, per_param)``: ``per_param`` None where ``common`` holds for every name.
    """
    common = record_coefficients(records, lr=lr, weighted=weighted, what=what)
    if lr is not None or records.num_rows == 0:
        return common, None
    kept = set(optimizer_steps(run.path))
    if not kept:
        return common, None
    ustep, first, inverse = np.unique(records.column("step").to_numpy(), return_index=True,
                                      return_inverse=True)
    record_lr = records.column("lr").to_numpy(zero_copy_only=False).astype(np.float64)
    group_0_rates = not root.records_rate_of_recorded_group(run.attrs)
    rates: dict[str, np.ndarray] | None = None
    unread: list[int] = []  # steps of the run without readable state
    for i, step in enumerate(ustep.tolist()):
        own = _group_rates(run, step) if step in kept else None
        if own is None:
            unread.append(step)
            continue
        agree = len(set(own.values())) <= 1  # one rate: the record's (or rec.backward's lr=)
        if agree and (not group_0_rates or all(v == record_lr[first[i]] for v in own.values())):
            continue
        if rates is None:
            rates = {n: np.full(ustep.size, np.nan) for n in names}
        for n in names:
            rates[n][i] = own.get(n, np.nan)
    if rates is None:
        return common, None
    if unread:
        warnings.warn(
            f"{what}: the recorded parameters' param groups had different learning rates, but "
            f"step(s) {unread[:5]}{' ...' if len(unread) > 5 else ''} have no readable "
            "optimizer state: those steps weight every parameter by the record's one rate.",
            UserWarning, stacklevel=4,
        )
    weight = (records.column("weight").to_numpy().astype(np.float64) if weighted
              else np.ones(records.num_rows))
    per_param = {}
    for n in names:
        rate = rates[n][inverse]
        per_param[n] = np.where(np.isnan(rate), common, rate * weight)
    return common, per_param


def _group_rates(run: StoreReader, step: int) -> dict[str, float] | None:
    """Each stepped parameter's group rate at ``step`` from its state file, or None when
    the file cannot be read (it is named; scores that need it raise)."""
    try:
        state = read_optimizer_step(run.path, step)
    except (StoreCorruptError, StoreFormatError):
        return None
    return {n: float(g["lr"]) for n, g in state.meta.get("params", {}).items() if g is not None}


class OptimizerView:
    """The run's optimizer state at the steps a score needs: per parameter and step, the
    factor ``lr_t c P_t`` applied to the probe's gradient (module doc).

    Args:
        run: The run.
        steps: The steps that will be scored.
        lr: A learning rate replacing every recorded one (``lr=``), or None.

    Raises:
        InputError: some of ``steps`` have no optimizer state.
    """

    def __init__(self, run: StoreReader, steps: np.ndarray, lr: float | None) -> None:
        self.run = run
        self.lr = None if lr is None else check_lr(lr)
        kept = np.asarray(optimizer_steps(run.path), dtype=np.int64)
        committed = run.steps.column("step").to_numpy()
        kept = kept[np.isin(kept, committed)]
        wanted = np.unique(np.asarray(steps, dtype=np.int64))
        missing = np.setdiff1d(wanted, kept)
        if missing.size:
            shown = ", ".join(map(str, missing[:5].tolist()))
            raise InputError(
                f"kind='optimizer': step(s) {shown}{' ...' if missing.size > 5 else ''} of "
                f"{run.path} have no optimizer state (optimizer= was not passed then, or the "
                "state file was removed). Use kind='tracin', or score the steps that have one."
            )
        self.kept = kept
        self._open = lru_cache(maxsize=4)(self._read)
        self._factor: tuple[tuple[str, int], tuple[float, np.ndarray | None]] | None = None

    def _read(self, step: int) -> OptimizerStep:
        return read_optimizer_step(self.run.path, step)

    def factor(self, param: str, step: int) -> tuple[float, np.ndarray | None]:
        """``(lr_t c, P_t)``: the scalar and the flat preconditioner (None: identity)
        ``param``'s probe gradient at ``step`` is multiplied by; ``(0, None)`` where the
        optimizer did not step the parameter."""
        key = (param, int(step))
        last = self._factor  # (read once: scans of several parameters share this view)
        if last is not None and last[0] == key:  # rows come step by step
            return last[1]
        found = self._compute_factor(param, int(step))
        self._factor = (key, found)
        return found

    def _compute_factor(self, param: str, step: int) -> tuple[float, np.ndarray | None]:
        state = self._open(int(step))
        group = state.group(param)
        if group is None:
            return 0.0, None
        kind = str(state.meta.get("kind"))
        lr = float(group["lr"]) if self.lr is None else float(self.lr)
        scale = lr * momentum_mass(group, kind)
        return scale, state.preconditioner(param) if kind == "adam" else None

    def apply(self, param: str, step: int, full: np.ndarray) -> np.ndarray:
        """Rows ``(k, numel)`` of a probe's full gradient at ``step``, times ``lr c P``."""
        scale, precond = self.factor(param, step)
        out = np.asarray(full, dtype=np.float64) * scale
        if precond is not None:
            out *= precond
        return out


def probe_reader(
    run: StoreReader,
    param: str,
    full_rows: Callable[[np.ndarray], np.ndarray],
    step_of: Callable[[int], int],
    view: OptimizerView | None,
    out: Any,
) -> ArrayReader:
    """A reader of probe rows in ``param``'s comparison space, transformed by the optimizer.

    Args:
        run: The run.
        param: The parameter.
        full_rows: ``full_rows(ids)`` returns the rows ``ids`` (sorted) as full gradients
            ``(k, numel)``: recorded probe rows, or a fixed gradient repeated; a new array
            (a writable one is scaled in place) or a read-only view.
        step_of: ``step_of(id)``: the step of row ``id`` (whose optimizer state applies).
        view: The optimizer's state, or None (``tracin``, ``cosine``: untransformed).
        out: The dtype returned.
    """
    shape = run.spec(param)["shape"]
    numel = int(np.prod(shape, dtype=np.int64))
    projected = run.form_name(param) == "projection"
    out_shape = run.form(param).out_shape if projected else shape

    def read(ids: np.ndarray) -> np.ndarray:
        if projected:
            full = np.array(full_rows(ids), dtype=np.float64).reshape(ids.size, numel)  # a copy
            if view is not None:
                for i, row in enumerate(ids):
                    full[i] = view.apply(param, step_of(int(row)), full[i])
            return np.asarray(project(run, param, full.reshape(ids.size, *shape)), dtype=out)
        rows = np.asarray(full_rows(ids)).reshape(ids.size, numel)
        if view is None:
            return np.asarray(rows, dtype=out)
        # times lr c P_t, by step: the factor formed in float64, rounded once to the rows'
        # dtype, one multiply (float32 rows: ~1e-7 relative, as the products themselves)
        result = rows if rows.dtype == out and rows.flags.writeable else np.empty(
            (ids.size, numel), dtype=out)  # (in place: full_rows gives a new array)
        steps = np.array([step_of(int(row)) for row in ids])
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(steps)) + 1, [ids.size]])
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            scale, precond = view.factor(param, int(steps[a]))
            factor = np.asarray(scale if precond is None else precond * scale, dtype=out)
            np.multiply(rows[a:b], factor, out=result[a:b], casting="unsafe")
        return result

    # (peak: the rows as read, and a result unless they are scaled in place; a projection's
    # float64 rows before it)
    return ArrayReader(read, out_shape, out, stored_itemsize=8 if projected else 4,
                       chunk_rows=1, sharded=True)


def probe_sqnorms(
    run: StoreReader, records: Any, names: Sequence[str]
) -> np.ndarray:
    """Per probe record, its squared gradient norm over ``names`` (index norms)."""
    sq = np.zeros(records.num_rows, dtype=np.float64)
    for name in names:
        if norm_column(name) not in records.column_names:
            raise SelectionError(f"the probe index has no norm of {name!r}.")
        norms = run.record_norms(records, name)
        sq += norms * norms
    return sq
