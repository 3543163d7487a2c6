"""Commands that compute over a run's gradients: ``influence``, ``export``, ``plot``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gradlog.cli._args import (
    DatumOpt,
    JsonOpt,
    MemoryOpt,
    ParamsOpt,
    RunArg,
    StepOpt,
    open_run,
    scan_args,
    selector,
    with_gradients,
)
from gradlog.cli._render import console, echo_json, human_bytes, num, table
from gradlog.errors import InputError

_SIDES = (("proponent", "proponents (training on them lowered the probe's loss)"),
          ("opponent", "opponents (training on them raised the probe's loss)"))
"""Influence's two tables for a probe: each row's ``kind``, and the table's title."""


def influence(
    run_path: RunArg,
    probe: Annotated[int | None, typer.Option(help="Id of a probe recorded with the run.")] = None,
    self_: Annotated[
        bool, typer.Option("--self", help="Rank data by self-influence instead.")
    ] = False,
    top: Annotated[int, typer.Option(min=1, help="Proponents and opponents to list.")] = 10,
    params: ParamsOpt = None,
    weighted: Annotated[
        bool, typer.Option(help="Include each record's weight w_b (first-order loss change).")
    ] = False,
    lr: Annotated[
        float | None, typer.Option(help="Use this learning rate instead of the recorded ones.")
    ] = None,
    max_memory: MemoryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """TracIn over the recorded steps: the training data that most helped (proponents) and
    hurt (opponents) a probe; score = sum_t lr_t <g_t(datum), g_t(probe)>."""
    run = open_run(run_path)
    if self_ == (probe is not None):
        ids = run.probe_ids
        known = (f"recorded probes: {', '.join(map(str, ids[:20]))}" if ids
                 else "this run has no probes")
        raise InputError(f"pass exactly one of --probe ID ({known}) or --self.")
    if probe is None:
        found = run.self_influence(top=top, params=params, weighted=weighted, lr=lr)
    else:
        found = run.influence(probe, top=top, params=with_gradients(run, params),
                              weighted=weighted, lr=lr, **scan_args(max_memory))
    rows = found.to_pylist()
    if as_json:
        echo_json({"probe": probe, "self": self_, "weighted": weighted, "rows": rows})
        return
    if probe is None:
        title = f"self-influence sum_t lr_t{' w' if weighted else ''} ||g_t||^2"
        _print_ranking(title, [{**r, "rank": i} for i, r in enumerate(rows, 1)])
        return
    for kind, title in _SIDES:
        _print_ranking(f"probe {probe}: {title}", [r for r in rows if r["kind"] == kind])


def _print_ranking(title: str, rows: list[dict[str, Any]]) -> None:
    """One table of ranked data: rank, datum, score, steps."""
    view = table(title, ("rank", "datum", "score", "steps"))
    for r in rows:
        view.add_row(str(r["rank"]), str(r["datum_id"]), num(r["score"], 6), str(r["n_steps"]))
    console.print(view)


def export(
    run_path: RunArg,
    out: Annotated[Path, typer.Option(help="File to write (.parquet or .npz).")],
    format: Annotated[
        str | None, typer.Option(help="parquet or npz (default: from --out's extension).")
    ] = None,
    params: ParamsOpt = None,
    step: StepOpt = None,
    datum: DatumOpt = None,
    max_memory: MemoryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export records and their gradients to one parquet or npz file."""
    from gradlog.analysis.export import FORMATS

    suffix = out.suffix.lstrip(".").lower()
    if format in FORMATS and suffix in FORMATS and format != suffix:
        # the library would write what --format says under a name that says otherwise
        raise InputError(
            f"--format {format} contradicts --out {out} (a .{suffix} name): drop --format, "
            f"or name the file .{format}."
        )
    run = open_run(run_path)
    names = with_gradients(run, params)
    summary = run.export(out, format=format, params=names, step=selector(step, "step"),
                         datum=selector(datum, "datum"), **scan_args(max_memory))
    if as_json:
        echo_json(summary)
        return
    console.print(f"wrote {summary['records']} records x {len(summary['params'])} parameters "
                  f"to {summary['path']} ({summary['format']}, {human_bytes(summary['bytes'])})")


def plot(
    run_path: RunArg,
    out: Annotated[Path, typer.Option(help="Image to write (.png, .svg, .pdf).")],
    params: ParamsOpt = None,
    datums: Annotated[int, typer.Option(min=1, help="Trajectories to draw.")] = 8,
    width: Annotated[int, typer.Option(min=100, help="Width in pixels.")] = 1200,
    height: Annotated[int, typer.Option(min=100, help="Height in pixels.")] = 500,
) -> None:
    """Plot per-datum gradient-norm trajectories and a steps x data heatmap."""
    run = open_run(run_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    run.plot(out, params=params, datums=datums, width=width, height=height)
    console.print(f"wrote {out} ({width}x{height} pixels)")
