"""What the backends on a POSIX file system share: I/O threads, vectored I/O, errors.

Used by the ``file`` and ``hf3fs`` backends:

- :class:`IOThreads` - spreads a batch over a lazily started thread pool (the caller's
  thread takes the first part) and stops it on close.
- :func:`advance` - drop bytes from the front of a list of buffers (partial ``preadv`` /
  ``pwritev``).
- :func:`io_error` and :func:`write_error` - an ``OSError`` as a typed error; a full disk
  or quota is a :class:`~sglang_storage.errors.CapacityError` naming the free space.
- :func:`process_alive`, :func:`subdirs`, :func:`namespace_of` - what index rebuilds need.
- :class:`FileMode` and :func:`make_dirs` - who may read what a backend creates: private
  to its user by default (files ``0600``, directories ``0700``), or shared with a group.
- Temporary files (:class:`TempNames`, :func:`create_temp`, :func:`probe_temp`,
  :func:`remove_dead_temp`): named ``.sgs-<pid>-<token>-<serial>.<kind>``, and locked
  (``flock``) by their writer for as long as they exist under that name. The kernel drops
  the lock when the writer dies, in any PID namespace, so "unlocked" means "its writer is
  gone" on every process of the host; the pid in the name is for people only. Nothing
  without the ``.sgs-`` prefix is ever removed.
- Store roots (:func:`claim_root`, :func:`write_marker`): a root carries a marker file;
  a non-empty directory without one is not a store and is refused unless adopted.
- Staying inside a store (:func:`open_beneath`, :func:`open_store_dir`,
  :func:`read_control`): paths under a store are opened relative to directory
  descriptors and never through a symbolic link, so a link planted by another local user
  cannot make a backend read, write, rename or delete anything outside its root; control
  files (markers, class files) are read only when they are small regular files, so a
  FIFO planted in their place never blocks.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import enum
import errno
import fcntl
import itertools
import json
import os
import re
import secrets
import shutil
import socket
import stat
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, TypeVar

from sglang_storage import __version__
from sglang_storage.core import DataKind, Namespace, ObjectKey, Shard
from sglang_storage.errors import (
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    StorageError,
)

__all__ = [
    "CONTROL_LIMIT",
    "IOV_MAX",
    "LINK_ERRNOS",
    "TEMP_PREFIX",
    "FileMode",
    "IOThreads",
    "TempNames",
    "TempState",
    "advance",
    "claim_root",
    "create_temp",
    "exposed",
    "file_mode_of",
    "io_error",
    "make_dirs",
    "make_dirs_beneath",
    "marker_fields",
    "namespace_of",
    "narrowed",
    "open_beneath",
    "open_store_dir",
    "probe_temp",
    "process_alive",
    "process_umask",
    "read_control",
    "read_marker",
    "remove_dead_temp",
    "remove_own_tree",
    "subdirs",
    "temp_writer",
    "write_error",
    "write_marker",
]

IOV_MAX: Final = 1024
"""The most buffers one ``preadv``/``pwritev`` call takes (Linux ``UIO_MAXIOV``)."""

_SPACE_ERRNOS: Final = (errno.ENOSPC, errno.EDQUOT)

T = TypeVar("T")
R = TypeVar("R")


class IOThreads:
    """A batch spread over ``threads`` threads: the caller's and a pool started on first use.

    :meth:`map_parts` learns how late the pool's threads start on a part (the wake-up of a
    thread, long on a virtual machine) and how long this kind of work takes per byte, and
    gives the caller's own part that much more work, so that every part ends at about the
    same time and the caller does not sleep waiting for the pool; a batch too small to
    gain from the pool runs on the caller's thread alone.

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
        # How late pool parts started in recent batches (a median resists one slow wake-up).
        self._lags: collections.deque[float] = collections.deque(maxlen=_LAGS)
        self._lag_s: float | None = None  # their median
        self._alone = 0  # batches run on the caller's thread alone since the pool last ran
        self._pace: dict[tuple[str, int], float] = {}  # seconds per byte, by work and size

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
        futures = []
        inline: list[Sequence[T]] = []
        for at, part in enumerate(parts[1:], start=1):
            try:
                futures.append(pool.submit(_run_all, work, part))
            except RuntimeError:  # the interpreter is exiting: the pool takes no more work
                inline = parts[at:]
                break
        results = _run_all(work, parts[0])
        for future in futures:
            results.extend(future.result())
        for part in inline:  # after the submitted parts: the order stays the items'
            results.extend(_run_all(work, part))
        return results

    def map_parts(
        self,
        work: Callable[[list[T]], R],
        items: Sequence[T],
        *,
        sizes: Sequence[int] | None = None,
        kind: str = "",
    ) -> list[R]:
        """What ``work`` returns for each contiguous part of ``items``, in the parts' order.

        At most one part per thread, the first on the caller's thread. ``sizes`` are the
        items' bytes (default: 1 each) and ``kind`` names the work; together they tell
        which past batches this one's pace is learned from.

        Raises:
            BackendUnavailableError: the threads were closed.
        """
        if self._threads == 1 or len(items) < 2:
            return [work(list(items))]
        weights = [1] * len(items) if sizes is None else list(sizes)
        key = (kind, max(1, sum(weights) // len(weights)).bit_length())
        cuts = self._cuts(weights, self._pace.get(key))
        if len(cuts) == 2 and self._alone >= _LAGS:
            cuts = self._cuts(weights, None)  # the pool again, now and then: is it still late?
        if len(cuts) == 2:  # the caller alone: no pool part would start in time to help
            self._alone += 1
            started = time.perf_counter()
            whole = work(list(items))
            self._learn(key, sum(weights), time.perf_counter() - started, None)
            return [whole]
        self._alone = 0
        pool = self._executor()
        futures = []
        inline: list[list[T]] = []
        for at in range(1, len(cuts) - 1):
            part = list(items[cuts[at] : cuts[at + 1]])
            try:
                futures.append(pool.submit(_timed, work, part))
            except RuntimeError:  # the interpreter is exiting: the pool takes no more work
                inline = [list(items[cuts[i] : cuts[i + 1]]) for i in range(at, len(cuts) - 1)]
                break
        started = time.perf_counter()
        results = [work(list(items[: cuts[1]]))]
        mine = time.perf_counter() - started
        lag = 0.0
        for future in futures:
            began, result = future.result()
            lag = max(lag, began - started)
            results.append(result)
        results += [work(part) for part in inline]  # after the submitted parts, in order
        self._learn(key, sum(weights[: cuts[1]]), mine, lag if futures else None)
        return results

    def _cuts(self, weights: list[int], pace: float | None) -> list[int]:
        """Where the parts of a batch of items of ``weights`` begin, and its end.

        The caller's part is ahead by what it does while the pool's threads start, so the
        pool's parts (which share the rest evenly by weight) end before it and the caller
        never sleeps waiting for them.
        """
        count, total = len(weights), sum(weights)
        parts = min(self._threads, count)
        ahead = 0.0
        if pace is not None and pace > 0 and self._lag_s is not None:
            ahead = _MARGIN * self._lag_s / pace  # what the caller does before a pool part starts
        share = (total - ahead) / parts  # each pool part's weight
        if share <= 0:
            return [0, count]
        cuts, goal, running = [0], total - (parts - 1) * share, 0
        for at, weight in enumerate(weights):
            if len(cuts) == parts:
                break
            if running + weight / 2 > goal and at > cuts[-1]:  # its middle is past the goal
                cuts.append(at)
                goal += share
            running += weight
        cuts.append(count)
        return cuts

    def _learn(self, key: tuple[str, int], weight: int, seconds: float, lag: float | None) -> None:
        """Fold one batch into the estimates (a lost race between threads loses a sample)."""
        if weight > 0:
            pace = seconds / weight
            before = self._pace.get(key)
            self._pace[key] = pace if before is None else before + _ALPHA * (pace - before)
        if lag is not None:
            self._lags.append(lag)
            self._lag_s = statistics.median(self._lags)

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


_ALPHA: Final = 0.25
"""Weight of the newest batch in :class:`IOThreads`' moving average of a work's pace."""
_MARGIN: Final = 1.25
"""How much more than the pool's start delay the caller's part is ahead: a pool part that
ends after the caller's costs the caller a wake-up; one that ends a little before, nothing."""
_LAGS: Final = 16
"""Recent pool start delays :class:`IOThreads` takes the median of; also how many batches
in a row it runs on the caller's thread alone before it tries the pool again."""


def _timed(work: Callable[[list[T]], R], part: list[T]) -> tuple[float, R]:
    """When ``work`` of ``part`` began on this thread, and what it returned."""
    return time.perf_counter(), work(part)


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


# ---------------------------------------------------------------------- permissions


class FileMode(enum.Enum):
    """Who may read (and write) the files and directories a backend creates.

    Chosen by its chmod spelling (``"0640"``) or its name (``"group_read"``). KV pages
    encode users' prompts, so the default keeps them to the store's own user.
    """

    PRIVATE = "0600"
    """The store's user only: files ``0600``, directories ``0700`` (the default)."""
    GROUP_READ = "0640"
    """Also readable by the directories' group: files ``0640``, directories ``0750``."""
    GROUP_WRITE = "0660"
    """Also readable and writable by the group (servers of several users sharing one
    store): files ``0660``, directories ``0770``."""

    @property
    def file_bits(self) -> int:
        """The permission bits of a file."""
        return int(self.value, 8)

    @property
    def dir_bits(self) -> int:
        """The permission bits of a directory: the file's, searchable where readable."""
        bits = self.file_bits
        return bits | (bits & 0o444) >> 2


def file_mode_of(value: object) -> object:
    """``value`` as a :class:`FileMode` where it names one, else as given (for validation).

    Names one: a member, its chmod spelling (``"0640"``), its name (``"group_read"``) or
    its bits (``0o640``).
    """
    if isinstance(value, str):
        for member in FileMode:
            if value in (member.value, member.name.lower(), member.name):
                return member
    elif isinstance(value, int) and not isinstance(value, bool):
        for member in FileMode:
            if value == member.file_bits:
                return member
    return value


def exposed(mode: int, allowed: int) -> bool:
    """Whether permission bits ``mode`` let group or others do more than ``allowed`` lets them."""
    return bool(mode & 0o077 & ~allowed)


def narrowed(mode: int, allowed: int) -> int:
    """``mode`` less what it lets group and others do beyond ``allowed`` (adds nothing)."""
    return mode & 0o700 | mode & allowed & 0o077


def process_umask() -> int:
    """This process's umask (read from ``/proc`` where it can be, without changing it)."""
    try:
        with Path("/proc/self/status").open() as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o077)  # only ever narrows what another thread creates meanwhile
    os.umask(old)
    return old


def make_dirs(path: str, mode: int, *, exact: bool) -> None:
    """Create directory ``path``, and its missing parents, with permission bits ``mode``.

    Unlike :func:`os.makedirs`, every directory it creates gets ``mode``, not only the last.
    (Plain ``os`` calls on a ``str``: the ``file`` backend calls this on its write path.)

    Args:
        path: The directory.
        mode: Permission bits of each directory created.
        exact: Also ``chmod`` each one (where the umask would narrow ``mode``).
    """
    try:
        os.mkdir(path, mode)  # noqa: PTH102
    except FileExistsError:
        return
    except FileNotFoundError:
        parent = os.path.dirname(path)  # noqa: PTH120
        if not parent or parent == path:
            raise
        make_dirs(parent, mode, exact=exact)
        try:
            os.mkdir(path, mode)  # noqa: PTH102
        except FileExistsError:
            return
    if exact:
        os.chmod(path, mode)  # noqa: PTH101


# ---------------------------------------------------------------------- inside a store

# openat2(2): struct open_how, and the resolve flags that keep a lookup inside its
# directory (linux/openat2.h). 437 on every architecture with the common syscall table.
_SYS_OPENAT2: Final = 437
_RESOLVE_NO_SYMLINKS: Final = 0x04
_RESOLVE_BENEATH: Final = 0x08
# Where a link or a way out of the directory stopped a lookup.
LINK_ERRNOS: Final = frozenset({errno.ELOOP, errno.EXDEV, errno.ENOTDIR})


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


def _load_openat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)
    return call


