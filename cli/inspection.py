"""Commands that describe a store and its records: ``info``, ``ls``, ``show``, ``norms``,
``verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from gradlog.cli._args import (
    DatumOpt,
    JsonOpt,
    MemoryOpt,
    ParamsOpt,
    RunArg,
    StepOpt,
    StorageOpt,
    location,
    open_run,
    records_of,
    scan_args,
    with_gradients,
)
from gradlog.cli._render import (
    LiteralTable,
    console,
    echo_json,
    human_bytes,
    num,
    shape_text,
    share,
    table,
)
from gradlog.errors import InputError, NotAStoreError
from gradlog.store import format as fmt
from gradlog.store.fs import store_path
from gradlog.store.lease import writer_note

_CONFIG_DEFAULTS = (("batch_grad", "autograd"), ("form", "full"))
"""Options ``info`` lists only when set away from these defaults (older stores lack them)."""


def info(run_path: RunArg, as_json: JsonOpt = False, storage: StorageOpt = None) -> None:
    """Summarise a store: format, configuration, parameters, steps, records, bytes."""
    run = open_run(run_path, storage)
    step_values = run.steps.column("step").to_pylist()
    summary = {
        "path": str(run.path),
        "format_version": run.format_version,
        "gradlog_version": run.attrs.get("gradlog_version"),
        "created": run.attrs.get("created"),
        "model": run.attrs.get("model", {}),
        "backend": run.attrs.get("backend", {}),
        "config": run.config,
        "config_hash": run.attrs.get("config_hash"),
        "params": [
            {**p, "bytes_per_record": fmt.record_bytes(run.attrs["params"][p["name"]])}
            for p in run.params.to_pylist()
        ],
        "steps": len(step_values),
        "first_step": step_values[0] if step_values else None,
        "last_step": step_values[-1] if step_values else None,
        "records": run.datums.num_rows,
        "datums": len(set(run.datums.column("datum_id").to_pylist())),
        "bytes": run.nbytes,
        "writer": _writer(run.path),
    }
    if as_json:
        echo_json(summary)
        return
    _print_info(summary)


def _writer(root: Any) -> dict[str, Any] | None:
    """The store's writer lease, when one is left there (a writer recording, or one that
    did not close the store): its state, whether it may be live, holder and one sentence."""
    note = writer_note(root)
    if note is None:
        return None
    lease = note.lease
    return {"state": note.state, "live": note.live, "note": note.text,
            "owner": lease.owner if lease else None,
            "renewed": lease.renewed if lease else None}


def _print_info(summary: dict[str, Any]) -> None:
    """``info``'s two tables: the run, and its parameters with their bytes per record."""
    head = LiteralTable(title=f"gradlog run {summary['path']}", show_header=False)
    head.add_row("format", f"gradlog v{summary['format_version']} "
                           f"(written by gradlog {summary['gradlog_version']})")
    head.add_row("created", str(summary["created"]))
    model = summary["model"]
    head.add_row("model", f"{model.get('class', '?')} ({model.get('n_parameters', 0):,} params)")
    backend = summary["backend"]
    head.add_row("backend", str(backend.get("name", "?")))
    if backend.get("fallback"):
        fallback = ", ".join(str(n) or "(the model)" for n in backend["fallback"])
        head.add_row("fell back to torch.func", fallback)
    cfg = summary["config"]
    extra = "".join(f" {key}={cfg[key]}" for key, default in _CONFIG_DEFAULTS
                    if cfg.get(key, default) != default)
    head.add_row("config", f"params={cfg.get('params')} batch_reduction="
                           f"{cfg.get('batch_reduction')} token_reduction="
                           f"{cfg.get('token_reduction')} dtype={cfg.get('dtype')} "
                           f"every={cfg.get('every')}{extra}")
    head.add_row("steps", f"{summary['steps']}" + (
        f" ({summary['first_step']}..{summary['last_step']})" if summary["steps"] else ""))
    head.add_row("records", f"{summary['records']} ({summary['datums']} distinct datums)")
    head.add_row("bytes on disk", human_bytes(summary["bytes"]))
    if summary["writer"] is not None:
        head.add_row("writer", summary["writer"]["note"])
    console.print(head)

    params = table("recorded parameters",
                   ("name", "shape", "dtype", "form", "bytes/record", "of full"),
                   left=("name", "shape", "dtype", "form"), names=("name",))
    total = full_total = 0
    for p in summary["params"]:
        full = p["numel"] * fmt.record_bytes({"dtype": p["dtype"], "shape": [1]})
        total += p["bytes_per_record"]
        full_total += full
        params.add_row(p["name"], shape_text(p["shape"]), p["dtype"], p["form"],
                       f"{p['bytes_per_record']:,}", share(p["bytes_per_record"], full))
    params.add_row("(total)", "", "", "", f"{total:,}", share(total, full_total))
    console.print(params)


