"""What :func:`~gradlog.sparse.sparse_backprop` keeps: the closed sets of ``per`` and
``mode`` values and the validated settings."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gradlog.errors import ConfigError

__all__ = ["MODES", "PER", "SparseSettings", "Where", "type_name"]

PER: dict[str, str] = {
    "token": "each position separately, along the output's last (feature) dimension",
    "datum": "each datum's whole output, flattened (batch on dimension 0)",
    "child": "each autograd node's inputs: the k with the largest gradient (L1 norm) get theirs",
}
"""The closed set of ``per=`` values: which entries compete for the k places of a row."""

MODES: dict[str, str] = {
    "masked": "dense backward of the masked gradient (the semantics, no speed-up)",
    "compact": "nn.Linear backward from the kept entries only (meProp); other modules masked",
}
"""The closed set of ``mode=`` values."""

Where = str | type | Sequence[str | type] | None


def type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


@dataclass(frozen=True)
class SparseSettings:
    """What :func:`sparse_backprop` keeps, validated.

    Attributes:
        k: Entries kept per row (exclusive with ``fraction``).
        fraction: Share of a row's entries kept, ``ceil(fraction * n)`` (at least 1).
        per: Rows: ``"token"`` or ``"datum"`` (see :data:`PER`).
        mode: ``"masked"`` or ``"compact"`` (see :data:`MODES`).
        where: The module patterns, as strings (classes by qualified name).
    """

    k: int | None = None
    fraction: float | None = None
    per: str = "token"
    mode: str = "masked"
    where: tuple[str, ...] = field(default=(type_name(nn.Linear),))

    def __post_init__(self) -> None:
        if self.k is not None and self.fraction is not None:
            raise ConfigError(
                f"sparse_backprop got both k={self.k!r} and fraction={self.fraction!r}; pass "
                "one of them: k=<entries kept per row> or fraction=<share of a row kept>."
            )
        if self.k is None and self.fraction is None:
            raise ConfigError(
                "sparse_backprop needs how much to keep: pass k=<int >= 1> (entries kept per "
                "row) or fraction=<float in (0, 1]> (share of a row kept)."
            )
        if self.k is not None and (
            isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1
        ):
            raise ConfigError(
                f"sparse_backprop k must be an int >= 1 (entries kept per row), got {self.k!r};"
                " pass e.g. k=32, or fraction=0.05 for a share of each row."
            )
        if self.fraction is not None:
            bad = isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float))
            if bad or not 0.0 < float(self.fraction) <= 1.0:
                raise ConfigError(
                    f"sparse_backprop fraction must be a number in (0, 1] (the share of each "
                    f"row's entries kept), got {self.fraction!r}; pass e.g. fraction=0.05, or "
                    "k=<int> for a fixed count."
                )
        if self.per not in PER:
            raise ConfigError(
                f"sparse_backprop per={self.per!r} is not one of {sorted(PER)}; pass "
                "per='token' (each position's features) or per='datum' (the whole datum)."
            )
        if self.mode not in MODES:
            raise ConfigError(f"sparse_backprop mode={self.mode!r} is not one of {sorted(MODES)}.")
        if self.per == "child" and self.mode != "masked":
            raise ConfigError(
                f"sparse_backprop per='child' chooses whole input gradients at each autograd "
                f"node, so it has no compact backward: drop mode={self.mode!r} (or pass "
                "mode='masked')."
            )

    def k_for(self, n: int) -> int:
        """Entries kept of a row of ``n`` (``n`` or more: the whole row)."""
        if self.k is not None:
            return self.k
        assert self.fraction is not None  # __post_init__ guarantees one of them
        # round() first: 0.05 * 100 is 5.000000000000001 in binary floating point.
        return max(1, math.ceil(round(self.fraction * n, 9)))

    def to_json(self) -> dict[str, Any]:
        """JSON form (stored in the run's attributes)."""
        return {
            "k": self.k,
            "fraction": None if self.fraction is None else float(self.fraction),
            "per": self.per,
            "mode": self.mode,
            "where": list(self.where),
        }

