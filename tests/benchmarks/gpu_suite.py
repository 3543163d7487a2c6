"""The GPU suite in one command: the ``gpu`` tests, then gradlog's CUDA benchmarks.

Usage::

    python tests/benchmarks/gpu_suite.py                 # on a CUDA machine: tests + tables
    python tests/benchmarks/gpu_suite.py --cpu           # tiny shapes on the CPU (< 1 minute)
    python tests/benchmarks/gpu_suite.py --out results.md --sections forms,head
    python tests/benchmarks/gpu_suite.py --shapes gpt --forms projection,norm --reps 9
    # issue 21's compact-form target and its floor first, in one call of a short lease:
    python tests/benchmarks/gpu_suite.py --sections tests,forms,floor --forms norm,projection \
        --batch-grads sum --reps 3

gradlog must be installed (``pip install -e .``; on a machine without a package index, with
the dependencies carried as wheels: ``pip install --no-deps --no-build-isolation -e .``): a
source folder on ``PYTHONPATH`` lacks ``gradlog.schemas`` and ``gradlog.cli``, and the suite
refuses it.

``--out FILE`` also writes the tables to FILE (and the whole pytest output to
``FILE.pytest.txt``); ``--workdir`` is where temporary stores go (the Writer table's disk).

Without CUDA the suite runs in ``--cpu`` mode by itself. It uses gradlog's public API only
(``GradRecorder``, ``gradlog.open``, ``gradlog.memory.chunked_linear_loss``, the model builders
of ``gradlog.testing``), so it measures what a user gets.

Sections (``--sections``, comma-separated; all by default, run in the order given; the
default runs tests, profile, floor, head, writer, then forms, whose rows go from the compact
forms to ``full``, so that a run stopped by a device-time limit has the tables that say most):

- ``tests``: ``pytest -m gpu`` over every test file holding a ``gpu`` mark
  (``tests/test_gpu.py``: every backend and the zoo on CUDA, bf16 autocast, no
  synchronisation per layer, pinned staging; and the others). The summary line is printed.
- ``forms`` (table "Compute"): a recorded step as a ratio to a plain step, for a GPT-2-small
  shape (``gradlog.demo`` GPT: vocab 50257, d 768, 12 layers, 12 heads, tied head, T 1024, B
  8) and a ~1B Llama shape (``gradlog.testing.llama``: vocab 32000, dim 2048, 16 layers, 16
  heads, SwiGLU 5632, T 256, B 4; its head through ``chunked_linear_loss``), random init,
  float32 parameters, bf16 autocast, SGD. ``--shapes llama-8k``: the same Llama at T 2048
  (8K tokens a step), where its plain step keeps the device busy (at T 256 the device idles
  most of a plain step, waiting on the host, so any host work shows whole). Every form
  (norm, projection dim 1024, auto within 1% of full's bytes, topk 1%, auto, full) with
  ``batch_grad="autograd"`` and ``"sum"``; hooks backend. Paired: every repetition runs
  ``--block`` plain steps on a hook-free copy of the model and then ``--block`` recorded
  steps on a second copy (forward, ``rec.backward``, optimizer step, ``rec.flush()`` after
  the block: the D2H copies and the writer's work are included, overlapped as in training),
  timed with CUDA events after a ``torch.cuda.synchronize``; the table gives the median over
  repetitions of the ratio and the median per-step times. Stores go to a temporary folder
  under ``--workdir`` (``durable=False``: the page cache absorbs the writes, disk is the
  next table's job). ``full`` of the Llama shape (15 GB per step) is left to the writer
  table's model.
- ``profile`` (tables "Where the time goes"): ``torch.profiler`` over a plain and a recorded
  step (``batch_grad="sum"``; forms ``--profile-forms``, default ``norm`` and ``projection``)
  of each shape: the operations and kernels with the most self device time (self CPU time
  with ``--cpu``) per recorded step beside the same rows of the plain step, so that a GPU
  session sees at once whether per-datum matmuls, norms, casts or copies take the time
  (a kernel's name says e.g. whether a matmul ran on tensor cores); then the synchronising
  calls of one recorded step at that shape, under autocast, with where each was made
  (``torch.cuda.set_sync_debug_mode``; the GPU tests check them at a tiny float32 GPT).
- ``floor`` (table "The device's floor"): what a compact form's step cannot do without on
  the device, per shape: a plain step, and the arithmetic every Linear layer's per-datum
  gradients add to it, timed alone on tensors captured from one step (inputs ``A`` and
  output gradients ``G`` of every call whose input has the batch first): the per-datum
  matmuls ``G_b^T A_b`` by gradlog's own kernel (``gradlog.grads.outer_sums``: bf16 operands
  into float32 on tensor cores where torch has it), their exact norms
  (``gradlog.grads.float64_sqnorms``), a projection to 1024 dims from them, and the batch
  weight-gradient matmuls ``G^T A`` that summing the per-datum ones could replace
  (``batch_grad="sum"``). Ratios: (plain + matmuls + norms) / plain, the floor of ``norm``
  with the plain step's own weight gradients, and the same without the batch matmuls (the
  fused floor). The Llama's head runs on flattened chunks and is left out.
- ``writer`` (table "Writer"): the GPT-2-small shape at B 4 recording ``full`` float32 to
  local disk (``durable=True``, fsync per step), steady state over several steps, against
  max(plain step, device-to-host copy of the step's records into pinned memory, raw
  ``tofile`` + ``fsync`` of as many bytes in the same folder).
- ``head`` (table "Chunked head"): the memory puzzle's head, batch 4, length 4096, hidden 4096,
  vocab 128256 (Llama 3), bf16 autocast: the naive head against ``chunked_linear_loss``
  (mean, and ``reduction="none"`` as per-datum recording needs), and ``reduction="none"``
  recorded by a ``GradRecorder`` (form ``norm``); peak ``torch.cuda.max_memory_allocated``
  above what was allocated before the step, and median time.

``--cpu`` shrinks every shape (a few layers, widths of 32-64) and repetitions so that the whole
run takes seconds: ``tests/test_gpu.py::test_gpu_suite_cpu_mode_runs`` keeps it alive in CI.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.memory import chunked_linear_loss
from gradlog.testing import zoo
from gradlog.testing.llama import LlamaConfig, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
# Quick and telling sections first, the long Compute table last, and in it the compact forms
# before the heavy full ones: a run cut short by a lease's device time keeps what matters.
SECTIONS = ["tests", "profile", "floor", "head", "writer", "forms"]


@dataclass(frozen=True)
class Shape:
    """A model shape for the Compute and Writer tables."""

    label: str
    kind: str  # "gpt" or "llama"
    vocab: int
    d: int
    layers: int
    heads: int
    T: int
    B: int
    hidden: int = 0  # Llama's SwiGLU size
    key: str = ""  # what --shapes names it (default: kind)

    @property
    def name(self) -> str:
        return self.key or self.kind


GPU_SHAPES = [
    Shape("GPT-2 small", "gpt", 50257, 768, 12, 12, 1024, 8),
    Shape("Llama ~1B", "llama", 32000, 2048, 16, 16, 256, 4, hidden=5632),
    # (only with --shapes llama-8k) the same model at 8K tokens a step, where the plain step
    # is no longer waiting on the host: what recording costs a training run's realistic step
    Shape("Llama ~1B, 8K tokens", "llama", 32000, 2048, 16, 16, 2048, 4, hidden=5632,
          key="llama-8k"),
]
CPU_SHAPES = [
    Shape("GPT tiny", "gpt", 96, 32, 2, 2, 16, 4),
    Shape("Llama tiny", "llama", 128, 32, 2, 4, 16, 3, hidden=64),
    Shape("Llama tiny, long", "llama", 128, 32, 2, 4, 64, 3, hidden=64, key="llama-8k"),
]
HEAVY = 512 * 2**20  # bytes per step above which a row times single steps
GPU_HEAD = {"B": 4, "T": 4096, "d": 4096, "V": 128256}
CPU_HEAD = {"B": 2, "T": 32, "d": 32, "V": 512}

# key -> (label, GradRecorder options from full's bytes per step)
FORMS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "norm": ("norm", lambda full: {"form": "norm"}),
    "projection": ("projection 1024", lambda full: {"form": {"form": "projection", "dim": 1024}}),
    "auto1": ("auto, 1% of full",
              lambda full: {"form": "auto", "form_budget": max(full // 100, 1)}),
    "topk": ("topk 1%", lambda full: {"form": {"form": "topk", "fraction": 0.01}}),
    "auto": ("auto", lambda full: {"form": "auto"}),
    "full": ("full", lambda full: {"form": "full"}),
}


class Report:
    """Prints markdown lines and keeps them for ``--out``."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.out is not None:
            self.out.write_text("\n".join(self.lines) + "\n")


