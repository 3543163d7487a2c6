"""Rows of a chunked head's input: labels flattened and cut like ``x``, the valid rows, and
the chunk sizes a memory budget allows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradlog.errors import InputError

__all__ = [
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "GPU_MIN_ROWS",
    "WEIGHT_SHARE",
    "bounds",
    "chunk_sizes",
    "flatten_labels",
    "take_rows",
    "valid_rows",
]

DEFAULT_MEMORY_BUDGET_BYTES = 16 * 2**20
"""Float32 logits of one chunk when neither ``chunk_size`` nor a budget is given (131 rows at
a vocabulary of 32K), raised to :data:`WEIGHT_SHARE` of the head's weight for wide heads. A
chunk's transients (its logits, their log-softmax and its gradient: about three logits'
worth, 48 MiB) then stay well under the head's weight gradient once the weight is large
(hidden 1024, vocabulary 32K: 125 MiB in float32), so the head's peak is about that gradient
plus ~50 MiB, where the unchunked head holds two to three times all rows' logits (batch 4 x
512 tokens at 32K: 750 MiB; measured in bench_memory.py). Larger chunks are faster on CPU
(each chunk reads and accumulates a weight-sized gradient: about x1.2 the unchunked time at
128 rows, x1.05 at 256, x2.4 at 32, measured at V 32K, d 1024): ``chunk_size=256`` trades
memory for speed."""

WEIGHT_SHARE = 32
"""By default a chunk holds at least ``hidden // WEIGHT_SHARE`` rows: its float32 logits are
then 1/32 of the float32 weight's bytes (its transients under a tenth of the weight gradient
the head holds anyway). Each chunk reads the whole weight and adds into its whole gradient, so
much fewer rows leave a GPU waiting on memory: at hidden 4096 and V 128K, 32 rows a chunk (the
16 MiB budget alone) took 1.98 s a step on an H200 where 523 rows took 0.23 s on an H100.
This floor gives 128 rows there, and changes nothing at hidden 1024 (32 rows at V 128K, -81%
peak memory against the unchunked head)."""

GPU_MIN_ROWS = 1024
"""By default a chunk on a GPU holds at least this many rows. Each chunk reads the whole weight
and adds into its whole gradient (~16 bytes of memory traffic per weight element), while its
matrix products grow with its rows (6 multiply-adds per row and weight element), so the
share of a chunk's time spent on memory is about ``16 F / (6 rows W)`` for a GPU of ``F``
flop/s and ``W`` bytes/s, whatever the head's shape: ~600 / rows on an H100 (bf16). At
hidden 4096 and V 128K, 128 rows a chunk took 0.67 s a step on an H100 against 0.11 s
unchunked; 1024 rows keep the chunk's float32 logits at 512 MiB there (4 KiB per row and
1K vocabulary). A CPU computes ~100 times slower for ~20 times less bandwidth: its chunks
stay small."""

_LOGIT_BYTES = 4  # the budget counts float32 logits: the dtype losses are usually upcast to


def flatten_labels(labels: Any, lead: tuple[int, ...], n_rows: int, path: str) -> Any:
    """Reshape every tensor in ``labels`` to ``(N, ...)``, keeping the structure."""
    if isinstance(labels, torch.Tensor):
        if labels.requires_grad:
            raise InputError(
                f"{path} requires grad, but chunked_linear_loss gives labels no gradient. Pass "
                f"{path}.detach() (e.g. teacher logits), or compute that term outside the head."
            )
        k = len(lead)
        if tuple(labels.shape[:k]) == lead:
            return labels.reshape(n_rows, *labels.shape[k:])  # (N, ...)
        if labels.dim() >= 1 and labels.shape[0] == n_rows:
            return labels  # already (N, ...)
        raise InputError(
            f"{path} has shape {tuple(labels.shape)}, but x has {n_rows} rows in leading "
            f"dimensions {lead}: every tensor in labels must start with {lead} (or with "
            f"{n_rows}, already flattened), one entry per row of x."
        )
    if isinstance(labels, Mapping):
        return {k: flatten_labels(v, lead, n_rows, f"{path}[{k!r}]") for k, v in labels.items()}
    if isinstance(labels, (tuple, list)):
        items = [flatten_labels(v, lead, n_rows, f"{path}[{i}]") for i, v in enumerate(labels)]
        if hasattr(labels, "_fields"):  # a namedtuple
            return type(labels)(*items)
        return type(labels)(items)
    return labels  # None, a number, a string: passed unchanged to every chunk


def take_rows(labels: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of every tensor in flattened ``labels``."""
    if isinstance(labels, torch.Tensor):
        return labels[start:stop]
    if isinstance(labels, dict):
        return {k: take_rows(v, start, stop) for k, v in labels.items()}
    if isinstance(labels, (tuple, list)):
        items = [take_rows(v, start, stop) for v in labels]
        if hasattr(labels, "_fields"):
            return type(labels)(*items)
        return type(labels)(items)
    return labels


