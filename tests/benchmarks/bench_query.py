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
- **Form space** (``--forms-steps`` > 0): the same run (same model, data and seeds) recorded
  twice with the hooks backend, once ``form="full"`` and once ``--factored-form`` (default
  ``auto``: ``factors`` where they are smaller, ``T (d_in + d_out) < d_in d_out``, i.e. the
  ``width x width`` layer; ``full`` for the small head and the biases), a sequence model
  (``--tokens`` tokens per datum) so that a Linear weight's per-datum gradient is
  ``G_b^T A_b`` of rank ``tokens``. At each of ``--forms-widths`` (default 128 and 512, a
  typical LM layer), influence of a recorded probe (every datum) and similarity of a block
  of records (``--forms-records``; ``--forms-records-wide`` above width 256, where a full
  record is over 1 MB) are timed on both stores (warm cache, median of ``--forms-reps``); the
  factored store compares records through ``Form.inner`` / ``inner_dense`` without
  rebuilding them. The table gives both times, the speed-up and the largest absolute
  difference of the scores, also relative to the largest score.

- **Many probes** (``--matrix-only``, or ``--matrix-data`` > 0 after the rest): a store of
  ``--matrix-data`` training data (each recorded once, batches of ``--matrix-batch``) and
  ``--matrix-probes`` probes recorded at every step (hooks backend, AdamW, float32, an MLP of
  width ``--matrix-width``), then ``run.influence_matrix()`` (every datum x every probe, one
  pass, ``kind="tracin"`` and ``kind="optimizer"``) against the raw sequential read of the
  same array files (training and probe gradients), page cache dropped before each,
  alternated ``--reps`` times; medians and the ratio (acceptance: >= 0.7). The scan's peak
  traced memory (tracemalloc, a separate untimed run) is shown against ``max_memory``.

Usage::

    python tests/benchmarks/bench_query.py --matrix-only --reps 3   # 1,000 data x 100 probes
    python tests/benchmarks/bench_query.py --gib 1 --reps 3
    python tests/benchmarks/bench_query.py --forms-only            # widths 128 and 512, ~1-2 min
    python tests/benchmarks/bench_query.py --forms-only --forms-widths 256 --tokens 32
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


