"""The datum check: on the first backward of each new layout and batch size, the records
weighted by random ``v_b`` against ``autograd.grad`` of ``sum_b v_b losses[b]``.

A wrong split between datums (two datums' gradients swapped, a share moved, a loss that
couples the datums) still sums to ``p.grad`` and passes the spot check
(:class:`.checks.SpotCheck`); the weighted sum sees it. When it runs
(:class:`DatumLayouts`, :func:`datum_check_possible`), on which backward
(:func:`datum_check_mode`), what it compares (:func:`sample_entries`, :func:`check_datum`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradlog._torch_private import (
    forked_rng,
    global_module_backward_hooks_on,
    module_has_backward_hooks,
    tensor_hook_count,
)
from gradlog.backends.base import check_tolerance
from gradlog.backends.hooks.calls import Call, calls_moved, sizes_of_b
from gradlog.backends.hooks.checks import over_tolerance, rerun_hint
from gradlog.backends.hooks.graph import foreign_functions
from gradlog.errors import BackendError
from gradlog.grads import Factors, Rows, dense, entries

__all__ = [
    "HOOK_KINDS",
    "DatumLayouts",
    "Layout",
    "check_datum",
    "datum_check_mode",
    "datum_check_possible",
    "probe",
    "sample_entries",
    "watch",
]

_DATUM_ENTRIES = 64  # entries per parameter of the datum check (check_datum)
_ZEROS_NAMED = 4  # checks comparing only zeros before a layout's re-checks are named

log = logging.getLogger("gradlog")

Layout = tuple[str, int, tuple[int, ...]]  # (module, calls of it, dims of size B): checked


class DatumLayouts:
    """The forward layouts the datum check (:func:`check_datum`) has verified, and whether
    a backward needs one.

    The check runs on the first backward, again at each batch size not checked yet (a short
    last batch), and whenever a forward has a layout not checked yet that shapes alone
    cannot settle: a layer output with several leading dimensions of size B (a
    sequence-first tensor whose length equals the batch size) or one after the first
    (sequence-first; or a shared table as long as the batch, read as batched: its records
    were then wrong from a later step on, unchecked), or a module called more than once
    (reuse, or once per datum by hand). A wrong split between datums still sums to
    ``p.grad``; the weighted check sees it. A layout counts as verified only once a check
    compared a gradient of its parameters that is not zero, and its own calls got an output
    gradient that is not zero (:meth:`passed`): a step where they get none (a mask keeping
    one key) compares zeros with zeros and proves nothing (it verified a shared table whose
    next step was then 0.72 off; 4.1e-2 where the table's other reads gave it a gradient)."""

    def __init__(self) -> None:
        self.checked: set[Layout] = set()
        self._pending: dict[Layout, frozenset[str]] = {}  # this backward's: their params
        self._calls: dict[Layout, list[Call]] = {}  # this backward's: the layouts' calls
        self._zeros: dict[Layout, int] = {}  # checks that compared only zeros, by layout
        self._told: set[Layout] = set()  # unverified layouts the log named (unverified)
        self._rows: dict[str, torch.Tensor] = {}  # entries in rows looked up (table_entries)

    def wants(self, calls: Sequence[Call], B: int, model: nn.Module,
              params: Mapping[str, nn.Parameter], due: bool = False,
              possible: bool = True) -> bool:
        """Whether this backward needs a check. ``due``: the recorder self-checks this
        batch (``check_every``): check a datum too, so a loss that starts coupling data is
        caught. ``possible``: whether one can run at all (:func:`datum_check_possible`, B
        above 1): where not, layouts go unchecked (README), and the log says so."""
        self._pending, self._calls, self._rows = {}, {}, {}
        if B < 2:
            return False
        uses: dict[int, int] = {}
        for c in calls:
            uses[id(c.entry)] = uses.get(id(c.entry), 0) + 1
        every = frozenset(params)
        unsure: dict[Layout, frozenset[str]] = {("<batch size>", B, ()): every}
        for c in calls:
            at = sizes_of_b(c, B)  # where the batch may be
            if len(at) > 1 or uses[id(c.entry)] > 1 or at[:1] not in ((), (0,)):
                key = (c.entry.name, uses[id(c.entry)], at if at != (0,) else ())
                unsure[key] = frozenset(c.entry.names.values())
                self._calls.setdefault(key, []).append(c)
        if self.checked and unsure.keys() <= self.checked and not due:
            self._calls = {}
            return False
        if not possible or foreign_backward_hooks(model, params):
            self._calls = {}
            self.unverified(unsure, "under FSDP or DDP(static_graph=True)" if not possible
                            else "parameters or modules carry backward hooks of yours")
            return False
        self._pending = {**unsure, ("", 0, ()): every}
        for c in (c for layout in self._calls.values() for c in layout):
            c.watched = True
        self._rows = _looked_up(calls, params)  # (read now: a check after the backward
        return True  # finds the calls' ids let go)

    def table_entries(self) -> dict[str, torch.Tensor]:
        """Flat entries of embedding tables in rows this backward's calls looked up, 8 per
        call, drawn at random when the check was wanted (:func:`_looked_up`), for the
        check to compare beside its own: those, half among a parameter's nonzero gradient
        entries, fall where another use fills it (a table tied to a head of 500 rows: the
        few rows looked up were missed, and a split read wrong passed, 0.85-1.8 off)."""
        rows, self._rows = self._rows, {}
        return rows

    def unverified(self, layouts: Iterable[Layout], why: str) -> None:
        """Log, once per layout, those that shapes alone cannot settle and no check has
        verified, on a step where none can run: their records are not checked."""
        for layout in layouts:
            if layout[0] in ("", "<batch size>") or layout in self.checked | self._told:
                continue
            self._told.add(layout)
            log.warning(
                "gradlog: %s's layout %s (a size of B beside the batch, or a module called "
                "more than once) is settled only by the datum check, and no check can run on "
                "this step (%s): its per-datum records here are unverified, and wrong if the "
                "batch was mistaken. Record one step with that layout without the cause, "
                "use a batch size unlike the model's other sizes, or use backend='loop'.",
                layout[0], layout[1:], why)

    def passed(self, datum: tuple[torch.Tensor, dict[str, tuple[Any, Any]]] | None
               ) -> frozenset[str] | None:
        """This backward's layouts are verified: those with a parameter whose gradient
        the passed check compared is not zero (the names returned). Where no check could run
        (``datum`` None: backward hooks of the user's, a reentrant checkpoint, autograd
        refused it), none is: that step goes unchecked (README), and the next one where a
        check runs checks them (a table as long as the batch, let be at a step with a
        backward hook, was 0.64 off at the next step, without one, unchecked)."""
        pending, calls, self._pending, self._calls = self._pending, self._calls, {}, {}
        self._rows = {}
        if datum is None:
            self.unverified(pending, "its extra backward could not run: a reentrant "
                            "checkpoint, or autograd Functions gradlog does not know")
            return None
        informative = frozenset(name for name, (_, theirs) in datum[1].items()
                                if theirs is not None and bool(theirs.any()))
        for layout, names in pending.items():
            own = calls.get(layout)  # (None: the batch size, the step's other layers)
            if names & informative and (own is None or calls_moved(own)):
                self.checked.add(layout)
                continue
            self._zeros[layout] = zeros = self._zeros.get(layout, 0) + 1
            if zeros == _ZEROS_NAMED and layout[0] not in ("", "<batch size>"):
                log.warning(
                    "gradlog: the datum check of %s's layout %s has compared only zero "
                    "gradients %d times (its parameters get none: a branch weighted 0, "
                    "unused rows); it verifies a layout only on gradients that are not zero, "
                    "so it runs again at every step with that layout (one extra backward "
                    "each) until they get one.", layout[0], layout[1:], zeros)
        return informative


def watch(call: Call, result: Mapping[str, Any]) -> None:
    """Whether what a watched call's rule gave (``result``: dense per-datum gradients,
    :class:`~gradlog.grads.Rows`, :class:`~gradlog.grads.Factors`, by attribute) is not all
    zero (:attr:`.calls.Call.moved`, a device bool read once, by
    :meth:`DatumLayouts.passed`): its output gradient is not enough, a layer on a zero
    input gets one and gives its weight none. Other calls: nothing."""
    if not call.watched:
        return
    flags = [_any(v) for v in result.values()]
    now = torch.stack([f.to(flags[0].device) for f in flags]).any() if flags else (
        torch.tensor(False))
    call.moved = now if call.moved is None else call.moved.to(now.device) | now


_HOT = 8  # entries per embedding call the datum check adds to its own (table_entries)
_PICK = torch.Generator().manual_seed(0)  # (its own: training's random streams stay)


def _looked_up(calls: Iterable[Call], params: Mapping[str, nn.Parameter]
               ) -> dict[str, torch.Tensor]:
    """8 flat entries per embedding call (the module, or ``F.embedding`` on a parameter
    itself) in rows its first argument looks up, drawn at random: parameter name -> flat
    indices. Not a subclass with a forward of its own (BART's and Whisper's positions take
    a shape and add an offset), nor a view or parametrization of the weight."""
    out: dict[str, torch.Tensor] = {}
    for c in calls:
        entry, args = c.entry, c.args or ()
        if entry.op != "embedding" and (
                entry.op or type(entry.module).forward is not nn.Embedding.forward
                or "forward" in vars(entry.module)):  # (one set on the instance)
            continue
        table: Any = args[1] if entry.op and len(args) > 1 else getattr(
            entry.module, "weight", None)
        name, ids = entry.names.get("weight", ""), args[0] if args else None
        if name not in params or table is not params[name]:
            continue
        if not isinstance(ids, torch.Tensor) or not ids.numel() or ids.is_floating_point():
            continue
        w: torch.Tensor = params[name]
        if not w.numel():
            continue
        ids = ids.reshape(-1).clamp(0, w.shape[0] - 1)  # (ids changed since: in the table)
        at = torch.randint(ids.numel(), (_HOT,), generator=_PICK).to(ids.device)
        col = torch.randint(max(1, w[0].numel()), (_HOT,), generator=_PICK)
        index = ids[at].to(w.device).long() * w[0].numel() + col.to(w.device)
        out[name] = torch.cat([out[name], index]) if name in out else index
    return out


def _any(material: Any) -> torch.Tensor:
    if isinstance(material, torch.Tensor):
        return material.any()
    if isinstance(material, Rows):
        return material.values.any()
    if isinstance(material, Factors):
        g, a = material.held
        return g.any() & a.any()  # (nonzero factors of every datum: a nonzero product)
    return dense(material).any()


def foreign_backward_hooks(model: nn.Module, params: Mapping[str, nn.Parameter]) -> bool:
    """Backward hooks of the user's own (on parameters or modules) would fire again in
    the datum check's extra backward, with side effects (gradient statistics): then no
    check. (Hooks on activations cannot be seen; README says so.)"""
    recorded = {id(p) for p in params.values()}
    for p in model.parameters():
        if tensor_hook_count(p) > (1 if id(p) in recorded else 0):
            return True
    if global_module_backward_hooks_on():
        return True
    return any(module_has_backward_hooks(m) for m in model.modules())


HOOK_KINDS = ("none", "checkpoint", "selective", "other")
"""Saved-tensor hooks a forward's calls ran under (:func:`gradlog._torch_private.
saved_tensor_hooks_kind`), from harmless to unknown; a forward counts as its last kind."""


def datum_check_possible(model: nn.Module) -> bool:
    """Whether the datum check's ``autograd.grad`` leaves training as it was: in one process;
    under torch.distributed for DDP without ``static_graph`` (its reducer hooks gradient
    accumulators, which ``autograd.grad`` does not run: p.grad stays the ranks' mean, as
    measured); ``static_graph``'s first backward queues an all-reduce the check would run,
    FSDP gathers and reduce-scatters in every backward."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return True
    ddp = torch.nn.parallel.DistributedDataParallel
    return isinstance(model, ddp) and not getattr(model, "static_graph", False)


def datum_check_mode(losses: torch.Tensor, batch_loss: torch.Tensor,
                     params: Mapping[str, nn.Parameter],
                     saved_tensor_hooks: str) -> tuple[str | None, bool]:
    """When the datum's own backward runs, and whether the graph holds autograd Functions
    gradlog does not know.

    ``"before"`` the batch's (then freed before the batch's backward allocates its per-datum
    gradients: no extra peak memory), or ``"after"`` it, on the kept graph, when a backward
    may use up state or draw random numbers (an autograd Function of the user's or a
    library's, selective activation checkpointing, saved-tensor hooks gradlog does not
    know): the batch's backward then runs first, exactly as without gradlog, and the check
    is skipped if autograd refuses the second backward. The datum's backward then runs
    while the per-datum gradients are held, so its own peak adds to the step's. Plain
    non-reentrant checkpointing (``saved_tensor_hooks == "checkpoint"``) recomputes its
    segments for every backward and restores their random state, so its check runs
    before (issue 20: it ran after, and step 1 peaked at 2.9x a plain step). None: no
    check (a reentrant checkpoint refuses ``autograd.grad``); the flag is then False.
    """
    if losses.grad_fn is None or not any(p.numel() for p in params.values()):
        return None, False
    foreign = foreign_functions(batch_loss.grad_fn)
    if foreign is None or (foreign and torch.distributed.is_available()
                           and torch.distributed.is_initialized()):
        return None, False  # (an unknown Function may talk to the other ranks: no check)
    late = foreign or saved_tensor_hooks in ("selective", "other")
    return ("after" if late else "before"), foreign


def probe(losses: torch.Tensor, params: Mapping[str, nn.Parameter],
          generator: torch.Generator, devices: list[int], rng: dict[str, torch.Tensor] | None,
          keep_graph: bool, layouts: DatumLayouts | None = None
          ) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """``autograd.grad(sum_b v_b losses[b])``, ``v ~ N(0, 1)``, at a few random entries per
    parameter (None: autograd refused; no check); see :func:`check_datum`. The global RNG
    is forked and set to ``rng``: the backward's random draws repeat. ``layouts`` adds
    entries in the rows its embedding calls looked up (:meth:`DatumLayouts.table_entries`)."""
    names = [n for n, p in params.items() if p.numel()]
    v = torch.randn(losses.shape[0], generator=generator, dtype=torch.float64)
    try:
        with forked_rng(devices, rng):
            weighted = (losses * v.to(losses.device, losses.dtype)).sum()
            got = torch.autograd.grad(weighted, [params[n] for n in names],
                                      retain_graph=keep_graph, allow_unused=True)
    except Exception as e:  # selective checkpointing ("backward an extra time"), a
        # Function whose backward uses up its state: no check (p.grad is unaffected)
        log.debug("gradlog: datum check skipped (%s: %s)", type(e).__name__, e)
        return None
    sampled = sample_entries(names, got, params, generator)
    extra = layouts.table_entries() if layouts is not None else {}
    for name, grad in zip(names, got, strict=True):
        if name in extra and grad is not None:
            at, theirs = sampled[name]
            index = extra[name].to(at.device)
            sampled[name] = (torch.cat([at, index]), torch.cat([theirs, torch.take(grad, index)]))
    k = max((len(at) for at, _ in sampled.values()), default=0)
    for name, (at, theirs) in sampled.items():  # (as many for each: check_datum's k)
        if len(at) < k:
            again = torch.arange(k - len(at), device=at.device) % len(at)
            sampled[name] = (torch.cat([at, at[again]]), None if theirs is None else
                             torch.cat([theirs, theirs[again.to(theirs.device)]]))
    return v, sampled


def sample_entries(names: list[str], got: Sequence[torch.Tensor | None],
                   params: Mapping[str, nn.Parameter],
                   generator: torch.Generator) -> dict[str, tuple[Any, Any]]:
    """The datum's own gradients ``got`` (one per name; None: unused) at a few random entries
    per parameter, half of them among its nonzero ones (a sparse gradient, an embedding's
    rows of the batch's tokens, is zero on both sides at most random entries: a wrong split
    passed there): name -> (flat indices, values or None)."""
    sampled: dict[str, tuple[Any, Any]] = {}
    half = _DATUM_ENTRIES // 2
    for name, grad in zip(names, got):
        p = params[name]
        index = torch.randint(p.numel(), (_DATUM_ENTRIES,), generator=generator)
        index = index.to(p.device)
        if grad is not None:
            nonzero = torch.nonzero(grad.reshape(-1)).squeeze(1)  # (a device sync)
            if nonzero.numel():
                pick = torch.randint(nonzero.numel(), (half,), generator=generator)
                index[:half] = nonzero[pick.to(nonzero.device)]
        sampled[name] = (index, None if grad is None else torch.take(grad, index))
    return sampled


def check_datum(datum: tuple[torch.Tensor, dict[str, tuple[Any, Any]]],
                records: Mapping[str, Any], params: Mapping[str, nn.Parameter],
                narrow: Iterable[torch.dtype], *, trusted: bool = True,
                required: bool = False, loss_scaled: bool = False,
                rerun: Mapping[str, str] | None = None,
                own: frozenset[str] = frozenset()) -> None:
    """The records weighted by random ``v`` (``sum_b v_b g_b``) against autograd's gradient
    of ``sum_b v_b losses[b]`` at the sampled entries. Every datum is checked at once: a
    split between datums that keeps their sum (the spot check's blind spot: two datums'
    gradients swapped, a share moved) changes the weighted sum, and so does a loss that
    couples the datums. Not ``trusted`` (the graph holds autograd Functions gradlog does
    not know, whose second backward may differ: state used up, gradients scaled in
    place): a warning, not an error.

    Args:
        datum: ``v`` ``(B,)`` float64 and :func:`sample_entries`' result.
        records: The backward's per-datum gradients or materials, by name.
        params: The recorded parameters, by name.
        narrow: Autocast dtypes the backward ran in. Under autocast the check's own
            backward runs in the narrow dtype through every layer it crosses, recorded or
            not: one tolerance for all.
        trusted: Whether a mismatch is an error (else a warning).
        required: A mismatch is an error even if not ``trusted``: layers on the batch's
            tokens flattened to rows (:class:`.rows.RowLayouts`) are recorded only once
            this check passes.
        loss_scaled: Whether the batch's backward carried a loss scale (a GradScaler's) that
            the check's own unscaled backward does not: records that overflowed under it
            (a step the scaler skips) are not compared.
        own: Parameters whose split is what this check verifies (outputs an expand or a
            repeat copies over the batch): compared with a floor of their own largest
            entry, not the model's (:func:`.checks.over_tolerance`).
    """
    v, sampled = datum
    names, ours, theirs, scales = list(sampled), [], [], []
    if not names:
        return  # (every recorded parameter has size 0)
    for name in names:
        index, theirs_k = sampled[name]
        rows = entries(records[name], index).to(torch.float64)  # (B, k)
        w = v.to(rows.device)[:, None]  # (B, 1)
        ours.append((w * rows).sum(0))  # (k,)
        scales.append((w.abs() * rows.abs()).sum(0))  # (k,)
        theirs.append(torch.zeros_like(ours[-1]) if theirs_k is None
                      else theirs_k.to(rows.device, torch.float64))  # (k,)
    narrow = list(narrow)
    rtol, atol = check_tolerance((params[n].dtype for n in names),
                                 [max(narrow, key=lambda d: torch.finfo(d).eps)]
                                 if narrow else ())
    device = ours[0].device
    a, c = (torch.stack([t.to(device) for t in ts]).reshape(-1) for ts in (ours, theirs))
    scale = torch.stack([t.to(device) for t in scales]).reshape(-1) + c.abs()
    eps = max(torch.finfo(t).eps for t in (*narrow, *(params[n].dtype for n in names))
              if t.is_floating_point)
    bad = over_tolerance(names, a, c, scale, rtol, atol, "datum check",
                          compare_non_finite=not loss_scaled, own=own, eps=eps).bad()
    if bad and not trusted and not required:
        warnings.warn(
            f"gradlog's datum check: the per-datum gradients of {bad[:6]}, weighted by random "
            "v_b and summed, differ from autograd's gradient of sum_b v_b losses[b]. The "
            "graph holds autograd Functions gradlog does not know, whose second backward "
            "may differ from the first, so this may be a false alarm; if one datum's loss "
            "depends on other datums, or a layer runs sequence-first with sequence length "
            "equal to the batch size, the records are wrong: compare with backend='loop'.",
            stacklevel=6,  # the caller of GradRecorder.backward
        )
        return
    if bad:
        raise BackendError(
            f"the per-datum gradients of {bad[:6]} differ from the datums' own gradients "
            "(weighted by random v_b and summed, against autograd.grad of sum_b v_b "
            "losses[b]), though their plain sum may match p.grad. Likely causes: (1) one "
            "datum's loss depends on the other datums of the batch (in-batch negatives of a "
            "contrastive loss, a loss normalised over the batch): the hooks backend then "
            "gives each datum's share of the batch gradient, not d losses[b] / d theta; (2) "
            "a layer ran on a layout where gradlog mistook the batch dimension (a "
            "sequence-first tensor whose sequence length equals the batch size, a layer "
            "called once per datum by hand, a batch the forward takes in another order: "
            "h[order], sorted by length); (3) a rule that assigns gradient to the wrong "
            "datum (please report it). p.grad is complete; nothing of this step was "
            "recorded. Use backend='loop', for (2) a batch size different from the "
            "sequence length or the batch reordered before the model."
            + rerun_hint(bad, rerun or {}) + _float32_hint(names, a, c, scale, params)
            + ("" if trusted else _UNTRUSTED_HINT)
        )


_UNTRUSTED_HINT = (
    " The graph also holds autograd Functions gradlog does not know, whose second backward "
    "(this check's) may differ from the first, so this may be a false alarm; but layers ran "
    "on the batch's tokens flattened to rows, whose split into datums only this check "
    "verifies, so the step is refused.")


def _float32_hint(names: list[str], a: torch.Tensor, c: torch.Tensor, scale: torch.Tensor,
                  params: Mapping[str, nn.Parameter]) -> str:
    """Why a float64 model's deviations that float32's tolerance allows occur."""
    rtol, atol = check_tolerance([torch.float32])
    if any(params[n].dtype != torch.float64 for n in names) or over_tolerance(
            names, a, c, scale, rtol, atol, "").bad():
        return ""
    return (" Here every deviation is within float32's rounding: a float64 model computing "
            "steps in float32 (transformers' softmax, routers, norms) rounds its gradients "
            "so; train it in float32, or pass check_every=0.")
