"""Members of autograd nodes, read through torch's private API (part of
:mod:`gradlog._torch_private`, whose rules apply: one function per read, each with a
fallback that is never wrong, only less precise).

Node shapes, saved tensors and attributes tell the hooks backend how an op moved the batch
(:mod:`gradlog.backends.hooks.graph`, ``layout``, ``reorder``, ``rows``, ``feeds``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "autograd_node_dims",
    "autograd_node_forward_class",
    "autograd_node_leading_copies",
    "autograd_node_nll_target",
    "autograd_node_output_dims",
    "autograd_node_output_dtypes",
    "autograd_node_output_shape",
    "autograd_node_repeats",
    "autograd_node_saved",
    "autograd_node_saved_alpha",
    "autograd_node_saved_condition",
    "autograd_node_shapes_known",
    "autograd_node_view_input_sizes",
]


def autograd_node_output_shape(node: Any, output: int = 0) -> tuple[int, ...]:
    """Shape of forward output ``output`` of autograd node ``node`` (its gradient's shape).
    Private API: ``Node._input_metadata``. Fallback: none (ask
    :func:`autograd_node_shapes_known` first)."""
    return tuple(node._input_metadata[output].shape)


def autograd_node_output_dims(node: Any) -> int:
    """Dimensions of the node's first forward output (0: it has none). Private API, as
    :func:`autograd_node_output_shape`."""
    return len(node._input_metadata[0].shape) if node._input_metadata else 0


def autograd_node_shapes_known(node: Any) -> bool:
    """Whether this torch's autograd nodes carry the shapes of their forward outputs (what
    :func:`autograd_node_output_shape` reads). Private API: ``Node._input_metadata``."""
    return hasattr(node, "_input_metadata")


def autograd_node_output_dtypes(node: Any) -> list[torch.dtype] | None:
    """The dtypes of autograd node ``node``'s forward outputs. Private API:
    ``Node._input_metadata``. Fallback: None (callers then guess from the node's type)."""
    metadata = getattr(node, "_input_metadata", None)
    return None if metadata is None else [m.dtype for m in metadata]


def autograd_node_saved_alpha(node: Any) -> float:
    """The ``alpha`` an ``AddBackward0``/``SubBackward0`` node saved. Private API:
    ``Node._saved_alpha``. Fallback: 1.0 (torch saves no alpha when it is 1)."""
    return float(getattr(node, "_saved_alpha", 1.0))


def autograd_node_saved_condition(node: Any) -> torch.Tensor | None:
    """The condition a ``WhereBackward0`` node saved (``torch.where(condition, x, y)``).
    Private API: ``Node._saved_condition``. Fallback: None (the caller refuses)."""
    cond = getattr(node, "_saved_condition", None)
    return cond if isinstance(cond, torch.Tensor) else None


def autograd_node_repeats(node: Any) -> tuple[int, ...] | None:
    """The repeats a ``RepeatBackward0`` node saved (``x.repeat(*repeats)``, new leading
    dimensions first). Private API: ``_saved_repeats``. Fallback: None (the caller refuses)."""
    try:
        return tuple(int(n) for n in node._saved_repeats)
    except (AttributeError, RuntimeError, TypeError):
        return None


def autograd_node_leading_copies(node: Any, ndim: int) -> int | None:
    """How many copies along dimension 0 a ``repeat``, ``cat``, ``index`` or
    ``index_select`` node made of an input of ``ndim`` dimensions whose dimension 0 has size
    1; 0 when it made none (another dimension, another input); None for other nodes.
    Private API: ``RepeatBackward0._saved_repeats``, ``CatBackward0._saved_dim``,
    ``IndexBackward0._saved_indices``, ``IndexSelectBackward0._saved_dim`` and
    ``_saved_index``. Fallback: None (not known: the caller does not count it)."""
    kind = type(node).__name__
    try:
        if kind == "RepeatBackward0":
            repeats = autograd_node_repeats(node) or ()
            return math.prod(repeats[: len(repeats) - ndim + 1]) if len(repeats) >= ndim else None
        if kind == "CatBackward0":  # the same input at every place: one tensor, copied
            inputs = {id(fn) for fn, _ in node.next_functions}
            return len(node.next_functions) if (
                _dim(node._saved_dim, ndim) == 0 and len(inputs) == 1) else 0
        if kind == "IndexSelectBackward0":
            return int(node._saved_index.numel()) if _dim(node._saved_dim, ndim) == 0 else 0
        if kind == "IndexBackward0":
            first = next(iter(node._saved_indices), None)
            return 0 if first is None else int(first.numel())
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return None
    return None


def autograd_node_saved(node: Any, name: str) -> Any:
    """What autograd node ``node`` saved as ``name`` (``dim``, ``dims``, ``shifts``,
    ``index``, ``indices``), dimensions counted from the front of its output; None where it
    saved nothing so named. Private API: ``Node._saved_<name>`` (a negative dimension reads
    back as an unsigned 64-bit value), ``Node._input_metadata``. Fallback: None."""
    try:
        value = getattr(node, f"_saved_{name}")
        if name in ("dim", "dims"):  # (no shapes before torch 2.6: a negative one stays so)
            meta = getattr(node, "_input_metadata", None)
            ndim = len(meta[0].shape) if meta else 0
            value = _dim(value, ndim) if name == "dim" else [_dim(d, ndim) for d in value]
    except (AttributeError, IndexError, RuntimeError, TypeError, ValueError):
        return None
    return value


def autograd_node_dims(node: Any) -> tuple[int, ...] | None:
    """The dimensions a permute (its permutation), transpose (the two it swaps) or softmax
    (the one it normalises) autograd node saved, counted from the front; None for other
    nodes, or where it cannot tell.

    Private API: ``PermuteBackward0._saved_dims``, ``TransposeBackward0._saved_dim0`` and
    ``_dim1``, ``SoftmaxBackward0._saved_dim`` (also ``LogSoftmaxBackward0``, SDPA's
    ``SafeSoftmaxBackward0``), the output's rank from ``Node._input_metadata``. Fallback:
    None (the caller then refuses).
    """
    kind = type(node).__name__
    try:
        ndim = len(node._input_metadata[0].shape)
        if kind == "PermuteBackward0":
            return tuple(_dim(d, ndim) for d in node._saved_dims)
        if kind == "TransposeBackward0":
            return _dim(node._saved_dim0, ndim), _dim(node._saved_dim1, ndim)
        if kind in ("SoftmaxBackward0", "LogSoftmaxBackward0", "SafeSoftmaxBackward0"):
            return (_dim(node._saved_dim, ndim),)
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return None
    return None


def _dim(saved: Any, ndim: int) -> int:
    """A saved dimension (an int64 read back as unsigned when negative), from the front."""
    d = int(saved)
    d = d - 2**64 if d >= 2**63 else d
    return d + ndim if d < 0 else d


def autograd_node_view_input_sizes(node: Any) -> tuple[int, ...] | None:
    """The input shape a ``view``/``reshape`` autograd node saved (what it reshaped). Private
    API: ``ViewBackward0._saved_self_sym_sizes`` (also ``UnsafeViewBackward0``,
    ``ReshapeAliasBackward0``). Fallback: None (the caller then checks less)."""
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    try:
        return None if sizes is None else tuple(int(n) for n in sizes)
    except (TypeError, ValueError):  # symbolic sizes
        return None


def autograd_node_nll_target(node: Any) -> tuple[torch.Tensor, int] | None:
    """``(target, ignore_index)`` an ``nll_loss`` autograd node saved (``cross_entropy``'s).
    Private API: ``NllLoss(2D)Backward0`` ``_saved_target``, ``_saved_ignore_index`` (some
    torch versions return -100 as 2**64 - 100). Fallback: None (the caller checks less)."""
    if not type(node).__name__.startswith("NllLoss"):
        return None
    target = getattr(node, "_saved_target", None)
    ignore = getattr(node, "_saved_ignore_index", None)
    if not isinstance(target, torch.Tensor) or not isinstance(ignore, int):
        return None
    return target, ignore - 2**64 if ignore >= 2**63 else ignore


def autograd_node_forward_class(node: Any) -> type | None:
    """The ``torch.autograd.Function`` class a Python autograd node belongs to, or None.
    Private API: ``BackwardCFunction._forward_cls``. Fallback: None."""
    return getattr(node, "_forward_cls", None)
