"""Top-k sparse backprop: a backward that passes on only the largest gradient entries.

An experiment mode for research on sparse training (meProp, Sun et al. 2017)::

    with gradlog.sparse_backprop(model, fraction=0.05):   # every nn.Linear, by default
        losses = F.cross_entropy(model(x), y, reduction="none")
        losses.mean().backward()                          # or rec.backward(losses, ...)

Semantics
---------
**Nodes.** For each module selected by ``where`` (default: every ``nn.Linear``) and each call
of its forward made inside the context with gradients enabled, the gradient with respect to
that call's output (the sum of what every consumer of the output sends back) is replaced,
before it enters the module's own backward, by a copy that keeps the k entries of largest
magnitude of each row and holds zeros elsewhere. Everything upstream (the module's
parameters, its input, earlier modules, which sparsify again at their own outputs) receives
the gradients computed from the sparsified gradient. Nothing else changes: forward values,
losses, and the gradients of outputs of modules that are not selected. A module called twice
is sparsified at each call's output. A module returning several tensors is sparsified at each
of them. The context returns, in place of each output tensor, an alias sharing its memory (a
no-copy identity node that carries the sparsifying hook), so a module returning one of its
inputs leaves the input's other uses untouched, and an in-place op after the module (e.g.
``ReLU(inplace=True)``) still sees the sparsification.

**Rows** (``per``). ``"token"`` (default): every position separately, along the output's last
dimension (the features of a Linear): an output ``(B, T, d)`` has ``B*T`` rows of ``d``
entries, an output ``(B, d)`` has ``B`` rows. ``"datum"``: each datum's whole output,
flattened, with the batch on dimension 0: ``(B, T, d)`` has ``B`` rows of ``T*d`` entries.
Each row belongs to one datum, so what is kept for a datum never depends on the rest of the
batch: per-datum gradients (``GradRecorder``) are well defined and batch-independent.
``"child"``: not a row of the output but the inputs of every autograd node created inside the
selected modules' forwards: each node passes the gradient on only to its ``k`` children (its
inputs, ``k=1``: one) with the largest gradient, by L1 norm, and zeros to the others
(:mod:`gradlog.sparse.child`; default ``where`` for it: the whole model). Its choice is made
on the batch's summed gradient, so it cannot be recorded per datum (``GradRecorder`` refuses).

**k.** ``k=`` keeps ``k`` entries per row; ``fraction=`` keeps ``ceil(fraction * n)`` (at
least 1) of a row's ``n`` entries, per node. ``k >= n`` keeps the whole row (the node's
gradient is passed on unchanged).

**Ties.** The entries kept are those ``torch.topk(|g|, k, sorted=False)`` returns for the
row: among equal magnitudes at the k-th place, topk's choice, which is deterministic for a
given input on a given device and torch build. Both modes make this same call on the same
gradient, so they keep the same entries.

**Modes.** ``"masked"``: a tensor hook on the output's alias replaces its gradient by the
masked copy; the module's backward runs as usual (the same dense arithmetic as dense backprop, on a
gradient with more zeros: the semantics, no speed-up). ``"compact"`` (meProp): selected
``nn.Linear`` modules (plain ``nn.Linear.forward``) take their output from a custom autograd
function whose backward uses the kept entries only: with ``S`` the ``(N, d_out)`` sparse
matrix of kept entries (``N`` rows of the flattened output), ``grad_input = S @ W`` and
``grad_weight = S^T @ X`` (sparse-dense matmuls, ``O(N k d_in)`` instead of
``O(N d_out d_in)``) and ``grad_bias`` by ``index_add``. Other selected modules use the masked
path. The two modes give the same gradients up to rounding (tested in float64).

**Scope.** Sparsification is decided at forward time: a forward run inside the context is
sparsified in its backward even if that backward runs after the context exited; a forward
run outside it is not. On exit (also on an exception) every module hook the context
installed is removed. The model is never wrapped, renamed or modified: its parameters stay
the same objects and its ``state_dict`` is unchanged.

**Recording.** The context's hooks run before any other forward hook of the module
(``prepend=True``), so a recorder's capture of the output gradient (the ``hooks`` backend)
sees the sparsified gradient, and the ``loop`` backend's per-datum ``autograd.grad`` calls go
through the same sparsifying hooks. A ``GradRecorder`` opened inside the context stores the
settings in the run's attributes, under ``backend.sparse_backprop`` (a list: one entry per
active context); entering or leaving a context while a recorder records the model is refused
at its next recorded step.

**Caveat.** An output that an operation broadcasts over the batch (a position embedding
called on ``[1, T]`` ids) receives the gradient summed over datums; sparsifying it couples
datums, so keep such modules out of ``where`` when recording per-datum gradients.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from gradlog._tree import flatten
from gradlog.errors import ConfigError
from gradlog.sparse.child import hook_nodes
from gradlog.sparse.compact import Alias, Call, CompactLinear, select
from gradlog.sparse.settings import MODES, PER, SparseSettings, Where, type_name

__all__ = [
    "MODES",
    "PER",
    "SparseBackprop",
    "SparseSettings",
    "active_settings",
    "check_settings",
    "sparse_backprop",
]

_ACTIVE: list[SparseBackprop] = []  # entered and not yet exited, oldest first


class SparseBackprop:
    """The context manager returned by :func:`sparse_backprop` (see the module docstring).

    Attributes:
        model: The model whose modules are sparsified.
        settings: The validated settings.
        modules: Selected modules, by their names in ``model.named_modules()``.
        compact: Names of the modules on the compact path (``mode="compact"``).
        calls: Gradients sparsified so far (one per output per backward; a recording's
            datum check adds one backward on its first step).
    """

    def __init__(
        self, model: nn.Module, settings: SparseSettings, modules: dict[str, nn.Module]
    ) -> None:
        self.model = model
        self.settings = settings
        self.modules = modules
        compact = settings.mode == "compact"
        self.compact = [n for n, m in modules.items() if compact and _compactable(m)]
        self.calls = 0
        self._handles: list[Any] = []

    @property
    def active(self) -> bool:
        """Whether the context is entered."""
        return bool(self._handles)

    def describe(self) -> dict[str, Any]:
        """JSON facts: the settings and the modules, as stored by a ``GradRecorder``."""
        return {
            **self.settings.to_json(),
            "modules": list(self.modules),
            "compact": list(self.compact),
        }

    def __enter__(self) -> SparseBackprop:
        if self.active:
            raise ConfigError("this sparse_backprop context is already active; enter it once.")
        for other in _ACTIVE:
            theirs = {id(m) for m in other.modules.values()}
            taken = [n for n, m in self.modules.items() if id(m) in theirs]
            if taken:
                raise ConfigError(
                    f"modules {taken[:5]} are already sparsified by an active sparse_backprop "
                    f"({other.settings.to_json()}); exit that context first, or choose a "
                    "`where` that selects other modules."
                )
        try:
            for name, module in self.modules.items():
                self._handles.append(self._hook(name, module))
        except BaseException:
            self._remove()
            raise
        _ACTIVE.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._remove()

    def _hook(self, name: str, module: nn.Module) -> Any:
        """Its forward hook on ``module``, prepended: run before every other forward hook, so
        that observers of the output's gradient (gradlog's hooks backend) hook it after (and
        kept first by them: ``gradlog_first``, see ``_torch_private.forward_hooks_first``)."""
        if self.settings.per == "child":
            hook, options = functools.partial(self._on_forward_child), {"with_kwargs": True}
        else:
            hook, options = functools.partial(self._on_forward, name in self.compact), {}
        hook.gradlog_first = True  # type: ignore[attr-defined]
        return module.register_forward_hook(hook, prepend=True, **options)

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    # -- hooks ------------------------------------------------------------------------------
    def _on_forward(
        self, compact: bool, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> Any:
        if not torch.is_grad_enabled():
            return None
        if compact and isinstance(output, torch.Tensor) and output.requires_grad:
            x = args[0] if args else None
            linear: Any = module
            if isinstance(x, torch.Tensor) and tuple(output.shape) == (
                *x.shape[:-1],
                linear.out_features,
            ):
                call = Call(output.detach())
                out = CompactLinear.apply(x, linear.weight, linear.bias, call, self.settings)
                out.register_hook(functools.partial(self._on_grad, call))
                return out
        leaves, rebuild = flatten(output)
        aliases: dict[int, torch.Tensor] = {}  # a tensor returned twice has one gradient
        new = []
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                if id(t) not in aliases:
                    alias = Alias.apply(t, Call(t.detach()))
                    alias.register_hook(functools.partial(self._on_grad, None))
                    aliases[id(t)] = alias
                t = aliases[id(t)]
            new.append(t)
        return rebuild(new) if aliases else None

    def _on_forward_child(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in flatten(output)[0] if isinstance(t, torch.Tensor)]
        inputs = [t for t in flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        hook_nodes(tensors, inputs, self.settings.k_for, self._count)

    def _count(self) -> None:
        self.calls += 1

    def _on_grad(self, call: Call | None, grad: torch.Tensor) -> torch.Tensor | None:
        sel = select(grad, self.settings)
        self.calls += 1
        if call is not None:
            call.sel = sel  # the compact backward reuses the selection
        return None if sel is None else sel.masked


def _compactable(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` forward (subclasses overriding it compute something else)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _matcher(where: Where) -> tuple[tuple[str, ...], Callable[[str, nn.Module], bool]]:
    """Normalise ``where`` and return (its JSON form, a predicate over (name, module))."""
    if where is None:
        where = nn.Linear
    items: list[str | type] = [where] if isinstance(where, (str, type)) else list(where)
    if not items:
        raise ConfigError(
            "sparse_backprop where= is empty; pass glob(s) over module names (e.g. "
            "'blocks.*.mlp.*'), module classes (nn.Linear), or leave it out for every nn.Linear."
        )
    for item in items:
        if not isinstance(item, (str, type)):
            raise ConfigError(
                f"sparse_backprop where= takes glob strings (over module names or class names) "
                f"and module classes, got {type(item).__name__} {item!r}."
            )
    patterns = [i for i in items if isinstance(i, str)]
    types = tuple(i for i in items if isinstance(i, type))

    def match(name: str, module: nn.Module) -> bool:
        if types and isinstance(module, types):
            return True
        cls = type(module).__name__
        return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(cls, p) for p in patterns)

    form = tuple(i if isinstance(i, str) else type_name(i) for i in items)
    return form, match


def sparse_backprop(
    model: nn.Module,
    *,
    k: int | None = None,
    fraction: float | None = None,
    where: Where = None,
    per: str = "token",
    mode: str = "masked",
) -> SparseBackprop:
    """Top-k sparse backprop at the outputs of selected modules, inside a ``with`` block.

    The gradient flowing back into each selected module's output keeps only its k
    largest-magnitude entries per row; the rest are set to zero before it continues. See the
    module docstring of :mod:`gradlog.sparse` for the exact semantics.

    Args:
        model: The model; only hooks are added (removed on exit), nothing is wrapped.
        k: Entries kept per row (exclusive with ``fraction``).
        fraction: Share of a row kept: ``ceil(fraction * n)`` of ``n`` entries, at least 1.
        where: Which modules: glob string(s) matched against module names (as in
            ``model.named_modules()``, e.g. ``"blocks.*.mlp.fc"``) or class names
            (``"Linear"``), and/or module classes (``nn.Linear``, matched with
            ``isinstance``). Default: every ``nn.Linear``. ``"*"`` also matches the model
            itself (name ``""``): its output, e.g. the logits, is then sparsified too.
            With ``per="child"`` the default is ``""``: the model itself, every node of its
            forward.
        per: ``"token"``: each position's last (feature) dimension; ``"datum"``: each datum's
            whole output, flattened, batch on dimension 0; ``"child"``: at every autograd node
            inside the selected modules, only the ``k`` inputs with the largest gradient (L1
            norm) receive theirs (``k=1``: the child with the largest gradient), the others
            zeros; ``fraction`` keeps ``ceil(fraction * n)`` of a node's ``n`` inputs.
        mode: ``"masked"`` (dense backward of the masked gradient) or ``"compact"`` (meProp:
            ``nn.Linear`` backward from the kept entries only; other modules masked).

    Returns:
        The context manager; its ``modules`` and ``compact`` name what it affects.

    Raises:
        ConfigError: invalid ``k``/``fraction``/``per``/``mode``, or ``where`` selects no
            module.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"sparse_backprop needs a torch.nn.Module, got {type(model).__name__}.")
    if where is None and per == "child":
        where = ""  # the model itself (named ""): every node of its forward
    form, match = _matcher(where)
    settings = SparseSettings(k=k, fraction=fraction, per=per, mode=mode, where=form)
    modules = {name: m for name, m in model.named_modules() if match(name, m)}
    if not modules:
        names = [n for n, _ in model.named_modules() if n][:8]
        classes = sorted({type(m).__name__ for m in model.modules()})[:8]
        raise ConfigError(
            f"sparse_backprop where={list(form)} selects no module of {type(model).__name__}. "
            f"Module names include {names}, classes {classes}; pass glob(s) over these names "
            "or class names, or module classes (e.g. where=nn.Linear)."
        )
    ctx = SparseBackprop(model, settings, modules)
    if mode == "compact" and not ctx.compact:
        raise ConfigError(
            f"sparse_backprop mode='compact' computes nn.Linear backwards from the kept "
            f"entries, but where={list(form)} selects no plain nn.Linear (selected: "
            f"{list(modules)[:5]}); select Linear modules or use mode='masked'."
        )
    return ctx


