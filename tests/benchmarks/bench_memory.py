"""Memory at language-model scale: peak memory and time of the naive vs the chunked LM head.

Sections (``--sections``, comma-separated; each is one function in ``SECTIONS`` that prints a
Markdown table, so later sections such as "recording 1 of 24 layers vs all" plug in beside):

``head``
    The projection of hidden states ``(B, T, d)`` to a vocabulary of ``V`` followed by a
    per-token cross entropy (float32 upcast), mean over tokens, forward and backward, with
    gradients for the hidden states, the head weight and its bias:

    - ``naive``: ``F.cross_entropy(linear(x).float(), y)``, all ``(B T, V)`` logits at once;
    - ``chunked C``: :func:`gradlog.memory.chunked_linear_loss` with ``chunk_size=C`` rows and
      its default schedule for a mean (gradients computed in forward, no recomputation);
    - ``chunked C recompute``: the same with ``grad_in_forward=False`` (forward without a
      graph, backward re-runs each chunk);
    - ``chunked C none``: ``reduction="none"`` per-token losses ``(B, T)`` (the input of
      ``GradRecorder.backward``), then ``.mean().backward()``; always recomputes.

What is measured.

- Peak memory: each method runs alone in a fresh subprocess (same inputs, ``--mem-reps``
  steps, ``zero_grad(set_to_none=True)`` before each, as in a training loop). CPU tensors are
  allocated through malloc, which tracemalloc does not see and torch keeps no statistics of, so
  the figure is the process's peak RSS (``VmHWM``, reset just before the first step through
  ``/proc/self/clear_refs``) minus its RSS at that moment: what the step adds on top of the
  inputs and parameters. (``ru_maxrss`` would not do: Linux carries it over ``exec`` from the
  forked parent.) Each child runs twice: with glibc's default malloc, where freed blocks below
  its dynamic mmap threshold (up to 32 MiB) stay in per-thread arenas and RSS also counts that
  fragmentation, and with ``MALLOC_MMAP_THRESHOLD_=1048576``, where every tensor of 1 MiB or
  more is mapped and unmapped on its own, so RSS follows the live tensors. On CUDA it is
  ``torch.cuda.max_memory_allocated()`` minus the allocation before the first step.
- Time: in this process, each repetition runs every method once, in turn; the table shows
  the median over repetitions (after one warm-up) of each method's time and of its ratio to
  the naive step of the same repetition. On a shared machine wall time is noisy, so the CPU
  time of the process (``time.process_time``, all threads) is shown beside it; on CUDA the
  wall time after ``torch.cuda.synchronize()``.
- Match: loss and gradients of every method against the naive head, as the largest absolute
  difference divided by the largest absolute value of the naive result (per tensor; the
  worst of loss, x, weight and bias is shown).

Usage (on a shared or small machine, keep OpenMP threads from spinning between ops)::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_memory.py --sections head --reps 5
    python tests/benchmarks/bench_memory.py --B 1 --T 256 --d 256 --V 8192 --reps 3  # quick
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

Step = Callable[[], torch.Tensor]


# --- section "head": naive vs chunked linear + cross entropy -------------------------------


def head_inputs(
    args: argparse.Namespace,
) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    """Hidden states ``x`` (B, T, d) requiring grad, the head ``nn.Linear(d, V)``, labels."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    linear = nn.Linear(args.d, args.V, device=device)
    x = torch.randn(args.B, args.T, args.d, device=device, requires_grad=True)  # (B, T, d)
    y = torch.randint(0, args.V, (args.B, args.T), device=device)  # (B, T)
    y[:, : args.T // 16] = -100  # some ignored tokens (e.g. a prompt)
    return x, linear, y


def _row_ce(x: torch.Tensor, linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(linear(x).float(), y, reduction="none")  # (rows,)


def head_methods(args: argparse.Namespace) -> list[str]:
    names = ["naive"]
    for c in args.chunk_sizes:
        names += [f"chunked {c}", f"chunked {c} recompute", f"chunked {c} none"]
    return names


def head_step(
    name: str, args: argparse.Namespace, x: torch.Tensor, linear: nn.Linear, y: torch.Tensor
) -> Step:
    """One training step of method ``name``: zero grads, forward, backward; returns the loss."""
    from gradlog.memory import chunked_linear_loss

    autocast = torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.bf16)

    def zero() -> None:
        x.grad = None
        linear.zero_grad(set_to_none=True)

    if name == "naive":

        def naive() -> torch.Tensor:
            zero()
            with autocast:
                logits = linear(x).float()  # (B, T, V)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            return loss.detach()

        return naive
    parts = name.split()
    chunk = int(parts[1])
    mode = parts[2] if len(parts) > 2 else ""

    def chunked() -> torch.Tensor:
        zero()
        with autocast:
            if mode == "none":
                losses = chunked_linear_loss(
                    x, linear, y, _row_ce, chunk_size=chunk, reduction="none"
                )  # (B, T)
                loss = losses.sum() / (y != -100).sum()
            else:
                loss = chunked_linear_loss(
                    x, linear, y, _row_ce, chunk_size=chunk, grad_in_forward=mode != "recompute"
                )
        loss.backward()
        return loss.detach()

    return chunked


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def head_memory_child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: the memory one step of ``name`` adds (bytes)."""
    # Warm up on tiny inputs first: the first matmul loads kernels and starts thread pools,
    # tens of MiB of RSS that belong to no method.
    tiny = argparse.Namespace(**{**vars(args), "B": 1, "T": 16, "d": 8, "V": 32})
    tiny.chunk_sizes = [4]
    head_step(
        name.replace(name.split()[1], "4") if name != "naive" else name, tiny, *head_inputs(tiny)
    )()
    x, linear, y = head_inputs(args)
    step = head_step(name, args, x, linear, y)
    device = x.device
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        _reset_peak_rss()
        before = _proc_status_bytes("VmRSS")
    for _ in range(args.mem_reps):
        loss = step()
        del loss
    if device.type == "cuda":
        _sync(device)
        return {"extra": torch.cuda.max_memory_allocated(device) - before}
    return {"extra": max(0, _proc_status_bytes("VmHWM") - before)}


def head_match(args: argparse.Namespace, names: list[str]) -> dict[str, float]:
    """Worst relative difference of loss and gradients of each method vs the naive head."""
    x, linear, y = head_inputs(args)
    results: dict[str, list[torch.Tensor]] = {}
    for name in names:
        loss = head_step(name, args, x, linear, y)()
        assert x.grad is not None and linear.weight.grad is not None
        grads = [x.grad, linear.weight.grad, linear.bias.grad]
        results[name] = [loss] + [g.clone() for g in grads if g is not None]
    ref = results["naive"]
    out = {}
    for name in names:
        out[name] = max(
            ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
            for a, b in zip(results[name], ref)
        )
    return out


def head_timing(args: argparse.Namespace, names: list[str]) -> dict[str, dict[str, float]]:
    """Median time (wall, CPU) and median ratio to the naive step of the same repetition."""
    x, linear, y = head_inputs(args)
    steps = {name: head_step(name, args, x, linear, y) for name in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.reps + 1):  # the first repetition warms up
        for name, step in steps.items():
            _sync(x.device)
            t_wall, t_cpu = time.perf_counter(), time.process_time()
            step()
            _sync(x.device)
            wall[name].append(time.perf_counter() - t_wall)
            cpu[name].append(time.process_time() - t_cpu)
    out = {}
    for name in names:
        w, c = wall[name][1:], cpu[name][1:]
        out[name] = {
            "wall_s": statistics.median(w),
            "cpu_s": statistics.median(c),
            "wall_ratio": statistics.median(a / b for a, b in zip(w, wall["naive"][1:])),
            "cpu_ratio": statistics.median(a / b for a, b in zip(c, cpu["naive"][1:])),
        }
    return out


def section_head(args: argparse.Namespace) -> None:
    """Print the table of the ``head`` section."""
    names = head_methods(args)
    logits = args.B * args.T * args.V * 4
    print(
        f"\n## head: B {args.B}, T {args.T}, d {args.d}, V {args.V}, "
        f"{'bf16 autocast' if args.bf16 else 'float32'}, {args.device}; float32 logits "
        f"{logits / 2**20:.0f} MiB, weight {args.V * args.d * 4 / 2**20:.0f} MiB"
    )
    match = head_match(args, names)
    timing = head_timing(args, names)
    mem = {n: child(f"head:{n}", args) for n in names}
    mem_mmap = {n: child(f"head:{n}", args, MMAP_ENV) for n in names}
    print(
        "| method | peak extra MiB | vs naive | same, mmap >= 1 MiB | vs naive | time s (wall) "
        "| vs naive (wall) | CPU s | vs naive (CPU) | max rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        t = timing[n]
        print(
            f"| {n} | {_mib(mem[n])} | {_rel(mem[n], mem['naive'])} | {_mib(mem_mmap[n])} | "
            f"{_rel(mem_mmap[n], mem_mmap['naive'])} | {t['wall_s']:.2f} | "
            f"{t['wall_ratio']:.2f} | {t['cpu_s']:.2f} | {t['cpu_ratio']:.2f} | "
            f"{match[n]:.1e} |",
            flush=True,
        )


def _mib(m: int | None) -> str:
    return "-" if m is None else f"{m / 2**20:.0f}"


def _rel(m: int | None, base: int | None) -> str:
    return "-" if m is None or not base else f"{m / base:.2f} ({m / base - 1:+.0%})"


# --- sections and the driver ----------------------------------------------------------------

SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "head": section_head,
}
CHILDREN: dict[str, Callable[[str, argparse.Namespace], dict[str, Any]]] = {
    "head": head_memory_child,
}


def _proc_status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, in bytes.

    Not ``ru_maxrss``: Linux carries it over ``exec`` from the forked parent, so a child of a
    large parent would report the parent's size.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Start ``VmHWM`` afresh at the current RSS (Linux >= 4.0), dropping warm-up peaks."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not permitted: VmHWM then also counts the set-up, an overestimate
        pass


# glibc keeps freed blocks below its dynamic mmap threshold (which grows up to 32 MiB) in
# per-thread arenas, so peak RSS also counts fragmentation. With the threshold fixed at 1 MiB
# every tensor of 1 MiB or more is mapped and unmapped on its own and RSS follows live tensors.
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def child(task: str, args: argparse.Namespace, env: dict[str, str] | None = None) -> int | None:
    """Run ``task`` ("section:method") in a fresh interpreter; its extra memory in bytes."""
    cmd = [sys.executable, __file__, "--child", task, *args.argv]
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )
    try:
        value = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    extra = value.get("extra")
    return None if extra is None else int(extra)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}"
    )
    parser.add_argument("--B", type=int, default=2, help="batch size")
    parser.add_argument("--T", type=int, default=1024, help="context length")
    parser.add_argument("--d", type=int, default=1024, help="hidden size")
    parser.add_argument("--V", type=int, default=32768, help="vocabulary size")
    parser.add_argument(
        "--chunk-sizes",
        default="256,512",
        help="comma-separated rows per chunk for the chunked head",
    )
    parser.add_argument("--bf16", action="store_true", help="run under bf16 autocast")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per method")
    parser.add_argument("--mem-reps", type=int, default=2, help="steps per memory subprocess")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(argv)  # children get the same options
    args.chunk_sizes = [int(c) for c in args.chunk_sizes.split(",") if c]
    for s in args.sections.split(","):
        if s and s not in SECTIONS:
            parser.error(f"unknown section {s!r}; choose from {list(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        section, name = args.child.split(":", 1)
        print(json.dumps(CHILDREN[section](name, args)))
        return
    print(
        f"# {datetime.date.today()} torch {torch.__version__} python "
        f"{platform.python_version()} threads {torch.get_num_threads()} "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} reps {args.reps} "
        f"device {args.device}"
    )
    for s in args.sections.split(","):
        if s:
            SECTIONS[s](args)


if __name__ == "__main__":
    main()