_syscall = _load_openat2()
_openat2_works: bool | None = None if _syscall is not None else False
# Each kind of open's struct, and the pointer passed (kept alive by the struct).
_hows: dict[tuple[int, int, bool], tuple[_OpenHow, Any]] = {}
_HOW_SIZE: Final = ctypes.sizeof(_OpenHow)
_AT_FDCWD: Final = -100


def _openat2(dir_fd: int | None, path: str, flags: int, mode: int) -> int | None:
    """``openat2`` with no links (beneath ``dir_fd`` if given); None where it is missing."""
    global _openat2_works
    if _openat2_works is False or _syscall is None:
        return None
    how = _hows.get((flags, mode, dir_fd is not None))
    if how is None:
        resolve = _RESOLVE_NO_SYMLINKS | (_RESOLVE_BENEATH if dir_fd is not None else 0)
        struct = _OpenHow(flags, mode if flags & os.O_CREAT else 0, resolve)
        how = _hows[(flags, mode, dir_fd is not None)] = (struct, ctypes.byref(struct))
    at = _AT_FDCWD if dir_fd is None else dir_fd
    fd = _syscall(_SYS_OPENAT2, at, path.encode(), how[1], _HOW_SIZE)
    if fd >= 0:
        _openat2_works = True
        return int(fd)
    code = ctypes.get_errno()
    if _openat2_works is None and code in (errno.ENOSYS, errno.EPERM):
        _openat2_works = False  # an old kernel, or a seccomp filter: walk instead
        return None
    raise OSError(code, f"{os.strerror(code)}: {path!r}")


