"""The form interface.

A **form** decides how a parameter's per-datum gradients are kept. It is bound to one
parameter (its shape and the form's own settings) and turns the **material** a rule has for a
batch into named arrays with the record axis first (:meth:`Form.encode`); it reads them back
(:meth:`Form.decode`, where the form keeps enough to) and compares records in its own space
(:meth:`Form.inner`, :meth:`Form.sqnorms`) without rebuilding the gradients.

The material (dense, :class:`~gradlog.grads.Factors`, :class:`~gradlog.grads.Rows`) is
defined in :mod:`gradlog.grads`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias

import torch

from gradlog.errors import ConfigError, InputError, StoreFormatError
from gradlog.grads import (
    MAX_ELEMENTS,
    Factors,
    Material,
    Rows,
    batch_size,
    batch_sum,
    chunks,
    dense,
    dense_sqnorms,
    entries,
    factors_worthwhile,
    float64_sqnorms,
    material_shape,
    norm_scratch,
    select,
)

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
