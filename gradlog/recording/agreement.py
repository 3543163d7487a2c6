"""What the ranks of a distributed run agree on before recording a form: one plan.

Forms are planned at the first recorded batch from its material (which parameters hand over
factors or sparse rows, and how many rows a datum has) and from the records a step holds
(``form_budget`` is split over them). Under torch.distributed each rank sees only its own
batch, so the ranks first agree on the most rows per datum of any rank and on the step's
records (every rank's batch); rank 0 plans with them, and its plan's JSON specs (the same
specs the store keeps) reach the other ranks, which rebuild the forms from them. Projection
seeds, dimensions and ``auto``'s choices are then the same on every rank, and equal what one
process plans for the same global batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gradlog import planning
from gradlog.backends import PerDatumGrads
from gradlog.distributed import Distributed
from gradlog.errors import GradlogError
from gradlog.recording.encoding import FormEncoder

__all__ = ["share_plan"]


def share_plan(
    dist: Distributed,
    encoder: FormEncoder,
    grads: PerDatumGrads,
    records: int,
    set_forms: Callable[[dict[str, tuple[dict[str, Any], Any]]], None],
) -> None:
    """Plan the forms once for every rank (a collective: every rank calls it at its first
    recorded batch).

    Args:
        dist: This process's place in the run.
        encoder: This rank's encoder, planned here.
        grads: This rank's first recorded batch's material.
        records: Records of the step's first round (every rank's batch), over which
            ``form_budget`` is split unless ``records_per_step`` is given.
        set_forms: ``StoreWriter.set_forms``.

    Raises:
        InputError: rank 0's plan failed (on rank 0: its own error).
        GradlogError: on the other ranks, when rank 0's plan failed.
    """
    options = encoder.options
    tokens = dist.max_over_ranks(planning.material_tokens(grads, options.tokens))
    if dist.rank == 0:
        encoder.options = dataclasses.replace(
            options,
            tokens=tokens or options.tokens,
            records_per_step=options.records_per_step or records,
        )
        try:
            encoder.plan_forms(grads, set_forms)
        except Exception as e:
            dist.share_json({"error": f"{type(e).__name__}: {e}"})
            raise
        finally:
            encoder.options = options
        assert encoder.forms is not None
        dist.share_json({"specs": {name: f.spec() for name, f in encoder.forms.items()}})
        return
    shared = dist.share_json(None)
    if "error" in shared:
        raise GradlogError(
            f"rank {dist.rank}: rank 0 could not plan the forms ({shared['error']}); "
            "nothing of this batch was written."
        )
    specs = {name: {"form_spec": spec} for name, spec in shared["specs"].items()}
    forms = planning.forms_from_specs(specs)
    set_forms({name: (f.spec(), planning.array_specs(f)) for name, f in forms.items()})
    encoder.resume(specs)
