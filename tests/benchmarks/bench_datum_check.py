"""What would an always-on coupling check cost? (issue #17, item 8)

A loss that couples datums (in-batch negatives) still sums to ``p.grad``, so only the datum
check sees it: one random datum's records against that datum's own ``autograd.grad``. The
hooks backend runs it on the first backward and on each new layout. This script times, on
the small GPT of PEERS.md (``bench_compute.build``), a recorded step with:

- ``default``: the datum check on the first backward only, ``check_every=100``;
- ``datum-every-step``: the datum check forced on every backward (a rotating random datum
  each step: what an always-on check costs);
- ``selfcheck-every-step``: ``check_every=1`` (the sum check, which cannot see coupling),
  for scale;

against a plain step, variants alternated within each repetition (paired), medians of the
per-repetition ratios. Usage::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_datum_check.py --reps 15 --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_compute import build, token_losses

import gradlog
from gradlog.backends.hooks import datum_check


def _variant(name: str, tmp: Path) -> Callable[[int], float]:
    model, x, y = build("small")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if name == "plain":
        def plain(steps: int) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                token_losses(model, (x, y)).mean().backward()
                opt.step()
                opt.zero_grad()
            return (time.perf_counter() - t0) / steps
        return plain
    every = 1 if name == "selfcheck-every-step" else 100
    rec = gradlog.GradRecorder(model, tmp / f"{name}.gradlog", overwrite=True, durable=False,
                               check_every=every, form="norm")
    rec.open()
    forced = name == "datum-every-step"

    def recorded(steps: int) -> float:
        real = datum_check.DatumLayouts.wants
        if forced:
            datum_check.DatumLayouts.wants = lambda *a, **k: True  # type: ignore[method-assign]
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                rec.backward(token_losses(model, (x, y)).mean(1))
                opt.step()
                opt.zero_grad()
            rec.flush()
            return (time.perf_counter() - t0) / steps
        finally:
            datum_check.DatumLayouts.wants = real  # type: ignore[method-assign]

    return recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=6, help="steps per timed repetition")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = ["plain", "default", "datum-every-step", "selfcheck-every-step"]
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        variants = {n: _variant(n, Path(d)) for n in names}
        for fn in variants.values():
            fn(2)  # warm-up (the first backward's datum check, allocations)
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]
            for n in order:
                times[n].append(variants[n](args.steps))
    plain = times["plain"]
    print(f"small GPT (vocab 512, d 128, 2 layers, T 64, B 16), CPU, 1 thread, form='norm', "
          f"{args.reps} paired repetitions of {args.steps} steps; medians")
    print(f"{'variant':24s} {'ms/step':>9s} {'x plain':>8s} {'x default':>9s}")
    for n in names:
        ratio = statistics.median(t / p for t, p in zip(times[n], plain))
        vs_default = statistics.median(t / d for t, d in zip(times[n], times["default"]))
        print(f"{n:24s} {1e3 * statistics.median(times[n]):9.2f} {ratio:8.3f} {vs_default:9.3f}")


if __name__ == "__main__":
    main()
