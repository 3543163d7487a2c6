"""What the hooks backend hooks, and what each hooked call leaves for its backward.

:func:`plan_entries` decides which modules get a forward hook and which rule computes each
recorded parameter (a layer's own rule, an ancestor's rule that covers it, or the generic
``torch.func`` fallback). An :class:`Entry` is one hooked module; a :class:`Call` is what one
forward call of it captured: its inputs, their versions, its output gradients as they arrive.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from gradlog._torch_private import tensor_version
from gradlog._tree import leaves
from gradlog.backends.fused import FusedLink, fusable
from gradlog.backends.hooks.parametrized import (
    Chain,
    Stamp,
    chains_of,
    evaluating,
    plists_in,
    stateful,
)
from gradlog.errors import UnsupportedLayerError
from gradlog.rules import GENERIC, Rule, find_rule
from gradlog.rules.base import parametrized_by

__all__ = ["TAG", "Call", "Entry", "calls_moved", "plan_entries", "sizes_of_b"]

TAG = "gradlog_calls"  # autograd Node.metadata key: [(output_nr, call)] of captured outputs
OUTPUT = "gradlog_output"  # and [(output_nr, call)] of every hooked output (reorder's inside)
BASE = "gradlog_base"  # and [(output_nr, call)] of hooked bases of outputs (graph.hook_target)


@dataclass(eq=False)
class Entry:
    """One hooked module, the rule computing its recorded parameters, and their names."""

    module: nn.Module
    name: str
    rule: Rule
    names: dict[str, str]  # attribute path -> recorded parameter name
    params: tuple[nn.Parameter, ...]
    fallback: bool
    fused: bool = False  # batch_grad="sum": the weight gradient is the sum of the records
    hook_base: bool = False  # see Rule.views_own_result and graph.hook_target
    op: str = ""  # an op call seen by operations.OpCapture (module: the root), not a module's
    chains: tuple[Chain, ...] = ()  # parametrized tensors whose parameters are recorded
    plists: tuple[nn.Module, ...] = ()  # the parametrizations its rule may evaluate again
    deferrable: bool = False  # its own parameters may be taken op by op (.containers)
    # output rank -> the batch dimensions its calls had where size settled it alone
    # (layout.locate_batch: a sequence-first step whose length equals the batch size reads
    # the batch where it was)
    batch_dims: dict[int, set[int]] = field(default_factory=dict)

    @functools.cached_property
    def wanted(self) -> frozenset[str]:
        """What the rule is asked for: the recorded attributes, a parametrized tensor's
        (``weight``) in place of its parameters' (:mod:`.parametrized`)."""
        chained = {path for c in self.chains for path in c.paths.values()}
        return frozenset({a for a in self.names if a not in chained}
                         | {c.attr for c in self.chains})

    @functools.cached_property
    def stateful(self) -> tuple[nn.Module, ...]:
        """Its parametrizations that keep state (``parametrized.States``)."""
        return stateful(self.plists)

    @functools.cached_property
    def param_ids(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self.params)

    @property
    def label(self) -> str:
        if self.op:
            return f"op {self.name} (in the forward of {type(self.module).__name__})"
        return f"{type(self.module).__name__} {self.name or '(the model)'!r}"


class _Tags(list[tuple[int, "Call"]]):
    """The calls noted on one autograd node (:data:`TAG`); a list a call can refer to weakly
    (a strong reference would make a cycle through the node's metadata)."""

    __slots__ = ("__weakref__",)


def sizes_of_b(call: Call, B: int) -> tuple[int, ...]:
    """The leading (not feature) dimensions of the call's output whose size is ``B``: where
    its batch may be. More than one, or one after the first, is a layout only the datum
    check settles (:class:`.datum_check.DatumLayouts`)."""
    shape, features = tuple(call.out_shape), call.entry.rule.feature_dims
    lead = shape[: len(shape) - (features(call.entry.module) if features else 1)]
    return tuple(k for k, n in enumerate(lead) if n == B)


