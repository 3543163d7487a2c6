"""Where a store's bytes live: a local directory, or an object store reached through fsspec.

A store location is either a :class:`pathlib.Path` (a local directory; also ``file://`` URLs)
or an :class:`ObjectPath` (any other fsspec URL: ``s3://bucket/run.gradlog``,
``memory://run.gradlog``, ...). :class:`ObjectPath` offers the part of the ``pathlib`` API the
store uses, so readers and writers join and test paths the same way for both; the few raw
operations that differ (vectored writes, atomic replacement, ranged reads, syncing) are the
functions of this module, whose local branch is exactly the code the writer and reader used
before object storage existed (the local path is benchmarked and must not slow down).

Object stores have no rename and no fsync. What they guarantee instead (S3 since 2020, GCS,
Azure, fsspec's memory store): a PUT of a whole object is atomic (readers see the old object
or the new one, never a part) and durable once it returns, and a LIST issued after a PUT
returned sees the object. So on object storage a part is written with one PUT under its final
name (no temporary), and a sync is a no-op. The commit order of FORMAT.md is unchanged.

An :class:`ObjectPath` never leaves its store: joining a ``..`` or ``.`` segment, an empty
segment or an absolute path raises, so a crafted store cannot make gradlog read or write
outside the URL it was given (local stores are protected by the symlink checks of the writer).

fsspec options (credentials, an S3 endpoint) come from fsspec's own configuration
(``fsspec.config.conf["s3"] = {...}``, ``FSSPEC_S3_*`` environment variables) or the
provider's (``AWS_*``), or pass ``storage_options`` to :func:`store_path`.
"""

from __future__ import annotations

import mmap
import os
import posixpath
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradlog.errors import GradlogError, StoreFormatError

__all__ = [
    "ObjectPath",
    "StorePath",
    "fsync_path",
    "is_object",
    "listdir",
    "open_ranges",
    "read_parquet",
    "remove_tree",
    "store_path",
    "write_buffers",
    "write_bytes_atomic",
    "write_parquet_atomic",
]


@dataclass(frozen=True)
class _Stat:
    st_size: int


