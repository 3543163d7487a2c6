"""Many probes at once: the (training data x probes) influence matrix in one pass (#19).

:func:`influence_matrix` scores every training datum against a batch of probes, reading
each training record once: a block of steps is read (within ``max_memory``, as every scan),
the probes' gradients at those steps are read beside it (times the optimizer's factor for
``kind="optimizer"``, projected for ``projection`` parameters), and one matrix product per
step gives the block's records x probes scores, summed into one row per datum. Memory: the
scan's blocks within ``max_memory`` plus the result, ``datums x probes`` float64.

Scores are those of :func:`gradlog.analysis.influence` (same kinds, sign and scale); the
products are computed in the stored dtype (float32 for ``float32`` stores: about 1e-7
relative of the product of the norms) and summed over steps and parameters in float64;
``float64`` stores give float64 products. The products are ``torch.mm``: numpy's OpenBLAS
threads, beside the scan's read-ahead threads on a busy machine, measured 4-6x slower.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from gradlog.analysis.optimizer import (
    OptimizerView,
    check_kind,
    param_coefficients,
    probe_reader,
    probe_sqnorms,
)
from gradlog.analysis.scan import ArrayReader, ScanArgs, ScanOptions, blocks, least_budget
from gradlog.analysis.selection import check_finite, params_of, summed_sqnorms
from gradlog.analysis.space import FormOps, ops_of, reader
from gradlog.errors import InputError
from gradlog.store.reader import StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["InfluenceMatrix", "influence_matrix"]


@dataclass(frozen=True)
class InfluenceMatrix:
    """Influence of every training datum on each probe.

    Attributes:
        datum_ids: ``(n,)`` training datum ids, ascending.
        probe_ids: ``(P,)`` the probes, in the order asked for (``0 .. P-1`` for gradients
            given as arrays).
        scores: ``(n, P)`` float64: ``scores[i, j]`` is datum ``datum_ids[i]``'s influence
            on probe ``probe_ids[j]`` (positive: a proponent).
        kind: The score kind (``"tracin"``, ``"optimizer"``, ``"cosine"``).
    """

    datum_ids: np.ndarray
    probe_ids: np.ndarray
    scores: np.ndarray
    kind: str

    def to_table(self) -> Any:
        """A pyarrow table: ``datum_id`` and one float64 column ``probe_<id>`` per probe;
        schema metadata ``score_kind``."""
        import pyarrow as pa

        columns = {"datum_id": pa.array(self.datum_ids, pa.int64())}
        for j, p in enumerate(self.probe_ids.tolist()):
            columns[f"probe_{p}"] = pa.array(self.scores[:, j], pa.float64())
        return pa.table(columns).replace_schema_metadata({"score_kind": self.kind})


def influence_matrix(
    run: StoreReader,
    probes: int | Sequence[int] | Mapping[str, Any] | None = None,
    *,
    kind: str | None = None,
    params: str | Sequence[str] | None = None,
    weighted: bool = False,
    lr: float | None = None,
    **scan: Unpack[ScanArgs],
) -> InfluenceMatrix:
    """Influence of every training datum on many probes, in one pass over the store.

    Args:
        run: The run.
        probes: Recorded probe ids (None: every recorded probe), or ``{param: array}`` with
            ``P`` gradients per parameter (``(P, *shape)``, numpy or torch) you computed,
            used unchanged at every recorded step.
        kind: ``"tracin"``, ``"optimizer"`` or ``"cosine"``; None: as
            :func:`gradlog.analysis.influence` chooses (module
            :mod:`gradlog.analysis.optimizer`).
        params: Parameters to sum over (default: every parameter that keeps gradients, or
            the dict's keys).
        weighted: Multiply by each record's weight ``w_b``.
        lr: A learning rate replacing every recorded one.
        **scan: ``max_memory``, ``progress`` (:class:`ScanArgs`); this scan runs locally.

    Returns:
        :class:`InfluenceMatrix`. A datum with no record at a step where a probe has a
        gradient scores 0 for it.

    Raises:
        SelectionError: an unknown probe or parameter.
        InputError: bad probe arrays; ``kind="optimizer"`` without recorded state.
    """
    import pyarrow.compute as pc

    kind = check_kind(run, kind)
    opts = ScanOptions(**scan).local_only("influence_matrix")
    fixed: dict[str, np.ndarray] | None = None
    if isinstance(probes, Mapping):
        names = params_of(run, list(probes) if params is None else params, gradients=True)
        fixed = _fixed_probes(run, probes, names)
        n_probes = next(iter(fixed.values())).shape[0]
        probe_ids = np.arange(n_probes, dtype=np.int64)
        records = run.datums
        precs = None
    else:
        if isinstance(probes, (int, np.integer)) and not isinstance(probes, bool):
            probes = [int(probes)]
        elif probes is not None and (isinstance(probes, (str, bool))
                                     or not hasattr(probes, "__iter__")):
            raise InputError(f"probes={probes!r}: pass recorded probe ids (a list), None for "
                             "every probe, or a dict {param: (P, *shape) gradients}.")
        names = params_of(run, params, gradients=True)
        precs = run.probe_records(probe=None if probes is None else list(probes))
        probe_ids = (np.asarray(run.probe_ids, dtype=np.int64) if probes is None
                     else np.asarray(list(probes), dtype=np.int64))
        if probe_ids.size == 0:
            raise InputError(f"{run.path} has no probes: pass probe gradients as a dict."
                             if probes is None else
                             f"probes={probes!r} selects no probe: pass recorded probe ids "
                             f"({list(run.probe_ids)[:20]}), or None for every probe.")
        uniq, counts = np.unique(probe_ids, return_counts=True)
        if (counts > 1).any():  # a probe's rows fill one column: a repeat would stay zero
            raise InputError(
                f"probes={list(probes or [])!r} names probe(s) {uniq[counts > 1].tolist()} more "
                "than once; each probe is one column of the matrix: pass each id once."
            )
        records = run.datums.filter(
            pc.is_in(run.datums.column("step"), value_set=precs.column("step"))
        )
    rows = records.column("row").to_numpy()
    steps = records.column("step").to_numpy()
    datum_ids, inverse = np.unique(records.column("datum_id").to_numpy(), return_inverse=True)
    out = np.zeros((datum_ids.size, probe_ids.size), dtype=np.float64)
    if rows.size == 0:
        return InfluenceMatrix(datum_ids, probe_ids, out, kind)
    per_param = None
    if kind == "optimizer":
        coef = (records.column("weight").to_numpy().astype(np.float64) if weighted
                else np.ones(rows.size))
    else:
        coef, per_param = param_coefficients(run, records, names, lr=lr, weighted=weighted,
                                             what="influence_matrix")
    ustep = np.unique(steps)
    at_step = np.searchsorted(ustep, steps)  # record -> its step's index
    slots = _probe_slots(precs, ustep, probe_ids)  # (steps, P): probe store row or -1
    view = OptimizerView(run, steps, lr) if kind == "optimizer" else None
    norm_scale = _cosine_scale(run, names, records, precs, ustep, probe_ids, fixed) \
        if kind == "cosine" else None

    readers = {n: reader(run, n, space=True) for n in names}
    sources = {n: _ProbeSource(run, n, slots, ustep, fixed, view, precs) for n in names}
    per_row = 8 * probe_ids.size * 2  # a block's products and their scaled copy
    opts.require("influence_matrix", [
        (n, r, least_budget(r, rows, per_row_bytes=per_row, extra_cost=sources[n].cost(at_step)))
        for n, r in readers.items()
    ])
    total = sum(rows.size * r.row_bytes for r in readers.values())

    # Dense parameters are read together, a block of steps of every one at a time: one
    # read-ahead pipeline for all (scanned one after another, each small parameter's only
    # read waited alone). Form arrays (``space``) keep a scan each.
    dense = [n for n in names if readers[n].ops is None]
    together = len(dense) > 1 and least_budget(  # (one row of each fits the budget)
        cast(ArrayReader, _Readers({n: readers[n] for n in dense})), rows,
        per_row_bytes=per_row,
        extra_cost=_Sources({n: sources[n] for n in dense}).cost(at_step)) <= opts.budget
    groups = ([dense] + [[n] for n in names if n not in dense] if together
              else [[n] for n in names])
    with opts.bar(total, "influence_matrix") as bar, _one_core_for_reads():
        for group in groups:
            if len(group) == 1:
                train, source = readers[group[0]], sources[group[0]]
            else:
                train = cast(ArrayReader, _Readers({n: readers[n] for n in group}))
                source = cast(_ProbeSource, _Sources({n: sources[n] for n in group}))
            for blk in blocks(train, rows, budget=opts.budget, keys=steps,
                              per_row_bytes=per_row, extra_cost=source.cost(at_step),
                              extra_read=source.read(at_step), on_read=bar.update,
                              what=", ".join(group)):
                assert blk.extra is not None  # extra_read gave it
                pos = np.arange(blk.positions.start, blk.positions.stop)
                local = at_step[pos]
                cuts = np.concatenate([[0], np.flatnonzero(np.diff(local)) + 1, [pos.size]])
                for name in group:
                    own = coef if per_param is None else per_param[name]
                    ops = ops_of(readers[name])
                    data = blk.data[name] if len(group) > 1 else blk.data
                    extra = cast(Any, blk.extra)[name] if len(group) > 1 else blk.extra
                    for k in range(cuts.size - 1):
                        a, b = int(cuts[k]), int(cuts[k + 1])
                        prod = _products(ops, ops.take(data, a, b), extra[k])  # (m, P)
                        prod *= own[pos[a:b], None]
                        if norm_scale is not None:
                            prod *= norm_scale(pos[a:b], int(local[a]))
                        np.add.at(out, inverse[pos[a:b]], prod)
    return InfluenceMatrix(datum_ids, probe_ids, out, kind)


class _Readers:
    """Several parameters' readers as one: a read returns each one's rows by name, and
    costs what their reads cost together (:func:`~gradlog.analysis.scan.blocks` needs only
    these)."""

    def __init__(self, parts: Mapping[str, ArrayReader]) -> None:
        self.parts = parts
        self.row_bytes = sum(r.row_bytes for r in parts.values())
        self.chunk_rows = max(r.chunk_rows for r in parts.values())

    def read_cost(self, rows: np.ndarray) -> int:
        return sum(int(r.read_cost(rows)) for r in self.parts.values())

    def read(self, rows: np.ndarray) -> dict[str, Any]:
        return {n: r.read(rows) for n, r in self.parts.items()}


class _Sources:
    """Several parameters' probe sources as one (their blocks by name)."""

    def __init__(self, parts: Mapping[str, _ProbeSource]) -> None:
        self.parts = parts

    def cost(self, at_step: np.ndarray) -> Any:
        costs = [s.cost(at_step) for s in self.parts.values()]
        return lambda i0, i1: sum(c(i0, i1) for c in costs)

    def read(self, at_step: np.ndarray) -> Any:
        reads = {n: s.read(at_step) for n, s in self.parts.items()}
        return lambda i0, i1: {n: r(i0, i1) for n, r in reads.items()}


@contextlib.contextmanager
def _one_core_for_reads() -> Iterator[None]:
    """torch's intra-op threads one fewer during the scan (restored after): the read-ahead
    threads read and decode on the core left. Measured on 2 shared cores: products 2x faster
    with 1 thread than with 2 competing with the reads."""
    import torch

    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _products(ops: Any, x: Any, q: np.ndarray) -> np.ndarray:
    """``<x_i, q_j>`` ``(m, P)`` in float64: a form's inner products, or one BLAS product
    in the stored dtype."""
    if isinstance(ops, FormOps):
        form = ops.form
        return np.asarray(form.inner_dense(x, q.reshape(q.shape[0], *form.shape)).numpy())
    import torch  # its matmul: numpy's OpenBLAS threads collapse beside the read-ahead threads

    def tensor(a: np.ndarray) -> Any:  # read-only views (a broadcast probe block) are copied
        a = np.ascontiguousarray(a, dtype=x.dtype)
        return torch.from_numpy(a if a.flags.writeable else a.copy())

    tx, tq = tensor(x), tensor(q)
    return np.asarray(torch.mm(tx, tq.T).numpy(), dtype=np.float64)


def _fixed_probes(
    run: StoreReader, probes: Mapping[str, Any], names: Sequence[str]
) -> dict[str, np.ndarray]:
    """The given gradients as float64 ``(P, numel)`` per parameter, checked."""
    missing = [n for n in names if n not in probes]
    if missing:
        raise InputError(f"the probe gradients have no entry for {missing}; give one array "
                         f"(P, *shape) per parameter (keys: {list(probes)}).")
    fixed, counts = {}, set()
    for n in names:
        value = probes[n]
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        arr = np.asarray(value, dtype=np.float64)
        shape = tuple(run.spec(n)["shape"])
        if arr.ndim != len(shape) + 1 or tuple(arr.shape[1:]) != shape:
            raise InputError(f"the probe gradients of {n!r} have shape {tuple(arr.shape)}; "
                             f"expected (P, {', '.join(map(str, shape))}): one per probe.")
        fixed[n] = check_finite(arr.reshape(arr.shape[0], -1), n, "probe gradient array")
        counts.add(arr.shape[0])
    if len(counts) != 1:
        raise InputError(f"the probe gradients give different numbers of probes per parameter "
                         f"({sorted(counts)}); give the same P for each.")
    return fixed


def _probe_slots(precs: Any, ustep: np.ndarray, probe_ids: np.ndarray) -> np.ndarray | None:
    """``(steps, P)``: each probe's store row at each step, -1 where it has none."""
    if precs is None:
        return None
    slots = np.full((ustep.size, probe_ids.size), -1, dtype=np.int64)
    i = np.searchsorted(ustep, precs.column("step").to_numpy())
    j = np.searchsorted(np.sort(probe_ids), precs.column("probe_id").to_numpy())
    order = np.argsort(probe_ids)
    ok = i < ustep.size
    slots[i[ok], order[j[ok]]] = precs.column("row").to_numpy()[ok]
    return slots


class _ProbeSource:
    """The probes' gradients at a block's steps, in the parameter's comparison space:
    ``(block steps, P, numel)``, zeros where a probe has no record."""

    def __init__(
        self,
        run: StoreReader,
        name: str,
        slots: np.ndarray | None,
        ustep: np.ndarray,
        fixed: Mapping[str, np.ndarray] | None,
        view: OptimizerView | None,
        precs: Any,
    ) -> None:
        self.slots, self.ustep = slots, ustep
        self._widened = run.form_name(name) != "full"  # (projected from float64 rows)
        self._lock = threading.Lock()
        self._last: tuple[tuple[int, ...], Future[np.ndarray]] | None = None
        out = run.value_dtype(name)
        if fixed is not None:  # the same P gradients at every step (times its factor)
            q = fixed[name]
            self.n_probes = q.shape[0]
            plain = probe_reader(run, name, lambda ids: q[ids], lambda i: 0, None, out)
            self._const = None if view is not None else plain.read(np.arange(q.shape[0]))
            self._reader: ArrayReader = probe_reader(
                run, name, lambda ids: q[ids % q.shape[0]],
                lambda i: int(ustep[i // q.shape[0]]), view, out)
        else:
            assert slots is not None and precs is not None
            self.n_probes = slots.shape[1]
            self._const = None
            if view is None:
                self._reader = reader(run, name, probes=True)
            else:
                step_of = dict(zip(precs.column("row").to_numpy().tolist(),
                                   precs.column("step").to_numpy().tolist()))
                self._reader = probe_reader(
                    run, name, lambda ids: run.read_probe_rows(name, ids, out),
                    step_of.__getitem__, view, out)

    def _ids(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows to read for step indices ``u`` and where each lands in ``(u, P)``."""
        if self.slots is None:  # virtual rows: step index * P + probe
            grid = u[:, None] * self.n_probes + np.arange(self.n_probes)[None, :]
        else:
            grid = self.slots[u]
        return grid.reshape(-1), grid.reshape(-1) >= 0

    def cost(self, at_step: np.ndarray) -> Any:
        def cost(i0: int, i1: int) -> int:
            u = np.unique(at_step[i0:i1])
            if self._const is not None:
                return int(self._const.nbytes)
            ids, ok = self._ids(u)
            rows = np.unique(ids[ok])
            # the rows; their float64 form before a projection; the arranged block unless
            # every probe has its row in order
            in_order = bool(ok.all()) and rows.size == ids.size and np.array_equal(rows, ids)
            return int(self._reader.read_cost(rows)
                       + (2 * rows.size * self._reader.row_bytes if self._widened else 0)
                       + (0 if in_order else u.size * self.n_probes * self._reader.row_bytes))
        return cost

    def read(self, at_step: np.ndarray) -> Any:
        def read(i0: int, i1: int) -> np.ndarray:
            u = np.unique(at_step[i0:i1])
            if self._const is not None:
                return np.broadcast_to(self._const, (u.size, *self._const.shape))
            # A step over the budget is scanned in several blocks of its records: they share
            # its probe rows, read once (the read-ahead threads ask for them together).
            key = tuple(u.tolist())
            with self._lock:
                mine = self._last is None or self._last[0] != key
                if mine:
                    self._last = (key, Future())
                assert self._last is not None
                pending = self._last[1]
            if mine:
                try:
                    pending.set_result(self._arranged(u))
                except BaseException as exc:
                    pending.set_exception(exc)
            return pending.result()
        return read

    def _arranged(self, u: np.ndarray) -> np.ndarray:
        """The probe rows of step indices ``u``, as ``(u, P, numel)``."""
        ids, ok = self._ids(u)
        rows, where = np.unique(ids[ok], return_inverse=True)
        data = self._reader.read(rows)  # (rows, numel)
        if ok.all() and rows.size == ids.size and np.array_equal(rows, ids):
            # every probe at every step, stored in order (the usual case): no copies
            whole: np.ndarray = data.reshape(u.size, self.n_probes, data.shape[1])
            return whole
        arranged = np.zeros((ids.size, data.shape[1]), dtype=data.dtype)
        arranged[ok] = data[where]
        return arranged.reshape(u.size, self.n_probes, data.shape[1])


def _cosine_scale(
    run: StoreReader,
    names: Sequence[str],
    records: Any,
    precs: Any,
    ustep: np.ndarray,
    probe_ids: np.ndarray,
    fixed: Mapping[str, np.ndarray] | None,
) -> Any:
    """``scale(positions, step index) -> (m, P)``: ``1 / (||g_d|| ||g_t(z)||)`` over
    ``names`` (0 where a norm is zero), from the index's exact norms."""
    rec = np.sqrt(summed_sqnorms(run, records, names))
    if fixed is not None:
        sq = sum(np.einsum("pi,pi->p", q, q) for q in fixed.values())
        probe = np.broadcast_to(np.sqrt(sq), (ustep.size, probe_ids.size))
    else:
        probe = np.zeros((ustep.size, probe_ids.size))
        norms = np.sqrt(probe_sqnorms(run, precs, names))
        i = np.searchsorted(ustep, precs.column("step").to_numpy())
        j = np.searchsorted(np.sort(probe_ids), precs.column("probe_id").to_numpy())
        probe[i, np.argsort(probe_ids)[j]] = norms

    def scale(pos: np.ndarray, k: int) -> np.ndarray:
        denom = np.outer(rec[pos], probe[k])
        return np.divide(1.0, denom, out=np.zeros_like(denom), where=denom > 0)

    return scale
