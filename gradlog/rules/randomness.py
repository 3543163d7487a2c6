"""Dropout masks of a module that the ``torch.func`` fallback re-runs per datum.

A re-run cannot draw the masks the batch's forward drew. So for each module the fallback
computes, the hooks backend installs :func:`track_dropout` when recording starts: during
every forward of that module, each of its dropout submodules (``nn.Dropout``,
``Dropout1d/2d/3d``: multiplicative masks) notes the global RNG state before it draws and,
after its call, rebuilds its scaled mask (the same draw, on a tensor of ones of the input's
shape, dtype and strides, with the RNG forked so training's stream is unchanged). The masks
of one call are kept with that call's input tensors. :func:`masks_of` hands them to
:func:`gradlog.rules.func.func_grads`, which re-runs the module with its dropouts switched
to eval mode and each output multiplied by that datum's row of its mask (:func:`replay`).

A functional ``F.dropout`` in the forward of the module or of its submodules (transformers'
eager attention dropout) is noted and replayed the same way, seen by a
:class:`~torch.overrides.TorchFunctionMode` pushed for the module's training forwards and
its re-runs (:class:`_Functional`).

Drop-path modules of libraries (transformers' ``BeitDropPath``, ``ConvNextDropPath`` and
their kin, timm's ``DropPath``: named ``...DropPath``, a ``drop_prob``, no parameters) draw
one multiplicative mask per datum the same way; as their forward is matched by name, each
call's output is checked to be its input times the rebuilt mask, and a call that is not is
refused (:func:`masks_of`). Other random draws (``AlphaDropout``, ``torch.rand`` in the
module's own forward, the dropout of ``F.scaled_dot_product_attention`` or inside
``nn.LSTM``/``MultiheadAttention``) are not replayed: those modules stay refused, never
computed with other masks (``MultiheadAttention``'s rule takes a training call's per-datum
gradients from the batch's own backward instead: :func:`draw_free`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from gradlog._torch_private import cuda_devices, dropout_rate, forked_rng, rng_states
from gradlog._tree import leaves
from gradlog.errors import BackendError

__all__ = [
    "REPLAYABLE", "draw_free", "masks_of", "replay", "track_dropout", "tracked", "undraw_free",
]

REPLAYABLE: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                                           nn.Dropout3d)
"""Dropout layers whose output is their input times a mask drawn by their own forward."""

_TRACKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # dropouts whose masks are noted
# modules whose rule takes their per-datum gradients from the batch's own backward, not a
# re-run: their own draws need no replay (MultiheadAttention in training: .attention)
_DRAW_FREE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_MAX_FRAMES = 64  # calls kept per module whose backward has not come (yet)


@dataclass
class _Frame:
    """The masks one call of a tracked module drew, with its input tensors (weakly)."""

    inputs: list[weakref.ref[torch.Tensor]]
    masks: list[torch.Tensor] = field(default_factory=list)
    ambiguous: bool = False  # another call on the same inputs: whose masks are whose?
    others_drew: bool = False  # and that call drew masks
    unlike: str = ""  # a drop path whose output was not its input times the mask

    def alive(self) -> bool:
        return all(r() is not None for r in self.inputs)


_FRAMES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], _Frame]] = (
    weakref.WeakKeyDictionary())


class _Replay:
    """The masks the re-run's dropouts apply, in call order (None: not replaying)."""

    masks: list[torch.Tensor] | None = None


def _replayable(m: nn.Module) -> bool:
    return type(m) in REPLAYABLE or _drop_path(m) is not None


def _rate(m: nn.Module) -> float:
    """A tracked dropout layer's rate (0: it draws nothing)."""
    rate = dropout_rate(m)
    return float((_drop_path(m) if rate is None else rate) or 0.0)


def _drop_path(m: nn.Module) -> float | None:
    """A library's drop-path module's rate (see the module doc), else None."""
    rate = getattr(m, "drop_prob", None)
    if (not type(m).__name__.endswith("DropPath") or not isinstance(rate, float)
            or any(True for _ in m.parameters())):
        return None
    return rate


