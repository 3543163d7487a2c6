"""The ``hooks`` backend: exact per-datum gradients from the user's one ordinary backward.

During the user's forward, a forward hook on each module that owns recorded parameters keeps
that call's inputs and puts a tensor hook on its outputs. During ``batch_loss.backward()``
(called once, untouched: hooks only observe, so ``p.grad`` is bitwise what it would be without
gradlog), each output hook receives the gradient of the batch loss with respect to the output,
and the module's **rule** (:mod:`gradlog.rules`) turns (inputs, output gradient) into per-datum
gradients right away, so captured tensors are freed layer by layer. Modules without a rule,
and raw parameters used in a module's own forward, use a per-module ``torch.func``
computation (:data:`gradlog.rules.GENERIC`); ``describe()`` lists them.

The captured output gradient is that of ``sum_b w_b losses[b]`` (``w_b = 1/B`` for a mean
batch loss), so rules multiply by ``1 / w_b``. A module called several times (reuse, tied
weights) contributes once per call, summed. Errors inside the backward are kept and raised
after it, so ``p.grad`` is never left half accumulated.

``batch_grad="sum"``. Recorded ``nn.Linear``/``Conv1D`` layers then take their weight
gradient from the sum of their per-datum gradients instead of autograd's own matmul
(:mod:`gradlog.backends.fused`): ``p.grad`` to float rounding, one matmul less per layer.

Chosen layers. Only modules owning recorded parameters are hooked (and only the recorded
parameters get a gradient hook), so recording ``params="layers.40.*"`` of a deep model costs
that layer's captured inputs (for Linear and LayerNorm the tensors autograd saves anyway) and
its per-datum gradients (B x its parameters); the rest of the model is not touched. A model
the user froze (``requires_grad=False``) needs nothing more: only parameters that require
grad are selected, and a recorded parameter frozen later is refused by name
(:func:`gradlog.params.check_differentiable`) before autograd's own, vaguer errors.

Autocast. Under ``torch.autocast`` captured inputs and output gradients may be bfloat16 or
float16 while parameters are float32: rules widen them and accumulate per-datum gradients in
the parameters' dtype. Autograd's own ``p.grad`` of such a layer is rounded to the narrow
dtype, so :attr:`low_precision` names those parameters and the checks of ``sum_b w_b g_b``
against ``p.grad`` allow :data:`~gradlog.backends.base.LOW_PRECISION_RTOL` of its epsilon.

Batch dimension. Every per-datum result must have B rows. Layers that treat leading
dimensions alike (Linear, Embedding, LayerNorm) may have the batch in any leading dimension
(sequence-first models); it is found by size, and refused as ambiguous when the model has
sequence-first layers and the sequence length equals B.

Shared inputs. A module whose output has no batch dimension of size B (Hugging Face style
position ids ``[1, T]``, or nanoGPT's ``arange(T)``) is broadcast over the batch by the op that
consumes it, and its own output gradient is already summed over datums. Before the backward,
gradlog walks the autograd graph from the loss to that output's consumers; when they are
additions, subtractions or expands, it takes each datum's gradient from the consumer's
output gradient instead (per datum: the shared input with that datum's gradient). Other
consumers are refused with an error before ``p.grad`` is touched.

Chunked heads. :func:`gradlog.memory.chunked_linear_loss` calls the head on chunks of
flattened ``(B*T, d)`` rows, during the backward; its ``current_chunk()`` says which rows, so
the backend lays each chunk out as ``(datums, T, d)`` for row-wise rules (Linear) and adds
the result into those datums' gradients.

Checks. A parameter that received a gradient without any hooked call seeing its use is an
error (it was used outside its module's forward, e.g. ``F.linear(x, self.emb.weight)`` in a
parent). On every backward a spot check compares ``sum_b w_b g_b`` with the gradient autograd
accumulated at a few random entries per parameter (partial uses, wrong rules); the recorder's
full self-check runs every ``check_every`` steps.

Activation checkpointing. Forward hooks fire again when ``torch.utils.checkpoint``
recomputes a segment during the backward. With ``use_reentrant=False`` the original call
is captured and receives the gradients; the recomputed call (told apart by torch's
recomputation saved-tensor hooks) is not captured again. With ``use_reentrant=True`` the
original forward ran without grad (nothing captured) and the recomputed call, inside the
backward, is the one that counts. Per-datum gradients equal those of the model without
checkpointing. Memory: with ``use_reentrant=False`` the captured inputs of the *recorded*
modules stay alive from the forward to their layer's backward, as without checkpointing (the
rest of the segment is freed as usual), so checkpointing saves less for recorded layers.
Measured on a 24-layer GPT (bench_memory.py ``--sections layers``, tests/benchmarks/
RESULTS.md): recording 1 of 24 checkpointed layers adds 33 MiB, all 24 add 511 MiB (386 MiB
without checkpointing: the difference is the recorded modules' inputs, ~5 MiB per layer).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from gradlog._tree import flatten, leaves
from gradlog.backends.base import LOW_PRECISION_RTOL, Backend, PerDatumGrads, graph_nodes
from gradlog.backends.fused import FusedLink, fusable, fuse_output
from gradlog.backends.heap import keep_heap_resident
from gradlog.errors import BackendError, GradlogError, UnsupportedLayerError
from gradlog.grads import Factors, Rows, entries
from gradlog.params import check_differentiable
from gradlog.rules import GENERIC, Rule, active_randomness, find_rule
from gradlog.rules.base import Capture, RuleResult

_current_chunk: Callable[[], Any]  # rows of chunked_linear_loss's head calls (gradlog.memory)
try:
    from gradlog.memory import current_chunk as _current_chunk
except ImportError:  # pragma: no cover - the memory module is optional for this backend
    _current_chunk = lambda: None  # noqa: E731


__all__ = ["BATCH_GRADS", "HooksBackend"]

log = logging.getLogger("gradlog")

BATCH_GRADS = ("autograd", "sum")
"""``p.grad`` of recorded Linear weights: autograd's own (bitwise), or the sum of the
per-datum gradients (:mod:`gradlog.backends.fused`: one matmul less, float tolerance)."""

_TAG = "gradlog_calls"  # autograd Node.metadata key: [(output_nr, call)] of captured outputs
_PASS_THROUGH = ("AddBackward0", "SubBackward0", "ExpandBackward0")
_SPOT_ENTRIES = 4  # entries per parameter compared with autograd's gradient on every backward
_DATUM_ENTRIES = 64  # entries per parameter of the datum check (_check_datum)
_SPOT_RTOL = {torch.float64: 1e-7, torch.float32: 1e-3}  # of sum_b w_b |g_b| + |grad|
_SPOT_ATOL = {torch.float64: 1e-12, torch.float32: 1e-7}  # for gradients that are all noise


_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. an activation-checkpoint recompute)."""
    return _graph_task_id is not None and _graph_task_id() != -1


def _in_checkpoint_recompute() -> bool:
    """True inside the recomputation of a ``torch.utils.checkpoint(use_reentrant=False)``
    segment: torch then runs the segment's forward under its ``_recomputation_hook`` saved-
    tensor hooks, only to rebuild saved tensors. (False where this cannot be told: the
    recomputed call is then captured but, never receiving a gradient, computes nothing.)"""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        hooks = top(False)
    except TypeError:  # a torch whose binding takes no argument
        hooks = top()
    except RuntimeError:
        return False
    pack = hooks[0] if hooks else None
    return getattr(pack, "__qualname__", "").startswith("_recomputation_hook.")


@dataclass(eq=False)
class _Entry:
    """One hooked module, the rule computing its recorded parameters, and their names."""

    module: nn.Module
    name: str
    rule: Rule
    names: dict[str, str]  # attribute path -> recorded parameter name
    params: tuple[nn.Parameter, ...]
    fallback: bool
    fused: bool = False  # batch_grad="sum": the weight gradient is the sum of the records
    hook_base: bool = False  # see Rule.views_own_result and _made_base

    @functools.cached_property
    def wanted(self) -> frozenset[str]:
        return frozenset(self.names)

    @property
    def label(self) -> str:
        return f"{type(self.module).__name__} {self.name or '(the model)'!r}"


