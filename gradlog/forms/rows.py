"""``rows``: sparse rows of an Embedding's per-datum gradient, exact.

Datum b's gradient of an Embedding ``(V, D)`` is non-zero only in the rows of the tokens it
used: at most N of V. The form keeps each datum's distinct rows (duplicates summed, all-zero
rows such as ``padding_idx`` dropped), sorted by row index, as ``index`` (records, tokens)
int64 and ``values`` (records, tokens, D); unused slots have index -1 and zero values.
``N (8 + 4 D)`` bytes instead of ``4 V D`` (for GPT-2's 50,257 x 768 embedding at N 1024:
3.2 MB instead of 154 MB per datum).

Comparisons gather rather than densify: two sets of records are laid out over the union of
the rows they use (U <= min(V, M N + K N)), so ``<x_i, y_j>`` costs ``U D`` per pair, and
the inner product with a dense gradient gathers the stored rows from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from gradlog.errors import ConfigError, InputError
from gradlog.forms.base import (
    MAX_ELEMENTS,
    ArraySpec,
    Encoded,
    Form,
    Material,
    ParamInfo,
    Rows,
    _as_batch,
    check_options,
    spec_fields,
)

__all__ = ["RowsForm"]


class RowsForm(Form):
    """Distinct non-zero rows per datum (see the module doc).

    Args:
        shape: The parameter's shape ``(V, *row_shape)``.
        tokens: Row slots per datum (>= 1): at least the datum's distinct rows.
    """

    name: ClassVar[str] = "rows"
    exact: ClassVar[bool] = True

    def __init__(self, shape: tuple[int, ...], tokens: int) -> None:
        super().__init__(shape)
        if len(self.shape) < 2:
            raise ConfigError(
                f"form 'rows' needs a parameter of >= 2 dimensions, got shape {self.shape}."
            )
        if tokens < 1:
            raise ConfigError(f"form 'rows' needs tokens >= 1 (row slots per datum), got {tokens}.")
        self.tokens = int(tokens)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row."""
        return self.shape[1:]

    @property
    def width(self) -> int:
        """Elements of one row (D)."""
        return self.numel // self.shape[0] if self.shape[0] else 0

    @classmethod
    def plan(cls, info: ParamInfo, **options: Any) -> Form:
        """``rows`` for a parameter whose rule gives sparse rows; the exact factored form
        otherwise (``factors`` for factors, ``full`` for dense). Option: ``tokens``."""
        check_options(cls.name, options, ("tokens",))
        if info.source != "rows":
            from gradlog.forms.factors import FactorsForm

            return FactorsForm.plan(info, **options)
        tokens = options.get("tokens", info.tokens)
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise ConfigError(f"form 'rows' option tokens={tokens!r} must be an integer.")
        form = cls(info.shape, tokens)
        if "tokens" in options:
            form.requested_tokens = tokens
        return form

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> RowsForm:
        f = spec_fields(spec, cls.name, {"tokens": int})
        return cls(f["shape"], f["tokens"])

    def spec(self) -> dict[str, Any]:
        return {"form": self.name, "shape": list(self.shape), "tokens": self.tokens}

    def arrays(self) -> dict[str, ArraySpec]:
        return {
            "index": ArraySpec((self.tokens,), "int64"),
            "values": ArraySpec((self.tokens, *self.row_shape)),
        }

    def encode(self, material: Material) -> Encoded:
        """Distinct rows per datum, padded (or cut after the last used slot) to ``tokens``.

        Raises:
            InputError: the material is not :class:`Rows`, or a datum uses more distinct
                rows than ``tokens``.
        """
        self._check_material(material)
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
                if self.requested_tokens is not None:
                    fix = (
                        f"Raise the form request's own 'tokens' option ({self.requested_tokens}; "
                        "it wins over GradRecorder(..., tokens=N)) to"
                    )
                else:
                    fix = "Plan with tokens="
                raise InputError(
                    f"form 'rows' was provisioned for {self.tokens} rows per datum, but a datum "
                    f"uses {used} distinct rows. {fix} at least the number of indices per datum "
                    "(the context length), or use form 'projection'."
                )
            return {"index": u.index[:, : self.tokens], "values": u.values[:, : self.tokens]}
        pad = self.tokens - n
        if pad == 0:
            return {"index": u.index, "values": u.values}
        index = torch.nn.functional.pad(u.index, (0, pad), value=-1)  # (B, tokens)
        values = u.values.new_zeros((u.values.shape[0], self.tokens, *self.row_shape))
        values[:, :n] = u.values
        return {"index": index, "values": values}

    def _rows(self, encoded: Mapping[str, torch.Tensor]) -> Rows:
        self.check(encoded)
        return Rows(encoded["index"], encoded["values"], self.shape[0])

    def decode(self, encoded: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._rows(encoded).dense()

    def inner(
        self,
        x: Mapping[str, torch.Tensor],
        y: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        rx, ry = self._rows(x), self._rows(y)
        M, K = rx.batch_size, ry.batch_size
        N1, N2 = int(rx.index.shape[1]), int(ry.index.shape[1])
        D = self.width
        out = torch.empty((M, K), dtype=dtype, device=rx.values.device)  # (M, K)
        # chunks whose union of rows keeps (m + k) U D within the budget
        per = max(1, D * (N1 + N2))
        step = max(1, int((MAX_ELEMENTS // per) ** 0.5))
        for i in range(0, M, step):
            for j in range(0, K, step):
                out[i : i + step, j : j + step] = _union_inner(
                    rx.index[i : i + step],
                    rx.values[i : i + step],
                    ry.index[j : j + step],
                    ry.values[j : j + step],
                    D,
                    dtype,
                )
        return out

    def sqnorms(
        self, x: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        r = self._rows(x)
        u = Rows(r.index, r.values.to(dtype), r.num_rows).unique()  # distinct rows per datum
        return u.values.reshape(u.batch_size, -1).square().sum(1)  # (M,)

    def inner_dense(
        self,
        x: Mapping[str, torch.Tensor],
        other: torch.Tensor,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        """``<x_i, W_j> = sum_n values[i, n] . W_j[index[i, n]]``: gathers the stored rows
        from ``other`` (K, V, *row_shape) or (V, *row_shape); never densifies a record."""
        r = self._rows(x)
        w = _as_batch(other, self.shape).to(dtype).reshape(-1, self.shape[0], self.width)
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


def _union_inner(
    ix: torch.Tensor,
    vx: torch.Tensor,
    iy: torch.Tensor,
    vy: torch.Tensor,
    D: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inner products ``(M, K)`` of two sets of sparse-row records (rows of D elements)
    laid out densely over the union of the rows they use."""
    used = torch.cat([ix[ix >= 0], iy[iy >= 0]])  # (n_used,)
    union = torch.unique(used)  # (U,) sorted
    U = int(union.numel())

    def lay_out(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        n = index.shape[0]
        slot = torch.searchsorted(union, index.clamp(min=0))  # (n, N) position in union
        flat = slot + torch.arange(n, device=index.device).unsqueeze(1) * U  # (n, N)
        keep = (index >= 0).reshape(-1)  # (n*N,)
        dense = values.new_zeros((n * U, D), dtype=dtype)  # (n*U, D)
        dense.index_add_(0, flat.reshape(-1)[keep], values.reshape(-1, D)[keep].to(dtype))
        return dense.reshape(n, U * D)  # (n, U*D)

    return lay_out(ix, vx) @ lay_out(iy, vy).T  # (M, K)
