"""The built-in run behind ``gradlog train``: a character-level GPT on the shipped corpus.

The default is made to be read: a small training set (64 windows of 32 characters) seen over
8 epochs, so every datum recurs at 8 steps; 4 held-out windows recorded as probes at every
step, so ``gradlog influence RUN --probe 0`` ranks the training windows that helped and hurt
one of them; plain SGD, under which TracIn's score is the first-order change of the probe's
loss; and full gradients of the last block's MLP and the output layer only, so the store stays
small (25 MiB in 330 files). It takes 10-13 s of CPU time (measured on a shared 2-core
machine, imports included).

Kept in the library (not the CLI) so that it is usable and testable from Python; the CLI
only parses options and displays progress and the summary.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradlog.demo.data import CharCorpus, load_corpus
from gradlog.demo.model import CharGPT, GPTConfig
from gradlog.errors import InputError
from gradlog.recorder import GradRecorder
from gradlog.store.dtypes import storage_dtype

__all__ = ["TrainSummary", "default_params", "describe_plan", "train_demo"]

_PAIR_EVERY = 2  # time a plain step before every 2nd recorded step, for the overhead ratio


@dataclass(frozen=True)
class TrainSummary:
    """What a demo run did, for the CLI's summary."""

    path: str
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
    files: int = 0
    """Files (objects) the store holds."""
    datums: int = 0
    """Distinct datums recorded."""
    proponent: int | None = None
    """The training datum that lowered probe 0's loss most (TracIn), when probes were kept."""
    windows: dict[int, str] = field(default_factory=dict)
    """Each training datum's text, by datum id (its window index in the corpus)."""
    probes: dict[int, str] = field(default_factory=dict)
    """Each probe's text, by probe id."""
    gradients: bool = True
    """Whether some recorded parameter keeps gradients: False when every one was recorded
    with form ``norm`` (only norms: no influence on a probe, so no ``proponent``)."""

    @property
    def overhead(self) -> float | None:
        """Median recorded step time / median plain step time (paired on the same batches);
        None when the run was too short to time a pair (``timed_steps_needed``)."""
        if self.recorded_step_s is None or not self.plain_step_s:
            return None
        return self.recorded_step_s / self.plain_step_s


def default_params(n_layer: int) -> list[str]:
    """The parameters the demo records by default: the output layer and the last block's MLP
    weights (10K of the model's 30K elements at the default width), in full."""
    return ["head.weight", f"blocks.{n_layer - 1}.mlp.*.weight"]


def _loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)  # (B, T, V)
    return torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), y, reduction="none"
    )  # (B, T)


def train_demo(
    out: str | os.PathLike[str] | Any,
    *,
    steps: int = 32,
    batch_size: int = 16,
    seq_len: int = 32,
    windows: int | None = 64,
    probes: int = 4,
    n_layer: int = 2,
    n_embd: int = 32,
    params: str | Sequence[str] | None = None,
    backend: str = "auto",
    dtype: str = "float32",
    every: int = 1,
    lr: float = 1.0,
    seed: int = 0,
    overwrite: bool = False,
    on_step: Callable[[int, float], None] | None = None,
    on_start: Callable[[GradRecorder], None] | None = None,
    form: Any = "full",
    batch_grad: str = "autograd",
    threads: int | None = 1,
) -> TrainSummary:
    """Train the built-in character-level GPT for ``steps`` SGD steps, recording into ``out``.

    Args:
        out: Store path or URL (or a :class:`gradlog.store.fs.ObjectPath`).
        steps: Optimizer steps.
        batch_size: Sequences per step (each one datum; its id is its window in the corpus).
        seq_len: Characters per sequence.
        windows: Train on the first ``windows`` windows of the corpus (each seen once per
            epoch); None: on every window not held out as a probe.
        probes: Held-out windows (the ones after the training windows) whose gradients are
            recorded at every recorded step, as probes 0..probes-1 (``run.influence``);
            0: none (object stores do not keep probes yet).
        n_layer: Transformer blocks.
        n_embd: Model width.
        params: Glob pattern(s) of the parameters to record; None: :func:`default_params`.
        backend: Per-datum gradient backend.
        dtype: Storage dtype.
        every: Record every N-th step.
        lr: SGD learning rate (plain SGD: TracIn's score is then the first-order change of a
            probe's loss).
        seed: Seed of the weights and of the data order.
        overwrite: Replace an existing store at ``out``.
        on_step: Called after each step with (step, mean loss).
        on_start: Called once recording has started, with the recorder.
        form: How per-datum gradients are kept (``GradRecorder(form=...)``).
        batch_grad: ``GradRecorder(batch_grad=...)``: ``"sum"`` skips autograd's own
            weight-gradient matmul of the recorded Linear layers.
        threads: torch's intra-op threads while training (restored after); None: unchanged.
            The model is tiny: one thread computes it fastest and leaves a core to the
            writer (on the 2-core development machine, while shared, 2 threads made the
            default run 5-9x slower).

    Raises:
        InputError: ``windows`` and ``probes`` ask for more windows than the corpus has, or
            a negative count; ``batch_size`` is larger than ``windows``.
    """
    corpus = CharCorpus(load_corpus())
    available = corpus.dataset(seq_len)
    # every window: all but the probes, which are the last ones (held out after the training set)
    train_windows = available - max(probes, 0) if windows is None else windows
    if probes < 0 or train_windows < 1 or train_windows + probes > available:
        raise InputError(
            f"{train_windows} training windows and {probes} probes of {seq_len} characters "
            f"need {train_windows + probes} windows; the corpus has {available}. Ask for "
            "fewer windows or probes (probes >= 0), or shorter sequences."
        )
    if not 1 <= batch_size <= train_windows:  # before the store is created
        raise InputError(
            f"a batch of {batch_size} sequences needs at least {batch_size} training windows; "
            f"{train_windows} were asked for (`gradlog train`: --batch-size <= --windows)."
        )
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(
            out, corpus, steps=steps, batch_size=batch_size, seq_len=seq_len,
            windows=train_windows, probes=probes, n_layer=n_layer, n_embd=n_embd,
            params=default_params(n_layer) if params is None else params, backend=backend,
            dtype=dtype, every=every, lr=lr, seed=seed, overwrite=overwrite, on_step=on_step,
            on_start=on_start, form=form, batch_grad=batch_grad,
        )
    finally:
        torch.set_num_threads(saved_threads)


