"""``topk``: the k largest-magnitude entries of each per-datum gradient.

Arrays: ``values`` (records, k) in the storage dtype, signed, in decreasing magnitude, and
``index`` (records, k) int64, their flat positions in the parameter (row-major). ``k (s +
8)`` bytes per record for ``s``-byte floats. Reading rebuilds the sparse gradient (zeros
elsewhere); inner products and norms are those of the kept entries.

Ties: every kept entry's magnitude is >= every dropped entry's. Among entries of equal
magnitude at the cut, which are kept is ``torch.topk``'s choice (not specified, and may
differ between devices); ``k`` at least the parameter's size keeps everything. A gradient
with fewer than k non-zero entries keeps zeros at distinct indices.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from gradlog.errors import ConfigError
from gradlog.forms.base import ArraySpec, Encoded, Form, ParamInfo, check_options
from gradlog.grads import MAX_ELEMENTS, Material, chunks, dense_sqnorms

__all__ = ["TopKForm"]


class TopKForm(Form):
    """The k largest-magnitude entries per datum (see the module doc).

    Args:
        shape: The parameter's shape.
        k: Entries kept per datum, 1 <= k <= numel.
    """

    name: ClassVar[str] = "topk"
    exact: ClassVar[bool] = False
    norms_apart: ClassVar[bool] = False  # its top-k pass takes the norms
    settings: ClassVar[dict[str, type]] = {"k": int}

    def __init__(self, shape: tuple[int, ...], k: int) -> None:
        super().__init__(shape)
        if not 1 <= k <= max(1, self.numel):
            raise ConfigError(
                f"form 'topk' needs 1 <= k <= {self.numel} (the parameter's size) "
                f"for shape {self.shape}, got k={k}."
            )
        self.k = int(k)

    @classmethod
    def plan(cls, info: ParamInfo, **options: Any) -> TopKForm:
        """Options: ``k`` (entries per datum) or ``fraction`` (``k = ceil(fraction *
        numel)``); either is capped at the parameter's size. Default: ``fraction=0.01``."""
        check_options(cls.name, options, ("k", "fraction"))
        k, fraction = options.get("k"), options.get("fraction")
        if k is not None and fraction is not None:
            raise ConfigError("form 'topk' takes k= or fraction=, not both.")
        if k is None:
            fraction = 0.01 if fraction is None else fraction
            if (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)
                    or not 0 < fraction <= 1):
                raise ConfigError(f"form 'topk' fraction={fraction!r} must be in (0, 1].")
            k = math.ceil(fraction * info.numel)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"form 'topk' k={k!r} must be an integer >= 1.")
        return cls(info.shape, max(1, min(k, info.numel)))

    def arrays(self) -> dict[str, ArraySpec]:
        return {"values": ArraySpec((self.k,)), "index": ArraySpec((self.k,), "int64")}

    def _encode(self, material: Material) -> Encoded:
        """Top-k of each datum's gradient; factors and rows are materialised a few datums at
        a time (at most :data:`~gradlog.grads.MAX_ELEMENTS` elements)."""
        return self._encode_with_norms(material, torch.float64)[0]

    def _encode_with_norms(
        self, material: Material, dtype: torch.dtype
    ) -> tuple[Encoded, torch.Tensor]:
        """Top-k and exact norms from the same materialised chunks."""
        values, index, norms = [], [], []
        for _, d in chunks(material):
            flat = d.reshape(d.shape[0], self.numel)  # (b, numel)
            idx = flat.abs().topk(self.k, dim=1, sorted=True).indices  # (b, k)
            index.append(idx)
            values.append(flat.gather(1, idx))  # (b, k)
            norms.append(dense_sqnorms(flat, dtype))  # (b,)
        return {"values": torch.cat(values), "index": torch.cat(index)}, torch.cat(norms)

    def _decode(self, x: Encoded) -> torch.Tensor:
        """The sparse gradients: kept entries in place, zeros elsewhere ``(M, *shape)``."""
        vals = x["values"]
        out = vals.new_zeros((vals.shape[0], self.numel))  # (M, numel)
        out.scatter_(1, x["index"], vals)
        return out.reshape(vals.shape[0], *self.shape)

    def _inner(self, x: Encoded, y: Encoded, dtype: torch.dtype) -> torch.Tensor:
        iy, vy = y["index"], y["values"].to(dtype)  # (K, k)
        m = x["values"].shape[0]
        out = vy.new_empty((m, iy.shape[0]))  # (M, K)
        step = max(1, MAX_ELEMENTS // max(1, self.numel + iy.numel()))
        for i in range(0, m, step):
            part = {key: t[i : i + step] for key, t in x.items()}
            dx = self._decode(part).to(dtype).reshape(-1, self.numel)  # (b, numel)
            picked = dx[:, iy]  # (b, K, k): x's entries at y's kept positions
            out[i : i + dx.shape[0]] = torch.einsum("bkj,kj->bk", picked, vy)  # (b, K)
        return out

    def _sqnorms(self, x: Encoded, dtype: torch.dtype) -> torch.Tensor:
        v = x["values"].to(dtype)  # (M, k)
        return torch.einsum("mk,mk->m", v, v)  # (M,)

    def _inner_dense(self, x: Encoded, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``<x_i, W_j>`` from the kept entries only: gathers them from ``other``."""
        w = other.to(dtype).reshape(-1, self.numel)  # (K, numel)
        picked = w[:, x["index"]]  # (K, M, k)
        return torch.einsum("kmj,mj->mk", picked, x["values"].to(dtype))  # (M, K)
