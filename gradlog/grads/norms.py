"""Exact squared norms of per-datum gradients: every element squared and summed in float64,
as the store's format requires of every record's norm (FORMAT.md)."""

from __future__ import annotations

import threading

import torch

__all__ = [
    "DEVICE_SCRATCH_ELEMENTS",
    "ONE_PASS_DEVICES",
    "SCRATCH_ELEMENTS",
    "SMALL_ELEMENTS",
    "dense_sqnorms",
    "float64_sqnorms",
    "norm_scratch",
    "stacked_sqnorms",
]


SCRATCH_ELEMENTS = {"cpu": 1 << 20}
"""float64 elements of :func:`float64_sqnorms`'s block buffer, by device type: 8 MiB on the
CPU, one buffer per thread kept between calls (:func:`_cpu_scratch`); elsewhere (CUDA)
:data:`DEVICE_SCRATCH_ELEMENTS`. On the CPU every op wakes the OpenMP
pool, a cost of its own when it sleeps between ops (``OMP_WAIT_POLICY=PASSIVE``): blocks of
``1 << 18`` took the small GPT's ``norm`` step from 1.65x a plain step to 1.75x, and the
norms alone (the hand-written floor) from 1.33x to 1.46x (tests/benchmarks/RESULTS.md)."""


DEVICE_SCRATCH_ELEMENTS = 1 << 25
"""The block buffer's float64 elements on a GPU (256 MiB at most, and no larger than the
input needs; gradlog's bound on intermediate tensors, ``MAX_ELEMENTS``): most records are one
block. Blocks of ``1 << 22`` made GPT-2 small's ``norm`` step launch ~280 blocks of 4 ops on
an H100, 44 ms of host time that the device waited out (tests/benchmarks/RESULTS.md)."""


SMALL_ELEMENTS = 1 << 14
"""Up to this many elements (128 KiB widened: heap memory that malloc reuses, not fresh pages)
:func:`float64_sqnorms` widens the whole input at once: a step of the small GPT has 22 such
parameters, where the blocked loop's own calls cost more than its arithmetic."""


ONE_PASS_DEVICES = frozenset({"cuda", "cpu"})
"""Device types where :func:`float64_sqnorms` takes each widened block's squared norms in one
``vector_norm`` pass, not ``square_`` then ``sum`` (two more passes over float64 in GPU
memory: 20 of the 230 ms of a ~1B Llama's ``norm`` step on an H200, with the widening copy
15 more; on the CPU one op fewer per block, measured 1-2% of the small GPT's ``norm`` step)."""


def norm_scratch(device: torch.device) -> torch.Tensor:
    """A block buffer for :func:`float64_sqnorms` on ``device``, to share between calls."""
    return torch.empty(SCRATCH_ELEMENTS.get(device.type, DEVICE_SCRATCH_ELEMENTS),
                       dtype=torch.float64, device=device)


def float64_sqnorms(flat: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Squared norms ``(B,)`` of the rows of ``flat`` (B, n), every element squared and summed
    in float64: the store's exact norms (FORMAT.md). Columns are widened a block at a time
    into ``scratch`` (float64, on ``flat``'s device; made if None or too small), never the
    whole tensor: widening a whole medium-GPT step of float32 gradients at once wrote 844
    MiB of fresh memory and took ~8x longer on a CPU (measured: 36.7 vs 4.7 ms per 32 MiB),
    and on a GPU would double the step's gradient memory."""
    if flat.dtype == torch.float64:
        return flat.square().sum(1)  # (B,)
    if flat.numel() <= SMALL_ELEMENTS:  # a bias or a norm's weight: one widened copy, no loop
        return flat.to(torch.float64).square_().sum(1)  # (B,)
    B, n = flat.shape
    per = SCRATCH_ELEMENTS.get(flat.device.type, DEVICE_SCRATCH_ELEMENTS)
    cols = max(1, per // max(1, B))
    width = B * min(cols, n)
    if scratch is None and flat.device.type == "cpu":
        scratch = _cpu_scratch(width)
    if (scratch is None or scratch.numel() < width or scratch.dtype != torch.float64
            or scratch.device != flat.device):
        scratch = torch.empty(width, dtype=torch.float64, device=flat.device)
    starts = range(0, n, cols)
    if flat.device.type in ONE_PASS_DEVICES:
        # each block's float64 norms into a row of their own, squared and summed once: two
        # ops a block (the root squared back: 1 ulp of float64)
        roots = torch.empty((len(starts), B), dtype=torch.float64, device=flat.device)
        for i, start in enumerate(starts):
            block = flat[:, start : start + cols]  # (B, c)
            wide = scratch[: block.numel()].view(block.shape)  # (B, c)
            wide.copy_(block)
            torch.linalg.vector_norm(wide, dim=1, out=roots[i])
        return roots.square_().sum(0) if len(starts) > 1 else roots[0].square_()  # (B,)
    out = torch.zeros(B, dtype=torch.float64, device=flat.device)  # (B,)
    for start in starts:
        block = flat[:, start : start + cols]  # (B, c)
        wide = scratch[: block.numel()].view(block.shape)  # (B, c)
        wide.copy_(block)
        out.add_(wide.square_().sum(1))
    return out


_held = threading.local()


def _cpu_scratch(width: int) -> torch.Tensor:
    """This thread's float64 block buffer on the CPU, kept between calls: a fresh one a call
    came from the kernel's zeroed pages each time (malloc hands blocks this large back), and
    the widening copy into it took 2-5x as long as into one reused (profiled in a ``norm``
    step of the small GPT)."""
    held = getattr(_held, "scratch", None)
    if held is None or held.numel() < width:
        with torch.inference_mode(False):  # made in inference mode, it could not be written out
            held = _held.scratch = torch.empty(width, dtype=torch.float64)
    return held


def dense_sqnorms(flat: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Squared norms ``(B,)`` of the rows of ``flat`` (B, n), returned in ``dtype``: float64
    ones by :func:`float64_sqnorms` (exact; one float32 norm over 5e7 elements erred by 3e-3,
    measured), others in the wider of ``flat``'s dtype and float32."""
    if dtype == torch.float64:
        return float64_sqnorms(flat)
    work = torch.promote_types(flat.dtype, torch.float32)
    whole: torch.Tensor = torch.linalg.vector_norm(flat, dim=1, dtype=work)  # (B,)
    return whole.to(dtype).square()


def stacked_sqnorms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """:func:`float64_sqnorms` of several small tensors ``(B, ...)`` of one shape, dtype and
    device (each of at most :data:`SMALL_ELEMENTS`): ``(k, B)``, from four ops per
    :data:`_STACK_ELEMENTS` of them. A GPT's biases and norm weights are most of its
    parameters; three small ops each were ~15 us of host time apiece on the CPU, and a
    kernel launch each on a GPU."""
    B = tensors[0].shape[0]
    step = max(1, _STACK_ELEMENTS // max(1, tensors[0].numel()))
    parts = [torch.stack(part).reshape(len(part), B, -1).to(torch.float64).square_().sum(2)
             for part in (tensors[i : i + step] for i in range(0, len(tensors), step))]
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # (k, B)


_STACK_ELEMENTS = 1 << 20
"""Elements stacked at once by :func:`stacked_sqnorms` (12 MiB with the float64 copy)."""
