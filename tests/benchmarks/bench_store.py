"""Store benchmark: gradlog's writer against the disk's raw write bandwidth, in the same run,
on real per-datum gradients; compression and error of each storage dtype; read latency; and
the cost of a recorded step with compute and writes overlapped.

What is measured (each size: the small and medium GPT of ``../shared/PEERS.md``, built as in
``bench_compute.py``: vocab 512, d 128/256, 2/4 layers, T 64/128, B 16/32):

- **Gradients**: ``--distinct`` steps of real per-datum gradients from gradlog's ``vmap``
  backend (AdamW steps between them, so they differ), cycled over the steps written.
- **Raw write**: the same float32 bytes per step, one file per step, ``numpy.tofile`` +
  ``fsync``: the disk's sequential write bandwidth.
- **gradlog write**: ``StoreWriter`` (the recorder's writer: background thread, shards written
  with ``writev``, ``syncfs`` before each commit) appending ``--steps`` steps of the same
  gradients, timed to the end of ``close()``. MB/s counts float32 gradient bytes, as raw does.
  Raw and gradlog alternate (in alternating order) for ``--rounds`` rounds, each after an
  ``os.sync()`` that writes back the previous measurement's dirty pages; medians are reported
  with the median of the paired ratios.
  The same pair then runs again beside compute on every core (``busy_compute``: matmuls on
  every torch thread in a background thread), each paired with the other, for the issue's
  "writer beside compute on all cores" (``--skip busy`` leaves it out).
  zarr-python writing the format-1 layout (one ``arr[a:b] = g`` per parameter and step) is
  timed once for reference.
- **Codecs**: each storage dtype and compressor: on-disk ratio (float32 bytes / bytes of the
  arrays' files), write MB/s, and the error read back against the float32 gradients: median
  and max relative error of nonzero elements, fraction of nonzero elements stored as 0, and the
  worst per-datum relative L2 error and cosine.
- **Reads** (a store of ``--read-steps`` steps, the same ``B`` datum ids each step; page cache
  of the store's files dropped with ``posix_fadvise(DONTNEED)`` before each cold query): Q1 one
  datum of one parameter (a d x d attention weight) across all steps; Q2 every parameter's
  gradients of one step; Q3 the norms of every parameter over a range of 10 steps. Each on a
  fresh ``gradlog.open`` (index included), and with zarr-python reading the same arrays.
- **Overlap**: per step, compute alone (the ``--backend`` per-datum gradients + AdamW step),
  the raw disk write alone, gradlog's write alone (the writer, as above), and a
  ``GradRecorder`` loop doing both, the writer overlapped with the next step's compute
  (``check_every=0``); the acceptance ratio is recorded / max(compute, raw disk), in steady
  state: the loops time ``--overlap-steps`` steps after a warm-up step and two more that fill
  the writer's queue, to the end of the last step (the final ``close()``, one step's write
  paid once per run, is shown separately). The floor beside it: the same recorder loop with
  gradlog's writer replaced by a raw one (each step's arrays ``tofile`` + ``fsync`` in a
  thread), what this machine allows compute and writes overlapped whatever the format.

Usage (the results are appended to RESULTS.md beside this file)::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_store.py --sizes small,medium
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compute import SIZES, build, token_losses

import gradlog
from gradlog.config import RecorderConfig
from gradlog.store import format as fmt
from gradlog.store.writer import ParamSpec, StoreWriter

Grads = dict[str, torch.Tensor]
CODECS = [  # (dtype, compression)
    ("float32", "none"),
    ("float32", "lz4"),
    ("float32", "zstd"),
    ("bfloat16", "none"),
    ("bfloat16", "lz4"),
    ("float16", "none"),
    ("bitround9", "lz4"),
    ("bitround7", "lz4"),
]
OUT: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    OUT.append(line)


# -- gradients ------------------------------------------------------------------------------
def real_gradients(size: str, distinct: int) -> tuple[list[Grads], Any]:
    """``distinct`` steps of per-datum gradients of the GPT of ``size`` (vmap backend)."""
    from gradlog.backends import BACKENDS
    from gradlog.losses import per_datum_losses
    from gradlog.params import select_params

    model, x, y = build(size)
    params = select_params(model, ["*"])
    backend = BACKENDS["vmap"](model, params, batch_reduction="mean", randomness="different")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = []
    gen = torch.Generator().manual_seed(1)
    vocab = SIZES[size]["vocab"]
    for _ in range(distinct):
        model.zero_grad(set_to_none=True)
        _, grads = backend.step(
            token_losses, (x, y), lambda r, m: per_datum_losses(r, m, "mean"), None, lambda _: None
        )
        out.append({n: g.detach().contiguous() for n, g in grads.items()})
        opt.step()
        for _ in range(5):  # move on, so that the next recorded step differs
            x = torch.randint(0, vocab, x.shape, generator=gen)  # (B, T)
            y = torch.randint(0, vocab, y.shape, generator=gen)  # (B, T)
            model.zero_grad(set_to_none=True)
            token_losses(model, (x, y)).mean().backward()
            opt.step()
    return out, model


def payload_bytes(grads: Grads) -> int:
    return sum(g.numel() * 4 for g in grads.values())


# -- disk helpers ---------------------------------------------------------------------------
def files(root: Path) -> Iterator[Path]:
    for directory, _, names in os.walk(root):
        for name in names:
            yield Path(directory) / name


def drop_cache(root: Path) -> None:
    """Evict ``root``'s files from the page cache (they are clean: written and synced)."""
    for f in files(root):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def settle() -> None:
    """Start each measurement from a clean page cache: write back every dirty page first
    (the previous measurement's writeback would otherwise throttle this one)."""
    os.sync()
    time.sleep(0.5)


