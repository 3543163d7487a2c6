"""Where a recorded step leaves the GPU idle, and which host work keeps it waiting.

The GPU suite's profile section shows that a recorded step's wall time exceeds its kernels'
(GPT-2 small, ``norm``: 266 ms of wall time against 198 ms of kernels on an H100), so the
device waits on the host. This script says on what: it profiles recorded steps with
gradlog's stages marked (``torch.profiler.record_function`` around a few internal
functions, as ``bench_host.py --stages`` times them), and from the trace

* merges the device's kernels, copies and sets into busy intervals; each idle gap between
  two of them is charged to the stage whose host code launched the kernel that ended it
  (the host was still there when the device ran dry);
* sums the host's synchronising and allocating runtime calls (``cudaStreamSynchronize``,
  ``cudaMemcpy``, ``cudaMalloc``, ``cudaHostAlloc``...) by the stage that made them;
* times ``batch_grad="sum"`` and ``"autograd"`` against a plain step, interleaved (each
  repetition runs a block of each, so drift touches all three alike).

Usage (a CUDA machine; ``--cpu`` runs tiny shapes on the CPU to keep the script alive, where
there are no kernels and only the host columns mean something)::

    python tests/benchmarks/gpu_idle.py --out gpu_idle.md --trace-dir traces
    python tests/benchmarks/gpu_idle.py --cpu
"""

from __future__ import annotations

import argparse
import bisect
import copy
import functools
import gc
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_suite as suite

import gradlog

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# runtime calls that make the host wait for the device, or may (allocations)
WAITING_CALLS = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc",
                 "cudaFreeHost", "cudaHostRegister")
OTHER = "(no stage: the script's own code, autograd between hooks)"


def stages() -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of the functions marked in the trace; labels nest as their
    calls do."""
    import gradlog.backends.hooks as hooks
    import gradlog.backends.hooks.checks as checks
    import gradlog.backends.hooks.graph as graph
    import gradlog.planning as planning
    import gradlog.recording.encoding as encoding
    import gradlog.recording.pipeline as pipeline
    from gradlog.store.writer import StoreWriter

    return [
        (suite, "token_losses", "forward (the model, losses)"),
        (hooks.HooksBackend, "_capture", "forward: capture per module call"),
        (gradlog.GradRecorder, "backward", "rec.backward"),
        (hooks.HooksBackend, "backward", "hooks backend's backward"),
        (hooks.HooksBackend, "_reset", "reset: op-use signatures, spot-check draw"),
        (graph.GraphSurvey, "_walk", "graph walk"),
        (hooks.HooksBackend, "_route_shared_outputs", "shared-output routing"),
        (hooks.HooksBackend, "_compute", "per call: layout, rule, accumulation"),
        (checks.SpotCheck, "check", "spot check"),
        (planning, "encode", "encoding: forms and exact norms"),
        (encoding, "stage", "staging to the host"),
        (hooks.HooksBackend, "settle", "settle: the checks' verdicts"),
        (pipeline.StepPipeline, "_record", "pipeline: record the step"),
        (StoreWriter, "append", "writer.append"),
        (gradlog.GradRecorder, "flush", "rec.flush"),
    ]


@contextmanager
def marked(wrapped: list[tuple[Any, str, str]]) -> Iterator[None]:
    """``wrapped``'s functions inside ``record_function(label)`` while open."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]

    def mark(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return run

    for owner, name, label in wrapped:
        setattr(owner, name, mark(getattr(owner, name), label))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


# --- the trace's analysis -----------------------------------------------------------------


class Analysis:
    """Per stage, ms per step: host time inside it, device idle charged to it, and its
    synchronising or allocating runtime calls; and the step's wall, busy and idle totals."""

    def __init__(self, events: list[dict[str, Any]], steps: int, labels: Iterable[str]) -> None:
        self.steps = steps
        self.labels = set(labels)
        spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
        device = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in spans
                        if e.get("cat") in DEVICE_CATEGORIES)
        marks = [e for e in spans if e.get("cat") == "user_annotation"
                 and e.get("name") in self.labels]
        runtime = [e for e in spans if e.get("cat") == "cuda_runtime"]
        self.host = defaultdict(float)  # label -> ms, inclusive of nested stages
        for e in marks:
            self.host[e["name"]] += float(e["dur"]) / 1e3 / steps
        by_thread: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
        for e in marks:
            by_thread[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                                            e["name"]))
        for spans_of in by_thread.values():
            spans_of.sort()
        self._marks = by_thread
        launches = {e.get("args", {}).get("correlation"): e for e in runtime}
        self.idle = defaultdict(float)  # label -> device idle ms charged to it
        self.busy = 0.0
        self.gaps = 0
        end = None
        for start, stop, e in device:
            if end is not None and start > end:
                launch = launches.get(e.get("args", {}).get("correlation"))
                label = (self.stage_at(launch.get("tid"), float(launch["ts"]))
                         if launch is not None else "(launch not found)")
                self.idle[label] += (start - end) / 1e3 / steps
                self.gaps += 1
            if end is None or start > end:
                self.busy += (stop - start) / 1e3 / steps
                end = stop
            elif stop > end:
                self.busy += (stop - end) / 1e3 / steps
                end = stop
        self.span = ((device[-1][1] - device[0][0]) / 1e3 / steps) if device else 0.0
        self.waits: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        for e in runtime:
            name = e.get("name", "")
            if any(w in name for w in WAITING_CALLS) and "Async" not in name:
                key = (self.stage_at(e.get("tid"), float(e["ts"])), name)
                self.waits[key][0] += float(e["dur"]) / 1e3 / steps
                self.waits[key][1] += 1 / steps

    def stage_at(self, tid: Any, ts: float) -> str:
        """The innermost marked stage open on thread ``tid`` at ``ts``."""
        spans = self._marks.get(tid, [])
        i = bisect.bisect_right(spans, (ts, float("inf"), ""))
        best = None
        for start, stop, label in reversed(spans[:i]):  # latest start first: innermost
            if start <= ts <= stop:
                best = label
                break
        return best if best is not None else OTHER


