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
"""

from __future__ import annotations

import contextlib
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
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final, TypeVar

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
    "IOV_MAX",
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
    "marker_fields",
    "namespace_of",
    "narrowed",
    "probe_temp",
    "process_alive",
    "process_umask",
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
        return f"{directory}/{TEMP_PREFIX}{os.getpid()}-{self._token}-{next(self._serial)}.{kind}"


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
    names: TempNames, directory: str | Path, kind: str, mode: int, *, exact: bool
) -> tuple[int, str]:
    """Create a new temporary file in ``directory``, holding its lock while ``fd`` is open.

    Returns its descriptor (open for writing) and path. Keep the descriptor open until
    the file has been renamed or removed: once it is closed, any process may take the
    file for an orphan and remove it.

    Args:
        names: Where its name comes from.
        directory: Where it is created.
        kind: The end of its name (what it is for).
        mode: Its permission bits.
        exact: Also set them with ``fchmod`` (where the umask would narrow them).
    """
    for _ in range(_TEMP_TRIES):
        path = names.next(directory, kind)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
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
                os.unlink(path)  # noqa: PTH108
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


def _open_temp(path: str) -> int | None:
    """``path`` opened to lock, not following links; None if it is no file or directory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None
        raise
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        os.close(fd)
        return None
    return fd


def _look(path: str) -> tuple[TempState, str, int | None]:
    try:
        fd = _open_temp(path)
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


def remove_dead_temp(path: str) -> tuple[TempState, str]:
    """Remove temporary file (or directory) ``path`` if its writer is gone.

    Returns :attr:`TempState.DEAD` once it is removed; in any other state it is kept.

    Raises:
        OSError: it could not be removed.
    """
    state, reason, fd = _look(path)
    if fd is None:
        return state, reason
    try:
        # Under its lock no writer renames it: the name still names this file or not.
        found, held = os.lstat(path), os.fstat(fd)
        if (found.st_ino, found.st_dev) != (held.st_ino, held.st_dev):
            return TempState.GONE, "renamed since it was looked at"
        if stat.S_ISDIR(held.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)  # noqa: PTH108
    except FileNotFoundError:
        return TempState.GONE, "no longer there"
    finally:
        os.close(fd)
    return TempState.DEAD, reason


def remove_own_tree(path: str) -> None:
    """Remove this process's temporary directory ``path``, holding its lock meanwhile.

    Failures are ignored: what is left is an orphan any later open removes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if _try_lock(fd) is not False:  # held elsewhere: that process is removing it
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- store roots


def read_marker(path: Path) -> dict[str, object]:
    """The fields of a store marker file (none when it holds no JSON object).

    Raises:
        OSError: it cannot be read.
        ValueError: it is not JSON.
    """
    content = json.loads(path.read_text())
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
