"""The writer's background thread: tasks run in order, fed through a queue bounded in bytes.

:meth:`Worker.put` blocks while the queue is full (backpressure: nothing is ever dropped). A
task's exception stops the thread's work: every later task is skipped, and the writer raises
:func:`failure` on the caller's thread at its next call. An ``atexit`` hook
(:func:`drainer`) lets daemon threads finish what was queued before the interpreter exits.
"""

from __future__ import annotations

import collections
import errno
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from gradlog.errors import GradlogError, StoreLockedError, StoreWriteError
from gradlog.store.fs import StorePath

__all__ = ["Task", "Worker", "drainer", "failure"]


@dataclass
class Task:
    """One unit of work of a :class:`Worker`."""

    what: str  # for error messages: "step 5 (micro-batch 0)"
    run: Callable[[], None]
    nbytes: int = 0


@dataclass
class Worker:
    """A thread running tasks in order, fed through a queue bounded in bytes."""

    capacity: int
    name: str
    _tasks: collections.deque[Task | None] = field(default_factory=collections.deque)
    _queued: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)
    error: BaseException | None = None
    failed_task: str = ""
    blocked_s: float = 0.0  # caller time spent waiting for room (backpressure)
    max_queued: int = 0
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (a daemon: :func:`drainer` waits for it at exit)."""
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def put(self, task: Task | None) -> None:
        """Queue ``task`` (None: stop); blocks while the queue holds ``capacity`` bytes (an
        item larger than the capacity waits for an empty queue). After a failure, tasks are
        dropped: nothing more is written (the stop signal still is queued)."""
        nbytes = task.nbytes if task is not None else 0
        with self._cond:
            t0 = time.perf_counter()
            while self.error is None and self._queued > 0 and self._queued + nbytes > self.capacity:
                self._cond.wait()
            self.blocked_s += time.perf_counter() - t0
            if self.error is not None and task is not None:
                return
            self._tasks.append(task)
            self._queued += nbytes
            self.max_queued = max(self.max_queued, self._queued)
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every queued task ran (or the thread failed)."""
        with self._cond:
            while self.error is None and (self._tasks or self._queued):
                self._cond.wait()

    def join(self) -> None:
        """Run what is queued, then stop the thread."""
        self.put(None)
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._tasks:
                    self._cond.wait()
                task = self._tasks[0]
            if task is None:
                return
            if self.error is None:
                try:
                    task.run()
                except BaseException as e:  # re-raised on the caller's thread
                    with self._cond:
                        self.error = e
                        self.failed_task = task.what
            with self._cond:
                self._tasks.popleft()
                self._queued -= task.nbytes
                self._cond.notify_all()
            del task  # not kept while waiting: a writer dropped unclosed can be collected


def drainer(*workers: Worker | None) -> Callable[[], None]:
    """An atexit hook waiting for ``workers``; holds them weakly (no leak if never run)."""
    refs = [weakref.ref(w) for w in workers if w is not None]

    def drain() -> None:
        for ref in refs:
            alive = ref()
            if alive is not None:
                alive.wait_idle()

    return drain


def failure(worker: Worker, path: StorePath, last_committed: int | None) -> GradlogError:
    """The error the caller sees for ``worker``'s failure: what failed, which steps are
    committed, and how to continue (``worker.error`` must be set): a
    :class:`~gradlog.errors.StoreLockedError` when the writer lost its lease, else a
    :class:`~gradlog.errors.StoreWriteError`."""
    error = worker.error
    committed = (
        f"Steps up to {last_committed} are committed and intact"
        if last_committed is not None
        else "No step was committed"
    )
    if isinstance(error, StoreLockedError):
        return StoreLockedError(f"{error} ({committed}; {worker.failed_task} was not.)")
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        fix = (
            "Free disk space (or record less: params=..., dtype='bfloat16', every=N), then "
            "continue with GradRecorder(..., resume=True)."
        )
    elif isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EROFS):
        fix = "Make the store writable, then continue with GradRecorder(..., resume=True)."
    else:
        fix = "Fix the cause, then continue with GradRecorder(..., resume=True)."
    return StoreWriteError(
        f"gradlog's writer failed writing {worker.failed_task} into {path}: "
        f"{type(error).__name__}: {error}. {committed}; nothing after them was committed. "
        f"{fix}"
    )
