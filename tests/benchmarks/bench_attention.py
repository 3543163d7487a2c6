"""``nn.MultiheadAttention``'s rule: from the batch's own backward through its projections,
against the per-datum ``torch.func`` re-run it replaced, and against a plain step.

An ``nn.TransformerEncoder`` (2 layers, d 128, 4 heads, feed-forward 512, dropout 0.1) and a
Linear head on ``(B, T, d) = (16, 64, 128)`` inputs; the hooks backend alone (no store), its
backward against a plain forward and backward of an identical copy, paired (one of each per
repetition), medians. Rows: training (the attention's dropout: the projections are the only
way), eval (projections), eval with the projections ignored (the re-run, as before).

Usage::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_attention.py --reps 22
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

import gradlog.rules.attention as attention
from gradlog.backends import BACKENDS
from gradlog.params import select_params

B, T, D = 16, 64, 128


def build() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, 4, 512, dropout=0.1, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Linear(D, 10))


def row(mode: str, rerun: bool, x: torch.Tensor, reps: int) -> dict[str, float]:
    plain_model, model = build(), build()
    for m in (plain_model, model):
        m.train(mode == "train")
    backend = BACKENDS["hooks"](model, select_params(model, ["*"]), batch_reduction="mean",
                                randomness="different")
    backend.attach()
    noted: Any = attention._frame_of
    if rerun:
        attention._frame_of = lambda module, cap: None  # type: ignore[assignment]
    try:
        ratios, plain_s, recorded_s = [], [], []
        for i in range(reps + 3):
            t0 = time.perf_counter()
            plain_model.zero_grad(set_to_none=True)
            plain_model(x).pow(2).mean((1, 2)).mean().backward()
            t1 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            losses = model(x).pow(2).mean((1, 2))
            backend.backward(losses, backend.reduce_batch(losses))
            t2 = time.perf_counter()
            if i >= 3:  # warm-up
                ratios.append((t2 - t1) / (t1 - t0))
                plain_s.append(t1 - t0)
                recorded_s.append(t2 - t1)
    finally:
        attention._frame_of = noted
        backend.detach()
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "plain": statistics.median(plain_s), "recorded": statistics.median(recorded_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=22)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, {args.threads} threads, B {B}, T {T}, d {D}, "
          f"{args.reps} paired reps\n")
    print("| mode | rule | plain ms | recorded ms | recorded / plain (median) | min-max |")
    print("|---|---|---|---|---|---|")
    for mode, rerun in (("train", False), ("eval", False), ("eval", True)):
        r = row(mode, rerun, x, args.reps)
        rule = "torch.func re-run" if rerun else "projections"
        print(f"| {mode} | {rule} | {1000 * r['plain']:.1f} | {1000 * r['recorded']:.1f} | "
              f"{r['ratio']:.2f} | {r['min']:.2f}-{r['max']:.2f} |")


if __name__ == "__main__":
    main()
