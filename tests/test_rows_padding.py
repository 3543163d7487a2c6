"""A rule's sparse rows with index -1 are padding (the ``Rows`` contract): they add nothing,
whatever their values hold, to any datum (they once landed in the previous datum's last row)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradlog.grads import Rows
from gradlog.rules import RULES, Capture, register_rule
from gradlog.testing.oracle import assert_like_loop


class PaddedLookup(nn.Module):
    """An embedding whose indices use -1 for "no token" (its output there is zero)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, dim, dtype=torch.float64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = nn.functional.embedding(idx.clamp(min=0), self.weight)  # (B, N, D)
        return out * (idx >= 0).unsqueeze(-1)


@pytest.fixture
def padded_rule():
    @register_rule(PaddedLookup, name="padded_lookup")
    def padded_lookup(module: PaddedLookup, cap: Capture, wanted: frozenset[str]):
        B = cap.batch_size
        index = cap.input.reshape(B, -1)  # (B, N), -1 where padded
        values = cap.grad_output.reshape(B, index.shape[1], -1)  # (B, N, D)
        # padding holds garbage (NaN): the contract says it is ignored whatever it holds
        values = torch.where((index >= 0).unsqueeze(-1), values, torch.nan)
        return {"weight": Rows(index, values, module.weight.shape[0], cap.scale)}

    yield
    del RULES[PaddedLookup]


def test_padding_rows_add_nothing(padded_rule) -> None:
    torch.manual_seed(0)
    model = PaddedLookup(7, 3)
    idx = torch.tensor([[6, -1, 2], [-1, 0, 6], [3, 3, -1]])  # datum 0's last row is 6 (= V-1)
    target = torch.randn(3, 3, 3, dtype=torch.float64)

    def forward() -> torch.Tensor:
        return ((model(idx) - target) ** 2).sum(dim=(1, 2))  # (B,)

    assert_like_loop(model, forward)
