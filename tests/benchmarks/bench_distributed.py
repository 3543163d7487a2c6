"""Recorded vs unrecorded training step under torch.distributed: 2 gloo ranks on CPU, per form.

Run: ``python tests/benchmarks/bench_distributed.py [--reps 5] [--steps 4] [--strategy ddp]
[--world 2]``. It starts the ranks itself (this file, re-run with ``--rank R``) and prints a
markdown table. ``--world 1`` runs one process (DDP over one rank records as one process):
the single-process reference under the same load.

Each rank trains the demo GPT (2 blocks, d 64, T 64, vocab 128) on its own batch of 8
sequences (SGD), wrapped in DDP or sharded by FSDP2 (``--strategy fsdp2``: ``fully_shard`` on
each block and the model). A repetition times, for every form in turn, a block of ``--steps``
plain steps (forward, backward, optimizer step) and then a block of as many recorded steps
(``rec.backward`` instead of ``backward``, the recorder opened before and flushed inside the
timed block, so the background writes count); the ratio of a form is the median over
repetitions of (recorded block / the plain block just before it): paired, so that load on a
shared machine moves both. Each recorded block opens a fresh store and runs one untimed step
first (planning, the first step's checks). Rank 0 reports; both ranks start every block
together (a barrier).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FORMS: dict[str, dict[str, Any]] = {
    "full": {},
    "projection (dim 1024)": {"form": {"form": "projection", "dim": 1024}},
    "auto (budget 1 MiB/step)": {"form": "auto", "form_budget": 1 << 20},
    "norm": {"form": "norm"},
}


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=600))
    import gradlog
    from gradlog.demo.model import CharGPT, GPTConfig

    torch.manual_seed(0)
    model = CharGPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64))
    if args.strategy == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.4-2.5
            from torch.distributed._composable.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        trained: nn.Module = model
    else:
        trained = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(trained.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + args.rank)
    x = torch.randint(0, 128, (8, 64), generator=g)
    y = torch.randint(0, 128, (8, 64), generator=g)

    def losses() -> torch.Tensor:
        logits = trained(x)  # (B, T, V)
        return nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")

    def plain_block() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            losses().mean().backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - t0

    def recorded_block(options: dict[str, Any], path: str) -> float:
        with gradlog.GradRecorder(trained, path, overwrite=True, durable=False,
                                  **options) as rec:
            rec.backward(losses())  # untimed: planning, the first step's checks
            opt.step()
            opt.zero_grad()
            rec.flush()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                rec.backward(losses())
                opt.step()
                opt.zero_grad()
            rec.flush()
            return time.perf_counter() - t0

    for _ in range(2):  # warm-up
        plain_block()
    ratios: dict[str, list[float]] = {name: [] for name in FORMS}
    plain_ms: list[float] = []
    for _ in range(args.reps):
        for name, options in FORMS.items():
            plain = plain_block()
            recorded = recorded_block(options, os.path.join(args.dir, "bench.gradlog"))
            ratios[name].append(recorded / plain)
            plain_ms.append(1e3 * plain / args.steps)
    if args.rank == 0:
        print(f"\n{args.world} gloo rank(s), {args.strategy}, {args.reps} reps x {args.steps} "
              f"steps per block, plain step median {statistics.median(plain_ms):.1f} ms (rank 0)\n")
        print("| form | recorded / plain step (median) | min-max |")
        print("|---|---|---|")
        for name, values in ratios.items():
            print(f"| {name} | {statistics.median(values):.2f} | "
                  f"{min(values):.2f}-{max(values):.2f} |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dir", default="")
    args = parser.parse_args()
    if args.rank is not None:
        _rank_main(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = tempfile.mkdtemp(prefix="gradlog-bench-dist-")
    root = str(Path(__file__).resolve().parents[2])  # this checkout's gradlog
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        procs = [
            subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                              "--dir", where, "--reps", str(args.reps), "--steps",
                              str(args.steps), "--strategy", args.strategy, "--world",
                              str(args.world)], env=env)
            for r in range(args.world)
        ]
        codes = [p.wait() for p in procs]
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
