"""Analysis of recorded runs: influence, similarity, parameter movement, statistics, export,
plots, and xarray/dask views. ``Run`` methods delegate here; the functions take the run first.

Every scan streams the gradients a block of steps at a time within ``max_memory`` (default
256 MiB), accumulates in float64, and shows a tqdm progress bar with ``progress=True``.
"""

from gradlog.analysis.export import export
from gradlog.analysis.frames import MissingExtraError, to_dask, to_xarray
from gradlog.analysis.influence import influence, record_influence, self_influence
from gradlog.analysis.movement import movers, record_movement
from gradlog.analysis.plot import plot_norms, record_norms
from gradlog.analysis.scan import DEFAULT_MAX_MEMORY, MemoryTooSmallError
from gradlog.analysis.selection import MissingLearningRateError
from gradlog.analysis.similarity import similarity
from gradlog.analysis.summary import stats

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "MemoryTooSmallError",
    "MissingExtraError",
    "MissingLearningRateError",
    "export",
    "influence",
    "movers",
    "plot_norms",
    "record_influence",
    "record_movement",
    "record_norms",
    "self_influence",
    "similarity",
    "stats",
    "to_dask",
    "to_xarray",
]
