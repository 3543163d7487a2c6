"""Memory at language-model scale: peak memory and time of the naive vs the chunked LM head.

Sections (``--sections``, comma-separated; each is one function in ``SECTIONS`` that prints a
Markdown table): ``head``, ``layers`` and ``bf16``.

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

``layers``
    Recording chosen layers of a deep model: a 24-layer CharGPT (``--layers-*`` sizes) trained
    with SGD, each method alone in a fresh subprocess running ``--mem-reps`` steps through a
    ``GradRecorder`` writing a store in a temporary directory (the writer thread included);
    ``--mem-trials`` processes per method, the median shown with its range (peaks of one and
    the same run vary by tens of MiB from process to process):

    - ``plain``: no recorder (the same imports and set-up);
    - ``1 of 24``: ``params="blocks.12.*"``; ``24 of 24``: ``params="blocks.*"``;
    - ``... frozen``: the user froze every other parameter (``requires_grad=False``);
    - ``... checkpointed``: every block under ``torch.utils.checkpoint(use_reentrant=False)``.

    The extra memory of recording is the recorded run's peak minus the plain run's peak (of the
    same frozen/checkpointed kind); the acceptance of issue 6 is that recording 1 of 24 layers
    costs at most 1/10 of recording all 24. The per-datum payload (B x recorded parameters x 4
    bytes per step) is shown beside it: it is part of the extra memory by design.

``bf16``
    Accuracy of per-datum gradients under ``torch.autocast(bfloat16)`` (float32 parameters) on
    the small GPT of PEERS.md (vocab 512, d 128, 2 layers, T 64, B 16): the relative error
    ``|g_b - g_b^32| / |g_b^32|`` of each datum's gradient against float32 without autocast,
    median and max over datums, per parameter kind; for the hooks backend (rules accumulate in
    float32), the same rules computing their products in bf16 (what accumulating in bf16 would
    give), and the loop backend (autograd's own bf16 gradients, one backward per datum); and
    ``|sum_b w_b g_b - p.grad| / |p.grad|``, which the recorder's self-check bounds.

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
    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_memory.py --sections layers,bf16
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
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

    autocast: Any = (
        torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.bf16)
        if x.device.type != "meta"  # (no autocast there; the meta device has no data anyway)
        else contextlib.nullcontext()
    )

    def zero() -> None:
        x.grad = None
        linear.zero_grad(set_to_none=True)

    if name == "naive":

        def naive() -> torch.Tensor:
            zero()
            with autocast:
                # (no name for the logits: a live reference would keep them through backward)
                loss = F.cross_entropy(linear(x).float().flatten(0, 1), y.flatten())  # (B T, V)
            loss.backward()
            return loss.detach()

        return naive
    parts = name.split()
    chunk = None if parts[1] == "default" else int(parts[1])  # default: the budget's rows
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
    if args.counted:  # count live tensor bytes instead of RSS (any device, meta included)
        from gradlog.memory import TensorPeak

        x, linear, y = head_inputs(args)
        step = head_step(name, args, x, linear, y)
        with TensorPeak() as counted:
            step()
        return {"extra": counted.peak}
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


PUZZLE_METHODS = ["naive", "chunked default", "chunked default none"]


def section_puzzle(args: argparse.Namespace) -> None:
    """The chunked head with its defaults at the memory puzzle's test size (issue 20).

    Batch 4, length 512, hidden 1024 (2,048 rows), float32, vocabularies ``--puzzle-vocabs``;
    each method in a fresh process. ``counted``: the peak bytes of the tensors the step
    allocates (:class:`gradlog.memory.TensorPeak`), on CPU and on the meta device (the same
    operators without data: equal to CPU where both ran; the only way to show the largest
    vocabularies on a small machine). ``RSS``: the process's peak resident memory with
    tensors >= 1 MiB mapped on their own (``MALLOC_MMAP_THRESHOLD_``), CPU only.
    """
    for vocab in args.puzzle_vocabs:
        sizes = ["--B", "4", "--T", "512", "--d", "1024", "--V", str(vocab)]
        cpu = vocab <= args.puzzle_cpu_vocab
        print(
            f"\n## puzzle: B 4, T 512, d 1024, V {vocab}, float32, chunked_linear_loss defaults"
            f" ({'cpu and meta' if cpu else 'meta only: above --puzzle-cpu-vocab'})"
        )
        print("| method | counted meta MiB | vs naive | counted cpu MiB | vs naive "
              "| RSS cpu MiB | vs naive |")
        print("|---|---|---|---|---|---|---|")
        runs: dict[str, dict[str, int | None]] = {n: {} for n in PUZZLE_METHODS}
        for name in PUZZLE_METHODS:
            argv = [*args.argv, *sizes, "--mem-reps", "1"]
            runs[name]["meta"] = child(f"head:{name}", args, None, [*argv, "--counted",
                                                                   "--device", "meta"])
            if cpu:
                runs[name]["cpu"] = child(f"head:{name}", args, None, [*argv, "--counted"])
                runs[name]["rss"] = child(f"head:{name}", args, MMAP_ENV, argv)
        base = runs["naive"]
        for name in PUZZLE_METHODS:
            r = runs[name]
            cells = [f"{_mib(r.get(k))} | {_rel(r.get(k), base.get(k))}"
                     for k in ("meta", "cpu", "rss")]
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def _mib(m: int | None) -> str:
    return "-" if m is None else f"{m / 2**20:.0f}"


def _rel(m: int | None, base: int | None) -> str:
    return "-" if m is None or not base else f"{m / base:.2f} ({m / base - 1:+.0%})"


# --- section "layers": recording 1 of 24 layers vs all 24 ----------------------------------

LAYER_METHODS = [
    "plain",
    "1 of 24",
    "24 of 24",
    "plain frozen",
    "1 of 24 frozen",
    "plain checkpointed",
    "1 of 24 checkpointed",
    "24 of 24 checkpointed",
]


def _layers_model(args: argparse.Namespace, method: str) -> tuple[nn.Module, Step, str | None]:
    """The 24-layer GPT, one training step (forward, backward or ``rec.backward``, SGD) as a
    function of the recorder (None: plain), and the recorded pattern."""
    from gradlog.demo.model import CharGPT, GPTConfig

    torch.manual_seed(0)
    n = args.layers_n
    model = CharGPT(
        GPTConfig(
            vocab_size=args.layers_V,
            block_size=args.layers_T,
            n_layer=n,
            n_head=4,
            n_embd=args.layers_d,
        )
    )
    middle = n // 2
    if "frozen" in method:
        model.requires_grad_(False)
        model.blocks[middle].requires_grad_(True)
    pattern = None
    if method.startswith("1 of"):
        pattern = f"blocks.{middle}.*"
    elif method.startswith(f"{n} of"):
        pattern = "blocks.*"
    use_checkpoint = "checkpointed" in method
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.layers_V, (args.layers_B, args.layers_T), generator=gen)
    y = torch.randint(0, args.layers_V, (args.layers_B, args.layers_T), generator=gen)
    pos = torch.arange(args.layers_T).unsqueeze(0)  # (1, T)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def losses() -> torch.Tensor:
        h = model.tok_emb(x) + model.pos_emb(pos)  # (B, T, d)
        for block in model.blocks:
            if use_checkpoint:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)  # (B, T, d)
        logits = model.head(model.ln_f(h))  # (B, T, V)
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)  # (B,)

    def step(rec: Any = None) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        out = losses()
        if rec is None:
            out.mean().backward()
        else:
            rec.backward(out)
        opt.step()
        return out.detach()

    return model, step, pattern


def layers_memory_child(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: the memory ``--mem-reps`` training steps of ``method`` add."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet  # imported lazily by the writer's first commit

    import gradlog
    import gradlog.recorder  # imported before measuring, in every method
    import gradlog.store.writer

    # pyarrow imports pandas on its first pa.array() (here: the writer's first index rows),
    # ~55 MiB of RSS once per process; done in set-up so that it counts as an import, not as
    # memory of recording.
    pa.array([0.0])

    model, step, pattern = _layers_model(args, method)
    tiny = model(torch.zeros(1, 4, dtype=torch.long))  # warm-up: kernels, thread pools
    tiny.sum().backward()
    model.zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory(dir=args.layers_dir) as tmp:
        rec = None
        if pattern is not None:
            rec = gradlog.GradRecorder(model, f"{tmp}/run.gradlog", params=pattern, check_every=0)
            rec.open()  # creating the store and the writer thread is set-up, not a step
        _reset_peak_rss()
        before = _proc_status_bytes("VmRSS")
        t0 = time.perf_counter()
        for _ in range(args.mem_reps):
            step(rec)
        if rec is not None:
            rec.close()  # the last steps' writes
        seconds = (time.perf_counter() - t0) / args.mem_reps
        peak = _proc_status_bytes("VmHWM")
    recorded = 0 if rec is None else sum(p.numel() for p in rec.params.values())
    return {"extra": max(0, peak - before), "s": seconds, "payload": recorded * args.layers_B * 4}


def _layers_trials(
    method: str, args: argparse.Namespace, env: dict[str, str] | None
) -> dict[str, Any] | None:
    """``--mem-trials`` fresh processes of ``method``: the median peak extra (bytes) and its
    range ("lo", "hi"), the median seconds per step, the payload. Peaks of the same run vary
    by tens of MiB between processes (allocation order, heap layout), so one process is not
    enough to tell a few MiB of recording apart."""
    runs = [child_result(f"layers:{method}", args, env) for _ in range(args.mem_trials)]
    done = [r for r in runs if r is not None]
    if not done:
        return None
    extras = [int(r["extra"]) for r in done]
    return {
        "extra": int(statistics.median(extras)),
        "lo": min(extras),
        "hi": max(extras),
        "s": statistics.median(float(r["s"]) for r in done),
        "payload": done[0]["payload"],
    }


def _plain_of(method: str) -> str:
    """The plain run of the same kind as ``method`` ("1 of 24 frozen" -> "plain frozen")."""
    return " ".join(["plain", *(w for w in ("frozen", "checkpointed") if w in method)])


def _all_of(method: str, n: int) -> str:
    """The all-layers run of the same kind as ``method`` ("1 of 24 frozen" -> "24 of 24
    frozen")."""
    return " ".join([f"{n} of {n}", *(w for w in ("frozen", "checkpointed") if w in method)])


def _recording_extra(measured: dict[str, dict[str, Any] | None]) -> dict[str, float]:
    """Per recorded method: its peak extra minus that of the plain run of the same kind."""
    out = {}
    for m, r in measured.items():
        base = measured.get(_plain_of(m))
        if not m.startswith("plain"):
            out[m] = (
                float("nan") if r is None or base is None else float(r["extra"] - base["extra"])
            )
    return out


def layers_extra(
    args: argparse.Namespace, env: dict[str, str] | None = None, methods: list[str] | None = None
) -> dict[str, float]:
    """Extra memory (bytes) of recording for each method (default: 1 and all of the layers),
    each run and its plain counterpart in fresh subprocesses."""
    n = args.layers_n
    names = methods or [f"1 of {n}", f"{n} of {n}"]
    runs = sorted(set(names) | {_plain_of(m) for m in names})
    measured = {m: _layers_trials(m, args, env) for m in runs}
    return {m: e for m, e in _recording_extra(measured).items() if m in names}


def section_layers(args: argparse.Namespace) -> None:
    """Print the table of the ``layers`` section."""
    n = args.layers_n
    names = [m.replace("24", str(n)) for m in LAYER_METHODS]
    per_layer = 12 * args.layers_d**2 + 13 * args.layers_d  # a CharGPT block's parameters
    print(
        f"\n## layers: CharGPT {n} layers, d {args.layers_d}, T {args.layers_T}, "
        f"B {args.layers_B}, vocab {args.layers_V}; {per_layer / 1e6:.2f}M parameters per "
        f"layer; {args.mem_reps} SGD steps per run, median (range) of {args.mem_trials} "
        f"processes; store on disk ({args.layers_dir or 'tmp'})"
    )
    measured = {
        label: {m: _layers_trials(m, args, env) for m in names}
        for label, env in (("default", None), ("mmap", MMAP_ENV))
    }
    extra = {label: _recording_extra(runs) for label, runs in measured.items()}
    print(
        "| method | per-datum payload MiB/step | peak extra MiB | extra of recording MiB | "
        "vs all layers | mmap >= 1 MiB: peak extra | extra of recording | vs all layers "
        "| s/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m in names:
        cells = []
        for label, runs in measured.items():
            r = runs[m]
            cells.append(
                "-" if r is None else f"{_mib(r['extra'])} ({_mib(r['lo'])}-{_mib(r['hi'])})"
            )
            if m.startswith("plain"):
                cells += ["-", "-"]
                continue
            mine, every = extra[label][m], extra[label].get(_all_of(m, n), float("nan"))
            cells.append("-" if math.isnan(mine) else _mib(int(mine)))
            cells.append("-" if math.isnan(mine) or not every > 0 else f"{mine / every:.3f}")
        r0 = measured["default"][m]
        payload = "-" if r0 is None or m.startswith("plain") else _mib(r0["payload"])
        seconds = "-" if r0 is None else f"{r0['s']:.2f}"
        print(f"| {m} | {payload} | " + " | ".join(cells) + f" | {seconds} |", flush=True)


# --- section "bf16": per-datum gradients under bf16 autocast against float32 -----------------


def _bf16_products_rule() -> Any:
    """A Linear rule computing its per-datum products in bf16 (for comparison only)."""
    from gradlog.rules.linear import as_rows

    def linear_bf16(module: nn.Linear, cap: Any, wanted: frozenset[str]) -> dict[str, Any]:
        B = cap.batch_size
        g = as_rows(cap.grad_output, B, module.out_features, "g")  # (B, N, d_out) bf16
        out: dict[str, Any] = {}
        if "weight" in wanted:
            a = as_rows(cap.input, B, module.in_features, "a").to(g.dtype)  # (B, N, d_in)
            out["weight"] = (torch.bmm(g.transpose(1, 2), a) * cap.scale).float()
        if "bias" in wanted:
            out["bias"] = (g.sum(1) * cap.scale).float()  # (B, d_out)
        return out

    return linear_bf16


def section_bf16(args: argparse.Namespace) -> None:
    """Print the table of the ``bf16`` section."""
    from gradlog.backends import BACKENDS
    from gradlog.demo.model import CharGPT, GPTConfig
    from gradlog.params import select_params
    from gradlog.rules import RULES, register_rule
    from gradlog.rules.base import one_feature_dim

    torch.manual_seed(0)
    V, d, T, B = 512, 128, 64, 16
    model = CharGPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_embd=d))
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, T))
    params = select_params(model, ["*"])

    def run(backend: str, autocast: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        be = BACKENDS[backend](model, params, batch_reduction="mean", randomness="different")
        be.attach()
        try:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(x)  # (B, T, V)
            losses = F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none").mean(
                1
            )  # (B,)
            grads = be.backward(losses, losses.mean())
        finally:
            be.detach()
        sums = {}
        for n, p in params.items():
            assert p.grad is not None
            total = grads[n].double().mean(0)
            sums[n] = float((total - p.grad.double()).norm() / p.grad.double().norm())
        return grads, sums

    reference, _ = run("loop", False)
    methods: dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]] = {}
    methods["hooks (float32 accumulation)"] = run("hooks", True)
    saved = RULES[nn.Linear]
    try:
        register_rule(nn.Linear, name="linear", feature_dims=one_feature_dim)(_bf16_products_rule())
        methods["hooks, Linear products in bf16"] = run("hooks", True)
    finally:
        RULES[nn.Linear] = saved
    methods["loop (autograd, bf16)"] = run("loop", True)

    def kind(name: str) -> str:
        if "emb" in name:
            return "embeddings"
        if "ln" in name:
            return "layer norms"
        if name == "head.weight":
            return "head"
        if ".attn.k.bias" in name:
            return ""  # analytically zero (softmax shift): pure rounding noise
        return "attention" if ".attn." in name else "mlp"

    kinds = ["embeddings", "attention", "mlp", "layer norms", "head"]
    print(
        f"\n## bf16: CharGPT vocab {V}, d {d}, 2 layers, T {T}, B {B}; float32 parameters; "
        "relative error of per-datum gradients vs float32 without autocast (median / max "
        "over datums, worst parameter of each kind)"
    )
    print("| method | " + " | ".join(kinds) + " | all | sum_b w_b g_b vs p.grad (max) |")
    print("|---|" + "---|" * (len(kinds) + 2))
    for label, (grads, sums) in methods.items():
        per_kind: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for n, ref in reference.items():
            k = kind(n)
            if not k:
                continue
            err = (grads[n].double() - ref.double()).reshape(B, -1).norm(
                dim=1
            ) / ref.double().reshape(B, -1).norm(dim=1)  # (B,)
            per_kind[k].append((float(err.median()), float(err.max())))
        cells = [
            f"{max(m for m, _ in v):.1e} / {max(x for _, x in v):.1e}" for v in per_kind.values()
        ]
        every = [e for v in per_kind.values() for e in v]
        cells.append(f"{max(m for m, _ in every):.1e} / {max(x for _, x in every):.1e}")
        worst_sum = max(v for n, v in sums.items() if kind(n))
        print(f"| {label} | " + " | ".join(cells) + f" | {worst_sum:.1e} |", flush=True)


