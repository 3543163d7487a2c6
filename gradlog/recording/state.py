"""The typed state of a recording: the step in progress, until it commits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PendingStep"]


@dataclass
class PendingStep:
    """A recorded step whose micro-batches are still being written; committed when the next
    step begins or the recorder closes.

    Attributes:
        step: The optimizer step.
        first_row: Row of the step's first record.
        lr: The learning rate of its first micro-batch (None: not given).
        n_records: Records so far (every micro-batch of this process).
        n_micro: ``backward``/``step`` calls so far.
        tokens: Tokens counted (unmasked tokens; one per datum for ``(B,)`` losses).
        loss_sum: Sum of the per-datum losses.
        time_compute_s: Seconds in the backward and the checks.
        time_write_s: Seconds encoding and handing the records to the writer.
    """

    step: int
    first_row: int
    lr: float | None
    n_records: int = 0
    n_micro: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    time_compute_s: float = 0.0
    time_write_s: float = 0.0

    def add(
        self, *, records: int, tokens: int, loss_sum: float, compute_s: float, write_s: float
    ) -> None:
        """Count one micro-batch in."""
        self.n_records += records
        self.n_micro += 1
        self.tokens += tokens
        self.loss_sum += loss_sum
        self.time_compute_s += compute_s
        self.time_write_s += write_s

    def row(self) -> dict[str, Any]:
        """The step's row of the per-step table, as ``StoreWriter.commit`` takes it."""
        return {
            "step": self.step,
            "first_row": self.first_row,
            "n_records": self.n_records,
            "n_micro": self.n_micro,
            "tokens": self.tokens,
            "lr": self.lr,
            "time_compute_s": self.time_compute_s,
            "time_write_s": self.time_write_s,
            "loss_mean": self.loss_sum / max(1, self.n_records),
        }
