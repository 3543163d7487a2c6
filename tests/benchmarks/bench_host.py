"""Host work of a recorded step: GPT-2 small's structure at widths where arithmetic vanishes.

The model has GPT-2 small's layer structure (``gradlog.testing.zoo.tiny_gpt``: 12 layers,
tied head) at tiny widths (vocab 64, d 16, 4 heads, T 16, B 8 by default), so a step's wall
time is the host's work: Python, torch's dispatcher, gradlog's hooks, rules, graph walks,
encoding and checks. On a GPU this work runs beside the device's and is what remains of a
recorded step when the device work is cheap: the H200 run of ``gpu_suite.py`` left ~40 ms
of GPT-2 small's recorded step to the host (RESULTS.md).

Table: per form (``batch_grad="sum"``, ``durable=False``, ``check_every=0``), the plain step
(forward, backward, SGD step on a hook-free copy) and the recorded step (forward,
``rec.backward``, SGD step), paired: each repetition times one of each; medians over
repetitions, and the host work gradlog adds (their difference). ``--profile FORM`` then
prints the main thread's cProfile of that form's recorded steps (cumulative; the writer's
threads are not in it).

Usage::

    python tests/benchmarks/bench_host.py
    python tests/benchmarks/bench_host.py --forms norm --reps 50 --profile norm
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import gradlog
from gradlog.testing import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", default="full,norm,projection")
    parser.add_argument("--reps", type=int, default=30, help="paired repetitions per form")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", default=None, help="a form to profile after timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, V = args.batch, 16, 64
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, T))
    print(f"torch {torch.__version__}, {args.threads} thread(s); GPT of {args.layers} layers, "
          f"vocab {V}, d 16, T {T}, B {B}; batch_grad='sum'; {args.reps} paired reps")
    print()
    print("| form | plain ms | recorded ms | added host ms | recorded / plain |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench_host_") as root:
        for form in [f for f in args.forms.split(",") if f]:
            _row(form, args, x, y, Path(root))


def _row(form: str, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor,
         root: Path) -> None:
    """Time one form's recorded step against the plain step, paired; print its row."""
    V, T = 64, x.shape[1]
    model = zoo.tiny_gpt(vocab=V, block_size=T, n_layer=args.layers, n_head=4, n_embd=16,
                         tie_weights=True, dtype=torch.float32)
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    def plain_step() -> None:
        zoo.per_token_ce(plain(x), y).mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()

    with gradlog.GradRecorder(model, root / f"{form}.gradlog", form=form, batch_grad="sum",
                              durable=False, check_every=0) as rec:

        def recorded_step() -> None:
            rec.backward(zoo.per_token_ce(model(x), y))
            opt.step()
            opt.zero_grad()

        for _ in range(args.warmup):
            plain_step()
            recorded_step()
        rec.flush()
        plain_s, recorded_s = [], []
        for _ in range(args.reps):
            plain_s.append(_seconds(plain_step))
            recorded_s.append(_seconds(recorded_step))
        rec.flush()
        p, r = statistics.median(plain_s), statistics.median(recorded_s)
        ratio = statistics.median(b / a for a, b in zip(plain_s, recorded_s, strict=True))
        print(f"| {form} | {p * 1e3:.1f} | {r * 1e3:.1f} | {(r - p) * 1e3:.1f} | "
              f"{ratio:.2f} |", flush=True)
        if form == args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20):
                recorded_step()
            rec.flush()
            profiler.disable()
            print()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats("gradlog", 40)


def _seconds(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
