"""Train the built-in character-level GPT with dense and with top-k sparse backprop.

Every run starts from the same weights and sees the same batches; only the backward differs.
At the output of every ``nn.Linear`` of the transformer blocks, ``gradlog.sparse_backprop``
keeps the top-k entries of each token's gradient (meProp); ``mode="compact"`` computes those
layers' backward from the kept entries only. The script prints the loss curves as a table (and
the median time of a training step), says why they look as they do, and draws them in one plot
when matplotlib is installed.

What to expect (measured on a 2-core CPU; the notes printed at the end say the same):

- Loss: k = ceil(fraction x width) entries per token, so at width 48 top-5% keeps 3 of 48 and
  top-25% keeps 12: the blocks learn from far fewer directions and the loss plateaus above
  dense (3.1 against 2.3 after 300 steps at 5%). The LM head is left dense by default: with
  its gradient sparsified too (``--where all``) the loss at 5% *rises*, 3.3 at step 60 to 4.8
  at step 300. The head's output gradient is softmax(z) - onehot(y): every character the
  model wrongly favours gets a small push down. Top-k keeps the target's entry and the few
  largest and drops the rest: the kept gradient no longer sums to zero, a bias at every step,
  and the dropped characters are never pushed down (sparsifying the head alone gives the same
  rise: 3.3 to 4.9).
- Time: at width 48 every matmul is tiny, so choosing the top-k of each row (a sort per
  token) costs more than the multiplications skipped: a compact step and a masked step each
  took 1.5x a dense one (paired medians of 3, one thread, shared machine). At width 512
  compact took 1.09x and masked 1.53x: the compact backward wins back most of what top-k
  costs, and beats dense only where the Linear backward dominates the step (a width-1024 MLP:
  backward 1.4-2.7x faster than dense at k <= 5%, ``tests/benchmarks/RESULTS.md``).

    python examples/sparse_backprop.py                      # dense, 25%, 5%: ~20 s on a CPU
    python examples/sparse_backprop.py --fractions 0.1 --steps 400 --mode masked
    python examples/sparse_backprop.py --where all          # the LM head sparsified too
    python examples/sparse_backprop.py --record runs/sparse.gradlog   # also record one run
"""

from __future__ import annotations

import argparse
import math
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
    where = modules(model, args.where)
    sparse = (
        gradlog.sparse_backprop(model, fraction=fraction, mode=args.mode, where=where)
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


def modules(model: torch.nn.Module, where: str) -> list[str] | None:
    """The modules whose output gradient is sparsified: ``sparse_backprop(where=...)``.

    A glob such as ``blocks.*`` would select every module under the blocks (LayerNorms, the
    blocks' own outputs), not only their Linear layers, so ``no-head`` names them one by one.
    """
    if where == "all":
        return None  # sparse_backprop's default: every nn.Linear
    if where == "no-head":
        return [name for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and name != "head"]
    return [glob for glob in where.split(",") if glob]


def smooth(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (the curve without batch noise)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def explain(
    args: argparse.Namespace,
    runs: dict[str, tuple[list[float], float]],
    curves: dict[str, list[float]],
) -> None:
    """Say why the table looks as it does: what k means at this width, what sparsifying the
    LM head does, and whether top-k paid for itself in time."""
    dense_ms = runs["dense"][1]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    kept = ", ".join(f"{f:.0%}: {math.ceil(f * args.width)}" for f in fractions)
    print(f"\nnote: k = ceil(fraction x width) entries of each token's gradient are kept, of "
          f"{args.width} ({kept}); fewer directions per token, a higher loss than dense.")
    if args.where == "all":
        last = {name: curve[-1] for name, curve in curves.items()}
        low = {name: min(curve) for name, curve in curves.items()}
        rose = [name for name in last if last[name] > low[name] + 0.2]
        print("note: the LM head is sparsified too: softmax's gradient pushes every wrongly "
              "favoured character down a little; top-k keeps the target and the few largest, "
              "so the kept gradient no longer sums to zero (a bias at every step) and the "
              "rest are never pushed down"
              + (f" (the loss rose: {', '.join(rose)})." if rose else "."))
    else:
        print(f"note: the LM head is left dense (--where {args.where}); --where all "
              "sparsifies its gradient too, and the loss at 5% then rises during training.")
    for name, (_, ms) in runs.items():
        if name != "dense" and ms > dense_ms:
            print(f"note: a {name} step took {ms / dense_ms:.1f}x a dense one: at width "
                  f"{args.width} the matmuls are tiny and choosing the top-k of every row "
                  "costs more than the multiplications it skips; the compact backward wins "
                  "it back on wide layers (--width 512: compact 1.09x, masked 1.53x a dense "
                  "step) and beats dense where Linear backwards dominate "
                  "(tests/benchmarks/RESULTS.md).")
            break


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
        "--where",
        default="no-head",
        help="'no-head' (default): every nn.Linear but the LM head; 'all': every nn.Linear; "
        "or comma-separated globs over module names",
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
    explain(args, runs, curves)
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