class _Call:
    """What one forward call of a hooked module left for its backward."""

    __slots__ = (
        "__weakref__",
        "args",
        "bd",
        "chunk",
        "done",
        "entry",
        "fused",
        "grads",
        "handles",
        "hooked",
        "kwargs",
        "lead",
        "out_shape",
        "pending",
        "primary",
        "received",
        "refusal",
        "twice",
        "versions",
        "via_consumers",
    )

    def __init__(self, entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any],
                 n_leaves: int, primary: int, out_shape: torch.Size) -> None:
        self.entry = entry
        self.args: tuple[Any, ...] | None = args
        self.kwargs: dict[str, Any] | None = kwargs
        self.versions = [(t, t._version) for t in leaves((args, kwargs))
                         if isinstance(t, torch.Tensor)]  # (input, its version when used)
        self.grads: list[torch.Tensor | None] = [None] * n_leaves
        self.handles: list[Any] = []
        self.hooked = 0
        self.received = 0
        self.primary = primary
        self.out_shape = out_shape
        self.bd = entry.rule.batch_dim(entry.module)  # settled by size in _locate_batch
        self.lead: int | None = None  # the output's size along bd
        self.done = False
        self.pending = False
        self.via_consumers = False
        self.twice = False  # its output was differentiated with create_graph=True
        self.refusal: str | None = None  # why the rule cannot compute this call
        self.chunk: Any = None  # gradlog.memory.ChunkInfo: the call saw rows of (B, T) inputs
        self.fused: FusedLink | None = None  # batch_grad="sum": where the weight sum goes

    def release(self) -> None:
        """Drop captured tensors and make the output hooks inert."""
        self.args = self.kwargs = None
        self.grads = []
        self.versions = []
        self.done = True
        for handle in self.handles:
            handle.remove()
        self.handles = []


