"""Op-level capture: uses of recorded parameters that no hooked module call covers.

Module hooks see a parameter only where its module's forward uses it. A parameter can also
be used by hand elsewhere: a tied head in the parent's forward (``h @ self.wte.weight.T``,
``F.linear(h, self.embed.weight)``), PEFT's LoRA embedding (``lora_embedding_A`` in a
``ParameterDict`` that is never called, used through ``F.embedding`` in the LoRA layer's
forward), a sequence bias repeated over the batch (``bias.repeat(1, B, 1)``).

:class:`OpCapture` is a :class:`~torch.overrides.TorchFunctionMode`, pushed for the duration
of the model's own forward (a forward pre-hook and an always-called forward hook on the
root module). It sees every torch function call; a call that takes a recorded parameter, or
a view of one made in the forward (``W.T``, ``W.view(...)``: :data:`VIEWS`, tracked as
:class:`~gradlog.rules.ops.ParamUse`), while no call of a module whose hooks cover that
parameter is running, becomes a call of an op rule (:mod:`gradlog.rules.ops`): captured
like a module call (inputs kept, a hook on the output), computed in the backward. Closed
forms for ``linear``, ``matmul`` and ``embedding``; any other op falls back to a per-op
``torch.func`` vector-Jacobian product, never to a re-run of a whole module.

Cost, and when the mode is on. A ``TorchFunctionMode`` routes every torch call of the forward
through Python: on the small GPT of bench_compute.py (74 calls per forward) even an empty mode
costs ~2 ms of a 26 ms forward (CPU), ~3% of a recorded step. So with ``watch="auto"`` (the
default) it watches only the forwards that may hold a use no module covers:

- the first :data:`SCANS` forwards with grad, and every forward once one of them had such a
  use (the model's free uses are then all captured, always);
- otherwise, before each backward, the autograd graph tells each recorded parameter's uses
  (:meth:`~gradlog.backends.hooks.graph.GraphSurvey.uses`: calls of its covering modules, and
  graph edges into its gradient accumulator, one per op that took it: ~0.1 ms). Uses no
  watched forward (or checked backward) had, e.g. a parameter used by hand only on some
  steps, make that backward compare ``sum_b w_b g_b`` with **every** entry of ``p.grad``
  (:meth:`OpCapture.unverified`); a mismatch is refused, naming ``watch="always"``, and the
  next forward is watched; a match is learnt (:meth:`OpCapture.checked`).

So a use is captured or refused, never missed in silence. Uses outside the model's forward
(in the loss code) are never seen: the coverage and spot checks refuse them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from gradlog._torch_private import (
    InCompiledRegion,
    cuda_devices,
    force_eager,
    forked_rng,
    gradient_accumulator,
    rng_states,
    tensor_version,
)
from gradlog._tree import flatten
from gradlog.backends.hooks.calls import Entry
from gradlog.backends.hooks.graph import GraphSurvey
from gradlog.errors import UnsupportedLayerError
from gradlog.rules.base import held_tensors
from gradlog.rules.ops import ParamUse, Step, op_kind, op_rule

__all__ = ["SCANS", "VIEWS", "WATCH", "OpCapture"]

SCANS = 2
"""Forwards watched before the mode turns itself off (no free use seen in any)."""
WATCH = ("auto", "always")

_T: Any = torch.Tensor  # (its T/mT properties' getters are what __torch_function__ sees)
VIEWS: frozenset[Any] = frozenset({
    _T.T.__get__, _T.mT.__get__, _T.t, torch.t, _T.transpose, torch.transpose, _T.permute,
    torch.permute, _T.view, _T.reshape, torch.reshape, _T.unsqueeze, torch.unsqueeze,
    _T.squeeze, torch.squeeze, _T.contiguous, _T.to, _T.float, _T.double, _T.half,
    _T.bfloat16, _T.__getitem__, _T.narrow, torch.narrow, _T.flatten, torch.flatten,
    _T.unflatten, _T.clone, _T.movedim, torch.movedim, _T.swapaxes, _T.swapdims,
})
"""Ops whose output is a linear, shape-only function of their first argument: a recorded
parameter passed through them stays tracked (others, e.g. ``expand``/``repeat``, are ops of
their own, with a per-op rule)."""

_RANDOM = frozenset({F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d,
                     F.dropout2d, F.dropout3d, torch.dropout, torch.bernoulli,
                     _T.bernoulli, torch.rand_like, torch.randn_like})


_MASKED = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout})
"""Random ops whose output is their input times a scaled mask they draw."""


def _drawn_mask(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                before: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor | None:
    """The scaled mask a dropout (:data:`_MASKED`) of a parameter drew: the same draw
    again, from the states ``before`` it, on a tensor of ones like the parameter (the
    generators forked: training's stream is unchanged). None where its output is not its
    input times that mask. Held as a step of the parameter's use, the op is then
    deterministic: ``x * mask``, whose per-datum gradients are each datum's times the mask
    (DeBERTa's dropout on its relative position embeddings)."""
    x = args[0]
    with forked_rng(cuda_devices([x]), before), torch.no_grad():
        mask = func(torch.ones_like(x), *args[1:], **kwargs)
        eps = torch.finfo(x.dtype).eps if x.dtype.is_floating_point else 0.0
        same = (isinstance(mask, torch.Tensor) and mask.shape == x.shape
                and torch.allclose(out, x * mask, rtol=8 * eps, atol=0.0))
    return mask if same else None


def _of_the_parameter(func: Any, x: torch.Tensor, out: torch.Tensor) -> bool:
    """An op of a tracked parameter alone that makes no more elements than it has
    (``logit_scale.exp()``, a softplus, a clamp, a scaling by a number, a sum): a
    deterministic function of the parameter, so it stays tracked as a step of its use
    (:meth:`ParamUse.to_param` differentiates through it) rather than becoming an op whose
    output no datum owns. Random ops, which a replay would draw again, and ops that make
    more (``expand``, ``repeat``: ops of their own, which may give the batch) are not."""
    return out.numel() <= x.numel() and func not in _RANDOM and not (
        isinstance(out, torch.Tensor) and out.data_ptr() == x.data_ptr())


def _drew_nothing(before: dict[str, torch.Tensor], x: torch.Tensor) -> bool:
    """Whether the random-number states are still ``before``'s: the op drew nothing (a
    random op not in :data:`_RANDOM`, such as ``F.gumbel_softmax`` or ``F.rrelu``, did)."""
    after = rng_states(cuda_devices([x]))
    return all(torch.equal(before[k], after[k]) for k in before)


Signature = tuple[tuple[int, ...], int]
"""A parameter's uses in a backward's graph: calls of each module covering it, and the graph
edges into its gradient accumulator (one per op taking it or a view of it)."""
Capture = Callable[[Entry, nn.Module, tuple[Any, ...], dict[str, Any], Any], Any]


class OpCapture(TorchFunctionMode):
    """Sees the forward's torch calls that take recorded parameters (see module doc).

    Args:
        model: The root module (op entries are labelled with it).
        params: The recorded parameters, by name.
        capture: The backend's capture of a call (``HooksBackend._capture``).
        inside: Parameter id -> number of running calls of modules covering it (kept by
            the backend's module hooks).
        modules: The backend's module entries (which cover which parameters).
        active: Whether capture is on now (off while rules run, outside grad mode, ...).
        watch: ``"auto"`` or ``"always"`` (see the module doc).
    """

    def __init__(self, model: nn.Module, params: Mapping[str, nn.Parameter], capture: Capture,
                 inside: dict[int, int], modules: Sequence[Entry], active: Callable[[], bool],
                 watch: str = "auto") -> None:
        super().__init__()
        self.model = model
        self.params = params
        self.capture = capture
        self.inside = inside
        self.active = active
        self.depth = 0
        self.covering = {n: tuple(id(e) for e in modules if n in e.names.values())
                         for n in params}
        self.always = watch == "always"
        self.watching = False  # the mode is pushed for the running forward
        self.grad = False  # the running forward started with grad enabled
        self.scans = 0  # watched forwards with grad and no free use
        self.free = 0  # free uses captured in the running forward
        self.unwatched = 0  # forwards with grad not watched since all forwards were walked
        self.forwards = 0  # forwards with grad whose backward has not run yet
        self.rescan = False  # the last backward's uses were new: watch the next forward
        self.known: dict[str, set[Signature]] = {}  # per parameter: uses known to be covered
        self.pending: dict[str, Signature] = {}  # the uses an exact check is verifying
        self._undo: tuple[int, int, bool, dict[str, Signature]] | None = None  # see undo
        self.held = _Accumulators()
        self.restore: Callable[[], None] | None = None  # the prior torch.compile stance
        self.entries: dict[Any, Entry] = {}  # one per op, layout and parameters: reused
        self.deferred: dict[int, int] = {}  # parameter id -> running calls of containers
        # taking it op by op (.containers): uses there do not make every forward watched
        # id -> (the tensor, its use, its version when made: None for a parameter, which an
        # optimizer changes in place between forwards)
        self.tracked: dict[int, tuple[weakref.ref[torch.Tensor], ParamUse, int | str | None]] = {
            id(p): (weakref.ref(p), ParamUse(n, p), None) for n, p in params.items()
        }
        self.written: set[str] = set()  # parameters whose followed tensors were written in place
        self.stale: set[str] = set()  # parameters used through tensors kept from before
        self.scanned = 0  # scans of the modules' attributes (_follow_attributes)
        self.index = 0  # forwards so far (ParamUse.forward)
        self._follow_attributes(model)

    # -- pushed around the root module's forward ---------------------------------------------
    def enter(self, *_: Any) -> None:
        """Forward pre-hook of the root module. Under ``torch.compile`` the recorded forward
        runs eagerly (see :func:`~gradlog._torch_private.force_eager`): dynamo would
        otherwise trace gradlog's hooks and this mode, guard on the ids they look up and
        recompile at every step (its recompile limit was hit by step 8)."""
        if self.depth == 0:
            self.index += 1
            self.grad = torch.is_grad_enabled()  # (a forward without grad is always watched)
            try:
                self.restore = force_eager() if self.grad else None
            except InCompiledRegion:
                self.depth, self.watching, self.restore = 1, False, None  # (leave still runs)
                raise UnsupportedLayerError(
                    "the recorded model was called from inside a torch.compile'd function or "
                    "module (torch.compile(lambda x: model(x)), a compiled wrapper around it, "
                    "a compiled training step): gradlog's hooks need the recorded forward to "
                    "run eagerly, which it arranges only when the compiled code starts at the "
                    "recorded module. Pass the compiled module itself to GradRecorder "
                    "(GradRecorder(torch.compile(model), ...)) and call it, or call the model "
                    "outside the compiled function. Nothing of this forward was recorded."
                ) from None
            self.watching = self.always or self.rescan or self.scans < SCANS or not self.grad
            if self.grad and self.scanned <= SCANS:
                self._follow_attributes(self.model)
            self.free, self.written, self.stale = 0, set(), set()
            if self.watching:
                self.__enter__()
        self.depth += 1

    def leave(self, *_: Any) -> None:
        """Always-called forward hook of the root module."""
        self.depth -= 1
        if self.depth != 0:
            return
        if self.watching:
            self.__exit__(None, None, None)
        if self.restore is not None:
            self.restore()
            self.restore = None
        if self.grad:
            self._settle()

    def _settle(self) -> None:
        """After a forward with grad: whether the next one is watched (module doc)."""
        self.forwards += 1
        if not self.watching:
            self.unwatched += 1
        elif self.free:
            self.always = True  # the model uses parameters freely: watch every forward
        else:
            self.scans += 1
            self.rescan = False

    def unverified(self, graph: GraphSurvey) -> bool:
        """Before a backward of the loss ``graph`` surveys: whether a forward of its graph
        went unwatched with uses of recorded parameters that no watched forward had (the
        backward then compares every entry, and the next forward is watched). The uses are
        read from the graph (:meth:`GraphSurvey.uses`); watched forwards' are learnt."""
        if self.always:  # every forward is watched: no walk
            return False
        self._undo = (self.unwatched, self.forwards, self.rescan, self.pending)
        # Which forward a graph comes from is not known: while forwards run before their
        # backwards (accumulation) and one of them went unwatched, every backward until
        # all of them have run compares its uses (none learns them unchecked).
        unwatched = self.unwatched
        self.forwards = max(0, self.forwards - 1)
        if not self.forwards:
            self.unwatched = 0
        held = self.held
        if not unwatched or held.names is None:  # (a stale node only makes uses look new)
            nodes = [(gradient_accumulator(p), n) for n, p in self.params.items()]
            if any(node is None for node, _ in nodes):  # (autograd cannot locate them)
                self.always = True
                return bool(unwatched)
            held.names = {id(node): n for node, n in nodes}
            held.nodes = [node for node, _ in nodes]
        edges, calls = graph.uses(held.names)
        signature = {n: (tuple(calls.get(e, 0) for e in self.covering[n]), edges.get(n, 0))
                     for n in self.params}
        if not unwatched:
            for n, sig in signature.items():
                self.known.setdefault(n, set()).add(sig)
            self.pending = {}  # (a failed check's: never learnt by a later one's pass)
            return False
        new = any(sig not in self.known.get(n, ()) for n, sig in signature.items())
        self.rescan = self.rescan or new
        self.pending = signature if new else {}
        return new

    def undo(self) -> None:
        """The backward :meth:`unverified` was asked for did not run (its batch was refused
        before it): the forward counts as unverified again, for a retry on its graph."""
        if self._undo is not None:
            self.unwatched, self.forwards, self.rescan, self.pending = self._undo
            self._undo = None

    def checked(self) -> None:
        """The backward :meth:`unverified` asked for passed its check at every entry. Its
        new uses are not learnt from that: a use that gave no gradient at that step (a
        by-hand embedding of padding only) passes any sum. The next forward stays watched
        (``rescan``) and learns them, capturing the use."""
        self.pending = {}

    # -- the mode -----------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        alone = bool(args) and not any(  # (W[y, :]: the index is data, inside a tuple)
            isinstance(a, torch.Tensor) for a in flatten((args[1:], kwargs))[0])
        lone = alone and self._tracked(args[0]) and func not in VIEWS and (
            func not in _RANDOM or func in _MASKED)
        before = rng_states(cuda_devices([args[0]])) if lone else None  # (a random draw?)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not out.requires_grad or any(
                out is a for a in args):  # (its input itself: a dropout at p=0 or in eval)
            return out
        uses = self._uses(args, kwargs)
        if not uses or not self.active():
            return out
        if (len(uses) == 1 and alone and id(args[0]) in uses
                and (func in VIEWS or (before is not None and _of_the_parameter(
                    func, args[0], out) and _drew_nothing(before, args[0])))):
            use = uses[id(args[0])]
            step: Step = (func, tuple(args[1:]), dict(kwargs))
            self._track(out, replace(use, steps=(*use.steps, step), kept=self._kept(use),
                                     forward=self.index))
            return out
        if len(uses) == 1 and before is not None and func in _MASKED:
            mask = _drawn_mask(func, args, kwargs, before, out)
            if mask is not None:  # (else an op of its own, refused: a draw it cannot redo)
                use = uses[id(args[0])]
                self._track(out, replace(use, steps=(*use.steps, (torch.mul, (mask,), {})),
                                         kept=self._kept(use), forward=self.index))
                return out
        free = {k: u for k, u in uses.items()
                if self._kept(u) or not self.inside.get(id(u.param))}
        if free:  # (a use inside a covering module's call is its rule's)
            if any(not self.deferred.get(id(u.param)) for u in free.values()):
                self.free += 1
            self.capture(self._entry(func, args, kwargs, free), self.model, args, kwargs, out)
        return out

    def _kept(self, use: ParamUse) -> bool:
        """A use through a tensor kept from before this forward (``ParamUse.kept``), or made
        in an earlier one (``self.c = self.w[:6]`` at the end of a forward, read in the
        next): no module's rule follows it, inside the module's call too (a module re-run
        per datum swaps its parameters, not such a view: 1.0 off)."""
        return use.kept or (bool(use.steps) and use.forward != self.index)

    def _state(self, use: ParamUse, held: torch.Tensor, version: int | str | None) -> str:
        """How a tracked tensor stands now: ``"use"`` (followed), ``"stale"`` (its value
        from an earlier forward or from before the forward, no function of the parameter
        now: one kept from an earlier forward is followed only as a view of the parameter's
        data, not as a copy, ``clone()``/``float()``, whose values an optimizer step or an
        edit left behind: 1e-3-3e-2 off), or ``"written"`` (in place since it was made)."""
        if use.steps and not use.kept and use.forward != self.index:
            return "use" if _same_data(held, use.param) else "stale"
        if version == _STALE:
            return "stale"
        return "use" if version is None or version == tensor_version(held) else "written"

    def _tracked(self, t: Any) -> bool:
        hit = self.tracked.get(id(t)) if isinstance(t, torch.Tensor) else None
        if hit is None or (held := hit[0]()) is None or held is not t:
            return False
        return self._state(hit[1], held, hit[2]) == "use"

    def _uses(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, ParamUse]:
        """The tracked tensors among the arguments (one level of lists: ``torch.cat``). One
        written in place since it was made (``q[0] = 5`` on a view of ``W * 1.0``) is no
        longer the function of its parameter its steps say: not a use (the parameter's
        gradient then refuses the backward, :func:`.checks.check_coverage`), nor is one
        holding an older value (:meth:`_state`)."""
        found: dict[int, ParamUse] = {}
        tracked = self.tracked
        for a in (*args, *kwargs.values()):
            for t in (a if type(a) in (list, tuple) else (a,)):
                hit = tracked.get(id(t))
                held = hit[0]() if hit is not None else None
                if hit is None or held is None or held is not t:
                    continue
                use = hit[1]
                state = self._state(use, held, hit[2])
                if state == "use":
                    found[id(t)] = use
                elif state == "stale":  # (no rule follows it: inside its module too)
                    self.stale.add(use.name)
                elif not self.inside.get(id(use.param)):  # (inside: its module's rule's)
                    self.written.add(use.name)
        return found

    def _follow_attributes(self, model: nn.Module) -> None:
        """Tensors made of recorded parameters before the forward and kept on a module
        (``self.pos = self.emb.weight[:16]`` in ``__init__``, in a list or a dict): ops of
        the forward take the parameter through them as through a view made there, but only
        tensors the forward made were followed (records 1.0 off, a tied table's other uses
        covered). A view of the parameter's data is followed from it (``as_strided`` of its
        strides, exact for any view of its dtype); any other tensor made of one (``W * 2``,
        ``view_as_real``) holds its value from then, no function of the parameter that
        gradlog can follow: its use refuses the backward (:func:`.checks.check_coverage`).
        A view left on older data (``model.float()`` since) is another tensor: not followed.
        Run at attach and at the first forwards (a view kept after attach)."""
        self.scanned += 1
        uses = {id(u.param): u for _, u, _ in self.tracked.values()}
        for module in model.modules():
            for t in held_tensors(module):
                if t.grad_fn is None or id(t) in self.tracked:
                    continue
                use = uses.get(id(t._base)) if t._base is not None else None
                if use is not None and _same_data(t, use.param):
                    step: Step = (torch.as_strided, (tuple(t.shape), tuple(t.stride()),
                                                     t.storage_offset()), {})
                    self._track(t, ParamUse(use.name, use.param, (step,), kept=True), None)
                elif use is not None and t.untyped_storage().data_ptr() != (
                        use.param.untyped_storage().data_ptr()):
                    continue
                elif (use := _made_of(t.grad_fn, uses)) is not None:
                    self._track(t, use, _STALE)

    def _track(self, view: torch.Tensor, use: ParamUse,
               version: int | str | None = "now") -> None:
        key = id(view)

        def drop(_: Any, key: int = key) -> None:
            entry = self.tracked.get(key)
            if entry is not None and entry[0]() is None:
                del self.tracked[key]

        self.tracked[key] = (weakref.ref(view, drop), use,
                             tensor_version(view) if version == "now" else version)

    def _entry(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               uses: dict[int, ParamUse]) -> Entry:
        """The entry of this op with these parameter uses (one per distinct layout)."""
        kind, slots = op_kind(func, args, kwargs, uses)
        leaves = flatten((args, kwargs))[0]
        by_slot = {a: (k, uses[id(leaves[k])]) for a, k in slots.items()}
        key = (func, kind, tuple((a, k, u.name, _steps_key(u.steps))
                                 for a, (k, u) in sorted(by_slot.items())))
        entry = self.entries.get(key)
        if entry is None:
            what = getattr(func, "__name__", str(func))
            label = f"{what}({', '.join(sorted({u.name for _, u in by_slot.values()}))})"
            rule = op_rule(func, kind, by_slot, label)
            names = {a: u.name for a, (_, u) in by_slot.items()}
            params = tuple(dict.fromkeys(u.param for _, u in by_slot.values()))
            entry = Entry(self.model, label, rule, names, params, fallback=kind == "vjp",
                          op=what)
            self.entries[key] = entry
        return entry


