"""``full``: the per-datum gradient itself, one array ``grad`` of ``(records, *shape)``.

What gradlog stored before forms existed, and the reference every other form is measured
against (bytes, cost, accuracy). Exact; any parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from gradlog.forms.base import (
    ArraySpec,
    Encoded,
    Form,
    Material,
    ParamInfo,
    check_options,
    dense,
    dense_sqnorms,
    spec_fields,
)

__all__ = ["FullForm"]


class FullForm(Form):
    """The whole per-datum gradient (see the module doc)."""

    name: ClassVar[str] = "full"
    exact: ClassVar[bool] = True

    @classmethod
    def plan(cls, info: ParamInfo, **options: Any) -> FullForm:
        check_options(cls.name, options, ())
        return cls(info.shape)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> FullForm:
        return cls(spec_fields(spec, cls.name, {})["shape"])

    def spec(self) -> dict[str, Any]:
        return {"form": self.name, "shape": list(self.shape)}

    def arrays(self) -> dict[str, ArraySpec]:
        return {"grad": ArraySpec(self.shape)}

    def encode(self, material: Material) -> Encoded:
        self._check_material(material)
        return {"grad": dense(material)}

    def encode_with_norms(
        self, material: Material, *, dtype: torch.dtype = torch.float64
    ) -> tuple[Encoded, torch.Tensor]:
        enc = self.encode(material)
        return enc, dense_sqnorms(enc["grad"].reshape(enc["grad"].shape[0], -1), dtype)

    def decode(self, encoded: Mapping[str, torch.Tensor]) -> torch.Tensor:
        self.check(encoded)
        return encoded["grad"]

    def inner(
        self,
        x: Mapping[str, torch.Tensor],
        y: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        self.check(x)
        self.check(y)
        gx = x["grad"].reshape(x["grad"].shape[0], -1).to(dtype)  # (M, n)
        gy = y["grad"].reshape(y["grad"].shape[0], -1).to(dtype)  # (K, n)
        return gx @ gy.T  # (M, K)

    def sqnorms(
        self, x: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        self.check(x)
        return dense_sqnorms(x["grad"].reshape(x["grad"].shape[0], -1), dtype)  # (M,)