def openat2_usable() -> bool:
    """Whether ``openat2`` may work here (not yet refused by the kernel or a filter)."""
    return _openat2_works is not False


def open_beneath(dir_fd: int | None, path: str, flags: int, mode: int = 0o600) -> int:
    """Open ``path`` under directory ``dir_fd`` (None: ``path`` is absolute), no link followed.

    No component may be a symbolic link and, with ``dir_fd``, the lookup never leaves it
    (``openat2`` with ``RESOLVE_NO_SYMLINKS``, and ``RESOLVE_BENEATH``; where the kernel
    lacks it, one ``O_NOFOLLOW`` open per component). Every call resolves ``path`` anew.

    Raises:
        OSError: as ``open``; a link on the way is ``ELOOP`` (or ``ENOTDIR``/``EXDEV``,
            see :data:`LINK_ERRNOS`).
    """
    fd = _openat2(dir_fd, path, flags | os.O_CLOEXEC, mode)
    if fd is not None:
        return fd
    if dir_fd is None:
        base = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return open_beneath(base, path.lstrip("/"), flags, mode)
        finally:
            os.close(base)
    *parents, last = path.split("/")
    current = dir_fd
    try:
        for part in parents:
            step = os.open(
                part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current
            )
            if current != dir_fd:
                os.close(current)
            current = step
        fd = os.open(last, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=current)
        if flags & os.O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):
            os.close(fd)  # O_PATH | O_NOFOLLOW opens a link itself
            raise OSError(errno.ELOOP, f"{os.strerror(errno.ELOOP)}: {path!r}")
        return fd
    finally:
        if current != dir_fd:
            os.close(current)