def record_forms(
    path: Path, form: str, *, width: int, batch: int, tokens: int, steps: int
) -> gradlog.Run:
    """A sequence MLP recorded with ``form``; everything else seeded, so two forms record
    the same run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 16))
    gen = torch.Generator().manual_seed(1)
    n_data = 4 * batch
    x = torch.randn(n_data, tokens, width, generator=gen)
    y = torch.randint(0, 16, (n_data, tokens), generator=gen)
    probes = (torch.randn(2, tokens, width, generator=gen),
              torch.randint(0, 16, (2, tokens), generator=gen))

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = m(b[0])  # (B, T, 16)
        per_token = F.cross_entropy(logits.transpose(1, 2), b[1], reduction="none")  # (B, T)
        return per_token.mean(1)  # (B,)

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradlog.GradRecorder(
        model, path, backend="hooks", form=form, optimizer=opt, overwrite=True,
        probes=(loss_fn, probes), check_every=0,
    ) as rec:
        for _ in range(steps):
            idx = torch.randperm(n_data, generator=gen)[:batch]
            rec.step(loss_fn, (x[idx], y[idx]), datum_ids=idx)
            opt.step()
            opt.zero_grad()
    return gradlog.open(path)


def forms_table(root: Path, args: argparse.Namespace) -> None:
    """Influence and similarity on a factored store against the ``full`` store of the same
    run, at each width: time, speed-up and largest score difference (module doc, **Form
    space**)."""
    print()
    print(
        f"form space: {args.forms_steps} steps x {args.batch} records x {args.tokens} tokens; "
        f"factored store recorded with form={args.factored_form!r}; warm cache, median of "
        f"{args.forms_reps}; scan cap {args.max_memory or '256MiB'}"
    )
    print()
    print("| width | query | full (ms) | factored (ms) | speed-up | max abs diff | "
          "diff / max score | max abs score |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for width in args.forms_widths:
        forms_rows(root, args, width)
    print()


def forms_rows(root: Path, args: argparse.Namespace, width: int) -> None:
    """The table rows of one width (:func:`forms_table`)."""
    size = {"width": width, "batch": args.batch, "tokens": args.tokens,
            "steps": args.forms_steps}
    forms = {"full": "full", "factored": args.factored_form}
    runs = {k: record_forms(root / f"{k}{width}.gradlog", f, **size) for k, f in forms.items()}
    n = args.forms_records if width <= 256 else args.forms_records_wide
    rows = runs["full"].datums.column("row").to_numpy()[:n]
    block = runs["full"].datums.take(np.arange(rows.size))
    big = runs["full"].param_names[0]
    planned = runs["factored"].params.column("form").to_pylist()

    def influence(run: gradlog.Run) -> np.ndarray:
        table = run.influence(run.probe_ids[0], top=None, max_memory=args.max_memory)
        return table.sort_by("datum_id").column("score").to_numpy()

    queries: dict[str, Callable[[gradlog.Run], np.ndarray]] = {
        "influence(probe, top=None), every param": influence,
        f"similarity({big!r}, {rows.size} x {rows.size} records)": lambda run: run.similarity(
            big, a=block, max_memory=args.max_memory
        ),
        f"similarity(every param, {rows.size} x {rows.size}, cosine)": lambda run: (
            run.similarity(a=block, kind="cosine", max_memory=args.max_memory)
        ),
    }
    note = (f"{runs['full'].nbytes / 1e6:.1f} MB full, {runs['factored'].nbytes / 1e6:.1f} MB "
            f"factored ({'/'.join(planned)})")
    for name, query in queries.items():
        dense, factored = query(runs["full"]), query(runs["factored"])  # warm: arrays opened
        t_full = median_time(lambda q=query: q(runs["full"]), args.forms_reps)
        t_fact = median_time(lambda q=query: q(runs["factored"]), args.forms_reps)
        diff = float(np.max(np.abs(dense - factored))) if dense.size else 0.0
        top = float(np.max(np.abs(dense))) if dense.size else 0.0
        print(
            f"| {width} | {name} | {t_full * 1e3:.1f} | {t_fact * 1e3:.1f} | "
            f"{t_full / t_fact:.2f}x | {diff:.2e} | {diff / top if top else 0.0:.1e} | "
            f"{top:.2e} |"
        )
    print(f"| {width} | stores: {note} | | | | | | |")


def record_matrix(path: Path, args: argparse.Namespace) -> gradlog.Run:
    """``--matrix-data`` training data, each once, and ``--matrix-probes`` probes per step."""
    torch.manual_seed(0)
    width = args.matrix_width
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 16))
    gen = torch.Generator().manual_seed(1)
    n = args.matrix_data
    x, y = torch.randn(n, width, generator=gen), torch.randint(0, 16, (n,), generator=gen)
    probes = (torch.randn(args.matrix_probes, width, generator=gen),
              torch.randint(0, 16, (args.matrix_probes,), generator=gen))

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1], reduction="none")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradlog.GradRecorder(model, path, optimizer=opt, overwrite=True,
                              probes=(loss_fn, probes), check_every=0) as rec:
        for idx in torch.randperm(n, generator=gen).split(args.matrix_batch):
            rec.backward(loss_fn(model, (x[idx], y[idx])), datum_ids=idx)
            opt.step()
            opt.zero_grad()
    return gradlog.open(path)


def matrix_table(root: Path, args: argparse.Namespace) -> None:
    """Many probes in one pass against the raw read of the same files (module doc)."""
    import tracemalloc
    import warnings

    path = root / "matrix.gradlog"
    t0 = time.perf_counter()
    run = record_matrix(path, args)
    t_record = time.perf_counter() - t0
    files = array_files(path)
    on_disk = sum(f.stat().st_size for f in files)
    opt_bytes = sum(f.stat().st_size for f in (path / "optimizer").glob("*.npz"))
    cap = args.max_memory or "256MiB"
    warnings.simplefilter("ignore")
    for kind in ("tracin", "optimizer"):  # warm imports
        run.influence_matrix(kind=kind, max_memory=cap)
    raw: list[float] = []
    scans: dict[str, list[float]] = {"tracin": [], "optimizer": []}
    for _ in range(args.reps):  # alternated: raw, tracin, raw, optimizer, ...
        for kind in scans:
            drop_cache(files)
            n, dt = raw_read(files)
            raw.append(n / dt)
            drop_cache(files)
            fresh = gradlog.open(path)
            t = time.perf_counter()
            m = fresh.influence_matrix(kind=kind, max_memory=cap)
            scans[kind].append(on_disk / (time.perf_counter() - t))
    tracemalloc.start()
    m = gradlog.open(path).influence_matrix(kind="optimizer", max_memory=cap)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    raw_bw = statistics.median(raw)
    mb = 1e6
    print(f"# bench_query --matrix  {datetime.datetime.now().isoformat('T', 'seconds')}  "
          f"{platform.node()}  {os.cpu_count()} CPUs  gradlog {gradlog.__version__}")
    print(f"store: {run.datums.num_rows} training records x {m.scores.shape[1]} probes at each "
          f"of {run.steps.num_rows} steps ({run.probes.num_rows} probe records), width "
          f"{args.matrix_width}, {on_disk / mb:.0f} MB of array files, optimizer state "
          f"{opt_bytes / mb:.1f} MB (recorded in {t_record:.1f} s); scan cap {cap}")
    print()
    print("| measurement | MB/s (median) | runs | / raw |")
    print("|---|---:|---|---:|")
    print(f"| raw sequential read of the array files | {raw_bw / mb:.0f} | "
          f"{', '.join(f'{v / mb:.0f}' for v in raw)} | 1.00 |")
    for kind, values in scans.items():
        med = statistics.median(values)
        print(f"| influence_matrix, kind={kind} (file bytes / s) | {med / mb:.0f} | "
              f"{', '.join(f'{v / mb:.0f}' for v in values)} | **{med / raw_bw:.2f}** |")
    print()
    print(f"peak traced memory of influence_matrix: {peak / 2**20:.0f} MiB (max_memory {cap}; "
          f"result {m.scores.nbytes / 2**20:.2f} MiB)")


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
    parser.add_argument("--tokens", type=int, default=16, help="tokens per datum (forms)")
    parser.add_argument("--forms-steps", type=int, default=10, help="0: no form table")
    parser.add_argument("--forms-records", type=int, default=128, help="similarity block")
    parser.add_argument("--forms-records-wide", type=int, default=64,
                        help="similarity block above width 256")
    parser.add_argument("--forms-widths", type=lambda v: [int(w) for w in v.split(",")],
                        default=[128, 512], help="widths of the form table, e.g. 128,512")
    parser.add_argument("--factored-form", default="auto",
                        help="form of the factored store: auto (factors where smaller), factors")
    parser.add_argument("--forms-reps", type=int, default=3, help="repeats of a form query")
    parser.add_argument("--forms-only", action="store_true", help="only the form table")
    parser.add_argument("--matrix-only", action="store_true", help="only the many-probes table")
    parser.add_argument("--matrix-data", type=int, default=1000, help="0: no many-probes table")
    parser.add_argument("--matrix-probes", type=int, default=100)
    parser.add_argument("--matrix-batch", type=int, default=100)
    parser.add_argument("--matrix-width", type=int, default=256)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_query-", dir=args.dir))
    path = root / "bench.gradlog"
    try:
        if args.matrix_only:
            matrix_table(root, args)
            return
        if args.forms_only:
            print(f"# bench_query --forms-only  {datetime.datetime.now().isoformat('T', 'seconds')}"
                  f"  {platform.node()}  {os.cpu_count()} CPUs  gradlog {gradlog.__version__}")
            forms_table(root, args)
            return
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
        if args.forms_steps > 0:
            forms_table(root, args)
        if args.matrix_data > 0:
            matrix_table(root, args)
    finally:
        if args.keep:
            print(f"store kept at {path}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
