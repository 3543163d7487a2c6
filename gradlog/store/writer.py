"""Writing a run into a store: the one place that creates arrays and index files.

Layout (normative text: schemas/FORMAT.md, format version 2)::

    RUN.gradlog/
      zarr.json                      root group; attributes: format, version, config, params
      grads/<param>/zarr.json        (records, *shape) array per parameter, sharded:
      grads/<param>/c.<s>.0..        shard s: rows s*c .. s*c+c-1, one inner chunk per row
      index/step-S-M.parquet         records of one backward call M of step S
      steps/step-S.parquet           the step's summary row; its presence commits step S

Each backward call's records start at a shard boundary (a multiple of ``c``, the size of the
first batch), so every shard file belongs to one call and is written once, whole, with one
``writev`` of the bytes zarr would write (:mod:`gradlog.store.chunks`).

Writes happen on a background thread fed through a queue bounded in bytes: ``append`` returns
as soon as the batch is queued and blocks only while the queue is full (backpressure; nothing
is ever dropped). A failure of the thread is re-raised on the caller's thread at its next
call, and at :meth:`StoreWriter.close`, as :class:`~gradlog.errors.StoreWriteError`; after a
failure nothing more is written, in particular no later step is committed.

Order of writes: a call's shards, then its index part, then at the step's end the steps part;
each parquet file is written under a temporary name and renamed into place. With ``durable``
(the default) a second thread syncs the step (one ``syncfs``) before writing its steps part,
while the writer thread goes on with the next step. A reader sees only committed steps, so a
crash leaves a consistent prefix, and ``resume=True`` continues after it.

Files are written through :mod:`gradlog.store.fs` (a local directory, or an fsspec URL where
each file is one PUT); several ranks of a torch.distributed run share one store through
:mod:`gradlog.store.ranks` (``rank``/``world_size``: rank 0 creates and commits).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import errno
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.errors import (
    GradlogError,
    StoreExistsError,
    StoreFormatError,
    StoreResumeError,
    StoreWriteError,
)
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.chunks import ShardLayout
from gradlog.store.dtypes import (
    INDEX_DTYPE,
    StorageDtype,
    default_compression,
    storage_dtype,
    to_storage_numpy,
    to_storage_torch,
)
from gradlog.store.fs import StorePath
from gradlog.store.probes import PROBE_INDEX_DIR, PROBES_GROUP, parse_probe_part_name
from gradlog.store.ranks import RANKS_DIR, merge_rows, rank_part, wait_for_ranks

__all__ = ["DEFAULT_QUEUE_BYTES", "ParamSpec", "StoreWriter"]

DEFAULT_QUEUE_BYTES: int | None = None
"""Default capacity of the writer's queue: None, the size of the first batch's gradients: one
batch is written while the next is computed (see :class:`StoreWriter`)."""

_GROWTH = 2  # arrays' record axes grow geometrically: a metadata rewrite per doubling
_FIRST_SHARDS = 256  # the first declaration covers 256 shards: no rewrite for 256 calls
RANK_COMMIT_TIMEOUT_S = 600.0
"""How long rank 0 waits for the other ranks' parts of a step before failing (distributed)."""


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter's per-datum gradients are stored."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # storage dtype (gradlog.store.dtypes)
    param_dtype: str  # the parameter's own dtype in the model
    form: str = "full"
    form_spec: Mapping[str, Any] | None = None  # gradlog.forms Form.spec(); None: full
    arrays: Mapping[str, Mapping[str, Any]] | None = None  # name -> {shape, kind}; None: full

    def array_entries(self) -> dict[str, dict[str, Any]]:
        """The form's arrays: name -> ``{"path", "shape", "kind"}`` (FORMAT.md section 2)."""
        if self.arrays is None:
            return {"grad": {"path": fmt.array_path(self.name), "shape": list(self.shape),
                             "kind": "float"}}
        return {
            key: {"path": fmt.form_array_path(self.name, self.form, key),
                  "shape": list(a["shape"]), "kind": str(a.get("kind", "float"))}
            for key, a in self.arrays.items()
        }

    def to_json(self) -> dict[str, Any]:
        """The parameter spec of the root attributes (FORMAT.md section 2)."""
        form_spec = self.form_spec or {"form": "full", "shape": list(self.shape)}
        return {
            "shape": list(self.shape),
            "numel": int(np.prod(self.shape, dtype=np.int64)),
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "form": self.form,
            "array": fmt.array_path(self.name),
            "form_spec": dict(form_spec),
            "arrays": self.array_entries(),
        }


@dataclass(frozen=True)
class _Target:
    """One array the writer fills: a parameter's ``full`` array or one of its form's."""

    param: str
    rel: str  # path inside the store
    shape: tuple[int, ...]
    dtype: StorageDtype


