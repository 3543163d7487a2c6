"""The form interface, and the per-datum material rules hand to forms.

A **form** decides how a parameter's per-datum gradients are kept. It is bound to one
parameter (its shape and the form's own settings) and turns the **material** a rule has for a
batch into named arrays with the record axis first (:meth:`Form.encode`); it reads them back
(:meth:`Form.decode`, where the form keeps enough to) and compares records in its own space
(:meth:`Form.inner`, :meth:`Form.sqnorms`) without rebuilding the gradients.

Material comes in three kinds, none of which loops over datums in Python:

- a dense tensor ``(B, *shape)``: the per-datum gradients themselves (any parameter);
- :class:`Factors`: ``scale * g_b^T a_b`` for a matrix parameter ``(p, q)``, from the rows
  ``g`` (B, N, p) and ``a`` (B, N, q) a Linear-like rule captured (for ``nn.Linear``: output
  gradients and inputs), padded to a common N with a ``mask`` of the rows that count;
- :class:`Rows`: sparse rows ``dense[b, index[b, n]] += scale * values[b, n]`` (Embedding).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias

import torch

from gradlog.errors import ConfigError, InputError, StoreFormatError

__all__ = [
    "SOURCES",
    "ArraySpec",
    "Encoded",
    "Factors",
    "Form",
    "Material",
    "ParamInfo",
    "Rows",
    "batch_size",
    "batch_sum",
    "chunks",
    "dense",
    "dense_sqnorms",
    "entries",
    "factors_worthwhile",
    "float64_sqnorms",
    "material_shape",
    "norm_scratch",
    "select",
]

Encoded: TypeAlias = dict[str, torch.Tensor]
"""Array name -> tensor ``(records, *per-record shape)``: what a form stores for a batch."""

SOURCES = ("dense", "factors", "rows")
"""What a parameter's rule hands to forms: dense per-datum gradients, factors, sparse rows."""

MAX_ELEMENTS = 1 << 25
"""Elements of an intermediate tensor above which forms work through the batch in chunks
(32M: 256 MiB in float64), so a comparison never needs memory quadratic in everything."""


def factors_worthwhile(tokens: int, d_in: int, d_out: int) -> bool:
    """True when the factors ``G (T, d_out)``, ``A (T, d_in)`` are smaller than ``G^T A``:
    ``T (d_in + d_out) < d_in d_out``, i.e. ``T < d_in d_out / (d_in + d_out)`` (64 rows for
    128 x 128, 2048 for 4096 x 4096)."""
    return tokens * (d_in + d_out) < d_in * d_out


def _check_batched(t: Any, what: str, dims: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(t).__name__}.")
    if dims is not None and t.dim() != dims:
        raise InputError(f"{what} has shape {tuple(t.shape)}; expected {dims} dimensions.")
    return t


