"""The forms of a run's parameters: planned at the first recorded batch, then every batch's
per-datum gradients encoded by them (:mod:`gradlog.forms`, through
:func:`gradlog.planning.encode`) and staged for the writer (:mod:`gradlog.recording.staging`).

Every form, ``full`` included, encodes through its own ``encode_with_norms``: the recorder
knows no form's layout.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from gradlog import planning
from gradlog.backends import PerDatumGrads
from gradlog.config import RecorderConfig, RecordingOptions
from gradlog.forms import Form
from gradlog.grads import batch_size
from gradlog.recording.staging import Staged, stage
from gradlog.recording.state import PendingStep
from gradlog.store.dtypes import INDEX_DTYPE, StorageDtype, storage_dtype

__all__ = ["FormEncoder"]

log = logging.getLogger("gradlog")

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # gradlog/


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from its caller, of the first frame outside gradlog:
    the user's ``backward``, ``step`` or with-block exit."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


class FormEncoder:
    """Plans the forms of the recorded parameters and encodes each batch by them.

    Attributes:
        forms: Parameter -> its form; None until planned (the first recorded backward), or
            the stored forms of a resumed store.
        plan: The plan's bytes table, as logged; None until planned.
    """

    def __init__(
        self,
        config: RecorderConfig,
        options: RecordingOptions,
        params: Mapping[str, torch.Tensor],
        path: str | os.PathLike[str],
    ) -> None:
        self.config = config
        self.options = options
        self.params = params
        self.path = path
        self.storage = storage_dtype(config.dtype)
        self.forms: dict[str, Form] | None = None
        self.plan: str | None = None
        self._planned_records: int | None = None  # records per step of the plan, until checked
        self._dtypes: dict[str, dict[str, StorageDtype]] = {}

    @property
    def bytes_per_record(self) -> int:
        """Stored bytes of one datum's gradients (by the forms once planned, else ``full``)."""
        itemsize = self.storage.itemsize
        if self.forms is not None:
            return sum(f.nbytes_per_record(itemsize) for f in self.forms.values())
        return sum(p.numel() for p in self.params.values()) * itemsize

    def resume(self, specs: Mapping[str, Mapping[str, Any]]) -> None:
        """Take the forms a resumed store holds."""
        self._use(planning.forms_from_specs(specs))

    def _use(self, forms: dict[str, Form]) -> None:
        self.forms = forms
        self._dtypes = {
            name: {
                key: INDEX_DTYPE if array.kind == "int64" else self.storage
                for key, array in form.arrays().items()
            }
            for name, form in forms.items()
        }

    def plan_forms(
        self,
        grads: PerDatumGrads,
        set_forms: Callable[[dict[str, tuple[dict[str, Any], Any]]], None],
    ) -> None:
        """Concrete forms from the first batch's material; log their bytes table and warn
        when the planned steps would not fit on the disk.

        Args:
            grads: The first recorded batch's material.
            set_forms: ``StoreWriter.set_forms``, given parameter -> (form spec, array
                specs) before the forms are used.
        """
        itemsize = self.storage.itemsize
        per_step_records = self.options.records_per_step
        forms = planning.plan(self.config, grads, itemsize=itemsize, tokens=self.options.tokens,
                              records_per_step=per_step_records)
        set_forms({n: (f.spec(), planning.array_specs(f)) for n, f in forms.items()})
        self._use(forms)
        batch = batch_size(next(iter(grads.values()))) if grads else 0
        records = per_step_records or batch  # the step's other micro-batches come later
        self._planned_records = records  # checked when the step commits
        self.plan = planning.plan_table(
            forms, batch=records, itemsize=itemsize, steps=self.options.planned_steps,
            records_from=(
                f"records_per_step={records}" if per_step_records
                else "the first batch's; with gradient accumulation pass records_per_step="
            ),
        )
        log.info("gradlog: forms and bytes per step of %s\n%s", self.path, self.plan)
        self._check_space(records)

    def _check_space(self, records: int) -> None:
        steps = self.options.planned_steps
        if steps is not None:
            planning.check_free_space(self.path, self.bytes_per_record * records * steps)

    def committed(self, pending: PendingStep, *, distributed: bool) -> None:
        """A step committed: the first one checks the records per step the plan assumed."""
        if self._planned_records is None:
            return
        planned, self._planned_records = self._planned_records, None
        if pending.n_records > planned and not distributed:
            self._replan_records(pending, planned)

    def _replan_records(self, pending: PendingStep, planned: int) -> None:
        """The first recorded step held more records than the plan assumed (gradient
        accumulation): correct :attr:`plan` and the projected size, and warn when that
        exceeds ``form_budget``."""
        assert self.forms is not None
        n, itemsize = pending.n_records, self.storage.itemsize
        per_step = self.bytes_per_record * n
        budget = self.config.form_budget
        if budget is not None and per_step > budget:
            why = (
                f"records_per_step={self.options.records_per_step}"
                if self.options.records_per_step else "the first micro-batch's"
            )
            records = f"{planned} record{'s' if planned > 1 else ''}"
            ratio = per_step / max(1, budget)
            warnings.warn(
                f"gradlog: step {pending.step} held {n} records in {pending.n_micro} "
                f"micro-batches, but form_budget={budget:,} (bytes per step) was split over "
                f"{records} ({why}): {ratio:.1f}x the budget per step ({per_step:,} bytes). "
                "The forms are fixed once planned; pass "
                f"GradRecorder(..., records_per_step={n}) (the most records a step holds) in "
                "the next run to split the budget over every record of a step.",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )
        self.plan = planning.plan_table(
            self.forms, batch=n, itemsize=itemsize, steps=self.options.planned_steps,
            records_from=f"step {pending.step} held them",
        )
        log.info("gradlog: forms and bytes per step of %s, corrected\n%s", self.path, self.plan)
        self._check_space(n)

    def encode(self, grads: PerDatumGrads) -> tuple[Staged, dict[str, np.ndarray]]:
        """Each parameter's arrays, staged for the writer, and its exact float64 norms."""
        assert self.forms is not None
        arrays, norms = planning.encode(self.forms, grads)
        staged = stage(arrays, self._dtypes, norms)
        return staged, staged.norms
