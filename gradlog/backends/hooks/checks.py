"""The hooks backend's checks that per-datum gradients are right.

Four checks, cheapest first: inputs modified in place after a call used them
(:func:`check_versions`); parameters that got a gradient no hooked call saw
(:func:`check_coverage`); on every backward, ``sum_b w_b g_b`` against autograd's gradient at a
few random entries per parameter (:class:`SpotCheck`); and on the first backward of each new
layout and batch size, the datum check (:mod:`.datum_check`). Tolerances:
:func:`.base.check_tolerance`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradlog._torch_private import (
    forward_hooks_first,
    tensor_version,
)
from gradlog.backends.base import check_floor, check_tolerance
from gradlog.backends.hooks.calls import Call, Entry
from gradlog.backends.hooks.parametrized import mode_refusal
from gradlog.errors import BackendError, GradlogError, UnsupportedLayerError
from gradlog.grads import Factors, entries
from gradlog.rules import active_randomness
from gradlog.rules.state import batched_attributes, batched_in_caches

__all__ = [
    "SpotCheck",
    "Verdict",
    "check_coverage",
    "check_versions",
    "over_tolerance",
    "raise_kept_error",
    "refuse_double_backward",
]

_SPOT_ENTRIES = 4  # entries per parameter compared with autograd's gradient on every backward


class SpotCheck:
    """``sum_b w_b g_b`` against the parameter's gradient in this backward, at a few random
    entries per parameter: catches uses the hooks did not see (a parameter also used by
    hand in a parent's forward) on every step, for the cost of reading B x k numbers and
    one device sync (:meth:`settle`, which the recorder defers until the step is encoded).
    The recorder's full self-check runs every ``check_every`` steps.

    Args:
        params: The recorded parameters, by name.
        generator: Draws the entries (never the global RNG: training's).
    """

    def __init__(self, params: Mapping[str, nn.Parameter], generator: torch.Generator) -> None:
        self.params = params
        self.generator = generator
        self.total: dict[str, torch.Tensor] = {}
        self.index: dict[str, torch.Tensor] = {}
        self.cells: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # 2-D: (rows, cols)
        self.full = False  # this backward compares every entry
        self.pending: Verdict | None = None  # the last check's, until settled
        self._layout: tuple[tuple[torch.Size, torch.device], ...] = ()  # (_lay_out's)
        self._sizes = torch.empty(0, 1, dtype=torch.float64)  # their sizes, as a tensor
        self._widths = torch.ones(0, 1, dtype=torch.long)  # and rows' widths (2-D)
        self._uniform = torch.empty(0, _SPOT_ENTRIES, dtype=torch.float64)  # a draw's
        self._drawn = torch.empty(3, 0, _SPOT_ENTRIES, dtype=torch.long)  # its entries
        self._on: list[torch.Tensor] = []  # _drawn, and a copy per other device
        self._index: dict[str, torch.Tensor] = {}  # views of those, per parameter
        self._cells: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rerun: dict[str, str] = {}  # parameters re-run per datum: name -> module label

    def draw(self, batch_size: int, full: bool = False) -> None:
        """Forget the last backward's entries; for a batch (``batch_size`` > 0), draw new:
        ``full``, every entry (a forward whose free uses went unwatched, see
        :mod:`.operations`)."""
        self.total = {}
        self.index = {}
        self.cells = {}
        self.full = full and batch_size > 0
        if self.full:
            self.index = {n: torch.arange(p.numel(), device=p.device)
                          for n, p in self.params.items() if p.numel()}
        elif batch_size and self.params:
            layout = tuple((p.shape, p.device) for p in self.params.values())
            if layout != self._layout:
                self._lay_out(layout)
            # drawn in place into the buffers the parameters' views look at: a step makes no
            # new tensor per parameter (~1 ms of host work a step at GPT-2 small's depth)
            torch.rand(self._uniform.shape, generator=self.generator, dtype=torch.float64,
                       out=self._uniform)
            flat, rows, cols = self._drawn.unbind(0)  # (n_params, k) each
            flat.copy_(self._uniform.mul_(self._sizes))  # (truncated: entries below size)
            torch.div(flat, self._widths, rounding_mode="floor", out=rows)
            torch.remainder(flat, self._widths, out=cols)
            for on in self._on:
                if on is not self._drawn:
                    on.copy_(self._drawn, non_blocking=True)
            self.index, self.cells = self._index, self._cells

    def _lay_out(self, layout: tuple[tuple[torch.Size, torch.device], ...]) -> None:
        """The buffers a draw fills, one ``(3, n_params, k)`` (flat entries, their rows and
        columns in 2-D parameters) per device, and each parameter's views of its own."""
        self._layout = layout
        shapes = [shape for shape, _ in layout]
        self._sizes = torch.tensor([s.numel() for s in shapes],
                                   dtype=torch.float64).unsqueeze(1)  # (n, 1)
        self._widths = torch.tensor([s[1] if len(s) == 2 and s[1] else 1
                                     for s in shapes]).unsqueeze(1)  # (n, 1)
        self._uniform = torch.empty(len(shapes), _SPOT_ENTRIES, dtype=torch.float64)
        self._drawn = torch.empty(3, len(shapes), _SPOT_ENTRIES, dtype=torch.long)
        on = {torch.device("cpu"): self._drawn}
        for p in self.params.values():
            if p.device not in on:
                on[p.device] = torch.empty_like(self._drawn, device=p.device)
        self._on = list(on.values())
        self._index, self._cells = {}, {}
        for i, (n, p) in enumerate(self.params.items()):
            if p.numel():
                flat, rows, cols = on[p.device][:, i]  # each (k,)
                self._index[n] = flat
                if p.dim() == 2:
                    self._cells[n] = (rows, cols)

    def observe(self, name: str, grad: torch.Tensor) -> None:
        """A few entries of this backward's gradient of the parameter (summed over its
        uses), to check against the per-datum gradients."""
        index = self.index.get(name)
        if index is not None and not grad.is_sparse:
            seen = torch.take(grad.detach() if grad.requires_grad else grad, index)  # (k,)
            prior = self.total.get(name)
            self.total[name] = seen if prior is None else prior + seen

    def settle(self) -> bool:
        """Raise if the last :meth:`check` found records that do not add up; True when it
        read one that passed (each is read once)."""
        verdict, self.pending = self.pending, None
        if verdict is not None:
            verdict.settle(self.rerun)
        return verdict is not None

    def check(self, records: Mapping[str, Any], low_precision: Mapping[str, torch.dtype],
              weight: float) -> None:
        """Compare; the outcome is :attr:`pending` until :meth:`settle` reads it (nothing
        here waits for the device)."""
        self.pending = self._compare(records, low_precision, weight)

    def _compare(self, records: Mapping[str, Any], low_precision: Mapping[str, torch.dtype],
                 weight: float) -> Verdict | None:
        """Whether the records of each parameter, weighted, add up to its gradient (None:
        nothing to compare).

        Args:
            records: Per-datum gradients or materials, by parameter name.
            low_precision: Parameters whose gradient autograd rounded (autocast), to dtype.
            weight: ``w_b`` (1/B for a mean batch loss).
        """
        if self.full:
            return self._check_all(records, low_precision, weight)
        names, rows, totals = [], [], []
        # factor records' entries as grads.entries takes them, their columns stacked per
        # group of one (B, N), scale and dtypes: one product and sum a group, not one a record
        scaled: dict[Any, tuple[list[str], list[torch.Tensor], list[torch.Tensor],
                                list[torch.Tensor]]] = {}
        for name, total in self.total.items():
            acc = records.get(name)
            if acc is None:  # (no contribution at all: check_coverage reported it)
                continue
            cells = self.cells.get(name)
            if (isinstance(acc, Factors) and acc.mask is None and cells is not None
                    and acc.shape == self.params[name].shape):
                g, a = acc.held  # (16-bit factors: the columns picked, then widened)
                key = (acc.scale, acc.dtype, g.dtype, a.dtype, g.shape[:2], g.device)
                group = scaled.setdefault(key, ([], [], [], []))
                group[0].append(name)
                group[1].append(g.index_select(2, cells[0]))  # (B, N, k)
                group[2].append(a.index_select(2, cells[1]))  # (B, N, k)
                group[3].append(total)
                continue
            names.append(name)
            rows.append(entries(acc, self.index[name]))  # (B, k)
            totals.append(total)  # (k,)
        for (scale, dtype, *_), (group_names, gs, as_, group_totals) in scaled.items():
            gk, ak = (torch.cat(gs, 2), torch.cat(as_, 2)) if len(gs) > 1 else (gs[0], as_[0])
            gk = gk if gk.dtype == dtype else gk.to(dtype)
            ak = ak if ak.dtype == dtype else ak.to(dtype)
            picked = gk.mul_(ak).sum(1)  # (B, k per name) (gk: index_select's own tensor)
            names += group_names
            rows.append(picked * scale if scale != 1.0 else picked)
            totals += group_totals
        if not names:
            return None
        if len({(r.dtype, r.device) for r in rows + totals}) > 1:  # cat needs one kind
            rows = [r.to(torch.float64) for r in rows]
            totals = [t.to(torch.float64) for t in totals]
        dtypes = [self.params[n].dtype for n in names]
        narrow = [low_precision[n] for n in names if n in low_precision]
        rtol, atol = check_tolerance(dtypes, narrow)
        ours = torch.cat(rows, 1).to(torch.float64)  # (B, n*k)
        total = torch.cat(totals).to(torch.float64)  # (n*k,)
        scale = ours.abs().sum(0) * weight + total.abs()  # (n*k,)
        return over_tolerance(names, ours.sum(0) * weight, total, scale, rtol, atol,
                               "spot check of a few entries",
                               floor_rtol=check_floor(dtypes, narrow))

    def _check_all(self, records: Mapping[str, Any], low_precision: Mapping[str, torch.dtype],
                   weight: float) -> Verdict | None:
        """:meth:`check` at every entry, a block of entries at a time (B x 2^20 float64)."""
        names = [n for n in self.total if records.get(n) is not None]
        if not names:
            return None
        dtypes = [self.params[n].dtype for n in names]
        narrow = [low_precision[n] for n in names if n in low_precision]
        rtol, atol = check_tolerance(dtypes, narrow)
        worst, largest = [], []  # per name: max(gap - rtol scale), max(scale)
        for name in names:
            index, total = self.index[name], self.total[name].to(torch.float64)
            w, m = [], []
            for part in range(0, index.numel(), 1 << 20):
                at = slice(part, part + (1 << 20))
                ours = entries(records[name], index[at]).to(torch.float64)  # (B, block)
                summed, theirs = ours.sum(0) * weight, total[at]
                scale = ours.abs().sum(0) * weight + theirs.abs()
                finite = summed.isfinite() & theirs.isfinite()
                over = torch.where(finite, (summed - theirs).abs() - rtol * scale,
                                   _non_finite_verdict(theirs))
                w.append(over.amax())
                m.append(torch.where(finite, scale, 0).amax())
            worst.append(torch.stack(w).amax())
            largest.append(torch.stack(m).amax())
        floor = check_floor(dtypes, narrow) * torch.stack(largest).amax()
        over = torch.stack(worst) - floor - atol  # (n,)
        return Verdict(names, over, "every entry, on a forward whose op-level uses went "
                       "unwatched", _WATCH_HINT)


class Verdict:
    """A check's outcome still on the device: per parameter, by how much its records miss
    the tolerance (> 0: they do not add up). :meth:`settle` reads it, the one wait for the
    device; the recorder settles after encoding the step, so that the step's device work is
    queued by then and the host does not sit idle in between (on an H200, ~40 ms of a
    GPT-2 small step went to host work done after an earlier wait)."""

    __slots__ = ("hint", "how", "names", "over")

    def __init__(self, names: list[str], over: torch.Tensor, how: str, hint: str = "") -> None:
        self.names, self.over, self.how, self.hint = names, over, how, hint

    def bad(self) -> list[str]:
        """The parameters whose records miss the tolerance (waits for the device)."""
        return [n for n, g in zip(self.names, self.over.tolist()) if g > 0]

    def settle(self, rerun: Mapping[str, str] | None = None) -> None:
        """Raise :class:`BackendError` naming the parameters whose records do not add up
        (``rerun``: :func:`rerun_hint`'s)."""
        bad = self.bad()
        if bad:
            raise BackendError(_not_adding_up(bad, self.how) + self.hint
                               + rerun_hint(bad, rerun or {}))


def refuse_compiled_in_place(model: nn.Module) -> None:
    """Refuse a model compiled in place: dynamo would compile gradlog's hooks with it."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise UnsupportedLayerError(
            "the model was compiled in place (model.compile()), which compiles gradlog's "
            "hooks with it: dynamo would trace them and recompile at every step. Use "
            "torch.compile(model), a wrapper whose recorded forwards gradlog runs "
            "eagerly and which records exactly what the eager model records.")


def rerun_hint(bad: Iterable[str], rerun: Mapping[str, str]) -> str:
    """For failed checks: which of the ``bad`` parameters come from re-running their module
    per datum (the ``torch.func`` fallback, ``rerun``: name -> module), and when such a
    re-run is wrong."""
    modules = sorted({rerun[n] for n in bad if n in rerun})
    if not modules:
        return ""
    return (f" Of those, some are computed by re-running their module per datum with "
            f"torch.func ({', '.join(modules[:3])}): that re-run is wrong when the module takes "
            "a tensor shared by the batch whose first dimension equals the batch size (it is "
            "split as if it held one row per datum) or reads state beyond its arguments. A "
            "batch size different from such sizes, a rule for the module "
            "(gradlog.rules.register_rule) or backend='loop' avoids it.")


_WATCH_HINT = (
    " That forward was not watched for op-level uses: gradlog watches every torch op of "
    "the first forwards, then only when the model has used a parameter outside its "
    "modules or the set of module calls changes (a TorchFunctionMode costs ~3% of a "
    "small model's step). The next forward is watched; to watch every forward, pass "
    "GradRecorder(..., watch_ops='always').")


def _not_adding_up(bad: list[str], how: str) -> str:
    return (
        f"the per-datum gradients of {bad} do not add up to their gradient in this "
        f"backward ({how}: sum_b w_b g_b != the gradient autograd accumulated, or NaN/inf "
        "where that gradient is finite): part of "
        "their use was not seen by gradlog, e.g. a parameter also used outside the model's "
        "forward (in the loss code: op-level capture sees only the root module's forward; "
        "a torch.compile'd model called through a method other than forward runs its inner "
        "module's forward unwatched), or a rule is wrong. p.grad is complete. Move that use "
        "into the model's forward (call the compiled module itself), or use backend='loop'.")


def over_tolerance(names: list[str], ours: torch.Tensor, theirs: torch.Tensor,
                    scale: torch.Tensor, rtol: float, atol: float, how: str, *,
                    compare_non_finite: bool = True, floor_rtol: float | None = None,
                    own: frozenset[str] = frozenset(), eps: float = 0.0) -> Verdict:
    """Whether the names' entries (``ours``, ``theirs`` and ``scale`` hold k per name, in
    order) differ by more than the tolerance. Floor: a parameter whose true gradient is 0 (a
    key bias under softmax) holds only rounding noise, so the tolerance also allows
    ``floor_rtol`` (default ``rtol``; the spot check's: :func:`check_floor`, not autocast's
    inflated ``rtol``, which let records off by 1.5x pass) of the largest gradient seen;
    for the names in ``own``, of their own largest (a split of DeBERTa's relative positions,
    whose gradients are 1e-8 of the model's, is compared all the same: the datum check),
    but never below ``eps`` (the parameters' dtype's) of the largest gradient seen: what is
    smaller than the model's own rounding cannot be told from it (a float32 T5's relative
    bias at T == B, 1e-7 of the model's gradients, was refused at every such step, its
    records right to 8e-8)."""
    finite = ours.isfinite() & theirs.isfinite()
    seen = torch.where(finite, scale, 0)
    floor = seen.amax() * (rtol if floor_rtol is None else floor_rtol)
    if own:
        per_name = seen.reshape(len(names), -1)
        mine = torch.tensor([n in own for n in names], device=seen.device)[:, None]
        floor = torch.where(mine, (per_name.amax(1, keepdim=True) * (
            rtol if floor_rtol is None else floor_rtol)).clamp_min(seen.amax() * eps),
            floor).expand_as(per_name).reshape(-1)
    elsewhere = (_non_finite_verdict(theirs) if compare_non_finite
                 else torch.full_like(theirs, -torch.inf))
    over = torch.where(finite, (ours - theirs).abs() - rtol * scale - floor - atol,
                       elsewhere)  # (n*k,) > 0: does not add up
    return Verdict(names, over.reshape(len(names), -1).amax(1), how)  # (n,)


def _non_finite_verdict(theirs: torch.Tensor) -> torch.Tensor:
    """Where ours or autograd's entry is NaN or inf: records that are not finite where
    autograd's gradient is fail (+inf: a NaN compared passes every ``>`` test, so a rule
    that made one would go unseen); where autograd's own is not finite (an overflow a loss
    scaler skips, a NaN the model made) there is nothing to compare (-inf)."""
    return torch.where(theirs.isfinite(), torch.inf, -torch.inf).to(theirs.dtype)


def refusal(entry: Entry, module: nn.Module, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> str | None:
    """Why the entry's rule cannot compute this call (asked at capture time, so the backend
    refuses before ``p.grad`` is touched rather than after the backward), or None."""
    rule = entry.rule
    reason = rule.refuse(module, args, kwargs) if rule.refuse is not None else None
    if reason is None and entry.plists:
        reason = mode_refusal(entry.plists)
    if reason is None and rule.uses_torch_func:
        noisy = active_randomness(module)
        if noisy:
            reason = (
                f"it draws dropout masks in training mode (in {noisy}) and rule "
                f"{rule.name!r} re-runs it per datum, which cannot reproduce the batch's "
                "masks. Set that dropout to 0 or put the module in eval mode (the rest of "
                "the model may stay in training mode), register a closed-form rule "
                "(gradlog.rules.register_rule), or use backend='loop'."
            )
    return reason


class HookOrder:
    """Keeps the capture's forward hook before the user's on each recorded module (behind
    ``gradlog.sparse``'s, which re-root the output): a user's hook prepended after the
    recorder attached ran before it, and one replacing the output made gradlog hook the
    replacement, whose gradient is not the layer's own (with ``batch_grad="sum"`` its
    ``p.grad`` too). The capture is put back at each call; a hook that still ran before it
    (registered during the call, or before ``gradlog.sparse``'s) refuses the call; one that
    removed itself before gradlog's ran is not seen. Global
    forward hooks (``register_module_forward_hook``) run before every module's own, so
    gradlog cannot go first: each is named once, in a warning."""

    def __init__(self) -> None:
        self.said: set[int] = set()

    @staticmethod
    def first(hook: Any) -> Any:
        """``hook`` (a ``functools.partial``) marked as the capture (``forward_hooks_first``)."""
        hook.gradlog_first = 2
        return hook

    def enter(self, module: nn.Module, args: Any) -> None:
        """A forward pre-hook, after the user's (they may register forward hooks): the
        capture put back first."""
        forward_hooks_first(module)

    def refusal(self, module: nn.Module) -> str | None:
        """In the capture, before anything: why the output it got may not be the module's
        own (None: it is, as far as gradlog can tell)."""
        before, hooks = forward_hooks_first(module)
        for hook in hooks:
            if id(hook) not in self.said:
                self.said.add(id(hook))
                warnings.warn(
                    f"a global module forward hook ({getattr(hook, '__qualname__', hook)!r}, "
                    "torch.nn.modules.module.register_module_forward_hook) runs before "
                    "gradlog's on every module: if it returns a replaced output of a "
                    "recorded module, gradlog records the replacement's gradient, not the "
                    "layer's own, and only large edits are caught. Register it on the "
                    "modules instead (gradlog's hook then runs first), or remove it while "
                    "recording; one that only reads outputs is harmless.",
                    stacklevel=2,
                )
        if all(getattr(h, "gradlog_first", 0) == 1 for h in before):
            return None
        return ("a forward hook of yours ran before gradlog's on it (registered during the "
                "call, e.g. in a forward pre-hook, or prepended before gradlog.sparse's), so "
                "the output gradlog got may not be the layer's own. Register forward hooks "
                "outside the forward, and before entering gradlog.sparse, or use "
                "backend='loop'.")


class InputWrites:
    """Whether a module re-run per datum wrote into an input in place during its forward
    (timm's ``LayerScale(inplace=True)``: ``x.mul_(gamma)``): its captured input then holds
    what the forward made of it, not what it took, and a re-run from it computes another
    function, consistently, so no later check sees it. Such calls are refused."""

    def __init__(self) -> None:
        self.open: dict[int, list[list[tuple[torch.Tensor, int]]]] = {}  # id(entry) -> calls
        self.pending: dict[int, bool] = {}  # id(entry) -> its last call wrote into an input

    def enter(self, entry: Entry, args: tuple[Any, ...]) -> None:
        if entry.rule.uses_torch_func:
            self.open.setdefault(id(entry), []).append(
                [(t, tensor_version(t)) for t in args if isinstance(t, torch.Tensor)])

    def leave(self, entry: Entry) -> None:
        if entry.rule.uses_torch_func and self.open.get(id(entry)):
            seen = self.open[id(entry)].pop()
            self.pending[id(entry)] = any(tensor_version(t) != v for t, v in seen)

    def refusal(self, entry: Entry) -> str | None:
        """Why the call that just returned cannot be re-run (None: it can)."""
        if not self.pending.pop(id(entry), False):
            return None
        return ("its forward writes into its input in place, so the input gradlog captured "
                "is what the forward made of it, and a re-run per datum (it has no rule) "
                "would compute another function. Use an out-of-place version (timm's "
                "LayerScale(inplace=False)), register a rule for it, or use backend='loop'.")


def refuse_double_backward(calls: Iterable[Call]) -> None:
    """Refuse a loss that differentiates a gradient taken through a hooked call."""
    twice = {c.entry.label for c in calls if c.twice and not c.done}
    if twice:
        raise UnsupportedLayerError(
            f"the loss differentiates a gradient taken through {sorted(twice)} "
            "(autograd.grad(..., create_graph=True) before the backward, e.g. a gradient "
            "penalty): its per-datum gradients include second-order terms that the hooks "
            "backend's per-layer rules do not see. Nothing was computed; p.grad is "
            "untouched. Use backend='loop' for this loss."
        )


def check_versions(call: Call) -> None:
    """Refuse a call whose input was modified in place after the call used it."""
    for t, version in call.versions:
        now = tensor_version(t)
        if now != version:
            raise BackendError(
                f"an input of {call.entry.label} was modified in place after the module "
                f"used it (tensor version {version} -> {now}), so its per-datum "
                "gradients would use the changed values. Avoid the in-place op on that "
                "input (e.g. an inplace activation after it), or use backend='loop'."
            )


def check_state(call: Call, batch_size: int) -> None:
    """Refuse a ``torch.func`` re-run of a call handed a cache that holds batched state
    (:mod:`gradlog.rules.state`): the re-run would read the batch's state, not a datum's."""
    if call.args is None or call.kwargs is None or not call.entry.rule.uses_torch_func:
        return
    where = batched_in_caches(call.args, call.kwargs, batch_size)
    if where is not None:
        raise UnsupportedLayerError(
            f"it was handed a cache holding state of the batch ({where}): gradlog re-runs "
            "this module per datum (it has no closed-form rule), and the re-run would read "
            "the whole batch's state (a state the forward wrote: continue from it) where "
            "the forward read none or a datum's. Train without the cache (transformers: "
            "model(..., use_cache=False)), register a rule for the module "
            "(gradlog.rules.register_rule), or use backend='loop'."
        )


def explain_state(entry: Entry, error: Exception, batch_size: int) -> Exception:
    """``error`` of a ``torch.func`` re-run, explained when the module keeps batched state on
    itself (its re-run per datum reads the batch's): an :class:`UnsupportedLayerError`."""
    if isinstance(error, GradlogError) or not entry.rule.uses_torch_func:
        return error
    held = batched_attributes(entry.module, batch_size)
    if not held:
        return error
    explained = UnsupportedLayerError(
        f"its re-run per datum (it has no closed-form rule) failed ({type(error).__name__}: "
        f"{error}); the module keeps state of the batch on itself ({', '.join(held[:3])}), "
        "which a re-run of one datum reads. Train without that state (a recurrent or cache "
        "state: use_cache=False in transformers), register a rule for the module "
        "(gradlog.rules.register_rule), or use backend='loop'.")
    explained.__cause__ = error
    return explained


def raise_kept_error(error: tuple[Entry, BaseException] | None) -> None:
    """Raise the error a rule raised inside the backward (kept until ``p.grad`` was
    complete), naming the module and rule."""
    if error is None:
        return
    entry, e = error
    where = (f"gradlog could not compute per-datum gradients of {entry.label} "
             f"(rule {entry.rule.name!r}): ")
    if isinstance(e, GradlogError):
        raise type(e)(where + str(e)) from e
    raise BackendError(
        where + f"{type(e).__name__}: {e}. p.grad is complete (the ordinary backward ran); "
        "use backend='loop' for this model and please report this."
    ) from e


def check_coverage(params: Iterable[str], got_grad: set[str], covered: set[str],
                   entries_: Sequence[Entry], ops: Any = None) -> None:
    """Refuse parameters that received a gradient though no hooked call used them
    (``ops``: the op-level capture, :class:`.operations.OpCapture`, or None)."""
    written = sorted(set(got_grad) & (ops.written if ops is not None else set()))
    if written:  # (its other uses may be covered: a tied head; the spot check misses a row)
        raise BackendError(
            f"parameter(s) {written}: a tensor made from them in the model's forward (a view, "
            "or an op of them alone, such as W.unsqueeze(0) * c) was written in place before "
            "its use (q[0] = 5, q.mul_(...)), so it is no longer the function of them gradlog "
            "follows. Make that write out of place (torch.where, index_put without _), or use "
            "backend='loop'. p.grad is complete.")
    stale = sorted(set(got_grad) & (ops.stale if ops is not None else set()))
    if stale:
        raise BackendError(
            f"parameter(s) {stale}: the forward used a tensor made from them before it ran "
            "(in __init__, or in an earlier forward) and kept (self.w2 = self.weight * 2, a "
            "copy: self.c = self.weight.clone()), which holds their value from then and is no "
            "function of them gradlog can follow. Make it inside the forward (a view kept from "
            "before, self.pos = self.emb.weight[:16], is followed), or use backend='loop'. "
            "p.grad is complete.")
    missed = [n for n in params if n in got_grad and n not in covered]
    if not missed:
        return
    owners = {n: [e.label for e in entries_ if n in e.names.values()] for n in missed}
    watched = ops is None or ops.watching
    raise BackendError(
        f"parameter(s) {missed} received a gradient, but no hooked module call used them "
        f"(owners: {owners}) and no op of the model's forward took them: they were used "
        "outside the model's forward (e.g. F.linear(x, model.embed.weight) in the loss "
        "code; op-level capture sees only the root module's forward). Move that use into "
        "the model's forward, or use backend='loop'." + ("" if watched else _WATCH_HINT)
    )
