"""``norm``: keep only the norm.

The store keeps the exact norm of every record and parameter in its index, whatever the
form (computed at recording by :func:`gradlog.grads.sqnorms`, without materialising factors
when the ghost norm is cheaper), so the ``norm`` form stores no array at all (0 bytes per
record): the parameter is present in the index only.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from gradlog.errors import InputError
from gradlog.forms.base import ArraySpec, Encoded, Form
from gradlog.grads import Material

__all__ = ["NormForm"]


class NormForm(Form):
    """Only the norm, which the index keeps for every form (see the module doc)."""

    name: ClassVar[str] = "norm"
    exact: ClassVar[bool] = False

    def arrays(self) -> dict[str, ArraySpec]:
        return {}

    def _encode(self, material: Material) -> Encoded:
        return {}

    def _inner(self, x: Encoded, y: Encoded, dtype: torch.dtype) -> torch.Tensor:
        raise InputError(
            "form 'norm' keeps only each record's norm (in the index: run.norms()), so inner "
            "products between records cannot be computed. Record the parameter with form "
            "'projection' (estimates) or 'full'/'factors'/'auto' (exact) to compare records."
        )

    def _sqnorms(self, x: Encoded, dtype: torch.dtype) -> torch.Tensor:
        raise InputError(
            "form 'norm' stores no array: the exact norms are in the store's "
            "index (run.norms()), computed by gradlog.grads.sqnorms at recording."
        )

    def _inner_dense(self, x: Encoded, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._inner(x, x, dtype)
