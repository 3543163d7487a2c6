"""The built-in run behind ``gradlog train``: a character-level GPT on the shipped corpus.

Kept in the library (not the CLI) so that it is usable and testable from Python; the CLI
only parses options and displays progress and the summary.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradlog.demo.data import CharCorpus, load_corpus
from gradlog.demo.model import CharGPT, GPTConfig
from gradlog.recorder import GradRecorder

__all__ = ["TrainSummary", "describe_plan", "train_demo"]

_PAIR_EVERY = 2  # time a plain step before every 2nd recorded step, for the overhead ratio


@dataclass(frozen=True)
class TrainSummary:
    """What a demo run did, for the CLI's summary."""

    path: Path
    steps: int
    records: int
    params: int
    param_elements: int
    bytes_on_disk: int
    final_loss: float
    plain_step_s: float | None
    recorded_step_s: float | None
    compute_s: float
    write_s: float
    timed_steps_needed: int = 2
    """Steps a run needs for the step times to be measured (None above when it had fewer)."""

    @property
    def overhead(self) -> float | None:
        """Median recorded step time / median plain step time (paired on the same batches);
        None when the run was too short to time a pair (``timed_steps_needed``)."""
        if self.recorded_step_s is None or not self.plain_step_s:
            return None
        return self.recorded_step_s / self.plain_step_s


def _loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)  # (B, T, V)
    return torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), y, reduction="none"
    )  # (B, T)


def train_demo(
    out: str | os.PathLike[str],
    *,
    steps: int = 100,
    batch_size: int = 8,
    seq_len: int = 64,
    n_layer: int = 2,
    n_embd: int = 48,
    params: str | Sequence[str] = "*",
    backend: str = "auto",
    dtype: str = "float32",
    every: int = 1,
    lr: float = 3e-3,
    seed: int = 0,
    overwrite: bool = False,
    on_step: Callable[[int, float], None] | None = None,
    on_start: Callable[[GradRecorder], None] | None = None,
    form: Any = "full",
    batch_grad: str = "autograd",
) -> TrainSummary:
    """Train the built-in character-level GPT for ``steps`` steps, recording into ``out``.

    Args:
        out: Store path.
        steps: Optimizer steps.
        batch_size: Sequences per step (each one datum; its id is its window in the corpus).
        seq_len: Characters per sequence.
        n_layer: Transformer blocks.
        n_embd: Model width.
        params: Glob pattern(s) of the parameters to record.
        backend: Per-datum gradient backend.
        dtype: Storage dtype.
        every: Record every N-th step.
        lr: AdamW learning rate.
        seed: Seed of the weights and of the data order.
        overwrite: Replace an existing store at ``out``.
        on_step: Called after each step with (step, mean loss).
        on_start: Called once recording has started, with the recorder.
        form: How per-datum gradients are kept (``GradRecorder(form=...)``).
        batch_grad: ``GradRecorder(batch_grad=...)``: ``"sum"`` skips autograd's own
            weight-gradient matmul of the recorded Linear layers.
    """
    torch.manual_seed(seed)
    corpus = CharCorpus(load_corpus())
    config = GPTConfig(
        vocab_size=corpus.vocab_size, block_size=seq_len, n_layer=n_layer, n_embd=n_embd
    )
    model = CharGPT(config)
    # A shadow copy takes a plain step on the same batch just before some recorded steps:
    # paired timings give the recording overhead on a noisy machine; the run is untouched.
    shadow = copy.deepcopy(model)
    shadow_opt = torch.optim.AdamW(shadow.parameters(), lr=lr)

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    plain_times: list[float] = []
    step_times: list[float] = []
    loss = float("nan")
    metadata = {"demo": "CharGPT on the shipped corpus", "seq_len": seq_len, "seed": seed}
    with GradRecorder(
        model, out, params=params, backend=backend, dtype=dtype, every=every, optimizer=opt,
        overwrite=overwrite, metadata=metadata, form=form, batch_grad=batch_grad,
        planned_steps=(steps + every - 1) // every,
    ) as rec:
        if on_start is not None:
            on_start(rec)
        for step, (x, y, ids) in enumerate(corpus.batches(batch_size, seq_len, steps, seed)):
            # Every 2nd *recorded* step (step // every counts them), skipping the first one
            # (warm-up: planning, allocation, self-check): steps 1, 3, ... for every=1, every,
            # 3 * every, ... otherwise. Counting raw steps never paired an even `every`.
            paired = step % every == 0 and (step // every) % _PAIR_EVERY == 1
            # the shadow's own warm-up (first backward, AdamW state) is left untimed too
            if paired or (step == 0 and steps > every):
                t0 = time.perf_counter()
                _loss_fn(shadow, (x, y)).mean(1).mean().backward()
                shadow_opt.step()
                shadow_opt.zero_grad(set_to_none=True)
                if paired:
                    plain_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            losses = rec.step(_loss_fn, (x, y), datum_ids=ids, step=step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if paired:
                step_times.append(time.perf_counter() - t0)
            loss = float(losses.mean())
            if on_step is not None:
                on_step(step, loss)

    from gradlog.run import Run

    run = Run(out)
    table = run.steps
    return TrainSummary(
        path=Path(out),
        steps=table.num_rows,
        records=run.datums.num_rows,
        params=len(run.param_names),
        param_elements=sum(run.params.column("numel").to_pylist()),
        bytes_on_disk=run.nbytes,
        final_loss=loss,
        plain_step_s=statistics.median(plain_times) if plain_times else None,
        recorded_step_s=statistics.median(step_times) if step_times else None,
        compute_s=float(sum(table.column("time_compute_s").to_pylist())),
        write_s=float(sum(table.column("time_write_s").to_pylist())),
        timed_steps_needed=every + 1,  # the first paired step is step `every`
    )


def describe_plan(rec: GradRecorder, steps: int, batch_size: int) -> dict[str, Any]:
    """Bytes per step and the projected size of the run (before compression)."""
    per_step = rec.bytes_per_record * batch_size
    recorded = (steps + rec.config.every - 1) // rec.config.every
    return {"bytes_per_step": per_step, "projected_bytes": per_step * recorded}
