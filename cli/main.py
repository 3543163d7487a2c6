"""``gradlog`` command: train the built-in run, inspect stores.

Every command is a thin layer over the library: it parses options, calls gradlog, and shows
the result. Library errors become one red line and exit code 1, never a traceback: the
commands let :class:`~gradlog.errors.GradlogError` propagate, and the app's group turns it
into that line here.

The commands live by group: ``record`` (train), ``inspection`` (info, ls, show, norms,
verify), ``analyze`` (influence, export, plot); ``_args`` holds what the commands reading a
run share, ``_render`` how results are shown.
"""

from __future__ import annotations

import warnings
from typing import Any

import typer
from typer.core import TyperGroup

from gradlog._version import __version__
from gradlog.cli import analyze, inspection, record, store_admin
from gradlog.cli._render import cli_words, fail, note
from gradlog.errors import GradlogError


class _Group(TyperGroup):
    """The app's command group: a library error in any command becomes one line, exit code 1."""

    def invoke(self, ctx: Any) -> Any:  # Any: click's Context, vendored by newer typer
        """Run the command; print a :class:`GradlogError` as one red line and exit 1."""
        try:
            with warnings.catch_warnings():  # library warnings are notes to the user here
                warnings.simplefilter("default")
                warnings.showwarning = note
                return super().invoke(ctx)
        except GradlogError as e:
            fail(GradlogError(cli_words(str(e))))
        except Exception as e:
            if not _storage_refused(e):
                raise  # a bug: its traceback is what a report needs
            fail(GradlogError(
                f"the store's storage refused access ({type(e).__name__}: {e}). Check the "
                "path, its permissions, or the object store's credentials (AWS_* environment "
                "variables, ~/.aws/credentials, fsspec's configuration)."
            ))


def _storage_refused(e: BaseException) -> bool:
    """A permission or credentials error of the filesystem or an object store's client."""
    module = type(e).__module__ or ""
    return isinstance(e, PermissionError) or module.startswith(
        ("botocore", "aiobotocore", "s3fs", "gcsfs", "google.auth", "azure"))


app = typer.Typer(
    name="gradlog",
    help="Record the gradient of every datum at every training step; inspect the records.",
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gradlog {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True,
        help="Print gradlog's version and exit.",
    ),
) -> None:
    """Record the gradient of every datum at every training step; inspect the records."""
# in this order in `gradlog --help`
app.command(cls=record.TrainCommand)(record.train)
app.command()(inspection.info)
app.command()(inspection.ls)
app.command()(inspection.show)
app.command()(inspection.norms)
app.command()(analyze.influence)
app.command()(analyze.export)
app.command()(analyze.plot)
app.command()(inspection.verify)
app.command()(store_admin.unlock)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
