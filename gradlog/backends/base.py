"""The interface every backend implements.

A backend turns one batch into per-datum gradients ``g_b = d losses[b] / d theta`` of the
selected parameters, and leaves ``p.grad`` of every trainable parameter exactly as the ordinary
backward of the batch loss would. The recorder owns everything else (input checks, reductions,
weights, the self-check, writing), so a new backend only implements these methods.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from gradlog.losses import DeviceChecks

__all__ = [
    "LATE_CHECK_DEVICES",
    "LOW_PRECISION_FLOOR",
    "LOW_PRECISION_RTOL",
    "Backend",
    "LossFn",
    "PerDatumGrads",
    "check_floor",
    "check_tolerance",
    "graph_nodes",
    "is_reentrant_checkpoint",
    "restorable_leaves",
]

_LATE_NOTE = (" (On a GPU the losses are checked after the backward, which used up the "
              "forward's graph: p.grad was set back to None, as it was, and nothing of the "
              "step was recorded. Run the forward again to retry.)")


LATE_CHECK_DEVICES = frozenset({"cuda"})
"""Device types whose loss checks :meth:`Backend.settle_loss_checks` may read after the
backward: those whose kernels run behind the host (on the CPU a read costs no wait)."""


def restorable_leaves(leaves: Iterable[torch.Tensor], device: torch.device | None,
                      own: Callable[[Any], bool] = lambda hook: False,
                      ) -> list[torch.Tensor] | None:
    """The ``leaves`` a backward accumulates into, when setting their ``.grad`` back to None
    undoes it on ``device``, so that the batch's loss checks may be read after it: on CUDA
    (:data:`LATE_CHECK_DEVICES`), every ``.grad`` None (no gradient accumulation), no hook on
    a leaf's gradient but gradlog's own (``own``) and none on its accumulation (an optimizer
    stepping in the backward would act on a refused batch), one process (DDP's reduction
    would have run on the others). Else None."""
    if device is None or device.type not in LATE_CHECK_DEVICES:
        return None
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return None
    out = list(leaves)
    for leaf in out:
        hooks = getattr(leaf, "_backward_hooks", None)
        if (leaf.grad is not None or getattr(leaf, "_post_accumulate_grad_hooks", None)
                or (hooks and not all(own(h) for h in hooks.values()))):
            return None
    return out


LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch)`` returning per-datum ``(B,)`` or per-token ``(B, T)`` losses."""

PerDatumGrads = dict[str, Any]
"""Parameter name -> per-datum gradients ``(B, *param.shape)`` on the parameter's device, or
for parameters in :attr:`Backend.keep_material` possibly their factors or sparse rows
(:class:`gradlog.forms.Factors`, :class:`gradlog.forms.Rows`)."""

LOW_PRECISION_RTOL = 8.0
"""Under autocast, autograd rounds ``p.grad`` of a layer computed in bfloat16/float16 to that
precision (recurrent layers compound it), while rules accumulate per-datum gradients in
float32: checks of ``sum_b w_b g_b`` against ``p.grad`` then allow a relative error of this
many machine epsilons of the narrow dtype (bfloat16: 8 * 2**-7 = 0.0625). Measured under
bfloat16 autocast on the test zoo: at most 1.4e-2 (LSTM), 2e-3 to 5e-3 elsewhere."""

LOW_PRECISION_FLOOR = 2.0
"""Under autocast, the floor of the spot check's tolerance (:func:`check_floor`) in machine
epsilons of the narrow dtype (bfloat16: 2 * 2**-7 = 0.0156 of the largest entry compared), not
:data:`LOW_PRECISION_RTOL`'s 8: the floor only covers entries that are rounding noise of the
other gradients (a key bias under softmax; a tied weight whose uses cancel, one of them rounded
to bfloat16), whose error stays below one epsilon of the largest entry. Measured under CPU
autocast on the test zoo and small Hugging Face models: at most 0.39 bfloat16 and 0.30 float16
epsilons of the largest entry; a GPU's bfloat16 split-K reduction of a weight gradient would
err by at most 0.9 epsilon of it (u * the sum of |terms|, bounded from the zoo's factor
records). 8 epsilons let records off by 1.5x pass on attention weights."""

_CHECK_RTOL = {torch.float64: 1e-7, torch.float32: 1e-3}  # of sum_b w_b |g_b| + |grad|
_CHECK_ATOL = {torch.float64: 1e-12, torch.float32: 1e-7}  # for gradients that are all noise


