"""One rank of the distributed-recording tests (tests/test_distributed.py): run as a script.

Usage: python ddp_worker.py RANK WORLD PORT STORE STEPS [crash_at_step|-]
[resume|mismatch|sum|rows]
Trains the shared tiny model under DDP (gloo, CPU) on rank RANK's share of a fixed global
batch per step, recording into STORE. With crash_at_step, rank 1 dies (os._exit) inside that
step, after its backward and before the step ends.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


class Rows(nn.Module):
    """A Linear on the batch's tokens flattened to ``(B*T, d)`` rows, as OPT's feed-forward
    layers run: laid out by datum only once the datum check passed on it."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.mid, self.out = nn.Linear(5, 12), nn.Linear(4, 4), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 5)
        h = self.up(x).view(len(x), 3, 4)  # (B, T 3, 4)
        rows = torch.tanh(self.mid(h.reshape(-1, 4)))  # (B*T, 4)
        return self.out(rows.view(len(x), 12))


def model_and_data(steps: int, global_batch: int = 8,
                   rows: bool = False) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = Rows() if rows else nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    g = torch.Generator().manual_seed(1)
    data = []
    for s in range(steps):
        x = torch.randn(global_batch, 5, generator=g)
        y = torch.randint(0, 3, (global_batch,), generator=g)
        ids = torch.arange(s * global_batch, (s + 1) * global_batch)
        data.append((x, y, ids))
    return model, data


def micro_batches(
    step: int, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The global batch's backward calls at ``step``: step 1 accumulates two micro-batches."""
    if step != 1:
        return [(x, y, ids)]
    half = len(ids) // 2
    return [(x[:half], y[:half], ids[:half]), (x[half:], y[half:], ids[half:])]


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store, steps = sys.argv[4], int(sys.argv[5])
    crash_at = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    resume = len(sys.argv) > 7 and sys.argv[7] == "resume"
    # "mismatch": rank 1 opens the store with another configuration than rank 0's
    dtype = "bfloat16" if sys.argv[7:8] == ["mismatch"] and rank == 1 else "float32"
    # "sum": Linear weight gradients from the per-datum sum (gradlog.backends.fused)
    batch_grad = "sum" if sys.argv[7:8] == ["sum"] else "autograd"
    rows = sys.argv[7:8] == ["rows"]  # a Linear on flattened rows (the datum check under DDP)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    import gradlog
    import gradlog.store.writer as writer

    writer.RANK_COMMIT_TIMEOUT_S = 5.0  # a crashed rank fails the commit quickly
    model, data = model_and_data(steps, rows=rows)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    first = 0
    if resume:  # replay the committed steps' updates, unrecorded
        steps_done = gradlog.open(store).steps.column("step").to_pylist()
        first = max(steps_done) + 1 if steps_done else 0
        for step in range(first):
            opt.zero_grad()
            calls = micro_batches(step, *data[step])
            for k, (x, y, _) in enumerate(calls):
                with ddp.no_sync() if k < len(calls) - 1 else contextlib.nullcontext():
                    nn.functional.cross_entropy(ddp(x[rank::world]), y[rank::world]).backward()
            opt.step()
    try:
        with gradlog.GradRecorder(
            ddp, store, check_every=1, resume=resume, dtype=dtype, batch_grad=batch_grad
        ) as rec:
            for step in range(first, steps):
                opt.zero_grad()
                calls = micro_batches(step, *data[step])
                for k, (x, y, ids) in enumerate(calls):
                    mine = slice(rank, None, world)
                    # gradient accumulation: only the last call all-reduces
                    with ddp.no_sync() if k < len(calls) - 1 else contextlib.nullcontext():
                        out = ddp(x[mine])
                        losses = nn.functional.cross_entropy(out, y[mine], reduction="none")
                        rec.backward(losses, datum_ids=ids[mine], step=step)
                if crash_at == step and rank == 1:
                    rec.flush()  # its part of the step before is written (not racing _exit)
                    os._exit(3)
                opt.step()
    finally:
        if crash_at is None:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