class ObjectPath:
    """A path inside a store on an fsspec file system (``s3://``, ``memory://``, ...).

    Immutable; ``root`` is the store's own location, which no derived path may leave.
    """

    def __init__(self, fs: Any, path: str, root: str | None = None) -> None:
        self.fs = fs
        self.path = path.rstrip("/") or "/"
        self.root = self.path if root is None else root

    # -- pathlib-like names -----------------------------------------------------------------
    def __truediv__(self, other: str | os.PathLike[str]) -> ObjectPath:
        rel = os.fspath(other)
        segments = rel.split("/")
        if rel.startswith("/") or any(s in ("", ".", "..") for s in segments):
            raise StoreFormatError(
                f"path {rel!r} inside {self} is not a plain relative path (it has an empty, "
                "'.' or '..' segment); gradlog never reads or writes outside a store."
            )
        return ObjectPath(self.fs, f"{self.path}/{rel}", self.root)

    def __str__(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and (self.fs, self.path) == (other.fs, other.path)

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> ObjectPath:
        if self.path == self.root:
            raise StoreFormatError(f"{self} is the store's root; gradlog never goes above it.")
        return ObjectPath(self.fs, posixpath.dirname(self.path), self.root)

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    # -- queries ----------------------------------------------------------------------------
    def _refresh(self) -> None:
        # s3fs caches listings; the commit log must be read as it is now
        self.fs.invalidate_cache(self.path)

    def exists(self) -> bool:
        self._refresh()
        return bool(self.fs.exists(self.path))

    def is_file(self) -> bool:
        self._refresh()
        return bool(self.fs.isfile(self.path))

    def is_dir(self) -> bool:
        self._refresh()
        return bool(self.fs.isdir(self.path))

    def is_symlink(self) -> bool:
        return False  # object stores have no links

    def listdir(self) -> list[str]:
        """Names of the entries below this prefix (files and "directories")."""
        self._refresh()
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        names = []
        for entry in entries:
            entry = str(entry).rstrip("/")
            if entry != self.path:
                names.append(posixpath.basename(entry))
        return names

    def iterdir(self) -> Iterator[ObjectPath]:
        for name in self.listdir():
            yield self / name

    def rglob(self, pattern: str) -> Iterator[ObjectPath]:
        if pattern != "*":
            raise GradlogError(f"internal: ObjectPath.rglob supports '*' only, got {pattern!r}.")
        self._refresh()
        for entry in self.fs.find(self.path):
            rel = str(entry)[len(self.path) + 1 :]
            if rel:
                yield self / rel

    def stat(self) -> _Stat:
        return _Stat(int(self.fs.size(self.path)))

    # -- reads and writes -------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.path))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        self.fs.pipe_file(self.path, data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        # Object stores have no directories: a prefix exists once an object is under it. The
        # memory file system keeps pseudo-directories, so create them where it has them.
        self.fs.makedirs(self.path, exist_ok=True)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise


StorePath = Path | ObjectPath
"""A store location or a path inside one."""


def store_path(
    location: str | os.PathLike[str] | ObjectPath,
    storage_options: Mapping[str, Any] | None = None,
) -> StorePath:
    """The store at ``location``: a local path, a ``file://`` URL (both a :class:`Path`), or
    another fsspec URL (an :class:`ObjectPath`).

    Raises:
        GradlogError: the URL's protocol needs a package that is not installed.
    """
    if isinstance(location, (ObjectPath, Path)):
        return location
    text = os.fspath(location)
    if "://" not in text:
        return Path(text)
    protocol = text.split("://", 1)[0]
    if protocol == "file":
        return Path(text[len("file://") :])
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise GradlogError(
            f"{text} is a URL; stores on object storage need fsspec: "
            "pip install fsspec s3fs (or, in gradlog's folder, pip install -e '.[s3]')."
        ) from None
    try:
        fs, path = url_to_fs(text, **dict(storage_options or {}))
    except (ImportError, ValueError) as e:
        known = ", ".join(sorted(fsspec.available_protocols())[:12])
        raise GradlogError(
            f"cannot open {text}: {e}. For s3:// install 's3fs' (pip install s3fs); "
            f"fsspec knows the protocols {known}, ..."
        ) from None
    if not path.strip("/"):
        raise GradlogError(
            f"{text} names no store inside the bucket; add a path: {text}/run.gradlog"
        )
    return ObjectPath(fs, path)


def is_object(path: StorePath) -> bool:
    """Whether ``path`` is on object storage (no rename, no fsync)."""
    return isinstance(path, ObjectPath)


# -- raw operations: the local branch is the writer's and reader's original code ---------------
def listdir(path: StorePath) -> list[str]:
    """Entry names in ``path``, like :func:`os.listdir`."""
    if isinstance(path, ObjectPath):
        return path.listdir()
    return os.listdir(path)


def write_buffers(path: StorePath, buffers: list[Any]) -> int:
    """Create or replace the file ``path`` with ``buffers`` concatenated; returns its size.

    Locally one ``writev`` (no copy), or for a file of :data:`DIRECT_MIN_BYTES` or more one
    direct write (:func:`_write_direct`); on object storage one PUT of the whole object.
    """
    if isinstance(path, ObjectPath):
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        return path.write_bytes(data)
    return _writev_file(path, buffers)


DIRECT_MIN_BYTES = 1 << 20
"""Local files of this size or more are written with ``O_DIRECT`` where the file system takes
it. A buffered write spends most of its CPU time in the kernel's copy into freshly allocated
page-cache pages: 53 ms of CPU per 33 MiB measured on the project's 2-core VM, against 8 ms
for a copy into one reused aligned buffer written directly, at the same disk bandwidth. A
writer thread beside compute on every core must not need a core of its own for that copy."""

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # Linux (0 elsewhere: never direct)
_DIRECT_WINDOW = 64 << 20
"""Bytes of a direct write copied and written at once (a multiple of the alignment): the
aligned buffer of a writing thread never holds more, whatever a shard's size."""
_DIRECT_ALIGN = 4096  # offsets, lengths and addresses of direct writes: the largest usual
# logical block size
_no_direct: set[int] = set()  # st_dev of local file systems that refused O_DIRECT
_aligned = threading.local()  # per thread: a page-aligned buffer reused across writes


def _open_new(path: Path, extra: int = 0) -> int:
    # O_NOFOLLOW: a shard name that is a symbolic link (a crafted store) is never followed
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0) | extra
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if path.is_symlink():
            raise StoreFormatError(
                f"{path} is a symbolic link; gradlog never writes through a link out of a "
                "store. Copy the store without links and resume the copy."
            ) from e
        raise


