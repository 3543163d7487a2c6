"""``full``: the per-datum gradient itself, one array ``grad`` of ``(records, *shape)``.

What gradlog stored before forms existed, and the reference every other form is measured
against (bytes, cost, accuracy). Exact; any parameter.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from gradlog.forms.base import ArraySpec, Encoded, Form
from gradlog.grads import Material, dense, dense_sqnorms

__all__ = ["FullForm"]


def _flat(x: Encoded, dtype: torch.dtype) -> torch.Tensor:
    return x["grad"].reshape(x["grad"].shape[0], -1).to(dtype)  # (M, numel)


class FullForm(Form):
    """The whole per-datum gradient (see the module doc)."""

    name: ClassVar[str] = "full"
    exact: ClassVar[bool] = True

    def arrays(self) -> dict[str, ArraySpec]:
        return {"grad": ArraySpec(self.shape)}

    def _encode(self, material: Material) -> Encoded:
        return {"grad": dense(material)}

    def _encode_with_norms(
        self, material: Material, dtype: torch.dtype
    ) -> tuple[Encoded, torch.Tensor]:
        enc = self._encode(material)
        return enc, dense_sqnorms(enc["grad"].reshape(enc["grad"].shape[0], -1), dtype)

    def _decode(self, x: Encoded) -> torch.Tensor:
        return x["grad"]

    def _inner(self, x: Encoded, y: Encoded, dtype: torch.dtype) -> torch.Tensor:
        return _flat(x, dtype) @ _flat(y, dtype).T  # (M, K)

    def _sqnorms(self, x: Encoded, dtype: torch.dtype) -> torch.Tensor:
        return dense_sqnorms(x["grad"].reshape(x["grad"].shape[0], -1), dtype)  # (M,)