def load_trace(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


# --- the measurements ---------------------------------------------------------------------


def timed_modes(say: suite.Report, args: argparse.Namespace, shape: suite.Shape,
                device: torch.device, root: Path) -> None:
    """Plain, ``sum`` and ``autograd`` steps interleaved, ``norm`` form."""
    clock = suite.Clock(device)
    plain = suite.build(shape, device)
    batch = suite.batch_of(shape, device)
    models = {"plain": plain, "sum": copy.deepcopy(plain), "autograd": copy.deepcopy(plain)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.0) for k, m in models.items()}
    recs = {k: gradlog.GradRecorder(models[k], root / f"{k}.gradlog", form="norm",
                                    batch_grad=k, check_every=0, durable=False)
            for k in ("sum", "autograd")}
    try:
        for rec in recs.values():
            rec.__enter__()
        blocks = {k: suite.block_of(models[k], opts[k], batch, recs.get(k), args.amp,
                                    args.block) for k in models}
        for block in blocks.values():
            block()  # warm-up: plans, kernels, the allocator's pools
        times: dict[str, list[float]] = {k: [] for k in blocks}
        for _ in range(args.reps):
            for k, block in blocks.items():
                times[k].append(clock(block) / args.block)
    finally:
        for rec in recs.values():
            rec.__exit__(None, None, None)
    p = times["plain"]
    say(f"### {shape.label}: `norm` in both modes, interleaved ({args.reps} reps of "
        f"{args.block} steps)")
    say()
    say("| step | median ms | / plain (median of paired ratios) | min-max |")
    say("|---|---|---|---|")
    for k, t in times.items():
        ratios = [b / a for a, b in zip(p, t, strict=True)]
        say(f"| {k} | {statistics.median(t) * 1e3:.1f} | **{statistics.median(ratios):.3f}** "
            f"| {min(ratios):.3f}-{max(ratios):.3f} |")
    say()


