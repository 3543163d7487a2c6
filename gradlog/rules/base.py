"""The rule interface and the registry of rules, by module type.

A **rule** turns what the hooks backend captured for one call of a module (its inputs, and
the gradient of the batch loss with respect to its outputs) into the per-datum gradients of
the module's parameters. Rules never run a backward of their own when a closed form exists
(Linear: ``G_b^T A_b``); layers without one use :mod:`gradlog.rules.func` (``torch.func``).

Third parties register rules for their own module types::

    from gradlog.rules import Capture, register_rule

    @register_rule(MyScale)
    def my_scale(module, cap, wanted):
        x, g = cap.input, cap.grad_output  # (B, ..., d), (B, ..., d)
        return {"weight": (g * x).reshape(cap.batch_size, -1, x.shape[-1]).sum(1) * cap.scale}

See ``gradlog/rules/README.md`` for the contract in full.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from gradlog._torch_private import forward_hooks_kept, forward_pre_hooks
from gradlog._tree import flatten, leaves
from gradlog.errors import UnsupportedLayerError

__all__ = [
    "RULES",
    "Capture",
    "Rule",
    "RuleFn",
    "RuleResult",
    "attributes",
    "find_rule",
    "forward_call",
    "held_tensors",
    "one_feature_dim",
    "own_params",
    "parametrized_by",
    "register_rule",
    "replays_keep_hooks",
    "widen",
]


@dataclass(frozen=True)
class Capture:
    """One call of a module, as its rule sees it.

    Attributes:
        args: Positional arguments of the call (tensors are the originals: never modify
            them in place). Tensor arguments that were shared by the whole batch (position
            ids of shape ``[1, T]`` or ``[T]``) are already expanded to the batch size.
        kwargs: Keyword arguments of the call.
        grads: Gradient of the batch loss with respect to each output leaf of the call, in
            the order of the flattened output (tuples, lists and dicts flattened in order);
            ``None`` where no gradient reached that output (or it is not a tensor).
        batch_size: B, the number of datums.
        scale: ``1 / w_b``: the captured gradients are of ``sum_b w_b losses[b]``, so a
            rule multiplies its per-datum result by ``scale`` to get ``d losses[b] / d theta``
            (``B`` for a mean batch loss, ``1`` for a sum).
        expanded: True when shared (unbatched) tensor arguments were expanded to the batch
            size; their rows are then identical (``args[0][0]`` is the original).
        alloc: ``alloc(shape, dtype, device)``: where :meth:`empty` gets its memory.
        factored: Attribute paths whose per-datum gradients the rule may return as
            :class:`gradlog.forms.Factors` instead of dense (their form keeps factors or
            projects from them); rules without factors ignore it.
        batch_dim: Where the call had its batch before the backend moved it first in
            ``args``, ``kwargs`` and ``grads`` (0 for most calls; 1 for a sequence-first
            ``(T, B, D)`` tensor). Rules that re-run the call use it to put it back.
        flattened: The call ran on the batch's tokens flattened to rows (``(B*T, ...)``);
            the backend laid its row tensors out as ``(B, T, ...)``, so a re-run takes each
            datum's ``(T, ...)`` slice as the module's rows, not as a batch of one.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grads: tuple[torch.Tensor | None, ...]
    batch_size: int
    scale: float
    expanded: bool = False
    alloc: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] | None = field(
        default=None, repr=False, compare=False)
    factored: frozenset[str] = frozenset()
    batch_dim: int = 0
    flattened: bool = False

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """An uninitialised tensor for a large per-datum result that the rule overwrites
        whole. Use it rather than ``torch.empty``: the backend may hand out memory of an
        earlier step that nobody holds any more, which saves page-faulting fresh memory."""
        if self.alloc is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return self.alloc(tuple(shape), dtype, torch.device(device))

    @property
    def input(self) -> torch.Tensor:
        """The layer's one input: the first positional argument, or the only tensor passed by
        keyword (``linear(input=x)``)."""
        if self.args:
            if not isinstance(self.args[0], torch.Tensor):
                raise TypeError("this call has no tensor as its first positional argument")
            return self.args[0]
        tensors = [v for v in self.kwargs.values() if isinstance(v, torch.Tensor)]
        if len(tensors) != 1:
            raise TypeError(f"this call has no positional input and {len(tensors)} tensor "
                            "keyword arguments; call the layer with its input first")
        return tensors[0]

    @property
    def grad_output(self) -> torch.Tensor:
        """The gradient of the first output, for layers with one output."""
        if not self.grads or self.grads[0] is None:
            raise TypeError("no gradient reached the first output of this call")
        return self.grads[0]


RuleResult = dict[str, Any]
"""Attribute path -> per-datum gradients (dense ``(B, *shape)``), sparse rows
(:class:`gradlog.grads.Rows`) or, for attributes in ``cap.factored``,
:class:`gradlog.grads.Factors`."""