def check_tolerance(
    dtypes: Iterable[torch.dtype],
    narrow: Iterable[torch.dtype] = (),
    *,
    rtol: float | None = None,
) -> tuple[float, float]:
    """The tolerance of a check of per-datum gradients against autograd's own gradient.

    Every such check (the hooks backend's spot and datum checks, the recorder's self-check)
    takes its tolerance from here, so they agree.

    Args:
        dtypes: The checked parameters' dtypes (at least one); the loosest known one (float32
            before float64) sets the default relative and the absolute tolerance; only
            unknown dtypes (half precision parameters): 1e-2 and 1e-4.
        narrow: Dtypes narrower than the parameters' in which autograd computed (autocast's
            bfloat16 or float16): the relative tolerance is then at least
            :data:`LOW_PRECISION_RTOL` epsilons of the widest-epsilon one.
        rtol: The caller's own relative tolerance (the recorder's ``check_rtol``) in place of
            the dtype's.

    Returns:
        ``(rtol, atol)``: relative to the magnitudes compared, absolute for gradients that
        are rounding noise only.
    """
    dtype = max(dtypes, key=lambda d: _CHECK_RTOL.get(d, 0))
    base = _CHECK_RTOL.get(dtype, 1e-2) if rtol is None else rtol
    eps = [torch.finfo(d).eps for d in narrow]
    if eps:  # autocast: autograd's gradient is rounded (see LOW_PRECISION_RTOL)
        base = max(base, LOW_PRECISION_RTOL * max(eps))
    return base, _CHECK_ATOL.get(dtype, 1e-4)


def check_floor(dtypes: Iterable[torch.dtype], narrow: Iterable[torch.dtype] = ()) -> float:
    """The spot check's floor: its tolerance also allows this share of the largest entry
    compared (entries whose true gradient is 0 hold rounding noise of the others). The
    dtype's relative tolerance (see :func:`check_tolerance`); under autocast at least
    :data:`LOW_PRECISION_FLOOR` epsilons of the widest-epsilon narrow dtype."""
    base = check_tolerance(dtypes)[0]
    eps = [torch.finfo(d).eps for d in narrow]
    return max(base, LOW_PRECISION_FLOOR * max(eps)) if eps else base


def is_reentrant_checkpoint(node: Any) -> bool:
    """Whether autograd node ``node`` is a ``torch.utils.checkpoint(use_reentrant=True)``
    segment (its backward refuses ``autograd.grad`` and hides the parameters inside)."""
    return "CheckpointFunction" in type(node).__name__


