"""The fault suite: what goes wrong around a store must never pass in silence.

- a deleted or short index part of a committed step: ``StoreCorruptError`` naming it, at open
  and at ``refresh()``, never an empty selection;
- a non-finite per-datum gradient from a finite loss: stored as computed, flagged by its
  non-finite norm, with a ``NonFiniteGradientWarning`` naming the datum ids and parameters
  (oracle: ``autograd.grad`` per datum);
- a symbolic link inside a store being resumed (an array folder, a shard, a temporary):
  refused, nothing written outside;
- a full disk (a small tmpfs; needs root): ``StoreWriteError``, committed steps intact, and
  ``resume=True`` finishes the run bit for bit as an uninterrupted one;
- a reader polling a store while another process writes it: every state it sees is a prefix
  of the finished run, bit for bit;
- property-based fuzz of crafted root and array metadata (hypothesis): opening, reading,
  verifying and resuming never raise anything but a ``GradlogError``, never allocate absurd
  memory, never execute code from the store, never touch a path outside it.

``kill -9`` at random points (mid-commit, mid-resume) is in ``tests/test_crash.py``; two
concurrent writers in ``tests/test_lease.py``; flipped bytes, deleted and truncated chunks in
``tests/test_verify.py`` and ``tests/test_store_chunks.py``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import textwrap
import time
import tracemalloc
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradlog
from gradlog.errors import (
    GradlogError,
    InputError,
    NonFiniteGradientWarning,
    StoreCorruptError,
    StoreResumeError,
    StoreWriteError,
)
from gradlog.store import writer as writer_module
from gradlog.store.verify import verify

GOLDEN = Path(__file__).parent / "golden"


# -- a small deterministic run ------------------------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _train(path: Any, steps: range, *, resume: bool = False, **options: Any) -> None:
    """Record ``steps`` of the deterministic run (replaying, unrecorded, those before)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps.start):
        x, y = _batch(step)
        ((model(x) - y) ** 2).sum(1).mean().backward()
        opt.step()
        opt.zero_grad()
    with gradlog.GradRecorder(model, path, resume=resume, **options) as rec:
        for step in steps:
            x, y = _batch(step)
            rec.backward(((model(x) - y) ** 2).sum(1), step=step,
                         datum_ids=list(range(4 * step, 4 * step + 4)), lr=0.1)
            opt.step()
            opt.zero_grad()


def _assert_same(path: Any, reference: Any, steps: list[int] | None = None) -> None:
    """The committed steps of ``path`` (all of them, or ``steps``) equal the reference's."""
    run, ref = gradlog.open(path), gradlog.open(reference)
    committed = run.steps.column("step").to_pylist()
    if steps is not None:
        assert committed == steps
    assert committed == list(range(len(committed)))  # a prefix
    timing = ["time_compute_s", "time_write_s"]
    want_steps = ref.steps.drop_columns(timing).to_pylist()[: len(committed)]
    assert run.steps.drop_columns(timing).to_pylist() == want_steps
    if committed:
        assert run.records(step=committed).equals(ref.records(step=committed))
        for name in ref.param_names:
            assert run.grads(name, step=committed).tobytes() == ref.grads(
                name, step=committed).tobytes(), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults-reference") / "ref.gradlog"
    _train(path, range(6))
    return path


# -- the index against the steps table -----------------------------------------------------------
def test_a_deleted_index_part_is_refused_at_open_and_at_refresh(
    tmp_store: Path, reference: Path
) -> None:
    shutil.copytree(reference, tmp_store)
    watching = gradlog.open(tmp_store)
    assert watching.grads("0.weight", step=3).shape == (4, 4, 5)
    part = tmp_store / "index" / "step-000000000003-000000.parquet"
    part.unlink()
    with pytest.raises(StoreCorruptError, match=r"step-000000000003-000000.parquet"):
        gradlog.open(tmp_store)
    with pytest.raises(StoreCorruptError, match=r"step-000000000003-000000.parquet"):
        watching.refresh()
    report = verify(tmp_store)
    assert not report.ok


