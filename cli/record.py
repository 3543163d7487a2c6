"""``gradlog train``: train the built-in model and record it."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape
from typer.core import TyperCommand

from gradlog.cli._args import StorageOpt, location
from gradlog.cli._render import (
    LiteralTable,
    cli_words,
    console,
    err_console,
    fail,
    human_bytes,
)
from gradlog.errors import GradlogError, InputError, StoreExistsError

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
    steps: Annotated[int, typer.Option(min=1, help="Optimizer (SGD) steps.")] = 32,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences (datums) per step.")] = 16,
    seq_len: Annotated[int, typer.Option(min=2, help="Characters per sequence.")] = 32,
    windows: Annotated[int, typer.Option(
        min=0, help="Training set: the corpus' first N windows of --seq-len characters, each "
        "seen once per epoch (0: every window not held out as a probe).")] = 64,
    probes: Annotated[int, typer.Option(
        min=0, help="Held-out windows recorded as probes 0..N-1 at every recorded step "
        "(gradlog influence RUN --probe 0).")] = 4,
    params: Annotated[list[str] | None, typer.Option(
        "--params", "-p", help="Glob of parameters to record (default: head.weight and the "
        "last block's MLP weights).")] = None,
    backend: Annotated[
        str, typer.Option(help=f"Per-datum gradient backend: {_BACKENDS}.")
    ] = "auto",
    dtype: Annotated[str, typer.Option(
        help=f"Storage dtype: {_DTYPES}; see schemas/FORMAT.md 4.2.")] = "float32",
    every: Annotated[int, typer.Option(min=1, help="Record every N-th step.")] = 1,
    out: Annotated[str | None, typer.Option(
        help="Store path or URL (default: runs/<name>.gradlog, replaced when it holds an "
        "earlier run).")] = None,
    name: Annotated[str, typer.Option(help="Run name, for the default path.")] = "demo",
    seed: Annotated[int, typer.Option(help="Seed of weights and data order.")] = 0,
    overwrite: Annotated[bool, typer.Option(
        help="Replace an existing store at --out.")] = False,
    form: Annotated[str, typer.Option(
        help=f"How per-datum gradients are kept: {_FORMS}, "
        "or JSON such as '{\"blocks.*\": {\"form\": \"projection\", \"dim\": 256}}' "
        "(README: Compact forms).")] = "full",
    batch_grad: Annotated[str, typer.Option(help=f"{_BATCH_GRADS}.")] = "autograd",
    storage: StorageOpt = None,
) -> None:
    """Train the built-in character-level GPT on the shipped sonnets, recording every datum.

    The default run is the introduction: 64 windows of 32 characters seen over 8 epochs, 4
    held-out windows recorded as probes, full gradients of the output layer and the last
    block's MLP: 25 MiB in 330 files, 10-13 s of CPU time.
    """
    from gradlog.demo.train import describe_plan, train_demo
    from gradlog.store.fs import is_object, store_path
    from gradlog.store.opening import is_store

    form_request = _form_request(form)
    if out is not None:
        path = location(out, storage)
        replace = overwrite
        if not overwrite and is_store(store_path(path)):
            # said here: the library's message names its own keywords (overwrite=, resume=)
            raise StoreExistsError(
                f"{out} already holds a gradlog run. Pass --overwrite to replace it, or "
                "choose another --out (gradlog train records a new run; it does not continue "
                "one)."
            )
    else:
        if storage:
            raise InputError("--storage-option configures a URL store: give it with --out "
                             "s3://bucket/run.gradlog (the default path is local).")
        path = Path("runs") / f"{name}.gradlog"
        replace = True  # the demo's own path: replaced, never a second copy beside it
    # announced once the recorder has checked every option and replaces it (on_start): a bad
    # option fails first and keeps the earlier run
    earlier = out is None and (path / "zarr.json").is_file()
    if probes and is_object(store_path(path)):
        console.print("note: probes are not yet kept on object storage: recording none "
                      "(--probes 0).", highlight=False)
        probes = 0
    if isinstance(path, Path):
        path.parent.mkdir(parents=True, exist_ok=True)
    recorder: dict[str, Any] = {}
    progress = _Progress(steps)

    def on_start(rec: Any) -> None:
        recorder["rec"] = rec
        if earlier:
            progress.say(f"{escape(str(path))} holds an earlier run: replacing it (--name NAME "
                         "or --out PATH keeps both).")
        plan = describe_plan(rec, steps, batch_size, probes)
        if plan["bytes_per_step"] is None:  # forms other than full: planned at the first step
            what = "the records' forms are planned at the first step"
            if probes:
                what += (f"; the {_count(probes, 'probe')} are kept in full: "
                         f"{human_bytes(plan['probe_bytes_per_step'])} per step")
        else:
            what = _bytes_per_step(plan, batch_size, probes)
        progress.say(f"recording {len(rec.params)} parameters with backend [bold]{backend}[/] "
                     f"into {escape(str(path))}: {what}")

    def on_step(step: int, loss: float) -> None:
        recorder["done"] = step + 1
        progress.advance(step, loss)
        plan = getattr(recorder.get("rec"), "plan", None)
        if plan is not None and form != "full" and not recorder.get("shown"):
            recorder["shown"] = True  # planned at the first recorded backward
            planned = describe_plan(recorder["rec"], steps, batch_size, probes)
            progress.say(f"forms and bytes per step:\n{escape(str(plan))}\n"
                         f"{_bytes_per_step(planned, batch_size, probes)}")

    with progress:
        try:
            summary = train_demo(
                path, steps=steps, batch_size=batch_size, seq_len=seq_len,
                windows=windows or None, probes=probes, params=params or None,
                backend=backend, dtype=dtype, every=every, seed=seed, overwrite=replace,
                on_step=on_step, on_start=on_start, form=form_request, batch_grad=batch_grad,
            )
        except (GradlogError, ValueError) as e:  # said inside the progress display: it ends
            progress.stop()  # before the line (ValueError: the demo's own checks)
            fail(GradlogError(cli_words(str(e), _TRAIN_WORDS)))
        except KeyboardInterrupt:  # Ctrl-C: the recorder committed the completed steps
            progress.stop()
            _interrupted(path, recorder.get("done", 0), started="rec" in recorder)
    _print_summary(summary, out if out is not None else str(path), storage)


_TRAIN_WORDS = (
    # the library's and the demo's keywords, as train's options: what the user can change
    (r"(?<![\w(.-])block_size=(\d+)", r"--seq-len \1"),
    (r"(?<![\w(.-])block_size\b", "--seq-len"),
    (r"(?<![\w(.-])batch_size must be", "--batch-size must be"),
    (r"(?<![\w(.-])windows must be", "--windows must be"),
    (r"(?<![\w(.-])batch_grad=", "--batch-grad "),
    (r"(?<![\w(.-])backend=", "--backend "),
    (r"(?<![\w(.-])dtype=", "--dtype "),
    (r"(?<![\w(.-])params pattern", "--params pattern"),
    (r"fewer windows or probes \(probes >= 0\), or shorter sequences",
     "fewer --windows or --probes, or a shorter --seq-len"),
)
"""Train's messages from the library and the demo, in its options' words (:func:`cli_words`)."""


def _count(n: int, noun: str) -> str:
    """``4 probes``, ``1 record``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _bytes_per_step(plan: Mapping[str, Any], batch_size: int, probes: int) -> str:
    """``"795.0 KiB per step (16 records: 636.0 KiB; 4 probes, kept in full: 159.0 KiB),
    3.1 MiB for the run before compression"``: what the bytes are, as the forms make the
    records' and not the probes'."""
    parts = f"{_count(batch_size, 'record')}: {human_bytes(plan['records_bytes_per_step'])}"
    if probes:
        parts += (f"; {_count(probes, 'probe')}, kept in full: "
                  f"{human_bytes(plan['probe_bytes_per_step'])}")
    return (f"{human_bytes(plan['bytes_per_step'])} per step ({parts}), "
            f"{human_bytes(plan['projected_bytes'])} for the run before compression")