def _train(
    out: Any, corpus: CharCorpus, *, steps: int, batch_size: int, seq_len: int, windows: int,
    probes: int, n_layer: int, n_embd: int, params: str | Sequence[str], backend: str,
    dtype: str, every: int, lr: float, seed: int, overwrite: bool,
    on_step: Callable[[int, float], None] | None,
    on_start: Callable[[GradRecorder], None] | None, form: Any, batch_grad: str,
) -> TrainSummary:
    """:func:`train_demo` once its arguments are checked and torch's threads set."""
    torch.manual_seed(seed)
    config = GPTConfig(
        vocab_size=corpus.vocab_size, block_size=seq_len, n_layer=n_layer, n_embd=n_embd
    )
    model = CharGPT(config)
    # A shadow copy takes a plain step on the same batch just before some recorded steps:
    # paired timings give the recording overhead on a noisy machine; the run is untouched.
    shadow = copy.deepcopy(model)
    shadow_opt = torch.optim.SGD(shadow.parameters(), lr=lr)

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    held_out = range(windows, windows + probes)  # the windows after the training set
    pairs = [corpus.window(i, seq_len) for i in held_out]
    probe_set = (_loss_fn, (torch.stack([x for x, _ in pairs]),
                            torch.stack([y for _, y in pairs]))) if pairs else None
    plain_times: list[float] = []
    step_times: list[float] = []
    loss = float("nan")
    metadata = {"demo": "CharGPT on the shipped corpus", "seq_len": seq_len, "seed": seed,
                "windows": windows, "probe_windows": list(held_out)}
    with GradRecorder(
        model, out, params=params, backend=backend, dtype=dtype, every=every, optimizer=opt,
        overwrite=overwrite, metadata=metadata, form=form, batch_grad=batch_grad,
        # the planned size is checked against free disk space, which an object store (an
        # ObjectPath: a URL opened with storage options) has none of to check
        planned_steps=(steps + every - 1) // every if isinstance(out, (str, os.PathLike))
        else None,
        probes=probe_set,
    ) as rec:
        if on_start is not None:
            on_start(rec)
        batches = corpus.batches(batch_size, seq_len, steps, seed, windows=windows)
        for step, (x, y, ids) in enumerate(batches):
            # Every 2nd *recorded* step (step // every counts them), skipping the first one
            # (warm-up: planning, allocation, self-check): steps 1, 3, ... for every=1, every,
            # 3 * every, ... otherwise. Counting raw steps never paired an even `every`.
            paired = step % every == 0 and (step // every) % _PAIR_EVERY == 1
            # the shadow's own warm-up (first backward) is left untimed too
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
    # form 'norm' keeps only norms: a probe's influence needs the training data's gradients
    gradients = any(f != "norm" for f in run.params.column("form").to_pylist())
    with warnings.catch_warnings():  # a projection form's "estimate" note: the summary's
        warnings.simplefilter("ignore")  # one-line hint needs none (gradlog influence says it)
        top = run.influence(0, top=1).to_pylist() if pairs and gradients else []
    proponent = next((r["datum_id"] for r in top if r["kind"] == "proponent"), None)
    return TrainSummary(
        path=str(run.path),
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
        files=sum(1 for f in run.path.rglob("*") if f.is_file()),
        datums=len(set(run.datums.column("datum_id").to_pylist())),
        windows={i: corpus.decode(corpus.window(i, seq_len)[0]) for i in range(windows)},
        probes={k: corpus.decode(x) for k, (x, _) in enumerate(pairs)},
        proponent=proponent,
        gradients=gradients,
    )


def describe_plan(
    rec: GradRecorder, steps: int, batch_size: int, probes: int = 0
) -> dict[str, Any]:
    """Bytes per recorded step and the projected size of the run (before compression).

    Returns:
        ``records_bytes_per_step``: the batch's records, by their forms (None while those are
        not planned: until the first recorded step, unless every form is ``full``);
        ``probe_bytes_per_step``: the probes', always kept in full; ``bytes_per_step`` and
        ``projected_bytes``: their sum, and for the run (None while the records' are).
    """
    full_record = sum(p.numel() for p in rec.params.values()) * storage_dtype(
        rec.config.dtype).itemsize
    planned = rec.forms is not None or all(request == "full" for _, request in rec.config.form)
    records = rec.bytes_per_record * batch_size if planned else None
    probe_bytes = full_record * probes
    per_step = None if records is None else records + probe_bytes
    recorded = (steps + rec.config.every - 1) // rec.config.every
    return {"records_bytes_per_step": records, "probe_bytes_per_step": probe_bytes,
            "bytes_per_step": per_step,
            "projected_bytes": None if per_step is None else per_step * recorded}
