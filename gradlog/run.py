"""The user-facing run: ``gradlog.open(path) -> Run``.

A :class:`Run` is a :class:`~gradlog.store.StoreReader` (metadata, records, norms, probes,
forms, stored arrays) whose other methods are the functions of :mod:`gradlog.analysis`,
each stated once there: ``run.influence(probe, top=10)`` is
``gradlog.analysis.influence(run, probe, top=10)``. Scans take the keywords of
:class:`gradlog.analysis.ScanArgs` (``max_memory``, ``progress``, ``scheduler``).
"""

from __future__ import annotations

from gradlog import analysis
from gradlog.store.reader import StoreReader

__all__ = ["Run"]


class Run(StoreReader):
    """A recorded run, opened for reading (see :func:`gradlog.open` for the errors raised).

    Attributes:
        path: The store's directory.
        attrs: The root attributes (format, versions, config, parameter specs).
    """

    # -- gradients (gradlog.analysis.gradients) ---------------------------------------------
    grads = analysis.grads
    probe_grads = analysis.probe_grads
    trajectory = analysis.trajectory
    project = analysis.project
    read_form_arrays = analysis.form_tensors

    # -- analyses ---------------------------------------------------------------------------
    similarity = analysis.similarity
    influence = analysis.influence
    influence_matrix = analysis.influence_matrix
    self_influence = analysis.self_influence
    movers = analysis.movers
    stats = analysis.stats
    export = analysis.export
    plot = analysis.plot_norms
    to_xarray = analysis.to_xarray
    to_dask = analysis.to_dask
