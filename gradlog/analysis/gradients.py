"""Per-datum gradients read back: the records of one parameter rebuilt from its form.

``Run.grads``, ``Run.probe_grads``, ``Run.trajectory``, ``Run.project`` and
``Run.read_form_arrays`` are these functions. ``full`` records come back as stored;
``factors``, ``rows`` and ``topk`` rebuilt (``topk``: its kept entries, zeros elsewhere);
``projection`` as its projected vectors (with a :class:`UserWarning` saying so, once per run
and parameter); ``norm`` keeps no gradient.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np

from gradlog.analysis.scan import memory_bytes
from gradlog.analysis.selection import check_finite
from gradlog.errors import (
    InputError,
    NonFiniteGradientWarning,
    ReadTooLargeError,
    SelectionError,
    StoreCorruptError,
    StoreFormatError,
)
from gradlog.store.dtypes import norms_disagree, read_dtype
from gradlog.store.reader import Selector, StoreReader, one_int

__all__ = [
    "Trajectory",
    "decoded",
    "form_notice",
    "form_tensors",
    "grads",
    "guard_unselected",
    "probe_grads",
    "project",
    "record_shape",
    "trajectory",
]


class Trajectory(NamedTuple):
    """One datum's gradients across training: ``steps[i]`` is the step of ``grads[i]``."""

    steps: np.ndarray
    grads: Any


def _out(values: np.ndarray, as_torch: bool) -> Any:
    if as_torch:
        import torch

        return torch.from_numpy(values)
    return values


def grads(
    run: StoreReader,
    param: str,
    step: Selector = None,
    datum: Selector = None,
    *,
    as_torch: bool = False,
    dtype: Any = np.float32,
    max_memory: int | str | None = None,
) -> Any:
    """Per-datum gradients of ``param`` for the selected records.

    Returns an array ``(n_records, *shape)`` whose rows follow ``run.records`` with the
    same selection (in row order: by step, then by position in the batch); torch with
    ``as_torch``. Without ``step`` and ``datum`` (every record) the read is refused when it
    would exceed ``max_memory`` (default 256 MiB, or a string such as ``"2GiB"``), with
    :class:`~gradlog.errors.ReadTooLargeError` naming a selection that fits; a selection
    you pass is read whatever its size.

    Parameters recorded with another form than ``full`` (``run.params["form"]``):
    ``factors``, ``rows`` and ``topk`` are rebuilt (``topk``: its kept entries, zeros
    elsewhere); ``projection`` returns the projected vectors ``(n_records, *ranks)``
    (with a :class:`UserWarning` saying so, once per parameter); ``norm`` keeps no
    gradient and raises :class:`~gradlog.errors.SelectionError` pointing to ``run.norms``.

    ``dtype``: float32 (default) or float64; others raise :class:`~gradlog.errors.InputError`.
    """
    dtype = read_dtype(dtype, "grads")
    run.spec(param)
    records = run.records(step, datum)
    rows = np.asarray(records.column("row"), dtype=np.int64)
    if step is None and datum is None:
        guard_unselected(run, param, rows, dtype, max_memory, "grads")
    values = decoded(run, param, rows, dtype)
    if run.form_name(param) == "full":
        _check_norms(run, param, values, run.record_norms(records, param), rows)
    return _out(values, as_torch)


def _check_norms(run: StoreReader, param: str, values: np.ndarray, norms: np.ndarray,
                 rows: np.ndarray) -> None:
    """Records read against their exact norms in the index: a shard of other rows (files
    swapped, copied in from another store) passes its checksums, not this (one pass over
    what was read; scans, which stream, leave it to ``gradlog verify``)."""
    if not rows.size:
        return  # (no array before the first records)
    bad, overflowed = norms_disagree(values, norms, run.array(param).dtype)
    if overflowed.any():  # said when recorded too
        warnings.warn(
            f"the records of {param!r} at rows {rows[overflowed][:5].tolist()} hold inf: they "
            "overflowed the float16 storage dtype when recorded (their norms in the index are "
            "exact).", NonFiniteGradientWarning, stacklevel=4)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise StoreCorruptError(
            f"{run.path}: the records of {param!r} at rows {rows[bad][:5].tolist()} do not "
            f"have the norms the index gives them (row {int(rows[i])}: "
            f"{float(np.linalg.norm(values[i].astype(np.float64))):.6g} read, "
            f"{norms[i]:.6g} in the index): a shard holds other records than its rows' (files "
            "swapped or copied in from another store?). Run gradlog verify on it."
        )


