"""Replay: whether a module found by what it looks like computes what a rule's formula assumes.

Rules matched by a predicate (transformers' experts and RMSNorm classes, which share no base
class) take a family's forward on trust only after running it once: the first call of each
module (and variant, such as transformers' experts implementation) is run again and its
output compared with the formula's. A module whose output differs keeps the ``torch.func``
re-run, which is right for any forward.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["replays"]

log = logging.getLogger("gradlog")

_SEEN: weakref.WeakKeyDictionary[nn.Module, dict[str, bool]] = weakref.WeakKeyDictionary()


def replays(module: nn.Module, variant: str, theirs: Callable[[], torch.Tensor],
            ours: Callable[[], Iterable[torch.Tensor]], width: int,
            computed_in: torch.dtype = torch.float64) -> bool:
    """Whether the module's forward (``theirs()``, run without grad) gives one of the
    formula's outputs (``ours()``: the candidates, e.g. ``w * x_hat`` and ``(1 + w) *
    x_hat``), to rounding of sums of ``width`` terms in the coarsest of their dtypes and
    ``computed_in`` (transformers' norms compute in float32 whatever their inputs); decided
    once per module and ``variant`` (:func:`_close`)."""
    seen = _SEEN.setdefault(module, {})
    if variant not in seen:
        try:
            with torch.no_grad():
                got = theirs()
                seen[variant] = any(_close(got, c, width, computed_in) for c in ours())
        except Exception as e:  # (a forward that takes other arguments)
            log.debug("gradlog: replay of %s failed (%s)", type(module).__name__, e)
            seen[variant] = False
        if not seen[variant]:
            log.info("gradlog: %s computes something other than its rule's formula; it is "
                     "re-run per datum", type(module).__name__)
    return seen[variant]


def _close(theirs: torch.Tensor, ours: torch.Tensor, width: int,
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
