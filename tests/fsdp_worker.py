"""One rank of the FSDP2 and compact-forms distributed tests (tests/test_fsdp.py): run as a
script, or imported for the single-process oracle (:func:`train`).

Usage: python fsdp_worker.py RANK WORLD PORT STORE STEPS STRATEGY FORM [crash_at|-] [resume]
STRATEGY: ``fsdp2`` (``fully_shard`` on every Linear, every block and the model, so the
recorded modules are FSDP2's dynamically created ``FSDPLinear`` etc.) or ``ddp``. FORM: a
``form=`` name, or ``auto:BYTES`` for ``form="auto"`` with ``form_budget=BYTES``. Rank r
trains the tiny GPT on rows ``r::WORLD`` of a fixed global batch per step (step 1 accumulates
two micro-batches, the first without gradient sync). Rank 0 saves each step's whole
``p.grad`` in ``STORE.grads/step-S.npz`` (numpy, no pickle). With ``crash_at``, rank 1 is
killed (SIGKILL) inside that step, after its backward.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

VOCAB, T, GLOBAL_B = 11, 8, 8


def model_and_data(steps: int) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """The tiny GPT (float32, 2 blocks, untied) and each step's global batch."""
    from gradlog.testing.zoo import gpt_batch, tiny_gpt

    model = tiny_gpt(vocab=VOCAB, block_size=T, n_layer=2, n_embd=8, dtype=torch.float32)
    data = []
    for s in range(steps):
        x, y, mask = gpt_batch(GLOBAL_B, T, vocab=VOCAB, seed=100 + s)
        data.append((x, y, mask, torch.arange(s * GLOBAL_B, (s + 1) * GLOBAL_B)))
    return model, data


def micro_batches(step: int, batch: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """The backward calls of ``step``: step 1 accumulates two micro-batches."""
    if step != 1:
        return [batch]
    half = GLOBAL_B // 2
    return [tuple(t[:half] for t in batch), tuple(t[half:] for t in batch)]


def recorder_options(form: str) -> dict[str, Any]:
    """``GradRecorder`` options of a FORM argument."""
    if form.startswith("auto:"):
        return {"form": "auto", "form_budget": int(form.split(":")[1])}
    if form == "projection":
        return {"form": {"form": "projection", "dim": 16}, "projection_seed": 7}
    return {"form": form}


def losses_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``(B, T)``."""
    logits = model(x)  # (B, T, V)
    return nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (B, T)


def train(
    model: nn.Module,
    data: list[tuple[torch.Tensor, ...]],
    rec: Any,
    first: int,
    *,
    rank: int = 0,
    world: int = 1,
    no_sync: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    on_grads: Callable[[int], None] = lambda step: None,
    crash_at: int | None = None,
) -> None:
    """SGD over ``data[first:]``, rank ``rank`` taking rows ``rank::world`` of each call."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(first, len(data)):
        opt.zero_grad()
        calls = micro_batches(step, data[step])
        for k, (x, y, mask, ids) in enumerate(calls):
            mine = slice(rank, None, world)
            with no_sync() if k < len(calls) - 1 else contextlib.nullcontext():
                losses = losses_of(model, x[mine], y[mine])
                if rec is None:  # replaying committed steps, unrecorded
                    m = mask[mine].float()
                    per_datum = (losses * m).sum(1) / m.sum(1)
                    per_datum.mean().backward()
                else:
                    rec.backward(losses, mask=mask[mine], datum_ids=ids[mine], step=step)
        if crash_at == step and rank == 1:
            rec.flush()  # its part of the step before is written (not racing the kill)
            os.kill(os.getpid(), signal.SIGKILL)
        if rec is not None:
            on_grads(step)
        opt.step()


def save_grads(model: nn.Module, out: Path, step: int, rank: int) -> None:
    """Every parameter's whole ``p.grad`` (gathered from FSDP2's shards) into ``out``."""
    from gradlog.distributed import dense

    grads = {n: dense(p.grad).detach().numpy() for n, p in model.named_parameters()
             if p.grad is not None}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / f"step-{step}.npz", **{n.replace(".", "/"): g for n, g in grads.items()})


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store, steps, strategy, form = sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7]
    crash_at = int(sys.argv[8]) if len(sys.argv) > 8 and sys.argv[8] != "-" else None
    resume = sys.argv[9:10] == ["resume"]
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    import gradlog
    import gradlog.store.writer as writer

    writer.RANK_COMMIT_TIMEOUT_S = 5.0  # a killed rank fails the commit quickly
    model, data = model_and_data(steps)

    if strategy == "fsdp2":
        from gradlog.distributed import fsdp2_module_class

        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.4-2.5
            from torch.distributed._composable.fsdp import fully_shard
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        trained: nn.Module = model
        assert type(model.blocks[0].attn.q).__name__ == "FSDPLinear"
        assert fsdp2_module_class() is not None

        @contextlib.contextmanager
        def fsdp_no_sync() -> Iterator[None]:
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]

        sync_off: Callable[[], contextlib.AbstractContextManager[None]] = fsdp_no_sync
    else:
        trained = nn.parallel.DistributedDataParallel(model)
        sync_off = trained.no_sync  # type: ignore[assignment]
    first = 0
    if resume:  # replay the committed steps' updates, unrecorded
        done = gradlog.open(store).steps.column("step").to_pylist()
        first = max(done) + 1 if done else 0
        train(trained, data[:first], None, 0, rank=rank, world=world, no_sync=sync_off)
    grads_dir = Path(store + ".grads")
    try:
        with gradlog.GradRecorder(trained, store, check_every=1, resume=resume,
                                  **recorder_options(form)) as rec:
            train(trained, data, rec, first, rank=rank, world=world, no_sync=sync_off,
                  on_grads=lambda s: save_grads(model, grads_dir, s, rank), crash_at=crash_at)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
