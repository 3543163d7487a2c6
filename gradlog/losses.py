"""From what the caller gives (per-datum or per-token losses) to one loss per datum.

Two shapes are easy to get wrong and would record wrong gradients without an error, so they
are checked from the losses' autograd graph (a few nodes below the losses, before any
backward):

- per-token losses flattened to ``(B*T,)`` (``F.cross_entropy(logits.view(-1, V),
  labels.view(-1), reduction="none")``, as language-model code often writes it) would make
  every token a datum: refused, naming the shape and the ``view(B, T)`` that fixes it;
- per-token losses ``(B, T)`` of ``cross_entropy``/``nll_loss`` whose labels hold
  ``ignore_index`` (``-100`` padding), reduced by ``mean`` without a ``mask`` that drops those
  positions, would count the padded positions (loss 0) in each datum's mean (a half-padded
  sequence would get half its gradient): refused, naming ``mask=labels != -100``. The labels
  are read from the loss's own graph, so this is exact; per-token losses of other origins
  that hold exact zeros get a warning instead (they may be ignored labels, or true zeros).

A check that reads values from the device can be left to :class:`DeviceChecks`: the recorder
reads all of a batch's at once, right before its backward touches ``p.grad``, so that the
host's own work before the backward runs while the device finishes the forward.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gradlog._torch_private import is_functorch_wrapped
from gradlog._torch_private.nodes import (
    autograd_node_nll_target,
    autograd_node_output_shape,
    autograd_node_shapes_known,
    autograd_node_view_input_sizes,
)
from gradlog.errors import InputError

__all__ = ["DeviceChecks", "per_datum_losses"]


class DeviceChecks:
    """Checks of a batch whose outcome is still on the device, read together by
    :meth:`settle` (one wait for the device): each a flag (a 0-dim bool tensor, True when the
    check fails) and what then raises its error (or warns)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, Callable[[], None]]] = []

    def add(self, failed: torch.Tensor, fail: Callable[[], None]) -> None:
        self._pending.append((failed, fail))

    @property
    def device(self) -> torch.device | None:
        """Where the first pending check's flag is (None: nothing pending)."""
        return self._pending[0][0].device if self._pending else None

    def settle(self) -> None:
        """Raise the first failed check's error (each check is read once)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        device = pending[0][0].device
        flags = torch.stack([f.reshape(()).to(device, torch.bool) for f, _ in pending])
        for (_, fail), failed in zip(pending, flags.tolist()):
            if failed:
                fail()


def per_datum_losses(
    losses: torch.Tensor, mask: torch.Tensor | None, token_reduction: str,
    checks: DeviceChecks | None = None,
) -> torch.Tensor:
    """Reduce ``(B,)`` or ``(B, T)`` losses to ``(B,)``: datum b's loss over its own tokens.

    With ``(B, T)`` losses, ``mask`` (bool or 0/1, same shape) marks the tokens that count;
    ``token_reduction`` is ``"mean"`` over a datum's unmasked tokens or their ``"sum"``. A
    datum with no unmasked token has loss 0 and gradient 0. Works under ``torch.func.vmap``.
    ``checks``: where the check of ignored labels leaves its count (read later), instead of
    reading it now.
    """
    if not isinstance(losses, torch.Tensor):
        raise InputError(
            f"losses must be a torch.Tensor of shape (B,) or (B, T), got {type(losses).__name__}."
        )
    if not losses.is_floating_point():
        raise InputError(f"losses must be floating point, got dtype {losses.dtype}.")
    if losses.dim() == 1:
        if mask is not None:
            raise InputError(
                "mask applies to per-token losses of shape (B, T); these losses have shape "
                f"{tuple(losses.shape)}. Drop mask, or pass per-token losses (reduction='none')."
            )
        _refuse_flattened(losses)
        return losses
    if losses.dim() != 2:
        raise InputError(
            f"losses must have shape (B,) per datum or (B, T) per token, got "
            f"{tuple(losses.shape)}. Compute the loss with reduction='none' and reshape it to "
            "(B, T), e.g. F.cross_entropy(logits.transpose(1, 2), y, reduction='none')."
        )
    if mask is not None and (
            not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(losses.shape)):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InputError(
            f"mask must be a tensor of the losses' shape {tuple(losses.shape)}, got {shape}."
        )
    if token_reduction == "mean":
        _refuse_ignored_in_mean(losses, mask, checks)
    if mask is None:
        return losses.mean(1) if token_reduction == "mean" else losses.sum(1)
    keep = mask.to(device=losses.device) != 0  # (B, T)
    total = torch.where(keep, losses, torch.zeros_like(losses)).sum(1)  # (B,)
    if token_reduction == "sum":
        return total
    count = keep.sum(1).clamp_min(1).to(losses.dtype)  # (B,)
    return total / count


_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")
_ORDER_KEEPING = (*_VIEWS, "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
                  "SqueezeBackward3", "UnsqueezeBackward0", "CloneBackward0", "ToCopyBackward0")


def _graph(losses: torch.Tensor) -> bool:
    """Whether the losses' autograd graph can be read (not under torch.func, not detached)."""
    return losses.grad_fn is not None and not is_functorch_wrapped(losses)