def _writev_file(path: Path, buffers: list[Any]) -> int:
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(len(v) for v in views)
    if total >= DIRECT_MIN_BYTES and _O_DIRECT:
        written = _write_direct(path, views, total)
        if written is not None:
            return written
    fd = _open_new(path)
    try:
        total = 0
        while views:
            batch = views[:1024]  # IOV_MAX on Linux
            expected = sum(len(v) for v in batch)
            written = os.writev(fd, batch)
            total += written
            if written == expected:  # the common case: everything went out
                del views[: len(batch)]
                continue
            while written >= len(views[0]):  # a short write: resume inside a buffer
                written -= len(views.pop(0))
            views[0] = views[0][written:]
        return total
    finally:
        os.close(fd)


def _write_direct(path: Path, views: list[memoryview], total: int) -> int | None:
    """``views`` written past the page cache: copied into this thread's aligned buffer a
    window of at most :data:`_DIRECT_WINDOW` bytes at a time, each window written in whole
    blocks, the file then cut to ``total`` bytes (the bytes on disk are exactly those of a
    buffered write). None, having written nothing that stays, where the file system does not
    take direct writes (tmpfs on older kernels, some network file systems): the caller
    writes buffered, as it will for that file system from then on."""
    import errno

    try:
        device = os.stat(path.parent).st_dev
    except OSError:
        return None
    if device in _no_direct:
        return None
    size = min(_DIRECT_WINDOW, -(-total // _DIRECT_ALIGN) * _DIRECT_ALIGN)
    buffer = getattr(_aligned, "buffer", None)
    if buffer is None or len(buffer) < size:
        # an anonymous map is page-aligned; grown up to a window, freed with the thread
        buffer = _aligned.buffer = mmap.mmap(-1, size)
    try:
        fd = _open_new(path, _O_DIRECT)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        _no_direct.add(device)
        return None
    out = memoryview(buffer)[:size]
    try:
        written = filled = 0  # bytes in the file, bytes in the window
        pending = [v for v in views if len(v)]
        while pending or filled:
            while pending and filled < size:  # fill the window
                take = min(size - filled, len(pending[0]))
                out[filled : filled + take] = pending[0][:take]
                filled += take
                pending[0] = pending[0][take:]
                if not len(pending[0]):
                    pending.pop(0)
            whole = -(-filled // _DIRECT_ALIGN) * _DIRECT_ALIGN  # the last window: padded
            out[filled:whole] = bytes(whole - filled)  # (cut off below; zeros meanwhile)
            done = 0
            while done < whole:
                done += os.pwrite(fd, out[done:whole], written + done)
            written += filled
            filled = 0
        os.ftruncate(fd, total)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        _no_direct.add(device)  # the open was taken, the write refused
        return None
    finally:
        os.close(fd)
        out.release()
    return total


def write_bytes_atomic(path: StorePath, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, whole.

    Locally a temporary (a dot file, ignored by readers) renamed into place; on object
    storage one PUT, which is atomic by itself.
    """
    if isinstance(path, ObjectPath):
        path.write_bytes(data)
        return
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a link left in its place is removed, never followed
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_parquet_atomic(table: Any, path: StorePath, *, durable: bool = False) -> None:
    """Write ``table`` as the parquet file ``path`` (snappy), atomically as
    :func:`write_bytes_atomic`; ``durable`` fsyncs a local temporary before the rename.

    Encoded in memory, without column statistics or dictionaries: the parts are small, read
    whole (never filtered by statistics), and these took most of the writer thread's time
    per step for forms that store little (2-3 ms of a step's 9 measured, small GPT). Snappy,
    not zstd: an index part of 16 records and 44 columns took 1.07 ms with zstd against
    0.51 ms, 4,096 records 3.9 against 2.2 ms, for 3-8% fewer bytes (per-datum norms and
    losses are random floats)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="snappy", write_statistics=False,
                   use_dictionary=False)
    data = sink.getvalue()
    if isinstance(path, ObjectPath):
        path.write_bytes(data.to_pybytes())
        return
    tmp = path.with_name("." + path.name + ".tmp")  # dot files are ignored by readers
    tmp.unlink(missing_ok=True)  # a link left in its place is removed, never followed
    fd = _open_new(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_path(path: Path) -> None:
    """``fsync`` the local file or directory ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_parquet(path: StorePath, schema: Any = None, columns: list[str] | None = None) -> Any:
    """Read the parquet file ``path`` (a pyarrow table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(path, ObjectPath):
        return pq.read_table(pa.BufferReader(path.read_bytes()), schema=schema, columns=columns)
    return pq.read_table(path, schema=schema, columns=columns)


def arrow_filesystem(path: StorePath) -> Any:
    """The pyarrow file system and path strings for reading files below ``path`` with
    ``pyarrow.dataset``: ``(None, str)`` locally."""
    if isinstance(path, ObjectPath):
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        return PyFileSystem(FSSpecHandler(path.fs))
    return None


def arrow_path(path: StorePath) -> str:
    """``path`` as the file system of :func:`arrow_filesystem` names it."""
    return path.path if isinstance(path, ObjectPath) else str(path)


def remove_tree(path: StorePath) -> None:
    """Delete the store at ``path`` and everything below it."""
    if isinstance(path, ObjectPath):
        path.fs.rm(path.path, recursive=True)
        path.fs.invalidate_cache(path.path)
        return
    import shutil

    shutil.rmtree(path)


class _Ranges:
    """Sized, ranged reads of one file (``pread`` locally, ranged GETs on object storage)."""

    def __init__(self, size: int, read: Any, fd: int | None = None) -> None:
        self.size = size
        self._read = read
        self.fd = fd  # a local file's descriptor (scatter reads: os.preadv), else None

    def pread(self, length: int, offset: int) -> bytes:
        data: bytes = self._read(length, offset)
        if len(data) != length:  # a short read at the end of a truncated file
            from gradlog.errors import StoreCorruptError

            raise StoreCorruptError(f"read {len(data)} of {length} bytes at offset {offset}.")
        return data


@contextmanager
def open_ranges(path: StorePath) -> Iterator[_Ranges]:
    """Open ``path`` for ranged reads. Raises FileNotFoundError when it is absent."""
    if isinstance(path, ObjectPath):
        fs, key = path.fs, path.path
        size = int(fs.size(key))

        def get(n: int, off: int) -> bytes:  # keywords: s3fs's third positional is version_id
            return bytes(fs.cat_file(key, start=off, end=off + n)) if n else b""

        yield _Ranges(size, get)
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        yield _Ranges(os.fstat(fd).st_size, lambda n, off: os.pread(fd, n, off),
                      fd if hasattr(os, "preadv") else None)
    finally:
        os.close(fd)
