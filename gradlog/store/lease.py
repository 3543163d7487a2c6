"""The writer lease: one writer per store at a time (FORMAT.md section 15).

A writer holds the store's lease while it records: the object ``writer-lease.json`` at the
store's root, holding its owner's identity (host, boot id, pid namespace, pid, the process's
start time), a random token and timestamps. It is created atomically, so of two writers
starting together one gets it and the other a :class:`~gradlog.errors.StoreLockedError`
naming the holder:

- **local file systems**: written under a temporary name and hard-linked into place
  (``link`` fails when the name exists: an exclusive create whose file is never seen
  half-written; also on NFS), or ``O_CREAT | O_EXCL`` where links are not supported;
- **object stores**: a conditional PUT (``If-None-Match: *`` on S3, through fsspec's
  ``mode="create"``), then read back; a file system without conditional writes gets fsspec's
  check-then-PUT, which two writers starting within one round trip can both pass: the loser
  notices at its first commit (below).

The writer renews the lease from its own thread when it commits a step (no extra thread):
locally by touching the file (its mtime is the heartbeat), on object storage by rewriting it.
Before each commit it verifies that the lease still holds its token; if the lease was broken
or taken, it refuses to commit and fails with ``StoreLockedError`` (the caller sees it at its
next call or at ``close``). Readers need no lease.

A lease whose owner is provably dead is taken over without asking: same host (same host name,
boot id and pid namespace) and the pid not running, or running with another start time; or
this very process, whose writer was dropped without closing. A lease of another host cannot be
checked that way: once it has not been renewed for :data:`LEASE_TTL_S` it is called expired,
and may be broken explicitly (``break_lease=True``, :func:`break_lease`, ``gradlog unlock``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradlog._version import __version__
from gradlog.errors import StoreLockedError
from gradlog.store import fs as sfs
from gradlog.store.fs import StorePath

__all__ = [
    "LEASE_FILE",
    "LEASE_TTL_S",
    "Lease",
    "LeaseInfo",
    "WriterNote",
    "acquire",
    "break_lease",
    "read_lease",
    "writer_note",
]

log = logging.getLogger("gradlog")

LEASE_FILE = "writer-lease.json"
"""The lease's name at the store root (readers ignore it)."""

LEASE_TTL_S = 300.0
"""Seconds after its last renewal at which another host's lease is called expired."""

_RENEW_EVERY_S = 30.0  # a commit renews the lease when it is older than this
_LIVE: set[str] = set()  # tokens of the leases this process holds, for stale ones of its own
_LIVE_LOCK = threading.Lock()
_MEMORY_LOCK = threading.Lock()  # memory:// has no conditional write; it lives in one process


