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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from gradlog.errors import ConfigError
from gradlog.rules.func import flatten

__all__ = [
    "MODES",
    "PER",
    "SparseBackprop",
    "SparseSettings",
    "active_settings",
    "check_settings",
    "sparse_backprop",
]

PER: dict[str, str] = {
    "token": "each position separately, along the output's last (feature) dimension",
    "datum": "each datum's whole output, flattened (batch on dimension 0)",
}
"""The closed set of ``per=`` values: which entries compete for the k places of a row."""

MODES: dict[str, str] = {
    "masked": "dense backward of the masked gradient (the semantics, no speed-up)",
    "compact": "nn.Linear backward from the kept entries only (meProp); other modules masked",
}
"""The closed set of ``mode=`` values."""

_COMPACT_DTYPES = (torch.float32, torch.float64)  # sparse-dense matmuls on every device
_ACTIVE: list[SparseBackprop] = []  # entered and not yet exited, oldest first

Where = str | type | Sequence[str | type] | None


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


@dataclass(frozen=True)
class SparseSettings:
    """What :func:`sparse_backprop` keeps, validated.

    Attributes:
        k: Entries kept per row (exclusive with ``fraction``).
        fraction: Share of a row's entries kept, ``ceil(fraction * n)`` (at least 1).
        per: Rows: ``"token"`` or ``"datum"`` (see :data:`PER`).
        mode: ``"masked"`` or ``"compact"`` (see :data:`MODES`).
        where: The module patterns, as strings (classes by qualified name).
    """

    k: int | None = None
    fraction: float | None = None
    per: str = "token"
    mode: str = "masked"
    where: tuple[str, ...] = field(default=(_type_name(nn.Linear),))

    def __post_init__(self) -> None:
        if self.k is not None and self.fraction is not None:
            raise ConfigError(
                f"sparse_backprop got both k={self.k!r} and fraction={self.fraction!r}; pass "
                "one of them: k=<entries kept per row> or fraction=<share of a row kept>."
            )
        if self.k is None and self.fraction is None:
            raise ConfigError(
                "sparse_backprop needs how much to keep: pass k=<int >= 1> (entries kept per "
                "row) or fraction=<float in (0, 1]> (share of a row kept)."
            )
        if self.k is not None and (
            isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1
        ):
            raise ConfigError(
                f"sparse_backprop k must be an int >= 1 (entries kept per row), got {self.k!r};"
                " pass e.g. k=32, or fraction=0.05 for a share of each row."
            )
        if self.fraction is not None:
            bad = isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float))
            if bad or not 0.0 < float(self.fraction) <= 1.0:
                raise ConfigError(
                    f"sparse_backprop fraction must be a number in (0, 1] (the share of each "
                    f"row's entries kept), got {self.fraction!r}; pass e.g. fraction=0.05, or "
                    "k=<int> for a fixed count."
                )
        if self.per not in PER:
            raise ConfigError(
                f"sparse_backprop per={self.per!r} is not one of {sorted(PER)}; pass "
                "per='token' (each position's features) or per='datum' (the whole datum)."
            )
        if self.mode not in MODES:
            raise ConfigError(f"sparse_backprop mode={self.mode!r} is not one of {sorted(MODES)}.")

    def k_for(self, n: int) -> int:
        """Entries kept of a row of ``n`` (``n`` or more: the whole row)."""
        if self.k is not None:
            return self.k
        assert self.fraction is not None  # __post_init__ guarantees one of them
        # round() first: 0.05 * 100 is 5.000000000000001 in binary floating point.
        return max(1, math.ceil(round(self.fraction * n, 9)))

    def to_json(self) -> dict[str, Any]:
        """JSON form (stored in the run's attributes)."""
        return {
            "k": self.k,
            "fraction": None if self.fraction is None else float(self.fraction),
            "per": self.per,
            "mode": self.mode,
            "where": list(self.where),
        }


@dataclass
class _Selection:
    """The kept entries of one gradient, as ``(rows, k)`` positions in its 2-D row view."""

    shape: torch.Size  # the gradient's shape
    index: torch.Tensor  # (rows, k) positions within a row
    values: torch.Tensor  # (rows, k)
    masked: torch.Tensor  # the gradient with zeros elsewhere, in its own shape


def _rows(grad: torch.Tensor, per: str) -> torch.Tensor:
    """The 2-D row view of a gradient: (rows, entries competing for the k places)."""
    if per == "datum":
        return grad.reshape(grad.shape[0], -1)  # (B, n)
    return grad.reshape(-1, grad.shape[-1])  # (rows, n)


def _select(grad: torch.Tensor, settings: SparseSettings) -> _Selection | None:
    """Top-k of each row of ``grad`` by magnitude; None when every entry is kept."""
    if grad.dim() == 0 or grad.numel() == 0:
        return None
    flat = _rows(grad, settings.per)  # (rows, n)
    n = flat.shape[1]
    k = settings.k_for(n)
    if k >= n:
        return None
    index = flat.abs().topk(k, dim=1, sorted=False).indices  # (rows, k)
    values = flat.gather(1, index)  # (rows, k)
    masked = flat.new_zeros(flat.shape).scatter_(1, index, values)  # (rows, n)
    return _Selection(grad.shape, index, values, masked.view(grad.shape))


class _Call:
    """One compact Linear call: its output until the function takes it, then the selection
    the output's gradient hook made, until the function's backward uses it."""

    __slots__ = ("out", "sel")

    def __init__(self, out: torch.Tensor) -> None:
        self.out: torch.Tensor | None = out
        self.sel: _Selection | None = None


