"""Train the built-in character-level GPT with dense and with top-k sparse backprop.

Every run starts from the same weights and sees the same batches; only the backward differs.
At the output of every ``nn.Linear``, ``gradlog.sparse_backprop`` keeps the top-k entries of
each token's gradient (meProp); ``mode="compact"`` computes those layers' backward from the
kept entries only. The script prints the loss curves as a table (and the median time of a
training step) and draws them in one plot when matplotlib is installed.

    python examples/sparse_backprop.py                      # dense, 25%, 5%: ~20 s on a CPU
    python examples/sparse_backprop.py --fractions 0.1 --steps 400 --mode masked
    python examples/sparse_backprop.py --where 'blocks.*'   # leave the LM head dense
    python examples/sparse_backprop.py --record runs/sparse.gradlog   # also record one run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: much faster on a small or shared CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # after the OpenMP setting, which torch reads at import
import torch.nn.functional as F

import gradlog
from gradlog.demo import CharCorpus, CharGPT, GPTConfig, load_corpus


def train(
    args: argparse.Namespace, fraction: float | None, record: str | None = None
) -> tuple[list[float], float]:
    """One run; ``fraction=None`` is dense backprop. Returns (loss per step, median step s)."""
    torch.manual_seed(args.seed)
    corpus = CharCorpus(load_corpus())
    config = GPTConfig(
        vocab_size=corpus.vocab_size,
        block_size=args.seq_len,
        n_layer=args.layers,
        n_embd=args.width,
    )
    model = CharGPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, times = [], []
    sparse = (
        gradlog.sparse_backprop(model, fraction=fraction, mode=args.mode, where=args.where)
        if fraction is not None
        else None
    )
    if sparse is not None:
        sparse.__enter__()  # the context stays open for the whole run
    rec = (
        gradlog.GradRecorder(model, record, backend="hooks", optimizer=opt, overwrite=True)
        if record
        else None
    )
    try:
        if rec is not None:
            rec.open()
        batches = corpus.batches(args.batch_size, args.seq_len, args.steps, seed=args.seed)
        for step, (x, y, ids) in enumerate(batches):
            t0 = time.perf_counter()
            per_token = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # (B,T)
            if rec is not None:
                rec.backward(per_token, datum_ids=ids, step=step)
            else:
                per_token.mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(float(per_token.detach().mean()))
    finally:
        if rec is not None:
            rec.close()
        if sparse is not None:
            sparse.__exit__(None, None, None)
    return losses, statistics.median(times[1:] or times)


def smooth(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (the curve without batch noise)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--fractions",
        default="0.25,0.05",
        help="comma-separated shares of each token's gradient kept",
    )
    parser.add_argument("--mode", choices=["compact", "masked"], default="compact")
    parser.add_argument(
        "--where", default=None, help="glob over module names (default: every nn.Linear)"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=".", help="folder of the plot (sparse_backprop.png)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.add_argument(
        "--record",
        default=None,
        help="record the sparsest run's per-datum gradients into this store",
    )
    args = parser.parse_args()

    fractions = [float(f) for f in args.fractions.split(",") if f]
    runs: dict[str, tuple[list[float], float]] = {"dense": train(args, None)}
    for i, fraction in enumerate(fractions):
        record = args.record if i == len(fractions) - 1 else None
        runs[f"{args.mode} top-{fraction:.0%}"] = train(args, fraction, record)

    window = max(1, args.steps // 20)
    curves = {name: smooth(losses, window) for name, (losses, _) in runs.items()}
    names = list(runs)
    print(f"training loss (mean of the last {window} steps), same weights and batches")
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    marks = sorted({*range(0, args.steps, max(1, args.steps // 10)), args.steps - 1})
    for step in marks:
        print(f"| {step} | " + " | ".join(f"{curves[n][step]:.3f}" for n in names) + " |")
    print("| median step ms | " + " | ".join(f"{runs[n][1] * 1e3:.1f}" for n in names) + " |")
    if args.record:
        run = gradlog.open(args.record)
        print(
            f"recorded {run.steps.num_rows} steps into {args.record}; sparsity settings: "
            f"{run.attrs['backend']['sparse_backprop']}"
        )

    if args.no_plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install 'gradlog[plot]' for the plot.")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        ax.plot(curves[name], label=f"{name} ({runs[name][1] * 1e3:.0f} ms/step)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    ax.set_title("CharGPT: dense vs top-k sparse backprop")
    ax.legend()
    out = Path(args.out) / "sparse_backprop.png"
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