def active_settings(model: nn.Module) -> list[dict[str, Any]]:
    """What every active :func:`sparse_backprop` context does to ``model`` (those selecting
    at least one of its modules), oldest first, as JSON; empty when none is active."""
    if not _ACTIVE:
        return []
    ids = {id(m) for m in model.modules()}
    return [c.describe() for c in _ACTIVE if any(id(m) in ids for m in c.modules.values())]


def check_settings(model: nn.Module, recorded: list[dict[str, Any]]) -> None:
    """Refuse to record a step whose sparsity differs from the one the store recorded.

    Raises:
        ConfigError: a sparse_backprop context on ``model`` was entered or left after the
            recorder opened its store, or one with ``per="child"`` is active (its gradients
            are not per datum).
    """
    now = active_settings(model)
    child = [s for s in now if s["per"] == "child"]
    if child:
        raise ConfigError(
            f"sparse_backprop per='child' is active on this model ({child[0]}): it chooses, at "
            "each autograd node, from the gradient of the whole batch, so a datum's gradient "
            "under it depends on the other datums and gradlog cannot record it (the per-datum "
            "gradients would not sum to p.grad). Train with it outside GradRecorder, or record "
            "with per='token' or per='datum', which keep each datum's choice its own."
        )
    if now == recorded:
        return
    raise ConfigError(
        f"the sparse_backprop settings of this model changed while recording (the store "
        f"recorded {recorded or 'dense backprop'}, now {now or 'dense backprop'}), so the store "
        "would misreport how these gradients were computed. Enter sparse_backprop before "
        "opening the GradRecorder (the outer `with`) and keep it for the whole recording, or "
        "record each setting into its own store."
    )

