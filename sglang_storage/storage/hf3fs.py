"""The ``hf3fs`` backend: self-checking objects in slots of large files on 3FS.

3FS favours few large files over many small ones, so objects live at fixed offsets
("slots") inside big data files, sized up front, rather than one file per object. Data
moves through 3FS's usrbio client (``hf3fs_fuse.io``) when it is importable and the root
is on a 3FS mount, and otherwise through plain POSIX calls on the mount (the same layout
either way). Layout under ``root``::

    sglang-storage-hf3fs.json                  marker: format and layout version
    classes/<model>/<kind>/<shard>/s<size>/    one slot class: a namespace and a slot size
        class.json                             its geometry, fixed when it is created
        lock                                   byte-range locks: one byte per set
        00000.data ... <data_files - 1>.data   data files, created when first written
    tmp/.sgs-<pid>-<token>-<serial>.json       class.json files being created (locked)
    quarantine/                                copies of slots that failed verification

A root is a store once it holds the marker: an existing directory that is not empty and
has none is refused (``adopt=True`` takes it over), and only ``.sgs-`` temporary files
whose writer no longer holds their lock are ever removed. Everything the backend creates
is private to its user (files ``0600``, directories ``0700``) unless ``file_mode`` shares
it with a group; the marker records the mode.

**Slots and classes.** An object of ``n`` payload bytes takes one slot of
``HEADER_SIZE + n`` rounded up to 4 KiB, in the class of its namespace and that slot size.
A class has ``data_files`` data files of ``data_file_size // slot_size`` slots each, cut
into sets of ``ways`` consecutive slots. Each slot holds the object's 512-byte header
(:mod:`.format`) followed by its payload, so any slot is verified on its own: a slot that
is torn, stale or overwritten reads as corrupt or absent, never as wrong bytes.

**The shared index is the slots themselves.** A key's set is a hash of its name, the
same in every process; the key lives in one of that set's ``ways`` slots, found by reading
their headers (a per-process hint of where each key was last seen saves the probe). So a
key written by one process is found by every other one with no index file to keep in
step, and reopening rebuilds the in-process index by reading the slot headers (holes of
the sparse data files are skipped). The price: a key can only go into its own set, so a
set whose ``ways`` slots all hold other objects must give one up (the least recently
used, as this process saw them) - or, without an eviction policy, the write fails with
:class:`~sglang_storage.errors.CapacityError`.

**Writers** take the set's lock - a thread lock of this instance, then an
open-file-description ``fcntl`` lock on the set's byte of the class's ``lock`` file, which
the kernel drops if the process dies - so a slot is never handed to two writers, in any
process. Under it a writer checks the key is not already there, picks a free slot (or a
victim), zeroes an old header, writes the payload, then the header: a header is valid
only once its payload is complete. **Readers** take no lock: they read header and payload
into the caller's buffers in one ``preadv``, verify both, and on a failed check read the
header again; a header that changed meanwhile means the slot was reused under them
(reported as a miss, with the buffers zeroed), an unchanged one means the object is
damaged (corrupt; the slot's bytes are copied to ``quarantine/`` and its header zeroed,
which frees it). A slot has no end of its own, so a payload whose tail was never written
fails its checksum; the reason then says how many trailing bytes read as zeros.

``capacity_bytes`` caps what this process holds (headers included) like the ``file``
backend does, evicting through the policy handed in; each process enforces it over the
objects it knows of (after a reopen, in file order: slots carry no timestamps). A class
can never hold more than its ``data_files`` data files. ``clear`` empties a namespace's
data files in place (truncated to zero and back), so every process's open descriptors
stay valid. The usrbio client is not zero copy: usrbio moves only memory registered with
3FS, so payloads are staged through one shared-memory buffer.

Several processes on one host (TP ranks) share a root; processes on different hosts
should use different roots, since the locks are only coherent on one host.

**Checking.** The backend is :class:`~sglang_storage.storage.backend.Scannable`: ``scan()``
reads every slot that holds data and reports its object (header, placement and payload
checksum), the orphaned temporary files of dead processes and anything under ``root`` the
backend did not write; ``repair()`` quarantines damaged slots (copy aside, header zeroed)
removes orphans and narrows data files and quarantined copies whose permissions let
other users in. Opened ``read_only`` it changes nothing under ``root`` (no cleanup at
open, no quarantine on a failed read; writes, deletes and clears are refused).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import importlib
import itertools
import json
import logging
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import attrs
import xxhash

from sglang_storage.config import (
    BYTES,
    instance_of,
    int_in_range,
    one_of,
    optional,
    positive_int,
)
from sglang_storage.core import (
    EvictionPolicy,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    CorruptObjectError,
    StateError,
    StorageError,
)
from sglang_storage.storage.backend import (
    BackendStats,
    Capabilities,
    StatsRecorder,
    count_prefix,
    scrub,
)
from sglang_storage.storage.capacity import CapacityIndex
from sglang_storage.storage.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    check_object,
    checksum,
    decode_header,
    encode_header,
    header_template,
)
from sglang_storage.storage.fsck import (
    ObjectReport,
    ObjectState,
    PayloadHasher,
    RepairAction,
    RepairResult,
    entry_size,
    exposure,
    foreign,
    inspect_header,
    inspect_object,
    namespace_dirs,
    quarantined,
    remove_orphan,
    restrict,
    scan_temp_dir,
    sorted_entries,
    temp_report,
)
from sglang_storage.storage.posix import (
    IOV_MAX,
    TEMP_PREFIX,
    FileMode,
    IOThreads,
    TempNames,
    advance,
    claim_root,
    create_temp,
    exposed,
    file_mode_of,
    io_error,
    make_dirs,
    marker_fields,
    namespace_of,
    process_umask,
    read_control,
    read_marker,
    remove_dead_temp,
    subdirs,
    temp_writer,
    write_error,
    write_marker,
)

__all__ = [
    "MARKER",
    "SLOT_ALIGNMENT",
    "ClientName",
    "Hf3fsBackend",
    "Hf3fsBackendConfig",
    "SlotLocation",
    "mount_of",
]

log = logging.getLogger(__name__)

MARKER: Final = "sglang-storage-hf3fs.json"
LAYOUT_VERSION: Final = 1
SLOT_ALIGNMENT: Final = 4096
"""Slots and data files are multiples of this many bytes."""

ClientName = Literal["auto", "usrbio", "posix"]
"""How data moves: ``"usrbio"`` (3FS's user-space ring client), ``"posix"`` (system calls
on the mount) or ``"auto"`` (usrbio when importable and the root is on 3FS)."""

_CLASS_FILE: Final = "class.json"
_MAX_DATA_FILES: Final = 65536
_MAX_WAYS: Final = 64
_LOCK_FILE: Final = "lock"
_STRIPES: Final = 64
_ZERO_HEADER: Final = bytes(HEADER_SIZE)
# format.py: the five length-prefixed names start after 96 bytes of fixed fields.
_NAMES_AT: Final = 96
# struct flock on Linux: l_type, l_whence, (pad), l_start, l_len, l_pid, (pad).
_FLOCK: Final = struct.Struct("@hhqqi4x")
_RACY_NS: Final = 2_000_000_000
_USRBIO_TIMEOUT: Final = datetime.timedelta(seconds=60)


def _multiple_of_alignment(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < SLOT_ALIGNMENT or value % SLOT_ALIGNMENT:
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason=f"must be a positive multiple of {SLOT_ALIGNMENT} bytes",
            allowed=f"{SLOT_ALIGNMENT}, {2 * SLOT_ALIGNMENT}, ...; sizes like '1GiB'",
        )


@attrs.frozen(kw_only=True)
class Hf3fsBackendConfig:
    """Options of the ``hf3fs`` backend."""

    root: Path = attrs.field(converter=Path, validator=instance_of(Path))
    """An existing directory on a 3FS mount (or, with ``allow_non_3fs``, anywhere)."""
    data_file_size: int = attrs.field(
        default=2**30, validator=_multiple_of_alignment, metadata=BYTES
    )
    """The size of each data file (rounded down to whole slots; an object larger than
    this gets data files of exactly one slot)."""
    data_files: int = attrs.field(default=16, validator=int_in_range(1, _MAX_DATA_FILES))
    """Data files per slot class (a namespace and a slot size): together with
    ``data_file_size`` the most a class can hold."""
    ways: int = attrs.field(default=8, validator=int_in_range(1, _MAX_WAYS))
    """Slots per set: how many places a key may go, and how many headers a lookup reads
    at most."""
    capacity_bytes: int | None = attrs.field(
        default=None, validator=optional(positive_int), metadata=BYTES
    )
    """The most bytes this process keeps (headers included); ``None`` for no cap. A cap
    needs an eviction policy."""
    client: ClientName = attrs.field(default="auto", validator=one_of("auto", "usrbio", "posix"))
    """How data moves; see :data:`ClientName`."""
    io_threads: int = attrs.field(default=4, validator=int_in_range(1, 64))
    """Threads a batch is spread over."""
    allow_non_3fs: bool = attrs.field(default=False, validator=instance_of(bool))
    """Accept a root that is not on a 3FS mount (tests, or a local stand-in): the same
    layout, through POSIX calls."""
    usrbio_buffer_bytes: int = attrs.field(
        default=64 * 2**20, validator=_multiple_of_alignment, metadata=BYTES
    )
    """The shared-memory staging buffer of the usrbio client (larger transfers are cut
    into pieces of this size)."""
    read_only: bool = attrs.field(default=False, validator=instance_of(bool))
    """Inspect an existing store without changing anything under ``root`` (no cleanup
    at open, no quarantine on a failed read); writes, deletes, clears and repairs raise
    :class:`~sglang_storage.errors.StateError`."""
    file_mode: FileMode | None = attrs.field(
        default=None, converter=file_mode_of, validator=optional(instance_of(FileMode))
    )
    """Who may read what the backend creates: ``"0600"`` (private, directories
    ``0700``), ``"0640"`` or ``"0660"`` (shared with the directories' group). ``None``
    keeps the store's own, recorded in its marker (private for a new store)."""
    adopt: bool = attrs.field(default=False, validator=instance_of(bool))
    """Accept a non-empty ``root`` that holds no store marker (and, unless read-only,
    write one): without it such a directory is refused as someone else's. Files the
    backend did not write are never touched either way."""
    clean_at_open: bool = attrs.field(default=True, validator=instance_of(bool))
    """Remove the temporary files of writers that are gone when opening (``fsck
    --repair`` turns it off, so that it removes only what it showed)."""


@attrs.frozen(kw_only=True)
class SlotLocation:
    """Where one object is stored: a data file and the offset of its slot."""

    path: Path
    offset: int
    slot_size: int
    """Bytes the slot takes (header and payload, rounded up to :data:`SLOT_ALIGNMENT`)."""


def mount_of(path: Path, *, mountinfo: str | None = None) -> tuple[str, str]:
    """The mount point holding ``path`` and its filesystem type (``""`` when unknown).

    Args:
        path: Any path; symbolic links are resolved.
        mountinfo: The text of ``/proc/self/mountinfo`` (read when ``None``).
    """
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return "/", ""
    real = os.path.realpath(path)
    best, fstype = "", ""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, tail[0]
    return best or "/", fstype


class _SlotIO(Protocol):
    """Moves bytes between data files and memory; POSIX calls or 3FS usrbio."""

    name: Literal["posix", "usrbio"]
    zero_copy: bool

    def read(self, fd: int, offset: int, views: Sequence[memoryview]) -> int: ...

    def read_header(self, fd: int, offset: int) -> bytes: ...

    def write(self, fd: int, offset: int, views: Sequence[memoryview]) -> None: ...

    def register(self, fd: int) -> None: ...

    def deregister(self, fd: int) -> None: ...

    def close(self) -> None: ...


class _PosixIO:
    """``preadv``/``pwritev`` straight between data files and the caller's buffers."""

    name: Literal["posix", "usrbio"] = "posix"
    zero_copy = True

    def read(self, fd: int, offset: int, views: Sequence[memoryview]) -> int:
        return _preadv_full(fd, views, offset)

    def read_header(self, fd: int, offset: int) -> bytes:
        raw = os.pread(fd, HEADER_SIZE, offset)
        while 0 < len(raw) < HEADER_SIZE:
            more = os.pread(fd, HEADER_SIZE - len(raw), offset + len(raw))
            if not more:
                break
            raw += more
        return raw.ljust(HEADER_SIZE, b"\0")

    def write(self, fd: int, offset: int, views: Sequence[memoryview]) -> None:
        _pwritev_full(fd, views, offset)

    def register(self, fd: int) -> None:
        return

    def deregister(self, fd: int) -> None:
        return

    def close(self) -> None:
        return


class _UsrbioIO:
    """Data through 3FS's usrbio rings (``hf3fs_fuse.io``), staged in one shared buffer.

    usrbio reads and writes only memory registered with 3FS (an ``iovec`` over shared
    memory), so payloads are copied between it and the caller's buffers. One transfer is
    in flight at a time per backend. Needs a 3FS cluster: it does not run on this
    project's CI machines.
    """

    name: Literal["posix", "usrbio"] = "usrbio"
    zero_copy = False

    def __init__(self, module: Any, mount_point: str, buffer_bytes: int) -> None:
        self._h3 = module
        self._size = buffer_bytes
        self._shm = shared_memory.SharedMemory(size=buffer_bytes, create=True)
        buffer = self._shm.buf
        assert buffer is not None
        self._buffer: memoryview = buffer
        try:
            self._iov: Any = module.make_iovec(self._shm, mount_point)
            self._reads: Any = module.make_ioring(mount_point, 1, for_read=True)
            self._writes: Any = module.make_ioring(mount_point, 1, for_read=False)
        except BaseException:
            self._shm.close()
            self._shm.unlink()
            raise
        # 3FS holds its own mapping now; the name is not needed any more.
        self._shm.unlink()
        self._lock = threading.Lock()

    def read(self, fd: int, offset: int, views: Sequence[memoryview]) -> int:
        total = sum(v.nbytes for v in views)
        done = 0
        with self._lock:
            while done < total:
                want = min(self._size, total - done)
                got = self._transfer(self._reads, want, True, fd, offset + done)
                _scatter(self._buffer[:got], views, done)
                done += got
                if got < want:
                    break
        return done

    def read_header(self, fd: int, offset: int) -> bytes:
        header = bytearray(HEADER_SIZE)
        self.read(fd, offset, [memoryview(header)])
        return bytes(header)

    def write(self, fd: int, offset: int, views: Sequence[memoryview]) -> None:
        total = sum(v.nbytes for v in views)
        done = 0
        with self._lock:
            while done < total:
                want = min(self._size, total - done)
                _gather(views, done, self._buffer[:want])
                got = self._transfer(self._writes, want, False, fd, offset + done)
                if got <= 0:
                    raise OSError(errno.EIO, f"usrbio wrote {got} of {want} bytes")
                done += got

    def _transfer(self, ring: Any, size: int, read: bool, fd: int, offset: int) -> int:
        ring.prepare(self._iov[0:size], read, fd, offset)
        done = ring.submit().wait(min_results=1, timeout=_USRBIO_TIMEOUT)
        if not done:
            raise OSError(errno.ETIMEDOUT, f"usrbio gave no completion within {_USRBIO_TIMEOUT}")
        result = int(done[0].result)
        if result < 0:
            raise OSError(-result, os.strerror(-result))
        return result

    def register(self, fd: int) -> None:
        self._h3.register_fd(fd)

    def deregister(self, fd: int) -> None:
        self._h3.deregister_fd(fd)

    def close(self) -> None:
        with self._lock:
            self._iov = self._reads = self._writes = None
            self._buffer.release()
            self._shm.close()


class _SlotClass:
    """One class's geometry, data file descriptors and set locks (in one process)."""

    def __init__(
        self,
        namespace: Namespace,
        directory: Path,
        slot_size: int,
        slots_per_file: int,
        ways: int,
        data_files: int,
        io: _SlotIO,
        file_bits: int,
        exact: bool,
        *,
        read_only: bool = False,
    ) -> None:
        self.namespace = namespace
        self.directory = directory
        self.slot_size = slot_size
        self.slots_per_file = slots_per_file
        self.ways = ways
        self.data_files = data_files
        self.sets_per_file = slots_per_file // ways
        self.total_sets = self.sets_per_file * data_files
        self.file_size = slots_per_file * slot_size
        self._io = io
        self._file_bits = file_bits
        self._exact = exact
        self._fds: list[int | None] = [None] * data_files
        self._fd_lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        # Only writers lock; a read-only open must not create a missing lock file.
        self._lock_fd: int | None = (
            None
            if read_only
            else _open_created(directory / _LOCK_FILE, os.O_RDWR, file_bits, exact)
        )

    def path(self, file: int) -> Path:
        return self.directory / f"{file:05d}.data"

    def set_of(self, name: str) -> int:
        return int(xxhash.xxh3_64_intdigest(name.encode())) % self.total_sets

    def set_of_slot(self, slot: int) -> int:
        file, index = divmod(slot, self.slots_per_file)
        return file * self.sets_per_file + index // self.ways

    def slots(self, set_id: int) -> range:
        file, index = divmod(set_id, self.sets_per_file)
        first = file * self.slots_per_file + index * self.ways
        return range(first, first + self.ways)

    def place(self, slot: int) -> tuple[int, int]:
        """``(data file, offset)`` of ``slot``."""
        file, index = divmod(slot, self.slots_per_file)
        return file, index * self.slot_size

    def fd(self, file: int, *, create: bool) -> int | None:
        """The data file's descriptor; ``None`` if it does not exist and ``create`` is false."""
        fd = self._fds[file]
        if fd is not None:
            return fd
        with self._fd_lock:
            fd = self._fds[file]
            if fd is not None:
                return fd
            try:
                if create:
                    fd = _open_created(self.path(file), os.O_RDWR, self._file_bits, self._exact)
                else:
                    fd = os.open(self.path(file), os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                if create and os.fstat(fd).st_size < self.file_size:
                    os.ftruncate(fd, self.file_size)
                self._io.register(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fds[file] = fd
            return fd

    def open_fds(self) -> list[int]:
        with self._fd_lock:
            return [fd for fd in self._fds if fd is not None]

    @contextlib.contextmanager
    def locked(self, set_id: int) -> Iterator[None]:
        """Hold set ``set_id`` against every other writer, in this and other processes."""
        lock_fd = self._writer_lock()
        with self._stripes[set_id % _STRIPES]:
            _ofd_lock(lock_fd, set_id, 1)
            try:
                yield
            finally:
                _ofd_unlock(lock_fd, set_id, 1)

    @contextlib.contextmanager
    def locked_all(self) -> Iterator[None]:
        """Hold every set of the class."""
        lock_fd = self._writer_lock()
        with contextlib.ExitStack() as stack:
            for stripe in self._stripes:
                stack.enter_context(stripe)
            _ofd_lock(lock_fd, 0, 0)
            try:
                yield
            finally:
                _ofd_unlock(lock_fd, 0, 0)

    def _writer_lock(self) -> int:
        if self._lock_fd is None:
            raise StateError(
                subject=f"hf3fs slot class {self.directory}",
                reason="opened read-only: it takes no writer locks",
            )
        return self._lock_fd

    def close(self) -> None:
        with self._fd_lock:
            fds, self._fds = self._fds, [None] * self.data_files
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    self._io.deregister(fd)
                os.close(fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)


@attrs.define
class _Listing:
    """The classes of one namespace as last listed, and when the listing is stale."""

    by_size: dict[int, _SlotClass]
    signature: tuple[int, int, int] | None
    racy: bool


class Hf3fsBackend:
    """Self-checking objects in slots of large data files on 3FS, shared by local processes.

    Args:
        config: Its options.
        eviction: Chooses victims when ``config.capacity_bytes`` is reached, and allows
            a full set to give up its least recently used object.

    Raises:
        BackendUnavailableError: ``root`` is missing, not a directory, not on a 3FS mount
            (without ``allow_non_3fs``), holds a store of another version, or does not
            support the locks the backend needs; or ``client="usrbio"`` and the usrbio
            client is not importable.
        ConfigError: a capacity cap without an eviction policy.
    """

    name = "hf3fs"

    def __init__(
        self,
        config: Hf3fsBackendConfig,
        *,
        eviction: EvictionPolicy[ObjectKey] | None = None,
    ) -> None:
        self._config = config
        self._root = config.root
        self._classes_dir = self._root / "classes"
        self._tmp_dir = self._root / "tmp"
        self._quarantine_dir = self._root / "quarantine"
        self._temp_names = TempNames()
        self._umask = process_umask()
        self._set_mode(config.file_mode or FileMode.PRIVATE)
        self._index: CapacityIndex[ObjectKey] = CapacityIndex(
            config.capacity_bytes, eviction, owner=f"hf3fs backend at {self._root}"
        )
        self._can_evict = eviction is not None
        self._stats = StatsRecorder()
        self._lock = threading.Lock()
        self._listings: dict[Namespace, _Listing] = {}
        self._hints: dict[ObjectKey, tuple[_SlotClass, int]] = {}
        self._ticks: dict[ObjectKey, int] = {}
        self._clock = itertools.count(1)
        self._quarantined = 0
        self._threads = IOThreads(config.io_threads, self.name)
        self._closed = False
        self._mount_point, self._fstype = self._check_root()
        self._io = self._open_client()
        try:
            self._prepare()
            self._rebuild_index()
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ opening

    def _unavailable(self, reason: str) -> BackendUnavailableError:
        return BackendUnavailableError(backend=self.name, reason=reason)

    @property
    def _on_3fs(self) -> bool:
        return "3fs" in self._fstype.lower()

    def _check_root(self) -> tuple[str, str]:
        root = self._root
        if not root.exists():
            raise self._unavailable(
                f"root {root} does not exist; mount 3FS and point root at a directory on "
                "the mount (create the directory first)"
            )
        if not root.is_dir():
            raise self._unavailable(f"root {root} is not a directory; point root at a directory")
        point, fstype = mount_of(root)
        if "3fs" not in fstype.lower() and not self._config.allow_non_3fs:
            raise self._unavailable(
                f"root {root} is not on a 3FS mount (it is on {fstype or 'an unknown filesystem'}"
                f" mounted at {point}); mount 3FS and use a directory on it, or set "
                "allow_non_3fs=True to keep the same layout on another filesystem (tests)"
            )
        return point, fstype

    def _open_client(self) -> _SlotIO:
        wanted = self._config.client
        if wanted == "posix":
            return _PosixIO()
        try:
            module: Any = importlib.import_module("hf3fs_fuse.io")
        except (ImportError, OSError) as error:
            if wanted == "usrbio":
                raise self._unavailable(
                    "client='usrbio' needs 3FS's usrbio Python client (the hf3fs_fuse "
                    f"package built from 3FS's hf3fs-py-usrbio), which is not importable: "
                    f"{error}; install it, or use client='posix' (or 'auto') to go "
                    "through the 3FS FUSE mount"
                ) from error
            return _PosixIO()
        if wanted == "auto" and not self._on_3fs:
            return _PosixIO()
        try:
            mount_point = str(module.extract_mount_point(str(self._root)))
            return _UsrbioIO(module, mount_point, self._config.usrbio_buffer_bytes)
        except (OSError, RuntimeError, ValueError) as error:
            raise self._unavailable(
                f"the usrbio client cannot use {self._root}: {error}; check that it is on "
                "a 3FS mount, or use client='posix'"
            ) from error

    def _set_mode(self, mode: FileMode) -> None:
        self._mode = mode
        self._file_bits, self._dir_bits = mode.file_bits, mode.dir_bits
        self._file_exact = self._file_bits & ~self._umask != self._file_bits
        self._dir_exact = self._dir_bits & ~self._umask != self._dir_bits

    def _marker_wanted(self) -> dict[str, object]:
        return {"format_version": FORMAT_VERSION, "layout_version": LAYOUT_VERSION}

    def _use_marker(self, content: dict[str, object], does: str) -> None:
        """Check the marker's versions; take its file mode unless one was given."""
        wanted = self._marker_wanted()
        found = {k: content.get(k) for k in wanted} if content else None
        if found != wanted:
            raise self._unavailable(
                f"{self._root} holds a store of {found}; this build {does} {wanted}"
                + (" (use another root)" if does == "uses" else "")
            )
        recorded = content.get("file_mode")
        if self._config.file_mode is None and isinstance(recorded, str):
            with contextlib.suppress(ValueError):
                self._set_mode(FileMode(recorded))

    def _prepare(self) -> None:
        if self._config.read_only:
            self._check_marker()
            return
        owner = type(self._config).__name__
        try:
            if not claim_root(self._root, MARKER, owner=owner, adopt=self._config.adopt):
                write_marker(
                    self._root,
                    MARKER,
                    marker_fields(
                        self.name, {**self._marker_wanted(), "file_mode": self._mode.value}
                    ),
                    self._temp_names,
                    mode=self._file_bits,
                    exact=self._file_exact,
                )
            self._use_marker(read_marker(self._root / MARKER), "uses")
            for directory in (self._classes_dir, self._tmp_dir, self._quarantine_dir):
                make_dirs(str(directory), self._dir_bits, exact=self._dir_exact)
            if self._config.clean_at_open:
                self._remove_orphans()
            self._check_locks()
        except (ConfigError, BackendUnavailableError):
            raise
        except (OSError, ValueError) as error:
            raise self._unavailable(f"cannot use {self._root}: {error}") from error

    def _check_marker(self) -> None:
        """Read-only open: a non-empty root needs a marker, and it must be this build's."""
        owner = type(self._config).__name__
        try:
            if not claim_root(self._root, MARKER, owner=owner, adopt=self._config.adopt):
                return
            content = read_marker(self._root / MARKER)
        except ConfigError:
            raise
        except (OSError, ValueError) as error:
            raise self._unavailable(f"cannot use {self._root}: {error}") from error
        self._use_marker(content, "reads")

    def _check_locks(self) -> None:
        fd = _open_created(self._root / _LOCK_FILE, os.O_RDWR, self._file_bits, self._file_exact)
        try:
            _ofd_lock(fd, 0, 1)
            _ofd_unlock(fd, 0, 1)
        except OSError as error:
            raise self._unavailable(
                f"{self._root} does not support open-file-description locks "
                f"(fcntl F_OFD_SETLKW: {error}); they keep writers of different processes "
                "out of each other's slots"
            ) from error
        finally:
            os.close(fd)

    def _remove_orphans(self) -> None:
        """Delete temporary files (ours by name) whose writers are gone."""
        for directory in (self._tmp_dir, self._root):
            for entry in os.scandir(directory):
                if temp_writer(entry.name) is not None:
                    with contextlib.suppress(OSError):
                        remove_dead_temp(entry.path)

    def _rebuild_index(self) -> None:
        """Index every valid object in the data files (in file order)."""
        for model in subdirs(self._classes_dir):
            for kind in subdirs(Path(model.path)):
                for shard in subdirs(Path(kind.path)):
                    namespace = namespace_of(model.name, kind.name, shard.name)
                    if namespace is None:
                        continue
                    for cls in self._classes_of(namespace).values():
                        self._scan(cls)
        if not self._config.read_only:
            self._remove(self._index.over_capacity(), evicted=True)

    def _scan(self, cls: _SlotClass) -> None:
        header = bytearray(HEADER_SIZE)
        view = memoryview(header)
        for file in range(cls.data_files):
            fd = cls.fd(file, create=False)
            if fd is None:
                continue
            for index in _data_slots(fd, cls.slots_per_file, cls.slot_size):
                slot = file * cls.slots_per_file + index
                got = self._io.read(fd, index * cls.slot_size, [view])
                if got < HEADER_SIZE or header[:4] != MAGIC:
                    continue
                try:
                    decoded = decode_header(header, where=f"{cls.path(file)}@{slot}")
                except CorruptObjectError:
                    continue
                key = decoded.key
                if (
                    key.namespace != cls.namespace
                    or decoded.object_size > cls.slot_size
                    or cls.set_of(key.name) != cls.set_of_slot(slot)
                    or key in self._hints
                ):
                    continue
                self._index.add(key, decoded.object_size)
                self._hints[key] = (cls, slot)

    # ------------------------------------------------------------------ classes

    def _classes_of(self, namespace: Namespace) -> dict[int, _SlotClass]:
        """The namespace's classes by slot size (relisted when its directory changed)."""
        directory = self._classes_dir / namespace.path
        try:
            status = directory.stat()
            signature: tuple[int, int, int] | None = (
                status.st_ino,
                status.st_mtime_ns,
                status.st_nlink,
            )
        except FileNotFoundError:
            signature = None
        listing = self._listings.get(namespace)
        if listing is not None and listing.signature == signature and not listing.racy:
            return listing.by_size
        with self._lock:
            self._check_open()
            listing = self._listings.get(namespace)
            known = dict(listing.by_size) if listing is not None else {}
            missing_class = False
            if signature is not None:
                for entry in subdirs(directory):
                    size = _slot_size_of(entry.name)
                    if size is None or size in known:
                        continue
                    cls = self._load_class(namespace, Path(entry.path), size)
                    if cls is None:
                        missing_class = True  # being created: look again next time
                    else:
                        known[size] = cls
            # A listing made within the directory's timestamp granularity may have missed
            # a class created in the same tick: keep relisting until it is old enough.
            racy = missing_class or (
                signature is not None and time.time_ns() - signature[1] < _RACY_NS
            )
            self._listings[namespace] = _Listing(known, signature, racy)
            return known

    def _load_class(
        self, namespace: Namespace, directory: Path, slot_size: int
    ) -> _SlotClass | None:
        try:
            # A small regular file only: a FIFO there must not block, nor a huge file fill
            # memory.
            geometry = json.loads(read_control(directory / _CLASS_FILE))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            log.warning("hf3fs backend: ignoring slot class %s: %s", directory, error)
            return None
        fields = ("slot_size", "slots_per_file", "ways", "data_files")
        values = [geometry.get(f) if isinstance(geometry, dict) else None for f in fields]
        numbers = [v for v in values if type(v) is int and v >= 1]
        why = _bad_geometry(numbers, slot_size) if len(numbers) == len(fields) else "missing"
        if why:
            log.warning(
                "hf3fs backend: ignoring slot class %s: bad geometry %.200r (%s)",
                directory,
                geometry,
                why,
            )
            return None
        _, slots_per_file, ways, data_files = numbers
        return _SlotClass(
            namespace,
            directory,
            slot_size,
            slots_per_file,
            ways,
            data_files,
            self._io,
            self._file_bits,
            self._file_exact,
            read_only=self._config.read_only,
        )

    def _class_for_write(self, namespace: Namespace, slot_size: int) -> _SlotClass:
        cls = self._classes_of(namespace).get(slot_size)
        if cls is not None:
            return cls
        config = self._config
        directory = self._classes_dir / namespace.path / f"s{slot_size}"
        slots_per_file = max(1, config.data_file_size // slot_size)
        geometry = {
            "slot_size": slot_size,
            "slots_per_file": slots_per_file,
            "ways": min(config.ways, slots_per_file),
            "data_files": config.data_files,
        }
        make_dirs(str(directory), self._dir_bits, exact=self._dir_exact)
        fd, tmp = create_temp(
            self._temp_names, self._tmp_dir, "json", self._file_bits, exact=self._file_exact
        )
        try:
            try:
                _write_all(fd, (json.dumps(geometry) + "\n").encode())
                # A link fails if another process created the class first: its geometry wins.
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, directory / _CLASS_FILE)
            finally:
                Path(tmp).unlink()
        finally:
            os.close(fd)
        with self._lock:
            listing = self._listings.get(namespace)
            known = dict(listing.by_size) if listing is not None else {}
            cls = known.get(slot_size)
            if cls is None:
                cls = self._load_class(namespace, directory, slot_size)
                if cls is None:
                    raise OSError(errno.EIO, f"slot class {directory} has no usable geometry")
                known[slot_size] = cls
                self._listings[namespace] = _Listing(
                    known, listing.signature if listing else None, True
                )
            return cls

    # ------------------------------------------------------------------ protocol

    @property
    def root(self) -> Path:
        """The store's directory."""
        return self._root

    @property
    def client(self) -> Literal["posix", "usrbio"]:
        """The client moving data: ``"usrbio"`` or ``"posix"``."""
        return self._io.name

    @property
    def on_3fs(self) -> bool:
        """Whether ``root`` is on a 3FS mount (rather than an allowed stand-in)."""
        return self._on_3fs

    @property
    def capabilities(self) -> Capabilities:
        """Shareable by processes on one host, durable, scannable; zero copy on POSIX."""
        return Capabilities(
            zero_copy=self._io.zero_copy,
            shared_across_processes=True,
            shared_across_hosts=False,
            durable=True,
            bounded=self._index.bounded,
            scannable=True,
        )

    def locate(self, key: ObjectKey) -> SlotLocation | None:
        """Where ``key``'s object is stored (by this or another process), or ``None``."""
        self._check_open()
        for cls in self._classes_of(key.namespace).values():
            found = self._probe(cls, key)
            if found is not None and _header_ok(found[1]):
                file, offset = cls.place(found[0])
                return SlotLocation(path=cls.path(file), offset=offset, slot_size=cls.slot_size)
        return None

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored (by this or another process)."""
        self._check_open()
        listings = self._listings_for(keys)
        return [self._exists(key, listings) for key in keys]

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys are stored."""
        self._check_open()
        listings = self._listings_for(keys)
        return count_prefix(self._exists(key, listings) for key in keys)

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Read and verify each requested object straight into its buffers."""
        self._check_open()
        listings = self._listings_for([r.key for r in requests])
        results = self._threads.spread(lambda r: self._get(r, listings[r.key.namespace]), requests)
        self._stats.record_gets(results)
        return results

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Write each request's buffers into a slot; existing keys are kept."""
        self._check_writable("put_from")
        listings = self._listings_for([r.key for r in requests])
        results = self._threads.spread(lambda r: self._put(r, listings[r.key.namespace]), requests)
        self._stats.record_puts(results)
        return results

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """Remove the stored ones of ``keys``."""
        self._check_writable("delete")
        removed = self._remove(keys, evicted=False)
        self._stats.record_deleted(removed)

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace`` (other namespaces are untouched)."""
        self._check_writable("clear")
        for cls in self._classes_of(namespace).values():
            with cls.locked_all():
                for file in range(cls.data_files):
                    fd = cls.fd(file, create=False)
                    if fd is None:
                        continue
                    try:
                        # Same inode, so other processes' descriptors stay valid.
                        os.ftruncate(fd, 0)
                        os.ftruncate(fd, cls.file_size)
                    except OSError as error:
                        raise io_error(
                            self.name, f"clear of {namespace.path} ({cls.path(file)})", error
                        ) from error
        for key in self._index.keys():  # noqa: SIM118 - a snapshot, not a dict
            if key.namespace == namespace:
                self._index.remove(key)
        for key in list(self._hints):
            if key.namespace == namespace:
                self._forget(key)

    def stats(self) -> BackendStats:
        """Contents (as this process knows them) and counters."""
        self._check_open()
        objects, nbytes = self._index.totals()
        return self._stats.snapshot(
            objects=objects, nbytes=nbytes, capacity_bytes=self._index.capacity_bytes
        )

    @property
    def quarantined(self) -> int:
        """Slots this instance quarantined after a failed check."""
        with self._lock:
            return self._quarantined

    def close(self) -> None:
        """Stop the I/O threads and close the data files; later calls raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._threads.close()
        self._release()

    def _release(self) -> None:
        with self._lock:
            listings, self._listings = self._listings, {}
        for listing in listings.values():
            for cls in listing.by_size.values():
                cls.close()
        self._hints.clear()
        self._io.close()

    def __enter__(self) -> Hf3fsBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lookups

    def _listings_for(self, keys: Sequence[ObjectKey]) -> dict[Namespace, dict[int, _SlotClass]]:
        return {ns: self._classes_of(ns) for ns in {key.namespace for key in keys}}

    def _exists(self, key: ObjectKey, listings: dict[Namespace, dict[int, _SlotClass]]) -> bool:
        for cls in listings[key.namespace].values():
            found = self._probe(cls, key)
            if found is not None and _header_ok(found[1]):
                return True
        return False

    def _header_at(self, cls: _SlotClass, slot: int) -> bytes | None:
        """The header bytes of ``slot`` (zero-padded if the file is short); None: no file."""
        file, offset = cls.place(slot)
        fd = cls.fd(file, create=False)
        if fd is None:
            return None
        return self._io.read_header(fd, offset)

    def _probe(self, cls: _SlotClass, key: ObjectKey) -> tuple[int, bytes] | None:
        """The slot whose header names ``key`` (valid or damaged) and that header."""
        hint = self._hints.get(key)
        hinted = hint[1] if hint is not None and hint[0] is cls else -1
        if hinted >= 0:
            raw = self._header_at(cls, hinted)
            if raw is not None and _claims(raw, key):
                return hinted, raw
        for slot in cls.slots(cls.set_of(key.name)):
            if slot == hinted:
                continue
            raw = self._header_at(cls, slot)
            if raw is None:
                return None  # a set lies in one data file, which does not exist
            if _claims(raw, key):
                self._hints[key] = (cls, slot)
                return slot, raw
        return None

    # ------------------------------------------------------------------ reads

    def _get(self, request: GetRequest, classes: dict[int, _SlotClass]) -> GetResult:
        key = request.key
        cls = classes.get(_slot_size(request.nbytes))
        if cls is None:
            return GetResult.miss_of(key)
        try:
            hint = self._hints.get(key)
            if hint is not None and hint[0] is cls:
                result = self._read_slot(cls, hint[1], request)
                if result is not None:
                    return result
                self._hints.pop(key, None)
            found = self._probe(cls, key)
            if found is not None:
                result = self._read_slot(cls, found[0], request)
                if result is not None:
                    return result
        except OSError as error:
            scrub(request.buffers)
            return GetResult.error_of(key, io_error(self.name, f"read of {key}", error))
        self._forget(key)
        return GetResult.miss_of(key)

    def _read_slot(self, cls: _SlotClass, slot: int, request: GetRequest) -> GetResult | None:
        """Read ``slot`` into the request's buffers; ``None`` if it does not hold the key."""
        key = request.key
        file, offset = cls.place(slot)
        fd = cls.fd(file, create=False)
        if fd is None:
            return None
        header = bytearray(HEADER_SIZE)
        got = self._io.read(fd, offset, [memoryview(header), *request.buffers])
        nbytes = request.nbytes
        template = header_template(key.namespace, request.spec)
        recorded = template.expected_checksum(header, key.name) if got >= HEADER_SIZE else None
        if (
            recorded is not None
            and got >= HEADER_SIZE + nbytes
            and checksum(request.buffers) == recorded
        ):
            self._index.touch(key, HEADER_SIZE + nbytes)
            self._ticks[key] = next(self._clock)
            self._hints[key] = (cls, slot)
            return GetResult.hit_of(request)
        if got < HEADER_SIZE:
            header[got:] = bytes(HEADER_SIZE - got)
        raw = bytes(header)
        if not _claims(raw, key):
            scrub(request.buffers)
            return None
        reason = self._why(request, raw, got, recorded)
        scrub(request.buffers)
        if self._header_at(cls, slot) != raw:
            # Rewritten while it was being read: the object was replaced, not damaged.
            return None
        corrupt = CorruptObjectError(key=str(key), reason=reason)
        if _asked_amiss(raw, request):  # a caller error: the slot itself is intact
            log.warning("hf3fs backend: %s; kept (asked for with another spec)", corrupt)
            return GetResult.corrupt_of(key, corrupt)
        self._quarantine(cls, slot, raw, key)
        log.warning("hf3fs backend: %s; quarantined", corrupt)
        return GetResult.corrupt_of(key, corrupt)

    def _why(self, request: GetRequest, raw: bytes, got: int, recorded: int | None) -> str:
        """Why the bytes read must not be delivered."""
        nbytes = request.nbytes
        if got < HEADER_SIZE:
            return f"truncated header ({got} bytes)"
        if recorded is None:
            try:
                decoded = decode_header(raw, where=str(request.key))
            except CorruptObjectError as error:
                return error.reason
            return (
                check_object(decoded, request.key, request.spec)
                or "header differs from the expected one"
            )
        if got < HEADER_SIZE + nbytes:
            return f"truncated: {got - HEADER_SIZE} of {nbytes} payload bytes"
        zeros = _zero_tail(request.buffers)
        if zeros and zeros >= min(64, nbytes // 2):
            return (
                f"payload checksum mismatch; truncated: its last {zeros} of {nbytes} bytes "
                "read as zeros (a write that stopped early)"
            )
        return "payload checksum mismatch"

    def _quarantine(self, cls: _SlotClass, slot: int, raw: bytes, key: ObjectKey) -> None:
        """Copy the damaged slot aside and free it, unless it was rewritten meanwhile."""
        self._index.remove(key)
        self._forget(key)
        if self._config.read_only:
            return
        try:
            self._free_slot(cls, slot, raw, copy_as=key.name)
        except OSError as error:
            log.warning("hf3fs backend: could not quarantine %s: %s", key, error)

    def _write_private(self, target: Path, data: bytes | bytearray) -> None:
        """Write a new file ``target`` with the store's file mode."""
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._file_bits)
        try:
            if self._file_exact:
                os.fchmod(fd, self._file_bits)
            _write_all(fd, data)
        finally:
            os.close(fd)

    def _free_slot(self, cls: _SlotClass, slot: int, raw: bytes, *, copy_as: str | None) -> bool:
        """Free ``slot`` if its header is still ``raw``; returns whether it was freed.

        When ``copy_as`` names it, the slot is first copied to ``quarantine/``.
        """
        file, offset = cls.place(slot)
        with cls.locked(cls.set_of_slot(slot)):
            fd = cls.fd(file, create=False)
            if fd is None or self._header_at(cls, slot) != raw:
                return False
            if copy_as is not None:
                copy = bytearray(cls.slot_size)
                got = self._io.read(fd, offset, [memoryview(copy)])
                target = self._quarantine_dir / f"{time.time_ns()}.{os.getpid()}.{copy_as}"
                with contextlib.suppress(OSError):
                    self._write_private(target, copy[:got])
            self._io.write(fd, offset, [memoryview(_ZERO_HEADER)])
        if copy_as is not None:
            with self._lock:
                self._quarantined += 1
        return True

    # ------------------------------------------------------------------ writes

    def _put(self, request: PutRequest, classes: dict[int, _SlotClass]) -> PutResult:
        key = request.key
        size = HEADER_SIZE + request.nbytes
        try:
            for cls in classes.values():
                found = self._probe(cls, key)
                if found is not None and _header_ok(found[1]):
                    return self._present(key, found[1])
        except OSError as error:
            return PutResult.error_of(key, io_error(self.name, f"write of {key}", error))
        try:
            victims = self._index.reserve(size)
        except StorageError as error:
            return PutResult.error_of(key, error)
        try:
            if victims:
                self._remove(victims, evicted=True)
            cls = self._class_for_write(key.namespace, _slot_size(request.nbytes))
            header = encode_header(key, request.spec, checksum(request.buffers))
            written = self._write(cls, key, header, request.buffers)
        except OSError as error:
            self._index.release(size)
            return PutResult.error_of(key, write_error(self.name, self._root, key, size, error))
        except StorageError as error:
            self._index.release(size)
            return PutResult.error_of(key, error)
        if isinstance(written, bytes):
            self._index.release(size)
            return self._present(key, written)
        self._index.commit(key, size)
        self._ticks[key] = next(self._clock)
        self._hints[key] = (cls, written)
        return PutResult.stored_of(request)

    def _present(self, key: ObjectKey, raw: bytes) -> PutResult:
        self._index.touch(key, HEADER_SIZE + int.from_bytes(raw[16:24], "little"))
        self._ticks[key] = next(self._clock)
        return PutResult.present_of(key)

    def _write(
        self, cls: _SlotClass, key: ObjectKey, header: bytes, buffers: Sequence[memoryview]
    ) -> int | bytes:
        """Store the object in its set; its slot, or the header found if already stored."""
        set_id = cls.set_of(key.name)
        with cls.locked(set_id):
            slots = cls.slots(set_id)
            file, _ = cls.place(slots[0])
            fd = cls.fd(file, create=True)
            assert fd is not None
            free: tuple[int, bytes] | None = None
            victim: tuple[int, int, bytes, ObjectKey] | None = None
            for slot in slots:
                raw = self._header_at(cls, slot)
                assert raw is not None
                if _header_ok(raw):
                    if _claims(raw, key):
                        return raw
                    try:
                        other = decode_header(raw, where=str(cls.path(file))).key
                    except CorruptObjectError:
                        other = None
                    if other is None:
                        if free is None:
                            free = (slot, raw)
                        continue
                    tick = self._ticks.get(other, 0)
                    if victim is None or tick < victim[0]:
                        victim = (tick, slot, raw, other)
                elif free is None:
                    free = (slot, raw)
            evicted: ObjectKey | None = None
            if free is None:
                if victim is None or not self._can_evict:
                    raise CapacityError(
                        resource=f"hf3fs set {set_id} of {cls.directory}",
                        requested=1,
                        available=0,
                        unit="slots",
                        hint=f"all {cls.ways} slots {key} can use hold other objects; hand "
                        "the backend an eviction policy, or raise data_files, "
                        "data_file_size or ways (for a new root)",
                    )
                _, slot, raw, evicted = victim
                free = (slot, raw)
            slot, raw = free
            _, offset = cls.place(slot)
            if raw != _ZERO_HEADER:
                self._io.write(fd, offset, [memoryview(_ZERO_HEADER)])
            self._io.write(fd, offset + HEADER_SIZE, buffers)
            self._io.write(fd, offset, [memoryview(header)])
        if evicted is not None:
            self._index.remove(evicted)
            self._forget(evicted)
            self._stats.record_evicted(1)
        return slot

    def _remove(self, keys: Sequence[ObjectKey], *, evicted: bool) -> int:
        """Zero the headers of ``keys``' slots; returns how many objects were found."""
        removed = 0
        for key in keys:
            self._index.remove(key)
            found = False
            try:
                for cls in self._classes_of(key.namespace).values():
                    if self._probe(cls, key) is None:
                        continue
                    set_id = cls.set_of(key.name)
                    with cls.locked(set_id):
                        for slot in cls.slots(set_id):
                            raw = self._header_at(cls, slot)
                            if raw is not None and _claims(raw, key):
                                file, offset = cls.place(slot)
                                fd = cls.fd(file, create=False)
                                assert fd is not None
                                self._io.write(fd, offset, [memoryview(_ZERO_HEADER)])
                                found = True
            except OSError as error:
                raise io_error(self.name, f"delete of {key}", error) from error
            finally:
                self._forget(key)
            removed += found
        if evicted:
            self._stats.record_evicted(len(keys))
        return removed

    def _forget(self, key: ObjectKey) -> None:
        self._hints.pop(key, None)
        self._ticks.pop(key, None)

    # ------------------------------------------------------------------ threads

    def _check_open(self) -> None:
        if self._closed:
            raise self._unavailable("the backend was closed")

    def _check_writable(self, operation: str) -> None:
        self._check_open()
        if self._config.read_only:
            raise StateError(
                subject=f"hf3fs backend at {self._root}: {operation}",
                reason="the backend was opened read-only (read_only=True)",
            )

    # ------------------------------------------------------------------ fsck

    def purge_quarantine(self, *, dry_run: bool = False) -> list[tuple[str, int]]:
        """Remove the slot copies this backend put in ``quarantine/``; ``(path, bytes)`` of each.

        Only regular files named as the backend names them (``<time in ns>.<pid>.<object
        name>``) are removed; anything else there is kept, and nothing is reached through a
        link.
        ``dry_run`` lists them only.

        Raises:
            StateError: the backend was opened read-only (unless ``dry_run``).
            BackendIOError: ``quarantine/`` cannot be listed (a link in its place included).
        """
        self._check_open()
        if not dry_run:
            self._check_writable("purge the quarantine")
        removed: list[tuple[str, int]] = []
        try:
            fd = os.open(self._quarantine_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return removed
        except OSError as error:
            raise io_error(self.name, f"listing {self._quarantine_dir}", error) from error
        try:
            for name in sorted(os.listdir(fd)):  # noqa: PTH208 - by descriptor, no link
                if not _QUARANTINED_NAME.fullmatch(name):
                    continue
                try:
                    status = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if not stat.S_ISREG(status.st_mode):
                        continue
                    if not dry_run:
                        os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    continue
                removed.append((str(self._quarantine_dir / name), status.st_size))
        finally:
            os.close(fd)
        return removed

    def scan(self, *, payloads: bool = True, model: str | None = None) -> Iterator[ObjectReport]:
        """Report every object in the slots, orphaned temporary file and foreign file.

        Changes nothing. Free slots (zero headers, holes) are not reported; a slot whose
        header is damaged, names an object that does not belong in it (another namespace,
        set or size) or whose payload fails its checksum is ``corrupt``. The slots of a
        data file whose permissions allow more than the store's file mode are ``exposed``.
        """
        self._check_open()
        for entry in sorted_entries(self._root):
            name, is_dir = entry.name, entry.is_dir(follow_symlinks=False)
            if name in (MARKER, _LOCK_FILE) and not is_dir:
                continue
            if name == "classes" and is_dir:
                yield from self._scan_classes(payloads=payloads, model=model)
            elif name == "tmp" and is_dir:
                yield from scan_temp_dir(self._tmp_dir)
            elif name == "quarantine" and is_dir:
                yield from quarantined(
                    self._quarantine_dir,
                    "a slot copied aside after a failed check",
                    allowed=self._file_bits,
                )
            elif name.startswith(TEMP_PREFIX):
                yield temp_report(entry)  # a marker being written
            else:
                yield foreign(entry, "not part of an hf3fs store")

    def _scan_classes(self, *, payloads: bool, model: str | None) -> Iterator[ObjectReport]:
        for found in namespace_dirs(self._classes_dir):
            if isinstance(found, ObjectReport):
                yield found
                continue
            namespace, directory = found
            classes = self._classes_of(namespace)
            for class_dir in sorted_entries(directory):
                size = _slot_size_of(class_dir.name)
                cls = classes.get(size) if size is not None else None
                if not class_dir.is_dir(follow_symlinks=False) or size is None:
                    yield foreign(class_dir, "not a slot class directory (s<size>)")
                elif cls is None:
                    yield ObjectReport(
                        state=ObjectState.CORRUPT,
                        location=class_dir.path,
                        nbytes=entry_size(class_dir),
                        reason=f"slot class without a usable {_CLASS_FILE}",
                    )
                else:
                    yield from self._scan_class(cls, payloads=payloads, model=model)

    def _scan_class(
        self, cls: _SlotClass, *, payloads: bool, model: str | None
    ) -> Iterator[ObjectReport]:
        data_names = {cls.path(file).name: file for file in range(cls.data_files)}
        for entry in sorted_entries(cls.directory):
            if entry.name in (_CLASS_FILE, _LOCK_FILE) and entry.is_file(follow_symlinks=False):
                continue
            file = data_names.get(entry.name)
            if file is None or not entry.is_file(follow_symlinks=False):
                yield foreign(entry, "not a data file of its slot class")
                continue
            fd = cls.fd(file, create=False)
            if fd is None:
                continue
            mode = os.fstat(fd).st_mode
            for index in _data_slots(fd, cls.slots_per_file, cls.slot_size):
                report = self._inspect_slot(
                    cls, file * cls.slots_per_file + index, payloads=payloads, model=model
                )
                if report is not None and exposed(mode, self._file_bits):
                    why = f"its data file's {exposure(mode, self._file_bits)}"
                    reason = f"{report.reason}; {why}" if report.reason else why
                    report = attrs.evolve(report, exposed=True, reason=reason)
                if report is not None:
                    yield report

    def _inspect_slot(
        self, cls: _SlotClass, slot: int, *, payloads: bool, model: str | None
    ) -> ObjectReport | None:
        """Classify one slot; ``None`` for a free one."""
        file, offset = cls.place(slot)
        raw = self._header_at(cls, slot)
        location = f"{cls.path(file)}@{offset}"
        if raw is None or raw == _ZERO_HEADER:
            return None
        identity = int(xxhash.xxh3_64_intdigest(raw))
        check = inspect_header(raw, where=location, model=model)
        header = check.header
        if header is not None and check.state is not ObjectState.CORRUPT:
            if header.key.namespace != cls.namespace:
                reason = f"holds an object of namespace {header.key.namespace.path}"
            elif header.object_size > cls.slot_size:
                reason = f"holds a {header.object_size}-byte object in a {cls.slot_size}-byte slot"
            elif cls.set_of(header.key.name) != cls.set_of_slot(slot):
                reason = "holds an object of another set (readers never look for it here)"
            else:
                reason = ""
            if reason:
                check = attrs.evolve(check, state=ObjectState.CORRUPT, reason=reason)
            else:
                fd = cls.fd(file, create=False)
                assert fd is not None
                end = min(header.object_size, max(0, os.fstat(fd).st_size - offset))
                digest = None
                if payloads and end == header.object_size:
                    digest = self._hash_slot(fd, offset, header.payload_length)
                check = inspect_object(check, stored_bytes=end, payload_checksum=digest)
        size = header.object_size if check.state is ObjectState.OK and header else cls.slot_size
        return ObjectReport(
            state=check.state,
            location=location,
            nbytes=size,
            key=None if header is None else header.key,
            reason=check.reason,
            identity=identity,
        )

    def _hash_slot(self, fd: int, offset: int, length: int) -> int:
        hasher = PayloadHasher()
        done = 0
        piece = bytearray(min(length, _SCAN_CHUNK))
        while done < length:
            view = memoryview(piece)[: min(len(piece), length - done)]
            got = self._io.read(fd, offset + HEADER_SIZE + done, [view])
            if got <= 0:
                break
            hasher.update(view[:got])
            done += got
        return hasher.value

    def repair(self, reports: Sequence[ObjectReport]) -> list[RepairResult]:
        """Quarantine damaged slots, free other models' slots, remove orphans.

        Data files and quarantined copies whose permissions allow more than the store's
        file mode are narrowed to it. A slot is acted on only if its header is still the
        one the scan saw.

        Raises:
            StateError: the backend was opened read-only.
        """
        self._check_writable("repair")
        return [self._repair(report) for report in reports]

    def _repair(self, report: ObjectReport) -> RepairResult:
        if not report.problem:
            return RepairResult(report=report, action=RepairAction.KEPT, reason="not a problem")
        if report.state is ObjectState.ORPHANED_TEMP:
            return remove_orphan(report, self._tmp_dir, self._root)
        if report.state is ObjectState.QUARANTINED:
            if Path(report.location).parent != self._quarantine_dir:
                return RepairResult(
                    report=report, action=RepairAction.KEPT, reason="not in this store's quarantine"
                )
            return restrict(report, report.location, self._file_bits, inode=report.identity)
        found = self._slot_of(report.location)
        if found is None:
            return RepairResult(
                report=report, action=RepairAction.KEPT, reason="not a slot of this store"
            )
        cls, slot = found
        if not report.state.problem:
            file, _ = cls.place(slot)
            return restrict(report, str(cls.path(file)), self._file_bits, inode=None)
        raw = self._header_at(cls, slot)
        if raw is None or int(xxhash.xxh3_64_intdigest(raw)) != report.identity:
            return RepairResult(
                report=report, action=RepairAction.GONE, reason="rewritten since the scan"
            )
        if report.key is not None:
            self._index.remove(report.key)
            self._forget(report.key)
        keep = report.state is not ObjectState.WRONG_MODEL
        copy_as = (report.key.name if report.key else f"slot{slot}") if keep else None
        try:
            freed = self._free_slot(cls, slot, raw, copy_as=copy_as)
        except OSError as error:
            return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
        if not freed:
            return RepairResult(
                report=report, action=RepairAction.GONE, reason="rewritten since the scan"
            )
        if not keep:
            self._stats.record_deleted(1)
        action = RepairAction.QUARANTINED if keep else RepairAction.REMOVED
        return RepairResult(report=report, action=action)

    def _slot_of(self, location: str) -> tuple[_SlotClass, int] | None:
        """The class and slot a report's ``path@offset`` names."""
        path_text, _, offset_text = location.rpartition("@")
        path = Path(path_text)
        try:
            parts = path.relative_to(self._classes_dir).parts
        except ValueError:
            return None
        if len(parts) != 5 or not offset_text.isdigit():
            return None
        namespace = namespace_of(*parts[:3])
        size = _slot_size_of(parts[3])
        if namespace is None or size is None:
            return None
        cls = self._classes_of(namespace).get(size)
        if cls is None:
            return None
        for file in range(cls.data_files):
            if cls.path(file) == path:
                offset = int(offset_text)
                if offset % cls.slot_size or offset // cls.slot_size >= cls.slots_per_file:
                    return None
                return cls, file * cls.slots_per_file + offset // cls.slot_size
        return None


# ---------------------------------------------------------------------- helpers


_SCAN_CHUNK: Final = 1 << 20


_MAX_DATA_FILE: Final = 1 << 50
"""The largest data file a class may describe (1 PiB): larger is a crafted class file."""


def _bad_geometry(numbers: Sequence[int], slot_size: int) -> str:
    """Why a class file's ``slot_size, slots_per_file, ways, data_files`` are unusable.

    Bounded as the config bounds them, so that nothing is allocated from a crafted one.
    """
    size, slots_per_file, ways, data_files = numbers
    if size != slot_size:
        return f"slot_size is not {slot_size}, its directory's"
    if not 1 <= ways <= _MAX_WAYS or ways > slots_per_file:
        return f"ways must be 1..{_MAX_WAYS} and at most slots_per_file"
    if data_files > _MAX_DATA_FILES:
        return f"data_files must be at most {_MAX_DATA_FILES}"
    if slots_per_file * size > _MAX_DATA_FILE:
        return f"data files larger than {_MAX_DATA_FILE} bytes"
    return ""


def _slot_size(nbytes: int) -> int:
    return -(-(HEADER_SIZE + nbytes) // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def _slot_size_of(name: str) -> int | None:
    match = re.fullmatch(r"s([1-9][0-9]*)", name)
    if match is None:
        return None
    size = int(match[1])
    return size if size % SLOT_ALIGNMENT == 0 else None


@functools.lru_cache(maxsize=1024)
def _namespace_prefix(namespace: Namespace) -> bytes:
    """The header's first two length-prefixed names (model, shard) for ``namespace``."""
    model, shard = namespace.model.encode(), namespace.shard.label.encode()
    return bytes([len(model)]) + model + bytes([len(shard)]) + shard


def _asked_amiss(raw: bytes, request: GetRequest) -> bool:
    """Whether ``raw`` is an intact header of the requested key with another spec."""
    try:
        decoded = decode_header(raw, where=str(request.key))
    except CorruptObjectError:
        return False
    return decoded.key == request.key and decoded.spec != request.spec


def _claims(raw: bytes, key: ObjectKey) -> bool:
    """Whether ``raw`` is (or was, before damage) a header of ``key``'s object."""
    if raw[:4] != MAGIC:
        return False
    name = key.name.encode()
    names = _namespace_prefix(key.namespace) + bytes([len(name)]) + name
    return raw[_NAMES_AT : _NAMES_AT + len(names)] == names


def _header_ok(raw: bytes) -> bool:
    """Whether ``raw`` is a whole header (magic and header checksum; not the payload)."""
    if raw[:4] != MAGIC:
        return False
    recorded = int.from_bytes(raw[12:16], "little")
    return int(xxhash.xxh32_intdigest(raw[:12] + bytes(4) + raw[16:HEADER_SIZE])) == recorded


def _zero_tail(views: Sequence[memoryview]) -> int:
    """How many bytes at the end of the concatenated ``views`` are zero."""
    count = 0
    for view in reversed(views):
        data = bytes(view)
        stripped = len(data.rstrip(b"\0"))
        count += len(data) - stripped
        if stripped:
            break
    return count


def _data_slots(fd: int, slots: int, slot_size: int) -> Iterator[int]:
    """Indexes of the slots of a data file that may hold data (holes skipped)."""
    index = 0
    while index < slots:
        try:
            offset = os.lseek(fd, index * slot_size, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:
                return  # only holes from here on
            yield from range(index, slots)  # SEEK_DATA unsupported: look at every slot
            return
        index = max(index, offset // slot_size)
        if index >= slots:
            return
        yield index
        index += 1


def _open_created(path: Path, flags: int, mode: int, exact: bool) -> int:
    """Open ``path``, creating it with permission bits ``mode`` if it is missing.

    ``exact`` sets them past the umask too; a file another process created is opened as
    it is.
    """
    while True:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile: create it
                return os.open(path, flags | os.O_CLOEXEC)
            continue
        if exact:
            try:
                os.fchmod(fd, mode)
            except OSError:
                os.close(fd)
                raise
        return fd


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _ofd_lock(fd: int, start: int, length: int) -> None:
    request = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, request)


def _ofd_unlock(fd: int, start: int, length: int) -> None:
    request = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)


def _preadv_full(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Read into ``views`` from ``offset`` until they are full or the file ends."""
    total = 0
    pending = [v for v in views if v.nbytes]
    while pending:
        got = os.preadv(fd, pending[:IOV_MAX], offset + total)
        if got == 0:
            break
        total += got
        pending = advance(pending, got)
    return total


def _pwritev_full(fd: int, views: Sequence[memoryview], offset: int) -> None:
    total = 0
    pending = [v for v in views if v.nbytes]
    while pending:
        written = os.pwritev(fd, pending[:IOV_MAX], offset + total)
        total += written
        pending = advance(pending, written)


def _scatter(source: memoryview, views: Sequence[memoryview], start: int) -> None:
    """Copy ``source`` into the concatenation of ``views``, from byte ``start`` on."""
    position = 0
    done = 0
    for view in views:
        end = position + view.nbytes
        if end > start and done < source.nbytes:
            begin = max(start, position) - position
            count = min(view.nbytes - begin, source.nbytes - done)
            view[begin : begin + count] = source[done : done + count]
            done += count
        position = end


def _gather(views: Sequence[memoryview], start: int, target: memoryview) -> None:
    """Fill ``target`` from the concatenation of ``views``, from byte ``start`` on."""
    position = 0
    done = 0
    for view in views:
        end = position + view.nbytes
        if end > start and done < target.nbytes:
            begin = max(start, position) - position
            count = min(view.nbytes - begin, target.nbytes - done)
            target[done : done + count] = view[begin : begin + count]
            done += count
        position = end


_QUARANTINED_NAME: Final = re.compile(r"[0-9]+\.[0-9]+\.[^/]+")
"""How a slot copy in ``quarantine/`` is named: ``<time in ns>.<pid>.<object name>``."""
