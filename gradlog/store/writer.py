"""Writing a run into a store: the one place that creates arrays and index files.

Layout (normative text: schemas/FORMAT.md, format version 3)::

    RUN.gradlog/
      zarr.json                      root group; attributes: format, version, config, params
      grads/<param>/zarr.json        (records, *shape) array per parameter (or form array),
      grads/<param>/c.<s>.0..        sharded: shard s holds rows s*c .. s*c+c-1
      index/step-S-M.parquet         records of one backward call M of step S
      steps/step-S.parquet           the step's summary row; its presence commits step S

:class:`StoreWriter` is the synchronous facade over the writer's parts, each one job:

- :mod:`gradlog.store.opening`: create a store, or check an existing one and discard what a
  crashed attempt left (``resume=True``);
- :mod:`gradlog.store.records`: the record arrays and the writing of one backward call
  (its shards, then its index part);
- :mod:`gradlog.store.commit`: the commit protocol (what makes a step visible);
- :mod:`gradlog.store.worker`: the background thread and its queue bounded in bytes
  (backpressure: ``append`` blocks while it is full; nothing is ever dropped);
- :mod:`gradlog.store.durability`: atomic writes and syncs (``syncfs``/``fsync``; PUTs on
  object storage through :mod:`gradlog.store.fs`).

A failure of the thread is re-raised on the caller's thread at its next call, and at
:meth:`StoreWriter.close`, as :class:`~gradlog.errors.StoreWriteError`; after a failure
nothing more is written, in particular no later step is committed. With ``durable`` (the
default) a second thread syncs each step before writing its steps part, while the writer
thread goes on with the next step. Several ranks of a torch.distributed run share one store
through :mod:`gradlog.store.ranks` (``rank``/``world_size``: rank 0 creates and commits).

The writer takes host numpy arrays only (device tensors are staged on the compute side,
:mod:`gradlog.recording.staging`); it never imports torch.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.errors import (
    GradlogError,
    NonFiniteGradientWarning,
    StoreExistsError,
    StoreWriteError,
)
from gradlog.store import durability, lease, opening
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.commit import CommitLog
from gradlog.store.dtypes import INDEX_DTYPE, default_compression, storage_dtype
from gradlog.store.durability import Files
from gradlog.store.fs import StorePath
from gradlog.store.ranks import RANKS_DIR
from gradlog.store.records import CallIndex, RecordArrays, Target
from gradlog.store.worker import Task, Worker, drainer, failure

__all__ = ["DEFAULT_QUEUE_BYTES", "ParamSpec", "StoreWriter"]

DEFAULT_QUEUE_BYTES: int | None = None
"""Default capacity of the writer's queue: None, the size of the first batch's gradients: one
batch is written while the next is computed (see :class:`StoreWriter`)."""

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

    @classmethod
    def from_json(cls, name: str, spec: Mapping[str, Any]) -> ParamSpec:
        """The spec stored in the root attributes (:meth:`to_json`'s inverse)."""
        return cls(
            name, tuple(spec["shape"]), spec["dtype"], spec["param_dtype"], str(spec["form"]),
            spec["form_spec"],
            {k: {"shape": v["shape"], "kind": v["kind"]} for k, v in spec["arrays"].items()},
        )


def _targets(specs: Mapping[str, ParamSpec], compression: str | None) -> dict[str, Target]:
    """Every array of every parameter, keyed by its path (``norm`` forms have none)."""
    out: dict[str, Target] = {}
    for name, spec in specs.items():
        for entry in spec.array_entries().values():
            dtype = INDEX_DTYPE if entry["kind"] == "int64" else storage_dtype(spec.dtype)
            out[entry["path"]] = Target(
                name, entry["path"], tuple(entry["shape"]), dtype, spec.form,
                compression or default_compression(spec.dtype),
            )
    return out


# -- file primitives (module level, so that fault tests can replace them) ---------------------
def _write_file(path: StorePath, buffers: list[Any]) -> int:
    """Create or truncate ``path`` and write ``buffers`` in order; returns the bytes written
    (one ``writev`` locally, one PUT on object storage: :mod:`gradlog.store.fs`)."""
    return sfs.write_buffers(path, buffers)


def _write_parquet_atomic(table: Any, path: StorePath) -> None:
    sfs.write_parquet_atomic(table, path)


def _write_json_atomic(path: StorePath, value: Any) -> None:
    durability.write_json_atomic(path, value)


def _syncfs(root: Path) -> bool:
    return durability.syncfs(root)


# -- the writer ---------------------------------------------------------------------------------
class StoreWriter:
    """Creates (or resumes) a store and appends records to it from a background thread.

    The API is synchronous: :meth:`append` and :meth:`commit` return once their work is queued
    (``append`` blocks while ``queue_bytes`` are queued); :meth:`flush` waits until everything
    queued is written; :meth:`close` also finishes the arrays. An error of the background
    thread is raised by the next call as :class:`~gradlog.errors.StoreWriteError`.

    The arrays passed to :meth:`append` are owned by the writer until written: the caller
    must not modify them afterwards (the recorder passes fresh per-datum gradients).

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
        break_lease: Take over the store's writer lease when its holder runs on another
            host and has not renewed it for its TTL (:mod:`gradlog.store.lease`). A lease
            whose holder is provably gone (this host, process not running) is taken over
            anyway; a live holder's never.

    Raises:
        StoreLockedError: another writer holds the store (rank 0; the message names it).
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
        break_lease: bool = False,
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
        self.durable = durable
        self._compression = compression
        # the primitives as this module holds them when the writer starts (fault tests)
        self._files = Files(_write_file, _write_parquet_atomic, _write_json_atomic, _syncfs)
        self._lease: lease.Lease | None = None
        if rank == 0:  # one writer per store; the other ranks write under rank 0's lease
            opening.refuse_foreign(self.path)  # no lease is put into a foreign directory
            action = "resume=True" if resume else "overwrite=True" if overwrite else "creating it"
            self._lease = lease.acquire(self.path, action=action, break_expired=break_lease)
        try:
            self._open(attrs, specs, overwrite, resume, queue_bytes, durable, compression)
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise

    def _open(
        self,
        attrs: Mapping[str, Any],
        specs: Mapping[str, ParamSpec],
        overwrite: bool,
        resume: bool,
        queue_bytes: int | None,
        durable: bool,
        compression: str | None,
    ) -> None:
        """Create or resume the store (under the lease) and start the threads."""
        rank, world_size = self.rank, self.world_size
        self._log = CommitLog(
            self.path, self._files, durable=durable, rank=rank, world_size=world_size,
            rank_timeout_s=RANK_COMMIT_TIMEOUT_S, last_committed=None, lease=self._lease,
        )
        self._use_specs(specs)
        self.planned_specs: dict[str, dict[str, Any]] | None = None  # stored forms (resume)
        self.n_rows = 0  # end of the last appended call's rows
        self._next_row = 0  # where the next call starts: a shard boundary
        self.last_step: int | None = None  # last committed step (resume)
        self.next_datum_id = 0  # one past the largest committed datum id (resume)
        self._index_schema = fmt.index_schema(list(self.specs))
        self._closed = False

        if rank > 0:  # rank 0 created or resumed the store before this rank started
            if not opening.is_store(self.path):
                raise StoreWriteError(
                    f"rank {rank}: {self.path} is not a gradlog store though rank 0 opened it; "
                    "every rank must record into the same path, on storage they all see."
                )
            self._resume(attrs, cleanup=False)
        elif resume and self.path.exists() and opening.is_store(self.path):
            self._resume(attrs)
        else:
            root = dict(attrs)
            root["params"] = {name: spec.to_json() for name, spec in self.specs.items()}
            opening.create(self.path, root, overwrite)
        if world_size > 1 and rank == 0:
            (self.path / RANKS_DIR).mkdir(exist_ok=True)
        self._worker = Worker(capacity=queue_bytes or 0, name=f"gradlog-writer:{self.path.name}")
        self._worker.start()
        self._syncer: Worker | None = None  # syncs and commits, behind the writer (durable)
        if durable:
            self._syncer = Worker(capacity=2, name=f"gradlog-syncer:{self.path.name}")
            self._syncer.start()
        # Daemon threads die with the interpreter: drain what was queued first (a recorder
        # left open still loses its last, uncommitted step, as after a crash).
        self._drain_at_exit = drainer(self._worker, self._syncer)
        atexit.register(self._drain_at_exit)

    def _use_specs(self, specs: Mapping[str, ParamSpec]) -> None:
        """Record ``specs``: their arrays start without layouts (made at the first append)."""
        self.specs = dict(specs)
        self._arrays = RecordArrays(
            self.path, self._files, self._log, _targets(self.specs, self._compression),
            rank=self.rank,
        )

    def set_forms(
        self, forms: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]]
    ) -> None:
        """Record each parameter's planned form (``(Form.spec(), arrays)``) in the root
        attributes, before the first :meth:`append` (the recorder plans at the first
        backward, when token counts are known)."""
        if self.n_rows:
            raise GradlogError("internal: set_forms() after records were appended.")
        # arrays a crash left before any commit are created afresh at the first append
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
        self._files.write_json(meta_file, meta)
        self._log.wrote(meta_file)

    def _resume(self, attrs: Mapping[str, Any], cleanup: bool = True) -> None:
        """Continue after the last committed step; ``cleanup`` (not for ranks > 0, which join
        a store rank 0 just cleaned) deletes what uncommitted steps left."""
        wanted = {name: spec.to_json() for name, spec in self.specs.items()}
        committed = opening.open_to_resume(self.path, attrs, wanted)
        stored = committed.params
        if committed.datums.num_rows:
            # forms were planned at the first backward and the arrays hold committed rows:
            # keep the forms, continue the arrays
            self.planned_specs = {name: dict(stored[name]) for name in wanted}
            self._use_specs({name: ParamSpec.from_json(name, stored[name]) for name in wanted})
            arrays = self._arrays
            layouts, capacity = opening.read_layouts(
                self.path, {key: target.dtype for key, target in arrays.targets.items()}
            )
            arrays.continue_layouts(layouts, capacity)
            self.n_rows = committed.end_row
            self._next_row = -(-self.n_rows // arrays.rows_per_shard) * arrays.rows_per_shard
            self.next_datum_id = committed.next_datum_id
        elif cleanup:
            # Nothing was committed: the run plans its forms again at its first backward and
            # creates its arrays afresh. A crashed attempt's arrays and form groups may be of
            # another plan (a group where an array now goes, or the reverse) and another shard
            # size; none of their rows is committed, so they go.
            opening.remove_arrays(self.path, stored)
        self.last_step = self._log.last_committed = committed.last_step
        if cleanup:
            opening.discard_uncommitted(self.path, committed.steps)

    # -- the public, synchronous API ----------------------------------------------------------
    def _raise_if_failed(self) -> None:
        notices = self._arrays.notices
        while notices:  # the writer thread's findings, as warnings on the caller's thread
            warnings.warn(notices.popleft(), NonFiniteGradientWarning, stacklevel=3)
        worker = self._worker
        if worker.error is None and self._syncer is not None and self._syncer.error is not None:
            worker = self._syncer
        if worker.error is not None:
            raise failure(worker, self.path, self._log.last_committed) from worker.error

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
        ready: Any = None,
    ) -> tuple[int, int]:
        """Queue the records of one backward call; returns their row range ``[start, stop)``.

        ``plan``: with several ranks, the batch sizes of every rank's call of this round
        (the same list on every rank); each rank's rows follow those of the ranks before it,
        each rank's call starting at a shard boundary, so ranks write disjoint shard files.

        ``grads`` maps every parameter to its per-datum gradients ``(B, *shape)`` (``full``)
        or to its form's arrays (name -> array): host numpy arrays, rounded to the storage
        dtype here unless they already are (:func:`~gradlog.store.dtypes.as_stored`).
        ``ready``: None, or an object whose ``synchronize()`` returns once the arrays are
        filled (the ``torch.cuda.Event`` after non-blocking device copies); the writer thread
        waits on it. ``norms`` are the exact float64 norms, computed before rounding.

        Raises:
            StoreWriteError: the writer thread failed earlier.
        """
        self._raise_if_failed()
        if self._closed:
            raise GradlogError("this StoreWriter is closed.")
        batch = len(datum_ids)
        sizes = plan if plan is not None else [batch]
        arrays = self._arrays
        if not arrays.rows_per_shard:
            arrays.make_layouts(max(sizes))
        c = arrays.rows_per_shard
        spans = [-(-b // c) * c for b in sizes]  # each call starts at a shard boundary
        start = self._next_row + sum(spans[: self.rank])
        stop = start + batch
        round_end = self._next_row + sum(spans[:-1]) + sizes[-1]  # the last rank's stop
        self._next_row += sum(spans)
        self.n_rows = round_end

        payload, nbytes = self._stage(grads)
        if self._worker.capacity == 0:  # queue_bytes=None: one batch
            self._worker.capacity = max(1, nbytes)
        index = CallIndex(
            step=step,
            micro=micro,
            datum_ids=np.asarray(datum_ids, dtype=np.int64),
            losses=np.asarray(losses, dtype=np.float64),
            weights=np.asarray(weights, dtype=np.float64),
            lr=lr,
            norms={name: np.asarray(norms[name], dtype=np.float64) for name in self.specs},
        )
        syncer = self._syncer

        def run() -> None:
            if syncer is not None and syncer.error is not None:
                return  # a commit failed: nothing more is written (the caller sees that error)
            arrays.write_call(start, batch, payload, index, self._index_schema, round_end, ready)

        self._worker.put(Task(f"step {step} (micro-batch {micro})", run, nbytes))
        self._raise_if_failed()
        return start, stop

    def _stage(self, grads: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """The arrays of ``grads`` keyed by their path in the store, and their bytes.

        Raises:
            GradlogError: (internal) a parameter or one of its form's arrays is missing, or
                an array is not a host numpy array.
        """
        missing = [name for name in self.specs if name not in grads]
        if missing:
            raise GradlogError(f"internal: append() misses gradients of {missing}.")
        payload: dict[str, np.ndarray] = {}
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
                if type(g).__module__.split(".")[0] == "torch":
                    raise GradlogError(
                        f"internal: the store writer got a torch tensor for {name!r} "
                        f"({array}); it takes host numpy arrays only. Stage device tensors "
                        "first (gradlog.recording.staging)."
                    )
                g = np.asarray(g)
                payload[entries[array]["path"]] = g
                nbytes += g.nbytes
        return payload, nbytes

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
        what = f"the commit of step {int(row['step'])}"
        log, syncer = self._log, self._syncer

        def run() -> None:
            written, seconds = log.take()
            if syncer is None:
                log.commit(row, written, seconds)
            else:
                syncer.put(Task(what, lambda: log.commit(row, written, seconds), 1))
                # let the syncer start its sync (a blocking call, releasing the GIL) before
                # this thread writes the next step: the two overlap from the start
                time.sleep(0)

        self._worker.put(Task(what, run))
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
        try:
            self._worker.join()
            if self._syncer is not None:
                self._syncer.join()
            self._raise_if_failed()
            arrays = self._arrays
            if arrays.layouts and arrays.capacity != self.n_rows and self.rank == 0:
                if self._lease is not None:  # trimming deletes: only under this lease
                    self._lease.check("trimming the arrays at close")
                arrays.set_rows(self.n_rows)
                arrays.remove_shards_past(self.n_rows)
            self._log.sync_all()  # the last commit markers, the trimmed metadata
        finally:
            self._arrays.close()
            if self._lease is not None:
                self._lease.release()