def array_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in files(root / "grads"))


def raw_write(grads: list[Grads], steps: int, where: Path) -> float:
    """MB/s of numpy tofile + fsync, one file per step."""
    where.mkdir(parents=True)
    host = [[g.numpy() for g in step.values()] for step in grads]
    settle()
    t0 = time.perf_counter()
    for s in range(steps):
        with open(where / f"step{s}.bin", "wb") as f:
            for a in host[s % len(host)]:
                a.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    shutil.rmtree(where)
    return steps * payload_bytes(grads[0]) / dt / 1e6


@contextlib.contextmanager
def busy_compute() -> Iterator[None]:
    """Matmuls on every torch thread, in a background thread, while the body runs: a training
    step's compute on all cores beside the writer (each op releases the GIL, as training's
    do; its Python between ops holds it)."""
    stop = threading.Event()
    a = torch.randn(384, 384)

    def burn() -> None:
        while not stop.is_set():
            torch.mm(a, a)

    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# -- gradlog writes -------------------------------------------------------------------------
def new_writer(path: Path, grads: Grads, dtype: str, compression: str, **kw: Any) -> StoreWriter:
    config = RecorderConfig(backend="vmap", dtype=dtype, compression=compression)
    attrs = {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "gradlog_version": gradlog.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"class": "CharGPT", "n_parameters": sum(g[0].numel() for g in grads.values())},
        "config": config.to_json(),
        "config_hash": config.hash(),
        "backend": {"name": "vmap"},
    }
    specs = {n: ParamSpec(n, tuple(g.shape[1:]), dtype, "float32") for n, g in grads.items()}
    return StoreWriter(path, attrs=attrs, specs=specs, compression=config.compression, **kw)


_NORMS: dict[int, dict[str, np.ndarray]] = {}


def norms_of(grads: Grads) -> dict[str, np.ndarray]:
    """The recorder computes norms on its own thread (compute side): cached, not timed."""
    if id(grads) not in _NORMS:
        batch = next(iter(grads.values())).shape[0]
        _NORMS[id(grads)] = {
            n: torch.linalg.vector_norm(g.reshape(batch, -1).double(), dim=1).numpy()
            for n, g in grads.items()
        }
    return _NORMS[id(grads)]


