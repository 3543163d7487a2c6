"""``norm``: keep only the norm, and the exact norms every form records.

The store keeps the exact norm of every record and parameter in its index, whatever the
form, so the ``norm`` form stores no array at all (0 bytes per record): the parameter is
present in the index only. :func:`sqnorms` computes those exact norms from any material
without materialising factors when the ghost norm is cheaper
(``||g_b^T a_b||^2 = sum((g_b g_b^T) * (a_b a_b^T))``) and from each datum's distinct rows
for sparse rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from gradlog.errors import InputError
from gradlog.forms.base import (
    ArraySpec,
    Encoded,
    Factors,
    Form,
    Material,
    ParamInfo,
    Rows,
    check_options,
    dense_sqnorms,
    spec_fields,
)
from gradlog.forms.factors import factored_sqnorms

__all__ = ["NormForm", "sqnorms"]


def sqnorms(material: Material, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Exact squared norms ``(B,)`` of per-datum gradients given as any material.

    Factors use the (blocked) ghost norm when it is cheaper (few tokens: ``N (p + q) <~ p q``),
    else materialise a few datums at a time; rows sum their distinct rows' squares.
    """
    if isinstance(material, Factors):  # the scale applies to the result: no copy of g
        g, a = material.g, material.a
        if material.mask is not None:  # zero the dropped rows (they may hold anything)
            c = Factors(g, a, material.mask).canonical()
            g, a = c.g, c.a
        out = factored_sqnorms(g, a, dtype=dtype)  # (B,)
        return out.mul_(material.scale**2) if material.scale != 1.0 else out
    if isinstance(material, Rows):
        u = Rows(
            material.index, material.values.to(dtype), material.num_rows, material.scale
        ).unique()
        return u.values.reshape(u.batch_size, -1).square().sum(1)  # (B,)
    return dense_sqnorms(material.reshape(material.shape[0], -1), dtype)  # (B,)


class NormForm(Form):
    """Only the norm, which the index keeps for every form (see the module doc)."""

    name: ClassVar[str] = "norm"
    exact: ClassVar[bool] = False

    @classmethod
    def plan(cls, info: ParamInfo, **options: Any) -> NormForm:
        check_options(cls.name, options, ())
        return cls(info.shape)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> NormForm:
        return cls(spec_fields(spec, cls.name, {})["shape"])

    def spec(self) -> dict[str, Any]:
        return {"form": self.name, "shape": list(self.shape)}

    def arrays(self) -> dict[str, ArraySpec]:
        return {}

    def encode(self, material: Material) -> Encoded:
        self._check_material(material)
        return {}

    def inner(
        self,
        x: Mapping[str, torch.Tensor],
        y: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        raise InputError(
            "form 'norm' keeps only each record's norm (in the index: run.norms()), so inner "
            "products between records cannot be computed. Record the parameter with form "
            "'projection' (estimates) or 'full'/'factors'/'auto' (exact) to compare records."
        )

    def sqnorms(
        self, x: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        raise InputError(
            "form 'norm' stores no array: the exact norms are in the store's "
            "index (run.norms()), computed by gradlog.forms.sqnorms at recording."
        )

    def inner_dense(
        self,
        x: Mapping[str, torch.Tensor],
        other: torch.Tensor,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        return self.inner(x, x, dtype=dtype)
