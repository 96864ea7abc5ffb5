"""What the backends on a POSIX file system share: I/O threads, vectored I/O, errors.

Used by the ``file`` and ``hf3fs`` backends:

- :class:`IOThreads` - spreads a batch over a lazily started thread pool (the caller's
  thread takes the first part) and stops it on close.
- :func:`advance` - drop bytes from the front of a list of buffers (partial ``preadv`` /
  ``pwritev``).
- :func:`io_error` and :func:`write_error` - an ``OSError`` as a typed error; a full disk
  or quota is a :class:`~sglang_storage.errors.CapacityError` naming the free space.
- :func:`process_alive`, :func:`subdirs`, :func:`namespace_of` - what orphan cleanup and
  index rebuilds need.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final, TypeVar

from sglang_storage.core import DataKind, Namespace, ObjectKey, Shard
from sglang_storage.errors import (
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    StorageError,
)

__all__ = [
    "IOV_MAX",
    "IOThreads",
    "advance",
    "io_error",
    "namespace_of",
    "process_alive",
    "subdirs",
    "write_error",
]

IOV_MAX: Final = 1024
"""The most buffers one ``preadv``/``pwritev`` call takes (Linux ``UIO_MAXIOV``)."""

_SPACE_ERRNOS: Final = (errno.ENOSPC, errno.EDQUOT)

T = TypeVar("T")
R = TypeVar("R")


class IOThreads:
    """A batch spread over ``threads`` threads: the caller's and a pool started on first use.

    Args:
        threads: Threads a batch is spread over (1: everything on the caller's thread).
        backend: The backend's name, for errors and thread names.
    """

    def __init__(self, threads: int, backend: str) -> None:
        self._threads = threads
        self._backend = backend
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def spread(self, work: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``work`` of every item, in order, in contiguous parts on the threads.

        Raises:
            BackendUnavailableError: the threads were closed.
        """
        if self._threads == 1 or len(items) < 2:
            return [work(item) for item in items]
        pool = self._executor()
        chunk = -(-len(items) // self._threads)
        parts = [items[i : i + chunk] for i in range(0, len(items), chunk)]
        futures = [pool.submit(_run_all, work, part) for part in parts[1:]]
        results = _run_all(work, parts[0])
        for future in futures:
            results.extend(future.result())
        return results

    def close(self) -> None:
        """Stop the pool after the work in flight; later batches raise."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise BackendUnavailableError(
                    backend=self._backend, reason="the backend was closed"
                )
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self._threads - 1,
                    thread_name_prefix=f"sglang-storage-{self._backend}",
                )
            return self._pool


def _run_all(work: Callable[[T], R], items: Sequence[T]) -> list[R]:
    return [work(item) for item in items]


def advance(views: list[memoryview], count: int) -> list[memoryview]:
    """Drop ``count`` bytes from the front of ``views``."""
    index = 0
    while index < len(views) and count >= views[index].nbytes:
        count -= views[index].nbytes
        index += 1
    rest = views[index:]
    if rest and count:
        rest[0] = rest[0][count:]
    return rest


def io_error(backend: str, operation: str, error: OSError) -> BackendIOError:
    """``error`` as the failure of ``operation`` of ``backend``."""
    return BackendIOError(backend=backend, operation=operation, reason=str(error), code=error.errno)


def write_error(
    backend: str, root: Path, key: ObjectKey, size: int, error: OSError
) -> StorageError:
    """A failed write of ``size`` bytes of ``key`` under ``root``: out of space or I/O."""
    if error.errno in _SPACE_ERRNOS:
        try:
            free = shutil.disk_usage(root).free
        except OSError:
            free = 0
        return CapacityError(
            resource=f"disk space under {root}",
            requested=size,
            available=free,
            hint=f"writing {key} failed: {error.strerror}",
        )
    return io_error(backend, f"write of {key}", error)


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def subdirs(path: Path) -> list[os.DirEntry[str]]:
    """The directories directly under ``path`` (none when it is missing)."""
    try:
        return [e for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def namespace_of(model: str, kind: str, shard: str) -> Namespace | None:
    """The namespace named by three directory names, or None when they name none."""
    try:
        return Namespace(model=model, kind=DataKind(kind), shard=Shard.from_label(shard))
    except (ValueError, ConfigError):
        return None