def append_step(writer: StoreWriter, grads: Grads, step: int) -> None:
    batch = next(iter(grads.values())).shape[0]
    norms = norms_of(grads)
    start, _ = writer.append(
        step=step,
        micro=0,
        datum_ids=np.arange(batch),
        losses=np.ones(batch),
        weights=np.full(batch, 1 / batch),
        lr=1e-3,
        grads={n: g.numpy() for n, g in grads.items()},  # the writer takes host numpy arrays
        norms=norms,
    )
    writer.commit(
        {
            "step": step,
            "first_row": start,
            "n_records": batch,
            "n_micro": 1,
            "tokens": batch,
            "lr": 1e-3,
            "loss_mean": 1.0,
            "time_compute_s": 0.0,
            "time_write_s": 0.0,
        }
    )


def gradlog_write(
    grads: list[Grads],
    steps: int,
    path: Path,
    dtype: str = "float32",
    compression: str = "none",
    durable: bool = True,
) -> float:
    """MB/s (float32 gradient bytes) of the writer, from its first append to the end of
    close() (creating the store, a one-time cost, is not timed)."""
    for g in grads:
        norms_of(g)
    writer = new_writer(path, grads[0], dtype, compression, durable=durable)
    settle()
    t0 = time.perf_counter()
    for s in range(steps):
        append_step(writer, grads[s % len(grads)], s)
    writer.close()
    dt = time.perf_counter() - t0
    return steps * payload_bytes(grads[0]) / dt / 1e6


def zarr_v1_write(grads: list[Grads], steps: int, path: Path) -> float:
    """zarr-python writing the format-1 layout: chunks (B, *shape), blosc zstd + crc32c."""
    import zarr
    from zarr.codecs import BloscCodec, Crc32cCodec

    batch = next(iter(grads[0].values())).shape[0]
    t0 = time.perf_counter()
    group = zarr.open_group(str(path), mode="w")
    arrays = {
        n: group.create_array(
            n,
            shape=(steps * batch, *g.shape[1:]),
            chunks=(batch, *g.shape[1:]),
            dtype="float32",
            fill_value=0,
            compressors=[
                BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle", typesize=4),
                Crc32cCodec(),
            ],
        )
        for n, g in grads[0].items()
    }
    for s in range(steps):
        for n, arr in arrays.items():
            arr[s * batch : (s + 1) * batch] = grads[s % len(grads)][n].numpy()
    os.sync()
    dt = time.perf_counter() - t0
    return steps * payload_bytes(grads[0]) / dt / 1e6


def errors_of(path: Path, reference: Grads) -> dict[str, float]:
    """Read step 0 back; errors against the float32 gradients it was written from."""
    run = gradlog.open(path)
    rel, zeroed, nonzero = [], 0, 0
    worst_l2, worst_cos = 0.0, 1.0
    for name, g in reference.items():
        exact = g.numpy().reshape(g.shape[0], -1).astype(np.float64)
        got = run.grads(name, step=0, dtype=np.float64).reshape(exact.shape)
        mask = exact != 0
        nonzero += int(mask.sum())
        zeroed += int((got[mask] == 0).sum())
        rel.append(np.abs(got[mask] - exact[mask]) / np.abs(exact[mask]))
        norm = np.linalg.norm(exact, axis=1)
        ok = norm > 0
        diff = np.linalg.norm(got - exact, axis=1)
        if ok.any():
            worst_l2 = max(worst_l2, float((diff[ok] / norm[ok]).max()))
            got_norm = np.linalg.norm(got, axis=1)[ok]
            dot = (got * exact).sum(1)[ok]
            cos = np.where(got_norm > 0, dot / np.maximum(got_norm, 1e-300) / norm[ok], 0.0)
            worst_cos = min(worst_cos, float(cos.min()))
    allrel = np.concatenate(rel)
    return {
        "median_rel": float(np.median(allrel)),
        "max_rel": float(allrel.max()),
        "zeroed": zeroed / max(1, nonzero),
        "l2": worst_l2,
        "cos": worst_cos,
    }


