"""What the commands that read a run share: their arguments and options, the parsing of step
and datum selections and of storage options, opening the run, and choosing the parameters
that keep gradients."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape

from gradlog.analysis import ScanArgs
from gradlog.cli._render import err_console
from gradlog.errors import InputError, SelectionError
from gradlog.run import Run

RUN_HELP = "Path of a gradlog store, or an fsspec URL (s3://bucket/run.gradlog, ...)."
SELECTOR_HELP = "an int, A:B (A..B-1; either end may be left open), or a comma list"

RunArg = Annotated[str, typer.Argument(metavar="RUN", help=RUN_HELP)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
StepOpt = Annotated[str | None, typer.Option("--step", "-s", help=f"Steps: {SELECTOR_HELP}.")]
DatumOpt = Annotated[
    str | None, typer.Option("--datum", "-d", help=f"Datum ids: {SELECTOR_HELP}.")
]
ParamsOpt = Annotated[
    list[str] | None, typer.Option("--param", "-p", help="Parameter (repeat for several).")
]
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option", metavar="KEY=VALUE",
        help="fsspec option of a URL store (repeat for several), e.g. "
        "endpoint_url=http://localhost:9000 for an S3 server that is not AWS; a VALUE that "
        "parses as JSON is taken as JSON (true, 5, {...}), as fsspec does with its "
        "FSSPEC_<PROTOCOL>_<KEY> variables.",
    ),
]
MemoryOpt = Annotated[
    str | None, typer.Option(help="Working-memory cap of the scan, e.g. 512MiB (default 256MiB).")
]


_IDS = {
    "step": ("steps are the run's step numbers", "gradlog ls RUN lists them"),
    "datum": ("datum ids are the ids the datums were recorded with",
              "gradlog norms RUN shows records with theirs"),
    "probes": ("probe ids are the ids the probes were recorded with",
               "gradlog ls RUN lists them"),
}
"""What each option's ids are, for the refusal of a negative one."""


def selector(text: str | None, what: str) -> Any:
    """``"5"`` -> 5, ``"2:8"`` -> slice(2, 8), ``"1,4,9"`` -> [1, 4, 9]; None stays None.

    Raises:
        InputError: ``text`` is none of those, or holds a negative id (``what`` names the
            option).
    """
    if text is None:
        return None
    try:
        if ":" in text:
            start, _, stop = text.partition(":")
            parsed: Any = slice(int(start) if start.strip() else None,
                                int(stop) if stop.strip() else None)
            values = [v for v in (parsed.start, parsed.stop) if v is not None]
        elif "," in text:
            parsed = values = [int(v) for v in text.split(",") if v.strip()]
        else:
            parsed = int(text)
            values = [parsed]
    except ValueError:
        raise InputError(
            f"--{what} {text!r} is not a selection: pass {SELECTOR_HELP} (e.g. 3, 0:10, 1,5,9)."
        ) from None
    if any(v < 0 for v in values):
        # said here, with the CLI's words: the library's message names run.steps
        ids, listed = _IDS.get(what, ("ids are the run's own numbers", "gradlog ls RUN"))
        raise InputError(
            f"--{what} {text!r}: {ids} (>= 0), not positions: {min(values)} does not count "
            f"from the end. Pass the numbers themselves ({listed}); A: selects A and every "
            "later one."
        )
    return parsed


