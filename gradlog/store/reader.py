"""Reading a run back: ``gradlog.open(path) -> Run``.

Opening reads JSON and parquet only; nothing in a store is ever executed. Only committed steps
(those with a row in ``steps/``) are visible, so a run being written or cut short by a crash
reads as a consistent prefix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from gradlog.errors import NotAStoreError, SelectionError, StoreFormatError
from gradlog.store import format as fmt
from gradlog.store import fs as sfs
from gradlog.store.fs import StorePath

__all__ = ["Run", "Trajectory"]

Selector = int | Sequence[int] | range | slice | None


def _read_root_attrs(path: StorePath) -> dict[str, Any]:
    meta_file = path / "zarr.json"
    if not path.exists():
        raise NotAStoreError(f"{path} does not exist. Record a run first (gradlog train).")
    if not meta_file.is_file():
        raise NotAStoreError(
            f"{path} is not a gradlog store: it has no zarr.json. A store is the directory "
            "that GradRecorder(model, path) or `gradlog train --out PATH` created."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{meta_file} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("node_type") != "group":
        raise StoreFormatError(f"{path} is not a Zarr group (zarr.json has no node_type 'group').")
    attrs = meta.get("attributes", {})
    if not isinstance(attrs, dict):
        raise StoreFormatError(f"{meta_file}: 'attributes' must be a JSON object.")
    fmt.check_root_attrs(attrs, str(path))
    return attrs


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


_EXPECTED = "expected an int, a list of ints, a range or a slice (ids A..B-1 for slice(A, B))"


def _one_int(sel: Any) -> int | None:
    """``sel`` as an int when it is one integer: a Python or numpy int, or a 0-d integer
    array or tensor (``idx[3]`` of a batch's ids); None otherwise. Bools are not ids."""
    if isinstance(sel, (bool, np.bool_)):
        return None
    if isinstance(sel, (int, np.integer)):
        return int(sel)
    if hasattr(sel, "detach"):  # a torch tensor, without importing torch
        sel = sel.detach().cpu().numpy()
    if isinstance(sel, np.ndarray) and sel.ndim == 0 and sel.dtype.kind in "iu":
        return int(sel)
    return None


def _as_list(sel: Selector, name: str) -> np.ndarray | None:
    """A selection other than a slice as int64 ids; None stays None.

    Raises:
        SelectionError: ``sel`` is not integers (floats, bools, strings are never ids).
    """
    if sel is None:
        return None
    if isinstance(sel, slice):
        raise TypeError("internal: slices are resolved before _as_list")
    one = _one_int(sel)
    if one is not None:
        return np.array([one], dtype=np.int64)
    values: np.ndarray | None = None
    if hasattr(sel, "detach"):  # torch, without importing it here
        values = sel.detach().cpu().numpy()
    elif isinstance(sel, np.ndarray):
        values = sel
    elif isinstance(sel, range):
        values = np.arange(sel.start, sel.stop, sel.step, dtype=np.int64)
    elif isinstance(sel, Iterable) and not isinstance(sel, (str, bytes, dict)):
        try:  # numpy takes 0-d arrays and tensors as their values
            values = np.asarray(list(sel))
        except (TypeError, ValueError):  # ragged
            values = None
    if values is None or values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise SelectionError(f"{name}={sel!r}: {_EXPECTED}.")
    return values.astype(np.int64)


def _in_slice(column: Any, sel: slice, name: str) -> Any:
    """Mask of ``column``'s values in ``[sel.start, sel.stop)`` (an open end: no bound)."""
    import pyarrow.compute as pc

    if sel.step not in (None, 1):
        raise SelectionError(
            f"{name}={sel!r}: {name} slices take no stride; pass a range or a list."
        )
    start, stop = (None if b is None else _one_int(b) for b in (sel.start, sel.stop))
    if (sel.start is not None and start is None) or (sel.stop is not None and stop is None):
        raise SelectionError(f"{name}={sel!r}: slice bounds must be ints or None.")
    mask = pc.greater_equal(column, np.iinfo(np.int64).min if start is None else start)
    if stop is not None:
        mask = pc.and_(mask, pc.less(column, stop))
    return mask


class Trajectory(NamedTuple):
    """One datum's gradients across training: ``steps[i]`` is the step of ``grads[i]``."""

    steps: np.ndarray
    grads: Any


class Run:
    """A recorded run, opened for reading.

    Attributes:
        path: The store's directory.
        attrs: The root attributes (format, versions, config, parameter specs).
    """

    def __init__(self, path: str | os.PathLike[str] | StorePath) -> None:
        """Open the store at ``path`` (a directory or an fsspec URL such as
        ``s3://bucket/run.gradlog``); see :func:`gradlog.open` for the errors raised."""
        self.path: StorePath = sfs.store_path(path)
        self._read_attrs()

    def _read_attrs(self) -> None:
        """(Re)read the root attributes, and forget what was opened from the old ones."""
        self.attrs = _read_root_attrs(self.path)
        self._specs: dict[str, dict[str, Any]] = self.attrs["params"]
        # Read before any step was committed, the specs may say 'full' for parameters whose
        # forms the recorder plans at its first backward (and writes here before any record):
        # steps re-reads them once it sees a commit (so does refresh).
        self._attrs_before_commit = self.attrs.get("config", {}).get("form", "full") != "full"
        for name in ("params", "_grad_arrays", "_probe_arrays"):
            self.__dict__.pop(name, None)

    def __repr__(self) -> str:
        return (
            f"Run({str(self.path)!r}, steps={self.steps.num_rows}, "
            f"records={self.datums.num_rows}, params={len(self._specs)})"
        )

    # -- metadata ---------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        return int(self.attrs["format_version"])

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
                "form": [self._specs[n].get("form", "full") for n in names],
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
        return table.sort_by("row")

    def refresh(self) -> Run:
        """See what was recorded since opening: re-read the root attributes (forms are planned
        at the first backward) and forget the cached tables (steps, records, probes) and the
        opened arrays (they grow as steps commit)."""
        self._read_attrs()
        for name in ("steps", "datums", "probes"):
            self.__dict__.pop(name, None)
        return self

    @property
    def nbytes(self) -> int:
        """Bytes the store occupies on disk."""
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    # -- selection --------------------------------------------------------------------------
    def _check_param(self, param: object) -> dict[str, Any]:
        if not isinstance(param, str):
            several = isinstance(param, (list, tuple, set))
            raise SelectionError(
                f"param={param!r}: expected one parameter name (a str)"
                + (", not several: call once per parameter" if several else "")
                + f". Recorded: {', '.join(self.param_names[:20])}"
                + (" ..." if len(self.param_names) > 20 else "")
            )
        if param not in self._specs:
            import difflib

            near = difflib.get_close_matches(param, self.param_names, n=5, cutoff=0.3)
            hint = f" Did you mean: {', '.join(near)}?" if near else ""
            raise SelectionError(
                f"parameter {param!r} is not recorded in {self.path}.{hint} "
                f"Recorded: {', '.join(self.param_names[:20])}"
                + (" ..." if len(self.param_names) > 20 else "")
            )
        return self._specs[param]

    def records(self, step: Selector = None, datum: Selector = None) -> Any:
        """pyarrow table of the records at ``step`` (int, list, range or slice) and
        ``datum`` (datum_id, list of them, or ``slice(A, B)``: ids A..B-1), in row order.
        Ints may be numpy ints or 0-d arrays/tensors; anything else (floats, bools, strings)
        raises :class:`~gradlog.errors.SelectionError`."""
        import pyarrow as pa
        import pyarrow.compute as pc

        table = self.datums
        if isinstance(step, slice):
            table = table.filter(_in_slice(table.column("step"), step, "step"))
        else:
            steps = _as_list(step, "step")
            if steps is not None:
                known = np.asarray(self.steps.column("step"))
                missing = np.setdiff1d(steps, known)
                if missing.size:
                    raise SelectionError(
                        f"step {int(missing[0])} is not a committed step of {self.path}. "
                        f"{_nearby(known, int(missing[0]), 'steps')}"
                    )
                table = table.filter(pc.is_in(table.column("step"), value_set=pa.array(steps)))
        if isinstance(datum, slice):  # ids A..B-1, as a step slice: an empty range is no error
            return table.filter(_in_slice(table.column("datum_id"), datum, "datum"))
        datums = _as_list(datum, "datum")
        if datums is not None:
            present = np.asarray(table.column("datum_id"))
            missing = np.setdiff1d(datums, present)
            if missing.size:
                raise SelectionError(
                    f"datum {int(missing[0])} has no record"
                    f"{' at the selected steps' if step is not None else ''} in {self.path}. "
                    f"{_nearby(np.unique(present), int(missing[0]), 'datum ids')}"
                )
            table = table.filter(pc.is_in(table.column("datum_id"), value_set=pa.array(datums)))
        return table

    # -- data -------------------------------------------------------------------------------
    def grads(
        self,
        param: str,
        step: Selector = None,
        datum: Selector = None,
        *,
        as_torch: bool = False,
        dtype: Any = np.float32,
    ) -> Any:
        """Per-datum gradients of ``param`` for the selected records.

        Returns an array ``(n_records, *shape)`` whose rows follow :meth:`records` with the
        same selection (in row order: by step, then by position in the batch).

        Parameters recorded with another form than ``full`` (``run.params["form"]``):
        ``factors``, ``rows`` and ``topk`` are rebuilt (``topk``: its kept entries, zeros
        elsewhere); ``projection`` returns the projected vectors ``(n_records, *ranks)``
        (with a :class:`UserWarning` saying so, once per parameter); ``norm`` keeps no
        gradient and raises :class:`~gradlog.errors.SelectionError` pointing to
        :meth:`norms`.
        """
        spec = self._check_param(param)
        rows = np.asarray(self.records(step, datum).column("row"), dtype=np.int64)
        form = spec.get("form", "full")
        if form != "full" and self.format_version >= 3:
            out = self._form_grads(param, rows, dtype)
        elif rows.size == 0:  # arrays are created at the first append: they may not exist yet
            out = np.zeros((0, *spec["shape"]), dtype=dtype)
        else:
            out = self._grad_array(param).read(rows, dtype)
        if as_torch:
            import torch

            return torch.from_numpy(out)
        return out

    def form(self, param: str) -> Any:
        """The :class:`gradlog.forms.Form` ``param`` was recorded with (``full`` before
        format version 3); its ``inner``/``sqnorms`` compare records in its own space."""
        from gradlog.forms import FullForm, form_from_spec

        spec = self._check_param(param)
        if self.format_version < 3:
            return FullForm(tuple(spec["shape"]))
        return form_from_spec(spec["form_spec"])

    def read_form_arrays(self, param: str, rows: np.ndarray) -> dict[str, Any]:
        """The stored arrays of ``param``'s form at store ``rows`` (sorted or not): name ->
        torch tensor ``(len(rows), *array shape)`` (floats as float32, float64 for float64
        storage; indices int64)."""
        import torch

        spec = self._check_param(param)
        if self.format_version < 3:
            entries = {"grad": {"shape": spec["shape"], "kind": "float"}}
        else:
            entries = spec["arrays"]
        wide = spec["dtype"] == "float64"
        out = {}
        for key, entry in entries.items():
            kind = np.int64 if entry["kind"] == "int64" else np.float64 if wide else np.float32
            if rows.size == 0:
                data = np.zeros((0, *entry["shape"]), dtype=kind)
            else:
                data = self._grad_array(param, key).read(rows, kind)
            out[key] = torch.from_numpy(np.ascontiguousarray(data))
        return out

    def _form_grads(self, param: str, rows: np.ndarray, dtype: Any) -> np.ndarray:
        """``grads()`` of a parameter recorded with another form than ``full``."""
        form = self._form_notice(param, stacklevel=4)
        arrays = self.read_form_arrays(param, rows)
        if form.name == "projection":
            return np.asarray(arrays["proj"].numpy(), dtype=dtype)
        return np.asarray(form.decode(arrays).numpy(), dtype=dtype)

    def _form_notice(self, param: str, *, stacklevel: int = 3) -> Any:
        """``param``'s form, after what reading its gradients must say: ``norm`` keeps none
        (:class:`~gradlog.errors.SelectionError`), ``projection`` gives projected vectors
        (a :class:`UserWarning`, once per parameter)."""
        import warnings

        form = self.form(param)
        if form.name == "norm":
            raise SelectionError(
                f"parameter {param!r} was recorded with form 'norm': only each record's exact "
                "norm is kept. Read it with run.norms(param); record with form 'full', "
                "'factors', 'projection' or 'auto' to keep more."
            )
        if form.name == "projection":
            warned: set[str] = self.__dict__.setdefault("_projection_warned", set())
            if param not in warned:
                warned.add(param)
                warnings.warn(
                    f"parameter {param!r} was recorded as a random projection: grads() returns "
                    f"the projected vectors {tuple(form.out_shape)} per record, not the "
                    "gradients. Inner products between them estimate the gradients' "
                    "(unbiased); project your own gradients alike with run.project(param, g).",
                    UserWarning,
                    stacklevel=stacklevel,
                )
        return form

    def project(self, param: str, grad: Any) -> Any:
        """A gradient the user computed (a test example's, ``(*shape)`` or a batch ``(K,
        *shape)``, torch or numpy), projected with ``param``'s stored projection: it lies in
        the space of ``run.grads(param)``, so their inner products estimate the gradients'.

        Raises:
            SelectionError: ``param`` was not recorded with form ``projection``.
        """
        import torch

        from gradlog.forms import project

        spec = self._check_param(param)
        if spec.get("form", "full") != "projection":
            raise SelectionError(
                f"parameter {param!r} was recorded with form {spec.get('form', 'full')!r}, "
                "not 'projection': compare your gradient with run.grads(param) directly."
            )
        g = grad if isinstance(grad, torch.Tensor) else torch.as_tensor(np.asarray(grad))
        if not g.is_floating_point():
            g = g.to(torch.float32)
        out = project(g, spec["form_spec"])  # float64 stays float64
        return out if isinstance(grad, torch.Tensor) else out.numpy()

    def _grad_array(self, param: str, array: str = "grad") -> Any:
        """``param``'s gradient array opened for verified reads (gradlog.store.arrays);
        decodes lossy storage dtypes. Cached: the array's layout never changes."""
        from gradlog.store.arrays import GradArray

        cache: dict[tuple[str, str], GradArray] = self.__dict__.setdefault("_grad_arrays", {})
        if (param, array) not in cache:
            cache[param, array] = GradArray(
                self.path, param, self._check_param(param), self.format_version, array
            )
        return cache[param, array]

    def norms(
        self,
        param: str | Sequence[str] | None = None,
        step: Selector = None,
        datum: Selector = None,
    ) -> Any:
        """Long pyarrow table (step, datum_id, row, param, norm) of exact per-record norms of
        ``param`` (a name, a list of names, or None: every parameter)."""
        import pyarrow as pa

        names: list[Any]  # checked by _check_param below
        if param is None:
            names = self.param_names
        elif isinstance(param, (list, tuple)):  # a long table: several parameters fit
            names = list(param)
        else:
            names = [param]
        if not names:
            raise SelectionError("norms(param=[]): no parameter selected; pass a name, a list "
                                 "of names, or None (every parameter).")
        for name in names:
            self._check_param(name)
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
        return pa.concat_tables(parts).sort_by([("row", "ascending")]) if parts else None


    def trajectory(self, param: str, datum: int, *, as_torch: bool = False) -> Trajectory:
        """Datum ``datum``'s gradients of ``param`` at every step where it appeared.

        Returns:
            ``Trajectory(steps, grads)``: int64 steps ``(n,)`` and gradients ``(n, *shape)``
            (float32 numpy, or torch with ``as_torch=True``), in step order.
        """
        one = _one_int(datum)
        if one is None:
            raise SelectionError(f"datum={datum!r}: a trajectory follows one datum id (an int).")
        self._check_param(param)
        steps = np.asarray(self.records(datum=one).column("step"), dtype=np.int64)
        return Trajectory(steps, self.grads(param, datum=one, as_torch=as_torch))

    # -- probes -----------------------------------------------------------------------------
    @property
    def probe_ids(self) -> list[int]:
        """Ids of the probes recorded with the run (``GradRecorder(..., probes=...)``)."""
        from gradlog.store.probes import read_probe_ids

        return list(read_probe_ids(self.path) or [])

    @cached_property
    def probes(self) -> Any:
        """pyarrow table of the probe records of committed steps (step, probe_id, row, loss,
        and ``norm/<param>`` per parameter), in row order."""
        from gradlog.store.probes import read_probe_index

        return read_probe_index(self.path, self.param_names, self.steps.column("step"))

    def probe_records(self, probe: Selector = None, step: Selector = None) -> Any:
        """pyarrow table of the probe records of ``probe`` (id or list) at ``step`` (int, list,
        range or slice), in row order."""
        import pyarrow as pa
        import pyarrow.compute as pc

        table = self.probes
        probes = _as_list(probe, "probe") if not isinstance(probe, slice) else None
        if isinstance(probe, slice):
            raise SelectionError("probe takes an id or a list of ids, not a slice.")
        if probes is not None:
            known = np.asarray(self.probe_ids, dtype=np.int64)
            missing = np.setdiff1d(probes, known)
            if missing.size:
                hint = (
                    "It was recorded without probes: pass GradRecorder(..., probes=(loss_fn, "
                    "batch)) to record them."
                    if known.size == 0
                    else _nearby(known, int(missing[0]), "probe ids")
                )
                raise SelectionError(f"probe {int(missing[0])} is not recorded in {self.path}. "
                                     f"{hint}")
            table = table.filter(pc.is_in(table.column("probe_id"), value_set=pa.array(probes)))
        if step is None:
            return table
        if isinstance(step, slice):
            return table.filter(_in_slice(table.column("step"), step, "step"))
        steps = _as_list(step, "step")
        assert steps is not None
        known = np.unique(np.asarray(table.column("step")))
        missing = np.setdiff1d(steps, known)
        if missing.size:
            raise SelectionError(
                f"step {int(missing[0])} has no probe record in {self.path}. "
                f"{_nearby(known, int(missing[0]), 'steps with probes')}"
            )
        return table.filter(pc.is_in(table.column("step"), value_set=pa.array(steps)))

    def probe_grads(
        self,
        param: str,
        probe: Selector = None,
        step: Selector = None,
        *,
        as_torch: bool = False,
        dtype: Any = np.float32,
    ) -> Any:
        """Recorded probe gradients of ``param``: ``(n, *shape)``, rows following
        :meth:`probe_records` with the same selection."""
        spec = self._check_param(param)
        rows = np.asarray(self.probe_records(probe, step).column("row"), dtype=np.int64)
        if rows.size == 0:
            out = np.zeros((0, *spec["shape"]), dtype=dtype)
        else:
            out = self._probe_array(param).read(rows, dtype)
        if as_torch:
            import torch

            return torch.from_numpy(out)
        return out

    def _probe_array(self, param: str) -> Any:
        """``param``'s probe gradient array (gradlog.store.probes.ProbeArray), cached."""
        from gradlog.store.probes import ProbeArray

        cache: dict[str, Any] = self.__dict__.setdefault("_probe_arrays", {})
        if param not in cache:
            cache[param] = ProbeArray(self.path, param, self._check_param(param))
        return cache[param]

    # -- analysis (gradlog.analysis) --------------------------------------------------------
    def to_xarray(
        self, param: str, step: Selector = None, datum: Selector = None, *, lazy: bool = False
    ) -> Any:
        """``param``'s gradients as an ``xarray.DataArray`` (dims ``record, dim_0, ...``;
        coords ``step``, ``datum_id``, ``row``, ``loss``, ``weight``, ``lr``); dask-backed with
        ``lazy=True``. Needs ``pip install 'gradlog[xarray]'``."""
        from gradlog.analysis.frames import to_xarray

        return to_xarray(self, param, step, datum, lazy=lazy)

    def to_dask(self, param: str, step: Selector = None, datum: Selector = None) -> Any:
        """``param``'s gradients as a lazy dask array ``(n, *shape)``, one chunk per store
        chunk (a step's rows). Needs ``pip install 'gradlog[dask]'``."""
        from gradlog.analysis.frames import to_dask

        return to_dask(self, param, step, datum)

    def similarity(
        self,
        params: str | Sequence[str] | None = None,
        *,
        a: Any = None,
        b: Any = None,
        kind: str = "dot",
        max_memory: int | str | None = None,
        progress: bool = False,
        scheduler: Any = None,
    ) -> Any:
        """Gradient similarity (``"dot"`` or ``"cosine"``) between records ``a`` and ``b``
        (each None, ``{"step": ..., "datum": ...}`` or a ``run.records()`` table): a float64
        array ``(len(a), len(b))``. See :func:`gradlog.analysis.similarity`."""
        from gradlog.analysis.similarity import similarity

        return similarity(self, params, a=a, b=b, kind=kind, max_memory=max_memory,
                          progress=progress, scheduler=scheduler)

    def influence(
        self,
        probe: Any,
        *,
        top: int | None = 10,
        params: str | Sequence[str] | None = None,
        weighted: bool = False,
        lr: float | None = None,
        max_memory: int | str | None = None,
        progress: bool = False,
        scheduler: Any = None,
    ) -> Any:
        """TracIn over the recorded steps: rank training data by
        ``sum_t lr_t <g_t(datum), g_t(probe)>``. A positive score means training on the datum
        decreased the probe's loss (proponent), a negative one increased it (opponent).
        ``probe``: a recorded probe id, or a dict ``{param: gradient}`` used at every step.
        Returns a pyarrow table (kind, rank, datum_id, score, n_steps). See
        :func:`gradlog.analysis.influence` for sign, scale, ``weighted`` and ``scheduler``
        (the scan on Dask)."""
        from gradlog.analysis.influence import influence

        return influence(self, probe, top=top, params=params, weighted=weighted, lr=lr,
                         max_memory=max_memory, progress=progress, scheduler=scheduler)

    def self_influence(
        self,
        *,
        top: int | None = None,
        params: str | Sequence[str] | None = None,
        weighted: bool = False,
        lr: float | None = None,
    ) -> Any:
        """Self-influence ``sum_t lr_t ||g_t(datum)||^2`` per datum, from the index's exact
        norms (no gradient read): a pyarrow table (datum_id, score, n_steps), descending."""
        from gradlog.analysis.influence import self_influence

        return self_influence(self, top=top, params=params, weighted=weighted, lr=lr)

    def movers(
        self,
        params: str | Sequence[str] | None = None,
        *,
        steps: Selector = None,
        top: int | None = 10,
        lr: float | None = None,
        max_memory: int | str | None = None,
        progress: bool = False,
        scheduler: Any = None,
    ) -> Any:
        """Which data moved ``params`` over ``steps``: each datum's contributions
        ``-lr_t w_b g_b`` projected on the SGD-attributable change of the parameters; scores
        sum to the change's norm. See :func:`gradlog.analysis.movers`."""
        from gradlog.analysis.movement import movers

        return movers(self, params, steps=steps, top=top, lr=lr, max_memory=max_memory,
                      progress=progress, scheduler=scheduler)

    def stats(
        self,
        param: str,
        step: Selector = None,
        datum: Selector = None,
        *,
        max_memory: int | str | None = None,
        scheduler: Any = None,
    ) -> dict[str, Any]:
        """Statistics of a slice (n_records, shape, norm, mean, std, min, max), streamed;
        on Dask with ``scheduler`` (as :meth:`influence`)."""
        from gradlog.analysis.summary import stats

        return stats(self, param, step, datum, max_memory=max_memory, scheduler=scheduler)

    def export(
        self,
        out: str | os.PathLike[str],
        *,
        format: str | None = None,
        params: str | Sequence[str] | None = None,
        step: Selector = None,
        datum: Selector = None,
        max_memory: int | str | None = None,
        progress: bool = False,
    ) -> dict[str, Any]:
        """Write records and gradients to a parquet or npz file (by extension or ``format``).
        See :func:`gradlog.analysis.export` for the layouts."""
        from gradlog.analysis.export import export

        return export(self, out, format=format, params=params, step=step, datum=datum,
                      max_memory=max_memory, progress=progress)

    def plot(
        self,
        out: str | os.PathLike[str] | None = None,
        *,
        params: str | Sequence[str] | None = None,
        datums: int | Sequence[int] = 8,
        width: int = 1200,
        height: int = 500,
    ) -> Any:
        """Per-datum gradient-norm trajectories and a steps x data heatmap (a matplotlib
        Figure; saved to ``out`` if given). Needs ``pip install 'gradlog[plot]'``."""
        from gradlog.analysis.plot import plot_norms

        return plot_norms(self, out, params=params, datums=datums, width=width, height=height)

def _nearby(known: np.ndarray, value: int, what: str) -> str:
    if known.size == 0:
        return f"The run has no committed {what} yet."
    order = np.argsort(np.abs(known.astype(np.int64) - value), kind="stable")[:5]
    near = ", ".join(str(int(v)) for v in np.sort(known[order]))
    return f"Nearest {what}: {near} ({known.size} in all, {int(known.min())}..{int(known.max())})."
