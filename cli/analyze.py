"""Commands that compute over a run's gradients: ``influence``, ``export``, ``plot``."""

from __future__ import annotations

import math
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
    StorageOpt,
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
    probe: Annotated[int | None, typer.Option(
        min=0, help="Id of a probe recorded with the run.")] = None,
    probes: Annotated[str | None, typer.Option(
        help="Many probes in one pass: 'all', ids 1,5,9 or A:B (ids A..B-1); the "
             "datums x probes matrix goes to --out, or a summary is printed.")] = None,
    self_: Annotated[
        bool, typer.Option("--self", help="Rank data by self-influence instead.")
    ] = False,
    top: Annotated[int, typer.Option(min=1, help="Proponents and opponents to list.")] = 10,
    kind: Annotated[str | None, typer.Option(
        help="Score: tracin, optimizer (Adam's preconditioner and momentum, from the "
             "recorded optimizer state) or cosine; default: optimizer when the run kept "
             "its optimizer's state, else tracin.")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Write the result (.parquet, .csv or .npz): the matrix of --probes, or the "
             "ranking of --probe or --self (the rows shown: --top per side).")] = None,
    params: ParamsOpt = None,
    weighted: Annotated[
        bool, typer.Option(help="Include each record's weight w_b (first-order loss change).")
    ] = False,
    lr: Annotated[
        float | None, typer.Option(help="Use this learning rate instead of the recorded ones.")
    ] = None,
    max_memory: MemoryOpt = None,
    as_json: JsonOpt = False,
    storage: StorageOpt = None,
) -> None:
    """Influence over the recorded steps: the training data that most helped (proponents) and
    hurt (opponents) a probe; tracin: score = sum_t lr_t <g_t(datum), g_t(probe)>; optimizer:
    sum_t lr_t c <P_t g_t(datum), g_t(probe)> with Adam's preconditioner P_t."""
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        # said here: the library's message offers lr=None, which is no --lr value
        raise InputError(f"--lr {lr:g} must be a finite positive number (the learning rate "
                         "that replaces every recorded one); omit --lr to use the recorded "
                         "ones.")
    run = open_run(run_path, storage)
    if sum((self_, probe is not None, probes is not None)) != 1:
        ids = run.probe_ids
        known = (f"recorded probes: {', '.join(map(str, ids[:20]))}" if ids
                 else "this run has no probes")
        raise InputError(f"pass exactly one of --probe ID, --probes IDS ({known}) or --self.")
    if out is not None and out.suffix.lstrip(".").lower() not in _OUT_FORMATS:
        raise InputError(f"--out {out}: name the file .parquet, .csv or .npz.")
    if probes is not None:
        _influence_matrix(run, probes, kind=kind, out=out, params=params, weighted=weighted,
                          lr=lr, max_memory=max_memory, as_json=as_json)
        return
    if probe is None:
        found = run.self_influence(top=top, params=params, weighted=weighted, lr=lr)
    else:
        found = run.influence(probe, top=top, kind=kind, params=with_gradients(run, params),
                              weighted=weighted, lr=lr, **scan_args(max_memory))
    rows = found.to_pylist()
    score_kind = (found.schema.metadata or {}).get(b"score_kind", b"").decode() or None
    if out is not None:
        _write_table(found, out)
    if as_json:
        echo_json({"probe": probe, "self": self_, "weighted": weighted, "kind": score_kind,
                   **({"out": str(out)} if out is not None else {"rows": rows})})
        return
    if out is not None:
        what = "by self-influence" if probe is None else f"for probe {probe} ({score_kind})"
        console.print(f"wrote {len(rows)} datums ranked {what} to {out}")
        return
    if probe is None:
        title = f"self-influence sum_t lr_t{' w' if weighted else ''} ||g_t||^2"
        _print_ranking(title, [{**r, "rank": i} for i, r in enumerate(rows, 1)])
        return
    for side, title in _SIDES:
        _print_ranking(f"probe {probe} ({score_kind}): {title}",
                       [r for r in rows if r["kind"] == side])


_OUT_FORMATS = ("parquet", "csv", "npz")