def calls_moved(calls: Iterable[Call]) -> bool:
    """Whether every one of a layout's calls gave per-datum gradients that are not zero
    (:attr:`Call.moved`, set where :attr:`Call.watched`): one whose share was zero proves
    nothing of its split (two calls of a layer under one layout, one weighted 0, were
    verified by the other)."""
    return all(c.moved is not None and bool(c.moved) for c in calls)


class Call:
    """What one forward call of a hooked module left for its backward."""

    __slots__ = (
        "__weakref__",
        "args",
        "autocast",
        "bd",
        "chunk",
        "copied",
        "datum_rows",
        "done",
        "entry",
        "fused",
        "geometry",
        "grads",
        "handles",
        "hooked",
        "inner",
        "kwargs",
        "lead",
        "marked",
        "moved",
        "out_shape",
        "pending",
        "primary",
        "received",
        "refusal",
        "stamp",
        "tagged",
        "twice",
        "versions",
        "via_consumers",
        "watched",
    )

    def __init__(self, entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any],
                 n_leaves: int, primary: int, out_shape: torch.Size) -> None:
        self.entry = entry
        self.args: tuple[Any, ...] | None = args
        self.kwargs: dict[str, Any] | None = kwargs
        self.versions = [(t, tensor_version(t)) for t in leaves((args, kwargs))
                         if isinstance(t, torch.Tensor)]  # (input, its version when used)
        self.grads: list[torch.Tensor | None] = [None] * n_leaves
        self.handles: list[Any] = []
        self.hooked = 0
        self.received = 0
        self.primary = primary
        self.out_shape = out_shape
        self.bd = entry.rule.batch_dim(entry.module)  # settled by size in layout.locate_batch
        self.lead: int | None = None  # the output's size along bd
        self.done = False
        self.pending = False
        self.via_consumers = False
        self.twice = False  # its output was differentiated with create_graph=True
        self.refusal: str | None = None  # why the rule cannot compute this call
        self.stamp: Stamp | None = None  # its stateful parametrizations' state (.parametrized)
        self.chunk: Any = None  # gradlog.memory.ChunkInfo: the call saw rows of (B, T) inputs
        self.datum_rows = 0  # via_consumers: each datum's rows at its consumers (0: one)
        self.copied = False  # via_consumers: read at copies over the batch (expand, repeat)
        self.fused: FusedLink | None = None  # batch_grad="sum": where the weight sum goes
        self.autocast: torch.dtype | None = None  # the autocast dtype its forward ran under
        self.tagged: weakref.ref[_Tags] | None = None  # its note in its output's grad_fn
        # a layout the datum check verifies this backward (datum_check.DatumLayouts): whether
        # any of its per-datum output gradients is not zero (a device bool, read by the check)
        self.watched = False
        self.moved: torch.Tensor | None = None
        self.inner: list[Call] | None = None  # a container's op calls (.containers)
        self.marked: list[weakref.ref[_Tags]] = []  # its notes in its outputs' (OUTPUT)
        self.geometry: tuple[torch.Size, tuple[int, ...], int] | None = None  # see mark_base

    def tag(self, metadata: dict[str, Any], output_nr: int) -> None:
        """Note this call in its output's ``grad_fn.metadata`` (:data:`TAG`): how the walks
        of the graph before a backward find the calls whose outputs are in it."""
        tags = metadata.get(TAG)
        if tags is None:
            tags = metadata[TAG] = _Tags()
        tags.append((output_nr, self))
        self.tagged = weakref.ref(tags)  # (weak: the graph alone decides how long it lives)

    def mark(self, metadata: dict[str, Any], output_nr: int, i: int) -> None:
        """Note this call in hooked output ``i``'s ``grad_fn.metadata``: :data:`OUTPUT`
        (what is inside its forward, below its outputs: :func:`.reorder.reordered`), and for
        its first, :meth:`tag`."""
        if i == self.primary:
            self.tag(metadata, output_nr)
        marks = metadata.get(OUTPUT)
        if marks is None:
            marks = metadata[OUTPUT] = _Tags()
        marks.append((output_nr, self))
        self.marked.append(weakref.ref(marks))

    def mark_base(self, base: torch.Tensor,
                  geometry: tuple[torch.Size, tuple[int, ...], int]) -> None:
        """The primary output is a view of ``base`` (hooked there: ``graph.hook_target``) with
        ``geometry`` (size, stride, offset in it): where its size is 1 first (it may be shared
        by the batch), note this call in the base's node (:data:`BASE`), where the graph walk
        finds an in-place op on the view, which drops the view's own node from the graph
        (``GraphSurvey.consumers``)."""
        self.geometry = geometry
        if geometry[0][:1] != (1,):  # (a batch's own output: not shared, no walk needs it)
            return
        metadata = cast(dict[str, Any], cast(Any, base.grad_fn).metadata)  # (hook_target: a node)
        marks = metadata.get(BASE)
        if marks is None:
            marks = metadata[BASE] = _Tags()
        marks.append((base.output_nr, self))
        self.marked.append(weakref.ref(marks))

    def untag(self) -> None:
        """Take this call's note out of its ``grad_fn.metadata``, after its backward: the
        graph's nodes outlive the step (until the losses are dropped, in the next forward
        of a training loop), and a call left there keeps itself and its lists alive with
        them, ~7 objects a call for Python's collector to age into its oldest generation."""
        refs, self.tagged, self.marked = [self.tagged, *self.marked], None, []
        for ref in refs:
            tags = ref() if ref is not None else None
            if tags:
                tags[:] = [(nr, call) for nr, call in tags if call is not self]

    def release(self, untag: bool = False) -> None:
        """Drop captured tensors and make the output hooks inert; ``untag``: and
        :meth:`untag` (once no later call of the backward reads the tags)."""
        self.args = self.kwargs = None
        self.grads = []
        self.versions = []
        self.done = True
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if untag:
            self.untag()


