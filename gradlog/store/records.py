"""The record arrays a writer fills, and the writing of one backward call into them.

Each parameter's ``full`` array, or each array of its form, is one Zarr v3 array of
``(records, *shape)`` sharded along the records (FORMAT.md sections 2-4). The shard size ``c``
is the first batch's size; each backward call's rows start at a shard boundary, so every shard
file belongs to one call and is written once, whole (:mod:`gradlog.store.chunks`). The arrays'
record axes grow geometrically: their metadata is rewritten once per doubling, and trimmed to
the rows written at close.

A call's shards are written first, then its index part: the step's commit
(:mod:`gradlog.store.commit`) comes after both.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradlog.errors import StoreFormatError
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.chunks import ShardLayout
from gradlog.store.commit import CommitLog
from gradlog.store.dtypes import StorageDtype, as_stored
from gradlog.store.durability import Files
from gradlog.store.fs import StorePath
from gradlog.store.opening import inside

__all__ = ["CallIndex", "RecordArrays", "Target"]

_Shard = tuple[StorePath, ShardLayout, np.ndarray]  # a shard file, its layout, its rows

_GROWTH = 2  # arrays' record axes grow geometrically: a metadata rewrite per doubling
_FIRST_SHARDS = 256  # the first declaration covers 256 shards: no rewrite for 256 calls
_LANES = 3
"""Threads writing a call's large shards at once (:meth:`RecordArrays._write_shards`). On this
project's VM disk, medium GPT, paired with a raw ``tofile + fsync``: one lane 346 MB/s, two
390-452; then, in two alternating pairs of runs, three lanes 1.12 / 1.30x raw idle and
1.14 / 1.13x raw beside compute on every core, against 0.98 / 1.09x and 1.08 / 0.98x for two
(a lane waiting for a core behind compute leaves one write fewer in flight)."""


@dataclass(frozen=True)
class Target:
    """One array the writer fills: a parameter's ``full`` array or one of its form's."""

    param: str
    rel: str  # path inside the store
    shape: tuple[int, ...]
    dtype: StorageDtype
    form: str  # the parameter's form: a form's arrays live in a group named after it
    compression: str


@dataclass(frozen=True)
class CallIndex:
    """The index columns of one backward call (what its index part holds beside rows)."""

    step: int
    micro: int
    datum_ids: np.ndarray  # int64 (B,)
    losses: np.ndarray  # float64 (B,)
    weights: np.ndarray  # float64 (B,)
    lr: float | None
    norms: dict[str, np.ndarray]  # parameter -> float64 (B,), in recording order


class RecordArrays:
    """The arrays of a store's records, keyed by their path in the store.

    Args:
        root: The store.
        files: The file operations.
        log: Where written files are noted for the step's commit.
        targets: Every array to fill (:class:`Target`), keyed by its path.
        rank: Ranks > 0 write shards only; rank 0 writes the arrays' metadata.
    """

    def __init__(
        self,
        root: StorePath,
        files: Files,
        log: CommitLog,
        targets: Mapping[str, Target],
        *,
        rank: int,
    ) -> None:
        self.root = root
        self.files = files
        self.log = log
        self.targets = dict(targets)
        self.rank = rank
        self.layouts: dict[str, ShardLayout] = {}
        self.capacity = 0  # rows the arrays' metadata currently declare
        self.notices: collections.deque[str] = collections.deque()  # for the caller's thread
        self.rows_per_shard = 0  # c, from the first batch (or the stored arrays)
        self._helper: ThreadPoolExecutor | None = None  # the second lane of _write_shards

    def continue_layouts(self, layouts: Mapping[str, ShardLayout], capacity: int) -> None:
        """Continue arrays that hold committed rows (resume): their stored layouts, and the
        rows their metadata declare."""
        self.layouts = dict(layouts)
        self.capacity = capacity
        # a run of 'norm' forms only has no arrays: one row per shard, as for any
        self.rows_per_shard = next(iter(self.layouts.values())).rows_per_shard if layouts else 1

    def make_layouts(self, batch: int) -> None:
        """Lay every array out in shards of ``batch`` rows (at the first call)."""
        self.rows_per_shard = batch
        for key, target in self.targets.items():
            self.layouts[key] = ShardLayout(
                target.shape, target.dtype.array_dtype, batch, target.compression
            )

    def directory(self, key: str) -> StorePath:
        """The directory of the array ``key``."""
        return self.root / self.targets[key].rel

    def set_rows(self, rows: int) -> None:
        """Declare ``rows`` records in every array's metadata (atomic rewrite of zarr.json)."""
        for key, layout in self.layouts.items():
            directory = self.directory(key)
            directory.mkdir(parents=True, exist_ok=True)
            if self.rank > 0:
                continue  # rank 0 writes the metadata, before it commits these rows
            self.files.write_json(directory / "zarr.json", layout.metadata(rows))
            self.log.wrote(directory / "zarr.json")
            group = directory.parent / "zarr.json"  # a form's arrays live in a group
            if directory.parent != self.root / fmt.GRADS_GROUP and not group.is_file():
                self.files.write_json(group, {"zarr_format": 3, "node_type": "group",
                                              "attributes": {"form": self.targets[key].form}})
                self.log.wrote(group)
        self.capacity = rows

    def write_call(
        self,
        start: int,
        batch: int,
        payload: dict[str, np.ndarray],
        index: CallIndex,
        index_schema: Any,
        round_end: int,
        ready: Any = None,
    ) -> None:
        """Writer thread: the shards of one backward call (rows ``start .. start+batch-1``),
        then its index part. ``round_end``: the end of the last rank's rows of this round
        (every rank tracks it; rank 0 alone writes the metadata). ``ready``: None, or what
        to ``synchronize()`` with before reading ``payload`` (device copies)."""
        import pyarrow as pa

        t0 = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        self._note_nonfinite(index)
        stop = start + batch
        if round_end > self.capacity:
            first = _FIRST_SHARDS * self.rows_per_shard
            self.set_rows(max(round_end, _GROWTH * self.capacity, first))
        shards: list[_Shard] = []
        overflowed: dict[str, np.ndarray] = {}  # float16 only: parameter -> rows (B,)
        for key, layout in self.layouts.items():
            rows = self._stored_rows(key, payload.pop(key))
            if self.targets[key].dtype.name == "float16" and rows.size:
                param = self.targets[key].param
                inf = np.isinf(rows.reshape(len(rows), -1)).any(1)
                if param in index.norms and inf.shape == index.norms[param].shape:
                    inf &= np.isfinite(index.norms[param])  # else flagged as non-finite
                overflowed[param] = overflowed.get(param, False) | inf
            if rows.shape != (batch, *layout.row_shape):
                raise StoreFormatError(
                    f"gradients of {key!r} have shape {rows.shape}, expected "
                    f"{(batch, *layout.row_shape)}."
                )
            if layout.row_elements == 0:
                continue  # nothing to store for a zero-size parameter
            c = layout.rows_per_shard
            directory = self.directory(key)
            for shard in range(start // c, -(-stop // c)):
                lo = shard * c - start
                block = rows[max(0, lo) : lo + c]
                shards.append((directory / layout.shard_key(shard), layout, block))
            del rows
        self._write_shards(shards)
        del shards
        self._note_overflow(index, overflowed)
        columns: dict[str, Any] = {
            "step": np.full(batch, index.step, dtype=np.int64),
            "micro": np.full(batch, index.micro, dtype=np.int32),
            "datum_id": index.datum_ids,
            "row": np.arange(start, stop, dtype=np.int64),
            "loss": index.losses,
            "weight": index.weights,
            "lr": pa.array([index.lr] * batch, type=pa.float64()),
        }
        for name, norms in index.norms.items():
            columns[fmt.norm_column(name)] = norms
        table = pa.table(columns, schema=index_schema)
        part = self.root / fmt.INDEX_DIR / fmt.index_part_name(index.step, index.micro)
        self.files.write_parquet(table, part)
        self.log.wrote(part)
        self.log.write_seconds += time.perf_counter() - t0

    def _write_shards(self, shards: list[_Shard]) -> None:
        """Write a call's shard files: with two or more files of
        :data:`~gradlog.store.fs.DIRECT_MIN_BYTES` or more (written past the page cache, each
        write waiting for the disk), in :data:`_LANES` lanes, this thread and helpers, so
        that several writes are in flight and one lane's copy overlaps the others' waits.
        Lanes are balanced by bytes, largest files first. Each shard is encoded in its lane
        when its turn comes (a compressed one's bytes are not all held at once)."""
        large = sorted((s for s in shards if s[2].nbytes >= sfs.DIRECT_MIN_BYTES),
                       key=lambda s: -s[2].nbytes)
        if len(large) < 2 or not isinstance(self.root, Path):
            for file, layout, block in shards:
                self.files.write_file(file, layout.encode(block))
                self.log.wrote(file)
            return
        lanes: list[list[Any]] = [[] for _ in range(_LANES)]
        load = [0] * _LANES
        for item in large:
            lane = load.index(min(load))
            lanes[lane].append(item)
            load[lane] += item[2].nbytes
        lanes[0].extend(s for s in shards if s[2].nbytes < sfs.DIRECT_MIN_BYTES)
        if self._helper is None:
            self._helper = ThreadPoolExecutor(_LANES - 1, thread_name_prefix="gradlog-shards")
        helpers = [self._helper.submit(self._write_lane, lane) for lane in lanes[1:]]
        try:
            self._write_lane(lanes[0])
        except BaseException:
            wait(helpers)  # never leave it writing behind a failure: this error is raised
            raise
        for helper in helpers:
            helper.result()
        for file, _, _ in shards:
            self.log.wrote(file)

    def _write_lane(self, shards: list[_Shard]) -> None:
        for file, layout, block in shards:
            self.files.write_file(file, layout.encode(block))

    def close(self) -> None:
        """Stop the helper thread of :meth:`_write_shards`, if one was started."""
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None

    def _note_nonfinite(self, index: CallIndex) -> None:
        """Note records whose gradient has a non-finite entry: their exact norm is NaN or
        inf (a norm is finite exactly when every entry is), so the check costs one pass over
        ``B`` norms per parameter, on this thread, after the device copies landed (no device
        sync on the training thread). They are stored as computed, flagged by that norm, and
        the writer warns on the caller's thread (:attr:`notices`)."""
        bad = {name: ~np.isfinite(n) for name, n in index.norms.items()}
        bad = {name: mask for name, mask in bad.items() if mask.any()}
        if not bad:
            return
        rows = np.logical_or.reduce(list(bad.values()))
        ids = index.datum_ids[rows].tolist()
        self.notices.append(
            f"step {index.step} (micro-batch {index.micro}): the per-datum gradients of datum "
            f"id(s) {ids[:20]}{' ...' if len(ids) > 20 else ''} hold NaN or inf in "
            f"parameter(s) {sorted(bad)[:10]}{' ...' if len(bad) > 10 else ''}, though their "
            "losses are finite. They are stored as computed, flagged by a non-finite norm "
            "in the index (run.datums 'norm/<param>', run.norms()); p.grad summed them too. "
            "Usual causes: sqrt or log at 0, a division by zero, an overflow in the loss."
        )

    def _note_overflow(self, index: CallIndex, overflowed: Mapping[str, np.ndarray]) -> None:
        """Note float16 records that became infinite though the gradient is finite (an
        entry past float16's largest value, 65504): they are stored so (their index norm
        stays exact), and the writer warns on the caller's thread (:attr:`notices`)."""
        bad = {name: rows for name, rows in overflowed.items() if rows.any()}
        if not bad:
            return
        ids = index.datum_ids[np.logical_or.reduce(list(bad.values()))].tolist()
        self.notices.append(
            f"step {index.step} (micro-batch {index.micro}): the per-datum gradients of datum "
            f"id(s) {ids[:20]}{' ...' if len(ids) > 20 else ''} in parameter(s) "
            f"{sorted(bad)[:10]}{' ...' if len(bad) > 10 else ''} have entries beyond "
            "float16's range (|g| > 65504), stored as inf: those records are lost (their "
            "norms in the index are exact). Record with dtype='bfloat16' (float32's range, 8 "
            "significant bits) or 'float32'."
        )

    def _stored_rows(self, key: str, values: np.ndarray) -> np.ndarray:
        """One array's rows as a C-contiguous array of its array dtype."""
        return np.ascontiguousarray(as_stored(values, self.targets[key].dtype))

    def remove_shards_past(self, rows: int) -> None:
        """Delete shard files wholly past ``rows`` (left by a crash or an over-allocation)."""
        for key, layout in self.layouts.items():
            directory = self.directory(key)
            if not directory.is_dir() or not inside(self.root, directory):
                continue
            first_gone = -(-rows // layout.rows_per_shard)
            for entry in sfs.listdir(directory):
                shard = layout.shard_of_key(entry)
                if shard is not None and shard >= first_gone:
                    (directory / entry).unlink()
