"""The chunked head's autocast: the caller's settings, recorded at the forward and entered
again for a backward's re-run; autocast off for each chunk's own backward; and the dtypes a
head's autograd node computed in, for backends that read autocast off the graph."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "AutocastState",
    "autocast_state",
    "computed_dtypes",
    "involves_float16",
    "no_autocast",
    "note_autocast",
    "replayed",
]

AutocastState = list[tuple[str, bool, torch.dtype, bool]]
"""(device type, enabled, dtype, cache enabled) per device type: ``x``'s and the CPU."""

_ATTR = "_gradlog_autocast"


def autocast_state(device: torch.device) -> AutocastState:
    """The caller's autocast settings for ``device`` and for CPU, to re-enter in backward."""
    state = []
    for device_type in dict.fromkeys([device.type, "cpu"]):
        if torch.amp.is_autocast_available(device_type):
            state.append(
                (
                    device_type,
                    torch.is_autocast_enabled(device_type),
                    torch.get_autocast_dtype(device_type),
                    torch.is_autocast_cache_enabled(),
                )
            )
    return state


def involves_float16(x: torch.Tensor, weight: torch.Tensor, state: AutocastState) -> bool:
    return torch.float16 in (x.dtype, weight.dtype) or any(
        enabled and dtype == torch.float16 for _, enabled, dtype, _ in state
    )


@contextlib.contextmanager
def replayed(state: AutocastState) -> Iterator[None]:
    """The recorded settings again (a backward may run outside, or inside another, region)."""
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype, cache in state:
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        yield


@contextlib.contextmanager
def no_autocast(state: AutocastState) -> Iterator[None]:
    """Autocast off on the state's devices, for a chunk's backward: the forward's casts are in
    its graph already; an autocast left on would cast the backward of parts of ``fn`` that
    turned it off or to another dtype (a backward run by autograd's engine has none)."""
    with contextlib.ExitStack() as stack:
        for device_type, *_ in state:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def note_autocast(ctx: Any, state: AutocastState) -> None:
    """Mark a head's autograd node with the autocast dtypes it computes in."""
    setattr(ctx, _ATTR, tuple(dtype for _, on, dtype, _ in state if on))


def computed_dtypes(node: Any) -> tuple[torch.dtype, ...]:
    """The autocast dtypes a chunked head's autograd node computed in (none for any other
    node). Its graph shows only the losses' dtype, so a backend that reads autocast off the
    graph (the loop backend's check tolerance) asks here: with a frozen body nothing else in
    the graph was narrower, and correct records were refused."""
    return tuple(getattr(node, _ATTR, ()))
