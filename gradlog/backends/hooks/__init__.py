"""The ``hooks`` backend: exact per-datum gradients from the user's one ordinary backward.

:class:`HooksBackend` orchestrates the parts: what to hook (:mod:`.calls`), graph walks
(:mod:`.graph`), where the batch is (:mod:`.layout`), adding up per-datum results
(:mod:`.accumulate`), buffers (:mod:`.pool`), autocast (:mod:`.precision`), checks (:mod:`.checks`).

During the user's forward, a forward hook on each module that owns recorded parameters keeps
that call's inputs and puts a tensor hook on its outputs. During ``batch_loss.backward()``
(called once, untouched: hooks only observe, so ``p.grad`` is bitwise what it would be without
gradlog), each output hook receives the gradient of the batch loss with respect to the output,
and the module's **rule** (:mod:`gradlog.rules`) turns (inputs, output gradient) into per-datum
gradients right away, so captured tensors are freed layer by layer. Modules without a rule,
and raw parameters used in a module's own forward, use a per-module ``torch.func``
computation (:data:`gradlog.rules.GENERIC`); ``describe()`` lists them.

The captured output gradient is that of ``sum_b w_b losses[b]`` (``w_b = 1/B`` for a mean
batch loss), so rules multiply by ``1 / w_b``; a module called several times contributes
once per call. Errors inside the backward are raised after it (``p.grad`` complete).

``batch_grad="sum"``: recorded Linear/Conv1D weights' gradient is their records' sum, not
autograd's matmul (:mod:`gradlog.backends.fused`): ``p.grad`` to float rounding.

Only modules owning recorded parameters are hooked. Autocast: :attr:`low_precision`.

Batch dimension. Layers that treat leading dimensions alike (Linear, Embedding, LayerNorm)
may have the batch in any of them (sequence-first models): found by size, refused where
ambiguous (sequence-first layers and a sequence length equal to B).

Shared inputs. An output with no batch dimension of size B (position ids ``[1, T]``) is
broadcast over the batch by the op consuming it: when that op adds, subtracts, expands or
repeats it, each datum's gradient is taken from its output gradient (found by a walk of the
graph before the backward); when it reaches the batch only through Linear layers so routed,
from theirs (:mod:`.feeds`, DeBERTa's relative positions); other uses are refused first.
Chunked heads and layers on the batch's tokens flattened to ``(B*T, d)``: :mod:`.layout`.

Uses outside a covering module (a head tied by hand, PEFT's LoRA embedding) are captured per
op around the root's forward (:mod:`.operations`; rules: :mod:`gradlog.rules.ops`), and so are
a container's own parameters (a layer scale) where they can all be (:mod:`.containers`).

Checks (:mod:`.checks`): a gradient no hooked call or op saw is an error; every backward
compares ``sum_b w_b g_b`` with autograd's gradient at a few random entries per parameter.

Activation checkpointing. Hooks fire again when ``torch.utils.checkpoint`` recomputes a
segment: with ``use_reentrant=False`` the original call counts (recomputations are told apart
by torch's saved-tensor hooks), with ``use_reentrant=True`` the recomputed one (the original
ran without grad: such calls are unseen when the layout is read, :func:`shared_outputs`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from gradlog._torch_private import (
    backward_keeps_graph,
    cuda_devices,
    in_autograd_backward,
    in_checkpoint_recompute,
    rng_states,
    saved_tensor_hooks_kind,
    torch_function_mode_paused,
)
from gradlog._tree import leaves
from gradlog.backends.base import Backend, PerDatumGrads, restorable_leaves
from gradlog.backends.fused import FusedLink, fuse_output
from gradlog.backends.heap import keep_heap_resident
from gradlog.backends.hooks import checks, datum_check, graph, parametrized
from gradlog.backends.hooks.accumulate import Accumulator
from gradlog.backends.hooks.calls import Call, Entry, plan_entries
from gradlog.backends.hooks.containers import Containers
from gradlog.backends.hooks.datum_check import HOOK_KINDS
from gradlog.backends.hooks.feeds import Feeds
from gradlog.backends.hooks.graph import alias_outputs, consumer_gradient, hook_target
from gradlog.backends.hooks.layout import batch_first, consumer_inputs, locate_batch, shared_outputs
from gradlog.backends.hooks.operations import WATCH, OpCapture
from gradlog.backends.hooks.pool import _BASELINE, BufferPool
from gradlog.backends.hooks.precision import autocast_dtype, call_precision, rule_precision
from gradlog.backends.hooks.rows import RowLayouts, rows_by_datum
from gradlog.errors import BackendError, UnsupportedLayerError
from gradlog.memory import current_chunk  # rows of chunked_linear_loss's head calls
from gradlog.params import check_differentiable
from gradlog.rules import track_dropout
from gradlog.rules.base import Capture, RuleResult, replays_keep_hooks
from gradlog.rules.ops import GENERIC_BATCH_DIM
from gradlog.rules.replay import replayed_otherwise

__all__ = ["BATCH_GRADS", "REUSES_BUFFERS", "HooksBackend"]

BATCH_GRADS = ("autograd", "sum")
"""``p.grad`` of recorded Linear weights: autograd's own (bitwise), or the sum of the
per-datum gradients (:mod:`gradlog.backends.fused`: one matmul less, float tolerance)."""

REUSES_BUFFERS = _BASELINE is not None
"""Whether reference counts are readable here, so the buffer pool reuses memory."""


class HooksBackend(Backend):
    """Per-datum gradients from forward/tensor hooks and per-layer rules (see module doc)."""

    name = "hooks"
    settles_loss_checks = True

    def __init__(
        self,
        model: nn.Module,
        params: Mapping[str, nn.Parameter],
        *,
        batch_reduction: str,
        randomness: str,
        batch_grad: str = "autograd",
        watch_ops: str = "auto",
    ) -> None:
        super().__init__(model, params, batch_reduction=batch_reduction, randomness=randomness)
        for option, value, choices in (("batch_grad", batch_grad, BATCH_GRADS),
                                       ("watch_ops", watch_ops, WATCH)):
            if value not in choices:
                raise BackendError(f"{option}={value!r} is not one of {list(choices)}.")
        self.batch_grad, self.watch_ops = batch_grad, watch_ops
        self._entries: list[Entry] = []
        self._sequence_first: list[str] = []  # modules with batch_first=False
        self._handles: list[Any] = []
        self._live: list[weakref.ref[Call]] = []
        self._armed = False  # True only inside this backend's own backward
        self._recomputing = False  # True while a rule runs (torch.func re-runs modules)
        self._spot_rng = torch.Generator().manual_seed(0)  # never the global RNG: training's
        self._spot = checks.SpotCheck(self.params, self._spot_rng)
        self._pool = BufferPool()
        self._layouts = datum_check.DatumLayouts()  # those the datum check verified
        self._rows = RowLayouts()
        self._probing = False  # inside the datum check's backward (_datum_probe)
        self._autocast: set[torch.dtype] = set()  # autocast dtypes the forward's calls ran in
        self._saved_tensor_hooks = "none"  # the calls' saved-tensor hooks (HOOK_KINDS)
        self._inside: dict[int, int] = {}  # parameter id -> running calls of covering modules
        self._ops: OpCapture | None = None
        self._containers = Containers(None, self._capturing)  # (see attach)
        self._states, self._writes = parametrized.States(), checks.InputWrites()
        self._order = checks.HookOrder()
        self._reset(0)

    # -- lifecycle --------------------------------------------------------------------------
    def attach(self) -> None:
        """Hook every module that owns (or whose rule covers) a recorded parameter."""
        if self._handles:
            return
        checks.refuse_compiled_in_place(self.model)
        if any(p.device.type == "cpu" for p in self.params.values()):
            keep_heap_resident()  # autograd's temporaries around our buffers: no page faults
        self._entries = plan_entries(self.model, self.params, self.batch_grad)
        self._spot.rerun = {n: e.label for e in self._entries if e.rule.uses_torch_func
                            for n in e.names.values()}  # (for the checks' messages)
        self._sequence_first = [name for name, m in self.model.named_modules()
                                if getattr(m, "batch_first", True) is False]
        self._handles += self._states.watch(p for e in self._entries for p in e.plists)
        for entry in self._entries:  # (before the user's hooks: prune's; one replacing it)
            self._handles += [entry.module.register_forward_pre_hook(functools.partial(
                self._on_enter, entry), prepend=True), entry.module.register_forward_hook(
                self._order.first(functools.partial(self._on_forward, entry)),
                with_kwargs=True, always_call=True, prepend=True),
                entry.module.register_forward_pre_hook(self._order.enter)]  # (after the user's)
            # its re-run replays the batch's dropout masks; what its compute takes from the forward
            self._handles += track_dropout(entry.module) if entry.rule.uses_torch_func else []
            self._handles += entry.rule.track(entry.module) if entry.rule.track else []
        # uses of recorded parameters that no hooked module call covers (see .operations)
        self._ops = OpCapture(self.model, self.params, self._capture, self._inside,
                              self._entries, self._capturing, self.watch_ops)
        self._containers = Containers(self._ops, self._capturing)
        self._handles += [self.model.register_forward_pre_hook(self._ops.enter, prepend=True),
                          self.model.register_forward_hook(self._ops.leave, always_call=True),
                          replays_keep_hooks(self.model),
                          *(p.register_hook(functools.partial(self._on_param_grad, name))
                            for name, p in self.params.items())]

    def detach(self) -> None:
        """Remove every hook gradlog installed and drop captured tensors."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for ref in self._live:
            call = ref()
            if call is not None:
                call.release()
        self._live, self._entries = [], []
        self._inside.clear()
        self._ops, self._containers = None, Containers(None, self._capturing)
        self._pool = BufferPool()  # let go of buffers kept for reuse

    @property
    def fused_params(self) -> frozenset[str]:
        """Recorded weights whose gradient is their records' sum (``batch_grad="sum"``)."""
        return frozenset(e.names["weight"] for e in self._entries if e.fused)

    def describe(self) -> dict[str, Any]:
        """Which module computes which recorded parameters, by which rule."""
        return {
            "name": self.name,
            "modules": [{"module": e.name, "class": type(e.module).__name__, "rule": e.rule.name,
                         "params": sorted(set(e.names.values()))} for e in self._entries],
            "fallback": list(dict.fromkeys(  # (or a replay found it computing otherwise)
                e.name for e in self._entries if (e.fallback and e.name not in
                                                  self._containers.by_ops)
                or replayed_otherwise(e.module))),
            "ops": sorted({f"{e.name}: {e.rule.name}"
                           for e in (self._ops.entries.values() if self._ops else ())}),
            "batch_grad": self.batch_grad,
            "fused": [e.name for e in self._entries if e.fused],
        }

    # -- capture (forward) ------------------------------------------------------------------
    def _on_enter(self, entry: Entry, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook: the entry's rule covers its parameters' uses until it returns."""
        self._states.enter(entry)
        self._writes.enter(entry, args)
        if not self._containers.enter(entry):  # (a container's own, op by op: uncovered)
            for key in entry.param_ids:
                self._inside[key] = self._inside.get(key, 0) + 1

    def _capturing(self) -> bool:
        """Whether an op seen now is captured (not while rules run, nor without grad)."""
        return not self._recomputing and torch.is_grad_enabled()

    def _on_forward(self, entry: Entry, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any], output: Any) -> Any:
        inside = self._inside  # (always called, also when the forward raised)
        self._states.leave(entry)
        self._writes.leave(entry)
        inner = self._containers.leave(entry)
        for key in entry.param_ids if inner is None else ():
            inside[key] = inside.get(key, 1) - 1
        if not torch.is_grad_enabled() and self._ops and self._ops.grad and self._ops.depth:
            self._unseen = True  # (in a forward with grad: a reentrant checkpoint's segment)
        if output is None or self._recomputing or not torch.is_grad_enabled():
            return None
        if not any(p.requires_grad for p in entry.params):
            return None
        last = self._live[-1] if self._live else None
        if self._ops is None or not self._ops.watching:  # (the mode is pushed only then)
            out = self._capture(entry, module, args, kwargs, output)
        else:
            with torch_function_mode_paused(self._ops):  # (its ops are not the model's)
                out = self._capture(entry, module, args, kwargs, output)
        call = self._live[-1]() if self._live and self._live[-1] is not last else None
        if inner is not None and call is not None:
            call.inner = inner
        return out

    def _capture(self, entry: Entry, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any], output: Any) -> Any:
        """Capture a call of a module or op; returns the output to hand on (None: as is)."""
        link: FusedLink | None = None
        late = None if entry.op else self._order.refusal(module)  # (a hook ran before it)
        if entry.fused and not late and not kwargs and current_chunk() is None and not isinstance(
                getattr(output, "grad_fn", None), torch.autograd.function.BackwardCFunction):
            # (an output another context re-rooted, e.g. gradlog.sparse, keeps its own backward)
            fused = fuse_output(module, args, output)
            if fused is not None:
                output, link = fused
        if in_autograd_backward() and (not self._armed or in_checkpoint_recompute()):
            # A checkpoint recompute (a backward not recorded, or a non-reentrant one: its
            # outputs get no gradient, the original call's do), re-rooted like that call.
            return output if link is not None else None
        replaced = link is not None
        if entry.fallback:
            aliased = alias_outputs(output, [(t, 0) for t in leaves((args, kwargs))
                                             if isinstance(t, torch.Tensor)])
            if aliased is not None:
                output, replaced = aliased, True
        outputs = leaves(output)
        call: Call | None = None
        seen: set[int] = set()
        for i, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor) or not t.requires_grad or id(t) in seen:
                continue
            seen.add(id(t))  # an output returned twice has one gradient: hook it once
            if call is None:
                call = Call(entry, args, kwargs, len(outputs), i, t.shape)
            if t.grad_fn is not None:  # lets the pre-backward graph walk find this call
                call.mark(cast(dict[str, Any], t.grad_fn.metadata), t.output_nr, i)
            on_grad = functools.partial(self._on_output_grad, call, i)
            if link is not None:  # FusedLinear.backward hands it over: no tensor hook needed
                link.on_grad = functools.partial(self._on_fused_grad, call, i)
            else:
                target = hook_target(t, call.versions) if i == call.primary and (
                    entry.hook_base or t.shape[:1] == (1,)) else t  # (see Call.mark_base)
                if target is not t:  # (noted: an in-place op on t drops t's node from the graph)
                    call.mark_base(target, (t.shape, t.stride(),
                                            int(t.storage_offset() - target.storage_offset())))
                if target is not t and entry.hook_base:  # see hook_target: t's hook may not fire
                    on_grad = functools.partial(self._on_base_grad, call, i)
                call.handles.append((target if entry.hook_base else t).register_hook(on_grad))
            call.hooked += 1
        if call is None:
            return output if replaced else None
        call.fused = link
        call.autocast = narrow = autocast_dtype(entry.params[0].device.type)
        if narrow is not None:  # (the datum check's tolerance; the call's, call_precision)
            self._autocast.add(narrow)
        if self._saved_tensor_hooks != "other":  # (when the datum check runs)
            kind = saved_tensor_hooks_kind()
            if HOOK_KINDS.index(kind) > HOOK_KINDS.index(self._saved_tensor_hooks):
                self._saved_tensor_hooks = kind
        chunk = current_chunk()
        if chunk is not None and chunk.differentiated:
            call.chunk = chunk  # a head called on flattened rows by chunked_linear_loss
        call.refusal = (checks.refusal(entry, module, args, kwargs) or late
                        or self._writes.refusal(entry))
        call.stamp = self._states.stamp(entry)  # (and why not, where its state went wrong)
        if call.refusal is None and call.stamp is not None:
            call.refusal = call.stamp.refusal
        self._live.append(weakref.ref(call))
        if entry.op:
            self._containers.note(call)
        if len(self._live) % 256 == 0:
            self._live = [r for r in self._live if r() is not None]
        return output if replaced else None

    # -- backward ---------------------------------------------------------------------------
    def backward(self, losses: torch.Tensor, batch_loss: torch.Tensor) -> PerDatumGrads:
        if not self._handles:
            raise BackendError("the hooks backend is not attached; the recorder attaches it "
                               "when recording starts (use GradRecorder as a context manager).")
        check_differentiable(self.params, losses)  # before autograd's own, vaguer errors
        self.settle()  # the last backward's, if its caller did not settle it
        B = int(losses.shape[0])
        survey = graph.GraphSurvey(batch_loss.grad_fn,  # one walk: _reset's and the routing's
                                   self._saved_tensor_hooks)
        self._reset(B, survey)
        # after _reset's walk, before the forward's state is dropped (a retry); or late
        self.settle_loss_checks(self._loss_refused, lambda device: restorable_leaves(
            survey.leaves(), device, lambda h: getattr(h, "func", None) == self._on_param_grad))
        self._pool.reclaim()
        try:
            checks.refuse_double_backward(c for c in (r() for r in self._live) if c is not None)
            self._route_shared_outputs(survey, B)  # may refuse, before p.grad is touched
            when, foreign = datum_check.datum_check_mode(
                losses, batch_loss, self.params, self._saved_tensor_hooks
            ) if self._wants_datum_check(B, survey) else (None, False)
            self._rows.require(when is not None)
            rng = rng_states(cuda_devices(self.model)) if when is not None else None
            datum = self._datum_probe(losses, rng, keep_graph=True) if when == "before" else None
            self._armed = True
            try:
                # the ordinary backward, p.grad as without gradlog (see datum_check_mode)
                batch_loss.backward(retain_graph=True if when == "after" else None)
            finally:
                self._armed = False
                for handle in self._consumer_handles:
                    handle.remove()
            for call in self._partial:  # calls some of whose outputs got no gradient
                if not call.done:
                    self._finish(call)
            for fed, per in self._feeds.leftover():
                self._routed(fed, per)
            checks.raise_kept_error(self._error)
            results = self._results
            materials = results.merge_materials()
            checks.check_coverage(self.params, self._got_grad, results.covered, self._entries,
                                  self._ops)
            self._spot.check({**results.acc, **materials}, self.low_precision, 1 / self._scale)
            if not self.defer_checks:
                self.settle()
            out = {
                name: materials[name] if name in materials
                else results.acc[name] if name in results.acc
                else torch.zeros((B, *p.shape), dtype=p.dtype, device=p.device)
                for name, p in self.params.items()
            }
            if when == "after":
                datum = self._datum_probe(losses, rng, keep_graph=False)  # (frees the graph)
            self._rows.require(datum is not None)  # (autograd refused the check's backward)
            if datum is not None:
                self.settle()  # the spot check's verdict first, and none left pending
                narrow = (*self.low_precision.values(), *self._autocast)
                datum_check.check_datum(datum, out, self.params, narrow, trusted=not foreign,
                                        required=bool(self._rows.pending or self._rows.reordered),
                                        loss_scaled=self.seed_scale != 1,
                                        rerun=self._spot.rerun, own=self._rows.own)
            self._rows.passed(self._layouts.passed(datum))
            return out
        finally:
            for call in self._touched:  # (untagged only now: layouts read earlier calls' tags)
                call.release(untag=True)
            self._reset(0)
            self._autocast = set()  # (what the next forward runs under)
            self._saved_tensor_hooks = "none"
            self._pool.release()

    def settle(self) -> None:
        self.settle_late_loss_checks()  # (first: a refused batch's other verdicts are moot)
        if self._spot.settle() and self._ops is not None:  # passed: the uses it saw learnt
            self._ops.checked()

    def _loss_refused(self) -> None:  # the forward counts as unverified again; no verdict
        self._spot.pending = None
        if self._ops is not None:
            self._ops.undo()

    def _wants_datum_check(self, B: int, survey: graph.GraphSurvey) -> bool:
        """:meth:`datum_check.DatumLayouts.wants`, or a self-checked batch, or a new flattened
        layout (:class:`.rows.RowLayouts`); never for B 1 (nor where
        :func:`datum_check.datum_check_possible` says no: FSDP, DDP with ``static_graph``)."""
        calls = [c for c in (r() for r in self._live) if c is not None and not c.done]
        rows = self._rows.note(calls, B, survey)
        possible = B > 1 and datum_check.datum_check_possible(self.model)
        return self._layouts.wants(survey.in_this_graph(calls), B, self.model, self.params,
                                   self.datum_check_due or rows, possible)

    def _datum_probe(self, losses: torch.Tensor, rng: dict[str, torch.Tensor] | None,
                     keep_graph: bool) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """:func:`datum_check.probe`, its backward let pass by the hooks."""
        self._probing = True  # (see _on_output_grad)
        try:
            return datum_check.probe(losses, self.params, self._spot_rng,
                                     cuda_devices(self.model), rng, keep_graph, self._layouts)
        finally:
            self._probing = False

    def _reset(self, batch_size: int, survey: graph.GraphSurvey | None = None) -> None:
        if batch_size:
            self.low_precision = {}
        else:
            self._unseen = False  # (calls a forward ran without grad: see _on_forward)
        self._batch = batch_size
        self._scale = (batch_size if self.batch_reduction == "mean" else 1) / self.seed_scale
        self._results = Accumulator(self.params, self._pool, batch_size, self.keep_material,
                                    self.dense_when_fused)
        self._got_grad: set[str] = set()
        self._partial: list[Call] = []
        self._touched: list[Call] = []
        self._consumer_handles: list[Any] = []
        self._feeds = Feeds()
        self._error: tuple[Entry, BaseException] | None = None
        self._spot.draw(batch_size, full=bool(batch_size and survey is not None and self._ops
                                              and self._ops.unverified(survey)))

    # -- gradients (inside the backward) ----------------------------------------------------
    def _on_param_grad(self, name: str, grad: torch.Tensor) -> None:
        if not self._armed:
            return
        self._got_grad.add(name)
        self._spot.observe(name, grad)

    def _on_fused_grad(self, call: Call, i: int, grad: torch.Tensor) -> bool:
        """A fused call's output gradient (from FusedLinear.backward); False when it was let
        pass (the datum check's backward): the call then keeps this handler for the batch's."""
        if self._probing:
            return False
        self._on_output_grad(call, i, grad)
        return True

    def _on_output_grad(self, call: Call, i: int, grad: torch.Tensor) -> None:
        # (a tensor hook: returns None, or autograd would take the result as the gradient)
        if self._probing or call.done or call.via_consumers:
            return
        if not self._armed:  # a backward gradlog does not record: just let go of the inputs
            if torch.is_grad_enabled():  # create_graph=True (a gradient penalty in the
                # loss): the recorded backward will differentiate this gradient; kept to
                # refuse it (checks.refuse_double_backward)
                call.twice = True
            elif not backward_keeps_graph():  # (retain_graph: kept for a recorded backward)
                call.release(untag=True)
            return
        self._touched.append(call)
        if self._error is not None:
            return
        call.grads[i] = grad
        call.received += 1
        if call.received >= call.hooked:
            self._finish(call)
        elif not call.pending:
            call.pending = True
            self._partial.append(call)

    def _on_base_grad(self, call: Call, i: int, grad: torch.Tensor) -> None:
        """Output ``i``'s base's gradient (:func:`graph.hook_target`), viewed as the output."""
        size, stride, offset = call.geometry or (grad.shape, grad.stride(), 0)
        self._on_output_grad(call, i, grad.contiguous().as_strided(size, stride, offset))

    def _finish(self, call: Call) -> None:
        self._compute(call, call.grads)
        call.release()

    def _compute(self, call: Call, grads: list[torch.Tensor | None], *,
                 args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None,
                 expanded: bool = False) -> None:
        """Run the call's rule and add its per-datum gradients; errors are kept for later
        (raising inside the autograd engine would leave ``p.grad`` half accumulated)."""
        entry = call.entry
        if self._error is not None or call.args is None or call.kwargs is None:
            return
        try:
            checks.check_versions(call)
            checks.check_state(call, self._batch)
            parametrized.check_state(call.stamp)
            if call.refusal is not None:
                raise UnsupportedLayerError(call.refusal)
            args = call.args if args is None else args
            kwargs = call.kwargs if kwargs is None else kwargs
            rows: slice | None = None  # the datums a chunk of rows belongs to
            flat = False  # a module re-run per datum on the batch's tokens, (B*T, ...) rows
            if call.chunk is not None:
                batch, rows, args, kwargs, grads, flat = rows_by_datum(
                    call.chunk, entry, self._batch, args, kwargs, grads)
            elif call.lead is None and not expanded:  # a call captured during the backward
                locate_batch(call, self._batch, self._sequence_first, unchecked=True)
            if call.bd != 0 and entry.rule.feature_dims is not None:
                args, kwargs, grads = batch_first(call.bd, self._batch, args, kwargs, grads)
            cap = Capture(
                args=args,
                kwargs=kwargs,
                grads=tuple(grads),
                batch_size=self._batch if rows is None else batch,
                scale=self._scale,
                expanded=expanded,
                alloc=self._pool.empty,
                factored=frozenset() if rows is not None else self._results.factored(
                    entry, fused=call.fused is not None),
                batch_dim=call.bd,
                flattened=flat,
            )
            self._recomputing = True
            grad_mode = torch.is_grad_enabled()  # off already in a backward without create_graph
            try:
                if grad_mode:
                    torch.set_grad_enabled(False)
                rule = entry.rule
                if entry.fallback and not entry.op and call.bd and not expanded:
                    rule = GENERIC_BATCH_DIM  # the module fallback, batch not first
                with rule_precision(call, rule), parametrized.evaluating(
                        entry.plists, bool(entry.chains), self._states.made, call.autocast):
                    result = rule.compute(entry.module, cap, entry.wanted)
                    if entry.chains:
                        result = parametrized.through(entry.chains, result)
            finally:
                self._recomputing = False
                if grad_mode:
                    torch.set_grad_enabled(True)
            weight = result.get("weight")
            if call.fused is not None and rows is None and isinstance(weight, torch.Tensor):
                # The call's batch weight gradient, read by FusedLinear.backward right after
                # this handler returns; taken before _add, which may add into the tensor.
                call.fused.weight_grad = weight.sum(0).div_(self._scale)
            self._add(entry, result, cap, rows)
            datum_check.watch(call, result)  # (where a datum check verifies its layout)
            narrow = call_precision(call, grads)
            if narrow is not None:  # the layer ran in autocast's dtype: p.grad is rounded
                for name in entry.names.values():
                    self.low_precision[name] = narrow
        except Exception as e:  # re-raised after the backward, with p.grad complete
            self._error = (entry, checks.explain_state(entry, e, self._batch))

    def _add(self, entry: Entry, result: RuleResult, cap: Capture, rows: slice | None = None
             ) -> None:  # this backward's per-datum results (Accumulator.add)
        self._results.add(entry, result, cap, rows)

    # -- shared (broadcast) outputs ---------------------------------------------------------
    def _route_shared_outputs(self, survey: graph.GraphSurvey, B: int) -> None:
        """Before the backward: settle each captured call's batch dimension, and hook the
        consumers of outputs an op broadcasts over the batch (see :func:`shared_outputs`)."""
        calls = [c for c in (r() for r in self._live) if c is not None]
        self._containers.settle(calls, B, survey)  # (releases calls: before live is read)
        live = [c for c in calls if not c.done and c.args is not None]
        self._live = [weakref.ref(c) for c in live]
        for call, found, feeds in shared_outputs(live, survey, B, self._sequence_first,
                                                 self._unseen):
            self._touched.append(call)
            self._feeds.note(call, len(found) if not feeds else 1, feeds)
            for node, slot, chain, at in found:
                hook = functools.partial(self._on_consumer_grad, call, consumer_gradient(
                    node, slot, at, B, bool(self._sequence_first)), chain, at)
                self._consumer_handles.append(node.register_prehook(hook))

    def _on_consumer_grad(self, call: Call, taken: Callable[[torch.Tensor], torch.Tensor],
                          chain: tuple[Any, ...], at: tuple[int, ...],
                          grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        if self._armed and grad_outputs and grad_outputs[0] is not None:
            self._routed(call, grad_outputs[0], chain, at, taken)

    def _routed(self, call: Call, g: torch.Tensor, chain: tuple[Any, ...] = (),
                at: tuple[int, ...] = (), taken: Callable[..., torch.Tensor] | None = None) -> None:
        """A shared call's rule on per-datum output gradients from consumer gradient ``g``
        (``taken``: :func:`.graph.consumer_gradient`); then the calls it feeds (:mod:`.feeds`)."""
        if call.args is None or self._error is not None:
            return
        try:
            g = taken(g) if taken is not None else g
            per, args, kwargs, expand = consumer_inputs(call, g, self._batch, chain, at)
            if call.entry.op and call.entry.fallback:  # a per-op vjp: re-run on its own inputs
                args, kwargs, expand = call.args, call.kwargs, True
        except BackendError as e:
            self._error = (call.entry, e)
            return
        grads = [per if k == call.primary else None for k in range(len(call.grads))]
        self._compute(call, grads, args=args, kwargs=kwargs, expanded=expand)
        for fed, per_fed in self._feeds.deliver(call, per):
            self._routed(fed, per_fed)