def ls(
    run_path: RunArg,
    as_json: JsonOpt = False,
    all_steps: Annotated[bool, typer.Option("--all", help="List every step.")] = False,
    storage: StorageOpt = None,
) -> None:
    """List a run's recorded parameters and committed steps."""
    run = open_run(run_path, storage)
    steps = run.steps.select(["step", "n_records", "n_micro", "tokens", "lr", "loss_mean"])
    probe_ids = run.probe_ids
    if as_json:
        echo_json({"path": str(run.path), "params": run.params.to_pylist(),
                   "steps": steps.to_pylist(), "probe_ids": probe_ids})
        return
    params = table(f"{len(run.param_names)} recorded parameters",
                   ("name", "shape", "numel", "dtype", "form"),
                   left=("name", "shape", "dtype", "form"), names=("name",))
    for p in run.params.to_pylist():
        params.add_row(p["name"], shape_text(p["shape"]), f"{p['numel']:,}", p["dtype"],
                       p["form"])
    console.print(params)
    rows = steps.to_pylist()
    view = table(f"{len(rows)} committed steps, {run.datums.num_rows} records",
                 ("step", "records", "micro-batches", "tokens", "lr", "mean loss"))
    elided = not all_steps and len(rows) > 20
    for r in [*rows[:10], None, *rows[-10:]] if elided else rows:
        if r is None:
            view.add_row("...", "", "", "", "", "")
            continue
        view.add_row(str(r["step"]), str(r["n_records"]), str(r["n_micro"]), str(r["tokens"]),
                     num(r["lr"]), num(r["loss_mean"]))
    console.print(view)
    if elided:
        console.print("(--all lists every step)")
    if probe_ids:
        console.print(f"probes: {len(probe_ids)} recorded ({', '.join(map(str, probe_ids[:10]))}"
                      f"{' ...' if len(probe_ids) > 10 else ''}); gradlog influence RUN --probe ID")


def show(
    run_path: RunArg,
    params: ParamsOpt = None,
    step: StepOpt = None,
    datum: DatumOpt = None,
    max_memory: MemoryOpt = None,
    as_json: JsonOpt = False,
    storage: StorageOpt = None,
) -> None:
    """Statistics of a slice of gradients: shape, norm, mean, std, min, max."""
    run = open_run(run_path, storage)
    names = with_gradients(run, params)
    steps, datums = records_of(run, step, datum)
    scan = scan_args(max_memory, bar=False)  # one scan per parameter: no bar for each
    results = [run.stats(name, steps, datums, **scan) for name in names]
    if as_json:
        echo_json(results)
        return
    where = ", ".join(x for x in (f"step {step}" if step else "", f"datum {datum}" if datum
                                  else "") if x) or "every record"
    view = table(f"gradients at {where}", ("param", "shape", "norm", "mean", "std", "min", "max"),
                 left=("param", "shape"), names=("param",))
    for r in results:
        view.add_row(r["param"], "x".join(map(str, r["shape"])), num(r["norm"]), num(r["mean"]),
                     num(r["std"]), num(r["min"]), num(r["max"]))
    console.print(view)


