"""``gradlog`` command: train the built-in run, inspect stores.

Every command is a thin layer over the library: it parses options, calls gradlog, and shows
the result. Library errors become one red line and exit code 1, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gradlog.errors import GradlogError
from gradlog.store import format as fmt

app = typer.Typer(
    name="gradlog",
    help="Record the gradient of every datum at every training step; inspect the records.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
_RUN_HELP = "Path of a gradlog store, or an fsspec URL (s3://bucket/run.gradlog, ...)."
err_console = Console(stderr=True)


def _fail(error: Exception) -> None:
    from rich.markup import escape

    # escaped: messages hold brackets ("pip install 'gradlog[plot]'", lists) rich would eat
    err_console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False,
                      soft_wrap=True)
    raise typer.Exit(code=1)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _free_path(name: str) -> Path:
    """runs/NAME.gradlog, or the first runs/NAME-K.gradlog that does not exist yet."""
    path = Path("runs") / f"{name}.gradlog"
    k = 2
    while path.exists():
        path = Path("runs") / f"{name}-{k}.gradlog"
        k += 1
    return path


@app.command()
def train(
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps.")] = 100,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences (datums) per step.")] = 8,
    seq_len: Annotated[int, typer.Option(min=2, help="Characters per sequence.")] = 64,
    params: Annotated[
        list[str] | None, typer.Option("--params", "-p", help="Glob of parameters to record.")
    ] = None,
    backend: Annotated[
        str, typer.Option(help="Per-datum gradient backend: auto (hooks), hooks, vmap, loop.")
    ] = "auto",
    dtype: Annotated[str, typer.Option(
        help="Storage dtype: float32 (lossless), float64, bfloat16, float16, bitroundN "
        "(e.g. bitround9); see schemas/FORMAT.md 4.2.")] = "float32",
    every: Annotated[int, typer.Option(min=1, help="Record every N-th step.")] = 1,
    out: Annotated[
        Path | None, typer.Option(help="Store path (default: runs/<name>.gradlog).")
    ] = None,
    name: Annotated[str, typer.Option(help="Run name, for the default path.")] = "demo",
    seed: Annotated[int, typer.Option(help="Seed of weights and data order.")] = 0,
    overwrite: Annotated[bool, typer.Option(
        help="Replace an existing store at --out (default: runs/<name>.gradlog).")] = False,
    form: Annotated[str, typer.Option(
        help="How per-datum gradients are kept: full, factors, projection, topk, norm, auto, "
        "or JSON such as '{\"blocks.*\": {\"form\": \"projection\", \"dim\": 256}}' "
        "(README: Compact forms).")] = "full",
    batch_grad: Annotated[str, typer.Option(
        help="autograd (training bitwise as without gradlog) or sum (Linear weight gradients "
        "from the per-datum sum: one matmul less).")] = "autograd",
) -> None:
    """Train the built-in character-level GPT on the shipped corpus, recording every datum."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from gradlog.demo.train import describe_plan, train_demo

    form_request: Any = form
    if form.lstrip().startswith("{"):
        try:
            form_request = json.loads(form)
        except json.JSONDecodeError as e:
            _fail(ValueError(f"--form is not valid JSON ({e}); pass a form name or a JSON "
                             "object such as '{\"*\": \"norm\"}'."))
    if out is not None:
        path = out
    elif overwrite:  # replace runs/<name>.gradlog itself; the recorder refuses to delete
        path = Path("runs") / f"{name}.gradlog"  # anything there that is not a gradlog store
    else:
        path = _free_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    recorder: dict[str, Any] = {}

    with Progress(
        TextColumn("[bold]training[/]"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(), console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("train", total=steps, loss="-")

        def on_start(rec: Any) -> None:
            recorder["rec"] = rec
            plan = describe_plan(rec, steps, batch_size)
            progress.console.print(
                f"recording {len(rec.params)} parameters with backend [bold]{backend}[/] into "
                f"{path}: {_bytes(plan['bytes_per_step'])} per step, "
                f"{_bytes(plan['projected_bytes'])} for the run before compression"
            )

        def on_step(step: int, loss: float) -> None:
            progress.update(task, advance=1, loss=f"{loss:.3f}")
            plan = getattr(recorder.get("rec"), "plan", None)
            if plan is not None and form != "full" and not recorder.get("shown"):
                recorder["shown"] = True  # planned at the first recorded backward
                progress.console.print(f"forms and bytes per step:\n{plan}")

        try:
            summary = train_demo(
                path, steps=steps, batch_size=batch_size, seq_len=seq_len,
                params=params or ["*"], backend=backend, dtype=dtype, every=every, seed=seed,
                overwrite=overwrite, on_step=on_step, on_start=on_start, form=form_request,
                batch_grad=batch_grad,
            )
        except (GradlogError, ValueError) as e:
            _fail(e)

    table = Table(title=f"gradlog run {summary.path}", show_header=False)
    table.add_row("steps recorded", str(summary.steps))
    table.add_row("records (step, datum)", str(summary.records))
    table.add_row("parameters", f"{summary.params} ({summary.param_elements:,} elements)")
    table.add_row("bytes on disk", _bytes(summary.bytes_on_disk))
    table.add_row("final loss", f"{summary.final_loss:.4f}")
    if summary.plain_step_s is None or summary.recorded_step_s is None or summary.overhead is None:
        # the first recorded step is warm-up, so a paired timing needs a later recorded step
        unmeasured = f"not measured (needs at least {summary.timed_steps_needed} steps)"
        table.add_row("plain step", unmeasured)
        table.add_row("recorded step", unmeasured)
    else:
        table.add_row("plain step", f"{summary.plain_step_s * 1e3:.1f} ms (median)")
        table.add_row(
            "recorded step",
            f"{summary.recorded_step_s * 1e3:.1f} ms (median), {summary.overhead:.2f}x plain",
        )
    table.add_row("time in per-datum compute / writing",
                  f"{summary.compute_s:.2f} s / {summary.write_s:.2f} s")
    console.print(table)
    console.print(f"Read it back: [bold]gradlog info {summary.path}[/] or "
                  f"gradlog.open({str(summary.path)!r})")


@app.command()
def info(
    run_path: Annotated[str, typer.Argument(metavar="RUN", help=_RUN_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Summarise a store: format, configuration, parameters, steps, records, bytes."""
    import gradlog

    try:
        run = gradlog.open(run_path)
        steps, datums = run.steps, run.datums
    except GradlogError as e:
        _fail(e)
    step_values = steps.column("step").to_pylist()
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
        "records": datums.num_rows,
        "datums": len(set(datums.column("datum_id").to_pylist())),
        "bytes": run.nbytes,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return

    head = Table(title=f"gradlog run {run.path}", show_header=False)
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
    extra = "".join(  # options set away from their defaults (older stores lack them)
        f" {key}={cfg[key]}" for key, default in (("batch_grad", "autograd"), ("form", "full"))
        if cfg.get(key, default) != default)
    head.add_row("config", f"params={cfg.get('params')} batch_reduction="
                           f"{cfg.get('batch_reduction')} token_reduction="
                           f"{cfg.get('token_reduction')} dtype={cfg.get('dtype')} "
                           f"every={cfg.get('every')}{extra}")
    head.add_row("steps", f"{summary['steps']}" + (
        f" ({summary['first_step']}..{summary['last_step']})" if summary["steps"] else ""))
    head.add_row("records", f"{summary['records']} ({summary['datums']} distinct datums)")
    head.add_row("bytes on disk", _bytes(summary["bytes"]))
    console.print(head)

    params = Table(title="recorded parameters")
    for column in ("name", "shape", "dtype", "form", "bytes/record", "of full"):
        params.add_column(column, justify="right" if column[0] in "bo" else "left")
    total = full_total = 0
    for p in summary["params"]:
        full = p["numel"] * fmt.record_bytes({"dtype": p["dtype"], "shape": [1]})
        total += p["bytes_per_record"]
        full_total += full
        params.add_row(p["name"], "x".join(map(str, p["shape"])) or "scalar", p["dtype"],
                       p["form"], f"{p['bytes_per_record']:,}", _share(p["bytes_per_record"], full))
    params.add_row("(total)", "", "", "", f"{total:,}", _share(total, full_total))
    console.print(params)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "-"


# -- reading a run: ls, show, norms, influence, export, plot -----------------------------------
_SELECTOR_HELP = "an int, A:B (A..B-1; either end may be left open), or a comma list"


def _selector(text: str | None, what: str) -> Any:
    """``"5"`` -> 5, ``"2:8"`` -> slice(2, 8), ``"1,4,9"`` -> [1, 4, 9]; None stays None."""
    from gradlog.errors import InputError

    if text is None:
        return None
    try:
        if ":" in text:
            start, _, stop = text.partition(":")
            return slice(int(start) if start.strip() else None, int(stop) if stop.strip() else None)
        if "," in text:
            return [int(v) for v in text.split(",") if v.strip()]
        return int(text)
    except ValueError:
        raise InputError(
            f"--{what} {text!r} is not a selection: pass {_SELECTOR_HELP} (e.g. 3, 0:10, 1,5,9)."
        ) from None


def _open_run(run_path: str) -> Any:
    import gradlog

    try:
        run = gradlog.open(run_path)
        run.steps, run.datums  # noqa: B018 - read the tables now, so errors surface here
    except GradlogError as e:
        _fail(e)
    return run


def _with_gradients(run: Any, params: list[str] | None) -> list[str]:
    """The parameters of a command that reads gradients: those given with -p, or by default
    every one that keeps gradients, saying which are skipped (form 'norm' keeps only norms)."""
    from rich.markup import escape

    from gradlog.errors import SelectionError

    forms = dict(zip(run.params.column("name").to_pylist(), run.params.column("form").to_pylist()))
    if params:
        for name in params:  # unknown names: the library's error lists the recorded ones
            if forms.get(name) == "norm":
                _fail(SelectionError(
                    f"parameter {name!r} was recorded with form 'norm': only each record's exact "
                    f"norm is kept (gradlog norms RUN -p {name} shows them), so it has no "
                    "gradients to read. Choose other parameters with -p/--param."
                ))
        return list(params)
    names = [n for n, form in forms.items() if form != "norm"]
    skipped = [n for n, form in forms.items() if form == "norm"]
    if not names:
        _fail(SelectionError(
            "every parameter was recorded with form 'norm': only each record's exact norm is "
            "kept, so there are no gradients to read. Use gradlog norms or gradlog influence "
            "--self."
        ))
    if skipped:
        err_console.print(
            f"note: skipping {escape(', '.join(skipped))}: recorded with form 'norm' (only "
            "norms are kept: gradlog norms shows them). Choose parameters with -p/--param.",
            highlight=False, soft_wrap=True,
        )
    return names


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: None instead."""
    if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _echo_json(value: Any) -> None:
    typer.echo(json.dumps(_finite(value), indent=2))


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _progress() -> bool:
    import sys

    return sys.stderr.isatty()


RunArg = Annotated[str, typer.Argument(metavar="RUN", help=_RUN_HELP)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
StepOpt = Annotated[str | None, typer.Option("--step", "-s", help=f"Steps: {_SELECTOR_HELP}.")]
DatumOpt = Annotated[
    str | None, typer.Option("--datum", "-d", help=f"Datum ids: {_SELECTOR_HELP}.")
]
ParamsOpt = Annotated[
    list[str] | None, typer.Option("--param", "-p", help="Parameter (repeat for several).")
]
MemoryOpt = Annotated[
    str | None, typer.Option(help="Working-memory cap of the scan, e.g. 512MiB (default 256MiB).")
]


@app.command("ls")
def ls_(
    run_path: RunArg,
    as_json: JsonOpt = False,
    all_steps: Annotated[bool, typer.Option("--all", help="List every step.")] = False,
) -> None:
    """List a run's recorded parameters and committed steps."""
    run = _open_run(run_path)
    steps = run.steps.select(["step", "n_records", "n_micro", "tokens", "lr", "loss_mean"])
    try:
        probe_ids = run.probe_ids
    except GradlogError as e:
        _fail(e)
    if as_json:
        _echo_json({"path": str(run.path), "params": run.params.to_pylist(),
                    "steps": steps.to_pylist(), "probe_ids": probe_ids})
        return
    params = Table(title=f"{len(run.param_names)} recorded parameters")
    for column in ("name", "shape", "numel", "dtype", "form"):
        params.add_column(column, justify="right" if column == "numel" else "left")
    for p in run.params.to_pylist():
        params.add_row(p["name"], "x".join(map(str, p["shape"])) or "scalar", f"{p['numel']:,}",
                       p["dtype"], p["form"])
    console.print(params)
    rows = steps.to_pylist()
    table = Table(title=f"{len(rows)} committed steps, {run.datums.num_rows} records")
    for column in ("step", "records", "micro-batches", "tokens", "lr", "mean loss"):
        table.add_column(column, justify="right")
    shown = rows if all_steps or len(rows) <= 20 else [*rows[:10], None, *rows[-10:]]
    for r in shown:
        if r is None:
            table.add_row("...", "", "", "", "", "")
            continue
        table.add_row(str(r["step"]), str(r["n_records"]), str(r["n_micro"]), str(r["tokens"]),
                      _num(r["lr"]), _num(r["loss_mean"]))
    console.print(table)
    if len(shown) < len(rows) + 1 and not all_steps and len(rows) > 20:
        console.print("(--all lists every step)")
    if probe_ids:
        console.print(f"probes: {len(probe_ids)} recorded ({', '.join(map(str, probe_ids[:10]))}"
                      f"{' ...' if len(probe_ids) > 10 else ''}); gradlog influence RUN --probe ID")


@app.command()
def show(
    run_path: RunArg,
    params: ParamsOpt = None,
    step: StepOpt = None,
    datum: DatumOpt = None,
    max_memory: MemoryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Statistics of a slice of gradients: shape, norm, mean, std, min, max."""
    run = _open_run(run_path)
    names = _with_gradients(run, params)
    try:
        results = [run.stats(name, _selector(step, "step"), _selector(datum, "datum"),
                             max_memory=max_memory) for name in names]
    except GradlogError as e:
        _fail(e)
    if as_json:
        _echo_json(results)
        return
    where = ", ".join(x for x in (f"step {step}" if step else "", f"datum {datum}" if datum
                                  else "") if x) or "every record"
    table = Table(title=f"gradients at {where}")
    for column in ("param", "shape", "norm", "mean", "std", "min", "max"):
        table.add_column(column, justify="left" if column in ("param", "shape") else "right")
    for r in results:
        table.add_row(r["param"], "x".join(map(str, r["shape"])), _num(r["norm"]),
                      _num(r["mean"]), _num(r["std"]), _num(r["min"]), _num(r["max"]))
    console.print(table)


@app.command()
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
) -> None:
    """Exact per-record gradient norms (step, datum_id, row, param, norm)."""
    run = _open_run(run_path)
    try:
        table = run.norms(params or None, _selector(step, "step"), _selector(datum, "datum"))
    except GradlogError as e:
        _fail(e)
    table = table.sort_by([("row", "ascending"), ("param", "ascending")])
    if out is not None:
        suffix = out.suffix.lower()
        if suffix not in (".parquet", ".csv"):
            _fail(ValueError(f"--out {out} must end in .parquet or .csv."))
        out.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, out, compression="zstd")
        else:
            import pyarrow.csv as pcsv

            pcsv.write_csv(table, out)
        if as_json:
            _echo_json({"path": str(out), "rows": table.num_rows})
        else:
            console.print(f"wrote {table.num_rows} norms to {out}")
        return
    if as_json:
        _echo_json(table.to_pylist())
        return
    top = table.sort_by([("norm", "descending")]).slice(0, limit).to_pylist()
    view = Table(title=f"largest of {table.num_rows} per-record gradient norms")
    for column in ("step", "datum", "param", "norm"):
        view.add_column(column, justify="left" if column == "param" else "right")
    for r in top:
        view.add_row(str(r["step"]), str(r["datum_id"]), r["param"], _num(r["norm"], 6))
    console.print(view)
    if table.num_rows > limit:
        console.print(f"({table.num_rows - limit} more; --out FILE.parquet writes them all)")


@app.command()
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
    from gradlog.errors import InputError

    run = _open_run(run_path)
    try:
        if self_ == (probe is not None):
            ids = run.probe_ids
            known = (f"recorded probes: {', '.join(map(str, ids[:20]))}" if ids
                     else "this run has no probes")
            raise InputError(f"pass exactly one of --probe ID ({known}) or --self.")
        if self_:
            table = run.self_influence(top=top, params=params, weighted=weighted, lr=lr)
        else:
            assert probe is not None
            table = run.influence(probe, top=top, params=_with_gradients(run, params),
                                  weighted=weighted, lr=lr, max_memory=max_memory,
                                  progress=_progress())
    except GradlogError as e:
        _fail(e)
    rows = table.to_pylist()
    if as_json:
        _echo_json({"probe": probe, "self": self_, "weighted": weighted, "rows": rows})
        return
    if self_:
        view = Table(title=f"self-influence sum_t lr_t{' w' if weighted else ''} ||g_t||^2")
        for column in ("rank", "datum", "score", "steps"):
            view.add_column(column, justify="right")
        for i, r in enumerate(rows, 1):
            view.add_row(str(i), str(r["datum_id"]), _num(r["score"], 6), str(r["n_steps"]))
        console.print(view)
        return
    for kind, title in (("proponent", "proponents (training on them lowered the probe's "
                                      "loss)"),
                        ("opponent", "opponents (training on them raised the probe's loss)")):
        view = Table(title=f"probe {probe}: {title}")
        for column in ("rank", "datum", "score", "steps"):
            view.add_column(column, justify="right")
        for r in rows:
            if r["kind"] == kind:
                view.add_row(str(r["rank"]), str(r["datum_id"]), _num(r["score"], 6),
                             str(r["n_steps"]))
        console.print(view)


@app.command()
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
    from gradlog.errors import InputError

    suffix = out.suffix.lstrip(".").lower()
    if format in FORMATS and suffix in FORMATS and format != suffix:
        # the library would write what --format says under a name that says otherwise
        _fail(InputError(
            f"--format {format} contradicts --out {out} (a .{suffix} name): drop --format, "
            f"or name the file .{format}."
        ))
    run = _open_run(run_path)
    names = _with_gradients(run, params)
    try:
        summary = run.export(out, format=format, params=names, step=_selector(step, "step"),
                             datum=_selector(datum, "datum"), max_memory=max_memory,
                             progress=_progress())
    except GradlogError as e:
        _fail(e)
    if as_json:
        _echo_json(summary)
        return
    console.print(f"wrote {summary['records']} records x {len(summary['params'])} parameters "
                  f"to {summary['path']} ({summary['format']}, {_bytes(summary['bytes'])})")


@app.command()
def plot(
    run_path: RunArg,
    out: Annotated[Path, typer.Option(help="Image to write (.png, .svg, .pdf).")],
    params: ParamsOpt = None,
    datums: Annotated[int, typer.Option(min=1, help="Trajectories to draw.")] = 8,
    width: Annotated[int, typer.Option(min=100, help="Width in pixels.")] = 1200,
    height: Annotated[int, typer.Option(min=100, help="Height in pixels.")] = 500,
) -> None:
    """Plot per-datum gradient-norm trajectories and a steps x data heatmap."""
    run = _open_run(run_path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        run.plot(out, params=params, datums=datums, width=width, height=height)
    except GradlogError as e:
        _fail(e)
    console.print(f"wrote {out} ({width}x{height} pixels)")


@app.command()
def verify(
    run_path: Annotated[str, typer.Argument(metavar="RUN", help=_RUN_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Check a store end to end: commit log, index, arrays, every chunk's checksum, schemas.

    Exit code 0 only when every check holds; otherwise 1, with what failed.
    """
    from rich.markup import escape

    from gradlog.store.verify import verify as verify_store

    report = verify_store(run_path)
    if as_json:
        _echo_json({
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


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
