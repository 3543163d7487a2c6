"""Every use of torch's private API in gradlog, each behind one function with a fallback.

gradlog reads a few things torch does not expose publicly: the autograd engine's graph
task, the saved-tensor hooks in force, storage reference counts, functorch's wrapped tensors,
members of autograd nodes (:mod:`.nodes`), hooks and views, the torch-function mode stack
and ``parametrize``'s cache; and it replaces one global for a while (``F.linear``, which
``F.multi_head_attention_forward`` calls by name: :func:`functional_linear_noted`). They
live here alone, so a torch upgrade that moves one breaks this package only. Each function
says what it returns when the private API is missing; no fallback is wrong, only less
precise (a check that runs later, a buffer that is not reused).

The global RNG state (CPU and CUDA) is read and restored here too: public API, but every
replay of a computation (the datum check, chunked heads, a dropout's mask) needs the same.

Torch versions: CI runs 2.13, the suite also 2.4.1 and 2.6.0 (README). torch 2.4 frees an
autograd node's Python object no one holds and reuses its id: walks hold the nodes they key.

This module imports only torch and the standard library (layer 1).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "DispatchMode",
    "InCompiledRegion",
    "backward_keeps_graph",
    "conv_reversed_padding",
    "cuda_devices",
    "dropout_rate",
    "force_eager",
    "forked_rng",
    "forward_hooks_kept",
    "forward_pre_hooks",
    "fsdp_reduces_grads",
    "functional_linear_noted",
    "global_module_backward_hooks_on",
    "in_autograd_backward",
    "in_checkpoint_recompute",
    "is_functorch_wrapped",
    "linear_ops",
    "module_has_backward_hooks",
    "parametrize_cache_suspended",
    "rng_states",
    "saved_tensor_hooks_kind",
    "set_rng_states",
    "storage_key",
    "storage_use_count",
    "tensor_hook_count",
    "tensor_hooks",
    "tensor_post_accumulate_hooks",
    "tensor_version",
    "tree_leaves",
    "view_base",
]

_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def in_autograd_backward() -> bool:
    """Whether the autograd engine is running a backward right now.

    Private API: ``torch._C._current_graph_task_id``. Fallback: False (a call is then taken
    for a forward).
    """
    return _graph_task_id is not None and _graph_task_id() != -1


def backward_keeps_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``). Private API:
    ``torch._C._autograd._get_current_graph_task_keep_graph``. Fallback: False."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(keep()) if keep is not None else False


def _top_saved_tensor_hooks() -> tuple[Any, ...] | None:
    """The (pack, unpack) saved-tensor hooks in force; None when this torch cannot say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        hooks = top(False)
    except TypeError:  # a torch whose binding takes no argument
        hooks = top()
    except RuntimeError:
        return None
    return tuple(hooks) if hooks else ()


def in_checkpoint_recompute() -> bool:
    """Whether this runs inside the recomputation of a ``torch.utils.checkpoint(
    use_reentrant=False)`` segment (torch's ``_recomputation_hook`` saved-tensor hooks).

    Private API: ``torch._C._autograd._top_saved_tensors_default_hooks``. Fallback: False
    (the recomputed call is then captured but, never receiving a gradient, computes nothing).
    """
    hooks = _top_saved_tensor_hooks()
    pack = hooks[0] if hooks else None
    return getattr(pack, "__qualname__", "").startswith("_recomputation_hook.")


def saved_tensor_hooks_kind() -> str:
    """Which saved-tensor hooks are in force: ``"none"``; ``"checkpoint"``, torch's own
    non-reentrant activation checkpointing (its unpacking recomputes per backward, so a
    graph may be differentiated several times); ``"selective"``, selective activation
    checkpointing (its cached activations are used up by the first backward); ``"other"``,
    hooks gradlog does not know (offloading, the user's own) or a torch that cannot say.

    Private API: ``torch._C._autograd._top_saved_tensors_default_hooks``, the pack hook's
    ``__qualname__`` (``_checkpoint_hook.__init__.<locals>.pack_hook``) and
    ``torch.utils._python_dispatch._get_current_dispatch_mode_stack`` (selective
    checkpointing's ``_CachingTorchDispatchMode``). Fallback: ``"other"``.
    """
    hooks = _top_saved_tensor_hooks()
    if hooks is None:
        return "other"
    if not hooks or hooks[0] is None:
        return "none"
    if not getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook."):
        return "other"
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        modes = _get_current_dispatch_mode_stack()
    except (ImportError, RuntimeError):
        return "other"
    if any(type(m).__name__ == "_CachingTorchDispatchMode" for m in modes):
        return "selective"
    return "checkpoint"