# -- reads ----------------------------------------------------------------------------------
def timed(fn: Callable[[], Any], reps: int = 3, cold: Path | None = None) -> float:
    times = []
    for _ in range(reps):
        if cold is not None:
            drop_cache(cold)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_latency(path: Path, param: str, steps: int) -> list[tuple[str, float, float]]:
    """(query, gradlog s, zarr-python s): cold = page cache of the store dropped first."""
    import zarr

    run = gradlog.open(path)
    names = run.param_names
    rows_q1 = np.asarray(run.records(datum=0).column("row"))
    mid = steps // 2
    rows_q2 = np.asarray(run.records(step=mid).column("row"))
    lo, hi = int(rows_q2[0]), int(rows_q2[-1]) + 1
    opened = gradlog.open(path)
    assert opened.datums.num_rows  # the index, read once per Run

    def index() -> Any:
        return gradlog.open(path).datums

    def q1() -> Any:
        return opened.grads(param, datum=0)

    def q1_zarr() -> Any:
        return zarr.open_array(str(path / fmt.array_path(param)), mode="r").oindex[rows_q1]

    def q2() -> Any:
        return [opened.grads(n, step=mid) for n in names]

    def q2_zarr() -> Any:
        return [zarr.open_array(str(path / fmt.array_path(n)), mode="r")[lo:hi] for n in names]

    def q3() -> Any:
        return opened.norms(step=slice(mid - 5, mid + 5))

    assert q1().shape[0] == steps
    np.testing.assert_array_equal(q1(), q1_zarr())  # zarr-python reads the same bits
    nan = float("nan")
    return [
        (f"open + read the index ({steps} steps' parts)", timed(index, cold=path), nan),
        (f"Q1: datum 0 of {param}, {steps} steps", timed(q1, cold=path), timed(q1_zarr, cold=path)),
        (
            f"Q2: all {len(names)} parameters of one step",
            timed(q2, cold=path),
            timed(q2_zarr, cold=path),
        ),
        ("Q3: norms, all parameters, 10 steps", timed(q3, cold=path), nan),
        ("open + read the index, warm", timed(index), nan),
        ("Q1 warm", timed(q1), timed(q1_zarr)),
        ("Q2 warm", timed(q2), timed(q2_zarr)),
        ("Q3 warm", timed(q3), nan),
    ]


