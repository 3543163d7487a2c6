"""Query benchmark: influence-scan throughput against the disk's raw sequential read bandwidth,
measured in the same run on the same files, and the latency of typical slices.

What is measured.

- **Store**: recorded here with ``GradRecorder`` (an MLP of two ``--width`` x ``--width``
  Linear layers, float32, batches of ``--batch``, 2 probes) until its gradient arrays hold
  about ``--gib`` GiB, in ``--dir`` (default: a temporary directory on the disk under test).
- **Raw read**: every file of the gradient and probe arrays, read sequentially with 16 MiB
  ``read`` calls, page cache dropped first: ``posix_fadvise(DONTNEED)`` on each file after an
  ``fsync`` (targeted, unlike ``/proc/sys/vm/drop_caches``, which needs root and evicts every
  process's cache). The warm read bandwidth is shown too, to see that the drop worked.
- **Influence scan**: ``run.influence(probe, top=10)`` over every recorded parameter and step,
  page cache dropped first. Throughput = bytes of those same files / wall time, so the two
  numbers are comparable; the table also shows the gradient bytes (float32) processed.
- Both are repeated ``--reps`` times, alternating, and the medians are reported with the ratio
  scan / raw (acceptance: >= 0.5).
- **Slice latency** (warm cache, median of ``--lat-reps``): one step of one parameter, one
  datum's trajectory, norms of the whole run, the records index of one step, similarity within
  a step, self-influence; and the first (cold) call of each after dropping the cache.

Usage::

    python tests/benchmarks/bench_query.py --gib 1 --reps 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gradlog


def record(path: Path, *, width: int, batch: int, gib: float, backend: str) -> gradlog.Run:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 16))
    per_record = sum(p.numel() for p in model.parameters()) * 4
    steps = max(2, int(gib * 2**30 / (per_record * batch)))
    gen = torch.Generator().manual_seed(1)
    n_data = 4 * batch
    x = torch.randn(n_data, width, generator=gen)
    y = torch.randint(0, 16, (n_data,), generator=gen)
    probes = (torch.randn(2, width, generator=gen), torch.randint(0, 16, (2,), generator=gen))

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1], reduction="none")

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradlog.GradRecorder(
        model,
        path,
        backend=backend,
        optimizer=opt,
        overwrite=True,
        probes=(loss_fn, probes),
        check_every=0,
    ) as rec:
        for _ in range(steps):
            idx = torch.randperm(n_data, generator=gen)[:batch]
            rec.step(loss_fn, (x[idx], y[idx]), datum_ids=idx)
            opt.step()
            opt.zero_grad()
    return gradlog.open(path)


def array_files(path: Path) -> list[Path]:
    roots = [path / "grads", path / "probes" / "grads"]
    return sorted(f for r in roots if r.is_dir() for f in r.rglob("*") if f.is_file())


def drop_cache(files: list[Path]) -> str:
    """Evict the store's files from the page cache (only them: other processes keep theirs)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def raw_read(files: list[Path]) -> tuple[int, float]:
    total = 0
    t0 = time.perf_counter()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            while chunk := os.read(fd, 16 << 20):
                total += len(chunk)
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0