def plan_entries(model: nn.Module, params: Mapping[str, nn.Parameter],
                 batch_grad: str) -> list[Entry]:
    """The modules to hook: each owning (or whose rule covers) a recorded parameter.

    Args:
        model: The user's model.
        params: The recorded parameters, by recorded name.
        batch_grad: The backend's ``batch_grad`` (``"sum"`` fuses plain Linear weights).

    Returns:
        One entry per module and rule (a module with a rule and also parameters its rule
        does not cover gets a second, generic entry for those).
    """
    with evaluating(plists_in(model)):  # (find_rule's checks may read a parametrized weight)
        return _plan(model, params, batch_grad)


def _plan(model: nn.Module, params: Mapping[str, nn.Parameter],
          batch_grad: str) -> list[Entry]:
    by_id = {id(p): n for n, p in params.items()}
    entries: list[Entry] = []
    taken: set[tuple[int, str]] = set()  # (module, attr) computed by an ancestor's rule
    for mname, module in model.named_modules():
        _refuse_parametrization(mname, module, by_id, taken)
        names: dict[str, str] = {}
        rule = find_rule(module)
        chains = chains_of(module, by_id)
        for chain in chains:  # their parameters are computed here, through the chain
            for path in chain.paths.values():
                owner, _, attr = path.rpartition(".")
                taken.add((id(module.get_submodule(owner)), attr))
        how = {id(c): parametrized_by(rule, c.attr) if rule is not None else None
               for c in chains}
        ruled = tuple(c for c in chains if how[id(c)] == "chain")
        rerun = tuple(c for c in chains if how[id(c)] == "rerun")  # (through it: no chain)
        if rule is not None:
            for path, p in rule.covers(module).items():
                if id(p) not in by_id or (id(module), path) in taken:
                    continue
                names[path] = by_id[id(p)]
                if "." in path:  # a child's parameter that this module's forward reads
                    owner, _, attr = path.rpartition(".")
                    taken.add((id(module.get_submodule(owner)), attr))
            names.update(_chained(ruled + rerun, module, by_id))
            if names:
                entries.append(_entry(params, batch_grad, module, mname, rule, names,
                                      fallback=False, chains=ruled))
        # A parameter this module also holds under an alias of a submodule's (opacus' DPLSTM
        # registers each cell weight again at the top) is computed where it is used: by the
        # submodule that holds it (a re-run of this module as well would count it twice).
        rest = {
            attr: by_id[id(p)]
            for attr, p in module.named_parameters(recurse=False)
            if id(p) in by_id and (id(module), attr) not in taken and attr not in names
        }
        if rest:
            below = {id(p) for n, p in module.named_parameters(remove_duplicate=False)
                     if "." in n}
            rest = {attr: name for attr, name in rest.items()
                    if id(module.get_parameter(attr)) not in below}
        # (the torch.func re-run passes the parametrization's parameters, not its tensor)
        chained = _chained(tuple(c for c in chains if how[id(c)] is None), module, by_id)
        # a module below the root holding raw parameters beside children with theirs (a
        # layer scale, BEiT's lambda_1): may take its own op by op (.containers)
        deferrable = bool(rest) and not chained and bool(mname) and any(
            True for child in module.children() for _ in child.parameters())
        rest.update(chained)
        if rest:
            entries.append(_entry(params, batch_grad, module, mname, GENERIC, rest,
                                  fallback=True, deferrable=deferrable))
    return entries