# -- overlap --------------------------------------------------------------------------------
class NullWriter:
    """Stands in for StoreWriter to time the recorder without any writing."""

    def __init__(self, path: Any, *, specs: Any, **kwargs: Any) -> None:
        self.path = path
        self.rows = 0
        self.last_step = None
        self.next_datum_id = 0
        self.planned_specs = None

    def set_forms(self, forms: Any) -> None:
        pass

    def append(self, *, datum_ids: Any, grads: Any, **kwargs: Any) -> tuple[int, int]:
        for g in grads.values():
            for a in g.values() if isinstance(g, dict) else [g]:
                np.asarray(a)  # what the writer would touch first
        start, self.rows = self.rows, self.rows + len(datum_ids)
        return start, self.rows

    def commit(self, row: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class RawWriter(NullWriter):
    """Stands in for StoreWriter with the floor of a background writer: each call's arrays
    handed to one thread that writes them as raw bytes (``tofile``, one file per call) and
    calls ``fsync``; one call queued behind the one being written, as gradlog's default queue.
    Compute beside this writer is what the machine itself allows: the disk's interrupts, the
    hypervisor's I/O work and the memory traffic of the writes land on the compute cores."""

    def __init__(self, path: Any, *, specs: Any, **kwargs: Any) -> None:
        super().__init__(path, specs=specs, **kwargs)
        import queue
        import threading

        self._dir = Path(path)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._queue: Any = queue.Queue(maxsize=1)
        self._calls = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            number, arrays = item
            with open(self._dir / f"call{number}.bin", "wb") as f:
                for a in arrays:
                    a.tofile(f)
                f.flush()
                os.fsync(f.fileno())
            self._queue.task_done()
        self._queue.task_done()

    def append(self, *, datum_ids: Any, grads: Any, **kwargs: Any) -> tuple[int, int]:
        arrays = [np.asarray(a) for g in grads.values()
                  for a in (g.values() if isinstance(g, dict) else [g])]
        self._queue.put((self._calls, arrays))
        self._calls += 1
        start, self.rows = self.rows, self.rows + len(datum_ids)
        return start, self.rows

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def recorder_loop(size: str, steps: int, backend: str, path: Path, fill: int = 2
                  ) -> dict[str, float]:
    """Seconds per step of a GradRecorder training loop: ``steady``, the time of ``steps``
    steps after one warm-up step and ``fill`` more that fill the writer's queue (its default
    capacity is one step, plus the step the thread is writing), up to the end of the last
    step; ``with_close``, the same plus the final ``close()``, which waits for the queue to
    drain (one step's write, paid once per run, so it weighs 1/steps here)."""
    model, x, y = build(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradlog.GradRecorder(model, path, backend=backend, check_every=0) as rec:

        def recorded_step() -> None:
            model.zero_grad(set_to_none=True)
            if rec._backend is not None and rec._backend.needs_loss_fn:
                rec.step(token_losses, (x, y))
            else:
                rec.backward(token_losses(model, (x, y)))
            opt.step()

        recorded_step()  # warm-up
        rec.flush()
        for _ in range(fill):
            recorded_step()
        t0 = time.perf_counter()
        for _ in range(steps):
            recorded_step()
        t1 = time.perf_counter()
    t2 = time.perf_counter()  # close() wrote and committed the last steps
    return {"steady": (t1 - t0) / steps, "with_close": (t2 - t0) / steps}


def overlap(size: str, steps: int, backend: str, tmp: Path, grads: Grads) -> dict[str, float]:
    """Seconds per step: the recorder with a null writer (compute: per-datum gradients,
    norms, AdamW), the raw disk and the writer alone, compute beside a raw writer (the
    floor), and the real recorder (both, overlapped)."""
    import gradlog.recording.handoff as handoff  # where the recorder opens its writer

    def with_writer(writer: Any, name: str) -> float:
        real = vars(handoff)["StoreWriter"]
        setattr(handoff, "StoreWriter", writer)  # noqa: B010 (a module's name, replaced)
        try:
            settle()
            return recorder_loop(size, steps, backend, tmp / name)["steady"]
        finally:
            setattr(handoff, "StoreWriter", real)  # noqa: B010
            shutil.rmtree(tmp / name, ignore_errors=True)

    compute = with_writer(NullWriter, "null.gradlog")
    raw = payload_bytes(grads) / (raw_write([grads], steps, tmp / "raw") * 1e6)
    write = payload_bytes(grads) / (gradlog_write([grads], steps, tmp / "w.gradlog") * 1e6)
    shutil.rmtree(tmp / "w.gradlog")
    floor = with_writer(RawWriter, "floor.gradlog")
    settle()
    recorded = recorder_loop(size, steps, backend, tmp / "o.gradlog")
    shutil.rmtree(tmp / "o.gradlog")
    return {"compute": compute, "raw": raw, "write": write, "floor": floor,
            "recorded": recorded["steady"], "recorded_with_close": recorded["with_close"]}


# -- main -----------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--steps", type=int, default=8, help="steps per write measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating raw/gradlog rounds")
    parser.add_argument("--distinct", type=int, default=3, help="distinct gradient steps")
    parser.add_argument(
        "--read-steps",
        default="small:100,medium:24",
        help="steps of the read-benchmark store, per size",
    )
    parser.add_argument("--overlap-steps", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads of the compute (e.g. 1 on a 2-core machine, leaving a "
        "core to the writer as a GPU node's spare cores would)",
    )
    parser.add_argument("--backend", default="hooks", help="backend of the overlap benchmark")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (the disk)")
    parser.add_argument("--skip", default="",
                        help="comma-separated: busy,codecs,reads,overlap,zarr")
    parser.add_argument("--no-results", action="store_true", help="do not append RESULTS.md")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    read_steps = dict(item.split(":") for item in args.read_steps.split(","))
    base = Path(tempfile.mkdtemp(prefix="bench_store_", dir=args.dir))
    say(
        f"\n## Store: writes, codecs, reads, overlap (`bench_store.py`), "
        f"{datetime.datetime.now().isoformat(timespec='minutes')}"
    )
    say(
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, threads {torch.get_num_threads()}, disk of {base}, load "
        f"average {os.getloadavg()[0]:.1f}; {args.steps} steps per write, {args.rounds} "
        "rounds; MB/s = float32 gradient bytes / wall time, fsync (syncfs) included"
    )
    try:
        for size in args.sizes.split(","):
            run_size(size, args, skip, int(read_steps.get(size, 20)), base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not args.no_results:
        results = Path(__file__).resolve().parent / "RESULTS.md"
        with open(results, "a", encoding="utf-8") as f:
            f.write("\n".join(OUT) + "\n")
        print(f"\nappended to {results}")


def run_size(size: str, args: Any, skip: set[str], read_steps: int, base: Path) -> None:
    grads, _ = real_gradients(size, args.distinct)
    mib = payload_bytes(grads[0]) / 2**20
    say(
        f"\n### {size} GPT {SIZES[size]}: {len(grads[0])} tensors, {mib:.1f} MiB of float32 "
        "per-datum gradients per step"
    )
    raw: list[float] = []
    ours: list[float] = []
    ours_nosync: list[float] = []
    busy_raw: list[float] = []
    busy_ours: list[float] = []
    for r in range(args.rounds):

        def ours_write(r: int = r, into: list[float] = ours) -> None:
            into.append(gradlog_write(grads, args.steps, base / f"g{r}.gradlog"))
            shutil.rmtree(base / f"g{r}.gradlog")

        def raw_write_(r: int = r, into: list[float] = raw) -> None:
            into.append(raw_write(grads, args.steps, base / f"raw{r}"))

        for first in (raw_write_, ours_write) if r % 2 == 0 else (ours_write, raw_write_):
            first()  # alternate the order: neither always follows the other
        ours_nosync.append(gradlog_write(grads, args.steps, base / f"n{r}.gradlog", durable=False))
        shutil.rmtree(base / f"n{r}.gradlog")
        if "busy" not in skip:
            pair = [lambda: raw_write_(into=busy_raw), lambda: ours_write(into=busy_ours)]
            for measure in pair if r % 2 == 0 else pair[::-1]:
                with busy_compute():
                    measure()
    ratio = [o / r for o, r in zip(ours, raw)]
    say("\n| writer (float32, full form) | MB/s median | min-max | vs raw (median of paired) |")
    say("|---|---|---|---|")
    say(
        f"| raw numpy tofile + fsync | {statistics.median(raw):.0f} | {min(raw):.0f}-"
        f"{max(raw):.0f} | 1.00 |"
    )
    say(
        f"| gradlog StoreWriter, durable (syncfs per step) | {statistics.median(ours):.0f} | "
        f"{min(ours):.0f}-{max(ours):.0f} | **{statistics.median(ratio):.2f}** "
        f"({min(ratio):.2f}-{max(ratio):.2f}) |"
    )
    say(
        f"| gradlog StoreWriter, durable=False (no sync per step) | "
        f"{statistics.median(ours_nosync):.0f} | {min(ours_nosync):.0f}-{max(ours_nosync):.0f} "
        f"| {statistics.median(ours_nosync) / statistics.median(raw):.2f} |"
    )
    if busy_raw:
        busy = [o / r for o, r in zip(busy_ours, busy_raw)]
        say(
            f"| raw tofile + fsync beside compute on every core | "
            f"{statistics.median(busy_raw):.0f} | {min(busy_raw):.0f}-{max(busy_raw):.0f} | "
            f"1.00 (beside compute) |"
        )
        say(
            f"| gradlog StoreWriter, durable, beside compute on every core | "
            f"{statistics.median(busy_ours):.0f} | {min(busy_ours):.0f}-{max(busy_ours):.0f} | "
            f"**{statistics.median(busy):.2f}** ({min(busy):.2f}-{max(busy):.2f}) of raw beside "
            "compute |"
        )
    if "zarr" not in skip:
        z = zarr_v1_write(grads, max(2, args.steps // 2), base / "z.zarr")
        shutil.rmtree(base / "z.zarr")
        say(
            f"| zarr-python 3.1, format-1 layout (blosc zstd) | {z:.0f} | - | "
            f"{z / statistics.median(raw):.2f} |"
        )

    if "codecs" not in skip:
        say(
            "\n| dtype | compression | ratio | write MB/s | median rel. error | max rel. error "
            "| nonzero stored as 0 | worst per-datum rel. L2 | 1 - worst cosine |"
        )
        say("|---|---|---|---|---|---|---|---|---|")
        for dtype, compression in CODECS:
            path = base / f"{dtype}-{compression}.gradlog"
            speed = gradlog_write(grads, args.steps, path, dtype, compression)
            ratio_c = args.steps * payload_bytes(grads[0]) / array_bytes(path)
            e = errors_of(path, grads[0])
            shutil.rmtree(path)
            say(
                f"| {dtype} | {compression} | {ratio_c:.2f} | {speed:.0f} | "
                f"{e['median_rel']:.2e} | {e['max_rel']:.2e} | {e['zeroed']:.2%} | "
                f"{e['l2']:.2e} | {1 - e['cos']:.1e} |"
            )

    if "reads" not in skip:
        path = base / "reads.gradlog"
        gradlog_write(grads, read_steps, path)
        param = "blocks.0.attn.q.weight"
        if param not in grads[0]:
            param = next(n for n, g in grads[0].items() if g.dim() == 3)
        say(
            f"\n| read ({read_steps}-step store, float32; Q1-Q3 on an open Run) | gradlog s "
            "| zarr-python s (rows known) |"
        )
        say("|---|---|---|")
        for label, ours_s, zarr_s in read_latency(path, param, read_steps):
            cold = "" if "warm" in label else ", cold"
            zs = "-" if zarr_s != zarr_s else f"{zarr_s:.4f}"
            say(f"| {label}{cold} | {ours_s:.4f} | {zs} |")
        shutil.rmtree(path)

    if "overlap" not in skip:
        from gradlog.backends import BACKENDS

        backend = args.backend if args.backend in BACKENDS else "vmap"
        o = overlap(size, args.overlap_steps, backend, base, grads[0])
        slowest = max(o["compute"], o["write"])
        bound = max(o["compute"], o["raw"])
        say(f"\n| overlap ({backend} backend, {args.overlap_steps} steps) | s/step |")
        say("|---|---|")
        say(
            f"| compute alone (recorder with a null writer: per-datum gradients, norms, "
            f"AdamW) | {o['compute']:.3f} |"
        )
        say(f"| raw disk write alone (numpy tofile + fsync) | {o['raw']:.3f} |")
        say(f"| write alone (StoreWriter, durable) | {o['write']:.3f} |")
        say(f"| serial sum | {o['compute'] + o['write']:.3f} |")
        say(f"| recorded step, overlapped (GradRecorder), steady | {o['recorded']:.3f} |")
        say(f"| the same with the final close() spread over the {args.overlap_steps} steps | "
            f"{o['recorded_with_close']:.3f} |")
        say(f"| floor: compute beside a raw writer (tofile + fsync of each step's arrays "
            f"in a thread) | {o['floor']:.3f} |")
        say(f"| **recorded / max(compute, write)** | **{o['recorded'] / slowest:.2f}** |")
        say(f"| **recorded / max(compute, raw disk)** | **{o['recorded'] / bound:.2f}** |")
        say(f"| floor / max(compute, raw disk) | {o['floor'] / bound:.2f} |")
        say(f"| recorded / floor | {o['recorded'] / o['floor']:.2f} |")


if __name__ == "__main__":
    main()
