"""The space records are compared in, and the readers that bring them there.

A scan reads one parameter's records through an :class:`~gradlog.analysis.scan.ArrayReader`
made here (:func:`reader`). Read dense (``space=False``: exports, statistics), every form
comes back as ``(n, numel)`` gradients: ``full`` as stored, ``factors``/``rows``/``topk``
rebuilt (``topk``: its kept entries), ``projection`` its projected vectors. Read in form space
(``space=True``: similarity, influence, movers), ``factors``, ``rows`` and ``topk`` come back
as their stored arrays and are compared through the form's own inner products
(:meth:`gradlog.forms.Form.inner`, ``sqnorms``, ``inner_dense``: ``<G1^T A1, G2^T A2> =
sum((G1 G2^T) * (A1 A2^T))``), never rebuilt; ``full`` and ``projection`` records are vectors
either way. The arithmetic of both spaces is :class:`DenseOps` / :class:`FormOps`, shared by
the local scans and their Dask tasks, so both compute the same numbers. Two shortcuts keep
``factors`` cheaper than ``full`` (``tests/benchmarks/bench_query.py --forms-only``): records
compared with themselves are multiplied once, symmetrically, their norms taken from the
diagonal (:meth:`FormOps.gram`); a block's records meet the probe gradient of their own step
in one batched product (:meth:`FormOps.group_dots`), not one small product per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from gradlog.analysis.gradients import project
from gradlog.analysis.scan import ArrayReader
from gradlog.errors import SelectionError, StoreFormatError
from gradlog.store.reader import StoreReader

__all__ = [
    "FORMS",
    "DenseOps",
    "FormOps",
    "RecordOps",
    "block_moments",
    "ops_of",
    "probe_cost",
    "probe_read",
    "reader",
    "space_vector",
    "step_dots",
]

FORMS = ("full", "factors", "rows", "topk", "projection")
"""Forms the scans read: ``full``; ``factors``, ``rows`` and ``topk`` exact (``topk`` its
kept entries); ``projection`` in its projected space (estimates)."""

_IN_FORM_SPACE = ("factors", "rows", "topk")
"""Forms whose records keep a smaller stored shape than the gradient: compared as stored."""

_ESTIMATES = {
    "projection": "a random projection: inner products, norms and scores computed from it are "
    "unbiased estimates (Johnson-Lindenstrauss error ~ sqrt(2/dim) of the product of norms)",
    "topk": "its top-k entries: inner products and scores use those entries only",
}


class RecordOps(Protocol):
    """The arithmetic a scan does on blocks of records (:class:`DenseOps`,
    :class:`FormOps`): inner products and sums in float64."""

    def take(self, x: Any, a: int, b: int) -> Any: ...
    def inner(self, x: Any, y: Any) -> np.ndarray: ...
    def sqnorms(self, x: Any) -> np.ndarray: ...
    def gram(self, x: Any) -> tuple[np.ndarray, np.ndarray]: ...
    def dots(self, x: Any, q: np.ndarray) -> np.ndarray: ...
    def weighted_sum(self, coef: np.ndarray, x: Any) -> np.ndarray: ...


class DenseOps:
    """Arithmetic on blocks of records as ``(n, numel)`` arrays, accumulated in float64."""

    @staticmethod
    def take(x: np.ndarray, a: int, b: int) -> np.ndarray:
        """Records ``[a, b)`` of a block."""
        return x[a:b]

    @staticmethod
    def inner(x: np.ndarray, y: np.ndarray | None) -> np.ndarray:
        """``<x_i, y_j>`` ``(m, k)`` (``y`` None: ``x`` with itself)."""
        x64 = x.astype(np.float64)
        return np.asarray(x64 @ (x64 if y is None else y.astype(np.float64)).T)

    @staticmethod
    def sqnorms(x: np.ndarray) -> np.ndarray:
        """``||x_i||^2`` ``(m,)``."""
        x64 = x.astype(np.float64)
        return np.asarray(np.einsum("ij,ij->i", x64, x64))

    @staticmethod
    def gram(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(inner(x, None), sqnorms(x))``."""
        return DenseOps.inner(x, None), DenseOps.sqnorms(x)

    @staticmethod
    def dots(x: np.ndarray, q: np.ndarray) -> np.ndarray:
        """``<x_i, q>`` ``(m,)`` with one flat vector ``q``."""
        return np.asarray(np.einsum("ij,j->i", x, q, dtype=np.float64, casting="unsafe"))

    @staticmethod
    def weighted_sum(coef: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``sum_i coef_i x_i`` as a flat float64 vector."""
        return np.asarray(np.einsum("i,ij->j", coef, x, dtype=np.float64, casting="unsafe"))


class FormOps:
    """Arithmetic on blocks of records kept as a form's arrays (name -> torch tensor,
    records first), through the form's own inner products: nothing rebuilt to compare.

    Args:
        form: The parameter's :class:`gradlog.forms.Form`.
    """

    def __init__(self, form: Any) -> None:
        self.form = form

    @staticmethod
    def take(x: Mapping[str, Any], a: int, b: int) -> dict[str, Any]:
        """Records ``[a, b)`` of a block."""
        return {key: t[a:b] for key, t in x.items()}

    def inner(self, x: Mapping[str, Any], y: Mapping[str, Any] | None) -> np.ndarray:
        """``<x_i, y_j>`` ``(m, k)`` in float64 (``y`` None: ``x`` with itself)."""
        return np.asarray(self.form.inner(x, x if y is None else y).numpy())

    def sqnorms(self, x: Mapping[str, Any]) -> np.ndarray:
        """``||x_i||^2`` ``(m,)`` in float64."""
        return np.asarray(self.form.sqnorms(x).numpy())

    def gram(self, x: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """``(inner(x, None), sqnorms(x))``: the norms are the inner products' diagonal,
        so the records are compared once (symmetric: half the blocks, the rest mirrored)."""
        gram = self.inner(x, None)  # (m, m)
        return gram, np.diagonal(gram).copy()

    def dots(self, x: Mapping[str, Any], q: np.ndarray) -> np.ndarray:
        """``<x_i, q>`` ``(m,)`` with one flat gradient ``q`` (the form's ``inner_dense``)."""
        import torch

        other = torch.from_numpy(np.ascontiguousarray(q, dtype=np.float64))  # (numel,)
        return np.asarray(self.form.inner_dense(x, other.reshape(self.form.shape)).numpy()[:, 0])

    def group_dots(
        self, x: Mapping[str, Any], counts: list[int], probe: np.ndarray
    ) -> np.ndarray | None:
        """``<x_i, probe_k>`` ``(m,)`` for records in consecutive groups, the ``k``-th of
        ``counts[k]`` records paired with ``probe[k]``, in one pass where the form has one
        (``factors``: :func:`~gradlog.grads.inner.factored_group_dots`); None otherwise."""
        if self.form.name != "factors":
            return None
        import torch  # analysis loads torch (through the forms) only when it computes

        from gradlog.grads.inner import factored_group_dots

        arrays = self.form.tensors(x)
        others = torch.from_numpy(np.ascontiguousarray(probe)).reshape(-1, *self.form.shape)
        return np.asarray(factored_group_dots(arrays["g"], arrays["a"], others, counts).numpy())

    def weighted_sum(self, coef: np.ndarray, x: Mapping[str, Any]) -> np.ndarray:
        """``sum_i coef_i g_i`` as a flat float64 vector (the sum is a gradient: it is
        formed, once per block)."""
        dense = self.form.decode(x).reshape(len(coef), -1).numpy()  # (m, numel)
        return DenseOps.weighted_sum(coef, dense)


def space_vector(run: StoreReader, param: str, grad: Any) -> Any:
    """A gradient the user gives for ``param`` in the space its records are compared in:
    projected for a ``projection`` parameter, as given otherwise."""
    if run.form_name(param) != "projection":
        return grad
    if hasattr(grad, "detach"):  # torch, without importing it here
        grad = grad.detach().cpu().numpy()
    arr = np.asarray(grad)
    return project(run, param, arr if arr.dtype.kind == "f" else arr.astype(np.float32))


def reader(
    run: StoreReader, param: str, *, probes: bool = False, space: bool = False
) -> ArrayReader:
    """A reader of ``param``'s records (or of its probe records), opened on first read.

    Values come back float32 (float64 for float64 storage), lossy storage dtypes widened.
    With ``space``, ``factors``, ``rows`` and ``topk`` records come back as their form's
    arrays (module doc); probes are stored full and always read dense.

    Raises:
        SelectionError: ``param`` keeps no gradients (form ``norm``).
        StoreFormatError: its form is one this gradlog's analysis does not read.
    """
    form = run.form_name(param)
    if form == "norm":
        raise SelectionError(  # params= selections are refused earlier, by params_of
            f"parameter {param!r} was recorded with form 'norm': only each record's exact norm "
            "is kept (read it with run.norms(param)), so it has no gradients to read. Choose a "
            "parameter recorded with another form."
        )
    if form not in FORMS:
        raise StoreFormatError(
            f"parameter {param!r} is stored in form {form!r}, which this gradlog's analysis "
            f"does not read (it reads {', '.join(FORMS)}). Upgrade gradlog."
        )
    out = run.value_dtype(param)
    itemsize = run.stored_itemsize(param)
    shape = run.spec(param)["shape"]
    if probes:  # probes are stored full; a projected parameter's are projected alike

        def read_probes(rows: np.ndarray) -> np.ndarray:
            full = run.read_probe_rows(param, rows, out)
            return np.asarray(space_vector(run, param, full), dtype=out)

        return ArrayReader(
            read_probes,
            run.form(param).out_shape if form == "projection" else shape,
            out,
            stored_itemsize=itemsize,
            chunk_rows=lambda: run.probe_array(param).chunk_rows,
            sharded=False,
            direct=lambda: run.probe_array(param).plain and form == "full",
        )
    if form == "full":
        return ArrayReader(
            lambda rows: run.read_array(param, rows, out),
            shape,
            out,
            stored_itemsize=itemsize,
            chunk_rows=lambda: run.chunk_rows(param),
            sharded=run.sharded,
            direct=lambda: run.scatters(param),
        )
    if form in _ESTIMATES and run.first_notice("estimate", param):
        import warnings

        warnings.warn(
            f"parameter {param!r} was recorded as {_ESTIMATES[form]}; exact norms stay in "
            "run.norms().",
            UserWarning,
            stacklevel=2,  # the analysis that reads it
        )
    return _form_reader(run, param, out, itemsize, space)


def _form_reader(
    run: StoreReader, param: str, out: Any, itemsize: int, space: bool
) -> ArrayReader:
    """Records of a parameter kept in another form than ``full``: a projection's vectors;
    the stored arrays of factors, rows and top-k (``space``) or their rebuilt gradients.
    Planned as rebuilt rows either way, so blocks are the same in both spaces."""
    import torch

    form = run.form(param)
    in_space = space and form.name in _IN_FORM_SPACE

    def read(rows: np.ndarray) -> Any:
        arrays = {k: torch.from_numpy(v) for k, v in run.read_arrays(param, rows).items()}
        if in_space:
            return arrays
        data = arrays["proj"] if form.name == "projection" else form.decode(arrays)
        return np.asarray(data.numpy(), dtype=out)

    shape = form.out_shape if form.name == "projection" else form.shape
    stored = max(1, form.nbytes_per_record(itemsize))
    return ArrayReader(
        read,
        shape,
        out,
        stored_itemsize=max(1, stored // max(1, int(np.prod(shape, dtype=np.int64)))),
        chunk_rows=lambda: run.chunk_rows(param),
        sharded=True,
        ops=FormOps(form) if in_space else None,
    )


def ops_of(r: ArrayReader) -> RecordOps:
    """The arithmetic on ``r``'s blocks."""
    return r.ops if r.ops is not None else DenseOps()


def step_dots(
    ops: RecordOps, data: Any, steps: np.ndarray, probe: np.ndarray
) -> np.ndarray:
    """``<g_r, g_t(probe)>`` for a block's records: ``steps`` their steps (ascending),
    ``probe`` one probe row per run of equal steps, in order."""
    out = np.zeros(steps.size, dtype=np.float64)
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(steps)) + 1, [steps.size]])
    if isinstance(ops, FormOps):  # all runs at once where the form can
        grouped = ops.group_dots(data, np.diff(cuts).tolist(), probe[: cuts.size - 1])
        if grouped is not None:
            return grouped
    for k in range(cuts.size - 1):  # runs of equal steps: the k-th uses the k-th probe row
        a, b = int(cuts[k]), int(cuts[k + 1])
        out[a:b] = ops.dots(ops.take(data, a, b), probe[k])
    return out


def block_moments(data: np.ndarray) -> tuple[int, float, float, float, float]:
    """A dense block's (count, mean, sum of squared deviations, min, max), in float64."""
    x = data.astype(np.float64)
    n = int(x.size)
    if n == 0:
        return 0, 0.0, 0.0, float(np.inf), float(-np.inf)
    bmean = float(x.mean())
    x -= bmean
    return n, bmean, float(np.einsum("ij,ij->", x, x)), float(data.min()), float(data.max())


def probe_cost(probes: ArrayReader, at: np.ndarray) -> Callable[[int, int], int]:
    """Bytes of the probe rows a block of positions ``[i0, i1)`` reads beside it."""

    def cost(i0: int, i1: int) -> int:
        return int(probes.read_cost(np.unique(at[i0:i1])))

    return cost


def probe_read(probes: ArrayReader, at: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """The probe rows of a block of positions ``[i0, i1)``, one per step."""

    def read(i0: int, i1: int) -> np.ndarray:
        return np.asarray(probes.read(np.unique(at[i0:i1])))

    return read