def guard_unselected(
    run: StoreReader,
    param: str,
    rows: np.ndarray,
    dtype: Any,
    max_memory: int | str | None,
    method: str,
    *,
    probes: bool = False,
) -> None:
    """Refuse a read of every record (no selection) that would load more than ``max_memory``.

    A selection the caller wrote is a decision; ``run.grads(param)`` alone is often a slip
    (in a notebook, the whole run loaded at once), so above the budget it is an error that
    names a selection of the right size, the lazy views, and the option to load it anyway.

    Raises:
        ReadTooLargeError: the read exceeds ``max_memory`` (default 256 MiB).
    """
    budget = memory_bytes(max_memory)
    spec = run.spec(param)
    shape = run.form(param).out_shape if spec["form"] == "projection" else spec["shape"]
    per_record = int(np.prod([int(d) for d in shape])) * np.dtype(dtype).itemsize
    need = int(rows.size) * per_record
    if need <= budget:
        return
    steps = run.steps
    if probes:
        pick = f"run.probe_grads({param!r}, probe=..., step=...)"
    elif steps.num_rows:
        first = int(steps.column("step")[0].as_py())
        per_step = int(steps.column("n_records")[0].as_py())
        fit = max(1, budget // max(per_record * max(per_step, 1), 1))
        last = int(steps.column("step")[min(fit, steps.num_rows) - 1].as_py())
        pick = (
            f"run.grads({param!r}, step={first}) (that step's {per_step} records), "
            f"step=slice({first}, {last + 1}) or datum=[...]"
        )
    else:
        pick = f"run.grads({param!r}, step=..., datum=...)"
    raise ReadTooLargeError(
        f"run.{method}({param!r}) without a step or datum selection would load every record: "
        f"{rows.size} x {tuple(int(d) for d in shape)} = {_size(need)}, over "
        f"max_memory={_size(budget)}. Select records, e.g. {pick}; or read lazily "
        f"with run.to_dask({param!r}) / run.to_xarray({param!r}); or stream a reduction "
        f"(run.stats, run.similarity, run.influence); or pass max_memory="
        f"'{-(-need // 2**20)}MiB' to load it all."
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def decoded(run: StoreReader, param: str, rows: np.ndarray, dtype: Any) -> np.ndarray:
    """``param``'s records at store ``rows`` as :func:`grads` returns them (numpy)."""
    if run.form_name(param) == "full":
        return run.read_array(param, rows, dtype)
    form = form_notice(run, param, stacklevel=4)
    arrays = form_tensors(run, param, rows)
    if form.name == "projection":
        return np.asarray(arrays["proj"].numpy(), dtype=dtype)
    out = form.decode(arrays)
    shape = (len(rows), *(int(d) for d in run.attrs["params"][param]["shape"]))
    if tuple(out.shape) != shape:  # a form spec at odds with its arrays: never reshaped
        raise StoreFormatError(
            f"{run.path}: the {form.name} records of {param!r} decode to {tuple(out.shape)}, "
            f"not {shape}: the store's form spec disagrees with its arrays (run gradlog "
            "verify on it)."
        )
    return np.asarray(out.numpy(), dtype=dtype)


def form_notice(run: StoreReader, param: str, *, stacklevel: int = 3) -> Any:
    """``param``'s form, after what reading its gradients must say: ``norm`` keeps none
    (:class:`~gradlog.errors.SelectionError`), ``projection`` gives projected vectors
    (a :class:`UserWarning`, once per run and parameter)."""
    form = run.form(param)
    if form.name == "norm":
        raise SelectionError(
            f"parameter {param!r} was recorded with form 'norm': only each record's exact "
            "norm is kept. Read it with run.norms(param); record with form 'full', "
            "'factors', 'projection' or 'auto' to keep more."
        )
    if form.name == "projection" and run.first_notice("projection", param):
        warnings.warn(
            f"parameter {param!r} was recorded as a random projection: grads() returns "
            f"the projected vectors {tuple(form.out_shape)} per record, not the "
            "gradients. Inner products between them estimate the gradients' "
            "(unbiased); project your own gradients alike with run.project(param, g).",
            UserWarning,
            stacklevel=stacklevel,
        )
    return form


def form_tensors(run: StoreReader, param: str, rows: np.ndarray) -> dict[str, Any]:
    """The stored arrays of ``param``'s form at store ``rows`` (sorted or not): name ->
    torch tensor ``(len(rows), *array shape)`` (floats as float32, float64 for float64
    storage; indices int64), as ``run.form(param).inner``/``decode`` take them."""
    import torch

    rows = np.asarray(rows, dtype=np.int64)
    return {k: torch.from_numpy(v) for k, v in run.read_arrays(param, rows).items()}


def record_shape(run: StoreReader, param: str) -> tuple[list[int], str]:
    """What :func:`grads` returns per record of ``param`` (its shape; a projection's
    projected shape), and the stored array whose chunks the records follow. A ``norm``
    parameter keeps no gradient: :class:`~gradlog.errors.SelectionError`, and a projection
    warns, as in :func:`grads`."""
    spec = run.spec(param)
    if spec["form"] == "full":
        return [int(d) for d in spec["shape"]], "grad"
    form = form_notice(run, param, stacklevel=4)
    if form.name == "projection":
        return [int(d) for d in form.out_shape], "proj"
    return [int(d) for d in spec["shape"]], next(iter(spec["arrays"]))


def project(run: StoreReader, param: str, grad: Any) -> Any:
    """A gradient the user computed (a test example's, ``(*shape)`` or a batch ``(K,
    *shape)``, torch or numpy), put in the space of ``run.grads(param)``: projected with a
    ``projection`` parameter's stored projection (inner products with the records then
    estimate the gradients'), as given for the other forms, whose records ``run.grads``
    returns in the parameter's shape (exact, or ``topk``'s kept entries), so one loop serves
    every parameter.

    Raises:
        SelectionError: ``param`` has form ``norm``, which keeps no gradients.
        InputError: ``grad`` has another shape, or holds NaN or inf (its projection would
            too, silently).
    """
    import torch

    from gradlog.forms import project as project_with
    from gradlog.forms.base import as_batch

    spec = run.spec(param)
    if spec["form"] == "norm":
        raise SelectionError(
            f"parameter {param!r} was recorded with form 'norm', which keeps no gradients to "
            "compare a gradient with: use run.norms() for its norms, or record it with form "
            "'full', 'auto' or 'projection'."
        )
    g = grad if isinstance(grad, torch.Tensor) else torch.as_tensor(np.asarray(grad))
    if not g.is_floating_point():
        g = g.to(torch.float32)
    if not bool(torch.isfinite(g).all()):  # (the message counts them, on this rare path)
        check_finite(g.detach().cpu().double().numpy(), param, "gradient to project")
    if spec["form"] == "projection":
        out = project_with(g, spec["form_spec"])  # float64 stays float64
    else:
        try:
            as_batch(g, tuple(int(d) for d in spec["shape"]))  # (checks its shape)
        except InputError as e:
            raise InputError(f"run.project({param!r}, ...): {e}") from None
        out = g
    return out if isinstance(grad, torch.Tensor) else out.numpy()


def probe_grads(
    run: StoreReader,
    param: str,
    probe: Selector = None,
    step: Selector = None,
    *,
    as_torch: bool = False,
    dtype: Any = np.float32,
    max_memory: int | str | None = None,
) -> Any:
    """Recorded probe gradients of ``param``: ``(n, *shape)``, rows following
    ``run.probe_records`` with the same selection (every probe at every step: refused above
    ``max_memory``, as :func:`grads`; ``dtype`` float32 or float64, as :func:`grads`)."""
    dtype = read_dtype(dtype, "probe_grads")
    run.spec(param)
    rows = np.asarray(run.probe_records(probe, step).column("row"), dtype=np.int64)
    if probe is None and step is None:
        guard_unselected(run, param, rows, dtype, max_memory, "probe_grads", probes=True)
    return _out(run.read_probe_rows(param, rows, dtype), as_torch)


def trajectory(run: StoreReader, param: str, datum: int, *, as_torch: bool = False) -> Trajectory:
    """Datum ``datum``'s gradients of ``param`` at every step where it appeared.

    Returns:
        ``Trajectory(steps, grads)``: int64 steps ``(n,)`` and gradients ``(n, *shape)``
        (float32 numpy, or torch with ``as_torch=True``), in step order.
    """
    one = one_int(datum)
    if one is None:
        raise SelectionError(f"datum={datum!r}: a trajectory follows one datum id (an int).")
    run.spec(param)
    steps = np.asarray(run.records(datum=one).column("step"), dtype=np.int64)
    return Trajectory(steps, grads(run, param, datum=one, as_torch=as_torch))