@dataclass(frozen=True)
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

    Attributes:
        g: ``(B, N, p)``, the factor of the parameter's first axis.
        a: ``(B, N, q)``, the factor of its second axis.
        mask: ``(B, N)`` bool, True for rows that count; None: all rows count.
        scale: Factor of every datum's gradient (a rule's ``cap.scale``).
    """

    g: torch.Tensor
    a: torch.Tensor
    mask: torch.Tensor | None = None
    scale: float = 1.0

    def __post_init__(self) -> None:
        g = _check_batched(self.g, "Factors.g", 3)
        a = _check_batched(self.a, "Factors.a", 3)
        if g.shape[:2] != a.shape[:2]:
            raise InputError(
                f"Factors.g {tuple(g.shape)} and Factors.a {tuple(a.shape)} must agree on "
                "(B, N): one row of each per token of each datum."
            )
        if self.mask is not None and (
            self.mask.dtype != torch.bool or self.mask.shape != g.shape[:2]
        ):
            raise InputError(
                f"Factors.mask has shape {tuple(self.mask.shape)} and dtype {self.mask.dtype}; "
                f"expected bool {tuple(g.shape[:2])} (True: the row counts). Build it from "
                "lengths with Factors.from_lengths."
            )

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
        return int(self.g.shape[0])

    @property
    def tokens(self) -> int:
        """N, rows per datum (padding included)."""
        return int(self.g.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        """The parameter's shape ``(p, q)``."""
        return int(self.g.shape[2]), int(self.a.shape[2])

    def canonical(self) -> Factors:
        """The same gradients with ``scale`` folded into ``g`` and ignored rows zeroed (in
        both factors, so padding holding NaN cannot leak), mask None, scale 1."""
        g, a = self.g, self.a
        if self.mask is not None:
            drop = ~self.mask.unsqueeze(-1)  # (B, N, 1)
            g = g.masked_fill(drop, 0.0)  # (B, N, p)
            a = a.masked_fill(drop, 0.0)  # (B, N, q)
        if self.scale != 1.0:
            g = g * self.scale  # (B, N, p)
        return Factors(g, a)

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
        if keep is None:
            keep = (c.g != 0).any(-1) & (c.a != 0).any(-1)  # (B, N)
        if self.mask is not None:
            keep = keep & self.mask
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # (B, N)
        g = c.g.gather(1, order.unsqueeze(-1).expand_as(c.g))  # (B, N, p)
        a = c.a.gather(1, order.unsqueeze(-1).expand_as(c.a))  # (B, N, q)
        lengths = keep.sum(1)  # (B,)
        pad = (torch.arange(self.tokens, device=g.device) >= lengths.unsqueeze(1)).unsqueeze(-1)
        return Factors(g.masked_fill(pad, 0.0), a.masked_fill(pad, 0.0)), lengths

    def dense(self) -> torch.Tensor:
        """The per-datum gradients ``(B, p, q)``: one batched matmul, the scale folded into
        it (as the Linear rule computes them)."""
        c = Factors(self.g, self.a, self.mask).canonical() if self.mask is not None else self
        B, _, p = c.g.shape
        out = torch.empty((B, p, c.a.shape[2]), dtype=c.g.dtype, device=c.g.device)
        # beta=0 ignores out's (uninitialised) contents
        return out.baddbmm_(c.g.transpose(1, 2), c.a, beta=0.0, alpha=self.scale)  # (B, p, q)

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
        after them (still N wide)."""
        B, N = self.index.shape
        D = self.width
        V = self.num_rows
        values = self.values.reshape(B * N, D)  # (B*N, D)
        if self.scale != 1.0:
            values = values * self.scale
        index = self.index.reshape(B * N)  # (B*N,)
        datum = torch.arange(B, device=index.device).repeat_interleave(N)  # (B*N,)
        keep = (index >= 0) & (values != 0).any(-1)  # (B*N,)
        key = torch.where(keep, datum * V + index, B * V)  # dropped entries sort last
        uniq, inverse = torch.unique(key, sorted=True, return_inverse=True)  # (U,), (B*N,)
        merged = values.new_zeros((uniq.numel(), D)).index_add_(0, inverse, values)  # (U, D)
        real = uniq < B * V  # (U,) not the "dropped" key
        owner = torch.where(real, uniq // V, 0)  # (U,) datum of each distinct row
        counts = torch.bincount(owner[real], minlength=B)  # (B,)
        starts = torch.cumsum(counts, 0) - counts  # (B,) first distinct row of each datum
        slot = torch.arange(uniq.numel(), device=index.device) - starts[owner]  # (U,)
        out_index = index.new_full((B, N), -1)  # (B, N)
        out_values = values.new_zeros((B, N, D))  # (B, N, D)
        out_index[owner[real], slot[real]] = uniq[real] % V
        out_values[owner[real], slot[real]] = merged[real]
        return Rows(out_index, out_values.reshape(self.values.shape), V)

    def dense(self) -> torch.Tensor:
        """The per-datum gradients ``(B, num_rows, *row_shape)`` (one ``index_add_``)."""
        B, N = self.index.shape
        V, D = self.num_rows, self.width
        out = self.values.new_zeros((B * V, D))  # (B*V, D)
        valid = (self.index >= 0).reshape(-1)  # (B*N,)
        flat = self.index + torch.arange(B, device=self.index.device).unsqueeze(1) * V
        flat = flat.reshape(-1)[valid]  # (n_valid,)
        out.index_add_(0, flat, self.values.reshape(B * N, D)[valid], alpha=self.scale)
        return out.reshape(B, *self.shape)


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
        return Factors(material.g[start:stop], material.a[start:stop], mask, material.scale)
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
        g = (c.g * w).reshape(-1, c.g.shape[2])  # (B*N, p)
        return g.T @ c.a.reshape(-1, c.a.shape[2])  # (p, q)
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
        c = Factors(material.g, material.a, material.mask).canonical()  # scale applied last
        q = c.a.shape[2]
        rows, cols = flat_index // q, flat_index % q  # (k,), (k,)
        picked = c.g.index_select(2, rows) * c.a.index_select(2, cols)  # (B, N, k)
        out = picked.sum(1)  # (B, k)
        return out * material.scale if material.scale != 1.0 else out
    if isinstance(material, Rows):
        D = material.width
        row, col = flat_index // D, flat_index % D  # (k,), (k,)
        vals = material.values.reshape(*material.index.shape, D)[:, :, col]  # (B, N, k)
        hit = material.index.unsqueeze(-1) == row  # (B, N, k)
        return (vals * hit).sum(1) * material.scale  # (B, k)
    return material.reshape(material.shape[0], -1).index_select(1, flat_index)  # (B, k)


SCRATCH_ELEMENTS = {"cpu": 1 << 18}
"""float64 elements of :func:`float64_sqnorms`'s block buffer, by device type: 2 MiB on the
CPU (stays in cache); elsewhere (CUDA) ``1 << 22`` (32 MiB: a few launches per parameter)."""


def norm_scratch(device: torch.device) -> torch.Tensor:
    """A block buffer for :func:`float64_sqnorms` on ``device``, to share between calls."""
    return torch.empty(SCRATCH_ELEMENTS.get(device.type, 1 << 22), dtype=torch.float64,
                       device=device)


def float64_sqnorms(flat: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Squared norms ``(B,)`` of the rows of ``flat`` (B, n), every element squared and summed
    in float64: the store's exact norms (FORMAT.md). Columns are widened a block at a time
    into ``scratch`` (float64, on ``flat``'s device; made if None or too small), never the
    whole tensor: widening a whole medium-GPT step of float32 gradients at once wrote 844
    MiB of fresh memory and took ~8x longer on a CPU (measured: 36.7 vs 4.7 ms per 32 MiB),
    and on a GPU would double the step's gradient memory."""
    if flat.dtype == torch.float64:
        return flat.square().sum(1)  # (B,)
    B, n = flat.shape
    per = SCRATCH_ELEMENTS.get(flat.device.type, 1 << 22)
    cols = max(1, per // max(1, B))
    width = B * min(cols, n)
    if (scratch is None or scratch.numel() < width or scratch.dtype != torch.float64
            or scratch.device != flat.device):
        scratch = torch.empty(width, dtype=torch.float64, device=flat.device)
    out = torch.zeros(B, dtype=torch.float64, device=flat.device)  # (B,)
    for start in range(0, n, cols):
        block = flat[:, start : start + cols]  # (B, c)
        wide = scratch[: block.numel()].view(block.shape)  # (B, c)
        wide.copy_(block)
        out.add_(wide.square_().sum(1))
    return out


def dense_sqnorms(flat: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Squared norms ``(B,)`` of the rows of ``flat`` (B, n), returned in ``dtype``: float64
    ones by :func:`float64_sqnorms` (exact; one float32 norm over 5e7 elements erred by 3e-3,
    measured), others in the wider of ``flat``'s dtype and float32."""
    if dtype == torch.float64:
        return float64_sqnorms(flat)
    work = torch.promote_types(flat.dtype, torch.float32)
    whole: torch.Tensor = torch.linalg.vector_norm(flat, dim=1, dtype=work)  # (B,)
    return whole.to(dtype).square()


def chunks(material: Material) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first datum, per-datum gradients (b, *shape))`` of any material, materialised a
    few datums at a time (at most :data:`MAX_ELEMENTS` elements each)."""
    B = batch_size(material)
    step = max(1, MAX_ELEMENTS // max(1, math.prod(material_shape(material))))
    for start in range(0, max(1, B), step):
        yield start, dense(select(material, start, start + step))


@dataclass(frozen=True)
class ArraySpec:
    """One array a form stores: its per-record shape and what its elements are.

    Attributes:
        shape: Shape of one record's entry (the record axis is not included).
        kind: ``"float"``: gradient values, kept in the storage dtype; ``"int64"``: indices.
    """

    shape: tuple[int, ...]
    kind: Literal["float", "int64"] = "float"

    def nbytes(self, itemsize: int) -> int:
        """Bytes per record with ``itemsize``-byte floats (indices take 8)."""
        return math.prod(self.shape) * (8 if self.kind == "int64" else itemsize)


@dataclass(frozen=True)
class ParamInfo:
    """What planning a form needs to know about a parameter.

    Attributes:
        shape: The parameter's shape.
        source: What its rule provides: ``"dense"``, ``"factors"`` (Linear-like weights) or
            ``"rows"`` (Embedding weights); see :data:`SOURCES`.
        tokens: For ``factors``/``rows``: rows per datum to provision (the context length;
            with reuse, times the number of calls).
        itemsize: Bytes of one stored float (4 for float32, 2 for bfloat16).
        name: The parameter's name (seeds of projections derive from it).
    """

    shape: tuple[int, ...]
    source: str = "dense"
    tokens: int | None = None
    itemsize: int = 4
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.source not in SOURCES:
            raise ConfigError(f"source={self.source!r} is not one of {list(SOURCES)}.")
        if self.source != "dense" and (self.tokens is None or self.tokens < 0):
            raise ConfigError(
                f"parameter {self.name!r}: source {self.source!r} needs tokens (rows per datum, "
                f"e.g. the context length), got {self.tokens!r}."
            )
        if self.source == "factors" and len(self.shape) != 2:
            raise ConfigError(
                f"parameter {self.name!r}: factors need a matrix, got shape {self.shape}."
            )
        if self.itemsize <= 0:
            raise ConfigError(f"itemsize must be positive, got {self.itemsize}.")

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        return math.prod(self.shape)

    @classmethod
    def of(cls, material: Material, *, name: str = "", itemsize: int = 4) -> ParamInfo:
        """The info of a parameter whose rule hands over ``material`` (at the first call)."""
        if isinstance(material, Factors):
            return cls(material.shape, "factors", material.tokens, itemsize, name)
        if isinstance(material, Rows):
            return cls(material.shape, "rows", int(material.index.shape[1]), itemsize, name)
        return cls(material_shape(material), "dense", None, itemsize, name)


class Form(abc.ABC):
    """How one parameter's per-datum gradients are kept. See the module doc.

    Subclasses set :attr:`name` and :attr:`exact`, and implement :meth:`plan`,
    :meth:`from_spec`, :meth:`spec`, :meth:`arrays`, :meth:`encode` and :meth:`inner`.

    Args:
        shape: The parameter's shape.
    """

    name: ClassVar[str]
    exact: ClassVar[bool]
    """True when :meth:`decode` gives back the gradients (to float rounding)."""
    requested_tokens: int | None = None
    """For forms provisioned with rows per datum (``factors``, ``rows``): the ``tokens``
    option of the form request when it set them (it wins over ``GradRecorder(tokens=)``, so
    errors say to raise it); None otherwise. Not part of the spec."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(int(d) for d in shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()})"

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self) and isinstance(other, Form) and (other.spec() == self.spec())
        )

    def __hash__(self) -> int:
        return hash(repr(self))

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        return math.prod(self.shape)

    # -- construction -----------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def plan(cls, info: ParamInfo, **options: Any) -> Form:
        """The form to use for a parameter when this one is asked for.

        May return another form where this one does not apply (``factors`` of a bias is
        its ``full`` form); ``auto`` always returns another.

        Raises:
            ConfigError: an option is unknown or invalid.
        """

    @classmethod
    @abc.abstractmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Form:
        """The form a stored :meth:`spec` describes.

        Raises:
            StoreFormatError: the spec is malformed.
        """

    @abc.abstractmethod
    def spec(self) -> dict[str, Any]:
        """JSON-able description: ``{"form": name, "shape": [...], **settings}``; enough to
        rebuild the form (:func:`gradlog.forms.form_from_spec`), projections included."""

    # -- sizes ------------------------------------------------------------------------------
    @abc.abstractmethod
    def arrays(self) -> dict[str, ArraySpec]:
        """The arrays :meth:`encode` returns, by name, per record."""

    def nbytes_per_record(self, itemsize: int = 4) -> int:
        """Bytes one record takes with ``itemsize``-byte floats (the norm, kept in the
        index for every form, not counted)."""
        return sum(a.nbytes(itemsize) for a in self.arrays().values())

    # -- data -------------------------------------------------------------------------------
    @abc.abstractmethod
    def encode(self, material: Material) -> Encoded:
        """The arrays to store for a batch of per-datum gradients, record axis first."""

    def encode_with_norms(
        self, material: Material, *, dtype: torch.dtype = torch.float64
    ) -> tuple[Encoded, torch.Tensor]:
        """What recording needs: :meth:`encode`'s arrays and the exact squared norms
        ``(B,)`` (accumulated in ``dtype``), by the cheaper joint path (a form that
        materialises the gradients anyway takes the norms from them)."""
        from gradlog.forms.norm import sqnorms  # norm.py builds on this module

        return self.encode(material), sqnorms(material, dtype=dtype)

    def decode(self, encoded: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The per-datum gradients ``(M, *shape)`` back from stored arrays.

        Raises:
            InputError: the form does not keep the gradients (``projection``, ``norm``).
        """
        raise InputError(
            f"form {self.name!r} does not keep the gradients, so they cannot be rebuilt. "
            "Compare records in its space with inner()/sqnorms(); record the parameter with "
            "form 'full', 'factors' or 'auto' to keep them."
        )

    @abc.abstractmethod
    def inner(
        self,
        x: Mapping[str, torch.Tensor],
        y: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        """Inner products ``<x_i, y_j>`` of two sets of records, ``(M, K)``, in ``dtype``.

        Exact forms give the gradients' inner products; ``projection`` an unbiased estimate;
        ``topk`` that of the kept entries."""

    def sqnorms(
        self, x: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Squared norms ``(M,)`` of records in the form's space (for exact forms: of the
        gradients; exact norms of every record are also in the store's index)."""
        return torch.diagonal(self.inner(x, x, dtype=dtype)).clone()

    def inner_dense(
        self,
        x: Mapping[str, torch.Tensor],
        other: torch.Tensor,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        """Inner products ``(M, K)`` of stored records with gradients ``other`` (K, *shape)
        (a test example's, computed by the user), in this form's space."""
        theirs = _as_batch(other, self.shape).to(dtype).reshape(-1, self.numel)  # (K, n)
        m = self.check(x)
        out = theirs.new_empty((m, theirs.shape[0]))  # (M, K)
        step = max(1, MAX_ELEMENTS // max(1, self.numel))  # records rebuilt at once
        for i in range(0, m, step):
            part = {key: t[i : i + step] for key, t in x.items()}
            ours = self.decode(part).to(dtype).reshape(-1, self.numel)  # (m, n)
            out[i : i + ours.shape[0]] = ours @ theirs.T  # (m, K)
        return out

    # -- checks -----------------------------------------------------------------------------
    def check(self, encoded: Mapping[str, torch.Tensor]) -> int:
        """Check stored arrays against :meth:`arrays`; returns the number of records.

        Raises:
            InputError: an array is missing or has the wrong shape.
        """
        want = self.arrays()
        if set(encoded) != set(want):
            raise InputError(
                f"form {self.name!r} stores arrays {sorted(want)}, got {sorted(encoded)}."
            )
        records = {int(t.shape[0]) for t in encoded.values()}
        for key, spec in want.items():
            t = encoded[key]
            if tuple(t.shape[1:]) != spec.shape:
                raise InputError(
                    f"form {self.name!r}: array {key!r} has shape {tuple(t.shape)}; expected "
                    f"(records, *{spec.shape}) for parameter shape {self.shape}."
                )
        if len(records) > 1:
            raise InputError(
                f"form {self.name!r}: arrays disagree on the number of records ({sorted(records)})."
            )
        return records.pop() if records else 0

    def _check_material(self, material: Material) -> None:
        shape = material_shape(material)
        if shape != self.shape:
            raise InputError(
                f"form {self.name!r} was planned for a parameter of shape {self.shape}, but the "
                f"per-datum gradients have shape {shape}. Plan the form from this parameter "
                "(ParamInfo.of(material))."
            )


def _as_batch(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` as a batch ``(K, *shape)``: a single gradient ``shape`` gets K=1."""
    if tuple(t.shape) == shape:
        return t.unsqueeze(0)
    if tuple(t.shape[1:]) != shape:
        raise InputError(
            f"a gradient of shape {tuple(t.shape)} does not match the parameter shape {shape}; "
            f"pass {shape} or a batch (K, *{shape})."
        )
    return t


def spec_fields(spec: Mapping[str, Any], form: str, fields: Mapping[str, type]) -> dict[str, Any]:
    """Check a stored spec names ``form`` and holds ``fields`` with the given types."""
    if spec.get("form") != form:
        raise StoreFormatError(f"spec {dict(spec)!r} is not a {form!r} form spec.")
    out: dict[str, Any] = {}
    for key, typ in {"shape": list, **fields}.items():
        value = spec.get(key)
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if not ok:
            raise StoreFormatError(
                f"{form!r} form spec field {key!r} is {value!r}; expected {typ.__name__}. "
                "The store's parameter spec is damaged or from another gradlog."
            )
        out[key] = value
    shape = out["shape"]
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise StoreFormatError(
            f"{form!r} form spec has shape {shape!r}; expected a list of non-negative integers."
        )
    out["shape"] = tuple(shape)
    return out


def check_options(form: str, options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    """Refuse options a form does not take, listing those it does."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"form {form!r} takes no option {unknown}; its options are {sorted(allowed)}."
        )