# -- who we are --------------------------------------------------------------------------------
def _read_first_line(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.readline().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None if there
    is no such process; 0 where it cannot be read (other systems)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    except OSError:
        return 0
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields and fields[0] in ("Z", "X"):  # a zombie has finished running
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _identity() -> dict[str, Any]:
    """This process as a lease names its owner."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _pid_ns(),
        "pid": pid,
        "start_ticks": _start_ticks(pid) or 0,
        "user": os.environ.get("USER") or os.environ.get("USERNAME") or "",
        "command": " ".join(sys.argv)[:200],
    }


def _pid_alive(pid: int, start_ticks: int) -> bool:
    """Whether process ``pid`` of this host runs and is the one that started at
    ``start_ticks`` (0: unknown, any process of that pid counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    except OSError:
        return True  # cannot tell: assume alive (never break a live writer's lease)
    now = _start_ticks(pid)
    if now is None:
        return False
    return not (start_ticks and now and now != start_ticks)


# -- the lease as stored -----------------------------------------------------------------------
@dataclass(frozen=True)
class LeaseInfo:
    """A lease as read from a store.

    Attributes:
        owner: The holder's identity (host, boot_id, pid_ns, pid, start_ticks, user, command).
        token: The holder's random token.
        acquired: When it was acquired (seconds since the epoch).
        renewed: Its last renewal (seconds since the epoch; locally the file's mtime).
        ttl_s: Seconds without renewal after which it is called expired.
        gradlog_version: The holder's gradlog.
    """

    owner: dict[str, Any]
    token: str
    acquired: float
    renewed: float
    ttl_s: float
    gradlog_version: str

    @classmethod
    def from_json(cls, value: Any, mtime: float | None) -> LeaseInfo:
        """Parse a lease; ``mtime``: the file's modification time (a local heartbeat).

        Raises:
            ValueError: not a lease.
        """
        if not isinstance(value, Mapping) or not isinstance(value.get("owner"), Mapping):
            raise ValueError("not a lease object")
        owner = dict(value["owner"])
        if not isinstance(owner.get("pid"), int) or not isinstance(value.get("token"), str):
            raise ValueError("a lease needs owner.pid (int) and token (str)")
        renewed = float(value.get("renewed", 0.0))
        if mtime is not None:
            renewed = max(renewed, mtime)
        return cls(owner, str(value["token"]), float(value.get("acquired", 0.0)), renewed,
                   float(value.get("ttl_s", LEASE_TTL_S)), str(value.get("gradlog_version", "")))

    @property
    def same_host(self) -> bool:
        """Whether the holder runs on this host, in this pid namespace (pids comparable)."""
        me = _identity()
        return all(self.owner.get(k) == me[k] for k in ("host", "boot_id", "pid_ns"))

    def state(self, now: float | None = None) -> str:
        """``"mine"`` (a writer of this process holds it), ``"stale-mine"`` (this process,
        whose writer is gone), ``"alive"`` (a live process of this host), ``"dead"`` (a
        process of this host that is gone), ``"live-elsewhere"`` (another host, renewed
        within its TTL) or ``"expired"`` (another host, not renewed for its TTL)."""
        if self.same_host:
            pid, start = int(self.owner["pid"]), int(self.owner.get("start_ticks") or 0)
            if pid == os.getpid() and _pid_alive(pid, start):
                with _LIVE_LOCK:
                    return "mine" if self.token in _LIVE else "stale-mine"
            return "alive" if _pid_alive(pid, start) else "dead"
        now = time.time() if now is None else now
        return "expired" if now - self.renewed > self.ttl_s else "live-elsewhere"

    def holder(self) -> str:
        """The holder, for messages: ``pid 12 on host 'a' (user u, `python train.py`)``."""
        o = self.owner
        who = f"pid {o.get('pid')} on host {o.get('host')!r}"
        extra = ", ".join(x for x in (
            f"user {o['user']}" if o.get("user") else "",
            f"`{o['command']}`" if o.get("command") else "",
        ) if x)
        return f"{who}{f' ({extra})' if extra else ''}"

    def describe(self) -> str:
        """The holder and the lease's age, for messages."""
        age = max(0.0, time.time() - self.renewed)
        return f"{self.holder()}, lease renewed {age:.0f} s ago"


def _lease_path(root: StorePath) -> StorePath:
    return root / LEASE_FILE


def read_lease(root: str | os.PathLike[str] | StorePath) -> LeaseInfo | None:
    """The lease of the store at ``root``, or None when no writer holds it.

    Raises:
        StoreLockedError: a lease object is there but is not a valid lease (it can only be
            broken explicitly: :func:`break_lease`).
    """
    path = _lease_path(sfs.store_path(root))
    for attempt in range(20):
        try:
            data = path.read_bytes()
            mtime = path.stat().st_mtime if isinstance(path, Path) else None
        except FileNotFoundError:
            return None
        try:
            return LeaseInfo.from_json(json.loads(data.decode("utf-8")), mtime)
        except (UnicodeDecodeError, ValueError, TypeError):
            if attempt < 19:  # O_EXCL fallback: being written right now
                time.sleep(0.025)
    raise StoreLockedError(
        f"{path} is not a valid writer lease (a damaged or foreign file). If no writer "
        f"records into {root}, remove it: gradlog unlock {root} --force."
    )


# -- what a reader is told ---------------------------------------------------------------------
@dataclass(frozen=True)
class WriterNote:
    """What a reader should know of a store whose writer lease is there (``gradlog info``,
    ``gradlog verify``): a writer is recording into it, or did not close it.

    Attributes:
        state: :meth:`LeaseInfo.state`'s, or ``"damaged"`` (a lease file that is no lease).
        text: One sentence saying it, with what to do.
        lease: The lease, None when damaged.
    """

    state: str
    text: str
    lease: LeaseInfo | None

    @property
    def live(self) -> bool:
        """Whether a writer may be recording into the store now (its process runs, or
        another host renewed the lease within its TTL)."""
        return self.state in ("mine", "alive", "live-elsewhere")


def writer_note(root: str | os.PathLike[str] | StorePath) -> WriterNote | None:
    """The store's writer lease as a reader should hear of it; None when no writer holds it
    (every writer closed the store). A writer killed (SIGKILL, a lost node) leaves its lease:
    on this host its process is gone; on another host only the lease's age tells, so one
    renewed within its TTL reads as live."""
    try:
        info = read_lease(root)
    except StoreLockedError:
        return WriterNote("damaged", f"its writer lease ({LEASE_FILE}) is damaged: a writer "
                          "may not have closed the store. If none records into it, remove "
                          f"it with `gradlog unlock {root} --force`.", None)
    if info is None:
        return None
    state = info.state()
    who, age, ttl = info.holder(), max(0.0, time.time() - info.renewed), info.ttl_s
    text = {
        "mine": f"a writer of this process is recording into the store ({who}, lease "
                f"renewed {age:.0f} s ago): reads see its committed steps so far.",
        "alive": f"a writer is recording into the store now: {who} runs (lease renewed "
                 f"{age:.0f} s ago); reads see its committed steps so far.",
        "stale-mine": f"its writer did not close the store: a recorder of this process "
                      f"({who}) was dropped unclosed, so the run stops at its last committed "
                      "step; the next writer takes the lease over.",
        "dead": f"its writer did not close the store: {who} is gone (killed or crashed), so "
                "the run was cut short at its last committed step. GradRecorder(..., "
                "resume=True) continues it (taking the lease over).",
        "live-elsewhere": f"a writer on another host holds its lease, renewed {age:.0f} s ago "
                          f"(within its {ttl:.0f} s TTL): {who} is recording, or was cut "
                          f"short less than {ttl:.0f} s ago.",
        "expired": f"its writer did not close the store: {who}, on another host, has not "
                   f"renewed its lease for {age:.0f} s (TTL {ttl:.0f} s): cut short, or still "
                   f"running there but stalled. If it is gone, `gradlog unlock {root}` breaks "
                   "the lease (break_lease=True in Python).",
    }[state]
    return WriterNote(state, text, info)


# -- acquiring ---------------------------------------------------------------------------------
def _new_lease(ttl_s: float) -> dict[str, Any]:
    now = time.time()
    return {"owner": _identity(), "token": secrets.token_hex(16), "acquired": now,
            "renewed": now, "ttl_s": ttl_s, "gradlog_version": __version__}


def _create_local(path: Path, data: bytes) -> bool:
    """Create ``path`` with ``data`` exclusively; False when it exists."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic and exclusive, and the file is complete once visible
        return True
    except FileExistsError:
        return False
    except OSError as e:  # no hard links here: an exclusive create
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                           errno.EMLINK, errno.ENOSYS):
            raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _create_object(path: sfs.ObjectPath, data: bytes) -> bool:
    """Create the object ``path`` with ``data`` by a conditional PUT; False when it exists."""
    protocols = path.fs.protocol if isinstance(path.fs.protocol, tuple) else (path.fs.protocol,)
    lock = _MEMORY_LOCK if "memory" in protocols else contextlib.nullcontext()
    with lock:
        try:
            path.fs.pipe_file(path.path, data, mode="create")
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError):  # an fsspec without modes: check, then PUT
            path.fs.invalidate_cache(path.path)
            if path.fs.exists(path.path):
                return False
            path.fs.pipe_file(path.path, data)
        path.fs.invalidate_cache(path.path)
    return True


def _create(path: StorePath, data: bytes) -> bool:
    if isinstance(path, Path):
        return _create_local(path, data)
    return _create_object(path, data)


def _remove_if(path: StorePath, token: str) -> bool:
    """Delete the lease at ``path`` if it still holds ``token``; True when it did (or when
    it was already gone). Locally the lease is first renamed away, so that a lease another
    writer created meanwhile is put back, not deleted."""
    if isinstance(path, Path):
        aside = path.with_name(f".{path.name}.{secrets.token_hex(6)}.broken")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return True
        try:
            info = LeaseInfo.from_json(json.loads(aside.read_bytes().decode("utf-8")), None)
            ours = info.token == token
        except (OSError, ValueError, TypeError, UnicodeDecodeError):
            ours = False
        if not ours:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)  # put the other writer's lease back
        aside.unlink()
        return ours
    try:
        info = LeaseInfo.from_json(json.loads(path.read_bytes().decode("utf-8")), None)
    except FileNotFoundError:
        return True
    except (ValueError, TypeError, UnicodeDecodeError):
        return False
    if info.token != token:
        return False
    path.unlink(missing_ok=True)
    return True


def _locked_message(root: StorePath, info: LeaseInfo, state: str, action: str) -> str:
    head = f"{root} is locked by a writer ({info.describe()}); {action} refused."
    if state == "mine":
        return (f"{head} This process holds it: a GradRecorder (or StoreWriter) on this path "
                "is still open. Close it (leave its `with` block or call rec.close()) first.")
    if state == "alive":
        return (f"{head} That process is running on this host. One writer per store: wait "
                f"for it to finish, stop it (kill {info.owner.get('pid')}), or record into "
                "another path. Readers (gradlog.open) need no lease.")
    if state == "expired":
        return (f"{head} It runs on another host and its lease expired (not renewed for "
                f"{info.ttl_s:.0f} s): the writer looks dead. If it is, break the lease: "
                f"pass break_lease=True, or run `gradlog unlock {root}`.")
    return (f"{head} It runs on another host and renewed its lease within the last "
            f"{info.ttl_s:.0f} s: wait for it to finish, or record into another path. If "
            f"you are sure it is dead, run `gradlog unlock {root} --force`.")


def break_lease(
    root: str | os.PathLike[str] | StorePath, *, force: bool = False
) -> LeaseInfo | None:
    """Remove the lease of the store at ``root`` left by a writer that is gone; returns the
    lease removed (None: there was none).

    A dead writer of this host, or an expired lease of another host, is broken as asked.
    ``force`` also breaks a lease that another host renewed within its TTL, or a lease file
    that cannot be read: the caller vouches that its writer is gone (a writer whose lease was
    broken refuses to commit when it notices).

    Raises:
        StoreLockedError: the holder is alive on this host (never broken), or renewed its
            lease from another host within its TTL and ``force`` is not set.
    """
    path = sfs.store_path(root)
    lease = _lease_path(path)
    try:
        info = read_lease(path)
    except StoreLockedError:
        if not force:
            raise
        lease.unlink(missing_ok=True)
        return None
    if info is None:
        return None
    state = info.state()
    if state in ("mine", "alive") or (state == "live-elsewhere" and not force):
        raise StoreLockedError(_locked_message(path, info, state, "breaking its lease"))
    if not _remove_if(lease, info.token):
        raise StoreLockedError(f"{path}: its lease changed while it was being broken (another "
                               "writer took it); read it again with `gradlog unlock`.")
    log.warning("gradlog: broke the writer lease of %s held by %s", path, info.describe())
    return info


class Lease:
    """A lease this process holds on one store (see the module doc).

    Use :func:`acquire` to get one.
    """

    def __init__(self, root: StorePath, record: dict[str, Any]) -> None:
        self.root = root
        self.path = _lease_path(root)
        self.token: str = record["token"]
        self._record = record
        self._renewed = time.monotonic()
        self.released = False
        with _LIVE_LOCK:
            _LIVE.add(self.token)

    def __del__(self) -> None:  # a writer dropped without close: its lease is stale
        with contextlib.suppress(Exception), _LIVE_LOCK:
            _LIVE.discard(self.token)

    def _lost(self, what: str, detail: str) -> StoreLockedError:
        return StoreLockedError(
            f"{self.root}: this writer's lease is {detail}, so {what} is refused: another "
            "writer may be recording into the store (its lease was broken by `gradlog unlock` "
            "or break_lease=True while this writer lived). Nothing more is written; steps "
            "committed before are intact. Check who records into the store before resuming."
        )

    def check(self, what: str) -> None:
        """Verify that this lease still holds the store before ``what`` (a commit), and
        renew it when due.

        Raises:
            StoreLockedError: the lease is gone or another writer's.
        """
        if self.released:
            raise self._lost(what, "released")
        try:
            info = read_lease(self.root)
        except StoreLockedError:
            raise self._lost(what, "damaged") from None
        if info is None:
            raise self._lost(what, "gone")
        if info.token != self.token:
            raise self._lost(what, f"now held by {info.describe()}")
        if time.monotonic() - self._renewed >= _RENEW_EVERY_S:
            self.renew()

    def renew(self) -> None:
        """Renew the lease (locally: touch it; on object storage: rewrite it)."""
        self._renewed = time.monotonic()
        if isinstance(self.path, Path):
            os.utime(self.path)
        else:
            self._record["renewed"] = time.time()
            self.path.write_bytes(json.dumps(self._record).encode("utf-8"))

    def release(self) -> None:
        """Give the lease up (only if it is still this writer's)."""
        if self.released:
            return
        self.released = True
        with _LIVE_LOCK:
            _LIVE.discard(self.token)
        with contextlib.suppress(OSError):
            _remove_if(self.path, self.token)


def acquire(
    root: StorePath, *, action: str, break_expired: bool = False, ttl_s: float = LEASE_TTL_S
) -> Lease:
    """Take the lease of the store at ``root`` (creating its directory locally).

    Args:
        root: The store.
        action: What the lease is for, for messages ("resume=True", "overwrite=True", ...).
        break_expired: Also take over an expired lease of another host (``break_lease``).
        ttl_s: The new lease's TTL.

    Raises:
        StoreLockedError: another writer holds the lease (see :func:`break_lease`).
    """
    if isinstance(root, Path):
        root.mkdir(parents=True, exist_ok=True)
    path = _lease_path(root)
    for _ in range(8):  # a lost race with another taker reads its lease next round
        record = _new_lease(ttl_s)
        if _create(path, json.dumps(record).encode("utf-8")):
            if not isinstance(path, Path):  # a backend without conditional PUTs: read back
                info = read_lease(root)
                if info is None or info.token != record["token"]:
                    holder = info.describe() if info else "another writer"
                    raise StoreLockedError(
                        f"{root}: another writer ({holder}) took the lease at the same time; "
                        f"{action} refused. Wait for it, or record into another path.")
            return Lease(root, record)
        info = read_lease(root)
        if info is None:
            continue  # released meanwhile
        state = info.state()
        if state in ("dead", "stale-mine") or (state == "expired" and break_expired):
            if _remove_if(path, info.token):
                log.warning("gradlog: took over the writer lease of %s from %s (%s)", root,
                            info.describe(), "gone" if state != "expired" else "expired")
            continue
        raise StoreLockedError(_locked_message(root, info, state, action))
    raise StoreLockedError(f"{root}: could not take the writer lease ({action}): other "
                           "writers keep taking it. Record into another path.")