# --- sections and the driver ----------------------------------------------------------------

SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "head": section_head,
    "puzzle": section_puzzle,
    "layers": section_layers,
    "bf16": section_bf16,
}
CHILDREN: dict[str, Callable[[str, argparse.Namespace], dict[str, Any]]] = {
    "head": head_memory_child,
    "layers": layers_memory_child,
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


def child_result(
    task: str,
    args: argparse.Namespace,
    env: dict[str, str] | None = None,
    argv: list[str] | None = None,
) -> dict[str, Any] | None:
    """Run ``task`` ("section:method") in a fresh interpreter, with this run's options (or
    ``argv``); the dict it prints (None if it failed: its stderr is shown)."""
    cmd = [sys.executable, __file__, "--child", task, *(args.argv if argv is None else argv)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )
    try:
        value: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return value


def child(
    task: str,
    args: argparse.Namespace,
    env: dict[str, str] | None = None,
    argv: list[str] | None = None,
) -> int | None:
    """Run ``task`` ("section:method") in a fresh interpreter; its extra memory in bytes."""
    value = child_result(task, args, env, argv)
    extra = None if value is None else value.get("extra")
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
    parser.add_argument(
        "--mem-trials", type=int, default=3, help="layers: processes per method (median)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--layers-n", type=int, default=24, help="layers: transformer blocks")
    parser.add_argument("--layers-d", type=int, default=192, help="layers: hidden size")
    parser.add_argument("--layers-T", type=int, default=128, help="layers: context length")
    parser.add_argument("--layers-B", type=int, default=8, help="layers: batch size")
    parser.add_argument("--layers-V", type=int, default=256, help="layers: vocabulary size")
    parser.add_argument("--layers-dir", default=None, help="layers: where the stores go")
    parser.add_argument(
        "--puzzle-vocabs", default="32000,128000", help="puzzle: comma-separated vocabularies"
    )
    parser.add_argument(
        "--puzzle-cpu-vocab",
        type=int,
        default=32000,
        help="puzzle: largest vocabulary also run on CPU (the naive 128K head needs ~5 GB)",
    )
    parser.add_argument(
        "--counted", action="store_true", help="head children: count tensor bytes (TensorPeak)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(argv)  # children get the same options
    args.chunk_sizes = [int(c) for c in args.chunk_sizes.split(",") if c]
    args.puzzle_vocabs = [int(v) for v in args.puzzle_vocabs.split(",") if v]
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