def open_store_dir(name: str, dir_fd: int | None, *, what: str) -> int:
    """A descriptor of store directory ``name`` (in ``dir_fd``), refusing a link there.

    Raises:
        BackendUnavailableError: ``name`` is a symbolic link or not a directory.
        OSError: it cannot be opened (``FileNotFoundError`` when it is missing).
    """
    try:
        return os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError as error:
        if error.errno not in LINK_ERRNOS:
            raise
        raise BackendUnavailableError(
            backend=what,
            reason=f"{name} in the store is a symbolic link or not a directory "
            f"({error.strerror}); a store's own directories must be real directories, so "
            "that nothing outside the root is ever read, written or removed",
        ) from error


def make_dirs_beneath(base: str, path: str, mode: int, *, exact: bool) -> tuple[int, list[int]]:
    """Open directory ``base/path``, creating what is missing under ``base``, no link followed.

    ``base`` is an absolute path, which must exist. Returns the directory's descriptor
    (``O_RDONLY``) and descriptors of the directories that gained an entry, the parent
    of each directory created (to fsync them). The caller closes them all.

    Raises:
        OSError: as ``mkdir``/``open``; a link on the way is one of :data:`LINK_ERRNOS`.
    """
    changed: list[int] = []
    try:
        return _open_or_make(base, path, mode, exact, changed), changed
    except BaseException:
        for fd in changed:
            os.close(fd)
        raise


