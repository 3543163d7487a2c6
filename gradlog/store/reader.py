"""Reading a store back at the storage level: :class:`StoreReader`.

Per parameter: its normalised spec, its form, its stored arrays by rows, its probe arrays,
its exact norms; per run: the records and steps tables. The user-facing :class:`gradlog.Run`
(``gradlog/run.py``) builds on it. Opening reads JSON and parquet only; nothing in a store is
ever executed. Only committed steps (those with a row in ``steps/``) are visible, so a run
being written or cut short by a crash reads as a consistent prefix.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradlog.errors import SelectionError, StoreFormatError, StoreReplacedError
from gradlog.store import consistency, root, selection
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.arrays import GradArray
from gradlog.store.dtypes import from_storage, storage_dtype
from gradlog.store.fs import StorePath
from gradlog.store.probes import ProbeArray, read_probe_ids, read_probe_index

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Selector", "StoreReader", "one_int"]

Selector = selection.Selector
one_int = selection.one_int



def _read_parts(directory: StorePath, schema: Any) -> Any:
    import pyarrow as pa
    import pyarrow.dataset as ds

    names = []
    if directory.is_dir():
        # temporaries (dot files) and foreign files are not parts
        names = [e for e in sorted(sfs.listdir(directory)) if fmt.parse_part_name(e) is not None]
    if not names:
        return schema.empty_table()
    try:  # one multi-threaded scan: ~1.5x faster than a read per file
        paths = [sfs.arrow_path(directory / name) for name in names]
        table = ds.dataset(
            paths, format="parquet", schema=schema, filesystem=sfs.arrow_filesystem(directory)
        ).to_table()
        # a part lacking a column reads as nulls here: let the per-file read name it
        if not any(table.column(f.name).null_count for f in schema if not f.nullable):
            return table
    except (OSError, pa.ArrowInvalid):
        pass  # find which part is bad (or which vanished) below
    tables = []
    for entry in names:
        try:
            table = sfs.read_parquet(directory / entry, schema=schema)
        except FileNotFoundError:
            continue  # an uncommitted part that a resuming writer just discarded
        except (OSError, pa.ArrowInvalid) as e:
            raise StoreFormatError(f"{directory / entry} is not a valid part: {e}") from None
        missing = [f.name for f in schema if not f.nullable and table.column(f.name).null_count]
        if missing:
            raise StoreFormatError(
                f"{directory / entry} is not a valid part: column(s) {missing} are missing or "
                "hold nulls. The store was damaged: run `gradlog verify` on it."
            )
        tables.append(table)
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


_NOTICES = {"projection": "_projection_warned", "estimate": "_estimates_noted"}
"""Kinds of once-per-parameter notices (:meth:`StoreReader.first_notice`), by their sets."""


class StoreReader:
    """A recorded store, opened for reading at the storage level.

    Every format version reads alike: the parameter specs are normalised once, when the store
    is opened (:func:`gradlog.store.format.normalised_specs`), so the form, form spec and
    arrays of each parameter are known whatever version wrote them. The user-facing
    :class:`gradlog.Run` builds on this class (reconstructed gradients, analyses).

    Attributes:
        path: The store's directory.
        attrs: The root attributes as stored (format, versions, config, parameter specs).
    """

    def __init__(
        self, path: str | os.PathLike[str] | StorePath, *, cross_check: bool = True
    ) -> None:
        """Open the store at ``path`` (a directory or an fsspec URL such as
        ``s3://bucket/run.gradlog``); see :func:`gradlog.open` for the errors raised.

        ``cross_check``: check now (and at :meth:`refresh`) that every committed step's index
        parts are there (``StoreCorruptError`` otherwise); ``gradlog verify`` opens without
        it and reports each problem itself."""
        self.path: StorePath = sfs.store_path(path)
        self._cross_check = cross_check
        self._read_attrs()
        self._check_index_parts()

    def _read_attrs(self) -> None:
        """(Re)read the root attributes, and forget what was opened from the old ones.

        Raises:
            StoreReplacedError: the store is another run than the one opened."""
        stamp = root.stamp(self.path)
        attrs = root.read_root_attrs(self.path)
        if hasattr(self, "attrs"):
            self._check_identity(attrs)
        self.attrs, self._stamp = attrs, stamp
        self._specs = fmt.normalised_specs(self.attrs)
        # Read before any step was committed, the specs may say 'full' for parameters whose
        # forms the recorder plans at its first backward (and writes here before any record):
        # steps re-reads them once it sees a commit (so does refresh).
        self._attrs_before_commit = self.attrs.get("config", {}).get("form", "full") != "full"
        self._arrays: dict[tuple[str, str], GradArray] = {}
        self._probe_arrays: dict[str, ProbeArray] = {}
        self.__dict__.pop("params", None)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, steps={self.steps.num_rows}, "
            f"records={self.datums.num_rows}, params={len(self._specs)})"
        )

    # -- metadata ---------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        """The format version the store was written in (informative: reads never differ)."""
        return int(self.attrs["format_version"])

    @property
    def sharded(self) -> bool:
        """Whether gradient arrays are read shard by shard by gradlog's own reader (else
        through zarr-python, whole chunks decoded): scans plan their memory by it."""
        return self.format_version >= 2

    @property
    def config(self) -> dict[str, Any]:
        """The recorder configuration the run was recorded with."""
        return dict(self.attrs.get("config", {}))

    @property
    def param_names(self) -> list[str]:
        """Recorded parameter names, in recording order."""
        return list(self._specs)

    @cached_property
    def params(self) -> Any:
        """pyarrow table: name, shape, numel, dtype, form of every recorded parameter."""
        import pyarrow as pa

        names = self.param_names
        return pa.table(
            {
                "name": names,
                "shape": pa.array([self._specs[n]["shape"] for n in names], pa.list_(pa.int64())),
                "numel": pa.array([self._specs[n].get("numel", 0) for n in names], pa.int64()),
                "dtype": [self._specs[n].get("dtype", "") for n in names],
                "form": [self._specs[n]["form"] for n in names],
            }
        )

    @cached_property
    def steps(self) -> Any:
        """pyarrow table of committed steps (step, first_row, n_records, lr, loss_mean, ...)."""
        table = _read_parts(self.path / fmt.STEPS_DIR, fmt.steps_schema())
        if table.num_rows and self._attrs_before_commit:
            self._read_attrs()  # the planned forms are written before the first commit
            self._attrs_before_commit = False
        return table.sort_by("step")

    @cached_property
    def datums(self) -> Any:
        """pyarrow table of every committed record (step, datum_id, row, loss, weight, lr,
        and ``norm/<param>`` per parameter), in row order."""
        import pyarrow as pa
        import pyarrow.compute as pc

        committed = self.steps.column("step")  # first: it may re-read the root attributes
        table = _read_parts(self.path / fmt.INDEX_DIR, fmt.index_schema(self.param_names))
        table = table.filter(pc.is_in(table.column("step"), value_set=pa.array(committed)))
        if self._cross_check:
            consistency.check_record_counts(self.path, self.steps, table)
        return table.sort_by("row")

    def _check_identity(self, attrs: dict[str, Any]) -> None:
        if root.identity(attrs) != root.identity(self.attrs):
            raise StoreReplacedError(
                f"{self.path} was replaced by another run (created {attrs.get('created')}) "
                f"since it was opened (the run created {self.attrs.get('created')}): what "
                "was read of the old run would be mixed with the new one's. Open it again: "
                "gradlog.open(path)."
            )

    def check_same_run(self) -> None:
        """Raise :class:`~gradlog.errors.StoreReplacedError` if the store was replaced by
        another run since it was opened. Local stores: a ``stat`` of the root metadata, read
        again only when it changed; other stores: the root metadata read again."""
        stamp = root.stamp(self.path)
        if stamp is not None and stamp == self._stamp:
            return
        self._check_identity(root.read_root_attrs(self.path))
        self._stamp = stamp

    def refresh(self) -> Self:
        """See what was recorded since opening: re-read the root attributes (forms are planned
        at the first backward) and forget the cached tables (steps, records, probes) and the
        opened arrays (they grow as steps commit)."""
        self._read_attrs()
        for name in ("steps", "datums", "probes"):
            self.__dict__.pop(name, None)
        self._check_index_parts()
        return self

    def _check_index_parts(self) -> None:
        """Every committed step's index parts are there (:mod:`gradlog.store.consistency`).

        Raises:
            StoreCorruptError: naming the missing parts.
        """
        if self._cross_check:  # read here, not cached: a run opened before its first commit
            steps = _read_parts(self.path / fmt.STEPS_DIR, fmt.steps_schema())  # sees later
            consistency.check_index_parts(self.path, steps)

    @property
    def nbytes(self) -> int:
        """Bytes the store occupies on disk."""
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    # -- parameters -------------------------------------------------------------------------
    def spec(self, param: object) -> dict[str, Any]:
        """``param``'s spec, normalised to the newest format (``form``, ``form_spec``,
        ``arrays``, ``shape``, ``dtype``): the reader's own dict, not to be modified.

        Raises:
            SelectionError: ``param`` is not one recorded parameter name.
        """
        if not isinstance(param, str):
            several = isinstance(param, (list, tuple, set))
            raise SelectionError(
                f"param={param!r}: expected one parameter name (a str)"
                + (", not several: call once per parameter" if several else "")
                + f". Recorded: {self._listed()}"
            )
        if param not in self._specs:
            near = difflib.get_close_matches(param, self.param_names, n=5, cutoff=0.3)
            hint = f" Did you mean: {', '.join(near)}?" if near else ""
            raise SelectionError(
                f"parameter {param!r} is not recorded in {self.path}.{hint} "
                f"Recorded: {self._listed()}"
            )
        return self._specs[param]

    def _listed(self) -> str:
        names = self.param_names
        return ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")

    def form_name(self, param: str) -> str:
        """The name of the form ``param`` was recorded with (``full`` before format
        version 3); cheap: builds no form (no torch)."""
        return str(self.spec(param)["form"])

    def form(self, param: str) -> Any:
        """The :class:`gradlog.forms.Form` ``param`` was recorded with (``full`` before
        format version 3); its ``inner``/``sqnorms`` compare records in its own space."""
        from gradlog.forms import form_from_spec  # forms need torch: only when asked

        return form_from_spec(self.spec(param)["form_spec"])

    def first_notice(self, kind: str, param: str) -> bool:
        """True the first time this reader is asked about notice ``kind`` (``"projection"``:
        grads() gives projected vectors; ``"estimate"``: scores are estimates) for
        ``param``; False after: each notice is given once per opened run and parameter."""
        seen: set[str] = self.__dict__.setdefault(_NOTICES[kind], set())
        if param in seen:
            return False
        seen.add(param)
        return True

    # -- records ----------------------------------------------------------------------------
    def records(self, step: Selector = None, datum: Selector = None) -> Any:
        """pyarrow table of the records at ``step`` (int, list, range or slice) and
        ``datum`` (datum_id, list of them, or ``slice(A, B)``: ids A..B-1), in row order.
        Ints may be numpy ints or 0-d arrays/tensors; anything else (floats, bools, strings)
        raises :class:`~gradlog.errors.SelectionError`."""
        table = _select_steps(
            self.datums, step, np.asarray(self.steps.column("step")),
            lambda s: f"step {s} is not a committed step of {self.path}.", "steps",
        )
        if isinstance(datum, slice):  # ids A..B-1, as a step slice: an empty range is no error
            return table.filter(selection.in_slice(table.column("datum_id"), datum, "datum"))
        datums = selection.as_ids(datum, "datum")
        if datums is None:
            return table
        present = np.asarray(table.column("datum_id"))
        missing = np.setdiff1d(datums, present)
        if missing.size:
            raise SelectionError(
                f"datum {int(missing[0])} has no record"
                f"{' at the selected steps' if step is not None else ''} in {self.path}. "
                f"{_nearby(np.unique(present), int(missing[0]), 'datum ids')}"
            )
        return _filter_in(table, "datum_id", datums)

    def rows(self, step: Selector = None, datum: Selector = None) -> np.ndarray:
        """Store rows (int64, row order) of :meth:`records` with the same selection."""
        return np.asarray(self.records(step, datum).column("row"), dtype=np.int64)

    def norms(
        self,
        param: str | Sequence[str] | None = None,
        step: Selector = None,
        datum: Selector = None,
    ) -> Any:
        """Long pyarrow table (step, datum_id, row, param, norm) of exact per-record norms of
        ``param`` (a name, a list of names, or None: every parameter)."""
        import pyarrow as pa

        names: list[Any]  # checked by spec below
        if param is None:
            names = self.param_names
        elif isinstance(param, (list, tuple)):  # a long table: several parameters fit
            names = list(dict.fromkeys(param))  # each once
        else:
            names = [param]
        if not names:
            raise SelectionError("norms(param=[]): no parameter selected; pass a name, a list "
                                 "of names, or None (every parameter).")
        for name in names:
            self.spec(name)
        table = self.records(step, datum)
        n = table.num_rows
        parts = [
            pa.table(
                {
                    "step": table.column("step"),
                    "datum_id": table.column("datum_id"),
                    "row": table.column("row"),
                    "param": pa.array([name] * n, pa.string()),
                    "norm": table.column(fmt.norm_column(name)),
                }
            )
            for name in names
        ]
        return pa.concat_tables(parts).sort_by([("row", "ascending")])

    def record_norms(self, records: Any, param: str) -> np.ndarray:
        """The exact float64 norms of ``param`` of ``records`` (a table of :meth:`records`
        or :attr:`datums`), from the index."""
        self.spec(param)
        return np.asarray(records.column(fmt.norm_column(param)).to_numpy(), dtype=np.float64)

    # -- arrays -----------------------------------------------------------------------------
    def array(self, param: str, array: str = "grad") -> GradArray:
        """``param``'s stored array ``array`` (one of ``spec(param)["arrays"]``), opened for
        verified reads (checksums; lossy storage dtypes decoded). Cached: its layout never
        changes."""
        opened = self._arrays.get((param, array))
        if opened is None or isinstance(self.path, Path):  # (a stat: cheap only locally)
            self.check_same_run()
        if opened is None:
            opened = self._arrays[param, array] = GradArray(
                self.path, param, self.spec(param), self.format_version, array
            )
        return opened

    def chunk_rows(self, param: str) -> int:
        """Rows per chunk (or shard) file of ``param``'s arrays (its first array's)."""
        return int(self.array(param, next(iter(self.spec(param)["arrays"]))).rows_per_chunk())

    def scatters(self, param: str) -> bool:
        """Whether sorted reads of ``param``'s ``full`` array land straight in their result
        (a local, uncompressed sharded array: ``ShardLayout.read_rows``' scatter reads)."""
        layout = self.array(param, "grad").layout
        return (layout is not None and layout.compression == "none"
                and not isinstance(self.path, sfs.ObjectPath) and hasattr(os, "preadv"))

    def read_array(
        self, param: str, rows: np.ndarray, dtype: Any = np.float32, array: str = "grad"
    ) -> np.ndarray:
        """Rows ``rows`` (int64, any order) of ``param``'s array ``array`` as
        ``(len(rows), *array shape)`` of ``dtype``; zeros ``(0, ...)`` for no rows (arrays are
        created at the first append: they may not exist yet).

        Sorted rows of sharded arrays are decoded straight into their place in the result
        by the verified shard reader (``ShardLayout.read_rows``: checksums, missing rows and
        truncation raise ``StoreCorruptError``), which saves two of the four passes over the
        data of the any-order path (a zeroed result and a per-shard block): measured, scans
        run about 2x faster on CPU.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            shape = self.spec(param)["arrays"][array]["shape"]
            return np.zeros((0, *shape), dtype=dtype)
        arr = self.array(param, array)
        layout = arr.layout
        if layout is None or bool(np.any(np.diff(rows) <= 0)):
            return np.asarray(arr.read(rows, dtype))
        stored = np.empty((rows.size, *arr.shape), dtype=layout.array_dtype)
        shards = rows // layout.rows_per_shard
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(shards)) + 1, [rows.size]])
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            shard = int(shards[a])
            key = layout.shard_key(shard)
            layout.read_rows(
                arr.directory / key,
                shard,
                (rows[a:b] - shard * layout.rows_per_shard).tolist(),
                stored[a:b],
                f"{arr.root}: {arr.where}, chunk {key}",
            )
        return np.asarray(from_storage(stored, arr.dtype, dtype))

    def read_arrays(self, param: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The stored arrays of ``param``'s form at store ``rows`` (sorted or not): name ->
        ``(len(rows), *array shape)`` (floats as float32, float64 for float64 storage;
        indices int64)."""
        spec = self.spec(param)
        wide = self.value_dtype(param)
        return {
            key: np.ascontiguousarray(
                self.read_array(param, rows, np.int64 if e["kind"] == "int64" else wide, key)
            )
            for key, e in spec["arrays"].items()
        }

    def value_dtype(self, param: str) -> Any:
        """The dtype reads return ``param``'s values in: float64 for float64 storage,
        float32 otherwise (lossy storage dtypes widened)."""
        stored = storage_dtype(self.spec(param)["dtype"])
        return np.float64 if stored.array_dtype == np.float64 else np.float32

    def stored_itemsize(self, param: str) -> int:
        """Bytes per stored value of ``param`` (its storage dtype's)."""
        return int(storage_dtype(self.spec(param)["dtype"]).itemsize)

    # -- probes -----------------------------------------------------------------------------
    @property
    def probe_ids(self) -> list[int]:
        """Ids of the probes recorded with the run (``GradRecorder(..., probes=...)``)."""
        return list(read_probe_ids(self.path) or [])

    @cached_property
    def probes(self) -> Any:
        """pyarrow table of the probe records of committed steps (step, probe_id, row, loss,
        and ``norm/<param>`` per parameter), in row order."""
        return read_probe_index(self.path, self.param_names, self.steps.column("step"))

    def probe_records(self, probe: Selector = None, step: Selector = None) -> Any:
        """pyarrow table of the probe records of ``probe`` (id or list) at ``step`` (int, list,
        range or slice), in row order."""
        if isinstance(probe, slice):
            raise SelectionError("probe takes an id or a list of ids, not a slice.")
        table = self.probes
        probes = selection.as_ids(probe, "probe")
        if probes is not None:
            known = np.asarray(self.probe_ids, dtype=np.int64)
            missing = np.setdiff1d(probes, known)
            if missing.size:
                hint = (
                    "It holds no probe: recorded without GradRecorder(..., probes=(loss_fn, "
                    "batch)), or before its first step with probes committed."
                    if known.size == 0
                    else _nearby(known, int(missing[0]), "probe ids")
                )
                raise SelectionError(f"probe {int(missing[0])} is not recorded in {self.path}. "
                                     f"{hint}")
            table = _filter_in(table, "probe_id", probes)
        return _select_steps(
            table, step, np.unique(np.asarray(table.column("step"))),
            lambda s: f"step {s} has no probe record in {self.path}.", "steps with probes",
        )

    def probe_array(self, param: str) -> ProbeArray:
        """``param``'s probe gradient array (stored ``full``), opened; cached."""
        opened = self._probe_arrays.get(param)
        if opened is None or isinstance(self.path, Path):
            self.check_same_run()
        if opened is None:
            table = self.probes
            rows = np.asarray(table.column("row"), dtype=np.int64)
            norms = np.full(int(rows.max()) + 1 if rows.size else 0, np.nan)
            norms[rows] = np.asarray(table.column(fmt.norm_column(param)), dtype=np.float64)
            opened = self._probe_arrays[param] = ProbeArray(self.path, param, self.spec(param),
                                                            norms)
        return opened

    def read_probe_rows(self, param: str, rows: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """Probe rows ``rows`` (sorted) of ``param`` as ``(len(rows), *shape)`` of ``dtype``."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return np.zeros((0, *self.spec(param)["shape"]), dtype=dtype)
        return np.asarray(self.probe_array(param).read(rows, dtype))


def _filter_in(table: Any, column: str, values: np.ndarray) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    return table.filter(pc.is_in(table.column(column), value_set=pa.array(values)))


def _select_steps(
    table: Any, step: Selector, known: np.ndarray, unknown: Any, what: str
) -> Any:
    """``table``'s rows at ``step`` (None: all; a slice: a range; else ids that must all be
    in ``known``, or a SelectionError starting with ``unknown(step)`` and listing ``what``)."""
    if step is None:
        return table
    if isinstance(step, slice):
        return table.filter(selection.in_slice(table.column("step"), step, "step"))
    steps = selection.as_ids(step, "step")
    assert steps is not None  # only None maps to None
    missing = np.setdiff1d(steps, known)
    if missing.size:
        first = int(missing[0])
        raise SelectionError(f"{unknown(first)} {_nearby(known, first, what)}")
    return _filter_in(table, "step", steps)


def _nearby(known: np.ndarray, value: int, what: str) -> str:
    if known.size == 0:
        return f"The run has no committed {what} yet."
    order = np.argsort(np.abs(known.astype(np.int64) - value), kind="stable")[:5]
    near = ", ".join(str(int(v)) for v in np.sort(known[order]))
    return f"Nearest {what}: {near} ({known.size} in all, {int(known.min())}..{int(known.max())})."
