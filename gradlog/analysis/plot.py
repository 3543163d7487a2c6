"""Pictures of a run: per-datum gradient-norm trajectories and a steps x data heatmap.

matplotlib is an optional dependency: ``pip install 'gradlog[plot]'``. Only the exact norms of
the index are read, never a gradient, so plotting any run is quick.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from gradlog.analysis.extras import require_extra
from gradlog.analysis.selection import params_of, summed_sqnorms
from gradlog.errors import InputError
from gradlog.store.reader import StoreReader

__all__ = ["plot_norms", "record_norms"]

_MAX_HEAT = (400, 300)  # (steps, data) at most in the heatmap; larger runs are subsampled


def record_norms(run: StoreReader, params: str | Sequence[str] | None = None) -> np.ndarray:
    """Per record (row order): the norm of its gradient over ``params`` (default: all)."""
    return np.asarray(np.sqrt(summed_sqnorms(run, run.datums, params_of(run, params))))


def plot_norms(
    run: StoreReader,
    out: str | os.PathLike[str] | None = None,
    *,
    params: str | Sequence[str] | None = None,
    datums: int | Sequence[int] = 8,
    width: int = 1200,
    height: int = 500,
    dpi: int = 100,
    log: bool = True,
) -> Any:
    """Draw gradient-norm trajectories of some data and a steps x data heatmap of all.

    Args:
        run: The run.
        out: Write the figure there (PNG, SVG, PDF by extension); None: only return it.
        params: Norm over these parameters (default: all recorded, jointly).
        datums: Datum ids to draw trajectories of, or how many: the data seen at the most
            steps (ties: the largest mean norm).
        width: Figure width in pixels (at ``dpi``).
        height: Figure height in pixels.
        dpi: Dots per inch of the saved image.
        log: Logarithmic norm axis and colour scale when the norms span more than 20x.

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    require_extra("matplotlib", "plot", "plotting")
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure

    if width < 100 or height < 100:
        raise InputError(f"the figure is {width}x{height} pixels; give at least 100x100.")
    records = run.datums
    if records.num_rows == 0:
        raise InputError(f"nothing to plot: {run.path} has no committed record yet.")
    norms = record_norms(run, params)
    steps = records.column("step").to_numpy()
    ids = records.column("datum_id").to_numpy()
    label = "gradient norm" + (f" of {params}" if isinstance(params, str) else "")

    if isinstance(datums, int):
        uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        means = np.bincount(inverse, weights=norms, minlength=uniq.size) / np.maximum(counts, 1)
        chosen = uniq[np.lexsort((-means, -counts))[: max(0, datums)]]
    else:
        chosen = np.asarray(list(datums), dtype=np.int64)
        unknown = np.setdiff1d(chosen, ids)
        if unknown.size:
            run.records(datum=int(unknown[0]))  # raises SelectionError listing nearby ids

    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    ax_traj, ax_heat = fig.subplots(1, 2, width_ratios=[1, 1.2])
    for d in chosen:
        mine = ids == d
        ax_traj.plot(steps[mine], norms[mine], marker=".", linewidth=1, label=f"datum {d}")
    ax_traj.set_xlabel("step")
    ax_traj.set_ylabel(label)
    ax_traj.set_title("per-datum gradient norm over training")
    positive = norms[norms > 0]
    log = bool(log and positive.size and positive.max() > 20 * positive.min())  # wide range
    if log:
        ax_traj.set_yscale("log")
    if chosen.size:
        ax_traj.legend(fontsize="small", ncols=2 if chosen.size > 6 else 1)

    # heatmap: steps (rows) x data (columns), blank where the datum was not at the step
    step_values = np.unique(steps)
    data_values = np.unique(ids)
    step_pick = _subsample(step_values.size, _MAX_HEAT[0])
    data_pick = _subsample(data_values.size, _MAX_HEAT[1])
    heat = np.full((step_pick.size, data_pick.size), np.nan)
    si = np.searchsorted(step_values[step_pick], steps)
    di = np.searchsorted(data_values[data_pick], ids)
    keep = (si < step_pick.size) & (di < data_pick.size)
    keep &= step_values[step_pick][np.minimum(si, step_pick.size - 1)] == steps
    keep &= data_values[data_pick][np.minimum(di, data_pick.size - 1)] == ids
    heat[si[keep], di[keep]] = norms[keep]
    scale: Any = Normalize()
    if log:
        scale = LogNorm(vmin=float(positive.min()), vmax=float(positive.max()))
    image = ax_heat.imshow(
        np.ma.masked_invalid(heat),
        aspect="auto",
        interpolation="nearest",
        norm=scale,
        cmap="viridis",
        origin="lower",
        extent=(-0.5, data_pick.size - 0.5, -0.5, step_pick.size - 0.5),
    )
    ax_heat.set_xlabel(
        "datum (by id" + (", subsampled)" if data_pick.size < data_values.size else ")")
    )
    ax_heat.set_ylabel("step" + (" (subsampled)" if step_pick.size < step_values.size else ""))
    _ticks(ax_heat.set_xticks, data_values[data_pick])
    _ticks(ax_heat.set_yticks, step_values[step_pick])
    ax_heat.set_title("gradient norm: steps x data")
    fig.colorbar(image, ax=ax_heat, label=label)
    if out is not None:
        fig.savefig(out, dpi=dpi)
    return fig


def _subsample(n: int, at_most: int) -> np.ndarray:
    if n <= at_most:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, at_most).round().astype(np.int64))


def _ticks(setter: Any, values: np.ndarray) -> None:
    if values.size == 0:
        return
    at = _subsample(values.size, 8)
    setter(at, [str(int(v)) for v in values[at]])
