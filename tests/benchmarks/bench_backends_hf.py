"""The backends side by side on a transformers model the hooks backend reaches by a layout
proof: Swin's windowed attention (``(B*windows, tokens, d)`` rows). Before that proof the
hooks backend refused Swin, and its users had ``vmap`` or ``loop``.

A training step (forward, ``rec.backward``, SGD step, ``rec.flush()``) of a
``SwinForImageClassification`` built from a config with random weights (float32, eager
attention, CPU), ``form="norm"`` (nothing stored but the norms: the compute), against the
plain step; variants alternated within each repetition (paired), medians of the
per-repetition ratios. Usage::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_backends_hf.py --reps 5
    python tests/benchmarks/bench_backends_hf.py --shape tiny --reps 1 --steps 1   # (smoke)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import gradlog

SHAPES: dict[str, dict[str, int]] = {
    # 64 x 64 images, patches of 4: 16 x 16 tokens, windows of 4 x 4, two stages
    "small": dict(image=64, patch=4, dim=32, window=4, B=8),
    "wide": dict(image=64, patch=4, dim=96, window=4, B=16),
    "tiny": dict(image=16, patch=2, dim=8, window=2, B=3),
}
BACKENDS = ("hooks", "vmap", "loop")


def build(shape: dict[str, int]) -> torch.nn.Module:
    import transformers

    cfg = transformers.SwinConfig(image_size=shape["image"], patch_size=shape["patch"],
                                  num_channels=3, embed_dim=shape["dim"], depths=[2, 2],
                                  num_heads=[2, 4], window_size=shape["window"], num_labels=10)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.SwinForImageClassification(cfg).train()


def timer(name: str, shape: dict[str, int], root: Path) -> Callable[[int], float]:
    """A function timing ``steps`` training steps of variant ``name`` (seconds per step)."""
    model = build(shape)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    B, side = shape["B"], shape["image"]
    x = torch.randn(B, 3, side, side, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (B,), generator=torch.Generator().manual_seed(2))

    def losses() -> torch.Tensor:
        return F.cross_entropy(model(pixel_values=x).logits, y, reduction="none")

    if name == "plain":
        def plain(steps: int) -> float:
            t = time.perf_counter()
            for _ in range(steps):
                losses().mean().backward()
                opt.step()
                opt.zero_grad()
            return (time.perf_counter() - t) / steps
        return plain
    rec = gradlog.GradRecorder(model, root / f"{name}.gradlog", backend=name, form="norm",
                               durable=False, check_every=0)
    rec.open()

    def recorded(steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            if name == "vmap":
                rec.step(lambda m, batch: F.cross_entropy(m(pixel_values=batch[0]).logits,
                                                          batch[1], reduction="none"), (x, y))
            else:
                rec.backward(losses())
            opt.step()
            opt.zero_grad()
        rec.flush()
        return (time.perf_counter() - t) / steps
    return recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    names = ["plain", *[b for b in args.backends.split(",") if b]]
    print(f"torch {torch.__version__}, {args.threads} thread(s); Swin {shape}, float32, "
          f"eager attention, form='norm'; {args.reps} paired reps of {args.steps} steps")
    with tempfile.TemporaryDirectory(prefix="bench_backends_hf_") as tmp:
        timers = {n: timer(n, shape, Path(tmp)) for n in names}
        for t in timers.values():
            t(1)  # (warm-up: first forwards, op-level watching, the datum check)
        seconds: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.reps):
            for n in names:
                seconds[n].append(timers[n](args.steps))
    print()
    print("| variant | ms per step (median) | / plain (median of paired ratios) |")
    print("|---|---|---|")
    for n in names:
        ratio = statistics.median(a / b for a, b in zip(seconds[n], seconds["plain"],
                                                         strict=True))
        print(f"| {n} | {statistics.median(seconds[n]) * 1e3:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
