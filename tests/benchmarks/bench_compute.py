"""Compute cost of per-datum gradients: a recorded step as a ratio to a plain training step.

Models: the small and medium GPT of ``../shared/PEERS.md`` (token + learned position
Embedding with Hugging Face style ``[1, T]`` position ids, pre-LN blocks with Linear q/k/v/o
and a GELU MLP, final LayerNorm, untied head; small: vocab 512, d 128, 2 layers, T 64, B 16;
medium: d 256, 4 layers, T 128, B 32; host: GPT-2 small's 12 layers at vocab 64, d 16, T 16,
B 8, where a step is host work), float32, per-token cross entropy averaged per datum, mean
over the batch.

What is timed. Methods take turns (round robin), each attached once, for the whole run, to
its own copy of the model (as when recording a training run). Each repetition of a method
runs a plain step on a second, identical copy that never sees a hook (zero_grad, forward,
``losses.mean().backward()``) and right after it one step of the method (zero_grad,
forward, per-datum gradients of every parameter computed and left in memory, ``p.grad``
where the method gives it). Nothing is written to disk: this is compute only. The table shows
the median over repetitions of the paired ratio method / plain, and the median times.

What "extra memory" is. CPU tensors are allocated through malloc, which tracemalloc does not
see, and torch exposes no CPU allocator statistics; so each method also runs alone in a fresh
subprocess (same model and batch, 1 warm-up + ``--mem-reps`` steps), and its extra memory is the
process's peak RSS (``VmHWM``) minus its RSS just before the first step (Linux only). The
ratio column divides that by the same quantity for the plain step. The per-datum payload
(B x recorded parameters x 4 bytes) is printed for reference: every method that returns
per-datum gradients holds it at the end of the step.

Methods: gradlog ``hooks`` (default backend), ``vmap`` (``torch.func``; computes ``p.grad``
from the per-datum gradients), ``loop`` (one backward per datum, the test oracle), torch's
private ExpandedWeights (``call_for_per_sample_grads``; it refuses the broadcast ``[1, T]``
position ids, so it gets them expanded to ``(B, T)``), Opacus hooks if installed, and a
reference that is not a tool: ``minimum.py``, the arithmetic of ``hooks`` with
``batch_grad="sum"`` hand-written for this one model with as little Python as it allows (no
checks, no generality), and its ``bitwise p.grad`` variant with the arithmetic of the default
mode (autograd's own weight-gradient matmul beside the per-datum one). Their ratios are the
floors for any eager implementation of these rules on the machine; the ``hooks`` rows minus
them are gradlog's own bookkeeping.

End to end: the ``gradlog record, form=F`` rows run ``GradRecorder`` (hooks backend) with form
``full``, ``norm`` and ``projection`` (dim 1024), both ``batch_grad`` modes: forward,
``rec.backward``, ``rec.flush()``, the records encoded, their exact float64 norms computed
and everything written to a store (default ``durable=True``). Their floors: ``hand-written
minimum + norm`` adds the exact norms of every record to the minimum, ``+ projection`` also
projects every record as gradlog's default projection does (``minimum.with_form``).

Usage (on a shared or small machine, keep OpenMP threads from spinning between ops, and
prefer ``--clock cpu`` when other processes compete for the cores)::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_compute.py --reps 15 --sizes small
    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_compute.py --clock cpu --threads 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIZES: dict[str, dict[str, int]] = {
    "small": {"vocab": 512, "d": 128, "layers": 2, "T": 64, "B": 16},
    "medium": {"vocab": 512, "d": 256, "layers": 4, "T": 128, "B": 32},
    # GPT-2 small's depth at widths where arithmetic vanishes: a step is the host's work
    # (what runs beside the device's on a GPU; see bench_host.py)
    "host": {"vocab": 64, "d": 16, "layers": 12, "T": 16, "B": 8},
}
Step = Callable[[], Any]


def build(size: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The GPT of PEERS.md at ``size`` and one batch (x, y) of token ids (B, T)."""
    from gradlog.demo.model import CharGPT, GPTConfig

    s = SIZES[size]
    torch.manual_seed(0)
    model = CharGPT(
        GPTConfig(
            vocab_size=s["vocab"], block_size=s["T"], n_layer=s["layers"], n_head=4, n_embd=s["d"]
        )
    )
    x = torch.randint(0, s["vocab"], (s["B"], s["T"]))  # (B, T)
    y = torch.randint(0, s["vocab"], (s["B"], s["T"]))  # (B, T)
    return model, x, y