class HooksBackend(Backend):
    """Per-datum gradients from forward/tensor hooks and per-layer rules (see module doc)."""

    name = "hooks"

    def __init__(
        self,
        model: nn.Module,
        params: Mapping[str, nn.Parameter],
        *,
        batch_reduction: str,
        randomness: str,
        batch_grad: str = "autograd",
    ) -> None:
        super().__init__(model, params, batch_reduction=batch_reduction, randomness=randomness)
        if batch_grad not in BATCH_GRADS:
            raise BackendError(f"batch_grad={batch_grad!r} is not one of {list(BATCH_GRADS)}.")
        self.batch_grad = batch_grad
        self._entries: list[_Entry] = []
        self._sequence_first: list[str] = []  # modules with batch_first=False
        self._handles: list[Any] = []
        self._live: list[weakref.ref[_Call]] = []
        self._armed = False  # True only inside this backend's own backward
        self._recomputing = False  # True while a rule runs (torch.func re-runs modules)
        self._spot_rng = torch.Generator().manual_seed(0)  # never the global RNG: training's
        self._pool = _Pool()
        self._datum_checked: set[tuple[str, int, tuple[int, ...]]] = set()  # layouts checked
        self._probing = False  # inside the datum check's backward (_datum_probe)
        self._autocast: set[torch.dtype] = set()  # autocast dtypes the forward's calls ran in
        self._saved_tensor_hooks = False  # a call ran under saved-tensor hooks (checkpoints)
        self._foreign_functions = False  # the checked graph holds autograd Functions not ours
        self._reset(0)

    # -- lifecycle --------------------------------------------------------------------------
    def attach(self) -> None:
        """Hook every module that owns (or whose rule covers) a recorded parameter."""
        if self._handles:
            return
        if any(p.device.type == "cpu" for p in self.params.values()):
            keep_heap_resident()  # autograd's temporaries around our buffers: no page faults
        self._entries = self._plan()
        self._sequence_first = [
            name for name, m in self.model.named_modules()
            if getattr(m, "batch_first", True) is False
        ]
        for entry in self._entries:
            hook = functools.partial(self._on_forward, entry)
            self._handles.append(entry.module.register_forward_hook(hook, with_kwargs=True))
        for name, p in self.params.items():
            self._handles.append(p.register_hook(functools.partial(self._on_param_grad, name)))

    def detach(self) -> None:
        """Remove every hook gradlog installed and drop captured tensors."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for ref in self._live:
            call = ref()
            if call is not None:
                call.release()
        self._live = []
        self._entries = []
        self._pool = _Pool()  # let go of buffers kept for reuse

    @property
    def fused_params(self) -> frozenset[str]:
        """Recorded weights whose gradient is the sum of their records (``batch_grad="sum"``;
        known once attached)."""
        return frozenset(e.names["weight"] for e in self._entries if e.fused)

    def describe(self) -> dict[str, Any]:
        """Which module computes which recorded parameters, by which rule."""
        return {
            "name": self.name,
            "modules": [
                {"module": e.name, "class": type(e.module).__name__, "rule": e.rule.name,
                 "params": sorted(set(e.names.values()))}
                for e in self._entries
            ],
            "fallback": [e.name for e in self._entries if e.fallback],
            "batch_grad": self.batch_grad,
            "fused": [e.name for e in self._entries if e.fused],
        }

    def _plan(self) -> list[_Entry]:
        by_id = {id(p): n for n, p in self.params.items()}
        entries: list[_Entry] = []
        taken: set[tuple[int, str]] = set()  # (module, attr) computed by an ancestor's rule
        for mname, module in self.model.named_modules():
            _refuse_parametrization(mname, module, by_id)
            names: dict[str, str] = {}
            rule = find_rule(module)
            if rule is not None:
                for path, p in rule.covers(module).items():
                    if id(p) not in by_id or (id(module), path) in taken:
                        continue
                    names[path] = by_id[id(p)]
                    if "." in path:  # a child's parameter that this module's forward reads
                        owner, _, attr = path.rpartition(".")
                        taken.add((id(module.get_submodule(owner)), attr))
                if names:
                    entries.append(self._entry(module, mname, rule, names, fallback=False))
            rest = {
                attr: by_id[id(p)]
                for attr, p in module.named_parameters(recurse=False)
                if id(p) in by_id and (id(module), attr) not in taken and attr not in names
            }
            if rest:
                entries.append(self._entry(module, mname, GENERIC, rest, fallback=True))
        return entries

    def _entry(self, module: nn.Module, name: str, rule: Rule, names: dict[str, str],
               *, fallback: bool) -> _Entry:
        params = tuple(self.params[n] for n in dict.fromkeys(names.values()))
        fused = (self.batch_grad == "sum" and not fallback and "weight" in names
                 and rule.name in ("linear", "conv1d_gpt2") and fusable(module))
        # (a fallback entry of a layer whose own rule knows its forward: a pruned Linear)
        own = rule if not fallback else find_rule(module)
        hook_base = own is not None and own.views_own_result
        return _Entry(module, name, rule, names, params, fallback, fused, hook_base)

    # -- capture (forward) ------------------------------------------------------------------
    def _on_forward(self, entry: _Entry, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any], output: Any) -> Any:
        if self._recomputing or not torch.is_grad_enabled():
            return None
        if not any(p.requires_grad for p in entry.params):
            return None
        link: FusedLink | None = None
        if entry.fused and not kwargs and _current_chunk() is None and not isinstance(
                getattr(output, "grad_fn", None), torch.autograd.function.BackwardCFunction):
            # (an output another context re-rooted, e.g. gradlog.sparse, keeps its own backward)
            fused = fuse_output(module, args, output)
            if fused is not None:
                output, link = fused
        if _in_backward() and (not self._armed or _in_checkpoint_recompute()):
            # A checkpoint recompute: in a backward that is not recorded, or a non-reentrant
            # one, whose outputs never receive gradients (the original call's do). It is
            # re-rooted like the original call, which saved the same tensors.
            return output if link is not None else None
        replaced = link is not None
        if entry.fallback:
            aliased = _alias_outputs(output, [(t, 0) for t in leaves((args, kwargs))
                                              if isinstance(t, torch.Tensor)])
            if aliased is not None:
                output, replaced = aliased, True
        outputs = leaves(output)
        call: _Call | None = None
        seen: set[int] = set()
        for i, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor) or not t.requires_grad or id(t) in seen:
                continue
            seen.add(id(t))  # an output returned twice has one gradient: hook it once
            if call is None:
                call = _Call(entry, args, kwargs, len(outputs), i, t.shape)
                if t.grad_fn is not None:  # lets the pre-backward graph walk find this call
                    tags = cast(dict[str, Any], t.grad_fn.metadata)
                    tags.setdefault(_TAG, []).append((t.output_nr, call))
            on_grad = functools.partial(self._on_output_grad, call, i)
            if link is not None:  # FusedLinear.backward hands it over: no tensor hook needed
                link.on_grad = functools.partial(self._on_fused_grad, call, i)
            else:
                target = _made_base(t, call.versions) if (
                    entry.hook_base and i == call.primary) else t
                if target is not t:  # see _made_base: the view's own hook may never fire
                    geometry = (t.shape, t.stride(),
                                int(t.storage_offset() - target.storage_offset()))
                    on_grad = functools.partial(self._on_base_grad, call, i, geometry)
                call.handles.append(target.register_hook(on_grad))
            call.hooked += 1
        if call is None:
            return output if replaced else None
        call.fused = link
        narrow = _autocast_dtype(entry.params[0].device.type)
        if narrow is not None:  # (the datum check's tolerance)
            self._autocast.add(narrow)
        if not self._saved_tensor_hooks and _saved_tensor_hooks_on():  # (when it runs)
            self._saved_tensor_hooks = True
        chunk = _current_chunk()
        if chunk is not None and chunk.differentiated:
            call.chunk = chunk  # a head called on flattened rows by chunked_linear_loss
        rule = entry.rule
        if rule.refuse is not None:
            call.refusal = rule.refuse(module, args, kwargs)
        if call.refusal is None and rule.uses_torch_func:
            noisy = active_randomness(module)
            if noisy:
                call.refusal = (
                    f"it draws dropout masks in training mode (in {noisy}) and rule "
                    f"{rule.name!r} re-runs it per datum, which cannot reproduce the batch's "
                    "masks. Set that dropout to 0 or put the module in eval mode (the rest of "
                    "the model may stay in training mode), register a closed-form rule "
                    "(gradlog.rules.register_rule), or use backend='loop'."
                )
        self._live.append(weakref.ref(call))
        if len(self._live) % 256 == 0:
            self._live = [r for r in self._live if r() is not None]
        return output if replaced else None

    # -- backward ---------------------------------------------------------------------------
    def backward(self, losses: torch.Tensor, batch_loss: torch.Tensor) -> PerDatumGrads:
        if not self._handles:
            raise BackendError("the hooks backend is not attached; the recorder attaches it "
                               "when recording starts (use GradRecorder as a context manager).")
        check_differentiable(self.params, losses)  # before autograd's own, vaguer errors
        B = int(losses.shape[0])
        self._reset(B)
        self._pool.reclaim()
        try:
            self._refuse_double_backward()
            self._route_shared_outputs(batch_loss, B)  # may refuse, before p.grad is touched
            when = self._datum_check_mode(losses, batch_loss) if self._wants_datum_check(
                B) else None
            rng = _rng_states(self.model) if when is not None else None
            datum = self._datum_probe(losses, rng, keep_graph=True) if when == "before" else None
            self._armed = True
            try:
                # the ordinary backward: p.grad exactly as without gradlog (its graph kept for
                # a datum check after it, see _datum_check_mode)
                batch_loss.backward(retain_graph=True if when == "after" else None)
            finally:
                self._armed = False
                for handle in self._consumer_handles:
                    handle.remove()
            for call in self._partial:  # calls some of whose outputs got no gradient
                if not call.done:
                    self._finish(call)
            self._raise_error()
            materials = self._merge_materials()
            self._check_coverage()
            self._spot_check(materials)
            out = {
                name: materials[name] if name in materials
                else self._acc[name] if name in self._acc
                else torch.zeros((B, *p.shape), dtype=p.dtype, device=p.device)
                for name, p in self.params.items()
            }
            if when == "after":
                datum = self._datum_probe(losses, rng, keep_graph=False)  # (frees the graph)
            if datum is not None:
                self._check_datum(datum, out, trusted=not self._foreign_functions)
            return out
        finally:
            for call in self._touched:
                call.release()
            self._reset(0)
            self._autocast = set()  # (what the next forward runs under)
            self._saved_tensor_hooks = False
            self._pool.release()

    # -- one datum against its own backward ----------------------------------------------------
    def _wants_datum_check(self, B: int) -> bool:
        """Check one datum on the first backward, and again whenever a forward has a layout
        not checked yet that shapes alone cannot settle: a layer output with several leading
        dimensions of size B (a sequence-first tensor whose length equals the batch size), or
        a module called more than once (reuse, or once per datum by hand). A wrong split
        between datums still sums to ``p.grad``; one datum's own backward sees it."""
        if B < 2 or _distributed():  # (DDP's reducer expects one backward per forward)
            return False
        calls = [c for c in (r() for r in self._live) if c is not None and not c.done]
        uses: dict[int, int] = {}
        for c in calls:
            uses[id(c.entry)] = uses.get(id(c.entry), 0) + 1
        unsure: set[tuple[str, int, tuple[int, ...]]] = set()
        for c in calls:
            shape, features = tuple(c.out_shape), c.entry.rule.feature_dims
            lead = shape[: len(shape) - (features(c.entry.module) if features else 1)]
            at = tuple(k for k, n in enumerate(lead) if n == B)  # where the batch may be
            if len(at) > 1 or uses[id(c.entry)] > 1:
                unsure.add((c.entry.name, uses[id(c.entry)], at if len(at) > 1 else ()))
        if self._datum_checked and unsure <= self._datum_checked:
            return False
        self._datum_checked |= unsure | {("", 0, ())}
        return not self._foreign_backward_hooks()

    def _foreign_backward_hooks(self) -> bool:
        """Backward hooks of the user's own (on parameters or modules) would fire again in
        the datum check's extra backward, with side effects (gradient statistics): then no
        check. (Hooks on activations cannot be seen; README says so.)"""
        recorded = {id(p) for p in self.params.values()}
        for p in self.model.parameters():
            if len(p._backward_hooks or ()) > (1 if id(p) in recorded else 0):
                return True
        module_hooks = torch.nn.modules.module
        if getattr(module_hooks, "_global_backward_hooks", None) or getattr(
                module_hooks, "_global_backward_pre_hooks", None):
            return True
        return any(m._backward_hooks or m._backward_pre_hooks for m in self.model.modules())

    def _datum_check_mode(self, losses: torch.Tensor, batch_loss: torch.Tensor) -> str | None:
        """When the datum's own backward runs: ``"before"`` the batch's (then freed before
        the batch's backward allocates its per-datum gradients: no extra peak memory), or
        ``"after"`` it, on the kept graph, when a backward may use up state or draw random
        numbers (an autograd Function of the user's or a library's, saved-tensor hooks such as
        selective activation checkpointing): the batch's backward then runs first, exactly as
        without gradlog, and the check is skipped if autograd refuses the second backward.
        None: no check (a reentrant checkpoint refuses ``autograd.grad``)."""
        if losses.grad_fn is None or not any(p.numel() for p in self.params.values()):
            return None
        foreign = _graph_kinds(batch_loss.grad_fn)
        if foreign is None:
            return None
        self._foreign_functions = foreign
        return "after" if foreign or self._saved_tensor_hooks else "before"

    def _datum_probe(self, losses: torch.Tensor, rng: dict[str, torch.Tensor] | None,
                     keep_graph: bool) -> tuple[int, dict[str, tuple[Any, Any]]] | None:
        """``autograd.grad(losses[b])`` for a random datum b, kept at a few random entries per
        parameter; None when autograd refuses it (the check is then skipped). The global RNG
        is forked around it and set to ``rng``, its state before the batch's backward: random
        draws in a backward (an autograd Function's noise) draw what the batch's backward
        draws, and training's stream is left as it was."""
        names = [n for n, p in self.params.items() if p.numel()]
        b = int(torch.randint(losses.shape[0], (1,), generator=self._spot_rng))
        devices = _cuda_devices(self.model)
        self._probing = True  # the hooks let this backward pass (see _on_output_grad)
        try:
            with torch.random.fork_rng(devices=devices):
                _set_rng_states(rng)
                got = torch.autograd.grad(losses[b], [self.params[n] for n in names],
                                          retain_graph=keep_graph,
                                          allow_unused=True)
        except Exception as e:  # selective checkpointing ("backward an extra time"), a
            # Function whose backward uses up its state: no check (p.grad is unaffected)
            log.debug("gradlog: datum check skipped (%s: %s)", type(e).__name__, e)
            return None
        finally:
            self._probing = False
        sampled: dict[str, tuple[Any, Any]] = {}
        for name, grad in zip(names, got):
            p = self.params[name]
            index = torch.randint(p.numel(), (_DATUM_ENTRIES,), generator=self._spot_rng)
            index = index.to(p.device)
            sampled[name] = (index, None if grad is None else torch.take(grad, index))
        return b, sampled

    def _check_datum(self, datum: tuple[int, dict[str, tuple[Any, Any]]],
                     records: Mapping[str, Any], *, trusted: bool = True) -> None:
        """Datum b's records against its own gradient at the probe's entries. Not
        ``trusted`` (the graph holds autograd Functions gradlog does not know, whose second
        backward may differ: state used up, gradients scaled in place): a warning, not an
        error."""
        b, sampled = datum
        # Under autocast the datum's own backward runs in the narrow dtype through every
        # layer it crosses, recorded or not: one tolerance for all.
        narrow = max((torch.finfo(d).eps for d in (*self.low_precision.values(),
                                                   *self._autocast)), default=0.0)
        names, ours, theirs = list(sampled), [], []
        for name in names:
            index, theirs_k = sampled[name]
            mine = entries(records[name], index)[b].to(torch.float64)  # (k,)
            ours.append(mine)
            theirs.append(torch.zeros_like(mine) if theirs_k is None
                          else theirs_k.to(mine.device, torch.float64))  # (k,)
        dtype = max((self.params[n].dtype for n in names), key=lambda d: _SPOT_RTOL.get(d, 0))
        rtol, atol = _SPOT_RTOL.get(dtype, 1e-2), _SPOT_ATOL.get(dtype, 1e-4)
        rtol = max(rtol, LOW_PRECISION_RTOL * narrow)
        a = torch.stack([o.to(ours[0].device) for o in ours])  # (n, k)
        c = torch.stack([t.to(ours[0].device) for t in theirs])  # (n, k)
        scale = a.abs() + c.abs()  # (n, k)
        # as in _spot_check: a parameter whose true gradient is 0 holds rounding noise only,
        # so the tolerance also scales with the largest gradient seen
        over = ((a - c).abs() - rtol * (scale + scale.max()) - atol).amax(1)  # (n,)
        bad = [n for n, g in zip(names, over.tolist()) if g > 0]
        if bad and not trusted:
            warnings.warn(
                f"gradlog's datum check: the per-datum gradients of {bad[:6]} for datum {b} "
                f"differ from that datum's own gradient (autograd.grad of losses[{b}]). The "
                "graph holds autograd Functions gradlog does not know, whose second backward "
                "may differ from the first, so this may be a false alarm; if one datum's loss "
                "depends on other datums, or a layer runs sequence-first with sequence length "
                "equal to the batch size, the records are wrong: compare with backend='loop'.",
                stacklevel=6,  # the caller of GradRecorder.backward
            )
            return
        if bad:
            raise BackendError(
                f"the per-datum gradients of {bad[:6]} for datum {b} of the batch differ from "
                f"that datum's own gradient (autograd.grad of losses[{b}]). Likely causes: "
                "(1) one datum's loss depends on the other datums of the batch (in-batch "
                "negatives of a contrastive loss, a loss normalised over the batch): the "
                "hooks backend then gives each datum's share of the batch gradient, not "
                "d losses[b] / d theta; (2) a layer ran on a layout where gradlog mistook "
                "the batch dimension (a sequence-first tensor whose sequence length equals "
                "the batch size, a layer called once per datum by hand). p.grad is complete; "
                "nothing of this step was recorded. Use backend='loop', or for (2) a batch "
                "size different from the sequence length."
            )

    def _refuse_double_backward(self) -> None:
        twice = {c.entry.label for c in (r() for r in self._live)
                 if c is not None and c.twice and not c.done}
        if twice:
            raise UnsupportedLayerError(
                f"the loss differentiates a gradient taken through {sorted(twice)} "
                "(autograd.grad(..., create_graph=True) before the backward, e.g. a gradient "
                "penalty): its per-datum gradients include second-order terms that the hooks "
                "backend's per-layer rules do not see. Nothing was computed; p.grad is "
                "untouched. Use backend='loop' for this loss."
            )

    def _reset(self, batch_size: int) -> None:
        if batch_size:
            self.low_precision = {}
        self._batch = batch_size
        self._scale = float(batch_size) if self.batch_reduction == "mean" else 1.0
        self._acc: dict[str, torch.Tensor] = {}
        self._material: dict[str, list[Factors | Rows]] = {}  # see _keep
        self._covered: set[str] = set()
        self._got_grad: set[str] = set()
        self._partial: list[_Call] = []
        self._touched: list[_Call] = []
        self._consumer_handles: list[Any] = []
        self._error: tuple[_Entry, BaseException] | None = None
        self._spot_total: dict[str, torch.Tensor] = {}
        self._spot_index: dict[str, torch.Tensor] = {}
        if batch_size and self.params:
            sizes = torch.tensor([p.numel() for p in self.params.values()], dtype=torch.float64)
            draw = torch.rand((len(sizes), _SPOT_ENTRIES), generator=self._spot_rng,
                              dtype=torch.float64)
            index = (draw * sizes.unsqueeze(1)).long()  # (n_params, k) flat entries
            devices = {p.device for p in self.params.values()}
            on = {d: index.to(d, non_blocking=True).unbind(0) for d in devices}  # rows (k,)
            for i, (name, p) in enumerate(self.params.items()):
                if p.numel():
                    self._spot_index[name] = on[p.device][i]

    def _on_param_grad(self, name: str, grad: torch.Tensor) -> None:
        if not self._armed:
            return
        self._got_grad.add(name)
        index = self._spot_index.get(name)
        if index is not None and not grad.is_sparse:
            # A few entries of this backward's gradient of the parameter (summed over its
            # uses), to check against the per-datum gradients (see _spot_check).
            seen = torch.take(grad.detach() if grad.requires_grad else grad, index)  # (k,)
            prior = self._spot_total.get(name)
            self._spot_total[name] = seen if prior is None else prior + seen

    def _on_fused_grad(self, call: _Call, i: int, grad: torch.Tensor) -> bool:
        """A fused call's output gradient (from FusedLinear.backward); False when it was let
        pass (the datum check's backward): the call then keeps this handler for the batch's."""
        if self._probing:
            return False
        self._on_output_grad(call, i, grad)
        return True

    def _on_output_grad(self, call: _Call, i: int, grad: torch.Tensor) -> None:
        # (a tensor hook: returns None, or autograd would take the result as the gradient)
        if self._probing or call.done or call.via_consumers:
            return
        if not self._armed:  # a backward gradlog does not record: just let go of the inputs
            if torch.is_grad_enabled():
                # create_graph=True (a gradient penalty in the loss): the recorded backward
                # will differentiate this gradient; kept to refuse it (_refuse_double_backward)
                call.twice = True
            else:
                call.release()
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

    def _on_base_grad(self, call: _Call, i: int,
                      geometry: tuple[torch.Size, tuple[int, ...], int],
                      grad: torch.Tensor) -> None:
        """The gradient of the base of output ``i`` (see :func:`_made_base`), viewed as the
        output: the output's gradient."""
        size, stride, offset = geometry
        self._on_output_grad(call, i, grad.contiguous().as_strided(size, stride, offset))

    def _finish(self, call: _Call) -> None:
        self._compute(call, call.grads)
        call.release()

    def _compute(self, call: _Call, grads: list[torch.Tensor | None], *,
                 args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None,
                 expanded: bool = False) -> None:
        """Run the call's rule and add its per-datum gradients; errors are kept for later
        (raising inside the autograd engine would leave ``p.grad`` half accumulated)."""
        entry = call.entry
        if self._error is not None or call.args is None or call.kwargs is None:
            return
        try:
            self._check_versions(call)
            if call.refusal is not None:
                raise UnsupportedLayerError(call.refusal)
            args = call.args if args is None else args
            kwargs = call.kwargs if kwargs is None else kwargs
            rows: slice | None = None  # the datums a chunk of rows belongs to
            if call.chunk is not None:
                batch, rows, args, kwargs, grads = _chunk_as_datums(
                    call.chunk, entry, self._batch, args, kwargs, grads)
            elif call.lead is None and not expanded:
                self._locate_batch(call, self._batch)  # a call captured during the backward
            if call.bd != 0 and entry.rule.feature_dims is not None:
                args, kwargs, grads = _batch_first(call.bd, self._batch, args, kwargs, grads)
            cap = Capture(
                args=args,
                kwargs=kwargs,
                grads=tuple(grads),
                batch_size=self._batch if rows is None else batch,
                scale=self._scale,
                expanded=expanded,
                alloc=self._pool.empty,
                factored=self._factored(entry) if rows is None else frozenset(),
            )
            self._recomputing = True
            grad_mode = torch.is_grad_enabled()  # off already in a backward without create_graph
            try:
                if grad_mode:
                    torch.set_grad_enabled(False)
                with _no_autocast(entry.params[0].device.type):
                    result = entry.rule.compute(entry.module, cap, entry.wanted)
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
            narrow = _narrow_dtype(grads, entry.params)
            if narrow is not None:  # the layer ran in autocast's dtype: p.grad is rounded
                for name in entry.names.values():
                    self.low_precision[name] = narrow
        except Exception as e:  # re-raised after the backward, with p.grad complete
            self._error = (entry, e)

    def _add(self, entry: _Entry, result: RuleResult, cap: Capture,
             rows: slice | None = None) -> None:
        """Add a rule's result into the per-datum accumulators: all B datums, or ``rows``
        (the datums a chunk of rows covers, ``cap.batch_size`` of them)."""
        B = self._batch
        n = cap.batch_size
        first = 0 if rows is None else rows.start
        for attr, value in result.items():
            name = entry.names.get(attr)
            if name is None:
                raise BackendError(f"rule {entry.rule.name!r} returned {attr!r}, which is not "
                                   f"among the parameters it was asked for: {sorted(entry.names)}")
            p = self.params[name]
            acc = self._acc.get(name)
            if self._keep(name, value, n):
                continue
            if isinstance(value, Rows):
                index, values = value.index, value.values
                if index.dim() != 2 or index.shape[0] != n or p.dim() == 0 or tuple(
                        values.shape) != (*index.shape, *p.shape[1:]):
                    raise BackendError(
                        f"rule {entry.rule.name!r} returned rows of shape {tuple(values.shape)} "
                        f"at indices {tuple(index.shape)} for {name!r} {tuple(p.shape)}; "
                        f"expected indices (B={n}, N) and rows (B, N, *{tuple(p.shape[1:])})."
                    )
                if acc is None:
                    acc = self._pool.empty((B, *p.shape), p.dtype, p.device).zero_()
                    self._acc[name] = acc
                V = p.shape[0]
                datum = torch.arange(first, first + n, device=index.device).unsqueeze(1)  # (n, 1)
                flat = (index + datum * V).reshape(-1)  # (n*N,) rows of acc viewed (B*V, -1)
                acc.view(B * V, -1).index_add_(
                    0, flat, values.reshape(flat.numel(), -1).to(p.dtype), alpha=value.scale)
            else:
                if tuple(value.shape) != (n, *p.shape):
                    raise BackendError(
                        f"rule {entry.rule.name!r} returned per-datum gradients of shape "
                        f"{tuple(value.shape)} for {name!r}; expected {(n, *p.shape)} (batch "
                        f"dimension B={n} first). A shared, unbatched input was taken for a "
                        "datum; please report this with the model."
                    )
                if value.dtype != p.dtype:
                    value = value.to(p.dtype)
                if rows is not None:  # a chunk's datums only
                    if acc is None:
                        acc = self._pool.empty((B, *p.shape), p.dtype, p.device).zero_()
                        self._acc[name] = acc
                    acc[rows].add_(value)
                elif acc is None:
                    if not value.is_contiguous() or _shares_memory(value, cap):
                        # never alias autograd's tensors: later calls add into this one
                        value = value.clone(memory_format=torch.contiguous_format)
                    self._acc[name] = value
                else:
                    acc.add_(value)
        self._covered.update(entry.names.values())

    # -- material for compact forms (gradlog.forms) ------------------------------------------
    def _factored(self, entry: _Entry) -> frozenset[str]:
        """Attributes of the entry whose rule may hand over factors (their form is not
        ``full``; chunked heads never: their calls cover slices of the batch)."""
        if not self.keep_material:
            return frozenset()
        return frozenset(a for a, n in entry.names.items() if n in self.keep_material)

    def _keep(self, name: str, value: Any, n: int) -> bool:
        """Keep factors or sparse rows of a parameter whose form is not ``full`` as they
        are (merged by :meth:`_merge_materials`); False: add ``value`` densely."""
        if name not in self.keep_material:
            if isinstance(value, Factors):
                raise BackendError(f"internal: factors of {name!r}, whose form is full.")
            return False
        if isinstance(value, Rows):
            p = self.params[name]
            if value.index.dim() != 2 or value.index.shape[0] != n or tuple(
                    value.values.shape) != (*value.index.shape, *p.shape[1:]):
                return False  # the dense path reports the shapes
            value = Rows(value.index, value.values.to(p.dtype), int(p.shape[0]), value.scale)
        elif not isinstance(value, Factors):
            return False
        if n != self._batch:
            raise BackendError(f"internal: material of {n} datums for {name!r} (B={self._batch}).")
        self._material.setdefault(name, []).append(value)
        return True

    def _merge_materials(self) -> dict[str, Factors | Rows | torch.Tensor]:
        """One material per parameter kept as factors or rows: several calls (reuse)
        concatenate along the token axis; a parameter that also got dense parts (a tied
        embedding and head) or both kinds is densified and added up."""
        out: dict[str, Factors | Rows | torch.Tensor] = {}
        for name, parts in self._material.items():
            kinds = {type(m) for m in parts}
            if name in self._acc or len(kinds) > 1:
                acc = self._acc.get(name)
                for m in parts:
                    acc = m.dense() if acc is None else acc.add_(m.dense())
                assert acc is not None
                out[name] = self._acc[name] = acc
            elif len(parts) == 1:
                out[name] = parts[0]
            elif kinds == {Factors}:
                fs = [cast(Factors, m).canonical() for m in parts]
                out[name] = Factors(torch.cat([f.g for f in fs], 1),
                                    torch.cat([f.a for f in fs], 1))
            else:
                rs = [cast(Rows, m) for m in parts]
                values = [r.values * r.scale if r.scale != 1.0 else r.values for r in rs]
                out[name] = Rows(torch.cat([r.index for r in rs], 1), torch.cat(values, 1),
                                 rs[0].num_rows)
            self._covered.add(name)
        return out

    def _check_versions(self, call: _Call) -> None:
        for t, version in call.versions:
            if t._version != version:
                raise BackendError(
                    f"an input of {call.entry.label} was modified in place after the module "
                    f"used it (tensor version {version} -> {t._version}), so its per-datum "
                    "gradients would use the changed values. Avoid the in-place op on that "
                    "input (e.g. an inplace activation after it), or use backend='loop'."
                )

    def _raise_error(self) -> None:
        if self._error is None:
            return
        entry, e = self._error
        where = (f"gradlog could not compute per-datum gradients of {entry.label} "
                 f"(rule {entry.rule.name!r}): ")
        if isinstance(e, GradlogError):
            raise type(e)(where + str(e)) from e
        raise BackendError(
            where + f"{type(e).__name__}: {e}. p.grad is complete (the ordinary backward ran); "
            "use backend='loop' for this model and please report this."
        ) from e

    def _check_coverage(self) -> None:
        missed = [n for n in self.params if n in self._got_grad and n not in self._covered]
        if not missed:
            return
        owners = {n: [e.label for e in self._entries if n in e.names.values()] for n in missed}
        raise BackendError(
            f"parameter(s) {missed} received a gradient, but no hooked module call used them "
            f"(owners: {owners}): they were used outside the forward of the module that owns "
            "them, e.g. F.linear(x, self.embed.weight) in a parent. Call the owning module "
            "instead, register a rule covering them for the module whose forward uses them "
            "(gradlog.rules.register_rule(..., covers=...)), or use backend='loop'."
        )

    def _spot_check(self, materials: Mapping[str, Any]) -> None:
        """``sum_b w_b g_b`` against the parameter's gradient in this backward, at a few random
        entries per parameter: catches uses the hooks did not see (a parameter also used by
        hand in a parent's forward) on every step, for the cost of reading B x k numbers and
        one device sync. The recorder's full self-check runs every ``check_every`` steps."""
        weight = 1.0 / self._scale
        names, rows, totals = [], [], []
        for name, total in self._spot_total.items():
            acc = materials.get(name, self._acc.get(name))
            if acc is not None:  # (no contribution at all: _check_coverage reported it)
                names.append(name)
                rows.append(entries(acc, self._spot_index[name]))  # (B, k)
                totals.append(total)  # (k,)
        if not names:
            return
        if len({(r.dtype, r.device) for r in rows + totals}) > 1:  # cat needs one kind
            rows = [r.to(torch.float64) for r in rows]
            totals = [t.to(torch.float64) for t in totals]
        dtype = max((self.params[n].dtype for n in names), key=lambda d: _SPOT_RTOL.get(d, 0))
        rtol, atol = _SPOT_RTOL.get(dtype, 1e-2), _SPOT_ATOL.get(dtype, 1e-4)
        narrow = [self.low_precision[n] for n in names if n in self.low_precision]
        if narrow:  # autocast: autograd's gradient is rounded (see LOW_PRECISION_RTOL)
            rtol = max(rtol, LOW_PRECISION_RTOL * max(torch.finfo(d).eps for d in narrow))
        ours = torch.cat(rows, 1).to(torch.float64)  # (B, n*k)
        total = torch.cat(totals).to(torch.float64)  # (n*k,)
        gap = (ours.sum(0) * weight - total).abs()  # (n*k,)
        scale = ours.abs().sum(0) * weight + total.abs()  # (n*k,)
        # Floor: a parameter whose true gradient is 0 (a key bias under softmax) holds only
        # rounding noise, so the tolerance also scales with the largest gradient seen.
        over = gap - rtol * (scale + scale.max()) - atol  # (n*k,) > 0: does not add up
        over = over.reshape(len(names), -1).amax(1)  # (n,)
        if not bool((over > 0).any()):  # the only device sync of the backward
            return
        bad = [n for n, g in zip(names, over.tolist()) if g > 0]
        raise BackendError(
            f"the per-datum gradients of {bad} do not add up to their gradient in this "
            "backward (spot check of a few entries: sum_b w_b g_b != the gradient autograd "
            "accumulated): part of their use was not seen by gradlog's hooks, e.g. a "
            "parameter also used by hand in a parent's forward (F.linear(x, self.emb.weight)),"
            " or a rule is wrong. p.grad is complete. Call the owning module for every use, "
            "register a rule covering the parameter for the module whose forward uses it, or "
            "use backend='loop'."
        )

    # -- shared (broadcast) outputs ---------------------------------------------------------
    def _route_shared_outputs(self, batch_loss: torch.Tensor, B: int) -> None:
        """Before the backward: settle each captured call's batch dimension, and for calls
        whose output an op broadcasts over the batch, take their per-datum output gradients
        from that op (see the module docstring). Refuses what cannot be computed."""
        live = [c for c in (r() for r in self._live)
                if c is not None and not c.done and c.args is not None]
        self._live = [weakref.ref(c) for c in live]
        if not live or batch_loss.grad_fn is None:
            return
        # Node._input_metadata (shapes of a node's forward outputs) tells exactly which
        # captured outputs an op broadcast; without it (older torch) a shape heuristic picks
        # the calls to check, and any call reaching the loss only through pass-through ops
        # counts as shared.
        exact = hasattr(batch_loss.grad_fn, "_input_metadata")
        if exact:
            candidates = live
        else:
            for call in live:
                self._locate_batch(call, B)
            widest = max((len(c.out_shape) for c in live if c.lead == B), default=0)
            candidates = [c for c in live if c.lead != B or len(c.out_shape) < widest
                          or c.refusal is not None]
        if not candidates:
            return
        consumers = _find_consumers(batch_loss.grad_fn, {id(c) for c in candidates})
        for call in candidates:
            found = consumers.get(id(call))
            if not found:
                continue  # not part of this graph (an earlier forward)
            entry = call.entry
            if call.refusal is not None:
                raise UnsupportedLayerError(
                    f"gradlog cannot compute per-datum gradients of {entry.label} (rule "
                    f"{entry.rule.name!r}): {call.refusal} Nothing was computed; p.grad is "
                    "untouched."
                )
            passing = all(type(node).__name__ in _PASS_THROUGH for node, _ in found)
            shape = tuple(call.out_shape)
            if exact:
                shared = any(type(node).__name__ in _PASS_THROUGH and _out_shape(node) != shape
                             for node, _ in found)
            else:
                shared = passing
            batch_first = entry.rule.feature_dims is not None or call.bd == 0
            if shared and passing and batch_first and call.hooked == 1:
                call.bd, call.lead = 0, B  # the consumer's gradient has the batch first
                call.via_consumers = True
                self._touched.append(call)
                for node, slot in found:
                    hook = functools.partial(self._on_consumer_grad, call, _factor(node, slot))
                    self._consumer_handles.append(node.register_prehook(hook))
                continue
            if exact:
                self._locate_batch(call, B)
            if shared or call.lead != B:
                ops = sorted({type(node).__name__ for node, _ in found})
                raise BackendError(
                    f"the output of {entry.label} has shape {shape}, with no batch dimension "
                    f"of size B={B} of its own, and reaches the loss through {ops}. gradlog "
                    "takes per-datum gradients of a shared output only when additions, "
                    "subtractions or expands alone broadcast it over the batch (position "
                    "embeddings). Give the layer a batched input (e.g. "
                    "position_ids.expand(B, -1)), keep the batch as one dimension (a Linear "
                    "accepts (B, T, d); do not flatten to (B*T, d)), give one loss per row the "
                    "layer saw (a batch of two views concatenated to 2B rows makes 2B datums), "
                    "or use backend='loop'."
                )

    def _locate_batch(self, call: _Call, B: int) -> None:
        """Settle the call's batch dimension: fixed by its rule, or, for layers that treat
        leading dimensions alike, the leading dimension of size B (dim 0 if it is one)."""
        entry, shape = call.entry, call.out_shape
        features = entry.rule.feature_dims
        if features is not None:
            leading = list(shape[: max(0, len(shape) - features(entry.module))])
            found = [k for k, n in enumerate(leading) if n == B]
            call.bd = 0 if not found or found[0] == 0 else found[0]
            if len(found) > 1 and found[0] == 0 and self._sequence_first and B > 1:
                raise BackendError(
                    f"{entry.label} has output shape {tuple(shape)}: with sequence-first "
                    f"layers in the model ({self._sequence_first[:3]}), either of its first "
                    f"dimensions may be the batch (B={B}), and gradlog cannot tell which. Use "
                    "a batch size different from the sequence length, batch_first=True "
                    "layers, or backend='loop'."
                )
        call.lead = shape[call.bd] if len(shape) > call.bd else None

    def _on_consumer_grad(self, call: _Call, factor: float,
                          grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        g = grad_outputs[0] if grad_outputs else None
        if not self._armed or g is None or call.args is None or self._error is not None:
            return
        B, shape = self._batch, tuple(call.out_shape)
        extra = g.dim() - len(shape)
        if extra < 0 or g.dim() == 0 or g.shape[0] != B:
            self._error = (call.entry, BackendError(
                f"its output {shape} is broadcast over the batch in more than one step (the "
                f"consumer's gradient has shape {tuple(g.shape)}, not (B={B}, ...)). Give the "
                "layer a batched input (e.g. position_ids.expand(B, -1)) or use backend='loop'."
            ))
            return
        if extra == 0:  # the output has a batch dimension of size 1 (or B)
            per = g.sum_to_size((B, *shape[1:]))  # (B, *shape[1:])
            expand = shape[0] != B

            def batched(t: torch.Tensor) -> torch.Tensor:
                return t.expand(B, *t.shape[1:]) if t.dim() and t.shape[0] == 1 else t
        else:  # the output has no batch dimension: it is shared whole by every datum
            per = g.sum_to_size((B,) + (1,) * (extra - 1) + shape).reshape(B, *shape)
            expand = True

            def batched(t: torch.Tensor) -> torch.Tensor:
                return t.unsqueeze(0).expand(B, *t.shape)
        if factor != 1.0:
            per = per * factor
        args, kwargs = call.args, call.kwargs
        if expand:
            parts, rebuild = flatten((call.args, call.kwargs))
            args, kwargs = rebuild([batched(t) if isinstance(t, torch.Tensor) else t
                                    for t in parts])
        grads: list[torch.Tensor | None] = [None] * len(call.grads)
        grads[call.primary] = per
        self._compute(call, grads, args=args, kwargs=kwargs, expanded=expand)


def _chunk_as_datums(
    chunk: Any, entry: _Entry, B: int, args: tuple[Any, ...], kwargs: dict[str, Any],
    grads: list[torch.Tensor | None],
) -> tuple[int, slice, tuple[Any, ...], dict[str, Any], list[torch.Tensor | None]]:
    """Lay out a chunk of flattened rows (rows ``start:stop`` of ``(B, T)`` flattened, from
    :func:`gradlog.memory.chunked_linear_loss`) as ``(datums spanned, T, ...)``, zero-padded
    where the chunk starts or ends inside a datum (zero inputs and gradients add nothing).
    Returns the number of datums, their slice, and the re-laid arguments and gradients."""
    if entry.rule.feature_dims is None:
        raise UnsupportedLayerError(
            f"rule {entry.rule.name!r} cannot take the flattened rows of chunked_linear_loss "
            "(only row-wise layers such as Linear can); call the layer unchunked or use "
            "backend='loop'."
        )
    lead = tuple(chunk.lead_shape)
    if not lead or lead[0] != B:
        raise BackendError(
            f"chunked_linear_loss ran on rows of shape {lead} for a batch of B={B} datums; "
            "its input must keep the batch first, e.g. hidden states (B, T, d)."
        )
    per = 1
    for n in lead[1:]:
        per *= n  # rows per datum
    start, stop = chunk.start, chunk.stop
    first, last = start // per, (stop - 1) // per + 1
    offset, n_rows = start - first * per, stop - start

    def as_datums(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n_rows:
            return t
        full = t.new_zeros(((last - first) * per, *t.shape[1:]))  # (datums*T, ...)
        full[offset : offset + n_rows] = t
        return full.view(last - first, per, *t.shape[1:])  # (datums, T, ...)

    parts, rebuild = flatten((args, kwargs))
    new_args, new_kwargs = rebuild([as_datums(t) for t in parts])
    return last - first, slice(first, last), new_args, new_kwargs, [as_datums(g) for g in grads]


def _batch_first(
    bd: int, B: int, args: tuple[Any, ...], kwargs: dict[str, Any],
    grads: list[torch.Tensor | None],
) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor | None]]:
    """Move batch dimension ``bd`` first in the tensors that have it (sequence-first calls)."""

    def first(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > bd and t.shape[bd] == B:
            return t.movedim(bd, 0)
        return t

    parts, rebuild = flatten((args, kwargs))
    new_args, new_kwargs = rebuild([first(t) for t in parts])
    return new_args, new_kwargs, [first(g) for g in grads]


class _Pool:
    """CPU buffers for per-datum results, reused by a later backward once gradlog holds the
    only reference to them (the caller has let go of that step's gradients: written, copied
    or dropped). Fresh CPU memory is page-faulted in on first touch, and glibc hands large
    freed blocks back to the system, so without reuse every step pays the faults again
    (measured: ~10 ms of a 55 ms step of the small GPT). A buffer that anyone still holds (the
    returned dict, a numpy view, a slice, a writer queue) is never reused while held, but is
    watched for :data:`_WATCH` more backwards: the recorder's writer lets go of a step's
    gradients a step or two later, and reusing them then saves faulting in a whole step of
    fresh memory (422 MiB for the medium GPT). Off CPU, torch's caching allocator already
    reuses memory and the pool stays out of the way."""

    def __init__(self) -> None:
        self._lent: list[tuple[torch.Tensor, int]] = []  # (buffer, backwards it was held)
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def reclaim(self) -> None:
        """Make buffers handed out earlier, and now held by nobody else, available again;
        keep watching the others for a few backwards, then forget them (their holders free
        them as usual)."""
        free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        lent, self._lent = self._lent, []
        while lent:
            t, held = lent.pop()
            if _BASELINE is not None and _references(t) == _BASELINE:  # as in _calibrate
                free.setdefault((tuple(t.shape), t.dtype), []).append(t)
            elif _BASELINE is not None and held < _WATCH:
                self._lent.append((t, held + 1))
            del t
        self._free = free

    def release(self) -> None:
        """Drop the buffers this backward did not reuse (the batch size or model changed)."""
        self._free = {}

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """An uninitialised tensor, from the pool where possible."""
        if device.type != "cpu" or _BASELINE is None:
            return torch.empty(shape, dtype=dtype, device=device)
        stack = self._free.get((tuple(shape), dtype))
        t = stack.pop() if stack else torch.empty(shape, dtype=dtype, device=device)
        self._lent.append((t, 0))
        return t


_WATCH = 3  # backwards a held pool buffer is watched for its holder to let go


def _references(t: torch.Tensor) -> tuple[int, int]:
    """(Python references to ``t``, references to its storage), as seen by a caller that
    holds ``t`` in exactly one local variable."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    storage = count(t.untyped_storage()._cdata) if count is not None else -1
    return sys.getrefcount(t), storage


def _calibrate() -> tuple[int, int] | None:
    """The counts of a tensor only the pool holds, measured on this interpreter and torch
    exactly the way _Pool.reclaim measures them; None (no reuse) if they cannot be read."""
    lent = [torch.empty(1)]
    t = lent.pop()
    refs = _references(t)
    return None if refs[1] < 0 else refs


_BASELINE = _calibrate()


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs ``device_type`` ops in here, or None when it is off (or this
    torch cannot say)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # torch without these signatures
        return None


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Rules compute in the parameters' dtype even if the caller's backward runs in autocast."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return contextlib.nullcontext()
    except TypeError:  # torch without the device_type argument: always disable it
        pass
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type without autocast support
        return contextlib.nullcontext()


def _narrow_dtype(grads: list[torch.Tensor | None],
                  params: tuple[nn.Parameter, ...]) -> torch.dtype | None:
    """The dtype of the call's output gradients if it is a narrower floating dtype than its
    parameters' (the layer ran under autocast), else None."""
    dtype = params[0].dtype
    if all(g is None or g.dtype == dtype for g in grads) and all(
            p.dtype == dtype for p in params):
        return None  # the usual case, without finfo lookups
    bits = min((torch.finfo(p.dtype).bits for p in params if p.is_floating_point()), default=0)
    for g in grads:
        if g is not None and g.is_floating_point() and torch.finfo(g.dtype).bits < bits:
            return g.dtype
    return None


def _alias_outputs(output: Any, inputs: list[tuple[torch.Tensor, int]]) -> Any:
    """A module whose outputs feed each other (``nn.LSTMCell``: ``h = o * tanh(c)``): the
    gradient autograd gives output ``c`` includes the path through ``h``, which the
    ``torch.func`` fallback counts again from ``h``'s gradient. The outputs another output
    was computed from are handed to the caller as aliases (``view_as``), whose hooks get
    only the gradient from outside the module. None when no output feeds another (the usual
    case: outputs stay as they are, and an in-place op on them keeps their hooks)."""
    flat, rebuild = flatten(output)
    outs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if len(outs) < 2:
        return None
    fed = _outputs_feeding_others(outs, inputs)
    if not fed:
        return None
    return rebuild([t.view_as(t) if any(t is f for f in fed) else t for t in flat])


def _outputs_feeding_others(outs: list[torch.Tensor],
                            inputs: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """The outputs whose autograd edge another output's history reaches inside the call
    (the walk stops at the call's inputs and at leaves)."""
    edges = {(id(t.grad_fn), t.output_nr): t for t in outs if t.grad_fn is not None}
    stop = {id(x.grad_fn) for x, _ in inputs if x.grad_fn is not None}
    fed: list[torch.Tensor] = []
    for t in outs:
        if t.grad_fn is None:
            continue
        stack, seen, keep = [t.grad_fn], {id(t.grad_fn)}, [t.grad_fn]
        while stack:
            node = stack.pop()
            for child, nr in node.next_functions:
                if child is None:
                    continue
                hit = edges.get((id(child), nr))
                if hit is not None and hit is not t and not any(hit is f for f in fed):
                    fed.append(hit)
                if id(child) not in seen and id(child) not in stop:
                    seen.add(id(child))
                    keep.append(child)
                    stack.append(child)
    return fed


def _graph_kinds(root: Any) -> bool | None:
    """For the datum check: None when the graph holds a ``torch.utils.checkpoint(
    use_reentrant=True)`` segment (its backward refuses ``autograd.grad``); else whether it
    holds a Python autograd Function other than gradlog's own (whose backward might use up
    state on a first backward or draw random numbers)."""
    foreign = False
    for node in graph_nodes(root):
        if "CheckpointFunction" in type(node).__name__:
            return None
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            owner = getattr(getattr(node, "_forward_cls", None), "__module__", "")
            # (torch's own, e.g. torch.compile's compiled regions, are trusted as gradlog's)
            foreign = foreign or not owner.startswith(("gradlog.", "torch."))
    return foreign


def _cuda_devices(model: nn.Module) -> list[int]:
    """The CUDA devices of the model's parameters and buffers (a model split across devices
    draws random numbers on each)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _rng_states(model: nn.Module) -> dict[str, torch.Tensor]:
    """The global RNG states (CPU, and the model's CUDA devices)."""
    states = {"cpu": torch.get_rng_state()}
    for index in _cuda_devices(model):
        states[f"cuda:{index}"] = torch.cuda.get_rng_state(index)
    return states


def _set_rng_states(states: dict[str, torch.Tensor] | None) -> None:
    for where, state in (states or {}).items():
        if where == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, int(where.split(":")[1]))


def _saved_tensor_hooks_on() -> bool:
    """Whether saved-tensor hooks are on (non-reentrant or selective activation
    checkpointing, offloading): their unpacking may be allowed once only."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: assume so (the check then runs after the backward)
    try:
        hooks = top(False)
    except TypeError:  # a torch whose binding takes no argument
        hooks = top()
    except RuntimeError:
        return True
    return bool(hooks and hooks[0] is not None)


def _distributed() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def _made_base(t: torch.Tensor, inputs: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Where to hook output ``t`` of a layer with a built-in rule: ``t``, or, when ``t`` is a
    view of a whole tensor the call made (a Linear on ``(B, T, d)`` views its 2-D matmul's
    result; ``MultiheadAttention(batch_first=True)`` transposes its projection's), that
    tensor. An in-place op on the view (``ReLU(inplace=True)`` after the layer) rebuilds the
    view's autograd history and drops a hook on ``t``; the base keeps its own, which receives
    the gradient of the output as the layer returned it. (The built-in layers use that
    tensor only through the view, so its gradient is the output's.)"""
    base = t._base
    if (base is None or base.grad_fn is None or base.numel() != t.numel()
            or not base.is_contiguous()):
        return t
    if any(base is x or base is x._base for x, _ in inputs):  # a view of an input
        return t
    return base


def _refuse_parametrization(name: str, module: nn.Module, recorded: Mapping[int, str]) -> None:
    """Refuse recorded parameters held by ``torch.nn.utils.parametrize`` (e.g.
    ``parametrizations.weight_norm``): the layer's rule gives the gradient of the weight the
    parametrization computes, not of its originals, and the chain through it per datum is
    not built."""
    if type(module).__name__ != "ParametrizationList":
        return
    held = [recorded[id(p)] for p in module.parameters() if id(p) in recorded]
    if held:
        raise UnsupportedLayerError(
            f"parameter(s) {held} are the originals of a torch.nn.utils.parametrize "
            f"parametrization ({name!r}, e.g. parametrizations.weight_norm or orthogonal): the "
            "hooks backend cannot compute per-datum gradients through a parametrization. Use "
            "backend='vmap' or backend='loop', leave these parameters out with params=, or "
            "record the plain weight (torch.nn.utils.parametrize.remove_parametrizations)."
        )


def _find_consumers(root: Any, wanted: set[int]) -> dict[int, list[tuple[Any, int]]]:
    """Walk the autograd graph from ``root``: for each wanted call (by id), the (node, input
    slot) pairs that consume its tagged output."""
    found: dict[int, list[tuple[Any, int]]] = {}
    tags: dict[int, list[tuple[int, _Call]]] = {}
    stack, keep = [root], [root]  # keep: node wrappers alive, so their ids stay unique
    seen = {id(root)}
    while stack:
        node = stack.pop()
        for slot, (child, output_nr) in enumerate(node.next_functions):
            if child is None:
                continue
            key = id(child)
            if key not in seen:
                seen.add(key)
                keep.append(child)
                stack.append(child)
                tagged = child.metadata.get(_TAG)
                if tagged:
                    tags[key] = tagged
            for nr, call in tags.get(key, ()):
                if nr == output_nr and id(call) in wanted:
                    found.setdefault(id(call), []).append((node, slot))
    return found


def _out_shape(node: Any) -> tuple[int, ...]:
    """Shape of the forward output of autograd node ``node`` (its gradient's shape)."""
    return tuple(node._input_metadata[0].shape)


def _factor(node: Any, slot: int) -> float:
    """d(node output)/d(input ``slot``) of a pass-through node: 1, alpha or -alpha."""
    alpha = float(getattr(node, "_saved_alpha", 1.0))
    kind = type(node).__name__
    if kind == "AddBackward0" and slot == 1:
        return alpha
    if kind == "SubBackward0" and slot == 1:
        return -alpha
    return 1.0


def _shares_memory(value: torch.Tensor, cap: Capture) -> bool:
    """Whether ``value`` is a captured tensor or a view of one (a rule returned it as is)."""
    base = value if value._base is None else value._base
    tensors = [t for t in (*cap.grads, *cap.args, *cap.kwargs.values())
               if isinstance(t, torch.Tensor)]
    return any(base is t or base is t._base for t in tensors)