# --- timing -------------------------------------------------------------------------------


class Clock:
    """Elapsed seconds of a callable: CUDA events after a synchronize, or perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any]) -> float:
        self.sync()
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


# --- models -------------------------------------------------------------------------------


def build(shape: Shape, device: torch.device) -> nn.Module:
    """Random-init float32 model of ``shape`` on ``device`` (seeded, no download)."""
    if shape.kind == "gpt":
        model: nn.Module = zoo.tiny_gpt(
            vocab=shape.vocab, block_size=shape.T, n_layer=shape.layers, n_head=shape.heads,
            n_embd=shape.d, tie_weights=True, dtype=torch.float32,
        )
    else:
        config = LlamaConfig(vocab_size=shape.vocab, dim=shape.d, n_layers=shape.layers,
                             n_heads=shape.heads, hidden_dim=shape.hidden, max_seq_len=shape.T)
        model = tiny_llama(config, dtype=torch.float32)
    return model.to(device).train()


def batch_of(shape: Shape, device: torch.device, B: int | None = None) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab, (B or shape.B, shape.T + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (B, T) each


def _row_ce(x: torch.Tensor, head: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(x).float(), y, reduction="none")  # (rows,)


def token_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy ``(B, T)``; the Llama's head runs chunked."""
    if hasattr(model, "hidden"):
        return chunked_linear_loss(model.hidden(x), model.lm_head, y, _row_ce, reduction="none")
    return zoo.per_token_ce(model(x), y)  # (B, T)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[Any, Any], rec: Any, amp: bool
) -> None:
    """Forward (bf16 autocast when ``amp``), backward (recorded when ``rec``), SGD step."""
    x, y = batch
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        losses = token_losses(model, x, y)  # (B, T)
    if rec is None:
        losses.mean(1).mean().backward()
    else:
        rec.backward(losses)
    opt.step()
    opt.zero_grad(set_to_none=True)


def block_of(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Any, rec: Any, amp: bool, n: int
) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            train_step(model, opt, batch, rec, amp)
        if rec is not None:
            rec.flush()

    return run


# --- sections -----------------------------------------------------------------------------


def section_tests(say: Report, args: argparse.Namespace) -> None:
    files = sorted(str(p) for p in (ROOT / "tests").glob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEsxX", "--tb=short",
           "-p", "no:cacheprovider", *files]
    say("## GPU tests")
    say()
    say(f"`pytest -m gpu` over {', '.join(Path(f).name for f in files)}")
    say()
    # run from elsewhere so that the installed gradlog is imported, not the source folder
    done = subprocess.run(cmd, cwd=args.workdir, capture_output=True, text=True, check=False)
    print(done.stdout[-20000:], done.stderr[-5000:], flush=True)
    if args.out is not None:  # the whole pytest output beside the tables
        args.out.with_suffix(".pytest.txt").write_text(done.stdout + done.stderr)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else done.stderr.strip().splitlines()[-1:]
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "XFAIL", "XPASS"))]
    say(f"result (exit {done.returncode}): `{summary}`")
    for ln in failed[:40]:
        say(f"- `{ln[:300]}`")
    say()


def section_forms(say: Report, args: argparse.Namespace, device: torch.device) -> None:
    clock = Clock(device)
    for shape in args.shapes:
        say(f"## Compute: {shape.label} (vocab {shape.vocab}, d {shape.d}, {shape.layers} "
            f"layers, T {shape.T}, B {shape.B}{', bf16 autocast' if args.amp else ''})")
        say()
        plain_model = build(shape, device)
        model = copy.deepcopy(plain_model)
        n_params = sum(p.numel() for p in model.parameters())
        full = 4 * shape.B * n_params
        say(f"{n_params / 1e6:.1f}M parameters; full float32 records {fmt_bytes(full)} per step; "
            f"{args.reps} paired reps of {args.block} steps each (rows storing over "
            f"{fmt_bytes(HEAVY)} per step: {max(2, args.reps - 2)} reps of 1 step)")
        say()
        say("| form | batch_grad | stored per step | plain ms | recorded ms "
            "| recorded / plain (median) | min-max |")
        say("|---|---|---|---|---|---|---|")
        batch = batch_of(shape, device)
        plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for key in args.forms:
            label, options = FORMS[key]
            for batch_grad in args.batch_grads:
                if label == "full" and shape.kind == "llama" and not args.cpu:
                    say(f"| {label} | {batch_grad} | {fmt_bytes(full)} | - | - | - | not run: "
                        "see the Writer table |")
                    continue
                try:
                    row = _form_row(args, clock, device, plain_model, model, plain_opt, opt,
                                    batch, options(full), batch_grad)
                except Exception as e:  # a failure is a result: report it, go on
                    traceback.print_exc()
                    row = f"- | - | - | ERROR {type(e).__name__}: {str(e)[:200]} | - "
                say(f"| {label} | {batch_grad} | {row} |")
        say()
        del plain_model, model, plain_opt, opt
        _free(device)


def _form_row(
    args: argparse.Namespace, clock: Clock, device: torch.device, plain_model: nn.Module,
    model: nn.Module, plain_opt: Any, opt: Any, batch: Any, options: dict[str, Any],
    batch_grad: str,
) -> str:
    root = Path(tempfile.mkdtemp(prefix="gpu_suite_", dir=args.workdir))
    try:
        with gradlog.GradRecorder(model, root / "run.gradlog", check_every=0, durable=False,
                                  batch_grad=batch_grad, **options) as rec:
            for _ in range(args.warmup):  # the first plans the forms and checks a datum
                clock(block_of(plain_model, plain_opt, batch, None, args.amp, 1))
                clock(block_of(model, opt, batch, rec, args.amp, 1))
            stored = rec.bytes_per_record * batch[0].shape[0]
            heavy = stored > HEAVY  # seconds per step: single steps, fewer repetitions
            n, reps = (1, max(2, args.reps - 2)) if heavy else (args.block, args.reps)
            plain = block_of(plain_model, plain_opt, batch, None, args.amp, n)
            recorded = block_of(model, opt, batch, rec, args.amp, n)
            ratios, tp, tr = [], [], []
            for _ in range(reps):
                a = clock(plain)
                b = clock(recorded)
                ratios.append(b / a)
                tp.append(a / n)
                tr.append(b / n)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return (f"{fmt_bytes(stored)} | {statistics.median(tp) * 1e3:.1f} | "
            f"{statistics.median(tr) * 1e3:.1f} | **{statistics.median(ratios):.3f}** | "
            f"{min(ratios):.3f}-{max(ratios):.3f}")


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _fs_of(path: Path) -> str:
    """The file system type of ``path`` (from /proc/mounts), for the record."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if str(path.resolve()).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], f"{parts[2]} on {parts[1]}"
    except OSError:
        pass
    return kind


def section_writer(say: Report, args: argparse.Namespace, device: torch.device) -> None:
    shape = args.shapes[0]
    B = max(1, shape.B // 2)
    clock = Clock(device)
    say(f"## Writer: {shape.label}, B {B}, form full float32 to local disk (durable=True)")
    say()
    plain_model = build(shape, device)
    model = copy.deepcopy(plain_model)
    batch = batch_of(shape, device, B)
    payload = 4 * B * sum(p.numel() for p in model.parameters())
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    root = Path(tempfile.mkdtemp(prefix="gpu_suite_w_", dir=args.workdir))
    try:
        plain = block_of(plain_model, plain_opt, batch, None, args.amp, 1)
        clock(plain)
        compute = statistics.median(clock(plain) for _ in range(max(3, args.reps)))
        d2h = _d2h_seconds(payload, device, clock)
        disk = _disk_seconds(payload, root, reps=2)
        steps = args.writer_steps
        with gradlog.GradRecorder(model, root / "run.gradlog", check_every=0,
                                  durable=True) as rec:
            clock(block_of(model, opt, batch, rec, args.amp, 1))  # plans, first write
            recorded = clock(block_of(model, opt, batch, rec, args.amp, steps)) / steps
        bound = max(compute, d2h, disk)
        say(f"records per step {fmt_bytes(payload)}; folder: {_fs_of(root)}")
        say()
        say("| what | per step | note |")
        say("|---|---|---|")
        say(f"| plain step (compute) | {compute * 1e3:.1f} ms | median |")
        say(f"| device -> pinned host copy of the records | {d2h * 1e3:.1f} ms | "
            f"{payload / d2h / 1e9:.1f} GB/s |")
        say(f"| raw `tofile` + `fsync`, same bytes, same folder | {disk * 1e3:.1f} ms | "
            f"{payload / disk / 1e9:.2f} GB/s |")
        say(f"| recorded step, full, steady state over {steps} steps | {recorded * 1e3:.1f} ms "
            f"| {payload / recorded / 1e9:.2f} GB/s of records |")
        say(f"| **recorded / max(compute, D2H, disk)** | **{recorded / bound:.3f}** | target "
            "<= 1.10 |")
        say()
    except Exception as e:
        traceback.print_exc()
        say(f"ERROR {type(e).__name__}: {str(e)[:300]}")
        say()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        del plain_model, model, plain_opt, opt
        _free(device)


def _d2h_seconds(nbytes: int, device: torch.device, clock: Clock) -> float:
    """Median time of one device -> pinned host copy of ``nbytes``."""
    cuda = device.type == "cuda"
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty(nbytes // 4, pin_memory=cuda)

    def copy() -> None:
        dst.copy_(src, non_blocking=cuda)

    clock(copy)
    return statistics.median(clock(copy) for _ in range(3))


def _disk_seconds(nbytes: int, root: Path, reps: int) -> float:
    """Median time to write ``nbytes`` with ``tofile`` and ``fsync`` them, in ``root``."""
    data = np.ones(nbytes // 4, dtype=np.float32)
    times = []
    for i in range(reps):
        path = root / f"raw{i}.bin"
        t = time.perf_counter()
        with open(path, "wb") as f:
            data.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t)
        path.unlink()
    return statistics.median(times)


def section_head(say: Report, args: argparse.Namespace, device: torch.device) -> None:
    s = CPU_HEAD if args.cpu else GPU_HEAD
    B, T, d, V = s["B"], s["T"], s["d"], s["V"]
    say(f"## Chunked head: B {B}, T {T}, d {d}, V {V}, bf16 autocast, float32 weights")
    say()
    say("| method | peak extra memory | vs naive | median ms |")
    say("|---|---|---|---|")
    clock = Clock(device)
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(d, V, bias=False).to(device)
    x = torch.randn(B, T, d, generator=gen).to(device).requires_grad_()  # (B, T, d)
    y = torch.randint(0, V, (B, T), generator=gen).to(device)  # (B, T)
    y[:, : T // 16] = -100  # a prompt without loss
    mask = y != -100  # (B, T)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def zero() -> None:
        x.grad = None
        head.zero_grad(set_to_none=True)

    def naive() -> None:
        zero()
        with amp:
            loss = F.cross_entropy(head(x).float().flatten(0, 1), y.flatten())
        loss.backward()

    def chunked() -> None:
        zero()
        with amp:
            loss = chunked_linear_loss(x, head, y, _row_ce)
        loss.backward()

    def chunked_none() -> None:
        zero()
        with amp:
            losses = chunked_linear_loss(x, head, y, _row_ce, reduction="none")  # (B, T)
        (losses.sum() / mask.sum()).backward()

    methods: dict[str, Callable[[], Any]] = {
        "naive (all logits)": naive,
        "chunked_linear_loss, mean": chunked,
        "chunked_linear_loss, reduction=none": chunked_none,
    }
    root = Path(tempfile.mkdtemp(prefix="gpu_suite_h_", dir=args.workdir))
    base: int | None = None
    try:
        for label, fn in methods.items():
            base = _head_row(say, label, fn, clock, device, args, base)
        with _recorded_head(head, root) as rec:

            def recorded() -> None:
                zero()
                with amp:
                    losses = chunked_linear_loss(x, head, y, _row_ce, reduction="none")
                rec.backward(losses, mask=mask)
                rec.flush()

            _head_row(say, "chunked, none, recorded (hooks, form norm)", recorded, clock,
                      device, args, base)
    except Exception as e:
        traceback.print_exc()
        say(f"| ERROR | {type(e).__name__}: {str(e)[:300]} | | |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    say()


@contextmanager
def _recorded_head(head: nn.Module, root: Path) -> Iterator[Any]:
    with gradlog.GradRecorder(head, root / "head.gradlog", form="norm", check_every=0,
                              durable=False) as rec:
        yield rec


def _head_row(
    say: Report, label: str, fn: Callable[[], Any], clock: Clock, device: torch.device,
    args: argparse.Namespace, base: int | None,
) -> int | None:
    try:
        fn()  # warm-up (kernels, allocator, the recorder's plan)
        peak: int | None = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        ms = statistics.median(clock(fn) for _ in range(max(1, min(args.reps, 3)))) * 1e3
    except Exception as e:
        traceback.print_exc()
        say(f"| {label} | ERROR {type(e).__name__}: {str(e)[:200]} | | |")
        return base
    rel = "-" if peak is None or not base else f"{peak / base:.3f}"
    say(f"| {label} | {'-' if peak is None else fmt_bytes(peak)} | {rel} | {ms:.1f} |")
    return base if base is not None else peak


def section_floor(say: Report, args: argparse.Namespace, device: torch.device) -> None:
    say("## The device's floor for compact forms (ms per step, medians of "
        f"{max(3, args.reps)})")
    say()
    say("| shape | Linear calls | plain step | per-datum matmuls | exact norms | projection | "
        "batch weight-grad matmuls | floor: (plain + matmuls + norms) / plain | "
        "fused floor (without the batch matmuls) |")
    say("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        try:
            say(_floor_row(shape, args, device))
        except Exception as e:  # a failure is a result: report it, go on
            traceback.print_exc()
            say(f"| {shape.label} | ERROR {type(e).__name__}: {str(e)[:200]} |")
        _free(device)
    say()


def _floor_row(shape: Shape, args: argparse.Namespace, device: torch.device) -> str:
    from gradlog.forms.projection import DEFAULT_DIM, balanced_ranks
    from gradlog.grads import float64_sqnorms, norm_scratch, outer_sums
    from gradlog.grads.material import MixedMatmul

    clock = Clock(device)
    reps = max(3, args.reps)
    model = build(shape, device)
    batch = batch_of(shape, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    plain = block_of(model, opt, batch, None, args.amp, 1)
    plain()  # warm-up
    plain_s = statistics.median(clock(plain) for _ in range(reps))
    captured = _capture_linears(model, batch, shape.B, args.amp)
    del model, opt
    _free(device)
    mixed = MixedMatmul.available and device.type in MixedMatmul.devices
    narrow = next((g.dtype for g, _ in captured if g.dtype != torch.float32), None)
    if narrow is not None and not mixed:  # float32 operands holding 16-bit values
        captured = [(g.float(), a.float()) for g, a in captured]
    B = shape.B
    out = torch.empty(B * max(g.shape[2] * a.shape[2] for g, a in captured),
                      dtype=torch.float32, device=device)
    scratch = norm_scratch(device)
    mats = {}
    for g, a in captured:
        ranks = balanced_ranks(DEFAULT_DIM, g.shape[2], a.shape[2])
        mats[g.shape[2], a.shape[2]] = (torch.randn(g.shape[2], ranks[0], device=device),
                                        torch.randn(a.shape[2], ranks[1], device=device))

    def per_datum(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        dst = out[: B * g.shape[2] * a.shape[2]].view(B, g.shape[2], a.shape[2])
        return outer_sums(g, a, 1.0, dst, narrow)  # (B, p, q) float32

    def matmuls() -> None:
        for g, a in captured:
            per_datum(g, a)

    def norms() -> None:
        for g, a in captured:
            float64_sqnorms(per_datum(g, a).view(B, -1), scratch)

    def projections() -> None:
        for g, a in captured:
            m0, m1 = mats[g.shape[2], a.shape[2]]
            m0.T @ (per_datum(g, a) @ m1)  # (B, r0, r1)

    def batch_matmuls() -> None:
        for g, a in captured:
            g.reshape(-1, g.shape[2]).t().mm(a.reshape(-1, a.shape[2]))

    t = {}
    for name, fn in (("matmuls", matmuls), ("norms", norms), ("projections", projections),
                     ("batch", batch_matmuls)):
        fn()  # warm-up
        t[name] = statistics.median(clock(fn) for _ in range(reps))
    norm_s, proj_s = t["norms"] - t["matmuls"], t["projections"] - t["matmuls"]
    floor = (plain_s + t["matmuls"] + norm_s) / plain_s
    fused = (plain_s - t["batch"] + t["matmuls"] + norm_s) / plain_s
    return (f"| {shape.label} | {len(captured)} | {plain_s * 1e3:.1f} | "
            f"{t['matmuls'] * 1e3:.1f} | {norm_s * 1e3:.1f} | {proj_s * 1e3:.1f} | "
            f"{t['batch'] * 1e3:.1f} | **{floor:.3f}** | **{fused:.3f}** |")


def _capture_linears(model: nn.Module, batch: Any, B: int,
                     amp: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(G, A)`` of every ``nn.Linear`` call of one step whose input has the batch first,
    as ``(B, N, d_out)`` and ``(B, N, d_in)``, in the dtypes autocast ran the call in (the
    input rounded as autocast's matmul took it)."""
    calls: list[list[Any]] = []

    def forward_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        x = args[0]
        if x.dim() >= 2 and x.shape[0] == B and output.requires_grad:
            call: list[Any] = [x.detach().to(output.dtype).reshape(B, -1, x.shape[-1])]
            calls.append(call)
            output.register_hook(lambda g: call.append(g.detach().reshape(B, -1, g.shape[-1])))

    handles = [m.register_forward_hook(forward_hook) for m in model.modules()
               if isinstance(m, nn.Linear)]
    try:
        x, y = batch
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
            losses = token_losses(model, x, y)  # (B, T)
        losses.mean(1).mean().backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return [(call[1], call[0]) for call in calls if len(call) == 2]