def valid_rows(labels: Any, n_rows: int, ignore_index: int | None) -> torch.Tensor | None:
    """``(N,)`` bool mask of rows whose label is not ``ignore_index``; None if all count."""
    if (
        ignore_index is None
        or not isinstance(labels, torch.Tensor)
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
        or labels.numel() != n_rows  # not one label per row (e.g. trailing dimensions)
    ):
        return None
    return labels.reshape(n_rows) != ignore_index  # (N,)


def chunk_sizes(
    chunk_size: int | Sequence[int] | None,
    memory_budget_bytes: int | None,
    n_rows: int,
    vocab: int,
    hidden: int = 0,
    min_rows: int = 0,
) -> list[int]:
    """Rows of each chunk, from ``chunk_size``, a budget of float32 logits per chunk, or by
    default :data:`DEFAULT_MEMORY_BUDGET_BYTES` but at least ``hidden // WEIGHT_SHARE`` rows
    (a head of ``vocab`` outputs from ``hidden`` features) and ``min_rows``
    (:data:`GPU_MIN_ROWS` on a GPU)."""
    if chunk_size is not None and memory_budget_bytes is not None:
        raise InputError(
            f"pass chunk_size or memory_budget_bytes, not both (got chunk_size={chunk_size!r}, "
            f"memory_budget_bytes={memory_budget_bytes!r})."
        )
    if chunk_size is None:
        budget = DEFAULT_MEMORY_BUDGET_BYTES if memory_budget_bytes is None else memory_budget_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise InputError(
                f"memory_budget_bytes must be a positive int (bytes of float32 logits per chunk), "
                f"got {budget!r}."
            )
        chunk_size = max(1, budget // (max(vocab, 1) * _LOGIT_BYTES))
        if memory_budget_bytes is None:
            chunk_size = max(chunk_size, hidden // WEIGHT_SHARE, min_rows)
    if isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
        if chunk_size <= 0:
            raise InputError(f"chunk_size must be a positive number of rows, got {chunk_size}.")
        sizes = [chunk_size] * (n_rows // chunk_size)
        if n_rows % chunk_size:
            sizes.append(n_rows % chunk_size)
    elif isinstance(chunk_size, Sequence) and not isinstance(chunk_size, (str, bytes)):
        sizes = list(chunk_size)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            raise InputError(
                f"chunk_size as a list must hold positive ints (rows per chunk), got {sizes!r}."
            )
        if sum(sizes) != n_rows:
            raise InputError(
                f"chunk sizes {sizes} sum to {sum(sizes)}, but x has {n_rows} rows (the product "
                f"of its leading dimensions). Make them sum to {n_rows}, or pass an int."
            )
    else:
        raise InputError(
            f"chunk_size must be an int, a list of ints or None, got {type(chunk_size).__name__}."
        )
    return sizes or [0]  # no rows: one empty chunk, so fn still sets the losses' dtype


def bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds
