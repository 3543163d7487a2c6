"""``factors`` and ``rows``: the exact factored forms, provisioned with rows per datum.

**factors** keeps the exact factors ``g_b`` (N, p) and ``a_b`` (N, q) of ``g_b^T a_b``. For a
Linear-like weight ``(p, q)`` the per-datum gradient is ``G_b^T A_b`` (output gradients times
inputs, summed over the datum's N tokens). Storing the two factors costs ``N (p + q)``
floats instead of ``p q``: smaller when ``N < p q / (p + q)``
(:func:`~gradlog.grads.factors_worthwhile`), e.g. 64 tokens for 128 x 128, 2048 for
4096 x 4096. Arrays: ``g`` (records, tokens, p) and ``a`` (records, tokens, q), where
``tokens`` is the provisioned rows per datum (the spec's ``tokens``, normally the context
length). A datum with fewer rows (padding, dropped tokens) has zero rows after its own; the
scale of the gradient is folded into ``g``. Comparisons never need the gradients
(:func:`~gradlog.grads.factored_inner` picks factored or materialised by cost, both exact),
nor does the inner product with a dense gradient (``sum_n g_n^T W a_n``).
A bias of a Linear-like layer has the gradient ``sum_n g_{b,n}`` (``Factors.bias()``): its
factored form is its full form, so ``factors`` asked for a vector plans ``full``.

**rows** keeps sparse rows of an Embedding's per-datum gradient, exact: datum b's gradient
of an Embedding ``(V, D)`` is non-zero only in the rows of the tokens it used, at most N of
V (an Embedding's rows are its factors). The form keeps each datum's distinct rows
(duplicates summed, all-zero rows such as ``padding_idx`` dropped), sorted by row index, as
``index`` (records, tokens) int64 and ``values`` (records, tokens, D); unused slots have
index -1 and zero values. ``N (8 + 4 D)`` bytes instead of ``4 V D`` (for GPT-2's 50,257 x
768 embedding at N 1024: 3.2 MB instead of 154 MB per datum). Comparisons gather rather than
densify (:func:`~gradlog.grads.rows_inner`); the inner product with a dense gradient
gathers the stored rows from it.

Either request plans the exact factored form of what the parameter's rule hands over:
``factors`` for factors, ``rows`` for sparse rows, ``full`` for dense gradients.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import torch

from gradlog.errors import ConfigError, InputError
from gradlog.forms.base import ArraySpec, Encoded, Form, ParamInfo, check_options
from gradlog.forms.full import FullForm
from gradlog.grads import (
    MAX_ELEMENTS,
    Factors,
    Material,
    Rows,
    factored_inner,
    factored_sqnorms,
    rows_inner,
    sqnorms,
)
from gradlog.grads.inner import factored_inner_dense

__all__ = ["FactorsForm", "RowsForm", "warn_if_larger_than_full"]


class _Provisioned(Form):
    """A form with ``tokens`` row slots per datum (``factors``, ``rows``).

    Args:
        shape: The parameter's shape.
        tokens: Rows per datum provisioned in the arrays (>= 1).
    """

    exact: ClassVar[bool] = True
    settings: ClassVar[dict[str, type]] = {"tokens": int}

    def __init__(self, shape: tuple[int, ...], tokens: int) -> None:
        super().__init__(shape)
        if tokens < 1:
            raise ConfigError(
                f"form {self.name!r} needs tokens >= 1 (rows per datum), got {tokens}."
            )
        self.tokens = int(tokens)

    @classmethod
    def plan(cls, info: ParamInfo, **options: Any) -> Form:
        """The exact factored form of the parameter's material: ``factors`` for factors,
        ``rows`` for sparse rows, ``full`` for dense gradients (a bias, a LayerNorm weight).
        Option: ``tokens`` (rows per datum to provision; default ``info.tokens``)."""
        check_options(cls.name, options, ("tokens",))
        if info.source == "dense":
            return FullForm.plan(info)
        kind = FactorsForm if info.source == "factors" else RowsForm
        tokens = options.get("tokens", info.tokens)
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise ConfigError(f"form {kind.name!r} option tokens={tokens!r} must be an integer.")
        form = kind(info.shape, tokens)
        if "tokens" in options:
            form.requested_tokens = tokens
        return form

    def _too_many(self, found: str, least: str, instead: str) -> InputError:
        """The error for a datum with more rows than provisioned, naming the option to raise."""
        fix = "Plan with tokens=" if self.requested_tokens is None else (
            f"Raise the form request's own 'tokens' option ({self.requested_tokens}; "
            "it wins over GradRecorder(..., tokens=N)) to")
        return InputError(
            f"form {self.name!r} was provisioned for {self.tokens} rows per datum, but a datum "
            f"{found}. {fix} at least {least}, or use {instead}."
        )


class FactorsForm(_Provisioned):
    """Exact factors of a Linear-like weight (see the module doc).

    Args:
        shape: The weight's shape ``(p, q)``.
        tokens: Rows per datum provisioned in the arrays (>= 1).
    """

    name: ClassVar[str] = "factors"

    def __init__(self, shape: tuple[int, ...], tokens: int) -> None:
        if len(shape) != 2:
            raise ConfigError(f"form 'factors' needs a matrix parameter, got shape {shape}.")
        super().__init__(shape, tokens)

    def arrays(self) -> dict[str, ArraySpec]:
        p, q = self.shape
        return {"g": ArraySpec((self.tokens, p)), "a": ArraySpec((self.tokens, q))}

    def _encode(self, material: Material) -> Encoded:
        """Factors with scale and mask folded in, padded (or compacted) to ``tokens`` rows.

        Raises:
            InputError: the material is not :class:`Factors`, or a datum has more
                contributing rows than ``tokens``.
        """
        if not isinstance(material, Factors):
            raise InputError(
                f"form 'factors' stores factors, but got dense per-datum gradients of shape "
                f"{tuple(material.shape) if isinstance(material, torch.Tensor) else '?'}. "
                "Plan the form with FactorsForm.plan (it gives 'full' for dense material)."
            )
        n = material.tokens
        if n > self.tokens:  # keep only rows that count, if they fit
            c, lengths = material.compact()
            longest = int(lengths.max()) if lengths.numel() else 0
            if longest > self.tokens:
                raise self._too_many(
                    f"has {longest} contributing rows (a longer context, or a module called "
                    "several times)",
                    "the longest datum's rows per step",
                    "form 'auto' or 'projection'",
                )
            return {"g": c.g[:, : self.tokens], "a": c.a[:, : self.tokens]}
        c = material.canonical()
        if n == self.tokens:
            return {"g": c.g, "a": c.a}
        pad = (0, 0, 0, self.tokens - n)  # zero rows after each datum's own
        return {"g": torch.nn.functional.pad(c.g, pad), "a": torch.nn.functional.pad(c.a, pad)}

    def _decode(self, x: Encoded) -> torch.Tensor:
        return torch.bmm(x["g"].transpose(1, 2), x["a"])  # (M, p, q)

    def _inner(self, x: Encoded, y: Encoded, dtype: torch.dtype) -> torch.Tensor:
        return factored_inner(x["g"], x["a"], y["g"], y["a"], dtype=dtype)  # (M, K)

    def _sqnorms(self, x: Encoded, dtype: torch.dtype) -> torch.Tensor:
        return factored_sqnorms(x["g"], x["a"], dtype=dtype)  # (M,)

    def _inner_dense(self, x: Encoded, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``<g_i^T a_i, W_k> = sum_n g_in^T W_k a_in`` with ``other`` (K, p, q): one
        matrix product per block, records not formed (:func:`factored_inner_dense`)."""
        return factored_inner_dense(x["g"], x["a"], other, dtype=dtype)  # (M, K)


class RowsForm(_Provisioned):
    """Distinct non-zero rows per datum (see the module doc).

    Args:
        shape: The parameter's shape ``(V, *row_shape)``.
        tokens: Row slots per datum (>= 1): at least the datum's distinct rows.
    """

    name: ClassVar[str] = "rows"

    def __init__(self, shape: tuple[int, ...], tokens: int) -> None:
        if len(shape) < 2:
            raise ConfigError(
                f"form 'rows' needs a parameter of >= 2 dimensions, got shape {tuple(shape)}."
            )
        super().__init__(shape, tokens)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row."""
        return self.shape[1:]

    @property
    def width(self) -> int:
        """Elements of one row (D)."""
        return self.numel // self.shape[0] if self.shape[0] else 0

    def arrays(self) -> dict[str, ArraySpec]:
        return {
            "index": ArraySpec((self.tokens,), "int64"),
            "values": ArraySpec((self.tokens, *self.row_shape)),
        }

    def _encode(self, material: Material) -> Encoded:
        """Distinct rows per datum, padded (or cut after the last used slot) to ``tokens``.

        Raises:
            InputError: the material is not :class:`Rows`, or a datum uses more distinct
                rows than ``tokens``.
        """
        if not isinstance(material, Rows):
            raise InputError(
                "form 'rows' stores sparse rows (an Embedding's), but got "
                f"{type(material).__name__} material. Plan the form with RowsForm.plan (it "
                "gives 'factors' or 'full' for other material)."
            )
        u = material.unique()
        n = int(u.index.shape[1])
        if n > self.tokens:
            used = int((u.index >= 0).sum(1).max()) if u.index.numel() else 0
            if used > self.tokens:
                raise self._too_many(
                    f"uses {used} distinct rows",
                    "the number of indices per datum (the context length)",
                    "form 'projection'",
                )
            return {"index": u.index[:, : self.tokens], "values": u.values[:, : self.tokens]}
        pad = self.tokens - n
        if pad == 0:
            return {"index": u.index, "values": u.values}
        index = torch.nn.functional.pad(u.index, (0, pad), value=-1)  # (B, tokens)
        values = u.values.new_zeros((u.values.shape[0], self.tokens, *self.row_shape))
        values[:, :n] = u.values
        return {"index": index, "values": values}

    def _rows(self, x: Encoded) -> Rows:
        return Rows(x["index"], x["values"], self.shape[0])

    def _decode(self, x: Encoded) -> torch.Tensor:
        return self._rows(x).dense()

    def _inner(self, x: Encoded, y: Encoded, dtype: torch.dtype) -> torch.Tensor:
        return rows_inner(self._rows(x), self._rows(y), dtype=dtype)  # (M, K)

    def _sqnorms(self, x: Encoded, dtype: torch.dtype) -> torch.Tensor:
        return sqnorms(self._rows(x), dtype=dtype)  # (M,) over each datum's distinct rows

    def _inner_dense(self, x: Encoded, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``<x_i, W_j> = sum_n values[i, n] . W_j[index[i, n]]``: gathers the stored rows
        from ``other`` (K, V, *row_shape); never densifies a record."""
        r = self._rows(x)
        w = other.to(dtype).reshape(-1, self.shape[0], self.width)  # (K, V, D)
        M, N = r.index.shape
        out = torch.empty((M, w.shape[0]), dtype=dtype, device=w.device)  # (M, K)
        step = max(1, MAX_ELEMENTS // max(1, N * self.width * w.shape[0]))
        for i in range(0, M, step):
            index = r.index[i : i + step]  # (m, N)
            vals = r.values[i : i + step].to(dtype).reshape(*index.shape, self.width)  # (m,N,D)
            vals = vals * (index >= 0).unsqueeze(-1)  # padding slots count nothing
            picked = w[:, index.clamp(min=0)]  # (K, m, N, D)
            out[i : i + index.shape[0]] = torch.einsum("kmnd,mnd->mk", picked, vals)  # (m, K)
        return out


WASTE_RATIO = 1.5
"""A requested ``factors``/``rows`` form storing more than this times ``full``'s bytes warns."""


def warn_if_larger_than_full(form: Form, info: ParamInfo) -> None:
    """Warn when an explicitly requested ``factors``/``rows`` form stores clearly more bytes
    per record than ``full`` would (over :data:`WASTE_RATIO` times: many rows per datum;
    factors pay off only below ``p q / (p + q)`` rows; ``auto`` never picks such a form)."""
    if not isinstance(form, _Provisioned):
        return
    own = form.nbytes_per_record(info.itemsize)
    full = math.prod(form.shape) * info.itemsize
    if own <= WASTE_RATIO * full:
        return
    who = f"parameter {info.name!r}" if info.name else f"a parameter of shape {form.shape}"
    if isinstance(form, FactorsForm):
        p, q = form.shape
        what = (
            f"{form.tokens} x ({p} + {q}) values per record (factors pay off below "
            f"{p * q // (p + q)} rows per datum)"
        )
    else:
        what = f"{form.tokens} rows of {form.shape[1:]} with their indices per record"
    warnings.warn(
        f"{who}: form {form.name!r} at {form.tokens} rows per datum stores {what}: "
        f"{own / full:.1f}x the bytes of form 'full' ({full} per record). Use form='full' for "
        "it (exact, smaller here), 'auto' (the smallest exact form of each parameter, within "
        "form_budget), or {'form': 'projection', 'dim': k} for compact estimates (README, "
        "section 'How faithful is a projection').",
        UserWarning,
        stacklevel=3,  # make_form's caller
    )
