"""Analysis of recorded runs: influence, similarity, parameter movement, statistics, export,
plots, gradients read back, and xarray/dask views. Every function takes a
:class:`gradlog.store.StoreReader` (a :class:`gradlog.Run` is one) first; ``Run``'s methods
are these functions.

Every scan streams the gradients a block of steps at a time within ``max_memory`` (default
256 MiB), accumulates in float64, and shows a tqdm progress bar with ``progress=True``: the
keywords of :class:`ScanArgs`, taken by every scan as ``**scan``.
"""

from gradlog.analysis.export import export, parquet_grads
from gradlog.analysis.frames import param_axes, to_dask, to_xarray
from gradlog.analysis.gradients import (
    Trajectory,
    form_tensors,
    grads,
    probe_grads,
    project,
    trajectory,
)
from gradlog.analysis.influence import influence, record_influence, self_influence
from gradlog.analysis.matrix import InfluenceMatrix, influence_matrix
from gradlog.analysis.movement import movers, record_movement
from gradlog.analysis.plot import plot_norms, record_norms
from gradlog.analysis.scan import DEFAULT_MAX_MEMORY, ScanArgs, ScanOptions
from gradlog.analysis.similarity import similarity
from gradlog.analysis.summary import stats

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "InfluenceMatrix",
    "ScanArgs",
    "ScanOptions",
    "Trajectory",
    "export",
    "form_tensors",
    "grads",
    "influence",
    "influence_matrix",
    "movers",
    "param_axes",
    "parquet_grads",
    "plot_norms",
    "probe_grads",
    "project",
    "record_influence",
    "record_movement",
    "record_norms",
    "self_influence",
    "similarity",
    "stats",
    "to_dask",
    "to_xarray",
    "trajectory",
]