def _open_or_make(base: str, path: str, mode: int, exact: bool, changed: list[int]) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY
    with contextlib.suppress(FileNotFoundError):
        return open_beneath(None, f"{base}/{path}", flags)
    parent, _, leaf = path.rpartition("/")
    if parent:
        parent_fd = _open_or_make(base, parent, mode, exact, changed)
    else:
        parent_fd = open_beneath(None, base, flags)
    try:
        try:
            os.mkdir(leaf, mode, dir_fd=parent_fd)
        except FileExistsError:
            created = False
        else:
            created = True
        fd = os.open(leaf, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        if created:
            try:
                if exact:
                    os.fchmod(fd, mode)
                changed.append(os.dup(parent_fd))
            except BaseException:
                os.close(fd)
                raise
        return fd
    finally:
        os.close(parent_fd)


# ---------------------------------------------------------------------- temporary files


TEMP_PREFIX: Final = ".sgs-"
"""How the name of every temporary file (or directory) of a backend starts."""

_TEMP_NAME: Final = re.compile(
    r"\.sgs-([1-9][0-9]{0,9})-([0-9a-f]{16})-([0-9]{1,20})\.([a-z]{1,8})"
)
_TEMP_TRIES: Final = 64
# flock answers these where a filesystem has no locks: liveness is then unknown.
_NO_LOCKS: Final = frozenset({errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, errno.ENOSYS})


class TempNames:
    """Fresh names for one backend instance's temporary files.

    ``.sgs-<pid>-<token>-<serial>.<kind>``: the token is random per instance and the pid is
    read at each name, so no two instances or forked processes ever pick the same one.
    """

    def __init__(self) -> None:
        self._token = secrets.token_hex(8)
        self._serial = itertools.count()

    def next(self, directory: str | Path, kind: str) -> str:
        """A name in ``directory`` for a temporary file of ``kind`` (``tmp``, ``clear``...)."""
        return f"{directory}/{self.name(kind)}"

    def name(self, kind: str) -> str:
        """A fresh file name (no directory) for a temporary file of ``kind``."""
        return f"{TEMP_PREFIX}{os.getpid()}-{self._token}-{next(self._serial)}.{kind}"


def temp_writer(name: str) -> int | None:
    """The pid in temporary file name ``name``; None when it is no name of ours.

    The pid is the writer's in its own PID namespace: for people, not for liveness.
    """
    match = _TEMP_NAME.fullmatch(name)
    return None if match is None else int(match[1])


def _try_lock(fd: int) -> bool | None:
    """Take ``fd``'s exclusive lock without waiting.

    Returns True when taken, False when held elsewhere, None when the filesystem has no
    locks.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in _NO_LOCKS:
            return None
        raise
    return True


def create_temp(
    names: TempNames,
    directory: str | Path,
    kind: str,
    mode: int,
    *,
    exact: bool,
    dir_fd: int | None = None,
    nofollow: bool = False,
) -> tuple[int, str]:
    """Create a new temporary file in ``directory``, holding its lock while ``fd`` is open.

    Returns its descriptor (open for writing) and path (with ``dir_fd``: its name in that
    directory). Keep the descriptor open until the file has been renamed or removed: once
    it is closed, any process may take the file for an orphan and remove it.

    Args:
        names: Where its name comes from.
        directory: Where it is created.
        kind: The end of its name (what it is for).
        mode: Its permission bits.
        exact: Also set them with ``fchmod`` (where the umask would narrow them).
        dir_fd: A descriptor of ``directory``: the file is created relative to it.
        nofollow: Follow no symbolic link on the way (``directory`` is then absolute).
    """
    for _ in range(_TEMP_TRIES):
        path = names.next(directory, kind) if dir_fd is None else names.name(kind)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if nofollow:
            fd = open_beneath(None, path, flags, mode)
        else:
            fd = os.open(path, flags, mode, dir_fd=dir_fd)
        try:
            held = _try_lock(fd)
            # A checker that opened it between the create and the lock has removed it.
            if held is not False and os.fstat(fd).st_nlink > 0:
                if exact:
                    os.fchmod(fd, mode)
                return fd, path
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path, dir_fd=dir_fd)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, f"no temporary file in {directory} stayed ours to lock")


class TempState(enum.Enum):
    """What a look at one temporary file (or directory) found."""

    LIVE = "live"
    """Its writer holds its lock: a write in progress."""
    DEAD = "dead"
    """Nobody holds its lock: its writer is gone (from :func:`remove_dead_temp`: removed)."""
    UNKNOWN = "unknown"
    """It cannot be told (no locks on this filesystem, or no permission): kept."""
    NOT_TEMP = "not_temp"
    """Named like one of ours, but not a regular file or directory: never ours."""
    GONE = "gone"
    """No longer there (or renamed since)."""


def _open_temp(path: str, dir_fd: int | None) -> int | None:
    """``path`` opened to lock, not following links; None if it is no file or directory."""
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None
        raise
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        os.close(fd)
        return None
    return fd


def _look(path: str, dir_fd: int | None = None) -> tuple[TempState, str, int | None]:
    try:
        fd = _open_temp(path, dir_fd)
    except FileNotFoundError:
        return TempState.GONE, "no longer there", None
    except OSError as error:
        return TempState.UNKNOWN, f"cannot open it to see ({error.strerror})", None
    if fd is None:
        return TempState.NOT_TEMP, "not a regular file or directory", None
    try:
        held = _try_lock(fd)
    except OSError as error:
        os.close(fd)
        return TempState.UNKNOWN, f"cannot lock it to see ({error.strerror})", None
    if held is None:
        os.close(fd)
        return TempState.UNKNOWN, "this filesystem has no file locks to tell by", None
    if not held:
        os.close(fd)
        return TempState.LIVE, "its writer holds its lock", None
    return TempState.DEAD, "nobody holds its lock: its writer is gone", fd


def probe_temp(path: str) -> tuple[TempState, str]:
    """Whether the writer of temporary file (or directory) ``path`` still runs, and why.

    Changes nothing (a lock taken to look is dropped at once).
    """
    state, reason, fd = _look(path)
    if fd is not None:
        os.close(fd)
    return state, reason


def remove_dead_temp(path: str, *, dir_fd: int | None = None) -> tuple[TempState, str]:
    """Remove temporary file (or directory) ``path`` if its writer is gone.

    Returns :attr:`TempState.DEAD` once it is removed; in any other state it is kept.

    Args:
        path: The file (with ``dir_fd``: its name in that directory).
        dir_fd: A descriptor of the directory it is in.

    Raises:
        OSError: it could not be removed.
    """
    state, reason, fd = _look(path, dir_fd)
    if fd is None:
        return state, reason
    try:
        # Under its lock no writer renames it: the name still names this file or not.
        found, held = os.stat(path, dir_fd=dir_fd, follow_symlinks=False), os.fstat(fd)
        if (found.st_ino, found.st_dev) != (held.st_ino, held.st_dev):
            return TempState.GONE, "renamed since it was looked at"
        if stat.S_ISDIR(held.st_mode):
            shutil.rmtree(path, dir_fd=dir_fd)
        else:
            os.unlink(path, dir_fd=dir_fd)
    except FileNotFoundError:
        return TempState.GONE, "no longer there"
    finally:
        os.close(fd)
    return TempState.DEAD, reason


def remove_own_tree(path: str, *, dir_fd: int | None = None) -> None:
    """Remove this process's temporary directory ``path``, holding its lock meanwhile.

    Links in it are removed, never followed. Failures are ignored: what is left is an
    orphan any later open removes.
    """
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return
    try:
        if _try_lock(fd) is not False:  # held elsewhere: that process is removing it
            shutil.rmtree(path, ignore_errors=True, dir_fd=dir_fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- store roots


CONTROL_LIMIT: Final = 1 << 16
"""The most bytes a control file (a store marker, an hf3fs class file) may hold."""


def read_control(
    path: Path | str, *, limit: int = CONTROL_LIMIT, dir_fd: int | None = None
) -> bytes:
    """The content of control file ``path``: a regular file of at most ``limit`` bytes.

    Opened without blocking and without following a link in its place, so a FIFO, device
    or link planted there is refused at once instead of hanging the caller.

    Raises:
        OSError: it cannot be opened or read.
        ValueError: it is not a regular file, or holds more than ``limit`` bytes.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if status.st_size > limit:
            raise ValueError(f"{path} holds {status.st_size} bytes, more than {limit}")
        data = os.pread(fd, limit + 1, 0)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path} holds more than {limit} bytes")
    return data