class RuleFn(Protocol):
    """``compute(module, cap, wanted) -> {attr: per-datum gradients}``.

    ``wanted`` holds the parameter attribute paths (``"weight"``, ``"out_proj.bias"``) to
    compute; the others are not recorded and may be skipped. Each value is a fresh tensor
    ``(B, *param.shape)`` (not a view of a captured tensor: the backend keeps it and may add
    into it) or a :class:`gradlog.grads.Rows`.
    """

    def __call__(self, module: Any, cap: Capture, wanted: frozenset[str]) -> RuleResult: ...


def widen(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` converted to ``dtype`` if it is a narrower floating tensor, else ``t`` itself.

    Under autocast, captured inputs and output gradients are often bfloat16/float16 while the
    parameters are float32; rules widen them first so per-datum gradients accumulate in the
    parameters' precision.
    """
    if dtype is None or not t.is_floating_point() or not dtype.is_floating_point:
        return t
    if torch.finfo(t.dtype).bits >= torch.finfo(dtype).bits:
        return t
    return t.to(dtype)


def own_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a module holds directly (``recurse=False``), by attribute name."""
    return dict(module.named_parameters(recurse=False))


def held_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors a module holds outside its parameters' registry, through lists, tuples and
    dicts, and one plain object's attributes (a dataclass; its buffers too): where one made
    of a parameter before the forward may be kept (``self.pos = self.emb.weight[:16]``)."""
    found = leaves(list(vars(module).values()))
    found += [t for v in found if _plain_object(v) for t in leaves(list(vars(v).values()))]
    return [t for t in found if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)]


def _plain_object(v: Any) -> bool:
    return (hasattr(v, "__dict__") and not isinstance(v, (nn.Module, torch.Tensor, type))
            and not callable(v))


class _Forward(nn.Module):
    """``inner.forward`` after its pre-hooks, their results dropped: the call
    :func:`forward_call` replays."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # (no global hooks on the wrapper)
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.inner
        replayed = [(h, with_kwargs) for h, with_kwargs in forward_pre_hooks(inner)
                    if not _gradlogs(h)]
        if replayed:  # (the hooks they register or remove, anywhere in the model, kept)
            with forward_hooks_kept(inner, *_RECORDED):
                for hook, with_kwargs in replayed:
                    _replay_pre_hook(inner, hook, with_kwargs, args, kwargs)
        return inner.forward(*args, **kwargs)


_RECORDED: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
"""Models attached to a recorder, by recorders attached (:func:`replays_keep_hooks`)."""


class _Recorded:
    """The handle :func:`replays_keep_hooks` returns."""

    def __init__(self, model: nn.Module) -> None:
        self.model: weakref.ref[nn.Module] | None = weakref.ref(model)
        _RECORDED[model] = _RECORDED.get(model, 0) + 1

    def remove(self) -> None:
        model = self.model() if self.model is not None else None
        self.model = None
        if model is not None and _RECORDED.get(model, 0) > 0:
            _RECORDED[model] -= 1
            if not _RECORDED[model]:
                del _RECORDED[model]


def replays_keep_hooks(model: nn.Module) -> _Recorded:
    """While the handle is not removed, a replay of a module's pre-hooks (:func:`forward_call`)
    leaves every hook of ``model`` as it was: one a replayed pre-hook registers on a sibling
    or on the model (a one-shot hook, removed only when it runs) stayed, and ran at the next
    forward (training 2e-2 off, the records 1.5 off the loop's)."""
    return _Recorded(model)


def _replay_pre_hook(inner: nn.Module, hook: Any, with_kwargs: bool, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
    """One pre-hook of the user's on copies of the argument containers (it may edit a list
    or the keyword arguments in place: applied twice on the inputs themselves)."""
    items, rebuild = flatten((args, kwargs))
    hook_args, hook_kwargs = rebuild(items)
    try:
        hook(inner, hook_args, hook_kwargs) if with_kwargs else hook(inner, hook_args)
    except Exception as e:
        raise UnsupportedLayerError(
            f"a forward pre-hook of yours on {type(inner).__name__} ({hook!r}) failed when "
            f"gradlog replayed the module ({type(e).__name__}: {e}). gradlog replays a module "
            "per datum after its pre-hooks, for the state they set (a weight made of "
            "parameters: prune's, a weight drop's), dropping what they return (the inputs it "
            "captured are theirs already), on one datum's inputs, which may be passed by "
            "keyword. Make the hook accept that, register a rule for the module "
            "(gradlog.rules.register_rule), or use backend='loop'.") from e


def _gradlogs(hook: Any) -> bool:
    """A hook of gradlog's own (its capture, its hook order, its op capture, dropout masks):
    not part of the module's function."""
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith("gradlog.")


def forward_call(module: nn.Module, state: dict[str, torch.Tensor], args: tuple[Any, ...],
                 kwargs: dict[str, Any] | None = None) -> Any:
    """``torch.func.functional_call`` of the module's ``forward`` after its pre-hooks, whose
    results are dropped, without its forward hooks: gradlog captured its inputs after its
    pre-hooks ran (a replay through ``module(...)`` applied a pre-hook scaling them twice)
    and its output before its other forward hooks did (gradlog's capture runs first: a hook
    editing the output was differentiated with the layer, records 1e-7 off unchecked at a
    scale of 1 + 1e-7; logging hooks ran again on one datum's tensors). Pre-hooks still run
    for the state they set (``prune``'s ``weight_orig * weight_mask``, a weight drop's: the
    weight made of the replay's parameters; a hook editing the keyword arguments in place
    edits a copy); hooks on its submodules are part of it. A ``__call__`` of the module's
    own is not replayed: the capture saw what it passed on to ``forward``.
    """
    named = {f"inner.{k}": v for k, v in state.items()}
    try:
        return torch.func.functional_call(_Forward(module), named, args, kwargs)
    finally:  # (functional_call writes a reassigned buffer back into the state it was given)
        state.update((k, named[f"inner.{k}"]) for k in state)


def attributes(*names: str) -> Callable[[nn.Module], dict[str, nn.Parameter]]:
    """``covers`` of a closed-form rule: only the module's own parameters named ``names``.

    A module may hold other parameters that its forward turns into these attributes
    (``torch.nn.utils.prune``'s ``weight_orig``, legacy ``weight_norm``'s ``weight_g`` and
    ``weight_v``, set up by forward pre-hooks); the formula does not give their gradients,
    so they are left to the ``torch.func`` fallback, which re-runs the module's forward."""

    def covers(module: nn.Module) -> dict[str, nn.Parameter]:
        return {a: p for a, p in module.named_parameters(recurse=False) if a in names}

    covers.__name__ = f"attributes{names}"
    covers.attributes = names  # type: ignore[attr-defined]  # (read by parametrized_by)
    return covers


def parametrized_by(rule: Rule, attr: str) -> str | None:
    """How ``rule`` gives the per-datum gradients of the parameters of a parametrization
    (``torch.nn.utils.parametrize``) making its module's ``attr`` (``covers`` sees only
    parameters, not such tensors): ``"chain"``, a closed-form rule covering ``attr`` (the
    module's own parameters or ``attributes(...)`` naming it), whose gradient of the tensor
    the backend chains on; ``"rerun"``, a rule re-running the module with its own
    parameters (``uses_torch_func``), which differentiates through the parametrization;
    None: neither (the generic re-run)."""
    if not (rule.covers is own_params or attr in getattr(rule.covers, "attributes", ())):
        return None
    return "rerun" if rule.uses_torch_func else "chain"


def _batch_first(module: nn.Module) -> int:
    return 0


def one_feature_dim(module: nn.Module) -> int:
    """``feature_dims`` of layers whose output ends in one feature dimension (Linear)."""
    return 1


@dataclass(frozen=True)
class Rule:
    """A registered rule.

    Attributes:
        name: Short name, shown in ``describe()`` and the run's attributes.
        compute: The function, see :class:`RuleFn`.
        covers: Which parameters the rule computes, by attribute path from the module
            (default: the module's own). A rule may cover a child's parameters that the
            module's forward uses directly (``MultiheadAttention`` reads
            ``out_proj.weight`` without calling ``out_proj``).
        batch_dim: Batch dimension of the module's first input and first output (1 for
            sequence-first RNNs and attention).
        uses_torch_func: True if the rule re-runs the module per datum with ``torch.func``
            (it then cannot reproduce dropout masks drawn in the batch's forward).
        refuse: ``refuse(module, args, kwargs)`` -> a reason the rule cannot handle this call,
            or None. Called at capture time, so the backend refuses before ``p.grad`` is
            touched rather than after the backward.
        feature_dims: For layers that treat every leading dimension alike (Linear, Embedding,
            LayerNorm): the number of trailing feature dimensions of the output. The batch
            may then be any leading dimension (sequence-first models); the backend finds it
            by size and moves it first (in inputs and output gradients) before calling the
            rule. None: the batch is at ``batch_dim``.
        views_own_result: The layer's first output may be a view of a whole tensor its
            forward made and uses only through that view (``F.linear`` on ``(B, T, d)``
            views its 2-D matmul's result). The backend then hooks that tensor instead of
            the output, so an in-place op on the output (``ReLU(inplace=True)`` after the
            layer), which rebuilds the view's history and drops hooks on it, loses nothing.
            Only for layers whose forward is known to do so; a wrong True double-counts.
        accepts: For a rule found by class name: whether this module is the library's
            class (a user's class of the same name then gets no rule: the ``torch.func``
            fallback). None: every module of that name.
        track: ``track(module)`` -> hook handles, installed on each recorded module of the
            rule while recording (removed with the backend's): what the rule notes in the
            module's forwards for its compute (``MultiheadAttention``'s projections in
            training). None: nothing.
    """

    name: str
    compute: RuleFn
    covers: Callable[[nn.Module], dict[str, nn.Parameter]] = own_params
    batch_dim: Callable[[nn.Module], int] = field(default=_batch_first)
    uses_torch_func: bool = False
    refuse: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], str | None] | None = None
    feature_dims: Callable[[nn.Module], int] | None = None
    views_own_result: bool = False
    accepts: Callable[[nn.Module], bool] | None = None
    track: Callable[[nn.Module], list[Any]] | None = None


RULES: dict[type[nn.Module] | str, Rule] = {}
"""Module type (or class name, for libraries gradlog does not import) -> rule."""

MATCHED: list[Rule] = []
"""Rules found by their ``accepts`` predicate alone, for a family of classes with no common
base or name (transformers' ``@use_experts_implementation`` experts), tried last."""


def register_rule(
    *keys: type[nn.Module] | str,
    name: str | None = None,
    covers: Callable[[nn.Module], dict[str, nn.Parameter]] = own_params,
    batch_dim: Callable[[nn.Module], int] = _batch_first,
    uses_torch_func: bool = False,
    refuse: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], str | None] | None = None,
    feature_dims: Callable[[nn.Module], int] | None = None,
    views_own_result: bool = False,
    accepts: Callable[[nn.Module], bool] | None = None,
    track: Callable[[nn.Module], list[Any]] | None = None,
) -> Callable[[RuleFn], RuleFn]:
    """Decorator registering ``compute`` as the rule for module types ``keys``.

    A key is a module class, or a class name (``"Conv1D"``) matched against
    ``type(module).__name__`` for classes of libraries gradlog does not import, or a
    qualified one (``"peft.tuners.ia3.layer.Linear"``: module and qualname) where the short
    name is ambiguous. Registering a key again replaces its rule (so third parties can
    override a built-in one).

    With no keys, the rule is found by ``accepts`` alone (:data:`MATCHED`), after every
    keyed lookup.

    Args:
        *keys: Module classes or class names.
        name: Rule name for ``describe()``; default: the function's name.
        covers: See :class:`Rule`.
        batch_dim: See :class:`Rule`.
        uses_torch_func: See :class:`Rule`.
        refuse: See :class:`Rule`.
        feature_dims: See :class:`Rule`.
        views_own_result: See :class:`Rule`.
        accepts: See :class:`Rule`.
        track: See :class:`Rule`.
    """
    if not keys and accepts is None:
        raise TypeError("register_rule needs a module type, a class name or accepts=")

    def decorate(compute: RuleFn) -> RuleFn:
        rule = Rule(
            name=name or str(getattr(compute, "__name__", "rule")),
            compute=compute,
            covers=covers,
            batch_dim=batch_dim,
            uses_torch_func=uses_torch_func,
            refuse=refuse,
            feature_dims=feature_dims,
            views_own_result=views_own_result,
            accepts=accepts,
            track=track,
        )
        for key in keys:
            if not (isinstance(key, str) or (isinstance(key, type) and issubclass(key, nn.Module))):
                raise TypeError(f"rule keys are nn.Module subclasses or class names, got {key!r}")
            RULES[key] = rule
        if not keys:
            MATCHED[:] = [r for r in MATCHED if r.name != rule.name] + [rule]
        return compute

    return decorate


def find_rule(module: nn.Module) -> Rule | None:
    """The rule for ``module``: its exact type, then its qualified class name
    (``"peft.tuners.ia3.layer.Linear"``), then its class name, then a base class whose
    ``forward`` it does not override (a subclass with its own forward gets no rule, so the
    backend falls back to ``torch.func`` rather than trust a formula for another function),
    then the first rule of :data:`MATCHED` that accepts it.
    An instance whose ``forward`` was replaced (``layer.forward = ...``) gets none either."""
    if "forward" in vars(module):
        return None
    cls = type(module)
    if cls in RULES:
        return RULES[cls]
    for key in (f"{cls.__module__}.{cls.__qualname__}", cls.__name__):  # (qualified: a
        rule = RULES.get(key)  # library's class whose short name is taken, "Linear")
        if rule is not None and (rule.accepts is None or rule.accepts(module)):
            return rule
    for base in _bases(cls):
        if base in RULES and cls.forward is base.forward:
            return RULES[base]
    return next((r for r in MATCHED if r.accepts is not None and r.accepts(module)), None)


def _bases(cls: type) -> Iterable[type]:
    return (b for b in cls.__mro__[1:] if b is not nn.Module and b is not object)
