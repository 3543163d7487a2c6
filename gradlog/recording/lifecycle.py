"""The step lifecycle: which step a call is for, which steps are recorded, the step in
progress (begun at its first recorded micro-batch, committed when the next step begins or the
recorder closes), and the default datum ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradlog.errors import InputError
from gradlog.recording.inputs import INT64_MAX, datum_ids_array
from gradlog.recording.state import PendingStep

__all__ = ["StepLifecycle"]


class StepLifecycle:
    """Step numbering and the step in progress.

    Args:
        every: Record steps with ``step % every == 0``.
        commit: Commits a complete step (the store handoff).
        committed: Called after a step committed (the forms check their plan).
        distributed: Whether several ranks record (their data counts are exchanged).

    Attributes:
        pending: The step being recorded, until committed.
        steps_recorded: Steps committed by this recorder.
        records_written: Records handed to the writer.
    """

    def __init__(
        self,
        every: int,
        commit: Callable[[PendingStep], None],
        committed: Callable[[PendingStep], None],
        *,
        distributed: bool = False,
    ) -> None:
        self.every = every
        self._commit = commit
        self._committed = committed
        self.distributed = distributed
        self.pending: PendingStep | None = None
        self.steps_recorded = 0
        self.records_written = 0
        self._last_step: int | None = None
        self._committed_through: int | None = None  # last step already in a resumed store
        self._next_datum = 0
        # What says the pending step is complete when an exception leaves the block (see
        # complete()): the step the last backward/step call was for, and whether the
        # optimizer stepped after the pending step's last micro-batch.
        self._attempted: int | None = None
        self.optimizer_stepped = False

    def resume(self, last_step: int, next_datum: int) -> None:
        """Continue after a resumed store's last committed step."""
        self._last_step = self._committed_through = last_step
        self._next_datum = next_datum

    def on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An optimizer post-step hook: the pending step's micro-batches are all in."""
        self.optimizer_stepped = True

    # -- begin ------------------------------------------------------------------------------
    def note_attempt(self, step: Any) -> None:
        """The step a backward/step call is for, noted before anything can refuse it."""
        if step is None:
            self._attempted = 0 if self._last_step is None else self._last_step + 1
        elif isinstance(step, (int, np.integer)) and not isinstance(step, bool):
            self._attempted = int(step)

    def resolve(self, step: Any) -> int:
        """The step of a call (default: the previous one + 1), checked; commits the pending
        step when a new one begins.

        Raises:
            InputError: not an int >= 0, already committed, or before the previous step.
        """
        if step is None:
            step = 0 if self._last_step is None else self._last_step + 1
        elif isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise InputError(f"step must be an int, got {type(step).__name__}.")
        return self._begin(int(step))

    def _begin(self, step: int) -> int:
        """``step`` checked against the steps before it; the pending step committed when
        ``step`` is a new one."""
        if not 0 <= step <= INT64_MAX:
            raise InputError(
                f"step must be >= 0 and <= 2**63 - 1 (the store keeps steps as int64), got "
                f"{step}."
            )
        if self._committed_through is not None and step <= self._committed_through:
            raise InputError(
                f"step {step} is already committed in the resumed store (its last committed "
                f"step is {self._committed_through}); continue with step "
                f"{self._committed_through + 1} or later."
            )
        if self._last_step is not None and step < self._last_step:
            raise InputError(
                f"step {step} comes after step {self._last_step}; steps must not decrease. "
                "Repeat the same step to accumulate micro-batches into it."
            )
        if self.pending is not None and self.pending.step == step and self.optimizer_stepped:
            raise InputError(
                f"step {step} already ended: the optimizer stepped after its micro-batches, so "
                f"another micro-batch of it would mix two parameter states in one step. Pass "
                f"step={step + 1} or later (or leave step= out: steps then count themselves). "
                f"Step {step} is kept as it was."
            )
        if self.pending is not None and self.pending.step != step:
            self.commit()  # a new step began: the previous one is complete
        return step

    def records(self, step: int) -> bool:
        """Whether ``step`` is recorded (``every``)."""
        return step % self.every == 0

    def skip(self, step: int, batch: int, datum_ids: Any) -> None:
        """A step not recorded (``every``): the default datum counter still counts its data,
        so that a datum's default id does not depend on ``every`` (one process; under DDP
        the ranks' counts are exchanged only on recorded steps)."""
        self._last_step = step
        if datum_ids is None and not self.distributed:
            self._next_datum += batch

    # -- a recorded micro-batch -------------------------------------------------------------
    def first_micro(self) -> bool:
        """Whether the next recorded micro-batch begins its step."""
        return self.pending is None or self.pending.n_micro == 0

    def datum_ids(self, datum_ids: Any, batch: int, sizes: list[int], offset: int) -> np.ndarray:
        """The batch's datum ids: the given ones, or the next of the running counter.

        Args:
            datum_ids: The caller's, or None.
            batch: This process's batch size.
            sizes: Every rank's batch size, in rank order.
            offset: Counter-numbered ids of the ranks before this one.
        """
        first = self._next_datum + offset
        ids = (
            datum_ids_array(datum_ids, batch)
            if datum_ids is not None
            else np.arange(first, first + batch, dtype=np.int64)
        )
        counted = self._next_datum + (sum(sizes) if datum_ids is None else 0)  # every rank's
        self._next_datum = max(counted, int(ids.max()) + 1)
        return ids

    def micro_index(self, rank: int, world_size: int) -> int:
        """The stored micro-batch index of this call: rank r's m-th call of a step is
        micro-batch ``m * world_size + r``."""
        micro = 0 if self.pending is None else self.pending.n_micro
        return micro * world_size + rank

    def add(
        self,
        step: int,
        rows: tuple[int, int],
        lr: float | None,
        *,
        tokens: int,
        loss_sum: float,
        compute_s: float,
        write_s: float,
    ) -> None:
        """Count a micro-batch written at ``rows`` into its step, beginning the step if new."""
        start, stop = rows
        if self.pending is None:
            self.pending = PendingStep(step=step, first_row=start, lr=lr)
        self.pending.add(records=stop - start, tokens=tokens, loss_sum=loss_sum,
                         compute_s=compute_s, write_s=write_s)
        self.optimizer_stepped = False
        self._last_step = step
        self.records_written += stop - start

    # -- commit -----------------------------------------------------------------------------
    def commit(self) -> None:
        """Commit the pending step, if any."""
        if self.pending is None:
            return
        pending = self.pending
        self._commit(pending)  # on failure the step stays pending
        self.pending = None
        self.steps_recorded += 1
        self._committed(pending)

    def complete(self) -> bool:
        """Whether the step in progress is known to have all its micro-batches: a later step
        was begun (its backward failed, e.g. a NaN loss), or the optimizer stepped after the
        step's last micro-batch. Under DDP never (other ranks may not have finished it)."""
        if self.pending is None:
            return True
        if self.distributed:
            return False
        return (self._attempted is not None and self._attempted != self.pending.step) or (
            self.optimizer_stepped)

    def abandon(self) -> None:
        """Leave the step in progress uncommitted, as after a crash."""
        self.pending = None