def read_marker(path: Path) -> dict[str, object]:
    """The fields of a store marker file (none when it holds no JSON object).

    Raises:
        OSError: it cannot be read.
        ValueError: it is not a small regular file of JSON (a FIFO is refused, not read).
    """
    content = json.loads(read_control(path))
    return dict(content) if isinstance(content, dict) else {}


def claim_root(root: Path, marker: str, *, owner: str, adopt: bool) -> bool:
    """Whether directory ``root`` holds its store marker; refuse one that is no store.

    An empty directory is a new store; entries named with :data:`TEMP_PREFIX` do not
    count (another process may be creating the store).

    Args:
        root: The directory.
        marker: The name of the marker file.
        owner: The config class, for the error.
        adopt: Accept a non-empty directory without a marker.

    Raises:
        ConfigError: ``root`` holds other things and no marker, and ``adopt`` is false.
        OSError: ``root`` cannot be listed.
    """
    path = root / marker
    if os.path.lexists(path):
        return True
    with os.scandir(root) as entries:
        others = sorted(e.name for e in entries if not e.name.startswith(TEMP_PREFIX))
    if os.path.lexists(path):  # created by another process meanwhile
        return True
    if others and not adopt:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(
            owner=owner,
            field="root",
            value=str(root),
            reason=f"is not empty ({shown}) and holds no store marker {marker}: it is no "
            "store of this backend, and nothing in it is the backend's to change",
            allowed="a missing or empty directory (a new store), an existing store, or "
            "adopt=True to make this directory a store (what the backend did not write is "
            "never touched)",
        )
    return False


def marker_fields(backend: str, fields: Mapping[str, object]) -> dict[str, object]:
    """A new store's marker: ``fields`` (format version first) and who created it."""
    return {
        **fields,
        "backend": backend,
        "created_by": f"sglang-storage {__version__}",
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "creator": {"uid": os.getuid(), "pid": os.getpid(), "host": socket.gethostname()},
    }


def write_marker(
    root: Path,
    marker: str,
    fields: Mapping[str, object],
    names: TempNames,
    *,
    mode: int,
    exact: bool,
) -> None:
    """Write ``root``'s marker file with ``fields`` unless one exists (it is then kept).

    The marker appears whole or not at all (a locked temporary file, linked into place).
    """
    fd, tmp = create_temp(names, root, "marker", mode, exact=exact)
    try:
        try:
            data = (json.dumps(dict(fields), indent=1) + "\n").encode()
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, root / marker)
        finally:
            Path(tmp).unlink()
    finally:
        os.close(fd)
