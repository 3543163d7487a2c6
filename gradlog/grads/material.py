"""The currency that crosses gradlog's seams: per-datum gradients in the three kinds rules
produce and forms, backends and the recorder consume.

- a dense tensor ``(B, *shape)``: the per-datum gradients themselves (any parameter);
- :class:`Factors`: ``scale * g_b^T a_b`` for a matrix parameter ``(p, q)``, from the rows
  ``g`` (B, N, p) and ``a`` (B, N, q) a Linear-like rule captured (for ``nn.Linear``: output
  gradients and inputs), padded to a common N with a ``mask`` of the rows that count;
- :class:`Rows`: sparse rows ``dense[b, index[b, n]] += scale * values[b, n]`` (Embedding).

None of the helpers loops over datums in Python.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from gradlog.errors import InputError

__all__ = [
    "MAX_ELEMENTS",
    "Factors",
    "Material",
    "Rows",
    "batch_size",
    "batch_sum",
    "chunks",
    "dense",
    "entries",
    "factors_worthwhile",
    "material_shape",
    "outer_sums",
    "select",
]

MAX_ELEMENTS = 1 << 25
"""Elements of an intermediate tensor above which work goes through the batch in chunks
(32M: 256 MiB in float64), so a comparison never needs memory quadratic in everything."""


def _check_batched(t: Any, what: str, dims: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(t).__name__}.")
    if dims is not None and t.dim() != dims:
        raise InputError(f"{what} has shape {tuple(t.shape)}; expected {dims} dimensions.")
    return t


class MixedMatmul:
    """Where 16-bit matrices are multiplied into float32 by :func:`outer_sums` (``bmm`` with
    ``out_dtype``: CUDA, torch >= 2.8); ``available`` turns False at the first refusal."""

    available = hasattr(torch.ops.aten.bmm, "dtype_out")
    devices = frozenset({"cuda"})


def outer_sums(left: torch.Tensor, right: torch.Tensor, scale: float, out: torch.Tensor,
               narrow: torch.dtype | None = None) -> torch.Tensor:
    """``out[b] = scale * left[b]^T right[b]``: (B, N, p), (B, N, q) -> (B, p, q).

    With ``narrow`` (the operands hold values of that 16-bit dtype, in it or widened), a
    float32 ``out`` on CUDA is computed from the 16-bit operands, exactly, on tensor cores
    with float32 accumulation: the products are exact either way, and float32 matrix
    products without TF32 run on the GPU's plain cores (on an H200 they took 45 ms of a
    GPT-2 small step recording norms). Elsewhere, one ``baddbmm`` in ``out``'s dtype (16-bit
    operands widened to it first)."""
    if (narrow is not None and MixedMatmul.available and out.dtype == torch.float32
            and out.device.type in MixedMatmul.devices):
        try:
            torch.ops.aten.bmm.dtype_out(_as(left, narrow).transpose(1, 2), _as(right, narrow),
                                         torch.float32, out=out)
            return out.mul_(scale) if scale != 1.0 else out
        except (RuntimeError, NotImplementedError, TypeError):  # this torch or GPU lacks it
            MixedMatmul.available = False
    if narrow is not None:
        left, right = _as(left, out.dtype), _as(right, out.dtype)
    # beta=0 ignores out's (uninitialised) contents; alpha folds the scale into the matmul.
    return out.baddbmm_(left.transpose(1, 2), right, beta=0.0, alpha=scale)  # (B, p, q)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``; as is (no dispatcher call) when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def factors_worthwhile(tokens: int, d_in: int, d_out: int) -> bool:
    """True when the factors ``G (T, d_out)``, ``A (T, d_in)`` are smaller than ``G^T A``:
    ``T (d_in + d_out) < d_in d_out``, i.e. ``T < d_in d_out / (d_in + d_out)`` (64 rows for
    128 x 128, 2048 for 4096 x 4096)."""
    return tokens * (d_in + d_out) < d_in * d_out


class Factors:
    """Per-datum gradients of a matrix parameter ``(p, q)`` as factors.

    Datum b's gradient is ``scale * sum_n mask[b, n] g[b, n]^T a[b, n] = scale * g_b^T a_b``.
    For ``nn.Linear`` (weight ``(d_out, d_in)``) ``g`` holds output gradients and ``a``
    inputs; for GPT-2's ``Conv1D`` (weight ``(d_in, d_out)``) the two swap. Rows where
    ``mask`` is False are ignored whatever they hold (padding, dropped tokens).

    Which tokens may be dropped: only rows that contribute nothing (a zero output-gradient or
    input row). Padding tokens that no loss and no other token sees qualify; prompt tokens
    without a loss generally do not (below the head later tokens attend to them, so their
    output gradients are not zero).
    :meth:`compact` with no mask finds the rows that contribute nothing by value.

    Under autocast the factors may be held in the 16-bit dtype itself (``narrow``, the
    operands of the layer's matmul: half the memory, and no widening copy where a consumer
    multiplies them on a GPU's tensor cores into float32). :attr:`g` and :attr:`a` always
    read the values in the gradients' dtype (float32 then, widened once on first read and
    kept); :attr:`held` gives the tensors as held, for the consumers that take 16-bit
    operands (:func:`outer_sums`, the exact norms, the spot check's entries).

    Attributes:
        g: ``(B, N, p)``, the factor of the parameter's first axis.
        a: ``(B, N, q)``, the factor of its second axis.
        mask: ``(B, N)`` bool, True for rows that count; None: all rows count.
        scale: Factor of every datum's gradient (a rule's ``cap.scale``).
        narrow: ``torch.bfloat16`` or ``torch.float16`` when every value of ``g`` and ``a``
            is one of that dtype (a layer that ran under autocast), held in it or widened:
            products of such values are exact in float32, so :meth:`dense` may multiply them
            in that dtype on a GPU's tensor cores, accumulating in float32. Factors held in
            ``narrow`` read as float32. None: no such promise.
    """

    __slots__ = ("_a", "_g", "_wide_a", "_wide_g", "mask", "narrow", "scale")

    _g: torch.Tensor
    _a: torch.Tensor
    _wide_g: torch.Tensor | None
    _wide_a: torch.Tensor | None
    mask: torch.Tensor | None
    scale: float
    narrow: torch.dtype | None

    def __init__(self, g: torch.Tensor, a: torch.Tensor, mask: torch.Tensor | None = None,
                 scale: float = 1.0, narrow: torch.dtype | None = None) -> None:
        g = _check_batched(g, "Factors.g", 3)
        a = _check_batched(a, "Factors.a", 3)
        if g.shape[:2] != a.shape[:2]:
            raise InputError(
                f"Factors.g {tuple(g.shape)} and Factors.a {tuple(a.shape)} must agree on "
                "(B, N): one row of each per token of each datum."
            )
        if narrow not in (None, torch.bfloat16, torch.float16):
            raise InputError(
                f"Factors.narrow must be torch.bfloat16, torch.float16 or None, got "
                f"{narrow!r}."
            )
        if mask is not None and (mask.dtype != torch.bool or mask.shape != g.shape[:2]):
            raise InputError(
                f"Factors.mask has shape {tuple(mask.shape)} and dtype {mask.dtype}; "
                f"expected bool {tuple(g.shape[:2])} (True: the row counts). Build it from "
                "lengths with Factors.from_lengths."
            )
        for name, value in (("_g", g), ("_a", a), ("_wide_g", None), ("_wide_a", None),
                            ("mask", mask), ("scale", scale), ("narrow", narrow)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Factors are immutable: cannot set {name!r}.")

    def __repr__(self) -> str:
        g, a = self.held
        return (f"Factors(g={tuple(g.shape)} {g.dtype}, a={tuple(a.shape)} {a.dtype}, "
                f"mask={'None' if self.mask is None else 'set'}, scale={self.scale}, "
                f"narrow={self.narrow})")

    @property
    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, a)`` as held: in ``narrow`` itself when autocast's operands were kept."""
        return self._g, self._a

    @property
    def g(self) -> torch.Tensor:
        """``(B, N, p)`` in the gradients' dtype."""
        return self._widened("_g", "_wide_g")

    @property
    def a(self) -> torch.Tensor:
        """``(B, N, q)`` in the gradients' dtype."""
        return self._widened("_a", "_wide_a")

    def _widened(self, held: str, wide: str) -> torch.Tensor:
        """A factor held in ``narrow``, widened to float32 once (kept); others as held."""
        t: torch.Tensor = getattr(self, held)
        if t.dtype is not self.narrow:
            return t
        widened: torch.Tensor | None = getattr(self, wide)
        if widened is None:
            widened = t.float()
            object.__setattr__(self, wide, widened)
        return widened

    @property
    def dtype(self) -> torch.dtype:
        """The gradients' dtype (float32 for factors held in ``narrow``)."""
        g = self._g
        return torch.float32 if g.dtype is self.narrow else g.dtype

    @classmethod
    def from_lengths(
        cls, g: torch.Tensor, a: torch.Tensor, lengths: torch.Tensor, scale: float = 1.0
    ) -> Factors:
        """Factors whose datum b has its first ``lengths[b]`` rows, the rest padding."""
        n = g.shape[1]
        mask = torch.arange(n, device=g.device) < lengths.to(g.device).unsqueeze(1)  # (B, N)
        return cls(g, a, mask, scale)

    @property
    def batch_size(self) -> int:
        """B."""
        return int(self._g.shape[0])

    @property
    def tokens(self) -> int:
        """N, rows per datum (padding included)."""
        return int(self._g.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        """The parameter's shape ``(p, q)``."""
        return int(self._g.shape[2]), int(self._a.shape[2])

    def masked(self) -> Factors:
        """The same factors with ignored rows zeroed (so padding holding NaN cannot leak) and
        mask None; held as they are, ``scale`` and ``narrow`` kept (zeros are values of any
        dtype)."""
        if self.mask is None:
            return self
        drop = ~self.mask.unsqueeze(-1)  # (B, N, 1)
        g, a = self.held
        return Factors(g.masked_fill(drop, 0.0), a.masked_fill(drop, 0.0), None, self.scale,
                       self.narrow)  # (B, N, p), (B, N, q)

    def picked(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``g[b, n, rows[k]] * a[b, n, cols[k]]`` ``(B, N, k)`` in the gradients' dtype, mask
        and scale not applied: the terms of entries ``(rows[k], cols[k])`` (the spot check's).
        Factors held in 16 bits have the k columns picked, then widened."""
        g, a = self.held
        dtype = self.dtype
        return _as(g.index_select(2, rows), dtype) * _as(a.index_select(2, cols), dtype)

    def canonical(self) -> Factors:
        """The same gradients with ``scale`` folded into ``g`` and ignored rows zeroed (in
        both factors, so padding holding NaN cannot leak), mask None, scale 1. Factors held
        in ``narrow`` stay so when there is no scale to fold in."""
        m = self.masked()
        if self.scale == 1.0:
            return m
        return Factors(m.g * self.scale, m.a)  # (B, N, p), (B, N, q)

    def compact(self, keep: torch.Tensor | None = None) -> tuple[Factors, torch.Tensor]:
        """Move the kept rows of each datum to the front, in order; padding after them.

        Args:
            keep: ``(B, N)`` bool of rows to keep (and'ed with ``mask``); None: rows whose
                ``g`` and ``a`` are both non-zero (dropping the others is exact).

        Returns:
            The canonical factors with kept rows first and zero rows after them (still N
            wide: trimming to the longest datum would need a device sync), and the number of
            kept rows per datum ``(B,)`` int64.
        """
        c = self.canonical()
        cg, ca = c.held  # (rows move, values do not: as held)
        if keep is None:
            keep = (cg != 0).any(-1) & (ca != 0).any(-1)  # (B, N)
        if self.mask is not None:
            keep = keep & self.mask
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # (B, N)
        g = cg.gather(1, order.unsqueeze(-1).expand_as(cg))  # (B, N, p)
        a = ca.gather(1, order.unsqueeze(-1).expand_as(ca))  # (B, N, q)
        lengths = keep.sum(1)  # (B,)
        pad = (torch.arange(self.tokens, device=g.device) >= lengths.unsqueeze(1)).unsqueeze(-1)
        return Factors(g.masked_fill(pad, 0.0), a.masked_fill(pad, 0.0), None, 1.0,
                       c.narrow), lengths

    def dense(self) -> torch.Tensor:
        """The per-datum gradients ``(B, p, q)``: one batched matmul, the scale folded into
        it (as the Linear rule computes them)."""
        g, a = self.masked().held  # (the scale comes last, in the matmul)
        B, _, p = g.shape
        out = torch.empty((B, p, a.shape[2]), dtype=self.dtype, device=g.device)
        return outer_sums(g, a, self.scale, out, self.narrow)  # (B, p, q)

    def bias(self, axis: int = 0) -> torch.Tensor:
        """Gradient of the layer's bias: ``scale * sum_n g[b, n]`` (B, p) for ``axis=0``
        (``nn.Linear``); ``axis=1`` sums ``a`` instead (Conv1D, whose bias follows its
        second axis)."""
        c = self.canonical()
        return (c.g if axis == 0 else c.a).sum(1)  # (B, p) or (B, q)


@dataclass(frozen=True)
class Rows:
    """Per-datum gradients with few non-zero rows: ``dense[b, index[b, n]] += scale *
    values[b, n]`` (an Embedding: at most N rows per datum). Entries with index -1 are
    padding and ignored.

    Attributes:
        index: ``(B, N)`` int64 row indices in ``[0, num_rows)``, or -1.
        values: ``(B, N, *row_shape)``.
        num_rows: The parameter's first dimension (V).
        scale: Factor of every datum's gradient.
    """

    index: torch.Tensor
    values: torch.Tensor
    num_rows: int
    scale: float = 1.0

    def __post_init__(self) -> None:
        index = _check_batched(self.index, "Rows.index", 2)
        values = _check_batched(self.values, "Rows.values")
        if values.shape[:2] != index.shape or index.dtype != torch.int64:
            raise InputError(
                f"Rows.index {tuple(index.shape)} ({index.dtype}) and Rows.values "
                f"{tuple(values.shape)} must be int64 (B, N) and (B, N, *row_shape)."
            )

    @property
    def batch_size(self) -> int:
        """B."""
        return int(self.index.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's shape ``(num_rows, *row_shape)``."""
        return (self.num_rows, *self.values.shape[2:])

    @property
    def width(self) -> int:
        """Elements per row (product of ``row_shape``)."""
        return math.prod(self.values.shape[2:])

    def unique(self) -> Rows:
        """The same gradients with each datum's rows distinct, all-zero rows dropped,
        ``scale`` folded in, sorted by row index, padded with index -1 and zero values
        after them (still N wide). Sizes are known in advance: nothing waits for the
        device (see :meth:`sqnorms`)."""
        B, N = self.index.shape
        D = self.width
        V = self.num_rows
        values = self.values.reshape(B * N, D)  # (B*N, D)
        if self.scale != 1.0:
            values = values * self.scale
        keep = (self.index >= 0).reshape(-1) & (values != 0).any(-1)  # (B*N,)
        key, group = self._groups(keep)  # (B*N,) each: sorted keys, then group keys
        merged = values.new_zeros((B * N, D)).index_add_(0, group[1], values[group[0]])
        real = key < B * V  # (B*N,) a distinct kept row (else dropped or an empty group)
        owner = torch.where(real, key // V, 0)  # (B*N,) datum of each distinct row
        counts = torch.zeros(B, dtype=torch.long, device=key.device).index_add_(
            0, owner, real.long())  # (B,) distinct rows per datum
        starts = torch.cumsum(counts, 0) - counts  # (B,) first distinct row of each datum
        slot = torch.arange(B * N, device=key.device) - starts[owner]  # (B*N,)
        at = torch.where(real, owner * N + slot, B * N)  # (B*N,) past the end: discarded
        out_index = self.index.new_full((B * N + 1,), -1).index_copy_(
            0, at, torch.where(real, key % V, -1))[: B * N]  # (B*N,)
        out_values = values.new_zeros((B * N + 1, D)).index_copy_(
            0, at, torch.where(real.unsqueeze(1), merged, 0.0))[: B * N]  # (B*N, D)
        return Rows(out_index.view(B, N), out_values.reshape(self.values.shape), V)

    def _groups(self, keep: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Entries grouped by (datum, row) by a sort, for sums per distinct row without a
        size read from the device. Returns each group's key ``datum * V + row`` (``B * V``
        for entries not kept and for the empty groups past the last), and ``(order,
        group)``: the entries in key order and the group of each, for
        ``index_add_(0, group, values[order])`` into ``B * N`` rows."""
        B, N = self.index.shape
        V = self.num_rows
        datum = torch.arange(B, device=self.index.device).unsqueeze(1)  # (B, 1)
        key = torch.where(keep.view(B, N), datum * V + self.index, B * V).reshape(-1)
        key, order = torch.sort(key)  # (B*N,) entries not kept last
        first = torch.ones_like(key, dtype=torch.bool)  # (B*N,) the first entry of its key
        first[1:] = key[1:] != key[:-1]
        group = first.cumsum(0) - 1  # (B*N,) 0, 1, ... per distinct key
        group_key = key.new_full((B * N,), B * V).scatter_(0, group, key)  # (B*N,)
        return group_key, (order, group)

    def sqnorms(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Exact squared norms ``(B,)`` in ``dtype``: each datum's rows of one index summed
        (in ``dtype``), then squared and summed; padding (index -1, which may hold anything)
        left out. Every size is known in advance (a sort, not ``unique``), so nothing waits
        for the device: the recorder encodes a step without a sync (see
        ``StepPipeline.record``)."""
        B, N = self.index.shape
        V, D = self.num_rows, self.width
        values = self.values.reshape(B * N, D)  # (B*N, D)
        key, (order, group) = self._groups((self.index >= 0).reshape(-1))
        merged = values.new_zeros((B * N, D), dtype=dtype).index_add_(
            0, group, values[order].to(dtype))  # (B*N, D) each distinct row's sum
        real = key < B * V  # not padding, not an empty group
        sq = torch.where(real, merged.square().sum(1), 0.0)  # (B*N,)
        out = values.new_zeros(B, dtype=dtype).index_add_(0, torch.where(real, key // V, 0), sq)
        return out.mul_(self.scale**2) if self.scale != 1.0 else out

    def dense(self) -> torch.Tensor:
        """The per-datum gradients ``(B, num_rows, *row_shape)`` (one ``index_add_``)."""
        B, N = self.index.shape
        V, D = self.num_rows, self.width
        out = self.values.new_zeros((B * V + 1, D))  # (B*V + 1, D) the last row: padding's
        valid = (self.index >= 0).reshape(-1, 1)  # (B*N, 1)
        flat = self.index + torch.arange(B, device=self.index.device).unsqueeze(1) * V
        flat = torch.where(valid[:, 0], flat.reshape(-1), B * V)  # (B*N,) (no mask: no sync)
        values = torch.where(valid, self.values.reshape(B * N, D), 0.0)  # padding may be NaN
        out.index_add_(0, flat, values, alpha=self.scale)
        return out[: B * V].reshape(B, *self.shape)


Material: TypeAlias = torch.Tensor | Factors | Rows
"""What a rule hands to a form for one batch: dense ``(B, *shape)``, factors or rows."""


def material_shape(material: Material) -> tuple[int, ...]:
    """The parameter shape the material's per-datum gradients have."""
    if isinstance(material, (Factors, Rows)):
        return tuple(material.shape)
    return tuple(_check_batched(material, "per-datum gradients").shape[1:])


def batch_size(material: Material) -> int:
    """B, the number of datums of any material."""
    if isinstance(material, (Factors, Rows)):
        return material.batch_size
    return int(_check_batched(material, "per-datum gradients").shape[0])


def select(material: Material, start: int, stop: int) -> Material:
    """Datums ``start:stop`` of any material (views, no copy)."""
    if isinstance(material, Factors):
        mask = None if material.mask is None else material.mask[start:stop]
        g, a = material.held
        return Factors(g[start:stop], a[start:stop], mask, material.scale, material.narrow)
    if isinstance(material, Rows):
        return Rows(
            material.index[start:stop],
            material.values[start:stop],
            material.num_rows,
            material.scale,
        )
    return material[start:stop]


def dense(material: Material) -> torch.Tensor:
    """The per-datum gradients ``(B, *shape)`` of any material (materialised)."""
    if isinstance(material, (Factors, Rows)):
        return material.dense()
    return _check_batched(material, "per-datum gradients")


def batch_sum(material: Material, weights: torch.Tensor) -> torch.Tensor:
    """``sum_b weights[b] g_b`` ``(*shape)`` without forming the per-datum gradients: what
    the recorder's self-check compares with ``p.grad``. Factors: one matmul over every row
    of the batch; rows: one ``index_add_``."""
    if isinstance(material, Factors):
        c = material.canonical()
        w = weights.to(c.g.dtype).reshape(-1, 1, 1)  # (B, 1, 1)
        B, N, p = c.g.shape  # (sizes spelt out: p or q may be 0)
        g = (c.g * w).reshape(B * N, p)  # (B*N, p)
        return g.T @ c.a.reshape(B * N, c.a.shape[2])  # (p, q)
    if isinstance(material, Rows):
        valid = (material.index >= 0).reshape(-1)  # (B*N,)
        w = weights.to(material.values.dtype).reshape(-1, 1)  # (B, 1)
        vals = material.values.reshape(*material.index.shape, -1) * w.unsqueeze(-1)  # (B,N,D)
        out = material.values.new_zeros((material.num_rows, material.width))  # (V, D)
        out.index_add_(
            0,
            material.index.reshape(-1)[valid],
            vals.reshape(-1, material.width)[valid],
            alpha=material.scale,
        )
        return out.reshape(material.shape)
    w = weights.to(material.dtype).reshape(-1, *([1] * (material.dim() - 1)))
    return (material * w).sum(0)


def entries(material: Material, flat_index: torch.Tensor) -> torch.Tensor:
    """Entries ``(B, k)`` of every datum's gradient at flat (row-major) positions
    ``flat_index`` (k,), without forming the gradients: the backend's spot check.
    Factors: ``sum_n g[b, n, i] a[b, n, j]``."""
    if isinstance(material, Factors):
        q = material.shape[1]
        rows, cols = flat_index // q, flat_index % q  # (k,), (k,)
        picked = material.masked().picked(rows, cols)  # (B, N, k) the scale applied last
        out = picked.sum(1)  # (B, k)
        return out * material.scale if material.scale != 1.0 else out
    if isinstance(material, Rows):
        D = material.width
        row, col = flat_index // D, flat_index % D  # (k,), (k,)
        vals = material.values.reshape(*material.index.shape, D)[:, :, col]  # (B, N, k)
        hit = material.index.unsqueeze(-1) == row  # (B, N, k)
        return (vals * hit).sum(1) * material.scale  # (B, k)
    flat = material if material.dim() == 2 else material.reshape(material.shape[0], -1)
    return flat.index_select(1, flat_index)  # (B, k)


def chunks(material: Material) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first datum, per-datum gradients (b, *shape))`` of any material, materialised a
    few datums at a time (at most :data:`MAX_ELEMENTS` elements each)."""
    B = batch_size(material)
    step = max(1, MAX_ELEMENTS // max(1, math.prod(material_shape(material))))
    for start in range(0, max(1, B), step):
        yield start, dense(select(material, start, start + step))
