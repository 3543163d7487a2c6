"""Which rows of :func:`~gradlog.memory.chunked_linear_loss`'s input the ``fn`` call in
progress sees: module hooks on the head (gradlog's hooks backend) read it to attribute the
``(rows, V)`` outputs of a chunk to datums."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["ChunkInfo", "current_chunk", "running_chunk"]


@dataclass(frozen=True)
class ChunkInfo:
    """Which rows the ``fn`` call in progress sees, for code that runs inside it (module hooks).

    A hook on the head sees ``(rows, V)`` outputs, not ``(B, T, V)``; with this it can
    attribute row ``r`` of the chunk to datum ``(start + r) // prod(lead_shape[1:])``.

    Attributes:
        lead_shape: ``x.shape[:-1]``, e.g. ``(B, T)``; the rows are these flattened.
        start: First row of the chunk.
        stop: One past its last row.
        differentiated: True when this call's graph is backpropagated (the backward re-run,
            or a forward that computes gradients); False for a forward without a graph.
        flattened: Not a chunked head's rows: a layer run on the batch's tokens flattened
            (the hooks backend's ``rows.flattened_rows``), trusted once a datum check
            passed on its layout.
        inside: Of a flattened call: the module took the batch first and flattened it
            itself (only its outputs are rows).
    """

    lead_shape: tuple[int, ...]
    start: int
    stop: int
    differentiated: bool
    flattened: bool = False
    inside: bool = False


_CURRENT_CHUNK: contextvars.ContextVar[ChunkInfo | None] = contextvars.ContextVar(
    "gradlog_current_chunk", default=None
)


def current_chunk() -> ChunkInfo | None:
    """The chunk whose ``fn`` call is running, or None outside :func:`chunked_linear_loss`."""
    return _CURRENT_CHUNK.get()


@contextlib.contextmanager
def running_chunk(info: ChunkInfo) -> Iterator[None]:
    """Make ``info`` the :func:`current_chunk` while the block runs."""
    token = _CURRENT_CHUNK.set(info)
    try:
        yield
    finally:
        _CURRENT_CHUNK.reset(token)