def force_eager() -> Callable[[], None] | None:
    """Make ``torch.compile``'d code run eagerly (no tracing, no recompiles) until the
    returned function is called; None when this torch cannot (torch < 2.6).

    Raises:
        InCompiledRegion: called while compiled code runs (dynamo traces or runs a function
            that calls the model): too late to keep it eager.

    Public API since torch 2.6: ``torch.compiler.set_stance("force_eager")``, whose return
    value restores the prior stance on ``__exit__``.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    if torch.compiler.is_compiling():  # dynamo traces this call: it may not set_stance
        raise InCompiledRegion("called while torch.compile traces the caller")
    try:
        stance = set_stance("force_eager")
    except RuntimeError as e:  # "attempted to set_stance in a torch.compile region"
        raise InCompiledRegion(str(e)) from None

    def restore() -> None:
        stance.__exit__(None, None, None)

    return restore


class InCompiledRegion(RuntimeError):
    """:func:`force_eager` was called while a ``torch.compile``'d function or module runs
    (the recorded model is called from inside it)."""


@contextlib.contextmanager
def torch_function_mode_paused(mode: Any) -> Iterator[None]:
    """The body without ``mode`` in the torch-function stack, modes above it kept (the hooks'
    reads of tensor attributes are not the model's ops). Private API: ``torch._C``'s stack."""
    c = torch._C
    top = c._len_torch_function_stack() if hasattr(c, "_len_torch_function_stack") else 0
    at = next((i for i in range(top) if c._get_function_stack_at(i) is mode), None)
    if at is None:
        yield
        return
    above = [c._pop_torch_function_stack() for _ in range(top - 1 - at)][::-1]  # outer first
    c._pop_torch_function_stack()
    for m in above:
        c._push_on_torch_function_stack(m)
    try:
        yield
    finally:
        for _ in above:
            c._pop_torch_function_stack()
        for m in (mode, *above):
            c._push_on_torch_function_stack(m)


def forward_hooks_first(module: torch.nn.Module) -> tuple[list[Any], tuple[Any, ...]]:
    """The forward hooks before ``module``'s marked ``gradlog_first`` 2 (the capture), and the
    global ones; then that hook is put right after the last marked 1 (``gradlog.sparse``'s),
    the others kept in order. Private API: ``Module._forward_hooks``, ``_global_forward_hooks``."""
    hooks, above = module._forward_hooks, torch.nn.modules.module._global_forward_hooks
    if len(hooks) == 1 and not above:  # (the usual case: the capture alone)
        return ([] if getattr(next(iter(hooks.values())), "gradlog_first", 0) == 2
                else list(hooks.values())), ()
    items, ranks = list(hooks.items()), [getattr(h, "gradlog_first", 0) for h in hooks.values()]
    at = ranks.index(2) if 2 in ranks else len(ranks)  # (none: nothing moves)
    rest = items[:at] + items[at + 1 :]
    last = max((i + 1 for i, r in enumerate(ranks[:at] + ranks[at + 1 :]) if r == 1), default=0)
    for key, _ in rest[:last] + items[at : at + 1] + rest[last:] if last != at < len(ranks) else ():
        hooks[key] = hooks.pop(key)  # (re-inserted in the order wanted)
    return [h for _, h in items[:at]], tuple(above.values())


def forward_pre_hooks(module: nn.Module) -> list[tuple[Callable[..., Any], bool]]:
    """``module``'s forward pre-hooks in order, each with whether it takes keyword arguments.
    Private API: ``Module._forward_pre_hooks``, ``_forward_pre_hooks_with_kwargs``.
    Fallback: none (a re-run then misses a pruning mask: its records refused, not wrong)."""
    hooks = getattr(module, "_forward_pre_hooks", None) or {}
    with_kwargs = getattr(module, "_forward_pre_hooks_with_kwargs", None) or {}
    return [(hook, key in with_kwargs) for key, hook in hooks.items()]


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def forward_hooks_kept(*modules: nn.Module) -> Iterator[None]:
    """The hooks of ``modules``, their submodules and the global module hooks left as they
    were: any registered meanwhile (by a pre-hook replayed: a one-shot hook, which removes
    itself only when it runs, on the module, a sibling or the model) are removed after, and
    any removed are put back, in their order. Private API: ``Module._forward_hooks``,
    ``_forward_pre_hooks``, ``_backward_hooks``, ``_backward_pre_hooks``, their
    ``_with_kwargs``/``_always_called`` notes, and ``torch.nn.modules.module``'s
    ``_global_*`` dicts. Fallback: those not found are not kept."""
    owners: dict[int, nn.Module] = {}
    for module in modules:
        owners.update((id(m), m) for m in module.modules())
    found = [getattr(torch.nn.modules.module, "_global" + name, None) for name in _HOOK_DICTS]
    found += [getattr(m, name, None) for m in owners.values() for name in _HOOK_DICTS]
    kept = [(hooks, dict(hooks)) for hooks in found if isinstance(hooks, dict)]
    try:
        yield
    finally:
        for hooks, saved in kept:
            if hooks.keys() != saved.keys():
                hooks.clear()
                hooks.update(saved)


def gradient_accumulator(t: torch.Tensor) -> Any:
    """The node accumulating a leaf's gradient (``AccumulateGrad``), or None (public since
    torch 2.2: ``torch.autograd.graph.get_gradient_edge(t).node``)."""
    get = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if get is None:
        return None
    try:
        return get(t).node
    except (RuntimeError, TypeError):
        return None


def storage_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage.

    Private API: ``torch._C._storage_Use_Count`` and ``UntypedStorage._cdata``. Fallback: -1
    (callers then never reuse a buffer).
    """
    count = getattr(torch._C, "_storage_Use_Count", None)
    return int(count(t.untyped_storage()._cdata)) if count is not None else -1


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper (inside a ``torch.func`` transform). Private
    API: ``torch._C._functorch.is_functorch_wrapped_tensor``. Fallback: False."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else False


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t``. Private API: ``Tensor._version`` (in every
    supported torch; no fallback needed)."""
    return int(t._version)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None. Private API: ``Tensor._base``. Fallback: None
    (``t`` is then treated as no view)."""
    return getattr(t, "_base", None)


def tensor_hook_count(t: torch.Tensor) -> int:
    """The number of gradient hooks registered on ``t`` (``Tensor.register_hook``). Private
    API: ``Tensor._backward_hooks``. Fallback: 0."""
    return len(getattr(t, "_backward_hooks", None) or ())


def tensor_hooks(t: torch.Tensor) -> list[Callable[..., Any]]:
    """The gradient hooks registered on ``t``, in order. Private API:
    ``Tensor._backward_hooks``. Fallback: none."""
    return list((getattr(t, "_backward_hooks", None) or {}).values())


def tensor_post_accumulate_hooks(t: torch.Tensor) -> list[Callable[..., Any]]:
    """The hooks registered with ``Tensor.register_post_accumulate_grad_hook``, in order.
    Private API: ``Tensor._post_accumulate_grad_hooks``. Fallback: none."""
    return list((getattr(t, "_post_accumulate_grad_hooks", None) or {}).values())


def global_module_backward_hooks_on() -> bool:
    """Whether global module backward hooks are registered
    (``torch.nn.modules.module.register_module_full_backward_hook`` and its pre-hook).

    Private API: ``torch.nn.modules.module._global_backward_hooks`` and
    ``_global_backward_pre_hooks``. Fallback: False for a member that is missing.
    """
    module_hooks = torch.nn.modules.module
    return bool(getattr(module_hooks, "_global_backward_hooks", None)
                or getattr(module_hooks, "_global_backward_pre_hooks", None))


def module_has_backward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has its own (full) backward or backward-pre hooks.

    Private API: ``Module._backward_hooks`` and ``Module._backward_pre_hooks``. Fallback:
    False for a member that is missing.
    """
    return bool(getattr(module, "_backward_hooks", None)
                or getattr(module, "_backward_pre_hooks", None))


def dropout_rate(module: nn.Module) -> float | None:
    """The drop probability ``p`` of one of torch's dropout layers; None for other modules.

    Private API: ``torch.nn.modules.dropout._DropoutNd``. Fallback: the public dropout
    classes.
    """
    base = getattr(nn.modules.dropout, "_DropoutNd", None)
    kinds = (base,) if base is not None else (
        nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
        nn.FeatureAlphaDropout)
    if not isinstance(module, kinds):
        return None
    return float(cast(Any, module).p)


def conv_reversed_padding(module: nn.Module) -> list[int]:
    """The ``F.pad`` widths a convolution with a non-zero ``padding_mode`` applies.

    Private API: ``_ConvNd._reversed_padding_repeated_twice``. Fallback: computed from the
    public ``padding`` attribute (as torch computes it).
    """
    pad = getattr(module, "_reversed_padding_repeated_twice", None)
    if pad is not None:
        return list(pad)
    conv: Any = module  # a _ConvNd: kernel_size, dilation and padding are tuples (or a str)
    kernel = tuple(conv.kernel_size)
    padding = conv.padding
    if isinstance(padding, str):  # "valid" or "same", as torch's _ConvNd computes them
        out = [0, 0] * len(kernel)
        if padding == "same":
            for i, (d, k) in enumerate(zip(conv.dilation, kernel)):
                total = d * (k - 1)
                j = len(kernel) - 1 - i
                out[2 * j], out[2 * j + 1] = total // 2, total - total // 2
        return out
    return [p for p in reversed(tuple(padding)) for _ in range(2)]


def cuda_devices(tensors: Iterable[torch.Tensor] | torch.nn.Module) -> list[int]:
    """The CUDA device indices of ``tensors`` (a module: its parameters and buffers), sorted
    (a model split across devices draws random numbers on each)."""
    if isinstance(tensors, torch.nn.Module):
        tensors = [*tensors.parameters(), *tensors.buffers()]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def rng_states(cuda: Iterable[int] = ()) -> dict[str, torch.Tensor]:
    """The global random-number states: CPU, and each listed CUDA device.

    Args:
        cuda: CUDA device indices whose generators to capture (:func:`cuda_devices`).

    Returns:
        ``{"cpu": state, "cuda:0": state, ...}``, for :func:`set_rng_states` and
        :func:`forked_rng`.
    """
    states = {"cpu": torch.get_rng_state()}
    for index in cuda:
        states[f"cuda:{index}"] = torch.cuda.get_rng_state(index)
    return states


def set_rng_states(states: dict[str, torch.Tensor] | None) -> None:
    """Restore states captured by :func:`rng_states` (nothing for None)."""
    for where, state in (states or {}).items():
        if where == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, int(where.split(":")[1]))


@contextlib.contextmanager
def forked_rng(cuda: Iterable[int] = (),
               states: dict[str, torch.Tensor] | None = None) -> Iterator[None]:
    """Run the block with the global random-number states forked: after it they are as
    before, so the caller's random stream is unchanged (a probe forward's dropout, a model
    built from a seed, a replayed backward).

    Args:
        cuda: CUDA device indices to fork besides the CPU generator.
        states: Where the block starts (from :func:`rng_states`, whose CUDA devices are
            forked too), so that a replay draws what the captured run drew; None: from the
            current states.
    """
    devices = sorted({*cuda, *(int(k.split(":")[1]) for k in (states or {}) if k != "cpu")})
    with torch.random.fork_rng(devices=devices):
        set_rng_states(states)
        yield


@contextlib.contextmanager
def parametrize_cache_suspended() -> Iterator[None]:
    """The block runs with a user's ``torch.nn.utils.parametrize.cached()`` suspended: a
    re-run differentiating through a parametrization must evaluate it, not read the
    forward's weight. Private API: that module's ``_cache_enabled`` counter. Fallback
    (absent): nothing suspended."""
    module = torch.nn.utils.parametrize
    held = getattr(module, "_cache_enabled", 0)
    if held:
        module._cache_enabled = 0
    try:
        yield
    finally:
        if held:
            module._cache_enabled = held


def fsdp_reduces_grads(module: nn.Module) -> bool | None:
    """Whether FSDP2 modules under ``module`` reduce-scatter gradients in this backward
    (False after ``set_requires_gradient_sync(False)``: ``p.grad`` is then left unchanged
    and the gradients accumulate unsharded). Reads ``FSDPParamGroup.reduce_grads`` of the
    first module with a parameter group; None when that private state is missing."""
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = getattr(get_state(), "_fsdp_param_group", None)
        except Exception:  # another torch's state layout
            return None
        if group is not None and hasattr(group, "reduce_grads"):
            return bool(group.reduce_grads)
    return None


DispatchMode: type = torch.utils._python_dispatch.TorchDispatchMode
"""Base of a mode seeing every operator below autograd (the backward's too). Private API:
``torch.utils._python_dispatch.TorchDispatchMode`` (present throughout 2.4-2.13)."""


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of nested tuples, lists and dicts (private API ``torch.utils._pytree``;
    the same traversal ``__torch_dispatch__`` arguments need)."""
    return torch.utils._pytree.tree_leaves(tree)


def storage_key(t: torch.Tensor) -> int:
    """An identity for ``t``'s storage, unique while the storage lives, also on ``meta``.

    Private API: ``UntypedStorage._cdata``. Fallback: ``data_ptr()`` (the same on CPU and
    CUDA; not unique on meta, where counts then merge storages)."""
    storage = t.untyped_storage()
    key = getattr(storage, "_cdata", None)
    return int(key) if key is not None else int(storage.data_ptr())


def linear_ops() -> frozenset[Any]:
    """The callables ``__torch_function__`` may see for a linear layer: ``F.linear`` and
    its C binding (private ``torch._C._nn.linear``; absent: ``F.linear`` only)."""
    binding = getattr(getattr(torch._C, "_nn", None), "linear", None)
    return frozenset({torch.nn.functional.linear} | ({binding} if binding is not None else set()))


_LINEAR = torch.nn.functional.linear
_noting = threading.local()  # .notes: this thread's callbacks, innermost last
_noting_lock = threading.Lock()
_noting_users = 0  # bodies of functional_linear_noted running, on every thread


def _noted_linear(*args: Any, **kwargs: Any) -> torch.Tensor:
    out = _LINEAR(*args, **kwargs)
    notes = getattr(_noting, "notes", None)
    if notes:
        names = ("input", "weight", "bias")
        given = {**dict(zip(names, args)), **kwargs}
        notes[-1](given["input"], given["weight"], given.get("bias"), out)
    return out


@contextlib.contextmanager
def functional_linear_noted(
    note: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], None],
) -> Iterator[None]:
    """Within the body, on this thread, each call of ``torch.nn.functional.linear`` made
    through that module's global name is passed to ``note(input, weight, bias, output)``:
    ``F.multi_head_attention_forward``'s projections, which a torch-function mode does not
    see (that function takes the dispatch whole). Private: the global is replaced while any
    thread runs such a body (other threads' calls pass straight through, unnoted), then
    restored. Fallback: none needed; where torch's functions stop calling that global,
    ``note`` is not called, and callers refuse what they could not note."""
    global _noting_users
    notes = _noting.__dict__.setdefault("notes", [])
    with _noting_lock:
        if _noting_users == 0:
            torch.nn.functional.linear = _noted_linear
        _noting_users += 1
    notes.append(note)
    try:
        yield
    finally:
        notes.pop()
        with _noting_lock:
            _noting_users -= 1
            if _noting_users == 0:
                torch.nn.functional.linear = _LINEAR
