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

app = typer.Typer(
    name="gradlog",
    help="Record the gradient of every datum at every training step; inspect the records.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


def _fail(error: Exception) -> None:
    err_console.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
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
    backend: Annotated[str, typer.Option(help="Per-datum gradient backend.")] = "vmap",
    dtype: Annotated[str, typer.Option(help="Storage dtype: float32 or float64.")] = "float32",
    every: Annotated[int, typer.Option(min=1, help="Record every N-th step.")] = 1,
    out: Annotated[
        Path | None, typer.Option(help="Store path (default: runs/<name>.gradlog).")
    ] = None,
    name: Annotated[str, typer.Option(help="Run name, for the default path.")] = "demo",
    seed: Annotated[int, typer.Option(help="Seed of weights and data order.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing store at --out.")] = False,
) -> None:
    """Train the built-in character-level GPT on the shipped corpus, recording every datum."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from gradlog.demo.train import describe_plan, train_demo

    path = out if out is not None else _free_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)

    with Progress(
        TextColumn("[bold]training[/]"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(), console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("train", total=steps, loss="-")

        def on_start(rec: Any) -> None:
            plan = describe_plan(rec, steps, batch_size)
            progress.console.print(
                f"recording {len(rec.params)} parameters with backend [bold]{backend}[/] into "
                f"{path}: {_bytes(plan['bytes_per_step'])} per step, "
                f"{_bytes(plan['projected_bytes'])} for the run before compression"
            )

        def on_step(step: int, loss: float) -> None:
            progress.update(task, advance=1, loss=f"{loss:.3f}")

        try:
            summary = train_demo(
                path, steps=steps, batch_size=batch_size, seq_len=seq_len,
                params=params or ["*"], backend=backend, dtype=dtype, every=every, seed=seed,
                overwrite=overwrite, on_step=on_step, on_start=on_start,
            )
        except (GradlogError, ValueError) as e:
            _fail(e)

    table = Table(title=f"gradlog run {summary.path}", show_header=False)
    table.add_row("steps recorded", str(summary.steps))
    table.add_row("records (step, datum)", str(summary.records))
    table.add_row("parameters", f"{summary.params} ({summary.param_elements:,} elements)")
    table.add_row("bytes on disk", _bytes(summary.bytes_on_disk))
    table.add_row("final loss", f"{summary.final_loss:.4f}")
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
    run_path: Annotated[Path, typer.Argument(metavar="RUN", help="Path of a gradlog store.")],
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
        "params": run.params.to_pylist(),
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
        head.add_row("fell back to torch.func", ", ".join(map(str, backend["fallback"])))
    cfg = summary["config"]
    head.add_row("config", f"params={cfg.get('params')} batch_reduction="
                           f"{cfg.get('batch_reduction')} token_reduction="
                           f"{cfg.get('token_reduction')} dtype={cfg.get('dtype')} "
                           f"every={cfg.get('every')}")
    head.add_row("steps", f"{summary['steps']}" + (
        f" ({summary['first_step']}..{summary['last_step']})" if summary["steps"] else ""))
    head.add_row("records", f"{summary['records']} ({summary['datums']} distinct datums)")
    head.add_row("bytes on disk", _bytes(summary["bytes"]))
    console.print(head)

    params = Table(title="recorded parameters")
    for column in ("name", "shape", "dtype", "form"):
        params.add_column(column)
    for p in summary["params"]:
        params.add_row(p["name"], "x".join(map(str, p["shape"])) or "scalar", p["dtype"],
                       p["form"])
    console.print(params)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