def test_a_short_index_part_is_refused_never_an_empty_selection(
    tmp_store: Path, reference: Path
) -> None:
    import pyarrow.parquet as pq

    shutil.copytree(reference, tmp_store)
    part = tmp_store / "index" / "step-000000000002-000000.parquet"
    pq.write_table(pq.read_table(part).slice(0, 1), part)  # 1 of the step's 4 records
    run = gradlog.open(tmp_store)  # every part is there: the count shows at the first read
    with pytest.raises(StoreCorruptError, match=r"committed step 2 has 4 records.*but 1 rows"):
        run.grads("0.weight", step=2)
    with pytest.raises(StoreCorruptError, match="step 2"):
        run.influence({"0.weight": np.ones((4, 5), np.float32)})
    # an empty part in place of another step's: the same
    pq.write_table(pq.read_table(part).slice(0, 0), part)
    with pytest.raises(StoreCorruptError, match=r"committed step 2 has 4 records.*but 0 rows"):
        gradlog.open(tmp_store).datums  # noqa: B018


# -- non-finite per-datum gradients --------------------------------------------------------------
class _Sqrt(nn.Module):
    """``loss_b = sqrt(<w, x_b>^2 + c_b)``: finite everywhere, its gradient infinite (then
    NaN through the chain rule) where ``<w, x_b>^2 + c_b == 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1, bias=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.lin(x).squeeze(1) ** 2 + c)


@pytest.mark.parametrize("backend", ["hooks"])  # loop: autograd.grad of losses[b] through
def test_a_non_finite_gradient_from_a_finite_loss_is_flagged_and_named(  # the batch's graph
    tmp_store: Path, backend: str  # meets 0 * inf = NaN for every datum (flagged too)
) -> None:
    torch.manual_seed(0)
    model = _Sqrt()
    x = torch.randn(4, 3)
    x[2] = 0.0  # datum 12: sqrt(0) = 0, its derivative infinite
    c = torch.tensor([1.0, 0.5, 0.0, 2.0])
    ids = [10, 11, 12, 13]
    # the oracle: each datum's own autograd.grad
    want = []
    for b in range(4):
        (g,) = torch.autograd.grad(model(x[b : b + 1], c[b : b + 1]).sum(), model.lin.weight)
        want.append(g.numpy().copy())
    finite = [bool(np.isfinite(w).all()) for w in want]
    assert finite == [True, True, False, True]
    warned = pytest.warns(NonFiniteGradientWarning, match=r"datum id\(s\) \[12\].*'lin.weight'")
    with warned, gradlog.GradRecorder(model, tmp_store, backend=backend, check_every=0) as rec:
        losses = model(x, c)
        assert torch.isfinite(losses).all()
        rec.backward(losses, datum_ids=ids)
    run = gradlog.open(tmp_store)
    norms = run.datums.column("norm/lin.weight").to_numpy()
    assert [bool(np.isfinite(n)) for n in norms] == finite  # the flag
    np.testing.assert_array_equal(run.grads("lin.weight"), np.stack(want))  # as computed
    report = verify(tmp_store)
    assert report.ok and any("non-finite gradient of ['lin.weight']" in n for n in report.notes)
    # queries keep the NaN, or leave the datum out and say so: never a number made up for it
    cos = run.similarity("lin.weight", kind="cosine")
    assert np.isnan(cos[2]).all() and np.isnan(cos[:, 2]).all()
    assert np.isfinite(np.delete(np.delete(cos, 2, 0), 2, 1)).all()
    stats = run.stats("lin.weight")
    assert np.isnan(stats["min"]) and np.isnan(stats["max"])
    probe = {"lin.weight": np.ones((1, 3))}
    for kind in ("tracin", "cosine"):
        for top in (None, 5):
            with pytest.warns(UserWarning, match=r"left out of the ranking \(ids \[12\]\)"):
                table = run.influence(probe, top=top, kind=kind, lr=0.1)
            assert 12 not in table.column("datum_id").to_pylist()
            assert table.num_rows == (3 if top is None else table.num_rows)
    with pytest.raises(InputError, match=r"records of step\(s\) \[0\] have non-finite"):
        run.movers(lr=0.1)  # (the change is NaN: every share would be)


def test_finite_gradients_give_no_warning(tmp_store: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteGradientWarning)
        _train(tmp_store, range(2))


# -- links ---------------------------------------------------------------------------------------
def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_resume_refuses_a_symlinked_array_folder(tmp_path: Path, reference: Path) -> None:
    store = tmp_path / "run.gradlog"
    _train(store, range(3))
    outside = tmp_path / "elsewhere"
    shutil.move(str(store / "grads" / "0.weight"), outside)
    (store / "grads" / "0.weight").symlink_to(outside, target_is_directory=True)
    before = _snapshot(outside)
    with pytest.raises(StoreResumeError, match=r"0\.weight is a symbolic link"):
        _train(store, range(3, 6), resume=True)
    assert _snapshot(outside) == before
    # the link replaced by the folder itself: the run continues, and is the reference
    (store / "grads" / "0.weight").unlink()
    shutil.move(str(outside), store / "grads" / "0.weight")
    _train(store, range(3, 6), resume=True)
    _assert_same(store, reference, list(range(6)))


def test_no_write_follows_a_link_planted_for_a_shard_or_a_temporary(
    tmp_path: Path, reference: Path
) -> None:
    store = tmp_path / "run.gradlog"
    _train(store, range(3))
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    shards = sorted((store / "grads" / "0.bias").glob("c.*"))
    next_shard = store / "grads" / "0.bias" / f"c.{len(shards)}.0"  # the resumed run's first
    next_shard.symlink_to(victim)
    (store / "steps" / ".step-000000000003.parquet.tmp").symlink_to(victim)
    (store / ".zarr.json.tmp").symlink_to(victim)
    with pytest.raises(StoreWriteError, match="symbolic link"):
        _train(store, range(3, 6), resume=True)
    assert victim.read_bytes() == b"precious"
    assert next_shard.is_symlink()
    _assert_same(store, reference, [0, 1, 2])  # what was committed stays intact


# -- a full disk -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        pytest.skip("mounting a small tmpfs needs root on Linux")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_keeps_committed_steps_and_resume_finishes(
    tmp_path: Path, reference: Path
) -> None:
    with _tmpfs(tmp_path / "disk", "1m") as disk:
        store = disk / "run.gradlog"
        filler = disk / "filler.bin"
        _train(store, range(2))
        stat = os.statvfs(disk)  # a filler leaves room for about one step more
        filler.write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - 40 * 1024))
        with pytest.raises(StoreWriteError, match="Free disk space"):
            _train(store, range(2, 6), resume=True)
        committed = gradlog.open(store).steps.column("step").to_pylist()
        assert committed[:2] == [0, 1] and len(committed) < 6
        report = verify(store)
        assert report.ok, [(c.name, c.problems) for c in report.checks]
        _assert_same(store, reference, committed)
        filler.unlink()  # space again: the run continues where it stopped
        _train(store, range(committed[-1] + 1, 6), resume=True)
        _assert_same(store, reference, list(range(6)))
        assert verify(store).ok


# -- a reader polling while another process writes -------------------------------------------------
POLL_WORKER = textwrap.dedent(
    """
    import time, torch
    from torch import nn
    import gradlog
    path, steps, pause = globals()["ARGS"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradlog.GradRecorder(model, path, form={"2.weight": "factors"}) as rec:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            rec.backward(((model(x) - y) ** 2).sum(1), step=step,
                         datum_ids=list(range(4 * step, 4 * step + 4)), lr=0.1)
            opt.step(); opt.zero_grad()
            time.sleep(pause)
    """
)


@pytest.mark.slow
def test_a_reader_polling_during_writes_sees_only_intact_prefixes(tmp_path: Path) -> None:
    script = tmp_path / "poll_worker.py"
    script.write_text(POLL_WORKER)
    steps = 12
    ref = tmp_path / "ref.gradlog"
    runpy.run_path(str(script), init_globals={"ARGS": [str(ref), steps, 0.0]},
                   run_name="__main__")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gradlog.recorder", "zarr", "pyarrow.parquet"])
    path = tmp_path / "run.gradlog"
    proc = ctx.Process(target=runpy.run_path, args=(str(script),), kwargs={
        "init_globals": {"ARGS": [str(path), steps, 0.15]}, "run_name": "__main__"})
    proc.start()
    want = gradlog.open(ref)
    seen: list[int] = []
    kept: gradlog.Run | None = None
    polls = 0
    deadline = time.monotonic() + 300
    while proc.is_alive() and time.monotonic() < deadline:
        try:
            run = gradlog.open(path)
        except gradlog.NotAStoreError:
            continue
        if kept is None:
            kept = run
        for view in (run, kept.refresh()):
            committed = view.steps.column("step").to_pylist()
            assert committed == list(range(len(committed))), committed
            if committed:
                assert committed[-1] >= (seen[-1] if seen else 0)
                seen.append(committed[-1])
                assert view.records(step=committed).equals(want.records(step=committed))
                for name in view.param_names:  # forms planned at the first step: read right
                    np.testing.assert_array_equal(view.grads(name, step=committed),
                                                  want.grads(name, step=committed))
        polls += 1
    proc.join(60)
    assert proc.exitcode == 0
    assert polls >= 3 and len(set(seen)) >= 2, (polls, seen)  # it did watch the run grow
    _assert_same(path, ref, list(range(steps)))


# -- fuzzed metadata ------------------------------------------------------------------------
_SUSPECT_EVENTS = ("pickle.find_class", "os.system", "subprocess.Popen", "os.exec",
                   "os.posix_spawn", "os.spawn")
_PAYLOADS = ("__import__", "lambda: 0", "!!python")  # what the fuzz plants as code
_AUDIT: dict[str, Any] = {"on": False, "events": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _AUDIT["on"]:
        return
    if event in _SUSPECT_EVENTS or (  # compiling a planted payload = running the store's code
        event == "compile" and any(p in repr(args[0]) for p in _PAYLOADS)
    ):
        _AUDIT["events"].append((event, repr(args)[:200]))
    elif event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        mode = args[1] if len(args) > 1 else "r"
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
            flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        inside = path == _AUDIT["store"] or path.startswith(_AUDIT["store"] + os.sep)
        near = path.startswith(_AUDIT["fence"] + os.sep)  # the case's folder: sentinels
        if not inside and (writing or near):
            _AUDIT["events"].append(("open outside the store", path, mode))


sys.addaudithook(_audit)

_TRAVERSALS = ["../secret", "../../secret", "/etc/passwd", "grads/../../secret", "grads/x/..",
               "", ".", "grads//x", "grads/lin.weight/../../../secret", "c:\\x", "%2e%2e/secret"]
_JSON_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, -1, 2, 7, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63), 10**30]),
    st.integers(-5, 10**6),
    st.sampled_from([0.5, 1e300, -0.0, 3.0]),
    st.sampled_from([*_TRAVERSALS, "float32", "bfloat16", "bitround9", "int64", "full",
                                   "factors", "projection", "topk", "norm", "rows", "zstd",
                                   "bytes", "crc32c", "sharding_indexed", "__import__('os')",
                                   "!!python/object", "lambda: 0"]),
    st.text(max_size=12),
)
_JSON = st.recursive(_JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON document (for picking what to mutate)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: Any, path: tuple[Any, ...], action: str, value: Any) -> Any:
    if not path:
        return value if action == "replace" else doc
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if action == "delete":
        del parent[key]
    elif action == "replace":
        parent[key] = value
    elif action == "wrap":
        parent[key] = [parent[key]]
    elif action == "scale" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] = parent[key] * 2**31 + 1
    else:
        parent[key] = value
    return doc


_STORES = ["v3.store", "v3-forms.store", "v2.store"]
_FILES = ["zarr.json", "grads/lin.weight/zarr.json", "grads/out%2Fhead.bias/zarr.json"]


@st.composite
def _cases(draw: Any) -> tuple[str, str, list[tuple[tuple[Any, ...], str, Any]]]:
    store = draw(st.sampled_from(_STORES))
    rel = draw(st.sampled_from([*(f for f in _FILES if (GOLDEN / store / f).is_file()),
                                *(str(p.relative_to(GOLDEN / store))
                                  for p in (GOLDEN / store / "grads").glob("*/*/zarr.json"))]))
    doc = json.loads((GOLDEN / store / rel).read_text())
    paths = _paths(doc)
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "delete", "wrap", "scale"]))
        if action in ("delete", "wrap", "scale") and not target:
            action = "replace"
        edits.append((target, action, draw(_JSON)))
    return store, rel, edits


def _exercise(path: Path, store: str) -> None:
    """Everything a user does with a store, read and write."""
    run = gradlog.open(path)
    run.datums  # noqa: B018
    for name in run.param_names:
        run.grads(name)
        run.norms(name)
    verify(path)
    attrs = json.loads((GOLDEN / store / "zarr.json").read_text())["attributes"]
    specs = {n: writer_module.ParamSpec.from_json(n, s) for n, s in attrs["params"].items()
             } if store != "v2.store" else None
    if specs is not None:  # resume the (crafted) store with the original run's writer
        w = writer_module.StoreWriter(path, attrs={k: v for k, v in attrs.items()
                                                   if k != "params"}, specs=specs,
                                      resume=True, durable=False)
        w.close()


_FUZZ_STATS = {"cases": 0, "refused": 0, "opened": 0}


def _fuzz_one(tmp_root: Path, case: tuple[str, str, list[Any]]) -> None:
    store, rel, edits = case
    fence = tmp_root / uuid.uuid4().hex
    fence.mkdir()
    (fence / "secret").write_bytes(b"secret")
    path = fence / "run.gradlog"
    shutil.copytree(GOLDEN / store, path)
    doc = json.loads((path / rel).read_text())
    for target, action, value in edits:
        with contextlib.suppress(KeyError, IndexError, TypeError):
            doc = _mutate(doc, target, action, copy.deepcopy(value))
    (path / rel).write_text(json.dumps(doc))
    _AUDIT.update(on=True, events=[], store=os.path.realpath(path),
                  fence=os.path.realpath(fence))
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # projections' notice; the audit is the point
            _exercise(path, store)
        _FUZZ_STATS["opened"] += 1
    except GradlogError:
        _FUZZ_STATS["refused"] += 1
    finally:
        _AUDIT["on"] = False
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    _FUZZ_STATS["cases"] += 1
    assert not _AUDIT["events"], _AUDIT["events"]
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated for a crafted store {case}"
    assert (fence / "secret").read_bytes() == b"secret"
    assert sorted(p.name for p in fence.iterdir()) == ["run.gradlog", "secret"]
    shutil.rmtree(fence)


def _fuzz_test(examples: int) -> Callable[[Path], None]:
    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(case=_cases())
    def run(tmp_path: Path, case: tuple[str, str, list[Any]]) -> None:
        _fuzz_one(tmp_path, case)

    return run


def _warm_up(tmp_path: Path) -> None:
    """Import lazily imported modules before the audit (their import compiles nothing, but
    keeps the audit to what a crafted store makes gradlog do)."""
    for store in _STORES:
        path = tmp_path / f"warm-{store}"
        shutil.copytree(GOLDEN / store, path)
        with contextlib.suppress(GradlogError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _exercise(path, store)


def test_fuzzed_metadata_never_escapes(tmp_path: Path) -> None:
    _warm_up(tmp_path)
    _fuzz_test(30)(tmp_path)


@pytest.mark.slow
def test_fuzzed_metadata_never_escapes_many(tmp_path: Path) -> None:
    _warm_up(tmp_path)
    _FUZZ_STATS.update(cases=0, refused=0, opened=0)
    _fuzz_test(1500)(tmp_path)
    print(f"fuzz: {_FUZZ_STATS}")  # for RELIABILITY.md
    assert _FUZZ_STATS["cases"] >= 1500 and math.isfinite(_FUZZ_STATS["refused"])
