"""The form interface.

A **form** decides how a parameter's per-datum gradients are kept. It is bound to one
parameter (its shape and the form's own settings) and turns the **material** a rule has for a
batch into named arrays with the record axis first (:meth:`Form.encode`); it reads them back
(:meth:`Form.decode`, where the form keeps enough to) and compares records in its own space
(:meth:`Form.inner`, :meth:`Form.sqnorms`) without rebuilding the gradients. The public
methods check what they are given and call the underscored ones a form implements
(``README.md`` in this folder: how to write a form).

The material (dense, :class:`~gradlog.grads.Factors`, :class:`~gradlog.grads.Rows`) is
defined in :mod:`gradlog.grads`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias

import numpy as np
import torch

from gradlog.errors import ConfigError, InputError, StoreFormatError
from gradlog.grads import (
    MAX_ELEMENTS,
    Factors,
    Material,
    Rows,
    batch_size,  # noqa: F401  TRANSITIONAL: gradlog/planning.py imports it from here
    material_shape,
    sqnorms,
)

__all__ = [
    "SOURCES",
    "ArraySpec",
    "Encoded",
    "Form",
    "ParamInfo",
    "Stored",
    "as_batch",
    "check_options",
    "spec_fields",
]

Encoded: TypeAlias = dict[str, torch.Tensor]
"""Array name -> tensor ``(records, *per-record shape)``: what a form stores for a batch."""

Stored: TypeAlias = Mapping[str, torch.Tensor | np.ndarray]
"""Stored arrays as a reader returns them (torch tensors or numpy arrays, records first):
what :meth:`Form.decode`, :meth:`Form.inner` and :meth:`Form.sqnorms` take."""

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

    A subclass sets :attr:`name`, :attr:`exact` and :attr:`settings`, and implements
    :meth:`arrays`, :meth:`_encode` and :meth:`_inner`; it overrides :meth:`plan` when it
    takes options, :meth:`_decode` when it keeps the gradients, :meth:`_sqnorms`,
    :meth:`_inner_dense` and :meth:`_encode_with_norms` where it has a cheaper way than the
    defaults. The public methods check their inputs (material shape, stored arrays, numpy
    arrays taken as tensors) and call those: ``README.md`` in this folder says how to write
    a form.

    Args:
        shape: The parameter's shape.
    """

    name: ClassVar[str]
    exact: ClassVar[bool]
    """True when :meth:`decode` gives back the gradients (to float rounding)."""
    norms_apart: ClassVar[bool] = True
    """True when :meth:`encode_with_norms` of a dense tensor is :meth:`encode` and the tensor's
    :func:`~gradlog.grads.sqnorms` (the encoding does not form the norms on its way): recording
    then takes small parameters' norms together (:func:`gradlog.planning.encode`)."""
    settings: ClassVar[Mapping[str, type]] = {}
    """The form's settings besides the shape: attribute and constructor keyword -> JSON type,
    stored in :meth:`spec` in this order and read back by :meth:`from_spec`."""
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
    def plan(cls, info: ParamInfo, **options: Any) -> Form:
        """The form to use for a parameter when this one is asked for (this default: a form
        without options or settings).

        May return another form where this one does not apply (``factors`` of a bias is
        its ``full`` form); ``auto`` always returns another.

        Raises:
            ConfigError: an option is unknown or invalid.
        """
        check_options(cls.name, options, ())
        return cls(info.shape)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Form:
        """The form a stored :meth:`spec` describes (this default: the shape and
        :attr:`settings` as constructor arguments).

        Raises:
            StoreFormatError: the spec is malformed.
        """
        fields = spec_fields(spec, cls.name, cls.settings)
        return cls(fields.pop("shape"), **fields)

    def spec(self) -> dict[str, Any]:
        """JSON-able description: ``{"form": name, "shape": [...], **settings}``; enough to
        rebuild the form (:func:`gradlog.forms.form_from_spec`), projections included."""
        own = {key: getattr(self, key) for key in self.settings}
        return {"form": self.name, "shape": list(self.shape), **own}

    # -- sizes ------------------------------------------------------------------------------
    @abc.abstractmethod
    def arrays(self) -> dict[str, ArraySpec]:
        """The arrays :meth:`encode` returns, by name, per record."""

    def nbytes_per_record(self, itemsize: int = 4) -> int:
        """Bytes one record takes with ``itemsize``-byte floats (the norm, kept in the
        index for every form, not counted)."""
        return sum(a.nbytes(itemsize) for a in self.arrays().values())

    # -- data -------------------------------------------------------------------------------
    def encode(self, material: Material) -> Encoded:
        """The arrays to store for a batch of per-datum gradients, record axis first.

        Raises:
            InputError: the material's parameter shape is not the form's, or the form does
                not take that kind of material.
        """
        self._check_material(material)
        return self._encode(material)

    def encode_with_norms(
        self, material: Material, *, dtype: torch.dtype = torch.float64
    ) -> tuple[Encoded, torch.Tensor]:
        """What recording needs: :meth:`encode`'s arrays and the exact squared norms
        ``(B,)`` (accumulated in ``dtype``), by the cheaper joint path (a form that
        materialises the gradients anyway takes the norms from them)."""
        self._check_material(material)
        return self._encode_with_norms(material, dtype)

    def decode(self, encoded: Stored) -> torch.Tensor:
        """The per-datum gradients ``(M, *shape)`` back from stored arrays.

        Raises:
            InputError: the form does not keep the gradients (``projection``, ``norm``), or
                the arrays do not match :meth:`arrays`.
        """
        return self._decode(self.tensors(encoded))

    def inner(self, x: Stored, y: Stored, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Inner products ``<x_i, y_j>`` of two sets of records, ``(M, K)``, in ``dtype``.

        Exact forms give the gradients' inner products; ``projection`` an unbiased estimate;
        ``topk`` that of the kept entries; ``norm`` raises :class:`InputError`."""
        return self._inner(self.tensors(x), self.tensors(y), dtype)

    def sqnorms(self, x: Stored, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Squared norms ``(M,)`` of records in the form's space (for exact forms: of the
        gradients; exact norms of every record are also in the store's index)."""
        return self._sqnorms(self.tensors(x), dtype)

    def inner_dense(
        self, x: Stored, other: torch.Tensor | np.ndarray, *, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Inner products ``(M, K)`` of stored records with gradients ``other`` (K, *shape)
        or one gradient ``(*shape)`` (a test example's, computed by the user), in this
        form's space."""
        return self._inner_dense(self.tensors(x), as_batch(_tensor(other), self.shape), dtype)

    # -- what a form implements -------------------------------------------------------------
    @abc.abstractmethod
    def _encode(self, material: Material) -> Encoded:
        """:meth:`encode` of material already checked against the form's shape."""

    def _encode_with_norms(
        self, material: Material, dtype: torch.dtype
    ) -> tuple[Encoded, torch.Tensor]:
        return self._encode(material), sqnorms(material, dtype=dtype)

    def _decode(self, x: Encoded) -> torch.Tensor:
        raise InputError(
            f"form {self.name!r} does not keep the gradients, so they cannot be rebuilt. "
            "Compare records in its space with inner()/sqnorms(); record the parameter with "
            "form 'full', 'factors' or 'auto' to keep them."
        )

    @abc.abstractmethod
    def _inner(self, x: Encoded, y: Encoded, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`inner` of arrays already checked against :meth:`arrays`."""

    def _sqnorms(self, x: Encoded, dtype: torch.dtype) -> torch.Tensor:
        return torch.diagonal(self._inner(x, x, dtype)).clone()

    def _inner_dense(self, x: Encoded, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rebuilds the records a block at a time (forms that do not keep the gradients
        override this)."""
        theirs = other.to(dtype).reshape(-1, self.numel)  # (K, n)
        m = _records(x)
        out = theirs.new_empty((m, theirs.shape[0]))  # (M, K)
        step = max(1, MAX_ELEMENTS // max(1, self.numel))  # records rebuilt at once
        for i in range(0, m, step):
            part = {key: t[i : i + step] for key, t in x.items()}
            ours = self._decode(part).to(dtype).reshape(-1, self.numel)  # (m, n)
            out[i : i + ours.shape[0]] = ours @ theirs.T  # (m, K)
        return out

    # -- checks -----------------------------------------------------------------------------
    def tensors(self, encoded: Stored) -> Encoded:
        """Stored arrays as torch tensors (numpy arrays shared, not copied), checked
        against :meth:`arrays`.

        Raises:
            InputError: an array is missing or has the wrong shape.
        """
        out = {key: _tensor(t) for key, t in encoded.items()}
        self.check(out)
        return out

    def check(self, encoded: Stored) -> int:
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


def _tensor(t: torch.Tensor | np.ndarray) -> torch.Tensor:
    """``t`` as a tensor: numpy arrays shared (a read-only one copied: torch needs writable)."""
    if isinstance(t, torch.Tensor):
        return t
    arr = np.asarray(t)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def _records(x: Encoded) -> int:
    """Records of checked arrays (0 for a form without arrays)."""
    return int(next(iter(x.values())).shape[0]) if x else 0


def as_batch(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` as a batch ``(K, *shape)``: a single gradient ``shape`` gets K=1.

    Raises:
        InputError: ``t`` is neither ``shape`` nor ``(K, *shape)``.
    """
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