def median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="gradient bytes to record")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--backend", default="loop")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lat-reps", type=int, default=10)
    parser.add_argument("--max-memory", default=None, help="scan cap (default 256MiB)")
    parser.add_argument("--dir", default=None, help="where to write the store")
    parser.add_argument("--keep", action="store_true", help="keep the store")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_query-", dir=args.dir))
    path = root / "bench.gradlog"
    try:
        t0 = time.perf_counter()
        run = record(path, width=args.width, batch=args.batch, gib=args.gib, backend=args.backend)
        t_record = time.perf_counter() - t0
        files = array_files(path)
        on_disk = sum(f.stat().st_size for f in files)
        logical = sum(run.params.column("numel").to_pylist()) * 4 * run.datums.num_rows
        probe = run.probe_ids[0]
        run.influence(probe, top=10, max_memory=args.max_memory)  # warm imports, open arrays

        t = time.perf_counter()
        raw_read(files)
        warm_bw = on_disk / (time.perf_counter() - t)
        raw, scan = [], []
        method = ""
        for _ in range(args.reps):
            method = drop_cache(files)
            n, dt = raw_read(files)
            raw.append(n / dt)
            drop_cache(files)
            fresh = gradlog.open(path)
            t = time.perf_counter()
            fresh.influence(probe, top=10, max_memory=args.max_memory)
            scan.append(on_disk / (time.perf_counter() - t))
        raw_bw, scan_bw = statistics.median(raw), statistics.median(scan)

        steps = run.steps.column("step").to_pylist()
        mid = steps[len(steps) // 2]
        datum = int(run.datums.column("datum_id")[0].as_py())
        big = run.param_names[0]
        slices: dict[str, Callable[[], Any]] = {
            f"grads({big!r}, step=S)": lambda: run.grads(big, step=mid),
            f"trajectory({big!r}, datum)": lambda: run.trajectory(big, datum),
            "norms() of the whole run": lambda: run.norms(),
            "records(step=S)": lambda: run.records(step=mid),
            f"similarity({big!r}, within step S)": lambda: run.similarity(big, a={"step": mid}),
            "self_influence()": lambda: run.self_influence(),
        }
        latency = {}
        for name, fn in slices.items():
            drop_cache(files)
            cold_run = gradlog.open(path)
            cold_fn = {
                f"grads({big!r}, step=S)": lambda r=cold_run: r.grads(big, step=mid),
                f"trajectory({big!r}, datum)": lambda r=cold_run: r.trajectory(big, datum),
                "norms() of the whole run": lambda r=cold_run: r.norms(),
                "records(step=S)": lambda r=cold_run: r.records(step=mid),
                f"similarity({big!r}, within step S)": lambda r=cold_run: r.similarity(
                    big, a={"step": mid}
                ),
                "self_influence()": lambda r=cold_run: r.self_influence(),
            }[name]
            t = time.perf_counter()
            cold_fn()
            cold = time.perf_counter() - t
            latency[name] = (cold, median_time(fn, args.lat_reps))

        mb = 1e6
        print(
            f"# bench_query  {datetime.datetime.now().isoformat(timespec='seconds')}  "
            f"{platform.node()}  {os.cpu_count()} CPUs  gradlog {gradlog.__version__}  "
            f"format v{run.format_version}"
        )
        print(
            f"store: {run.steps.num_rows} steps x {args.batch} records, "
            f"{len(run.param_names)} params, {logical / mb:.0f} MB of float32 gradients, "
            f"{on_disk / mb:.0f} MB of array files (recorded in {t_record:.1f} s); "
            f"cache dropped with {method}; scan cap {args.max_memory or '256MiB'}"
        )
        print()
        print("| measurement | MB/s (median) | runs |")
        print("|---|---:|---|")
        print(
            f"| raw sequential read of the array files | {raw_bw / mb:.0f} | "
            f"{', '.join(f'{v / mb:.0f}' for v in raw)} |"
        )
        print(f"| (warm read of the same files, page cache) | {warm_bw / mb:.0f} | |")
        print(
            f"| influence scan (file bytes / s) | {scan_bw / mb:.0f} | "
            f"{', '.join(f'{v / mb:.0f}' for v in scan)} |"
        )
        print(
            f"| influence scan (float32 gradient bytes / s) | "
            f"{scan_bw * logical / on_disk / mb:.0f} | |"
        )
        print(f"| **scan / raw** | **{scan_bw / raw_bw:.2f}** | target >= 0.50 |")
        print()
        print("| slice | cold (ms) | warm median (ms) |")
        print("|---|---:|---:|")
        for name, (cold, warm) in latency.items():
            print(f"| {name} | {cold * 1e3:.1f} | {warm * 1e3:.1f} |")
    finally:
        if args.keep:
            print(f"store kept at {path}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