def _influence_matrix(
    run: Any, probes: str, *, kind: str | None, out: Path | None, params: Any,
    weighted: bool, lr: float | None, max_memory: str | None, as_json: bool,
) -> None:
    """``--probes``: the datums x probes matrix, to ``--out`` or summarised."""
    chosen = None if probes.strip() == "all" else selector(probes, "probes")
    if isinstance(chosen, slice):
        ids = run.probe_ids
        lo = chosen.start if chosen.start is not None else min(ids, default=0)
        hi = chosen.stop if chosen.stop is not None else max(ids, default=-1) + 1
        chosen = [i for i in ids if lo <= i < hi]
        if not chosen:
            shown = ", ".join(map(str, ids[:20])) or "none"
            raise InputError(f"--probes {probes}: no recorded probe id in that range "
                             f"(recorded: {shown}).")
    elif isinstance(chosen, int):
        chosen = [chosen]
    matrix = run.influence_matrix(chosen, kind=kind, params=with_gradients(run, params),
                                  weighted=weighted, lr=lr, **scan_args(max_memory))
    if out is not None:
        _write_matrix(matrix, out)
    if as_json:
        echo_json({"kind": matrix.kind, "datum_ids": matrix.datum_ids.tolist(),
                   "probe_ids": matrix.probe_ids.tolist(), "weighted": weighted,
                   **({"out": str(out)} if out is not None else
                      {"scores": matrix.scores.tolist()})})
        return
    if out is not None:
        console.print(f"wrote {matrix.scores.shape[0]} datums x {matrix.scores.shape[1]} probes "
                      f"({matrix.kind}) to {out}")
        return
    view = table(f"{matrix.kind} influence: top datum per probe",
                 ("probe", "proponent", "score", "opponent", "score"))
    for j, p in enumerate(matrix.probe_ids.tolist()):
        col = matrix.scores[:, j]
        hi, lo = int(col.argmax()), int(col.argmin())
        # as --probe's tables: a proponent has a positive score, an opponent a negative one;
        # a probe that no datum hurt (or helped) has none, not its least helpful datum
        view.add_row(str(p), *_top_cells(matrix.datum_ids[hi], float(col[hi]), col[hi] > 0),
                     *_top_cells(matrix.datum_ids[lo], float(col[lo]), col[lo] < 0))
    console.print(view)


def _top_cells(datum: Any, score: float, found: bool) -> tuple[str, str]:
    """A probe's proponent or opponent cells: its datum and score, or "none" and "-"."""
    return (str(datum), num(score, 6)) if found else ("none", "-")


def _write_matrix(matrix: Any, out: Path) -> None:
    """The datums x probes matrix to ``out``: npz arrays, or its table as parquet or CSV."""
    if out.suffix.lstrip(".").lower() == "npz":
        import numpy as np

        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out, datum_ids=matrix.datum_ids, probe_ids=matrix.probe_ids,
                 scores=matrix.scores, kind=np.array(matrix.kind))
        return
    _write_table(matrix.to_table(), out)


def _write_table(tbl: Any, out: Path) -> None:
    """A pyarrow table to ``out`` by its extension: parquet, CSV, or npz (an array a column,
    and the schema's ``score_kind``: a ranking's ``kind`` column says proponent/opponent)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = out.suffix.lstrip(".").lower()
    if suffix == "npz":
        import numpy as np
        import pyarrow as pa

        arrays: dict[str, Any] = {
            # strings as a unicode array: an object array would need allow_pickle to load
            name: np.array(col.to_pylist(), dtype=str) if pa.types.is_string(col.type)
            else col.to_numpy()
            for name, col in zip(tbl.column_names, tbl.columns)
        }
        kind = (tbl.schema.metadata or {}).get(b"score_kind")
        if kind:
            arrays["score_kind"] = np.array(kind.decode())
        np.savez(out, **arrays)
        return
    if suffix == "csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(tbl, out)
        return
    import pyarrow.parquet as pq

    pq.write_table(tbl, out)


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
    storage: StorageOpt = None,
) -> None:
    """Export records and their gradients to one parquet or npz file."""
    from gradlog.analysis.export import FORMATS

    suffix = out.suffix.lstrip(".").lower()
    # the library's own message names its format= argument: say it with the CLI's flags
    if format is not None and format not in FORMATS:
        raise InputError(f"--format {format} is not one of {', '.join(FORMATS)}: pass "
                         "--format parquet or --format npz.")
    if format is None and suffix not in FORMATS:
        raise InputError(f"--out {out} names no export format: name the file .parquet or .npz, "
                         "or pass --format parquet|npz.")
    if format in FORMATS and suffix in FORMATS and format != suffix:
        # the library would write what --format says under a name that says otherwise
        raise InputError(
            f"--format {format} contradicts --out {out} (a .{suffix} name): drop --format, "
            f"or name the file .{format}."
        )
    run = open_run(run_path, storage)
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
    datums: Annotated[int, typer.Option(
        min=1, help="Outlying data to name and draw the trajectories of.")] = 5,
    width: Annotated[int, typer.Option(min=100, help="Width in pixels.")] = 1200,
    height: Annotated[int, typer.Option(min=100, help="Height in pixels.")] = 500,
    storage: StorageOpt = None,
) -> None:
    """Plot gradient norms: their range per step (median, quartiles, extremes) with the
    outlying data's trajectories named, norm against loss, and a steps x data heatmap."""
    run = open_run(run_path, storage)
    out.parent.mkdir(parents=True, exist_ok=True)
    run.plot(out, params=params, datums=datums, width=width, height=height)
    console.print(f"wrote {out} ({width}x{height} pixels)")
