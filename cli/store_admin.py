"""Commands that administer a store rather than read it: ``unlock`` (break a writer lease)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.markup import escape

from gradlog.cli._args import RunArg, StorageOpt, location
from gradlog.cli._render import console
from gradlog.errors import NotAStoreError, StoreLockedError
from gradlog.store.fs import store_path
from gradlog.store.lease import break_lease, read_lease


def unlock(
    run_path: RunArg,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Also break a lease that another host renewed within its TTL, or a damaged "
            "lease file: you vouch that its writer is gone.",
        ),
    ] = False,
    storage: StorageOpt = None,
) -> None:
    """Break the writer lease of a store whose writer is gone (a crashed job on another host).

    A writer of this host that is still running is never unlocked; one that is gone needs no
    unlock (the next writer takes its lease over). Exit code 0 when no lease is left.
    """
    where = location(run_path, storage)
    damaged = False
    try:
        held = read_lease(where)
    except StoreLockedError:  # a damaged lease file: only --force removes it
        if not force:
            raise
        held, damaged = None, True
    if held is None and not damaged and not (store_path(where) / "zarr.json").exists():
        raise NotAStoreError(f"{where} is not a gradlog store (no zarr.json there): nothing "
                             "to unlock. Name the store's directory (NAME.gradlog).")
    with _unlogged_break():
        removed = break_lease(where, force=force)
    if held is None and not damaged:
        console.print(f"{escape(str(where))}: no writer holds the lease; nothing to do.",
                      highlight=False, soft_wrap=True)
        return
    holder = removed.describe() if removed is not None else "a damaged lease file"
    console.print(f"{escape(str(where))}: broke the writer lease of {escape(holder)}.",
                  highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _unlogged_break() -> Iterator[None]:
    """Without the library's log line that it broke a lease: the command says so itself (on
    stdout), and the log's would repeat it on stderr."""
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("gradlog: broke the writer lease")

    logger = logging.getLogger("gradlog")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
