"""Replay: whether a module found by what it looks like computes what a rule's formula assumes.

Rules matched by a predicate (transformers' experts and RMSNorm classes, which share no base
class) take a family's forward on trust only after running it once: the first call of each
module (and variant, such as transformers' experts implementation) is run again and its
output compared with the formula's. A module whose output differs keeps the ``torch.func``
re-run, which is right for any forward.

The comparison runs in float32 at least (a copy of 16-bit weights, or float64 probes): in 16
bits a correct forward rounds as much as a formula a few percent off. A 16-bit module is
then also run as it is, on the call, and compared with the formula in aggregate (``own``):
a forward that computes otherwise only in 16 bits is seen down to a few bf16 epsilons.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = ["close", "replayed_otherwise", "replays"]

log = logging.getLogger("gradlog")

_SEEN: weakref.WeakKeyDictionary[nn.Module, dict[str, bool]] = weakref.WeakKeyDictionary()
_OWN_EPS = 2.0
"""A 16-bit forward's tolerance against the formula, in its dtype's epsilons, in aggregate
(``||own - formula|| / ||formula||``): the experts of transformers' 67 families and their
RMSNorm classes measured at most 0.7 and 0.3 bf16 epsilons (CHANGELOG); a forward 3% off
(4 bf16 epsilons) is refused."""

Own = tuple[Callable[[], torch.Tensor], Callable[[], Sequence[torch.Tensor]]]
"""The module's forward on the call as it runs (its 16-bit dtype), and the formula's
candidates on the same call in float32 (in ``ours``' order)."""


def replays(module: nn.Module, variant: str, theirs: Callable[[], torch.Tensor],
            ours: Callable[[], Iterable[torch.Tensor]], width: int,
            computed_in: torch.dtype = torch.float64, own: Own | None = None) -> bool:
    """Whether the module's forward (``theirs()``, run without grad) gives one of the
    formula's outputs (``ours()``: the candidates, e.g. ``w * x_hat`` and ``(1 + w) *
    x_hat``), to rounding of sums of ``width`` terms in the coarsest of their dtypes and
    ``computed_in`` (transformers' norms compute in float32 whatever their inputs), and, where
    ``own`` gives a 16-bit output, whether that is the same candidate to :data:`_OWN_EPS`;
    decided once per module and ``variant`` (:func:`close`)."""
    seen = _SEEN.setdefault(module, {})
    if variant not in seen:
        try:
            with torch.no_grad():
                got = theirs()
                matched = [k for k, c in enumerate(ours()) if close(got, c, width, computed_in)]
                seen[variant] = bool(matched) and (own is None or _near(own, matched[0]))
        except Exception as e:  # (a forward that takes other arguments)
            log.debug("gradlog: replay of %s failed (%s)", type(module).__name__, e)
            seen[variant] = False
        if not seen[variant]:
            log.info("gradlog: %s computes something other than its rule's formula; it is "
                     "re-run per datum", type(module).__name__)
    return seen[variant]


def replayed_otherwise(module: nn.Module) -> bool:
    """Whether a replay of ``module`` found it computing something else than its rule's
    formula (it is then re-run per datum, like a module without a rule)."""
    return any(not ok for ok in _SEEN.get(module, {}).values())


def _near(own: Own, k: int) -> bool:
    """Whether the module's own 16-bit output is the formula's candidate ``k`` to
    :data:`_OWN_EPS` of its dtype, in aggregate (wider outputs: the replay decided)."""
    got = own[0]()
    if not got.is_floating_point() or torch.finfo(got.dtype).bits > 16:
        return True
    ref = own[1]()[k].to(torch.float64)
    if got.shape != ref.shape:
        return False
    err = (got.to(torch.float64) - ref).norm()
    return bool(err <= _OWN_EPS * torch.finfo(got.dtype).eps * ref.norm())


def close(theirs: torch.Tensor, ours: torch.Tensor, width: int,
           computed_in: torch.dtype) -> bool:
    """Element by element, to rounding of sums of ``width`` terms (relative to the element,
    and to the outputs' root mean square where terms cancel). Never in 16 bits: there the
    rounding of a correct forward is as large as a formula a few percent off (a norm
    scaled by 1.05), so a module whose parameters are 16-bit keeps the re-run."""
    if theirs.shape != ours.shape or not theirs.is_floating_point():
        return False
    coarse = max(theirs.dtype, ours.dtype, computed_in, key=lambda d: torch.finfo(d).eps)
    if torch.finfo(coarse).bits <= 16:
        return False
    tol = 64 * torch.finfo(coarse).eps * math.sqrt(max(width, 1))
    a, b = theirs.to(torch.float64), ours.to(torch.float64)
    rms = b.square().mean().sqrt() if b.numel() else b.new_zeros(())
    return bool(((a - b).abs() <= tol * (b.abs() + rms)).all())