def _targets(specs: Mapping[str, ParamSpec]) -> dict[str, _Target]:
    """Every array of every parameter, keyed by its path (``norm`` forms have none)."""
    out: dict[str, _Target] = {}
    for name, spec in specs.items():
        for entry in spec.array_entries().values():
            dtype = INDEX_DTYPE if entry["kind"] == "int64" else storage_dtype(spec.dtype)
            out[entry["path"]] = _Target(name, entry["path"], tuple(entry["shape"]), dtype)
    return out


# -- file primitives (module level, so that fault tests can replace them) ---------------------
def _write_file(path: StorePath, buffers: list[Any]) -> int:
    """Create or truncate ``path`` and write ``buffers`` in order; returns the bytes written
    (one ``writev`` locally, one PUT on object storage: :mod:`gradlog.store.fs`)."""
    return sfs.write_buffers(path, buffers)


def _write_parquet_atomic(table: Any, path: StorePath) -> None:
    sfs.write_parquet_atomic(table, path)


def _write_json_atomic(path: StorePath, value: Any) -> None:
    sfs.write_bytes_atomic(path, json.dumps(value, separators=(",", ":")).encode("utf-8"))


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _syncfs(root: Path) -> bool:
    """Flush the file system holding ``root`` (Linux ``syncfs``); False where unavailable.

    One ``syncfs`` per step measured 2-4x faster than an ``fdatasync`` per shard file on
    ext4 (one journal commit instead of one per file) for the small GPT's 37 shards per step.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syncfs = libc.syncfs
    except (OSError, AttributeError):
        return False
    fd = os.open(root, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(root))
    finally:
        os.close(fd)
    return True


def _is_store(path: StorePath) -> bool:
    try:
        meta = json.loads((path / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("attributes", {}).get("format") == fmt.FORMAT_NAME


def _inside(root: StorePath, path: StorePath) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``root`` or below it."""
    if not isinstance(root, Path) or not isinstance(path, Path):
        return True  # an ObjectPath cannot leave its store (gradlog.store.fs); no links
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root + os.sep)


# -- the background thread ----------------------------------------------------------------------
@dataclass
class _Task:
    what: str  # for error messages: "step 5 (micro 0)"
    run: Callable[[], None]
    nbytes: int = 0


