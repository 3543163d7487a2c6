"""The self-check: ``sum_b w_b g_b == p.grad`` on the first recorded step and every N-th.

A mismatch means per-datum gradients are silently wrong (a layer that couples datums, an
in-place change of a parameter, a backend bug), so it is a loud error naming the parameter,
raised before anything of the batch is written.

Under torch.distributed each rank holds its own records: the weighted sums are summed over
ranks (one ``all_reduce``) on checked steps only, and an FSDP2 ``p.grad`` (a DTensor shard)
is gathered whole for the comparison. Inside FSDP2's ``set_requires_gradient_sync(False)``
``p.grad`` does not change, so the sums are carried to the micro-batch that reduces.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gradlog._torch_private import tensor_hooks
from gradlog.backends import PerDatumGrads
from gradlog.backends.base import check_tolerance
from gradlog.distributed import Distributed, dense
from gradlog.errors import GradientCheckError
from gradlog.grads import Factors, Material, batch_size, batch_sum, sqnorms

__all__ = ["SelfCheck", "weighted_sum"]


def weighted_sum(material: Material, weight: float) -> torch.Tensor:
    """``weight * sum_b g_b`` of any material (dense: as before forms, bitwise)."""
    if isinstance(material, torch.Tensor):
        return material.detach().sum(0) * weight
    device = material.held[0].device if isinstance(material, Factors) else material.values.device
    weights = torch.full((batch_size(material),), weight, dtype=torch.float64, device=device)
    return batch_sum(material, weights)


class SelfCheck:
    """Compares the weighted sum of each parameter's per-datum gradients with what the
    backward added to its ``p.grad``.

    Args:
        params: The recorded parameters, by name.
        every: Check the first recorded step and every N-th after it (0: never).
        rtol: Relative tolerance on the norm of the difference.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], every: int, rtol: float) -> None:
        self.params = params
        self.every = every
        self.rtol = rtol
        self.n_checked = 0
        # FSDP2 without gradient sync: the weighted sums so far and p.grad before them,
        # until a micro-batch of the step reduces into p.grad
        self._carry: list[torch.Tensor] | None = None
        self._carry_before: Mapping[str, torch.Tensor | None] = {}

    def due(self, steps_recorded: int, first_micro: bool) -> bool:
        """Whether the batch about to be recorded is checked: only a step's first
        micro-batch (``p.grad`` then holds only its gradient past the snapshot)."""
        if self.every == 0:
            return False
        if self._carry is not None:
            if not first_micro:
                return True  # the step's micro-batches until one reduces into p.grad
            self._carry = None  # the step ended without reducing: nothing to compare
        due = self.n_checked == 0 or steps_recorded % self.every == 0
        return due and first_micro

    def snapshot(self) -> dict[str, torch.Tensor | None]:
        """``p.grad`` before the backward (it may hold earlier accumulated gradients)."""
        return {
            n: None if p.grad is None else p.grad.detach().clone() for n, p in self.params.items()
        }

    def verify(
        self,
        before: Mapping[str, torch.Tensor | None],
        grads: PerDatumGrads,
        weight: float,
        dist: Distributed | None,
        low_precision: Mapping[str, torch.dtype],
    ) -> None:
        """Check every parameter after the backward.

        Args:
            before: :meth:`snapshot` before the backward.
            grads: The batch's per-datum gradients.
            weight: Each record's weight ``w_b``.
            dist: This process's place in a distributed run (each rank holds its own
                records), or None.
            low_precision: Parameters whose ``p.grad`` autograd rounded to a narrow dtype
                (autocast), and that dtype.

        Raises:
            GradientCheckError: a parameter without ``.grad``, or one whose sum differs.
        """
        totals = [weighted_sum(grads[name], weight) for name in self.params]
        if self._carry is not None:  # earlier micro-batches of the step, not yet reduced
            totals = [a + b for a, b in zip(self._carry, totals)]
            before = self._carry_before
            self._carry = None
        if dist is not None and dist.fsdp is not None and not dist.syncing():
            self._carry, self._carry_before = totals, before  # p.grad is left as it was
            return
        self.n_checked += 1
        results = []  # (name, error, own scale, dtype)
        if dist is not None:  # this rank holds its own records only
            if dist.syncing():
                totals = dist.sum_over_ranks(totals)
            else:  # DDP.no_sync(): p.grad is this rank's own, not yet averaged
                totals = [t * dist.world_size for t in totals]
        for name, p, total in zip(self.params, self.params.values(), totals):
            prior = before[name]
            if p.grad is None:  # the loss did not depend on it at this batch (a task head
                # another batch uses, a mask token): autograd's gradient is 0, and so must
                # every record be (not only their sum)
                if bool((sqnorms(grads[name]) != 0).any()):
                    raise GradientCheckError(
                        f"self-check failed for {name!r}: it has no .grad after the backward "
                        "(the loss did not use it at this batch), yet some of its per-datum "
                        "gradients are not zero (a backend bug: compare with "
                        "backend='loop'). Nothing of this batch was written.")
                delta = torch.zeros_like(total)
            else:  # FSDP2: p.grad is this rank's shard (a DTensor); compare whole tensors
                delta = dense(p.grad.detach()) - (0 if prior is None else dense(prior))
            # NaN/inf in p.grad (an overflow a loss scaler skips): nothing to compare there.
            # NaN/inf in the records where p.grad is finite: wrong (a NaN err passes `>`).
            finite = delta.isfinite()
            diff = torch.where(finite, delta - total, 0).double()
            if not bool(diff.isfinite().all()):
                raise GradientCheckError(
                    f"self-check failed for {name!r}: its per-datum gradients hold NaN or inf "
                    "where p.grad is finite, so they are wrong (a backend bug: compare with "
                    "backend='loop'). Nothing of this batch was written."
                )
            err = float(torch.linalg.vector_norm(diff))
            scale = float(torch.linalg.vector_norm(torch.where(finite, delta, 0).double()))
            results.append((name, err, scale, p.dtype))
        # Rounding error follows the size of the intermediate values, not of the result: a
        # gradient that is analytically zero (attention key biases) is pure rounding noise of
        # the model's other gradients. So the floor scales with the largest gradient.
        largest = max((scale for _, _, scale, _ in results), default=0.0)
        for name, err, scale, dtype in results:
            floor = 1e3 * torch.finfo(dtype).eps * largest
            # autocast: autograd rounded p.grad to bfloat16/float16
            narrow = (low_precision[name],) if name in low_precision else ()
            rtol, _ = check_tolerance((dtype,), narrow, rtol=self.rtol)
            if err > rtol * scale + floor:
                raise GradientCheckError(
                    f"self-check failed for {name!r}: the weighted sum of per-datum gradients "
                    f"differs from p.grad by {err:.3g} (|p.grad| {scale:.3g}, rtol "
                    f"{rtol:.3g}). Per-datum gradients of this parameter are wrong, or "
                    "rounded apart. Likely causes: a layer that mixes datums (batch "
                    "statistics, a batch-level loss term), an in-place change of the parameter "
                    "during the step, a backend bug (compare with backend='loop'), or, where "
                    "|p.grad| is tiny next to the model's other gradients, a model computing in "
                    "a lower precision than its parameters (a float32 softmax in a float64 "
                    "model: its rounding shows on gradients that are analytically zero; "
                    "check_every=0 skips this check). Nothing of this batch was written."
                    + _hooked_hint(name, self.params[name])
                )


def _hooked_hint(name: str, p: torch.Tensor) -> str:
    """What a gradient hook of the user's on ``p`` does to this check, if it has one."""
    theirs = [h for h in tensor_hooks(p)
              if not getattr(getattr(h, "func", h), "__module__", "").startswith("gradlog")]
    return (f" {name!r} has gradient hooks of yours (Tensor.register_hook): they change "
            "p.grad, not the records (each datum's gradient of its loss); a hook that scales "
            "or clips it fails this check. Remove them while recording, or check_every=0."
            if theirs else "")