def section_profile(say: Report, args: argparse.Namespace, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # (torch 2.11 warns that events are cleared per cycle unless they are accumulated)
    accumulate = ({"acc_events": True}
                  if "acc_events" in inspect.signature(profile).parameters else {})
    where = "device" if cuda else "CPU"
    for shape in args.shapes:
        plain_model = build(shape, device)
        model = copy.deepcopy(plain_model)
        batch = batch_of(shape, device)
        plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for key in args.profile_forms:
            label, options = FORMS[key]
            say(f"## Where the time goes: {shape.label}, {label}, batch_grad=sum "
                f"(self {where} ms per step, {args.profile_steps} profiled steps)")
            say()
            root = Path(tempfile.mkdtemp(prefix="gpu_suite_p_", dir=args.workdir))
            try:
                full = 4 * shape.B * sum(p.numel() for p in model.parameters())
                with gradlog.GradRecorder(model, root / "run.gradlog", check_every=0,
                                          durable=False, batch_grad="sum",
                                          **options(full)) as rec:
                    rows, wall, busy = {}, {}, {}
                    for name, m, o, r in (("plain", plain_model, plain_opt, None),
                                          ("recorded", model, opt, rec)):
                        block = block_of(m, o, batch, r, args.amp, args.profile_steps)
                        block_of(m, o, batch, r, args.amp, 2)()  # warm-up: plans, kernels
                        wall[name] = Clock(device)(block) * 1e3 / args.profile_steps
                        with profile(activities=activities, **accumulate) as prof:
                            block()
                            Clock(device).sync()
                        rows[name] = _self_times(prof, cuda, args.profile_steps)
                        busy[name] = _kernel_ms(prof, args.profile_steps) if cuda else 0.0
                    # where a recorded step waits for the device (the host idles then); run
                    # on the CPU too, so that CI's --cpu run keeps this call alive
                    step = block_of(model, opt, batch, rec, args.amp, 1)
                    waits: list[str] = []
                    if cuda:
                        waits = _sync_sites(step)
                    else:
                        step()
                _profile_table(say, rows["plain"], rows["recorded"])
                say(f"| wall time per step, unprofiled (a step whose device time is well "
                    f"below it waits on the host) | {wall['recorded']:.1f} | | "
                    f"{wall['plain']:.1f} | |")
                if cuda:  # kernels alone: the rest of the wall time the device sat idle
                    say(f"| kernels alone, profiled (the device busy) | {busy['recorded']:.1f} "
                        f"| | {busy['plain']:.1f} | |")
                    say(f"| the device idle: wall - kernels | "
                        f"{wall['recorded'] - busy['recorded']:.1f} | | "
                        f"{wall['plain'] - busy['plain']:.1f} | |")
                    say()
                    say(f"Synchronising calls of one recorded step: {len(waits)}: "
                        + "; ".join(f"`{w}`" for w in waits))
            except Exception as e:  # a failure is a result: report it, go on
                traceback.print_exc()
                say(f"ERROR {type(e).__name__}: {str(e)[:300]}")
            finally:
                shutil.rmtree(root, ignore_errors=True)
            say()
        del plain_model, model, plain_opt, opt
        _free(device)


def _sync_sites(fn: Callable[[], None]) -> list[str]:
    """The synchronising CUDA calls ``fn`` makes on this thread
    (``torch.cuda.set_sync_debug_mode("warn")``), each as ``file:line function``."""
    import threading
    import warnings

    sites: list[str] = []
    main = threading.get_ident()

    def show(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if "synchroniz" in str(message) and threading.get_ident() == main:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/gradlog/" in f.filename or f.filename == __file__]
            where = frames[-1] if frames else None
            sites.append(f"{Path(filename).name}:{lineno}" + (
                f" in {where.name}" if where is not None else ""))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def _self_times(prof: Any, cuda: bool, steps: int) -> dict[str, tuple[float, float]]:
    """Per event name: (self ms per step on the device, or the CPU without CUDA; calls per
    step). Kernels and the operations that launch them are both rows on a GPU."""
    out = {}
    for e in prof.key_averages():
        if cuda:  # (torch 2.4 names it self_cuda_time_total; later ones self_device_...)
            us = getattr(e, "self_device_time_total", None)
            us = getattr(e, "self_cuda_time_total", 0) if us is None else us
        else:
            us = e.self_cpu_time_total
        out[e.key] = (us / 1e3 / steps, e.count / steps)
    return out


def _kernel_ms(prof: Any, steps: int) -> float:
    """Device ms per step spent in kernels and copies (the profiler's device events only;
    the operations that launched them are CPU events and not counted twice)."""
    from torch.autograd import DeviceType

    total = 0.0
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            us = getattr(e, "self_device_time_total", None)
            total += getattr(e, "self_cuda_time_total", 0) if us is None else us
    return total / 1e3 / steps


def _profile_table(say: Report, plain: dict[str, tuple[float, float]],
                   recorded: dict[str, tuple[float, float]], top: int = 18) -> None:
    say("| operation or kernel | recorded ms | calls | plain ms | calls |")
    say("|---|---|---|---|---|")
    extra = {k: v[0] - plain.get(k, (0.0, 0.0))[0] for k, v in recorded.items()}
    for key in sorted(extra, key=lambda k: -extra[k])[:top]:
        r, p = recorded[key], plain.get(key, (0.0, 0.0))
        say(f"| `{key[:90]}` | {r[0]:.2f} | {r[1]:.0f} | {p[0]:.2f} | {p[1]:.0f} |")
    total_r = sum(v[0] for k, v in recorded.items())
    total_p = sum(v[0] for k, v in plain.items())
    say(f"| all rows (kernels and their operations overlap on a GPU) | {total_r:.1f} | | "
        f"{total_p:.1f} | |")


# --- main ---------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest section")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--reps", type=int, default=None, help="paired repetitions per row")
    parser.add_argument("--block", type=int, default=None, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=None, help="untimed blocks per row")
    parser.add_argument("--writer-steps", type=int, default=None, help="steps of the Writer row")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated: gpt,llama (default), llama-8k")
    parser.add_argument("--forms", default=",".join(FORMS),
                        help=f"comma-separated subset of {list(FORMS)}")
    parser.add_argument("--batch-grads", default="autograd,sum",
                        help="comma-separated batch_grad modes of the Compute table")
    parser.add_argument("--profile-forms", default="norm,projection",
                        help="comma-separated forms of the profile section")
    parser.add_argument("--profile-steps", type=int, default=2,
                        help="profiled steps per row of the profile section")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="folder for temporary stores (default: the current folder)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        args.cpu = True
    small = args.cpu
    args.reps = args.reps or (1 if small else 5)
    args.block = args.block or (1 if small else 3)
    args.warmup = args.warmup if args.warmup is not None else 1
    args.writer_steps = args.writer_steps or (2 if small else 4)
    args.amp = True
    kinds = (args.shapes or "gpt,llama").split(",")
    args.shapes = [s for s in (CPU_SHAPES if small else GPU_SHAPES) if s.name in kinds]
    args.workdir = (args.workdir or Path.cwd()).resolve()
    wanted = [s for s in args.sections.split(",") if s]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.no_tests and "tests" in wanted:
        wanted.remove("tests")
    args.sections = wanted
    args.forms = [f for f in args.forms.split(",") if f]
    args.profile_forms = [f for f in args.profile_forms.split(",") if f]
    args.batch_grads = [m for m in args.batch_grads.split(",") if m]
    if not args.batch_grads or set(args.batch_grads) - {"autograd", "sum"}:
        parser.error(f"--batch-grads takes autograd and/or sum, got {args.batch_grads}")
    for forms in (args.forms, args.profile_forms):
        if set(forms) - set(FORMS):
            parser.error(f"unknown forms {sorted(set(forms) - set(FORMS))}; from {list(FORMS)}")
    return args


def check_installed() -> None:
    """Refuse a gradlog imported from an uninstalled source folder: its package data
    (``gradlog.schemas``, ``gradlog.cli``) lives at the top level and is mapped into the
    package only by an install, so ``verify`` and the CLI would fail mid-run."""
    import importlib.util

    missing = [m for m in ("gradlog.schemas", "gradlog.cli") if importlib.util.find_spec(m) is None]
    if missing:
        where = Path(gradlog.__file__).parent
        sys.exit(f"gradlog at {where} is not installed ({', '.join(missing)} cannot be "
                 "imported). Install it first: `pip install -e .`, or offline, with "
                 "its dependencies present: `pip install --no-deps --no-build-isolation -e .`.")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    check_installed()
    device = torch.device("cpu" if args.cpu else "cuda")
    say = Report(args.out)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    say(f"# GPU suite, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    say()
    say(f"device: {name or device.type}{' (--cpu: tiny shapes)' if args.cpu else ''}; "
        f"torch {torch.__version__}{cuda}; python {platform.python_version()}; "
        f"gradlog {gradlog.__version__}")
    say(f"command: `python tests/benchmarks/gpu_suite.py {' '.join(argv or sys.argv[1:])}`")
    say()
    t0 = time.perf_counter()
    for section in args.sections:
        t = time.perf_counter()
        if section == "tests":
            section_tests(say, args)
        elif section == "forms":
            section_forms(say, args, device)
        elif section == "profile":
            section_profile(say, args, device)
        elif section == "floor":
            section_floor(say, args, device)
        elif section == "writer":
            section_writer(say, args, device)
        elif section == "head":
            section_head(say, args, device)
        print(f"[{section}: {time.perf_counter() - t:.0f} s]", flush=True)
    say(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