class _CompactLinear(torch.autograd.Function):
    """``y = x W^T + b`` whose backward uses only the kept entries of the output gradient.

    The forward returns the output the module already computed (no second matmul): it is
    passed in through ``call``, outside autograd's view of the inputs, so the returned tensor
    is a plain output (in-place ops after the layer, e.g. ``ReLU(inplace=True)``, work).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        call: _Call,
        settings: SparseSettings,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.call = call
        ctx.settings = settings
        ctx.has_bias = bias is not None
        out, call.out = call.out, None
        assert out is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        call: _Call = ctx.call
        settings: SparseSettings = ctx.settings
        sel, call.sel = call.sel, None
        if sel is None or sel.masked is not grad:  # no hook ran, or a later hook changed it
            sel = _select(grad, settings)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        d_out, d_in = weight.shape
        x2 = x.reshape(-1, d_in)  # (N, d_in)
        N = x2.shape[0]
        grad_x = grad_w = grad_b = None
        if sel is None or weight.dtype not in _COMPACT_DTYPES:  # dense: all kept, or a dtype
            g = (grad if sel is None else sel.masked).reshape(N, d_out).to(weight.dtype)
            if need_x:
                grad_x = (g @ weight).to(x.dtype).view(x.shape)  # (..., d_in)
            if need_w:
                grad_w = g.t() @ x2.to(weight.dtype)  # (d_out, d_in)
            if need_b and ctx.has_bias:
                grad_b = g.sum(0)  # (d_out,)
            return grad_x, grad_w, grad_b, None, None
        rows, cols = _coordinates(sel, settings.per, d_out)  # (M,), (M,) in the (N, d_out) view
        values = sel.values.reshape(-1).to(weight.dtype)  # (M,)
        if need_x:
            s = _sparse(torch.stack([rows, cols]), values, (N, d_out))  # (N, d_out), M entries
            grad_x = torch.sparse.mm(s, weight).to(x.dtype).view(x.shape)  # (..., d_in)
        if need_w:
            st = _sparse(torch.stack([cols, rows]), values, (d_out, N))  # (d_out, N)
            grad_w = torch.sparse.mm(st, x2.to(weight.dtype))  # (d_out, d_in)
        if need_b and ctx.has_bias:
            grad_b = values.new_zeros(d_out).index_add_(0, cols, values)  # (d_out,)
        return grad_x, grad_w, grad_b, None, None


class _Alias(torch.autograd.Function):
    """The identity, as a new plain tensor sharing the output's memory (no copy).

    The sparsifying hook goes on this tensor rather than on the module's output because a
    Linear's output on ``(B, T, d)`` inputs is a view: an in-place op after the layer
    (``ReLU(inplace=True)``) re-routes the backward around a view's own node, and a hook
    registered on it would never fire. It also keeps a module that returns its input from
    sparsifying the input's other uses.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: _Call) -> torch.Tensor:
        out, call.out = call.out, None
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _coordinates(sel: _Selection, per: str, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every kept entry in the ``(N, d_out)`` view of a Linear's output."""
    n_rows, k = sel.index.shape
    if per == "datum":  # a datum's row is its L positions x d_out features, flattened
        per_datum = math.prod(sel.shape) // (n_rows * d_out)  # positions per datum
        base = torch.arange(n_rows, device=sel.index.device).unsqueeze(1) * per_datum  # (B,1)
        rows = (base + sel.index.div(d_out, rounding_mode="floor")).reshape(-1)  # (B*k,)
        return rows, sel.index.remainder(d_out).reshape(-1)
    rows = torch.arange(n_rows, device=sel.index.device).repeat_interleave(k)  # (N*k,)
    return rows, sel.index.reshape(-1)


def _sparse(indices: torch.Tensor, values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    # Invariants hold by construction (distinct in-range indices); checking them costs a pass.
    return torch.sparse_coo_tensor(indices, values, size, check_invariants=False)


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
        compact = set(self.compact)
        try:
            for name, module in self.modules.items():
                hook = functools.partial(self._on_forward, name in compact)
                # prepend: run before every other forward hook, so that observers of the
                # output's gradient (gradlog's hooks backend) hook it after this one.
                self._handles.append(module.register_forward_hook(hook, prepend=True))
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
                call = _Call(output.detach())
                out = _CompactLinear.apply(x, linear.weight, linear.bias, call, self.settings)
                out.register_hook(functools.partial(self._on_grad, call))
                return out
        leaves, rebuild = flatten(output)
        aliases: dict[int, torch.Tensor] = {}  # a tensor returned twice has one gradient
        new = []
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                if id(t) not in aliases:
                    alias = _Alias.apply(t, _Call(t.detach()))
                    alias.register_hook(functools.partial(self._on_grad, None))
                    aliases[id(t)] = alias
                t = aliases[id(t)]
            new.append(t)
        return rebuild(new) if aliases else None

    def _on_grad(self, call: _Call | None, grad: torch.Tensor) -> torch.Tensor | None:
        sel = _select(grad, self.settings)
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

    form = tuple(i if isinstance(i, str) else _type_name(i) for i in items)
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
        per: ``"token"``: each position's last (feature) dimension; ``"datum"``: each datum's
            whole output, flattened, batch on dimension 0.
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
            recorder opened its store.
    """
    now = active_settings(model)
    if now == recorded:
        return
    raise ConfigError(
        f"the sparse_backprop settings of this model changed while recording (the store "
        f"recorded {recorded or 'dense backprop'}, now {now or 'dense backprop'}), so the store "
        "would misreport how these gradients were computed. Enter sparse_backprop before "
        "opening the GradRecorder (the outer `with`) and keep it for the whole recording, or "
        "record each setting into its own store."
    )