def profiled(say: suite.Report, args: argparse.Namespace, shape: suite.Shape,
             device: torch.device, root: Path, batch_grad: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    model = suite.build(shape, device)
    batch = suite.batch_of(shape, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped = stages()
    labels = [label for _, _, label in wrapped]
    trace = root / f"{shape.name}-{batch_grad}.json"
    with gradlog.GradRecorder(model, root / f"p-{batch_grad}.gradlog", form="norm",
                              batch_grad=batch_grad, check_every=0, durable=False) as rec:
        block = suite.block_of(model, opt, batch, rec, args.amp, args.profile_steps)
        suite.block_of(model, opt, batch, rec, args.amp, 2)()  # warm-up
        wall = suite.Clock(device)(block) * 1e3 / args.profile_steps
        collected = _collections()
        with marked(wrapped):
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with collected, profile(activities=activities) as prof:
                block()
                suite.Clock(device).sync()
        prof.export_chrome_trace(str(trace))
    found = Analysis(load_trace(trace), args.profile_steps, labels)
    say(f"### {shape.label}: `norm`, batch_grad={batch_grad!r} ({args.profile_steps} profiled "
        "steps; ms per step)")
    say()
    say(f"Unprofiled wall {wall:.1f}; profiled: device busy {found.busy:.1f} over a span of "
        f"{found.span:.1f}, {found.gaps / args.profile_steps:.0f} idle gaps a step; Python's "
        f"garbage collections {collected.ms / args.profile_steps:.1f} ms a step.")
    say()
    say("| stage (nested: a stage's host time includes the stages it calls) | host ms "
        "| device idle charged to it | waiting calls: ms (calls) |")
    say("|---|---|---|---|")
    waits_by: dict[str, list[str]] = defaultdict(list)
    for (label, name), (ms, n) in sorted(found.waits.items(), key=lambda kv: -kv[1][0]):
        waits_by[label].append(f"{name} {ms:.2f} ({n:.0f})")
    for label in [*labels, OTHER, "(launch not found)"]:
        host, idle = found.host.get(label, 0.0), found.idle.get(label, 0.0)
        if host or idle or waits_by.get(label):
            say(f"| {label} | {host:.2f} | {idle:.2f} | {'; '.join(waits_by[label][:4])} |")
    say(f"| all | | {sum(found.idle.values()):.2f} | |")
    say()
    if args.trace_dir is not None:  # gzipped, for chrome://tracing or perfetto
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        with open(trace, "rb") as src, gzip.open(args.trace_dir / f"{trace.name}.gz",
                                                 "wb") as dst:
            shutil.copyfileobj(src, dst)


class _collections:
    """Milliseconds in Python's garbage collections while open."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._t = 0.0

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t) * 1e3

    def __enter__(self) -> _collections:
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--shapes", default="gpt,llama", help="comma-separated: gpt,llama")
    parser.add_argument("--modes", default="sum,autograd", help="batch_grad modes to profile")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions")
    parser.add_argument("--block", type=int, default=3, help="steps per timed block")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--no-timing", action="store_true", help="profile only")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="where to keep the gzipped chrome traces")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    args.amp = True
    if args.reps is None:
        args.reps = 2 if args.cpu else 7
    known = suite.CPU_SHAPES if device.type == "cpu" else suite.GPU_SHAPES
    args.shapes = [s for key in args.shapes.split(",") for s in known if s.name == key]
    say = suite.Report(args.out)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    say(f"## Where the device idles ({name}; torch {torch.__version__}; bf16 autocast)")
    say()
    say(f"command: `python {' '.join(sys.argv)}`")
    say()
    top = Path(tempfile.mkdtemp(prefix="gpu_idle_", dir=args.workdir))
    try:
        for shape in args.shapes:
            root = top / shape.name
            root.mkdir()
            if not args.no_timing:
                timed_modes(say, args, shape, device, root)
                suite._free(device)
            for mode in [m for m in args.modes.split(",") if m]:
                profiled(say, args, shape, device, root, mode)
                suite._free(device)
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
