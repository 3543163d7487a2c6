"""Backward time of top-k sparse backprop (``gradlog.sparse_backprop``) against dense.

Models (float32):
- ``mlp``: an MLP of width 1024: ``Linear(1024, 1024) -> ReLU`` three times, then
  ``Linear(1024, 10)``, batch 256, cross entropy.
- ``gpt``: the built-in transformer (``gradlog.demo.CharGPT``, d 256, 4 layers, T 128, B 8,
  vocab of the shipped corpus), per-token cross entropy on corpus batches.

Methods: ``dense`` (no context), then for each fraction ``masked`` (tensor hooks zero all
but the top-k entries of each token's output gradient at every ``nn.Linear``; dense kernels
still run) and ``compact`` (meProp: the Linear backward from the kept entries only, with
sparse-dense matmuls). k = ceil(fraction * d_out) per layer and token.

What is timed: ``loss.backward()`` only; the forward (under the context) is not timed. Each
repetition runs every method once, in a rotated order (interleaved, so drift and other
processes' load hit all methods alike); the table shows median backward times and the median
of the per-repetition ratio method / dense (paired within a repetition). The last column
checks that compact and masked give the same gradients (max |difference| / max |gradient|).

``--kernels`` adds the micro-benchmark behind the compact kernel choice: one 1024x1024 layer,
256 rows, the ways to compute ``grad_input`` and ``grad_weight`` from k kept entries per row.

Usage (on a shared machine, keep OpenMP threads from spinning between ops)::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_sparse.py --reps 15
    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_sparse.py --threads 1 --clock cpu \\
        --kernels --append      # append the tables to tests/benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.demo import CharCorpus, CharGPT, GPTConfig, load_corpus

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
Batch = tuple[torch.Tensor, torch.Tensor]


def build_mlp(seed: int = 0) -> tuple[nn.Module, Batch, Callable[[nn.Module, Batch], Any]]:
    torch.manual_seed(seed)
    width, B = 1024, 256
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    batch = (torch.randn(B, width), torch.randint(0, 10, (B,)))

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    return model, batch, loss


def build_gpt(seed: int = 0) -> tuple[nn.Module, Batch, Callable[[nn.Module, Batch], Any]]:
    torch.manual_seed(seed)
    corpus = CharCorpus(load_corpus())
    T, B = 128, 8
    config = GPTConfig(vocab_size=corpus.vocab_size, block_size=T, n_layer=4, n_embd=256)
    model = CharGPT(config)
    x, y, _ = next(corpus.batches(B, T, 1, seed=seed))

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return F.cross_entropy(m(b[0]).transpose(1, 2), b[1])

    return model, (x, y), loss


MODELS = {
    "mlp": ("MLP width 1024 (3 x Linear 1024x1024 + ReLU, Linear 1024x10), B 256", build_mlp),
    "gpt": ("CharGPT d 256, 4 layers, T 128, B 8", build_gpt),
}


def backward_time(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[..., Any],
    clock: Callable[[], float],
    sparse: dict[str, Any] | None,
) -> float:
    model.zero_grad(set_to_none=True)
    if sparse is None:
        loss = loss_fn(model, batch)
    else:
        with gradlog.sparse_backprop(model, **sparse):
            loss = loss_fn(model, batch)
    t0 = clock()
    loss.backward()  # the forward ran inside the context: its backward is sparsified
    return clock() - t0


def grads(
    model: nn.Module, batch: Batch, loss_fn: Callable[..., Any], sparse: dict[str, Any]
) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with gradlog.sparse_backprop(model, **sparse):
        loss_fn(model, batch).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def bench_model(name: str, args: argparse.Namespace) -> list[str]:
    title, build = MODELS[name]
    model, batch, loss_fn = build()
    clock = CLOCKS[args.clock]
    methods: dict[str, dict[str, Any] | None] = {"dense": None}
    for f in args.fractions:
        methods[f"masked {f:.0%}"] = {"fraction": f, "mode": "masked"}
        methods[f"compact {f:.0%}"] = {"fraction": f, "mode": "compact"}
    names = list(methods)
    for n in names:  # warm-up (allocator, sparse kernels)
        backward_time(model, batch, loss_fn, clock, methods[n])
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps):
        shift = rep % len(names)
        this = {}
        for n in names[shift:] + names[:shift]:
            this[n] = backward_time(model, batch, loss_fn, clock, methods[n])
        for n in names:
            times[n].append(this[n])
            ratios[n].append(this[n] / this["dense"])
    agree: dict[str, str] = {}
    for f in args.fractions:
        masked = grads(model, batch, loss_fn, {"fraction": f, "mode": "masked"})
        compact = grads(model, batch, loss_fn, {"fraction": f, "mode": "compact"})
        scale = max(float(m.abs().max()) for m in masked)
        gap = max(float((m - c).abs().max()) for m, c in zip(masked, compact))
        agree[f"compact {f:.0%}"] = f"{gap / scale:.1e}"
    rows = [
        f"### {title}",
        "",
        "| backward | median ms | vs dense (median of paired ratios) | min-max ratio | "
        "speed-up | compact vs masked |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:
        r = statistics.median(ratios[n])
        rows.append(
            f"| {n} | {statistics.median(times[n]) * 1e3:.1f} | {r:.2f} | "
            f"{min(ratios[n]):.2f}-{max(ratios[n]):.2f} | {1 / r:.1f}x | {agree.get(n, '')} |"
        )
    return rows


def bench_kernels(args: argparse.Namespace) -> list[str]:
    """grad_input and grad_weight of one Linear from k kept entries per row, several ways."""
    N, d_out, d_in = 256, 1024, 1024
    rows = [
        f"### Kernel choice: one {d_out}x{d_in} Linear, {N} rows (ms, median of {args.reps})",
        "",
        "| k per row | dense matmuls | topk | gather W rows + einsum, index_add | "
        "COO sparse.mm (chosen) | CSR @ W, COO for W | unified (shared columns) |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in args.fractions:
        k = max(1, round(f * d_out))
        times = _kernel_times(N, d_out, d_in, k, args.reps, CLOCKS[args.clock])
        rows.append(f"| {k} ({f:.0%}) | " + " | ".join(f"{t * 1e3:.2f}" for t in times) + " |")
    return rows


def _kernel_times(
    N: int, d_out: int, d_in: int, k: int, reps: int, clock: Callable[[], float]
) -> list[float]:
    torch.manual_seed(0)
    x, W, g = torch.randn(N, d_in), torch.randn(d_out, d_in), torch.randn(N, d_out)
    idx = g.abs().topk(k, dim=1, sorted=False).indices  # (N, k)
    v = g.gather(1, idx).reshape(-1)  # (N*k,)
    r = torch.arange(N).repeat_interleave(k)  # (N*k,)
    c = idx.reshape(-1)  # (N*k,)

    def coo(i: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return torch.sparse_coo_tensor(i, v, size, check_invariants=False)

    def dense() -> Any:
        return g @ W, g.t() @ x

    def topk() -> Any:
        return g.abs().topk(k, dim=1, sorted=False)

    def gather() -> Any:
        wk = W.index_select(0, c).view(N, k, d_in)  # (N, k, d_in)
        gx = torch.einsum("nk,nkd->nd", v.view(N, k), wk)  # (N, d_in)
        src = (v.view(N, k, 1) * x.unsqueeze(1)).reshape(-1, d_in)  # (N*k, d_in)
        return gx, torch.zeros(d_out, d_in).index_add_(0, c, src)

    def sparse_coo() -> Any:
        gx = torch.sparse.mm(coo(torch.stack([r, c]), (N, d_out)), W)  # (N, d_in)
        return gx, torch.sparse.mm(coo(torch.stack([c, r]), (d_out, N)), x)  # (d_out, d_in)

    def sparse_csr() -> Any:
        crow = torch.arange(0, N * k + 1, k)  # (N+1,)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "CSR support is in beta state"
            s = torch.sparse_csr_tensor(crow, c, v, (N, d_out), check_invariants=False)
        return s @ W, torch.sparse.mm(coo(torch.stack([c, r]), (d_out, N)), x)

    def unified() -> Any:  # meProp's shared selection: couples the datums of a batch
        cols = g.abs().sum(0).topk(k).indices  # (k,)
        gk = g[:, cols]  # (N, k)
        gw = torch.zeros(d_out, d_in)
        gw[cols] = gk.t() @ x
        return gk @ W[cols], gw

    fns = [dense, topk, gather, sparse_coo, sparse_csr, unified]
    t: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            t[i].append(clock() - t0)
    return [statistics.median(ts) for ts in t]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="interleaved repetitions")
    parser.add_argument("--models", default="mlp,gpt", help=f"comma-separated: {','.join(MODELS)}")
    parser.add_argument(
        "--fractions", default="0.01,0.05,0.25", help="comma-separated shares of each row kept"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: perf_counter; cpu: this process's CPU time (use --threads 1)",
    )
    parser.add_argument("--kernels", action="store_true", help="add the kernel-choice table")
    parser.add_argument(
        "--append",
        nargs="?",
        const=str(RESULTS),
        default=None,
        help=f"append the tables to this markdown file (default {RESULTS.name})",
    )
    args = parser.parse_args()
    args.fractions = [float(f) for f in args.fractions.split(",") if f]
    if args.threads:
        torch.set_num_threads(args.threads)

    lines: list[str] = []
    tables = [lambda n=n: bench_model(n, args) for n in args.models.split(",")]
    if args.kernels:
        tables.append(lambda: bench_kernels(args))
    for table in tables:
        rows = [*table(), ""]
        print("\n".join(rows), flush=True)
        lines += rows

    if args.append:
        cmd = " ".join(["python", "tests/benchmarks/bench_sparse.py", *sys.argv[1:]])
        env = "OMP_WAIT_POLICY=PASSIVE " if os.environ.get("OMP_WAIT_POLICY") else ""
        header = [
            "",
            "## Sparse backprop: backward time (`bench_sparse.py`)",
            "",
            f"{datetime.date.today().isoformat()}, torch {torch.__version__}, Python "
            f"{platform.python_version()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} intra-op threads, {args.clock} clock, "
            f"{args.reps} interleaved repetitions.",
            "",
            f"`{env}{cmd}`",
            "",
        ]
        with open(args.append, "a", encoding="utf-8") as fh:
            fh.write("\n".join(header + lines))
        print(f"appended to {args.append}")


if __name__ == "__main__":
    main()