def _key(args: Any) -> tuple[int, ...]:
    return tuple(id(t) for t in leaves(args) if isinstance(t, torch.Tensor))


def tracked(module: nn.Module) -> bool:
    """Whether ``module`` is a dropout whose masks :func:`track_dropout` notes."""
    return module in _TRACKED


def _dropout_call(args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[torch.Tensor, float, bool]:
    """``F.dropout``'s (input, p, training) from a call's arguments."""
    names = ("input", "p", "training", "inplace")
    given = {**dict(zip(names, args)), **kwargs}
    return given["input"], float(given.get("p", 0.5)), bool(given.get("training", True))


class _Functional(TorchFunctionMode):
    """Notes the mask of each ``F.dropout`` call that draws one into the module's current
    frame (in call order with its dropout layers'), or, in a re-run (:func:`replay`),
    applies the next mask instead of drawing."""

    def __init__(self, frame: _Frame | None) -> None:
        super().__init__()
        self.frame = frame

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.dropout or _Layer.inside:
            return func(*args, **kwargs)
        x, p, training = _dropout_call(args, kwargs)
        if not training or p == 0.0:
            return func(*args, **kwargs)
        if _Replay.masks is not None:  # the re-run: this datum's row of the batch's mask
            if not _Replay.masks:
                raise RuntimeError("a dropout ran more often in the re-run than in the forward")
            return x * _Replay.masks.pop(0)
        state = rng_states(cuda_devices([x]))
        out = func(*args, **kwargs)
        if self.frame is not None:
            with forked_rng(cuda_devices([x]), state), torch.no_grad():
                self.frame.masks.append(F.dropout(torch.ones_like(x), p, True))
        return out


class _Layer:
    """Whether a tracked dropout layer is running (its own ``F.dropout`` is noted by its
    hooks, not by :class:`_Functional`)."""

    inside = False


def track_dropout(module: nn.Module) -> list[Any]:
    """Note the masks drawn by ``module``'s dropout submodules and functional dropouts in
    each of its training forwards.

    Returns:
        The hook handles (remove them to stop).
    """
    drops = [m for m in module.modules() if _replayable(m)]
    current: list[_Frame | None] = [None]
    states: dict[int, dict[str, torch.Tensor]] = {}
    modes: list[_Functional] = []

    def leave(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              out: Any) -> None:
        if modes:
            modes.pop().__exit__(None, None, None)

    def enter(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _Replay.masks is not None or not torch.is_grad_enabled():
            current[0] = None
            return
        frames = _FRAMES.setdefault(module, {})
        for k in [k for k, f in frames.items() if not f.alive()]:
            del frames[k]  # calls whose inputs are gone: their backward will not come
        while len(frames) >= _MAX_FRAMES:
            del frames[next(iter(frames))]
        tensors = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        frame = _Frame([weakref.ref(t) for t in tensors])
        key = _key((args, kwargs))
        if key in frames:  # called again on the same inputs: whose masks are whose is unknown
            frames[key].ambiguous = frame.ambiguous = True
            frame.others_drew = bool(frames[key].masks) or frames[key].others_drew
        frames[key] = frame
        current[0] = frame
        if module.training and not torch.compiler.is_compiling():
            modes.append(_Functional(frame))
            modes[-1].__enter__()

    def before(m: nn.Module, args: tuple[Any, ...]) -> None:
        _Layer.inside = True
        if _Replay.masks is None and current[0] is not None and m.training and _rate(m):
            x = args[0]
            states[id(m)] = rng_states(cuda_devices([x]))

    def after(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        try:
            return noted(m, args, out)
        finally:
            _Layer.inside = False  # (after the mask's rebuild, whose F.dropout is this layer's)

    def noted(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        if _Replay.masks is not None:  # the re-run: this datum's row of the batch's mask
            if not _rate(m):
                return None  # (drew nothing in the forward: a rate of 0)
            if not _Replay.masks:
                raise RuntimeError("a dropout ran more often in the re-run than in the forward")
            return out * _Replay.masks.pop(0)
        frame, state = current[0], states.pop(id(m), None)
        if frame is None or state is None or not m.training:
            return None
        x = args[0]
        with forked_rng(cuda_devices([x]), state), torch.no_grad():
            mask = m.forward(torch.ones_like(x))  # the draw the call made, scaled 1/(1-p)
            if type(m) not in REPLAYABLE and not (isinstance(out, torch.Tensor) and torch.allclose(
                    out, x * mask, rtol=8 * torch.finfo(x.dtype).eps, atol=0.0)):
                frame.unlike = type(m).__name__  # (matched by name: not a mask on its input)
        frame.masks.append(mask)
        return None

    handles = [module.register_forward_pre_hook(enter, with_kwargs=True),
               module.register_forward_hook(leave, with_kwargs=True, always_call=True)]
    for m in drops:
        handles.append(m.register_forward_pre_hook(before))
        handles.append(m.register_forward_hook(after))
        _TRACKED.add(m)
    return handles


def masks_of(module: nn.Module, args: Any) -> list[torch.Tensor] | None:
    """The masks the call of ``module`` on ``args`` (its captured ``(args, kwargs)``) drew,
    removed from the store; None when none were noted for it."""
    frames = _FRAMES.get(module)
    if not frames:
        return None
    frame = frames.pop(_key(args), None)
    tensors = [t for t in leaves(args) if isinstance(t, torch.Tensor)]
    if frame is not None and (len(frame.inputs) != len(tensors) or any(
            r() is not t for r, t in zip(frame.inputs, tensors))):
        frame = None  # (another call's, whose inputs' ids were reused: not this call's)
    if frame is not None and frame.ambiguous and (frame.masks or frame.others_drew):
        raise BackendError(
            f"{type(module).__name__} was called more than once on the same inputs in one "
            "forward and its dropouts drew masks in each call: gradlog cannot tell which "
            "call's backward is which, to replay its masks. Set those dropouts to 0 or use "
            "backend='loop'."
        )
    if frame is not None and frame.unlike:
        raise BackendError(
            f"{frame.unlike} inside {type(module).__name__} is named like a drop path, but "
            "its output was not its input times a mask its forward drew, so gradlog cannot "
            "replay it in the per-datum re-run. Set its rate to 0, put it in eval mode, or "
            "use backend='loop'."
        )
    return None if frame is None else frame.masks


def draw_free(module: nn.Module) -> None:
    """Mark ``module`` as computed from the batch's own backward (no re-run), so that its
    own draws are not listed by :func:`unreplayed`; its rule then refuses a call whose
    forward it could not follow."""
    _DRAW_FREE.add(module)


def undraw_free(module: nn.Module) -> None:
    """Undo :func:`draw_free` (recording ended)."""
    _DRAW_FREE.discard(module)


def unreplayed(module: nn.Module) -> list[str]:
    """Names of ``module``'s submodules that draw random numbers in this mode and whose
    draws are not noted (see the module doc)."""
    found = []
    for name, m in module.named_modules():
        if not m.training:
            continue
        rate = dropout_rate(m)
        rate = _drop_path(m) if rate is None else rate
        if rate is not None:
            p = 0.0 if m in _TRACKED and _replayable(m) else rate
        elif isinstance(m, nn.RNNBase):
            p = m.dropout if m.num_layers > 1 else 0.0  # dropout acts between layers only
        elif isinstance(m, nn.MultiheadAttention):
            p = 0.0 if name == "" and m in _DRAW_FREE else m.dropout
        else:
            continue
        if p > 0:
            found.append(name)
    return found


@contextlib.contextmanager
def replay(module: nn.Module, masks: Sequence[torch.Tensor]) -> Iterator[None]:
    """Re-run ``module`` with its tracked dropouts applying ``masks`` in call order (each
    already the datum's slice, shaped like the dropout's output) instead of drawing."""
    drops = [m for m in module.modules() if m in _TRACKED and m.training]
    for m in drops:
        m.training = False  # (its forward is then the identity; the hook applies the mask)
    _Replay.masks = list(masks)
    try:
        with _Functional(None):
            yield
        if _Replay.masks:
            raise RuntimeError("a dropout ran less often in the re-run than in the forward")
    finally:
        _Replay.masks = None
        for m in drops:
            m.training = True