def graph_nodes(root: Any, descend: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """Every autograd node reachable from ``root`` (each once).

    Args:
        root: The node to start from (None: no nodes).
        descend: Whether to walk on below a node (default: always); a node it refuses is
            still yielded.
    """
    if root is None:
        return
    stack, seen = [root], {id(root)}
    keep = [root]  # node wrappers alive, so their ids stay unique
    while stack:
        node = stack.pop()
        yield node
        if descend is not None and not descend(node):
            continue
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                keep.append(child)
                stack.append(child)


class Backend(abc.ABC):
    """Computes per-datum gradients of selected parameters.

    Args:
        model: The user's model; never wrapped, renamed or patched.
        params: The parameters to record, by their recorded names.
        batch_reduction: ``"mean"`` or ``"sum"``: ``p.grad`` is the gradient of
            ``losses.mean()`` or ``losses.sum()``.
        randomness: ``torch.func.vmap`` randomness for backends that use it.
    """

    name: ClassVar[str]
    needs_loss_fn: ClassVar[bool] = False
    """True when per-datum gradients need the loss function (``rec.step``), not just losses."""

    def __init__(
        self,
        model: nn.Module,
        params: Mapping[str, nn.Parameter],
        *,
        batch_reduction: str,
        randomness: str,
    ) -> None:
        self.model = model
        self.params = dict(params)
        self.batch_reduction = batch_reduction
        self.randomness = randomness
        self.keep_material: frozenset[str] = frozenset()
        """Set by the recorder: parameters whose form is not ``full``. A backend may return
        their per-datum gradients as factors or sparse rows (the hooks backend does), which
        the forms encode without forming the gradients; others return dense gradients."""
        self.dense_when_fused: frozenset[str] = frozenset()
        """Set by the recorder: weights of :attr:`keep_material` whose calls that take their
        gradient from the records (:attr:`fused_params`) return the dense gradients they
        form anyway; their other calls (under autocast) return factors."""
        self.seed_scale = 1.0
        """Set by the recorder before a backward: the factor its batch loss carries (a
        trainer's loss scale, gradient accumulation's ``1/k``), so ``p.grad`` gets what the
        trainer's own backward would give; per-datum gradients are of the unscaled losses."""
        self.low_precision: dict[str, torch.dtype] = {}
        """Set by each backward: recorded parameter name -> the narrower floating dtype
        (autocast's bfloat16 or float16) in which autograd computed its ``p.grad``. Such a
        ``p.grad`` is rounded to that precision while the per-datum gradients are not (rules
        accumulate in the parameter's dtype), so the recorder's self-check allows for it."""

    @property
    def fused_params(self) -> frozenset[str]:
        """Recorded weights whose gradient is the sum of their records (the hooks backend's
        ``batch_grad="sum"``); none by default."""
        return frozenset()

    datum_check_due: bool = False
    """Set by the recorder on its self-checked batches (``check_every``): a backend that can
    check one datum's own gradient (the hooks backend) does so on them as well."""

    loss_checks: DeviceChecks | None = None
    """Set by the recorder for one backward when :attr:`settles_loss_checks`: the checks of
    the batch's losses still on the device (a NaN loss, ignored labels), which the backward
    must settle before it touches ``p.grad``: late, so that its own work before (graph
    walks) runs while the device finishes the forward. Other backends get them settled."""

    settles_loss_checks: ClassVar[bool] = False

    _late: tuple[DeviceChecks, Callable[[], None] | None, list[torch.Tensor]] | None = None

    def settle_loss_checks(
        self, on_fail: Callable[[], None] | None = None,
        late: Callable[[torch.device], list[torch.Tensor] | None] | None = None,
    ) -> None:
        """Read :attr:`loss_checks` (once); raises the first failed check's error, after
        ``on_fail`` (which undoes what the backward did before: the batch may be retried).

        ``late(device)``: the leaves whose ``.grad`` set back to None undoes the backward
        (:func:`restorable_leaves`), or None. Given them, the checks are left to
        :meth:`settle_late_loss_checks`: read now, on a GPU, the host would wait for the
        whole forward before launching the backward's first kernel (60 ms of GPT-2 small's
        step on an H100)."""
        checks, self.loss_checks = self.loss_checks, None
        if checks is None:
            return
        leaves = late(checks.device) if late is not None and checks.device is not None else None
        if leaves is not None:
            self._late = (checks, on_fail, leaves)
            return
        try:
            checks.settle()
        except BaseException:
            if on_fail is not None:
                on_fail()
            raise

    def settle_late_loss_checks(self) -> None:
        """Read the loss checks :meth:`settle_loss_checks` left for after the backward; when
        one failed, set the leaves' ``.grad`` back to None, as it was before the backward,
        run its ``on_fail`` and raise its error (nothing of the step is recorded)."""
        late, self._late = self._late, None
        if late is None:
            return
        checks, on_fail, leaves = late
        try:
            checks.settle()
        except Exception as e:
            for leaf in leaves:
                leaf.grad = None
            if on_fail is not None:
                on_fail()
            if e.args and isinstance(e.args[0], str):
                e.args = (e.args[0] + _LATE_NOTE, *e.args[1:])
            raise

    defer_checks: bool = False
    """Set by the recorder: the backward may leave its checks' outcome on the device until
    :meth:`settle` (the hooks backend's spot check, its one wait for the device), which
    the recorder calls once the step's records are encoded."""

    def settle(self) -> None:  # noqa: B027 - only backends with deferred checks need it
        """Raise what the last backward's deferred checks found (:attr:`defer_checks`)."""

    def attach(self) -> None:  # noqa: B027 - optional hook for backends that install hooks
        """Called when recording starts."""

    def detach(self) -> None:  # noqa: B027
        """Called when recording ends; must undo everything ``attach`` did."""

    def describe(self) -> dict[str, Any]:
        """JSON facts about how this backend computes gradients, stored in the run's
        attributes under ``backend`` (e.g. which modules fell back to a generic method).
        Called after :meth:`attach`."""
        return {"name": self.name}

    @abc.abstractmethod
    def backward(self, losses: torch.Tensor, batch_loss: torch.Tensor) -> PerDatumGrads:
        """Per-datum gradients of ``losses`` (B,), then the ordinary ``batch_loss.backward()``.

        ``batch_loss`` is ``losses.mean()`` or ``losses.sum()``; its backward accumulates into
        ``p.grad`` exactly as the user's own ``loss.backward()`` would.
        """

    def step(
        self,
        loss_fn: LossFn,
        batch: Any,
        reduce: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
        mask: torch.Tensor | None,
        check: Callable[[torch.Tensor], None],
    ) -> tuple[torch.Tensor, PerDatumGrads]:
        """Compute losses from ``loss_fn(model, batch)``, then as :meth:`backward`.

        ``reduce(raw_losses, mask)`` turns the loss function's output into per-datum losses
        (B,); ``check(losses)`` validates them and must run before ``p.grad`` is touched.
        Returns the per-datum losses (B,) and gradients.
        """
        losses = reduce(loss_fn(self.model, batch), mask)
        check(losses)
        return losses, self.backward(losses, self.reduce_batch(losses))

    def reduce_batch(self, losses: torch.Tensor) -> torch.Tensor:
        """The scalar whose ordinary backward gives ``p.grad``."""
        return losses.mean() if self.batch_reduction == "mean" else losses.sum()
