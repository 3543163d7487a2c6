"""Which training data helped, and which hurt, a held-out example? TracIn over recorded steps.

Trains the built-in character-level GPT on 64 windows of the shipped sonnets with plain SGD,
recording per-datum gradients and, at every step, the gradients of 4 held-out windows (the
probes). Then, without retraining or checkpoints:

- ``run.influence(probe)``: the training windows whose updates lowered the probe's loss most
  (proponents) and raised it most (opponents), ``sum_t lr_t <g_t(window), g_t(probe)>``;
- ``run.self_influence()``: the windows the model kept being pushed by;
- ``run.movers(param)``: the windows that moved the output layer most;
- ``run.plot()``: their gradient-norm trajectories and a steps x windows heatmap.

    python examples/influence.py --out runs/influence.gradlog     # well under a minute
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import gradlog
from gradlog.demo import CharCorpus, CharGPT, GPTConfig, load_corpus

SEQ, BATCH, TRAIN, PROBES = 32, 8, 64, 4


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-token losses (B, T); gradlog averages them per window."""
    x, y = batch
    return F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/influence.gradlog")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--plot", default=None, help="image path (default: beside --out)")
    args = parser.parse_args()

    torch.manual_seed(0)
    corpus = CharCorpus(load_corpus())
    windows = [corpus.window(i, SEQ) for i in range(TRAIN + PROBES)]
    x = torch.stack([w[0] for w in windows])  # (TRAIN + PROBES, T)
    y = torch.stack([w[1] for w in windows])
    probe_ids = list(range(TRAIN, TRAIN + PROBES))  # held out: never trained on
    model = CharGPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=SEQ, n_embd=32))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    gen = torch.Generator().manual_seed(0)

    t0 = time.perf_counter()
    with gradlog.GradRecorder(
        model,
        args.out,
        params=["blocks.*.mlp.*", "head.weight"],
        backend="vmap",
        optimizer=opt,
        overwrite=True,
        probes=(loss_fn, (x[probe_ids], y[probe_ids])),
        probe_ids=probe_ids,
    ) as rec:
        order = torch.randperm(TRAIN, generator=gen)
        for step in range(args.steps):
            if (step * BATCH) % TRAIN == 0:
                order = torch.randperm(TRAIN, generator=gen)  # a new epoch
            start = (step * BATCH) % TRAIN
            idx = order[start : start + BATCH]
            losses = rec.step(loss_fn, (x[idx], y[idx]), datum_ids=idx)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 16 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  train loss {losses.mean():.3f}")
    print(f"recorded {args.steps} steps in {time.perf_counter() - t0:.1f} s into {args.out}")

    run = gradlog.open(args.out)
    probe = probe_ids[0]
    losses = run.probe_records(probe=probe).column("loss").to_pylist()
    print(f"\nprobe {probe}: {corpus.decode(x[probe])!r}")
    print(f"its loss over training: {losses[0]:.3f} -> {losses[-1]:.3f} (never trained on)")

    t0 = time.perf_counter()
    table = run.influence(probe, top=3)  # TracIn: sum_t lr_t <g_t(datum), g_t(probe)>
    print(f"influence scan: {time.perf_counter() - t0:.2f} s")
    for row in table.to_pylist():
        text = corpus.decode(x[row["datum_id"]])
        print(
            f"  {row['kind']:<10} #{row['rank']}  window {row['datum_id']:3d}  score "
            f"{row['score']:+.4f} over {row['n_steps']} steps  {text!r}"
        )
    if "opponent" not in table.column("kind").to_pylist():
        print(
            "  no opponent: every training window's updates lowered this probe's loss (to "
            "first order), as is usual early in training"
        )

    selfish = run.self_influence(top=3).to_pylist()
    print("\nlargest self-influence:", [(r["datum_id"], round(r["score"], 3)) for r in selfish])
    movers = run.movers("head.weight", top=2).to_pylist()
    print(
        "moved head.weight most:",
        [(r["kind"], r["datum_id"], f"{r['fraction']:.1%}") for r in movers],
    )

    if importlib.util.find_spec("matplotlib") is None:
        print("\n(pip install 'gradlog[plot]' to draw the trajectories)")
        return
    image = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
    top = [r["datum_id"] for r in table.to_pylist()]
    run.plot(image, datums=top, width=1200, height=450)
    print(f"\nwrote {image}: gradient-norm trajectories of those windows, steps x windows heatmap")


if __name__ == "__main__":
    main()