def norms(
    run_path: RunArg,
    params: ParamsOpt = None,
    step: StepOpt = None,
    datum: DatumOpt = None,
    out: Annotated[
        Path | None, typer.Option(help="Write every norm to a .parquet or .csv file.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Rows to print (largest norms).")] = 20,
    as_json: JsonOpt = False,
    storage: StorageOpt = None,
) -> None:
    """Exact per-record gradient norms (step, datum_id, row, param, norm)."""
    run = open_run(run_path, storage)
    found = run.norms(params or None, *records_of(run, step, datum))
    found = found.sort_by([("row", "ascending"), ("param", "ascending")])
    if out is not None:
        _write_norms(found, out)
        if as_json:
            echo_json({"path": str(out), "rows": found.num_rows})
        else:
            console.print(f"wrote {found.num_rows} norms to {out}")
        return
    if as_json:
        echo_json(found.to_pylist())
        return
    top = found.sort_by([("norm", "descending")]).slice(0, limit).to_pylist()
    view = table(f"largest of {found.num_rows} per-record gradient norms",
                 ("step", "datum", "param", "norm"), left=("param",), names=("param",))
    for r in top:
        view.add_row(str(r["step"]), str(r["datum_id"]), r["param"], num(r["norm"], 6))
    console.print(view)
    if found.num_rows > limit:
        console.print(f"({found.num_rows - limit} more; --out FILE.parquet writes them all)")


def _write_norms(found: Any, out: Path) -> None:
    """Write the norms table to ``out``, parquet or CSV by its extension.

    Raises:
        InputError: ``out`` ends in neither.
    """
    suffix = out.suffix.lower()
    if suffix not in (".parquet", ".csv"):
        raise InputError(f"--out {out} must end in .parquet or .csv.")
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(found, out, compression="zstd")
    else:
        import pyarrow.csv as pcsv

        pcsv.write_csv(found, out)


def verify(run_path: RunArg, as_json: JsonOpt = False, storage: StorageOpt = None) -> None:
    """Check a store end to end: commit log, index, arrays, every chunk's checksum, schemas.

    Exit code 0 only when every check holds; otherwise 1, with what failed.
    """
    from gradlog.store.verify import verify as verify_store

    where = location(run_path, storage)
    root = store_path(where)
    # not a damaged store, but no store at all: one line, as `gradlog info` says it, not a
    # FAIL for every check (--json: a report all the same)
    if not as_json and not root.exists():
        raise NotAStoreError(f"{where} does not exist. Name a store's directory (NAME.gradlog).")
    if not as_json and not (root / "zarr.json").is_file():
        raise NotAStoreError(
            f"{where} is not a gradlog store: it has no zarr.json. Name a store's directory "
            "(NAME.gradlog: the directory that GradRecorder(model, path) or gradlog train "
            "--out PATH created)."
        )
    report = verify_store(where)
    if as_json:
        echo_json({
            "path": str(report.path),
            "ok": report.ok,
            "checks": [
                {"name": c.name, "ok": c.ok, "summary": c.summary, "skipped": c.skipped,
                 "problems": c.problems}
                for c in report.checks
            ],
            "notes": report.notes,
        })
    else:
        for c in report.checks:
            mark = "[green]ok[/]  " if c.ok else "[bold red]FAIL[/]"
            console.print(f"{mark} {c.name}: {escape(c.skipped or c.summary)}", highlight=False)
            for problem in c.problems:
                console.print(f"       - {escape(problem)}", highlight=False, soft_wrap=True)
        for note in report.notes[:20]:
            console.print(f"     note: {escape(note)}", highlight=False)
        if len(report.notes) > 20:
            console.print(f"     note: ... and {len(report.notes) - 20} more", highlight=False)
        verdict = "intact" if report.ok else "DAMAGED: see FAIL above"
        console.print(f"{report.path}: {verdict}", highlight=False)
    if not report.ok:
        raise typer.Exit(code=1)