def _below(root: Any, depth: int, through: tuple[str, ...] | None = None) -> Iterator[Any]:
    """Autograd nodes within ``depth`` steps below ``root`` (walking on only through node
    types in ``through``, when given)."""
    level, seen = [root], {id(root): root}  # (held: a freed wrapper's id is reused)
    for _ in range(depth):
        following = []
        for node in level:
            yield node
            if through is not None and type(node).__name__ not in through:
                continue
            for child, _ in node.next_functions:
                if child is not None and id(child) not in seen:
                    seen[id(child)] = child
                    following.append(child)
        level = following


def _refuse_flattened(losses: torch.Tensor) -> None:
    """Refuse ``(B*T,)`` losses reshaped from a ``(B, T, ...)`` tensor a few ops above them
    (per-token losses of flattened logits): each token would be taken for a datum."""
    n = int(losses.shape[0])
    if n < 4 or not _graph(losses) or not autograd_node_shapes_known(losses.grad_fn):
        return
    for node in _below(losses.grad_fn, 6):
        if type(node).__name__ not in _VIEWS:
            continue
        sizes = autograd_node_view_input_sizes(node)
        out = autograd_node_output_shape(node)
        if sizes is None or len(sizes) < 2 or not out or out[0] != n:
            continue
        b, t = sizes[0], sizes[1]
        if b > 1 and t > 1 and b * t == n:
            raise InputError(
                f"losses have shape ({n},), computed from a tensor of shape {sizes} flattened "
                f"to {out}: {b} datums of {t} tokens each, flattened into {n} rows. gradlog "
                f"takes one loss per datum (B,) or per token (B, T), so each row would count "
                f"as a datum. Pass the per-token losses as (B, T): losses.view({b}, {t}), with "
                f"mask=(labels != -100).view({b}, {t}) when labels hold ignore_index padding "
                "(or reduce each datum's tokens yourself to (B,))."
            )


def _refuse_ignored_in_mean(losses: torch.Tensor, mask: torch.Tensor | None,
                            checks: DeviceChecks | None = None) -> None:
    """Refuse per-token losses whose ignored labels (``ignore_index``, loss 0) a ``mean`` over
    each datum's tokens would count (with ``checks``: when they are read); warn on exact
    zeros of losses of unknown origin."""
    if not _graph(losses):
        return
    found = None
    for node in _below(losses.grad_fn, 4, _ORDER_KEEPING):
        found = autograd_node_nll_target(node)
        if found is not None:
            break
    if found is not None and found[0].numel() == losses.numel():
        target, ignore = found  # the losses' own labels, in the losses' element order
        ignored = (target.reshape(losses.shape) == ignore).to(losses.device)  # (B, T)
        if mask is not None:
            ignored = ignored & (mask.to(losses.device) != 0)
        count = ignored.sum()

        def refuse() -> None:
            where = "the mask keeps" if mask is not None else "with no mask="
            raise InputError(
                f"per-token losses of shape {tuple(losses.shape)} come from cross_entropy/"
                f"nll_loss with ignore_index={ignore}, and {where} {int(count)} positions "
                f"whose labels are {ignore} (their loss is 0): token_reduction='mean' would "
                "count them in each datum's mean (a half-padded sequence would get half its "
                f"gradient). Pass mask=(labels != {ignore}) (the tokens that count), or "
                "token_reduction='sum'."
            )

        if checks is not None:
            checks.add(count > 0, refuse)
        elif int(count):
            refuse()
        return
    if mask is not None:
        return

    def warn() -> None:
        warnings.warn(
            f"per-token losses of shape {tuple(losses.shape)} hold exact zeros and no mask= "
            "was passed: token_reduction='mean' counts those positions in each datum's mean. "
            "If they are ignored labels (padding, a prompt), pass mask= with the tokens that "
            "count (e.g. labels != -100).",
            UserWarning,
            stacklevel=_callers_level(),
        )

    zeros = (losses.detach() == 0).any()
    if checks is not None:  # read with the other checks (a wait for the device)
        checks.add(zeros, warn)
    elif bool(zeros):
        warn()


_INSIDE = (str(Path(__file__).resolve().parent), str(Path(torch.__file__).resolve().parent))


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside gradlog and torch, for a warning raised
    here: the checks that warn may be read late, from anywhere in gradlog."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level