def _chained(chains: tuple[Chain, ...], module: nn.Module,
             recorded: Mapping[int, str]) -> dict[str, str]:
    """Attribute path -> recorded name of the chains' parameters."""
    return {path: recorded[id(module.get_parameter(path))]
            for c in chains for path in c.paths.values()}


def _entry(params: Mapping[str, nn.Parameter], batch_grad: str, module: nn.Module, name: str,
           rule: Rule, names: dict[str, str], *, fallback: bool,
           chains: tuple[Chain, ...] = (), deferrable: bool = False) -> Entry:
    owned = tuple(params[n] for n in dict.fromkeys(names.values()))
    fused = (batch_grad == "sum" and not fallback and "weight" in names
             and rule.name in ("linear", "conv1d_gpt2") and fusable(module))
    # (a fallback entry of a layer whose own rule knows its forward: a pruned Linear)
    own = rule if not fallback else find_rule(module)
    hook_base = own is not None and own.views_own_result
    return Entry(module, name, rule, names, owned, fallback, fused, hook_base, chains=chains,
                 plists=plists_in(module), deferrable=deferrable)


def _refuse_parametrization(name: str, module: nn.Module, recorded: Mapping[int, str],
                            taken: set[tuple[int, str]]) -> None:
    """Refuse recorded parameters of a ``torch.nn.utils.parametrize`` parametrization that
    no chain through the module it parametrizes computes (:mod:`.parametrized`): where the
    ``ParametrizationList`` is not found as that module's ``parametrizations`` entry."""
    if type(module).__name__ != "ParametrizationList":
        return
    held = [recorded[id(p)] for owner in module.modules()
            for attr, p in owner.named_parameters(recurse=False)
            if id(p) in recorded and (id(owner), attr) not in taken]
    if held:
        raise UnsupportedLayerError(
            f"parameter(s) {held} are held by the torch.nn.utils.parametrize parametrization "
            f"{name!r}, which gradlog found outside the module it parametrizes: the hooks "
            "backend cannot compute their per-datum gradients. Use backend='loop', leave "
            "these parameters out with params=, or record the plain weight "
            "(torch.nn.utils.parametrize.remove_parametrizations)."
        )
