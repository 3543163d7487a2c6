"""Pictures of a run: the range of gradient norms at each step with the outlying data named,
norm against loss, and a steps x data heatmap.

matplotlib is an optional dependency: ``pip install -e '.[plot]'``. Only the index is read
(exact norms and losses), never a gradient, so plotting any run is quick.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradlog.analysis.extras import require_extra
from gradlog.analysis.selection import params_of, summed_sqnorms
from gradlog.errors import InputError
from gradlog.store.reader import StoreReader

__all__ = ["NormRanges", "norm_ranges", "outliers", "plot_norms", "record_norms"]

_MAX_HEAT = (400, 300)  # (steps, data) at most in the heatmap; larger runs are subsampled
_MAX_DOTS = 20_000  # records drawn in the norm-against-loss panel; more are subsampled
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
"""The per-step quantiles drawn: a 5-95% band, a 25-75% band and the median."""


def record_norms(run: StoreReader, params: str | Sequence[str] | None = None) -> np.ndarray:
    """Per record (row order): the norm of its gradient over ``params`` (default: all)."""
    return np.asarray(np.sqrt(summed_sqnorms(run, run.datums, params_of(run, params))))


@dataclass(frozen=True)
class NormRanges:
    """Gradient norms summarised per step.

    Attributes:
        steps: The steps, ascending, shape ``(S,)``.
        quantiles: ``(S, len(QUANTILES))``: the norms' 5, 25, 50, 75 and 95% quantiles at each
            step (linear interpolation between a step's sorted norms, as ``np.quantile``).
        low: ``(S,)`` each step's smallest norm.
        high: ``(S,)`` each step's largest norm.
        counts: ``(S,)`` records per step.
    """

    steps: np.ndarray
    quantiles: np.ndarray
    low: np.ndarray
    high: np.ndarray
    counts: np.ndarray


def norm_ranges(steps: np.ndarray, norms: np.ndarray) -> NormRanges:
    """Quantiles of ``norms`` within each step (vectorised over steps: one sort in all).

    Args:
        steps: ``(N,)`` each record's step.
        norms: ``(N,)`` each record's norm.
    """
    uniq, inverse, counts = np.unique(steps, return_inverse=True, return_counts=True)
    order = np.lexsort((norms, inverse))  # by step, then norm
    ordered = norms[order]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    quantiles = np.empty((uniq.size, len(QUANTILES)))
    for j, q in enumerate(QUANTILES):
        pos = q * (counts - 1)  # as np.quantile's default "linear" method
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, counts - 1)
        frac = pos - lo
        quantiles[:, j] = ordered[starts + lo] * (1 - frac) + ordered[starts + hi] * frac
    return NormRanges(uniq, quantiles, ordered[starts], ordered[starts + counts - 1], counts)


def outliers(
    steps: np.ndarray, ids: np.ndarray, norms: np.ndarray, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` data whose gradient stood out most from its step's: ranked by their
    largest ratio ``norm / median norm of the step`` over the steps where they appear.

    Returns:
        ``(datum_ids, ratios)``, the most outlying first.
    """
    ranges = norm_ranges(steps, norms)
    median = ranges.quantiles[np.searchsorted(ranges.steps, steps), QUANTILES.index(0.5)]
    ratio = np.divide(norms, median, out=np.ones_like(norms), where=median > 0)
    uniq, inverse = np.unique(ids, return_inverse=True)
    best = np.full(uniq.size, -np.inf)
    np.maximum.at(best, inverse, ratio)
    top = np.argsort(-best, kind="stable")[: max(0, count)]
    return uniq[top], best[top]


_IMAGE_SUFFIXES = (".png", ".svg", ".pdf")


def plot_norms(
    run: StoreReader,
    out: str | os.PathLike[str] | None = None,
    *,
    params: str | Sequence[str] | None = None,
    datums: int | Sequence[int] = 5,
    width: int = 1200,
    height: int = 500,
    dpi: int = 100,
    log: bool = True,
) -> Any:
    """Draw a run's gradient norms in three panels.

    1. Per step: the median norm, the 25-75% and 5-95% bands of the step's records and its
       extremes, with the trajectories of the outlying data, each labelled with its id.
    2. Norm against loss, every record (coloured by step), the same data labelled, and the
       rank correlation of the two.
    3. A steps x data heatmap of the norms (blank where a datum was not at a step).

    Args:
        run: The run.
        out: Write the figure there (PNG, SVG, PDF by extension); None: only return it.
        params: Norm over these parameters (default: all recorded, jointly).
        datums: Datum ids to draw and label, or how many: the data whose norm stood out most
            from its step's median (:func:`outliers`).
        width: Figure width in pixels (at ``dpi``).
        height: Figure height in pixels.
        dpi: Dots per inch of the saved image.
        log: Logarithmic norm (and loss) axes and colour scale when the values span more
            than 20x.

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        InputError: the figure is smaller than 100x100 pixels, ``out`` does not end in
            .png, .svg or .pdf, or the run has no record.
        SelectionError: a datum id given is not in the run.
    """
    require_extra("matplotlib", "plot", "plotting")
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure

    if width < 100 or height < 100:
        raise InputError(f"the figure is {width}x{height} pixels; give at least 100x100.")
    suffix = "" if out is None else os.path.splitext(os.fspath(out))[1].lower()
    if out is not None and suffix not in _IMAGE_SUFFIXES:  # before any work, and explicit:
        raise InputError(  # matplotlib would add .png to a bare name, or raise on others
            f"out={os.fspath(out)!r}: name an image file ending in "
            f"{', '.join(_IMAGE_SUFFIXES)} (the extension picks the format)."
        )
    records = run.datums
    if records.num_rows == 0:
        raise InputError(f"nothing to plot: {run.path} has no committed record yet.")
    norms = record_norms(run, params)
    steps = records.column("step").to_numpy()
    ids = records.column("datum_id").to_numpy()
    losses = records.column("loss").to_numpy(zero_copy_only=False).astype(np.float64)
    label = "gradient norm" + (f" of {params}" if isinstance(params, str) else "")

    if isinstance(datums, int):
        chosen, _ = outliers(steps, ids, norms, datums)
    else:
        chosen = np.asarray(list(datums), dtype=np.int64)
        unknown = np.setdiff1d(chosen, ids)
        if unknown.size:
            run.records(datum=int(unknown[0]))  # raises SelectionError listing nearby ids
    positive = norms[norms > 0]
    log = bool(log and positive.size and positive.max() > 20 * positive.min())  # wide range

    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    ax_range, ax_loss, ax_heat = fig.subplots(1, 3, width_ratios=[1.25, 1, 1.1])
    colours = [f"C{i % 10}" for i in range(chosen.size)]
    _draw_ranges(ax_range, steps, ids, norms, chosen, colours, log=log, label=label)
    _draw_against_loss(ax_loss, steps, ids, norms, losses, chosen, colours, log=log,
                       label=label)
    _draw_heatmap(fig, ax_heat, steps, ids, norms, positive, log=log, label=label,
                  scales=(Normalize, LogNorm))
    if out is not None:
        fig.savefig(out, dpi=dpi)
    return fig


def _draw_ranges(
    ax: Any, steps: np.ndarray, ids: np.ndarray, norms: np.ndarray, chosen: np.ndarray,
    colours: list[str], *, log: bool, label: str,
) -> None:
    """Panel 1: each step's norm quantiles as bands, and the chosen data's trajectories."""
    r = norm_ranges(steps, norms)
    q = {v: r.quantiles[:, j] for j, v in enumerate(QUANTILES)}
    ax.fill_between(r.steps, r.low, r.high, color="0.93", step="mid", label="min-max")
    ax.fill_between(r.steps, q[0.05], q[0.95], color="0.82", step="mid", label="5-95%")
    ax.fill_between(r.steps, q[0.25], q[0.75], color="0.62", step="mid", label="25-75%")
    ax.plot(r.steps, q[0.5], color="black", linewidth=1.5, label="median")
    for d, colour in zip(chosen.tolist(), colours):
        mine = ids == d
        xs, ys = steps[mine], norms[mine]
        ax.plot(xs, ys, color=colour, marker="o", markersize=3, linewidth=0.8, alpha=0.9)
        at = int(np.argmax(ys))
        ax.annotate(f"#{d}", (xs[at], ys[at]), xytext=_offset(len(ax.texts)),
                    textcoords="offset points", color=colour, fontsize="small",
                    fontweight="bold")
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    if log:
        ax.set_yscale("log")
    per_step = int(np.median(r.counts))
    ax.set_title(f"norm per step (of {per_step} records a step)" + (
        f"\n#id: the {chosen.size} data furthest above their step's median"
        if chosen.size else ""), fontsize="medium")
    ax.legend(fontsize="x-small", loc="upper right", ncols=2)


def _draw_against_loss(
    ax: Any, steps: np.ndarray, ids: np.ndarray, norms: np.ndarray, losses: np.ndarray,
    chosen: np.ndarray, colours: list[str], *, log: bool, label: str,
) -> None:
    """Panel 2: every record's norm against its loss, coloured by step; the chosen data
    labelled; Spearman's rank correlation in the title."""
    finite = np.isfinite(losses)
    pick = np.flatnonzero(finite)
    if pick.size > _MAX_DOTS:  # a sample keeps the picture and the drawing time bounded
        pick = pick[np.unique(np.linspace(0, pick.size - 1, _MAX_DOTS).round().astype(int))]
    dots = ax.scatter(losses[pick], norms[pick], c=steps[pick], s=6, cmap="viridis",
                      alpha=0.6, linewidths=0)
    for d, colour in zip(chosen.tolist(), colours):
        mine = np.flatnonzero((ids == d) & finite)
        if not mine.size:
            continue
        ax.scatter(losses[mine], norms[mine], s=22, facecolors="none", edgecolors=colour,
                   linewidths=1.2)
        at = mine[int(np.argmax(norms[mine]))]
        ax.annotate(f"#{d}", (losses[at], norms[at]), xytext=_offset(len(ax.texts)),
                    textcoords="offset points", color=colour, fontsize="small",
                    fontweight="bold")
    rho = _spearman(losses[finite], norms[finite])
    ax.set_title("norm against loss" + (f"\n(rank correlation {rho:+.2f})"
                                        if rho is not None else ""), fontsize="medium")
    ax.set_xlabel("loss of the datum at the step")
    ax.set_ylabel(label)
    if log:
        ax.set_yscale("log")
    ax.figure.colorbar(dots, ax=ax, label="step", fraction=0.05)


def _offset(k: int) -> tuple[int, int]:
    """Where the k-th label goes from its point (points): alternately right and left, so
    labels of neighbouring points overlap less."""
    return (4, 3) if k % 2 == 0 else (-22, -10)


def _spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman's rank correlation (ties broken by position); None for fewer than 3 points or
    a constant variable."""
    if x.size < 3:
        return None
    rx = np.argsort(np.argsort(x)).astype(np.float64)
    ry = np.argsort(np.argsort(y)).astype(np.float64)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def _draw_heatmap(
    fig: Any, ax: Any, steps: np.ndarray, ids: np.ndarray, norms: np.ndarray,
    positive: np.ndarray, *, log: bool, label: str, scales: tuple[Any, Any],
) -> None:
    """Panel 3: steps (rows) x data (columns), blank where the datum was not at the step."""
    linear, logarithmic = scales
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
    scale: Any = linear()
    if log:
        scale = logarithmic(vmin=float(positive.min()), vmax=float(positive.max()))
    image = ax.imshow(
        np.ma.masked_invalid(heat),
        aspect="auto",
        interpolation="nearest",
        norm=scale,
        cmap="magma",
        origin="lower",
        extent=(-0.5, data_pick.size - 0.5, -0.5, step_pick.size - 0.5),
    )
    ax.set_facecolor("0.92")  # a datum absent from a step: light grey, not a colour
    ax.set_xlabel(
        "datum (by id" + (", subsampled)" if data_pick.size < data_values.size else ")")
    )
    ax.set_ylabel("step" + (" (subsampled)" if step_pick.size < step_values.size else ""))
    _ticks(ax.set_xticks, data_values[data_pick])
    _ticks(ax.set_yticks, step_values[step_pick])
    ax.set_title("norm: steps x data\n(grey: not in that step's batch)", fontsize="medium")
    fig.colorbar(image, ax=ax, label=label, fraction=0.05)


def _subsample(n: int, at_most: int) -> np.ndarray:
    if n <= at_most:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, at_most).round().astype(np.int64))


def _ticks(setter: Any, values: np.ndarray) -> None:
    if values.size == 0:
        return
    at = _subsample(values.size, 8)
    setter(at, [str(int(v)) for v in values[at]])
