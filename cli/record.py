"""``gradlog train``: train the built-in model and record it."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from typer.core import TyperCommand

from gradlog.cli._render import console, fail, human_bytes
from gradlog.errors import GradlogError, InputError

if TYPE_CHECKING:
    from gradlog.demo.train import TrainSummary

_FORMS, _BACKENDS, _BATCH_GRADS, _DTYPES = "{forms}", "{backends}", "{batch_grads}", "{dtypes}"
"""Placeholders in the options' help, filled from the registries when help is shown."""


def _listing(names: Iterable[str], notes: Mapping[str, str], last: str = ", ") -> str:
    """``a (note), b, c``: each name with its note where it has one; ``last`` before the last."""
    items = [f"{name} ({notes[name]})" if name in notes else name for name in names]
    return ", ".join(items[:-1]) + last + items[-1] if len(items) > 1 else "".join(items)


def _choices() -> dict[str, str]:
    """Each placeholder's text, listed from the registry of its closed set."""
    # imported here: the registries import torch, which `gradlog info` must not
    from gradlog.backends import BACKENDS
    from gradlog.backends.hooks import BATCH_GRADS
    from gradlog.forms import FORMS
    from gradlog.store.dtypes import STORAGE_DTYPE_NAMES

    aliases = {name: cls.name for name, cls in BACKENDS.items() if cls.name != name}
    return {
        _FORMS: _listing(FORMS, {}),
        _BACKENDS: _listing(BACKENDS, aliases),
        _BATCH_GRADS: _listing(BATCH_GRADS, {
            "autograd": "training bitwise as without gradlog",
            "sum": "Linear weight gradients from the per-datum sum: one matmul less",
        }, last=" or "),
        _DTYPES: _listing(STORAGE_DTYPE_NAMES, {"float32": "lossless",
                                                "bitroundN": "e.g. bitround9"}),
    }


class TrainCommand(TyperCommand):
    """The ``train`` command, whose help lists forms, backends, batch_grad modes and dtypes
    from their registries only when it is shown."""

    def format_help(self, ctx: Any, formatter: Any) -> None:  # click's, vendored by new typer
        """Fill the placeholders of the options' help, then show it."""
        choices = _choices()
        for param in self.params:
            text = getattr(param, "help", None)
            if text:
                for placeholder, listed in choices.items():
                    text = text.replace(placeholder, listed)
                param.help = text  # type: ignore[attr-defined]
        super().format_help(ctx, formatter)


def _free_path(name: str) -> Path:
    """runs/NAME.gradlog, or the first runs/NAME-K.gradlog that does not exist yet."""
    path = Path("runs") / f"{name}.gradlog"
    k = 2
    while path.exists():
        path = Path("runs") / f"{name}-{k}.gradlog"
        k += 1
    return path


def _form_request(form: str) -> Any:
    """--form as the recorder takes it: a form name, or the JSON object it spells.

    Raises:
        InputError: ``form`` starts like JSON but is not.
    """
    if not form.lstrip().startswith("{"):
        return form
    try:
        return json.loads(form)
    except json.JSONDecodeError as e:
        raise InputError(f"--form is not valid JSON ({e}); pass a form name or a JSON "
                         "object such as '{\"*\": \"norm\"}'.") from None


def train(
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps.")] = 100,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences (datums) per step.")] = 8,
    seq_len: Annotated[int, typer.Option(min=2, help="Characters per sequence.")] = 64,
    params: Annotated[
        list[str] | None, typer.Option("--params", "-p", help="Glob of parameters to record.")
    ] = None,
    backend: Annotated[
        str, typer.Option(help=f"Per-datum gradient backend: {_BACKENDS}.")
    ] = "auto",
    dtype: Annotated[str, typer.Option(
        help=f"Storage dtype: {_DTYPES}; see schemas/FORMAT.md 4.2.")] = "float32",
    every: Annotated[int, typer.Option(min=1, help="Record every N-th step.")] = 1,
    out: Annotated[
        Path | None, typer.Option(help="Store path (default: runs/<name>.gradlog).")
    ] = None,
    name: Annotated[str, typer.Option(help="Run name, for the default path.")] = "demo",
    seed: Annotated[int, typer.Option(help="Seed of weights and data order.")] = 0,
    overwrite: Annotated[bool, typer.Option(
        help="Replace an existing store at --out (default: runs/<name>.gradlog).")] = False,
    form: Annotated[str, typer.Option(
        help=f"How per-datum gradients are kept: {_FORMS}, "
        "or JSON such as '{\"blocks.*\": {\"form\": \"projection\", \"dim\": 256}}' "
        "(README: Compact forms).")] = "full",
    batch_grad: Annotated[str, typer.Option(help=f"{_BATCH_GRADS}.")] = "autograd",
) -> None:
    """Train the built-in character-level GPT on the shipped corpus, recording every datum."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from gradlog.demo.train import describe_plan, train_demo

    form_request = _form_request(form)
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
                f"{path}: {human_bytes(plan['bytes_per_step'])} per step, "
                f"{human_bytes(plan['projected_bytes'])} for the run before compression"
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
        except (GradlogError, ValueError) as e:  # said inside the progress display: it ends
            fail(e)  # after the line (ValueError: the demo's own checks)
    _print_summary(summary)


def _print_summary(summary: TrainSummary) -> None:
    """The trained run's summary table, and how to read it back."""
    view = Table(title=f"gradlog run {summary.path}", show_header=False)
    view.add_row("steps recorded", str(summary.steps))
    view.add_row("records (step, datum)", str(summary.records))
    view.add_row("parameters", f"{summary.params} ({summary.param_elements:,} elements)")
    view.add_row("bytes on disk", human_bytes(summary.bytes_on_disk))
    view.add_row("final loss", f"{summary.final_loss:.4f}")
    if summary.plain_step_s is None or summary.recorded_step_s is None or summary.overhead is None:
        # the first recorded step is warm-up, so a paired timing needs a later recorded step
        unmeasured = f"not measured (needs at least {summary.timed_steps_needed} steps)"
        view.add_row("plain step", unmeasured)
        view.add_row("recorded step", unmeasured)
    else:
        view.add_row("plain step", f"{summary.plain_step_s * 1e3:.1f} ms (median)")
        view.add_row(
            "recorded step",
            f"{summary.recorded_step_s * 1e3:.1f} ms (median), {summary.overhead:.2f}x plain",
        )
    view.add_row("time in per-datum compute / writing",
                 f"{summary.compute_s:.2f} s / {summary.write_s:.2f} s")
    console.print(view)
    console.print(f"Read it back: [bold]gradlog info {summary.path}[/] or "
                  f"gradlog.open({str(summary.path)!r})")