@dataclass
class _Worker:
    """A thread running tasks in order, fed through a queue bounded in bytes."""

    capacity: int
    name: str
    _tasks: collections.deque[_Task | None] = field(default_factory=collections.deque)
    _queued: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)
    error: BaseException | None = None
    failed_task: str = ""
    blocked_s: float = 0.0  # caller time spent waiting for room (backpressure)
    max_queued: int = 0
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def put(self, task: _Task | None) -> None:
        """Queue ``task``; blocks while the queue holds ``capacity`` bytes (an item larger
        than the capacity waits for an empty queue). Raises the thread's error, if any."""
        nbytes = task.nbytes if task is not None else 0
        with self._cond:
            t0 = time.perf_counter()
            while self.error is None and self._queued > 0 and self._queued + nbytes > self.capacity:
                self._cond.wait()
            self.blocked_s += time.perf_counter() - t0
            if self.error is not None and task is not None:
                return  # nothing more is written after a failure; the stop signal still is
            self._tasks.append(task)
            self._queued += nbytes
            self.max_queued = max(self.max_queued, self._queued)
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every queued task ran (or the thread failed)."""
        with self._cond:
            while self.error is None and (self._tasks or self._queued):
                self._cond.wait()

    def join(self) -> None:
        self.put(None)
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._tasks:
                    self._cond.wait()
                task = self._tasks[0]
            if task is None:
                return
            if self.error is None:
                try:
                    task.run()
                except BaseException as e:  # re-raised on the caller's thread
                    with self._cond:
                        self.error = e
                        self.failed_task = task.what
            with self._cond:
                self._tasks.popleft()
                self._queued -= task.nbytes
                self._cond.notify_all()


# -- the writer ---------------------------------------------------------------------------------
class StoreWriter:
    """Creates (or resumes) a store and appends records to it from a background thread.

    The API is synchronous: :meth:`append` and :meth:`commit` return once their work is queued
    (``append`` blocks while ``queue_bytes`` are queued); :meth:`flush` waits until everything
    queued is written; :meth:`close` also finishes the arrays. An error of the background
    thread is raised by the next call as :class:`~gradlog.errors.StoreWriteError`.

    The arrays and tensors passed to :meth:`append` are owned by the writer until written: the
    caller must not modify them afterwards (the recorder passes fresh per-datum gradients).

    Args:
        path: Directory of the store (conventionally ``NAME.gradlog``).
        attrs: Root attributes beyond the per-parameter specs (format, config, ...).
        specs: The recorded parameters, in recording order.
        overwrite: Replace an existing gradlog store at ``path``. A directory that is not a
            gradlog store is never deleted.
        resume: Continue the gradlog store at ``path`` after its last committed step (its
            ``config_hash`` and parameters must match ``attrs`` and ``specs``); records of
            uncommitted steps are discarded. Without a store at ``path``, start a new one.
        queue_bytes: Capacity of the queue between the caller and the writer thread, in bytes
            of gradients held in host memory. A batch is admitted while the queued bytes plus
            its own fit, or when the queue is empty (so a batch larger than the capacity never
            deadlocks). Default (None): the first batch's size, so one batch is being written
            while the next is computed and ``append`` waits for it: peak memory about two
            batches of gradients, with compute and writes overlapped.
        durable: Flush the step's data to disk (``syncfs``/``fsync``) before writing its
            commit marker, so a committed step survives power loss, not only a crash of the
            process. Without it, steps are safe against process crashes only.
        compression: ``"none"``, ``"lz4"`` or ``"zstd"``; default: the dtype's
            (:func:`~gradlog.store.dtypes.default_compression`).
        rank, world_size: Recording by ``world_size`` ranks into one store
            (:mod:`gradlog.store.ranks`): rank 0 creates or resumes the store and commits
            steps; every other rank joins it once rank 0 is done (never creates, deletes or
            rewrites metadata) and writes its own rows, index parts and rank parts.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | StorePath,
        *,
        attrs: Mapping[str, Any],
        specs: Mapping[str, ParamSpec],
        overwrite: bool = False,
        resume: bool = False,
        queue_bytes: int | None = DEFAULT_QUEUE_BYTES,
        durable: bool = True,
        compression: str | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if overwrite and resume:
            raise StoreExistsError(
                "overwrite=True and resume=True contradict each other: pass overwrite=True to "
                "replace the store, or resume=True to continue it."
            )
        if queue_bytes is not None and (
            isinstance(queue_bytes, bool) or not isinstance(queue_bytes, int) or queue_bytes < 1
        ):
            raise GradlogError(
                f"queue_bytes={queue_bytes!r} must be a positive int (bytes), or None for one "
                "batch's gradients."
            )
        self.path: StorePath = sfs.store_path(path)
        self.rank = rank
        self.world_size = world_size
        self.specs = dict(specs)
        self.durable = durable
        self._compression = compression
        self._use_specs(self.specs)
        self.planned_specs: dict[str, dict[str, Any]] | None = None  # stored forms (resume)
        self._rows_per_shard = 0  # c, from the first batch
        self._layouts: dict[str, ShardLayout] = {}
        self._capacity = 0  # rows the arrays' metadata currently declare
        self.n_rows = 0  # end of the last appended call's rows
        self._next_row = 0  # where the next call starts: a shard boundary
        self.last_step: int | None = None  # last committed step (resume)
        self.next_datum_id = 0  # one past the largest committed datum id (resume)
        self.last_committed: int | None = None  # the writer thread's last committed step
        self._index_schema = fmt.index_schema(list(self.specs))
        self._steps_schema = fmt.steps_schema()
        self._write_seconds = 0.0  # writer-thread time of the step being written
        self._closed = False
        self._unsynced: set[StorePath] = set()  # written since the last sync (fsync fallback)
        self._unsynced_markers: list[StorePath] = []  # commit markers not yet synced

        resumed = False
        if rank > 0:  # rank 0 created or resumed the store before this rank started
            if not _is_store(self.path):
                raise StoreWriteError(
                    f"rank {rank}: {self.path} is not a gradlog store though rank 0 opened it; "
                    "every rank must record into the same path, on storage they all see."
                )
            self._resume(attrs, cleanup=False)
            resumed = True
        elif resume and self.path.exists() and _is_store(self.path):
            self._resume(attrs)
            resumed = True
        if not resumed:
            self._create(attrs, overwrite)
        if world_size > 1 and rank == 0:
            (self.path / RANKS_DIR).mkdir(exist_ok=True)
        self._worker = _Worker(capacity=queue_bytes or 0, name=f"gradlog-writer:{self.path.name}")
        self._worker.start()
        self._syncer: _Worker | None = None  # syncs and commits, behind the writer (durable)
        if durable:
            self._syncer = _Worker(capacity=2, name=f"gradlog-syncer:{self.path.name}")
            self._syncer.start()
        # Daemon threads die with the interpreter: drain what was queued first (a recorder
        # left open still loses its last, uncommitted step, as after a crash).
        self._drain_at_exit = _drainer(self._worker, self._syncer)
        atexit.register(self._drain_at_exit)

    def _use_specs(self, specs: Mapping[str, ParamSpec]) -> None:
        self.specs = dict(specs)
        self._targets = _targets(self.specs)
        self._dtypes: dict[str, StorageDtype] = {k: t.dtype for k, t in self._targets.items()}
        self.compression = {
            k: self._compression or default_compression(self.specs[t.param].dtype)
            for k, t in self._targets.items()
        }

    def set_forms(
        self, forms: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]]
    ) -> None:
        """Record each parameter's planned form (``(Form.spec(), arrays)``) in the root
        attributes, before the first :meth:`append` (the recorder plans at the first
        backward, when token counts are known)."""
        if self.n_rows:
            raise GradlogError("internal: set_forms() after records were appended.")
        # arrays a crash left before any commit are created afresh at the first append
        self._layouts, self._capacity, self._rows_per_shard = {}, 0, 0
        specs = {}
        for name, spec in self.specs.items():
            form_spec, arrays = forms[name]
            specs[name] = ParamSpec(
                name, spec.shape, spec.dtype, spec.param_dtype, str(form_spec["form"]),
                dict(form_spec), {k: dict(v) for k, v in arrays.items()},
            )
        self._use_specs(specs)
        if self.rank > 0:
            return  # rank 0 writes the root attributes (every rank plans the same forms)
        meta_file = self.path / "zarr.json"
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        meta["attributes"]["params"] = {n: s.to_json() for n, s in self.specs.items()}
        _write_json_atomic(meta_file, meta)
        self._unsynced.add(meta_file)

    # -- creation and resumption --------------------------------------------------------------
    def _create(self, attrs: Mapping[str, Any], overwrite: bool) -> None:
        import zarr

        if self.path.exists():
            empty_dir = self.path.is_dir() and not any(self.path.iterdir())
            if not empty_dir:
                if not _is_store(self.path):
                    raise StoreExistsError(
                        f"{self.path} exists and is not a gradlog store; refusing to write into "
                        "or delete it. Choose another path."
                    )
                if not overwrite:
                    raise StoreExistsError(
                        f"{self.path} already holds a gradlog run. Pass overwrite=True (CLI: "
                        "--overwrite) to replace it, resume=True to continue it, or choose "
                        "another path."
                    )
                if self.path.is_symlink():
                    raise StoreExistsError(
                        f"{self.path} is a symbolic link; refusing to delete what it points "
                        "to. Pass the store's real path."
                    )
                sfs.remove_tree(self.path)
        root = dict(attrs)
        root["params"] = {name: spec.to_json() for name, spec in self.specs.items()}
        if sfs.is_object(self.path):  # a group is its zarr.json; one PUT each
            sfs.write_bytes_atomic(self.path / "zarr.json", _group_json(root))
            sfs.write_bytes_atomic(self.path / fmt.GRADS_GROUP / "zarr.json", _group_json({}))
        else:
            group = zarr.open_group(str(self.path), mode="w", zarr_format=3, attributes=root)
            group.create_group(fmt.GRADS_GROUP)
        (self.path / fmt.INDEX_DIR).mkdir()
        (self.path / fmt.STEPS_DIR).mkdir()

    def _resume(self, attrs: Mapping[str, Any], cleanup: bool = True) -> None:
        """Continue after the last committed step; ``cleanup`` (not for ranks > 0, which join
        a store rank 0 just cleaned) deletes what uncommitted steps left."""
        from gradlog.store.reader import Run

        run = Run(self.path)
        where = str(self.path)
        if run.format_version != fmt.FORMAT_VERSION:
            raise StoreResumeError(
                f"{where} is in gradlog format version {run.format_version}; resume=True "
                f"continues version {fmt.FORMAT_VERSION} stores only. Record the rest of the "
                "run into a new store (another path)."
            )
        _check_same_config(run.attrs, attrs, where)
        stored = run.attrs["params"]
        wanted = {name: spec.to_json() for name, spec in self.specs.items()}
        if list(stored) != list(wanted):
            raise StoreResumeError(
                f"{where} records parameters {list(stored)[:8]}..., this recorder "
                f"{list(wanted)[:8]}...; resume with the same model and params= patterns."
            )
        same = ("shape", "numel", "dtype", "param_dtype")
        for name, spec in wanted.items():
            if any(stored[name].get(k) != spec[k] for k in same):
                raise StoreResumeError(
                    f"{where}: parameter {name!r} is stored as {stored[name]}, this recorder "
                    f"has {spec}; resume with the same model and dtype."
                )
        for sub in (fmt.INDEX_DIR, fmt.STEPS_DIR, fmt.GRADS_GROUP, PROBES_GROUP,
                    PROBE_INDEX_DIR):
            target = self.path / sub
            if target.is_symlink() or not _inside(self.path, target):
                raise StoreResumeError(
                    f"{target} is a symbolic link or leaves the store; resume=True never writes "
                    "outside the store. Copy the store without links and resume the copy."
                )
        if run.datums.num_rows:  # forms were planned at the first backward: keep them
            self.planned_specs = {name: dict(stored[name]) for name in wanted}
            self._use_specs({
                name: ParamSpec(name, spec.shape, spec.dtype, spec.param_dtype,
                                str(stored[name]["form"]), stored[name]["form_spec"],
                                {k: {"shape": v["shape"], "kind": v["kind"]}
                                 for k, v in stored[name]["arrays"].items()})
                for name, spec in self.specs.items()
            })
        steps = run.steps
        datums = run.datums
        if datums.num_rows:  # the arrays hold committed rows: continue them
            for key, array in self._targets.items():
                meta_file = self.path / array.rel / "zarr.json"
                if meta_file.is_file():
                    layout, rows = _read_layout(meta_file)
                    if layout.array_dtype != self._dtypes[key].array_dtype:
                        raise StoreResumeError(
                            f"{meta_file}: array dtype {layout.array_dtype} is not that of "
                            f"storage dtype {array.dtype.name}; the store is damaged."
                        )
                    self._layouts[key] = layout
                    self.compression[key] = layout.compression
                    self._capacity = rows if not self._capacity else min(self._capacity, rows)
            missing = [k for k in self._targets if k not in self._layouts]
            if missing:
                raise StoreResumeError(
                    f"{where}: arrays of {missing[:5]} are missing though records were "
                    "committed; the store is damaged (run `gradlog verify`)."
                )
        elif cleanup:
            # Nothing was committed: the run plans its forms again at its first backward and
            # creates its arrays afresh. A crashed attempt's arrays and form groups may be of
            # another plan (a group where an array now goes, or the reverse) and another shard
            # size; none of their rows is committed, so they go.
            self._remove_arrays(stored)
        if steps.num_rows:
            self.last_step = int(steps.column("step")[-1].as_py())
        if datums.num_rows:
            end = int(np.asarray(datums.column("row")).max()) + 1
            self.next_datum_id = int(np.asarray(datums.column("datum_id")).max()) + 1
            c = next(iter(self._layouts.values())).rows_per_shard if self._layouts else 1
            self._rows_per_shard = c
            self.n_rows = end
            self._next_row = -(-end // c) * c
        committed = {
            (int(s), int(m))
            for s, n in zip(steps.column("step").to_pylist(), steps.column("n_micro").to_pylist())
            for m in range(n)
        }
        self.last_committed = self.last_step
        if not cleanup:
            return
        # Discard what the crash left: uncommitted index parts and temporaries. Their rows are
        # past the committed ones and will be overwritten. Rank parts and probe parts of
        # uncommitted steps go too: a step recorded again must not be committed on a crashed
        # attempt's part (nor show its probes when it is recorded again without probes).
        done = {int(s) for s in steps.column("step").to_pylist()}
        for sub in (fmt.INDEX_DIR, fmt.STEPS_DIR, RANKS_DIR, PROBE_INDEX_DIR):
            if sub in (RANKS_DIR, PROBE_INDEX_DIR) and not (self.path / sub).is_dir():
                continue  # recorded by one process, or without probes
            for entry in sfs.listdir(self.path / sub):
                parsed = fmt.parse_part_name(entry)
                probe_step = parse_probe_part_name(entry) if sub == PROBE_INDEX_DIR else None
                stale = entry.startswith(".") or (
                    sub == fmt.INDEX_DIR
                    and parsed is not None
                    and (parsed[0], parsed[1] or 0) not in committed
                ) or (sub == RANKS_DIR and parsed is not None and parsed[0] not in done) or (
                    probe_step is not None and probe_step not in done
                )
                if stale and (self.path / sub / entry).is_file():
                    (self.path / sub / entry).unlink()

    def _remove_arrays(self, stored: Mapping[str, Any]) -> None:
        """Delete every parameter's array or form group (resuming a store without records)."""
        for name in stored:
            directory = self.path / fmt.array_path(name)
            if directory.is_symlink() or not _inside(self.path, directory):
                raise StoreResumeError(
                    f"{directory} is a symbolic link or leaves the store; resume=True never "
                    "deletes outside the store. Copy the store without links and resume the "
                    "copy."
                )
            if directory.exists():
                sfs.remove_tree(directory)

    # -- arrays ---------------------------------------------------------------------------------
    def _array_dir(self, key: str) -> StorePath:
        return self.path / self._targets[key].rel

    def _make_layouts(self, batch: int) -> None:
        self._rows_per_shard = batch
        for key, target in self._targets.items():
            self._layouts[key] = ShardLayout(
                target.shape, self._dtypes[key].array_dtype, batch, self.compression[key]
            )

    def _set_rows(self, rows: int) -> None:
        """Declare ``rows`` records in every array's metadata (atomic rewrite of zarr.json)."""
        for name, layout in self._layouts.items():
            directory = self._array_dir(name)
            directory.mkdir(parents=True, exist_ok=True)
            if self.rank > 0:
                continue  # rank 0 writes the metadata, before it commits these rows
            _write_json_atomic(directory / "zarr.json", layout.metadata(rows))
            self._unsynced.add(directory / "zarr.json")
            group = directory.parent / "zarr.json"  # a form's arrays live in a group
            if directory.parent != self.path / fmt.GRADS_GROUP and not group.is_file():
                spec = self.specs[self._targets[name].param]
                _write_json_atomic(group, {"zarr_format": 3, "node_type": "group",
                                           "attributes": {"form": spec.form}})
                self._unsynced.add(group)
        self._capacity = rows

    # -- the public, synchronous API ----------------------------------------------------------
    def _raise_if_failed(self) -> None:
        worker = self._worker
        if worker.error is None and self._syncer is not None and self._syncer.error is not None:
            worker = self._syncer
        if worker.error is None:
            return
        error = worker.error
        committed = (
            f"Steps up to {self.last_committed} are committed and intact"
            if self.last_committed is not None
            else "No step was committed"
        )
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            fix = (
                "Free disk space (or record less: params=..., dtype='bfloat16', every=N), then "
                "continue with GradRecorder(..., resume=True)."
            )
        elif isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EROFS):
            fix = "Make the store writable, then continue with GradRecorder(..., resume=True)."
        else:
            fix = "Fix the cause, then continue with GradRecorder(..., resume=True)."
        raise StoreWriteError(
            f"gradlog's writer failed writing {worker.failed_task} into {self.path}: "
            f"{type(error).__name__}: {error}. {committed}; nothing after them was committed. "
            f"{fix}"
        ) from error

    def append(
        self,
        *,
        step: int,
        micro: int,
        datum_ids: np.ndarray,
        losses: np.ndarray,
        weights: np.ndarray,
        lr: float | None,
        grads: Mapping[str, Any],
        norms: Mapping[str, np.ndarray],
        plan: list[int] | None = None,
    ) -> tuple[int, int]:
        """Queue the records of one backward call; returns their row range ``[start, stop)``.

        ``plan``: with several ranks, the batch sizes of every rank's call of this round
        (the same list on every rank); each rank's rows follow those of the ranks before it,
        each rank's call starting at a shard boundary, so ranks write disjoint shard files.

        ``grads`` maps every parameter to its per-datum gradients ``(B, *shape)``: numpy
        arrays or torch tensors (CUDA tensors are rounded on the device and copied to pinned
        host memory without blocking; the writer thread waits for the copy). ``norms`` are
        the exact float64 norms, computed before rounding.

        Raises:
            StoreWriteError: the writer thread failed earlier.
        """
        self._raise_if_failed()
        if self._closed:
            raise GradlogError("this StoreWriter is closed.")
        batch = len(datum_ids)
        sizes = plan if plan is not None else [batch]
        if not self._rows_per_shard:
            self._make_layouts(max(sizes))
        c = self._rows_per_shard
        spans = [-(-b // c) * c for b in sizes]  # each call starts at a shard boundary
        start = self._next_row + sum(spans[: self.rank])
        stop = start + batch
        round_end = self._next_row + sum(spans[:-1]) + sizes[-1]  # the last rank's stop
        self._next_row += sum(spans)
        self.n_rows = round_end

        payload, event, nbytes = self._stage(grads)
        if self._worker.capacity == 0:  # queue_bytes=None: one batch
            self._worker.capacity = max(1, nbytes)
        index = {
            "datum_ids": np.asarray(datum_ids, dtype=np.int64),
            "losses": np.asarray(losses, dtype=np.float64),
            "weights": np.asarray(weights, dtype=np.float64),
            "norms": {name: np.asarray(norms[name], dtype=np.float64) for name in self.specs},
        }

        def run() -> None:
            self._write_call(step, micro, start, batch, lr, payload, event, index, round_end)

        self._worker.put(_Task(f"step {step} (micro-batch {micro})", run, nbytes))
        self._raise_if_failed()
        return start, stop

    def _stage(self, grads: Mapping[str, Any]) -> tuple[dict[str, Any], Any, int]:
        """Hand gradients to the writer thread: CUDA tensors are rounded on the device and
        copied into pinned host buffers (non_blocking) with an event to wait for."""
        missing = [name for name in self.specs if name not in grads]
        if missing:
            raise GradlogError(f"internal: append() misses gradients of {missing}.")
        payload: dict[str, Any] = {}
        event = None
        nbytes = 0
        for name, spec in self.specs.items():
            value = grads[name]
            entries = spec.array_entries()
            if not isinstance(value, Mapping):  # a full form's gradients
                value = {"grad": value}
            if set(value) != set(entries):
                raise GradlogError(
                    f"internal: {name!r} ({spec.form}) got arrays {sorted(value)}, its form "
                    f"stores {sorted(entries)}."
                )
            for array, g in value.items():
                key = entries[array]["path"]
                payload[key], size, event = self._stage_one(key, g, event)
                nbytes += size
        if event is not None:
            event.record()  # after every copy, on the current stream
        return payload, event, nbytes

    def _stage_one(self, name: str, g: Any, event: Any) -> tuple[Any, int, Any]:
        """One array: a CUDA tensor is rounded on the device and copied to pinned memory."""
        if not type(g).__module__.startswith("torch"):
            g = np.asarray(g)
            return g, g.nbytes, event
        g = g.detach()
        if g.is_cuda:
            import torch

            stored = to_storage_torch(g, self._dtypes[name])
            host = torch.empty(stored.shape, dtype=stored.dtype, pin_memory=True)
            host.copy_(stored, non_blocking=True)
            if event is None:
                event = torch.cuda.Event()
            g = host
        nbytes = g.element_size() * g.numel()
        return g, nbytes, event

    def _host_rows(self, name: str, g: Any, staged_on_device: bool) -> np.ndarray:
        """Gradients of one parameter as a C-contiguous array of the array dtype."""
        dtype = self._dtypes[name]
        if isinstance(g, np.ndarray):
            out = to_storage_numpy(g, dtype)
        else:
            stored = g if staged_on_device else to_storage_torch(g, dtype)
            out = stored.numpy()
        if out.dtype != dtype.array_dtype:
            out = out.view(dtype.array_dtype)  # bfloat16 bits come back as int16
        return np.ascontiguousarray(out)

    def _write_call(
        self,
        step: int,
        micro: int,
        start: int,
        batch: int,
        lr: float | None,
        payload: dict[str, Any],
        event: Any,
        index: dict[str, Any],
        round_end: int,
    ) -> None:
        """Writer thread: the shards of one backward call, then its index part."""
        import pyarrow as pa

        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()
        if self._syncer is not None and self._syncer.error is not None:
            return  # a commit failed: nothing more is written (the caller sees that error)
        stop = start + batch
        if round_end > self._capacity:  # every rank tracks it; rank 0 alone writes metadata
            first = _FIRST_SHARDS * self._rows_per_shard
            self._set_rows(max(round_end, _GROWTH * self._capacity, first))
        for name, layout in self._layouts.items():
            rows = self._host_rows(name, payload.pop(name), event is not None)
            if rows.shape != (batch, *layout.row_shape):
                raise StoreFormatError(
                    f"gradients of {name!r} have shape {rows.shape}, expected "
                    f"{(batch, *layout.row_shape)}."
                )
            if layout.row_elements == 0:
                continue  # nothing to store for a zero-size parameter
            c = layout.rows_per_shard
            directory = self._array_dir(name)
            for shard in range(start // c, -(-stop // c)):
                lo = shard * c - start
                file = directory / layout.shard_key(shard)
                _write_file(file, layout.encode(rows[max(0, lo) : lo + c]))
                self._unsynced.add(file)
            del rows
        columns: dict[str, Any] = {
            "step": np.full(batch, step, dtype=np.int64),
            "micro": np.full(batch, micro, dtype=np.int32),
            "datum_id": index["datum_ids"],
            "row": np.arange(start, stop, dtype=np.int64),
            "loss": index["losses"],
            "weight": index["weights"],
            "lr": pa.array([lr] * batch, type=pa.float64()),
        }
        for name in self.specs:
            columns[fmt.norm_column(name)] = index["norms"][name]
        table = pa.table(columns, schema=self._index_schema)
        part = self.path / fmt.INDEX_DIR / fmt.index_part_name(step, micro)
        _write_parquet_atomic(table, part)
        self._unsynced.add(part)
        self._write_seconds += time.perf_counter() - t0

    def commit(self, step_row: Mapping[str, Any]) -> None:
        """Queue the commit of a step: its steps part, after all its records are written.

        With ``durable``, the writer thread hands the step to a second thread that syncs it
        to disk and then writes the steps part, while the writer thread goes on with the
        next step's shards: syncing one step overlaps writing the next (at most two steps
        wait for their sync). The steps part's ``time_write_s`` is the writer's time for the
        step, sync included.

        Raises:
            StoreWriteError: the writer thread failed earlier.
        """
        self._raise_if_failed()
        row = dict(step_row)
        step = int(row["step"])
        what = f"the commit of step {step}"

        def mark(written: set[StorePath], seconds: float) -> None:
            import pyarrow as pa

            t0 = time.perf_counter()
            if self.durable:  # the step's data reach the disk before its commit marker exists
                _sync(self.path, written)
            row["time_write_s"] = seconds + time.perf_counter() - t0
            if self.rank > 0:  # this rank's share; rank 0 commits the step
                marker = rank_part(self.path, step, self.rank)
            else:
                marker = self.path / fmt.STEPS_DIR / fmt.step_part_name(step)
                if self.world_size > 1:
                    others = wait_for_ranks(
                        self.path, step, self.world_size, RANK_COMMIT_TIMEOUT_S
                    )
                    row.update(merge_rows(row, others))
            table = pa.Table.from_pylist([row], schema=self._steps_schema)
            _write_parquet_atomic(table, marker)
            # The marker becomes durable with the next sync (or the one at close): a power
            # loss can only lose it, leaving its step uncommitted, never half there.
            self._unsynced_markers.append(marker)
            self.last_committed = step

        def run() -> None:
            written, self._unsynced = self._unsynced, set()
            seconds, self._write_seconds = self._write_seconds, 0.0
            if self._syncer is None:
                mark(written, seconds)
            else:
                self._syncer.put(_Task(what, lambda: mark(written, seconds), 1))

        self._worker.put(_Task(what, run))
        self._raise_if_failed()

    def flush(self) -> None:
        """Wait until everything queued so far is written (and committed, for commits).

        Raises:
            StoreWriteError: the writer thread failed.
        """
        self._worker.wait_idle()
        if self._syncer is not None:
            self._syncer.wait_idle()
        self._raise_if_failed()

    @property
    def stats(self) -> dict[str, float]:
        """Backpressure figures: ``blocked_s`` (caller time waiting for room in the queue)
        and ``max_queued_bytes``."""
        return {"blocked_s": self._worker.blocked_s, "max_queued_bytes": self._worker.max_queued}

    def close(self) -> None:
        """Write everything queued, stop the thread, and trim the arrays to the rows written.

        Raises:
            StoreWriteError: the writer thread failed (the arrays are then left as they are).
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._drain_at_exit)
        self._worker.join()
        if self._syncer is not None:
            self._syncer.join()
        self._raise_if_failed()
        if self._layouts and self._capacity != self.n_rows and self.rank == 0:
            self._set_rows(self.n_rows)
            self._remove_shards_past(self.n_rows)
        if self.durable:  # the last commit markers, the trimmed metadata
            _sync(self.path, {*self._unsynced, *self._unsynced_markers})
            self._unsynced.clear()
            self._unsynced_markers.clear()

    def _remove_shards_past(self, rows: int) -> None:
        """Delete shard files wholly past ``rows`` (left by a crash or an over-allocation)."""
        for name, layout in self._layouts.items():
            directory = self._array_dir(name)
            if not directory.is_dir() or not _inside(self.path, directory):
                continue
            first_gone = -(-rows // layout.rows_per_shard)
            for entry in sfs.listdir(directory):
                shard = layout.shard_of_key(entry)
                if shard is not None and shard >= first_gone:
                    (directory / entry).unlink()


def _drainer(*workers: _Worker | None) -> Callable[[], None]:
    """An atexit hook waiting for ``workers``; holds them weakly (no leak if never run)."""
    refs = [weakref.ref(w) for w in workers if w is not None]

    def drain() -> None:
        for ref in refs:
            alive = ref()
            if alive is not None:
                alive.wait_idle()

    return drain


def _sync(root: StorePath, written: set[StorePath]) -> None:
    """Make ``written`` (files and the directories holding them) durable: one ``syncfs`` of
    the store's file system on Linux, else an ``fsync`` of each. Nothing on object storage:
    a PUT is durable once it returned."""
    if not isinstance(root, Path):
        return
    if _syncfs(root):
        return
    local = [p for p in written if isinstance(p, Path)]
    for path in sorted(local, key=lambda p: len(p.parts), reverse=True):
        _fsync_path(path)
    for directory in {p.parent for p in local}:
        _fsync_path(directory)


def _read_layout(meta_file: StorePath) -> tuple[ShardLayout, int]:
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{meta_file} is not valid JSON: {e}") from None
    layout = ShardLayout.from_metadata(meta, str(meta_file))
    return layout, int(meta["shape"][0])


def _group_json(attributes: Mapping[str, Any]) -> bytes:
    """A Zarr v3 group's ``zarr.json`` (what zarr-python writes for one)."""
    meta = {"attributes": dict(attributes), "zarr_format": 3, "consolidated_metadata": None,
            "node_type": "group"}
    return json.dumps(meta, indent=2).encode("utf-8")


def _check_same_config(stored: Mapping[str, Any], wanted: Mapping[str, Any], where: str) -> None:
    if stored.get("config_hash") == wanted.get("config_hash"):
        return
    old, new = stored.get("config", {}), wanted.get("config", {})
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    diff = "; ".join(f"{k}: stored {old.get(k)!r}, now {new.get(k)!r}" for k in keys[:8])
    raise StoreResumeError(
        f"{where} was recorded with config_hash {stored.get('config_hash')}, this recorder has "
        f"{wanted.get('config_hash')} ({diff or 'same keys, different values'}). resume=True "
        "continues a store with the same configuration only: pass the stored options, or "
        "record into a new store."
    )