def token_losses(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per-token cross entropy (B, T); ``batch[2]``, if present, are position ids."""
    x, y = batch[0], batch[1]
    logits = model(x) if len(batch) == 2 else model(x, batch[2])  # (B, T, V)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (B, T)


def methods(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> dict[str, tuple[Callable[[], None], Step, Callable[[], None]] | str]:
    """name -> (setup, step, teardown), or a string saying why the method is unavailable."""
    from gradlog.backends import BACKENDS
    from gradlog.losses import per_datum_losses
    from gradlog.params import select_params

    params = select_params(model, ["*"])
    out: dict[str, tuple[Callable[[], None], Step, Callable[[], None]] | str] = {}

    def none() -> None:
        return None

    def plain() -> Any:
        model.zero_grad(set_to_none=True)
        token_losses(model, (x, y)).mean(1).mean().backward()

    out["plain fwd+bwd"] = (none, plain, none)

    compiled = torch.compile(model)  # (compiles at its first call: a warm-up round)

    def plain_compiled() -> Any:
        compiled.zero_grad(set_to_none=True)
        token_losses(compiled, (x, y)).mean(1).mean().backward()

    out["plain fwd+bwd, torch.compile"] = (none, plain_compiled, none)

    def reduce(raw: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return per_datum_losses(raw, mask, "mean")

    variants: list[tuple[str, str, dict[str, Any]]] = [
        ("gradlog hooks", "hooks", {}),
        ("gradlog hooks, torch.compile", "hooks", {}),
        ("gradlog hooks, batch_grad=sum", "hooks", {"batch_grad": "sum"}),
        ("gradlog vmap", "vmap", {}),
        ("gradlog loop", "loop", {}),
    ]
    for label, name, options in variants:
        # the compiled row records torch.compile(model): its paired plain step is the
        # compiled model's too (time_methods), so the ratio is recorded / plain, compiled
        backend = BACKENDS[name](
            compiled if "torch.compile" in label else model, params, batch_reduction="mean",
            randomness="different", **options
        )
        if backend.needs_loss_fn:

            def step(be: Any = backend) -> Any:
                model.zero_grad(set_to_none=True)
                return be.step(token_losses, (x, y), reduce, None, lambda losses: None)[1]
        else:

            def step(be: Any = backend) -> Any:
                be.model.zero_grad(set_to_none=True)
                losses = reduce(token_losses(be.model, (x, y)), None)  # (B,)
                return be.backward(losses, losses.mean())

        out[label] = (backend.attach, step, backend.detach)

    for form in RECORD_FORMS:
        for batch_grad in ("autograd", "sum"):
            label = f"gradlog record, form={form}" + (
                ", batch_grad=sum" if batch_grad == "sum" else "")
            out[label] = _recording(model, x, y, form, batch_grad)

    try:
        from torch.nn.utils._per_sample_grad import call_for_per_sample_grads
    except ImportError as e:  # pragma: no cover - private API
        out["torch ExpandedWeights"] = f"not importable ({e})"
    else:
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)  # (B, T): no broadcast

        def expanded() -> Any:
            model.zero_grad(set_to_none=True)
            for p in model.parameters():
                p.grad_sample = None  # type: ignore[attr-defined]
            wrapped = call_for_per_sample_grads(model, batch_size=x.shape[0], loss_reduction="mean")
            logits = wrapped(x, positions)  # (B, T, V)
            F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1).mean().backward()
            return [p.grad_sample for p in model.parameters()]  # type: ignore[attr-defined]

        out["torch ExpandedWeights"] = (none, expanded, none)

    minimum: dict[str, Step] = {}

    def minimum_setup(bitwise: bool = False) -> None:
        from minimum import minimum_step  # this folder (the script's own directory)

        minimum["step"] = minimum_step(model, x, y, token_losses, bitwise)

    out["hand-written minimum (reference)"] = (
        minimum_setup, lambda: minimum["step"](), none)
    out["hand-written minimum, bitwise p.grad (reference)"] = (
        lambda: minimum_setup(bitwise=True), lambda: minimum["step"](), none)
    for form in ("norm", "projection"):
        def floor(form: str = form) -> Any:
            from minimum import with_form

            return with_form(minimum["step"](), form)

        out[f"hand-written minimum + {form} (reference)"] = (minimum_setup, floor, none)

    try:
        from opacus import GradSampleModule
    except ImportError:
        out["Opacus hooks"] = "not installed"
    else:  # pragma: no cover - optional
        holder: dict[str, Any] = {}

        def opacus_setup() -> None:
            holder["gsm"] = GradSampleModule(model, loss_reduction="mean")

        def opacus_step() -> Any:
            gsm = holder["gsm"]
            gsm.zero_grad(set_to_none=True)
            token_losses(gsm, (x, y)).mean(1).mean().backward()
            return [p.grad_sample for p in model.parameters()]

        def opacus_teardown() -> None:
            holder.pop("gsm")._close()

        out["Opacus hooks"] = (opacus_setup, opacus_step, opacus_teardown)
    return out


RECORD_FORMS = ("full", "norm", "projection")
"""Forms of the ``gradlog record`` rows (``projection``: its default dim, 1024)."""


def _recording(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, form: str, batch_grad: str
) -> tuple[Callable[[], None], Step, Callable[[], None]]:
    """A ``GradRecorder`` end to end: forward, ``rec.backward``, ``rec.flush()`` (the step's
    records encoded in ``form`` and written to a store in a temporary folder, committed with
    the default ``durable=True``). With ``--clock cpu`` the writer threads' CPU time counts
    (not the wait for the disk); with ``--clock wall`` the whole wait for the step's write."""
    import shutil
    import tempfile

    import gradlog
    from gradlog.losses import per_datum_losses

    held: dict[str, Any] = {}

    def setup() -> None:
        held["dir"] = tempfile.mkdtemp(prefix="bench_compute_")
        held["rec"] = gradlog.GradRecorder(
            model, os.path.join(held["dir"], "run.gradlog"), form=form, batch_grad=batch_grad,
        ).__enter__()

    def step() -> Any:
        rec = held["rec"]
        model.zero_grad(set_to_none=True)
        rec.backward(per_datum_losses(token_losses(model, (x, y)), None, "mean"))
        rec.flush()

    def teardown() -> None:
        held.pop("rec").__exit__(None, None, None)
        shutil.rmtree(held.pop("dir"), ignore_errors=True)

    return setup, step, teardown


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _timed(step: Step) -> float:
    t = _clock()
    result = step()
    elapsed = _clock() - t
    del result
    return elapsed


def time_methods(size: str, names: list[str], reps: int, loop_reps: int) -> dict[str, Any]:
    """Median paired ratio and median times (s) of each method against a plain step.

    Methods take turns (round robin, rotating the order every repetition), so that load from
    other processes on a shared machine falls on every method alike. Each method has two
    identical copies of the model: one it is attached to for the whole run (as when
    recording a training run: buffers and hooks persist across steps), and one that never
    sees a hook, whose plain step runs right before each of the method's steps."""
    tables: dict[str, Any] = {}
    plains: dict[str, Step] = {}
    for name in names:
        tables[name] = methods(*build(size))
        plain = "plain fwd+bwd, torch.compile" if "torch.compile" in name else "plain fwd+bwd"
        plains[name] = methods(*build(size))[plain][1]  # type: ignore[index]
    rows: dict[str, dict[str, list[float]]] = {
        n: {"ratio": [], "plain": [], "method": []} for n in names}
    out: dict[str, Any] = {}
    for name in names:
        entry = tables[name][name]
        if isinstance(entry, str):
            out[name] = entry
        else:
            entry[0]()  # setup
    try:
        for rep in range(reps + 2):  # two warm-up rounds
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                if name in out or (name == "gradlog loop" and rep >= loop_reps + 2):
                    continue
                t0 = _timed(plains[name])
                t1 = _timed(tables[name][name][1])
                if rep >= 2:
                    rows[name]["ratio"].append(t1 / t0)
                    rows[name]["plain"].append(t0)
                    rows[name]["method"].append(t1)
    finally:
        for name in names:
            if name not in out:
                tables[name][name][2]()  # teardown
    for name, r in rows.items():
        if name in out:
            continue
        out[name] = {
            "ratio": statistics.median(r["ratio"]),
            "plain_s": statistics.median(r["plain"]),
            "method_s": statistics.median(r["method"]),
            "min_ratio": min(r["ratio"]),
            "max_ratio": max(r["ratio"]),
        }
    return out


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


def memory_child(size: str, name: str, reps: int) -> None:
    """In a fresh process: peak RSS minus RSS before the first step, printed as JSON."""
    model, x, y = build(size)
    entry = methods(model, x, y)[name]
    if isinstance(entry, str):
        print(json.dumps({"error": entry}))
        return
    setup, step, teardown = entry
    setup()
    before = _status_bytes("VmRSS")
    for _ in range(reps + 1):
        result = step()
        del result
    teardown()
    # VmHWM: this address space's peak RSS. (ru_maxrss would not do: Linux carries the
    # parent's high-water mark across fork and exec.)
    peak = _status_bytes("VmHWM")
    print(json.dumps({"extra": max(0, peak - before)}))


def memory(size: str, name: str, reps: int, threads: int | None) -> int | None:
    cmd = [
        sys.executable,
        __file__,
        "--memory-child",
        name,
        "--sizes",
        size,
        "--mem-reps",
        str(reps),
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    try:
        value = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return value.get("extra")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed pairs per method")
    parser.add_argument("--sizes", default="small", help="comma-separated: small,medium,host")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--methods", default=None, help="comma-separated subset of methods")
    parser.add_argument(
        "--loop-reps",
        type=int,
        default=3,
        help="timed pairs for the loop oracle (B backwards per step: slow)",
    )
    parser.add_argument("--mem-reps", type=int, default=2, help="steps per memory subprocess")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall time, or this process's CPU time (all its threads): steadier "
        "when other processes compete for the cores",
    )
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global _clock
    _clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            parser.error(f"unknown size {s!r}; choose from {list(SIZES)}")
    if args.memory_child:
        memory_child(sizes[0], args.memory_child, args.mem_reps)
        return

    print(
        f"# {datetime.date.today()} torch {torch.__version__} python "
        f"{platform.python_version()} threads {torch.get_num_threads()} "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} reps {args.reps} "
        f"clock {args.clock} load average {os.getloadavg()[0]:.1f}"
    )
    for size in sizes:
        model, x, y = build(size)
        names = list(methods(model, x, y))
        if args.methods:
            wanted = args.methods.split(",")
            names = [n for n in names if n == "plain fwd+bwd" or any(w in n for w in wanted)]
        n_params = sum(p.numel() for p in model.parameters())
        payload = n_params * x.shape[0] * 4
        print(
            f"\n## {size}: {SIZES[size]}, {n_params / 1e6:.2f}M parameters, per-datum payload "
            f"{payload / 2**20:.1f} MiB/step"
        )
        base_mem = (
            None if args.no_memory else memory(size, "plain fwd+bwd", args.mem_reps, args.threads)
        )
        print(
            "| method | step / plain (median) | min-max | plain ms | method ms "
            "| extra memory MiB | vs plain |"
        )
        print("|---|---|---|---|---|---|---|")
        timings = time_methods(size, names, args.reps, args.loop_reps)
        for name in names:
            timing = timings[name]
            if isinstance(timing, str):
                print(f"| {name} | - | - | - | - | - | {timing} |")
                continue
            mem = None if args.no_memory else memory(size, name, args.mem_reps, args.threads)
            mem_s = "-" if mem is None else f"{mem / 2**20:.0f}"
            rel = "-" if mem is None or not base_mem else f"{mem / base_mem:.2f}"
            print(
                f"| {name} | {timing['ratio']:.2f} | {timing['min_ratio']:.2f}-"
                f"{timing['max_ratio']:.2f} | {timing['plain_s'] * 1e3:.1f} | "
                f"{timing['method_s'] * 1e3:.1f} | {mem_s} | {rel} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