def _interrupted(path: Any, done: int, *, started: bool) -> NoReturn:
    """Say what an interrupted run kept, on stderr, and exit 130 (as a shell does on Ctrl-C)."""
    where = escape(str(path))
    if not started:  # before the store was created (or replaced)
        kept = f"nothing was written to {where}"
    else:
        try:
            from gradlog.run import Run

            committed = Run(path).steps.column("step").to_pylist()
        except GradlogError:
            committed = []
        kept = (f"steps {committed[0]}..{committed[-1]} are kept in {where} (gradlog verify "
                f"{where} checks them)" if committed else f"no step was committed to {where}")
    err_console.print(f"[yellow]interrupted[/] at step {done}: {kept}.", highlight=False,
                      soft_wrap=True)
    raise typer.Exit(code=130)


class _Progress:
    """Training progress: a rich bar on a terminal; elsewhere (a CI log, a pipe) plain lines
    as it goes, at every eighth of the run and at least every few seconds, flushed at once.
    """

    def __init__(self, steps: int, *, seconds: float = 5.0) -> None:
        self.steps = steps
        self.live = console.is_terminal
        self.seconds = seconds
        self.every = max(1, steps // 8)
        self.started = self.last = time.perf_counter()
        self.bar: Any = None
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]training[/]"), BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(), console=console,
                transient=True,
            )
            self.task = self.bar.add_task("train", total=steps, loss="-")

    def __enter__(self) -> _Progress:
        self.started = self.last = time.perf_counter()
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """End the bar (a no-op for plain lines, and when already stopped)."""
        if self.bar is not None:
            self.bar.stop()

    def say(self, text: str) -> None:
        """A message above the bar, or a line."""
        (self.bar.console if self.bar is not None else console).print(text, highlight=False,
                                                                       soft_wrap=True)

    def advance(self, step: int, loss: float) -> None:
        """Step ``step`` (0-based) is done, at mean loss ``loss``."""
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=f"{loss:.3f}")
            return
        now, done = time.perf_counter(), step + 1
        if done in (1, self.steps) or done % self.every == 0 or now - self.last >= self.seconds:
            self.last = now
            console.print(f"step {done}/{self.steps}  loss {loss:.3f}  "
                          f"{now - self.started:.1f} s", highlight=False)


