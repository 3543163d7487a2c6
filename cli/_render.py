"""How every command shows its result: the consoles, the one-line error, tables, numbers, JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Container, Sequence
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def fail(error: Exception) -> NoReturn:
    """Print ``error`` as one red line on stderr and exit with code 1 (never a traceback)."""
    # escaped: messages hold brackets ("pip install 'gradlog[plot]'", lists) rich would eat
    err_console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False,
                      soft_wrap=True)
    raise typer.Exit(code=1)


READ_WORDS = (
    # keywords of the scans' options, as the commands that read a run name them
    (r"(?<![\w(.-])max_memory\b ?=? ?", "--max-memory "),
    (r"(?<![\w(.-])kind=", "--kind "),
)
"""A library message's Python keywords and the options of the commands that read a run."""


def cli_words(message: str, words: Sequence[tuple[str, str]] = READ_WORDS) -> str:
    """A library message, naming the command's options (``--seq-len``, ``--max-memory``)
    instead of the Python keywords behind them (``block_size=``, ``max_memory=``), which the
    CLI does not take. The library's messages stay as they are for Python callers."""
    for pattern, replacement in words:
        message = re.sub(pattern, replacement, message)
    return message


def note(message: Warning | str, *_: object, **__: object) -> None:
    """A library warning as one yellow line on stderr (a ``warnings.showwarning``): not
    Python's two lines with a source path, and never mixed into ``--json`` output."""
    err_console.print(f"[yellow]note:[/] {escape(str(message))}", highlight=False,
                      soft_wrap=True)


class LiteralTable(Table):
    """A rich table whose title and cells are shown as they are: stored strings (parameter
    names such as ``[red]head.weight``, paths, class names) are never read as markup, so a
    name shows, and can be copied into ``-p``, exactly as it was recorded."""

    def __init__(self, *args: Any, title: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, title=None if title is None else escape(title), **kwargs)

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        super().add_row(*(escape(c) if isinstance(c, str) else c for c in cells), **kwargs)


def table(
    title: str, columns: Sequence[str], *, left: Container[str] = (), names: Container[str] = ()
) -> Table:
    """A table with these columns: those in ``left`` left-justified, numbers right.

    No cell is cut short with an ellipsis: on a narrow terminal the columns in ``names``
    (parameter names, which two records may share all but the end of, and which are copied
    into ``-p``) keep their width, and the other columns fold their cells onto more lines
    (never narrower than their header).
    """
    view = LiteralTable(title=title)
    for column in columns:
        view.add_column(column, justify="left" if column in left else "right",
                        no_wrap=column in names, overflow="fold", min_width=len(column))
    return view


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def shape_text(shape: Sequence[int]) -> str:
    """``[4, 3]`` -> ``"4x3"``; ``[]`` -> ``"scalar"``."""
    return "x".join(map(str, shape)) or "scalar"


def share(part: int, whole: int) -> str:
    """``part`` as a percentage of ``whole``, ``-`` when ``whole`` is 0."""
    return f"{100 * part / whole:.2f}%" if whole else "-"


def num(value: Any, digits: int = 4) -> str:
    """A table cell: floats to ``digits`` significant digits, None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: None instead."""
    if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def echo_json(value: Any) -> None:
    """Print ``value`` as indented JSON on stdout (NaN and infinities as null)."""
    typer.echo(json.dumps(_finite(value), indent=2))