def storage_options(values: list[str] | None) -> dict[str, Any]:
    """``["endpoint_url=http://h:9000", "anon=true"]`` -> ``{"endpoint_url": "http://h:9000",
    "anon": True}``: each VALUE as JSON where it parses (as fsspec reads its environment
    variables), else as the string given.

    Raises:
        InputError: an item is not KEY=VALUE.
    """
    options: dict[str, Any] = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(
                f"--storage-option {item!r} is not KEY=VALUE: pass e.g. --storage-option "
                "endpoint_url=http://localhost:9000 (one option each, repeat the flag)."
            )
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def location(path: str, values: list[str] | None) -> Any:
    """Where a command's store is: ``path`` itself, or with ``--storage-option`` given, the
    object-store location they configure (a ``gradlog.store.fs.ObjectPath``).

    Raises:
        InputError: storage options were given for a local path, or are malformed.
        GradlogError: the URL cannot be opened with them.
    """
    options = storage_options(values)
    if not options:
        return path
    from gradlog.store.fs import is_object, store_path

    where = store_path(path, options)
    if not is_object(where):
        raise InputError(
            f"--storage-option configures a URL store (s3://bucket/run.gradlog, ...), but "
            f"{path} is a local path: drop the option, or give the store's URL."
        )
    return where


def records_of(run: Run, step: str | None, datum: str | None) -> tuple[Any, Any]:
    """The parsed ``--step`` and ``--datum`` selections of a command that reads records.

    Raises:
        InputError: a selection is malformed.
        SelectionError: together they select no record (``--step 5:2``), naming what the run
            has, so an empty table never passes for an answer.
    """
    steps, datums = selector(step, "step"), selector(datum, "datum")
    if (step is not None or datum is not None) and run.records(steps, datums).num_rows == 0:
        given = " and ".join(f"--{w} {t}" for w, t in (("step", step), ("datum", datum)) if t)
        known = run.steps.column("step").to_pylist()
        span = f"steps {known[0]}..{known[-1]} ({len(known)} committed)" if known else "no steps"
        raise SelectionError(
            f"{given} selects no record of this run, which has {span} and "
            f"{run.datums.num_rows} records. Pick steps and datums it has (gradlog ls RUN "
            "lists them; A:B is a half-open range, so its start must be below its end)."
        )
    return steps, datums


def scan_args(max_memory: str | None, *, bar: bool = True) -> ScanArgs:
    """The library's scan keywords of a command: its --max-memory, and a progress bar when
    ``bar`` and stderr is a terminal."""
    return {"max_memory": max_memory, "progress": bar and sys.stderr.isatty()}


def open_run(run_path: str, storage: list[str] | None = None) -> Run:
    """Open a run (with the command's ``--storage-option`` values) and read its step and record
    tables now, so that a damaged or missing store fails here, before any output
    (``Run(path)`` is what ``gradlog.open`` returns)."""
    run = Run(location(run_path, storage))
    run.steps, run.datums  # noqa: B018 - read the tables now, so errors surface here
    return run


def with_gradients(run: Run, params: list[str] | None) -> list[str]:
    """The parameters of a command that reads gradients: those given with -p, or by default
    every one that keeps gradients, saying which are skipped (form 'norm' keeps only norms).

    Raises:
        SelectionError: a parameter given, or every parameter, keeps only norms.
    """
    forms = dict(zip(run.params.column("name").to_pylist(), run.params.column("form").to_pylist()))
    if params:
        for name in params:  # unknown names: the library's error lists the recorded ones
            if forms.get(name) == "norm":
                raise SelectionError(
                    f"parameter {name!r} was recorded with form 'norm': only each record's exact "
                    f"norm is kept (gradlog norms RUN -p {name} shows them), so it has no "
                    "gradients to read. Choose other parameters with -p/--param."
                )
        return list(params)
    names = [n for n, form in forms.items() if form != "norm"]
    skipped = [n for n, form in forms.items() if form == "norm"]
    if not names:
        raise SelectionError(
            "every parameter was recorded with form 'norm': only each record's exact norm is "
            "kept, so there are no gradients to read. Use gradlog norms or gradlog influence "
            "--self."
        )
    if skipped:
        err_console.print(
            f"note: skipping {escape(', '.join(skipped))}: recorded with form 'norm' (only "
            "norms are kept: gradlog norms shows them). Choose parameters with -p/--param.",
            highlight=False, soft_wrap=True,
        )
    return names