def _print_summary(summary: TrainSummary, where: str, storage: list[str] | None) -> None:
    """The trained run's summary table, what its probe found, and the commands to try next."""
    view = LiteralTable(title=f"gradlog run {summary.path}", show_header=False)
    view.add_row("steps recorded", str(summary.steps))
    each = f"{summary.records / max(summary.datums, 1):.3g}"
    view.add_row("records (step, datum)", f"{summary.records} ({summary.datums} datums, at "
                 f"{each} step{'' if each == '1' else 's'} each on average)")
    view.add_row("probes", f"{len(summary.probes)} (recorded at every step)")
    view.add_row("parameters", f"{summary.params} ({summary.param_elements:,} elements)")
    view.add_row("bytes on disk",
                 f"{human_bytes(summary.bytes_on_disk)} in {summary.files} files")
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
    run = shlex.quote(where) + "".join(f" --storage-option {shlex.quote(o)}"
                                       for o in storage or ())
    if summary.probes:
        console.print(f"probe 0 is the held-out window {summary.probes[0]!r}", highlight=False,
                      soft_wrap=True)
    if summary.proponent is not None and summary.proponent in summary.windows:
        console.print(f"training on window {summary.proponent} "
                      f"{summary.windows[summary.proponent]!r} lowered its loss most",
                      highlight=False, soft_wrap=True)
    if summary.probes and not summary.gradients:
        console.print("no influence on the probes: every parameter was recorded with form "
                      "'norm', which keeps only each record's norm, and a probe's influence "
                      "needs the training records' gradients (--form full keeps them).",
                      highlight=False, soft_wrap=True)
    console.print("Try next:", highlight=False)
    lines = [
        (f"gradlog influence {run} --probe 0", "the training windows that helped and hurt it")
        if summary.probes and summary.gradients else (
            f"gradlog influence {run} --self", "the windows the model kept being pushed by"),
        (f"gradlog plot {run} --out fig.png",
         "gradient norms per step, against the loss, with outliers named"),
        (f"gradlog info {run}", "what the store holds; gradlog show RUN for gradient statistics"
         if summary.gradients else "what the store holds; gradlog norms RUN lists the norms"),
    ]
    width = max(len(cmd) for cmd, _ in lines)
    for cmd, what in lines:
        console.print(f"  {escape(cmd):<{width}}  # {what}", highlight=False, soft_wrap=True)
    console.print(f"or in Python: run = gradlog.open({str(summary.path)!r})", highlight=False,
                  soft_wrap=True)