class _Accumulators:
    """The recorded parameters' gradient accumulators (autograd nodes), held: while they are
    referenced autograd reuses them in later forwards (as DDP relies on), so their ids
    name the parameters in every graph. A copy of the model (``copy.deepcopy``, which copies
    its hooks and so this) holds none: nodes cannot be copied."""

    def __init__(self) -> None:
        self.names: dict[int, str] | None = None  # node id -> parameter name
        self.nodes: list[Any] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> _Accumulators:
        return _Accumulators()


_STALE = "stale"
"""The version of a tracked tensor kept from before the forward that is no view of its
parameter (:meth:`OpCapture._follow_attributes`): no use of it is followed."""


def _same_data(view: torch.Tensor, param: torch.Tensor) -> bool:
    """A view of the parameter's current data in its dtype (so ``as_strided`` replays it):
    its storage, and within the parameter's span of it (a flat buffer of several)."""
    if view.dtype != param.dtype or (
            view.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()):
        return False
    (start, end), (first, last) = _span(view), _span(param)
    return first <= start and end <= last


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The elements of its storage a tensor reaches: [first, last]."""
    start = int(t.storage_offset())
    return start, start + sum((int(n) - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if n)


def _made_of(node: Any, uses: Mapping[int, ParamUse], limit: int = 256) -> ParamUse | None:
    """The recorded parameter (by id, in ``uses``) whose gradient accumulator a graph from
    ``node`` reaches within ``limit`` nodes, or None. (By the node's variable: a parameter
    whose data was set since, ``model.double()``, has a new node, and the graph the old.)"""
    todo, seen, held = [node], set[int](), []  # (held: torch 2.4 reuses a freed node's id)
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        held.append(node)
        if id(getattr(node, "variable", None)) in uses:
            return uses[id(node.variable)]
        todo += [child for child, _ in node.next_functions]
    return None


def _steps_key(steps: tuple[Step, ...]) -> tuple[Any, ...]:
    return tuple((id(f), repr(a), repr(sorted(k.items()))) for f, a, k in steps)
