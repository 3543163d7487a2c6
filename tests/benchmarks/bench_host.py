"""Host work of a recorded step: GPT-2 small's structure at widths where arithmetic vanishes.

The model has GPT-2 small's layer structure (``gradlog.testing.zoo.tiny_gpt``: 12 layers,
tied head; ``--model llama``: the ~1B Llama's, 16 layers, dim 32) at tiny widths (vocab 64,
d 16, 4 heads, T 16, B 8 by default), so a step's wall time is the host's work: Python,
torch's dispatcher, gradlog's hooks, rules, graph walks, encoding and checks. On a GPU this
work runs beside the device's and is what remains of a recorded step when the device work is
cheap: the H200 run of ``gpu_suite.py`` left ~40 ms of GPT-2 small's recorded step to the
host (RESULTS.md).

Table: per form (``batch_grad="sum"``, or ``--batch-grad``'s; ``durable=False``,
``check_every=0``), the plain step (forward, backward, SGD step on a hook-free copy) and the
recorded step (forward, ``rec.backward``, SGD step), paired: each repetition times one of
each; medians over repetitions, and the host work gradlog adds (their difference); then the
aten operations one step of each dispatches (a noise-free count; on a GPU, about its
launches). ``--stages`` then times the first form's steps by stage, unprofiled: perf_counter
wrappers around a few of gradlog's internal functions (the forward capture, the hooks'
reset, graph walk, routing and per-call compute, the rules, the accumulation, the spot
check, the encoding), each called a few hundred times a step at most, so the wrappers add
little. ``--profile FORM`` prints the main thread's cProfile of that form's recorded steps
(cumulative; the writer's threads are not in it; it doubles the step and inflates loops of
small calls most).

Usage::

    python tests/benchmarks/bench_host.py
    python tests/benchmarks/bench_host.py --forms norm --reps 50 --profile norm
    python tests/benchmarks/bench_host.py --model llama --forms norm,projection
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import gc
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

import gradlog
from gradlog.testing import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", default="full,norm,projection")
    parser.add_argument("--reps", type=int, default=30, help="paired repetitions per form")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                        help="GPT-2 small's structure (tied head) or the ~1B Llama's (RMSNorm, "
                        "gated MLP, rotary attention, its head through chunked_linear_loss)")
    parser.add_argument("--layers", type=int, default=None, help="default: 12 (gpt), 16 (llama)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", default=None, help="a form to profile after timing")
    parser.add_argument("--amp", action="store_true",
                        help="forwards under bfloat16 autocast (the GPU suite's steps)")
    parser.add_argument("--batch-grad", choices=("sum", "autograd"), default="sum",
                        help="the recorder's batch_grad mode")
    parser.add_argument("--stages", action="store_true",
                        help="time the first form's steps by stage (internal functions)")
    args = parser.parse_args()
    if args.layers is None:
        args.layers = 16 if args.model == "llama" else 12
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    global _AMP
    _AMP = args.amp
    B, T, V = args.batch, 16, 64
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, T))
    width = "dim 32, hidden 64" if args.model == "llama" else "d 16"
    print(f"torch {torch.__version__}, {args.threads} thread(s); {args.model} of {args.layers} "
          f"layers, vocab {V}, {width}, T {T}, B {B}; batch_grad={args.batch_grad!r}; "
          f"{args.reps} paired reps"
          f"{'; bf16 autocast' if args.amp else ''}")
    print()
    print("| form | plain ms | recorded ms | added host ms | recorded / plain "
          "| aten ops, plain | aten ops, recorded | mean ms, plain / recorded "
          "| GC ms a step, plain / recorded | full collections a step, plain / recorded |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    forms = [f for f in args.forms.split(",") if f]
    with tempfile.TemporaryDirectory(prefix="bench_host_") as root:
        for form in forms:
            _row(form, args, x, y, Path(root))
        if args.stages and forms:
            _stages(forms[0], args, x, y, Path(root))


def _model(args: argparse.Namespace, T: int) -> torch.nn.Module:
    if args.model == "llama":
        from gradlog.testing.llama import LlamaConfig, tiny_llama

        config = LlamaConfig(vocab_size=64, dim=32, n_layers=args.layers, n_heads=4,
                             hidden_dim=64, max_seq_len=T)
        return tiny_llama(config, dtype=torch.float32)
    return zoo.tiny_gpt(vocab=64, block_size=T, n_layer=args.layers, n_head=4, n_embd=16,
                        tie_weights=True, dtype=torch.float32)


_AMP = False


def _token_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy (B, T), the forward under bfloat16 autocast with ``--amp``."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_AMP):
        return _token_losses_of(model, x, y)


def _token_losses_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy (B, T): a Llama's head through ``chunked_linear_loss``."""
    if hasattr(model, "hidden") and hasattr(model, "lm_head"):  # gradlog.testing.llama
        from gradlog.memory import chunked_linear_loss

        def ce(h: torch.Tensor, head: Any, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(head(h).float(), target, reduction="none")

        return chunked_linear_loss(cast(Any, model).hidden(x), cast(Any, model).lm_head, y, ce,
                                   reduction="none")
    return zoo.per_token_ce(model(x), y)


def _stages(form: str, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor,
            root: Path) -> None:
    """Per step: plain forward and backward, recorded forward and ``rec.backward``, and the
    time inside a few internal functions (nested: a row's time includes the rows it calls)."""
    import gradlog.backends.hooks as hooks
    import gradlog.backends.hooks.accumulate as accumulate
    import gradlog.backends.hooks.checks as checks
    import gradlog.backends.hooks.graph as graph
    import gradlog.planning as planning
    import gradlog.rules.layer_norm as layer_norm
    import gradlog.rules.linear as linear

    spent: dict[str, float] = {}
    wrapped = [
        (hooks.HooksBackend, "_capture", "forward: capture per module call"),
        (hooks.HooksBackend, "backward", "backward: hooks backend (autograd's own included)"),
        (hooks.HooksBackend, "_reset", "  reset: op-use signatures, spot-check draw"),
        (graph.GraphSurvey, "_walk", "    the graph walk (also for the routing)"),
        (checks.SpotCheck, "draw", "    spot-check draw"),
        (hooks.HooksBackend, "_route_shared_outputs", "  shared-output routing"),
        (hooks.HooksBackend, "_compute", "  per call: layout, rule, accumulation"),
        (linear, "_affine", "    Linear rule"),
        (layer_norm, "_affine", "    LayerNorm rule"),
        (accumulate.Accumulator, "add", "    accumulation"),
        (checks.SpotCheck, "check", "  spot check"),
        (planning, "encode", "encoding: forms and exact norms"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]
    for owner, name, label in wrapped:
        setattr(owner, name, _timer(getattr(owner, name), label, spent))
    try:
        model = _model(args, x.shape[1])
        plain = copy.deepcopy(model)
        with gradlog.GradRecorder(model, root / f"stages-{form}.gradlog", form=form,
                                  batch_grad=args.batch_grad, durable=False, check_every=0) as rec:
            for _ in range(args.warmup):
                rec.backward(_token_losses(model, x, y))
                model.zero_grad()
            rec.flush()
            spent.clear()
            steps = {"plain forward": 0.0, "plain backward": 0.0, "recorded forward": 0.0,
                     "rec.backward": 0.0}
            for _ in range(args.reps):
                t0 = time.perf_counter()
                loss = _token_losses(plain, x, y).mean()
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                losses = _token_losses(model, x, y)
                t3 = time.perf_counter()
                rec.backward(losses)
                t4 = time.perf_counter()
                plain.zero_grad()
                model.zero_grad()
                for key, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    steps[key] += dt
            rec.flush()
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    print()
    print(f"Stages of a `{form}` step (ms per step, mean of {args.reps}; nested rows)")
    print()
    print("| stage | ms |")
    print("|---|---|")
    ordered = [(label, spent[label]) for _, _, label in wrapped if label in spent]
    for label, total in [*steps.items(), *ordered]:
        print(f"| {label} | {total / args.reps * 1e3:.1f} |")


def _aten_ops(step: Callable[[], None]) -> int:
    """The aten operations one step dispatches on this thread (the writer's threads' are not
    counted): a count free of the machine's noise, and on a GPU about the kernel launches
    and dispatcher calls the host makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as counted:
        step()
    return counted.n


def _timer(fn: Callable[..., Any], label: str, spent: dict[str, float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

    return timed


def _row(form: str, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor,
         root: Path) -> None:
    """Time one form's recorded step against the plain step, paired; print its row."""
    model = _model(args, x.shape[1])
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    held: list[Any] = [None, None]  # each loop's last losses, alive until the next forward

    def plain_step() -> None:
        held[0] = _token_losses(plain, x, y)
        held[0].mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()

    with gradlog.GradRecorder(model, root / f"{form}.gradlog", form=form,
                              batch_grad=args.batch_grad, durable=False, check_every=0) as rec:

        def recorded_step() -> None:
            held[1] = _token_losses(model, x, y)
            rec.backward(held[1])
            opt.step()
            opt.zero_grad()

        for _ in range(args.warmup):
            plain_step()
            recorded_step()
        rec.flush()
        plain_s, recorded_s = [], []
        with _CollectorTime() as collector:
            for _ in range(args.reps):
                collector.side = 0
                plain_s.append(_seconds(plain_step))
                collector.side = 1
                recorded_s.append(_seconds(recorded_step))
        rec.flush()
        p, r = statistics.median(plain_s), statistics.median(recorded_s)
        ratio = statistics.median(b / a for a, b in zip(plain_s, recorded_s, strict=True))
        ops = (_aten_ops(plain_step), _aten_ops(recorded_step))
        mean = [statistics.fmean(plain_s) * 1e3, statistics.fmean(recorded_s) * 1e3]
        gc_ms = [collector.seconds[i] / args.reps * 1e3 for i in (0, 1)]
        full = [collector.full[i] / args.reps for i in (0, 1)]
        print(f"| {form} | {p * 1e3:.1f} | {r * 1e3:.1f} | {(r - p) * 1e3:.1f} | "
              f"{ratio:.2f} | {ops[0]} | {ops[1]} | {mean[0]:.1f} / {mean[1]:.1f} | "
              f"{gc_ms[0]:.2f} / {gc_ms[1]:.2f} | {full[0]:.3f} / {full[1]:.3f} |", flush=True)
        if form == args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20):
                recorded_step()
            rec.flush()
            profiler.disable()
            print()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats("gradlog", 40)


class _CollectorTime:
    """Python's garbage collections while open, by side (0 plain, 1 recorded): seconds in
    them and how many were full (generation 2). Medians hide a full collection every few
    dozen steps; the means and these columns show it."""

    def __init__(self) -> None:
        self.side = 0
        self.seconds = [0.0, 0.0]
        self.full = [0, 0]
        self._start = 0.0

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.seconds[self.side] += time.perf_counter() - self._start
        self.full[self.side] += info["generation"] == 2

    def __enter__(self) -> _CollectorTime:
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on)


def _seconds(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
