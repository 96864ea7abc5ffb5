"""The ``file`` backend: one self-checking file per object under a local directory.

The embedded default. Layout under ``root``::

    sglang-storage.json                      marker: format version, file mode, creator
    objects/<model>/<kind>/<shard>/<xx>/<name>  one object (header + payload); xx: 256 shards
    tmp/.sgs-<pid>-<token>-<serial>.tmp      writes in progress, each locked by its writer
    quarantine/                              objects that failed verification

**Whose directory it is.** A root is a store once it holds the marker, written when the
store is created (in a missing or empty directory). A non-empty directory without one is
refused with a :class:`~sglang_storage.errors.ConfigError` (``adopt=True`` takes it over),
and nothing the backend did not write is ever removed: only names that start with
``.sgs-`` are its temporary files.

**Who may read it.** Files are created ``0600`` and directories ``0700`` (KV pages encode
prompts); ``file_mode`` shares them with a group (:class:`FileMode`). The mode is
recorded in the marker, so every later open keeps it; ``scan()`` reports objects whose
permissions allow more.

**Nothing outside the root.** Another local user who can write to the root may plant
links and special files there. Below the root (whose own links are resolved once, at
open) every path is opened anew following no symbolic link, and renames, removals and
fsyncs go through descriptors of directories reached that way: a link at an object's
place is moved aside, never read through; a link on the way makes a put that key's error
and a read a miss; a link in place of ``objects/``, ``tmp/`` or ``quarantine/`` is
refused at open. A put is ``PRESENT`` only where a whole object that verifies is
already there; a directory at a key's place is that key's error.

Writes go to a temporary file, optionally fsync'ed, then are renamed into place, so a
reader (in any process) sees either no object or a whole one, and concurrent writers of
one key leave one whole object. A read is one ``preadv`` of header and payload straight
into the caller's buffers, then verification; a failed check zeroes the buffers,
quarantines the file and reports the key corrupt. Batches are spread over a few I/O
threads (the system calls and the checksum release the GIL).

Several processes (TP ranks) may share one root. Each keeps its own index of what is
stored (rebuilt by a directory scan when it opens), learns of other processes' objects
when it meets them, and enforces ``capacity_bytes`` over what it knows.

Opening removes the temporary files of writers that are gone (a ``kill -9`` mid-write
leaves one). A writer holds an ``flock`` on its temporary file from its creation until
it is renamed into place, and the kernel drops it when the writer dies, so the test holds
across PID namespaces (containers sharing one host directory). Opened ``read_only``,
the backend changes nothing under ``root``: no directories, marker or cleanup at open,
no quarantine on a failed read, and writes, deletes and clears are refused - how
``sglang-storage fsck`` inspects a store. It is
:class:`~sglang_storage.storage.backend.Scannable`: ``scan()`` reports every object (its
header, size and payload checksum), orphaned temporary file and foreign file, and
``repair()`` quarantines damaged objects, removes orphans and restricts objects whose
permissions let other users read them.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import importlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Final, cast

import attrs
import xxhash

from sglang_storage.config import BYTES, instance_of, int_in_range, optional, positive_int
from sglang_storage.core import (
    EvictionPolicy,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutRequest,
    PutResult,
    valid_names,
)
from sglang_storage.errors import (
    BackendIOError,
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
from sglang_storage.storage.capacity import CapacityIndex, KeySlots
from sglang_storage.storage.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    HeaderTemplate,
    ObjectHeader,
    check_object,
    checksum,
    decode_header,
    encode_header,
    header_template,
)
from sglang_storage.storage.fsck import (
    HeaderCheck,
    ObjectReport,
    ObjectState,
    PayloadHasher,
    RepairAction,
    RepairResult,
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
    LINK_ERRNOS,
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
    make_dirs_beneath,
    marker_fields,
    namespace_of,
    narrowed,
    open_beneath,
    open_store_dir,
    openat2_usable,
    process_umask,
    read_marker,
    remove_dead_temp,
    remove_own_tree,
    subdirs,
    temp_writer,
    write_error,
    write_marker,
)

__all__ = ["Durability", "FileBackend", "FileBackendConfig", "FileMode"]

log = logging.getLogger(__name__)

MARKER: Final = "sglang-storage.json"
SPREAD_READ_BYTES: Final = 192 << 10
"""A read batch goes to the I/O threads only when its objects average this many payload
bytes; smaller ones are read on the caller's thread (``benchmarks/file_backend.py``:
two threads read 64 and 128 KiB pages slower than one, 256 KiB and larger faster)."""


class Durability(enum.Enum):
    """How hard a write works to survive a crash before it is acknowledged."""

    NONE = "none"
    """No fsync. A crash of the host can lose recent objects (never corrupt a read:
    damaged objects fail verification). SGLang's own file backend behaves like this."""
    DATA = "data"
    """fsync the object's file before renaming it into place."""
    FULL = "full"
    """fsync the file, rename, then fsync its directory and every directory the write
    created: an acknowledged object survives power loss."""


@attrs.frozen(kw_only=True)
class FileBackendConfig:
    """Options of the ``file`` backend."""

    root: Path = attrs.field(converter=Path, validator=instance_of(Path))
    """The directory holding the store; created when missing."""
    capacity_bytes: int | None = attrs.field(
        default=None, validator=optional(positive_int), metadata=BYTES
    )
    """The most bytes this process keeps under ``root`` (headers included); ``None`` for
    no cap. A cap needs an eviction policy."""
    durability: Durability = attrs.field(default=Durability.NONE, validator=instance_of(Durability))
    """When a write counts as done; see :class:`Durability`."""
    io_threads: int = attrs.field(default=2, validator=int_in_range(1, 64))
    """Threads a batch is spread over."""
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


class FileBackend:
    """Self-checking objects as files under one directory, shareable by local processes.

    Args:
        config: Its options.
        eviction: Chooses victims when ``config.capacity_bytes`` is reached.

    Raises:
        BackendUnavailableError: ``root`` cannot be created or used, or holds a store of
            another format version; read-only: ``root`` is not a directory.
        ConfigError: ``root`` is a non-empty directory without a store marker (and
            ``adopt`` is false).
    """

    name = "file"

    def __init__(
        self,
        config: FileBackendConfig,
        *,
        eviction: EvictionPolicy[ObjectKey] | None = None,
    ) -> None:
        self._config = config
        self._root = config.root
        # Paths for I/O start at the root with its links resolved once, here: below it,
        # every path is opened anew with no link followed (``open_beneath``).
        real = Path(os.path.realpath(self._root))
        self._objects_dir = real / "objects"
        self._objects_prefix = f"{self._objects_dir}/"
        self._tmp_dir = real / "tmp"
        self._tmp_prefix = str(self._tmp_dir)
        self._temp_names = TempNames()
        self._umask = process_umask()
        self._set_mode(config.file_mode or FileMode.PRIVATE)
        self._quarantine_dir = real / "quarantine"
        self._slots = KeySlots()
        self._ordered = eviction is not None
        # Without a policy the index holds each object as one compact slot (bytes);
        # a policy is handed the ObjectKeys themselves (and holds them anyway).
        self._slot: Callable[[ObjectKey], _Slot] = _same_key if self._ordered else self._slots.slot
        self._sizes: dict[int, int] = {}
        """The distinct object sizes seen at open, each indexed size one shared int."""
        self._index: CapacityIndex[_Slot] = CapacityIndex(
            config.capacity_bytes,
            cast("EvictionPolicy[_Slot] | None", eviction),
            owner=f"file backend at {self._root}",
        )
        self._stats = StatsRecorder()
        self._quarantined = 0
        self._quarantine_bytes = 0
        """Bytes under ``quarantine/``, held against the cap as a standing reservation."""
        self._lock = threading.Lock()
        self._threads = IOThreads(config.io_threads, self.name)
        self._closed = False
        self._prepare()
        self._rebuild_index()

    # ------------------------------------------------------------------ opening

    def _set_mode(self, mode: FileMode) -> None:
        self._mode = mode
        self._file_bits, self._dir_bits = mode.file_bits, mode.dir_bits
        # Set exactly only where the umask would narrow them (one fchmod per write).
        self._file_exact = self._file_bits & ~self._umask != self._file_bits
        self._dir_exact = self._dir_bits & ~self._umask != self._dir_bits

    def _prepare(self) -> None:
        if self._config.read_only:
            self._check_store()
            return
        try:
            self._make_root()
            if not claim_root(
                self._root, MARKER, owner=type(self._config).__name__, adopt=self._config.adopt
            ):
                write_marker(
                    self._root,
                    MARKER,
                    marker_fields(
                        self.name,
                        {"format_version": FORMAT_VERSION, "file_mode": self._mode.value},
                    ),
                    self._temp_names,
                    mode=self._file_bits,
                    exact=self._file_exact,
                )
            self._use_marker(read_marker(self._root / MARKER), "writes")
            for directory in (self._objects_dir, self._tmp_dir, self._quarantine_dir):
                make_dirs(str(directory), self._dir_bits, exact=self._dir_exact)
            self._check_dirs()
            if self._config.clean_at_open:
                self._remove_orphans()
        except (ConfigError, BackendUnavailableError):
            raise
        except (OSError, ValueError) as error:
            raise BackendUnavailableError(
                backend=self.name, reason=f"cannot use {self._root}: {error}"
            ) from error

    def _check_dirs(self) -> None:
        """Refuse a link (or a file) in place of one of the store's directories."""
        root_fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in _STORE_DIRS:
                try:
                    os.close(open_store_dir(name, root_fd, what=self.name))
                except FileNotFoundError:
                    if not self._config.read_only:
                        raise  # a read-only open of a store that never held any is fine
        finally:
            os.close(root_fd)

    def _store_dir(self, path: Path) -> int:
        """A descriptor of one of the store's directories, reached through no link."""
        return open_beneath(None, str(path), os.O_RDONLY | os.O_DIRECTORY)

    def _make_root(self) -> None:
        """Create ``root`` (private, or with the configured mode) when it is missing."""
        if self._root.exists():
            return
        self._root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self._root, self._dir_bits)
        except FileExistsError:
            return
        if self._dir_exact:
            os.chmod(self._root, self._dir_bits)

    def _use_marker(self, content: dict[str, object], does: str) -> None:
        """Check the marker's format version; take its file mode unless one was given."""
        version = content.get("format_version")
        if version != FORMAT_VERSION:
            raise BackendUnavailableError(
                backend=self.name,
                reason=f"{self._root} holds a store of format version {version}; "
                f"this build {does} version {FORMAT_VERSION}"
                + (" (use another root)" if does == "writes" else ""),
            )
        recorded = content.get("file_mode")
        if self._config.file_mode is None and isinstance(recorded, str):
            with contextlib.suppress(ValueError):
                self._set_mode(FileMode(recorded))

    def _check_store(self) -> None:
        """Read-only open: the root must be a directory holding this build's store."""
        try:
            if not self._root.is_dir():
                raise BackendUnavailableError(
                    backend=self.name,
                    reason=f"{self._root} is not a directory (a read-only open creates nothing)",
                )
            if claim_root(
                self._root, MARKER, owner=type(self._config).__name__, adopt=self._config.adopt
            ):
                self._use_marker(read_marker(self._root / MARKER), "reads")
            self._check_dirs()
        except (ConfigError, BackendUnavailableError):
            raise
        except (OSError, ValueError) as error:
            raise BackendUnavailableError(
                backend=self.name, reason=f"cannot use {self._root}: {error}"
            ) from error

    def _remove_orphans(self) -> None:
        """Delete temporary files (ours by name) whose writers are gone."""
        for directory in (self._tmp_dir, self._root):
            dir_fd = (
                self._store_dir(directory)
                if directory is self._tmp_dir
                else os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            )
            try:
                for name in os.listdir(dir_fd):
                    if temp_writer(name) is not None:
                        with contextlib.suppress(OSError):
                            remove_dead_temp(name, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)

    def _rebuild_index(self) -> None:
        """Index every object under ``objects/``, oldest first (the eviction order).

        An object is sized by its file, which a put writes whole; a file with holes, or
        larger than the cap, is sized by its header instead: one whose header does not
        account for its size is quarantined, a valid one larger than the cap is evicted
        (it can never fit), so neither makes the cap evict the store's other objects.
        """
        # Only a policy cares about the order: without one, objects go straight in.
        ordered: list[tuple[float, _Slot, int]] = []
        # One thread: spread over the I/O threads it was slower (the work between the
        # system calls holds the GIL).
        for job in self._fans():
            if not self._ordered:
                named = self._scan_named(*job)
                if named is not None:
                    pairs, odd_named = named
                    for key, status in odd_named:
                        if self._sized_by_header(key, status):
                            pairs.append((self._slot(key), status.st_size))
                    self._index.add_many(pairs)
                    continue
            found, odd = self._scan_fan(job)
            for key, status in odd:
                if self._sized_by_header(key, status):
                    found.append((self._slot(key), status.st_size, status.st_mtime))
            if self._ordered:
                ordered.extend((mtime, slot, size) for slot, size, mtime in found)
            else:
                self._index.add_many([(slot, size) for slot, size, _ in found])
        ordered.sort(key=lambda item: item[0])
        self._index.add_many([(slot, size) for _, slot, size in ordered])
        del ordered
        if not self._config.read_only:
            self._delete_slots(self._index.over_capacity())
            held = self._quarantine_bytes  # what quarantining at this scan already held
            self._hold_quarantined(_allocated_under(self._quarantine_dir) - held)

    def _sized_by_header(self, key: ObjectKey, status: os.stat_result) -> bool:
        """Whether the suspicious file of ``key`` may be indexed at its size (see above)."""
        header = self._stored_header(key)
        valid = header is not None and header.object_size == status.st_size
        capacity = self._config.capacity_bytes
        if valid and (capacity is None or status.st_size <= capacity):
            return True
        if self._config.read_only:
            return False
        if valid:
            self._delete_files([key])
        elif self._quarantine(status.st_ino, key):
            log.warning(
                "file backend: %s claims %d bytes its header does not account for; quarantined",
                key,
                status.st_size,
            )
        return False

    def _stored_header(self, key: ObjectKey) -> ObjectHeader | None:
        """The header stored for ``key`` when it decodes and names ``key``, else None."""
        try:
            fd = open_beneath(None, self._path(key), os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = os.pread(fd, HEADER_SIZE, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            header = decode_header(raw, where=str(key))
        except CorruptObjectError:
            return None
        return header if header.key == key else None

    def _fans(self) -> Iterator[tuple[Namespace, os.DirEntry[str]]]:
        """Every fan directory of every namespace under ``objects/``."""
        for model in subdirs(self._objects_dir):
            for kind in subdirs(Path(model.path)):
                for shard in subdirs(Path(kind.path)):
                    namespace = namespace_of(model.name, kind.name, shard.name)
                    if namespace is None or namespace.shard.label != shard.name:
                        continue  # "tp0of1" parses, but path_of never looks there
                    for fan in subdirs(Path(shard.path)):
                        yield namespace, fan

    def _scan_fan(self, job: tuple[Namespace, os.DirEntry[str]]) -> _FanScan:
        """The objects in one fan directory: ``(slot, size, mtime)`` each, and odd files.

        Odd: with holes, or larger than the cap (the caller sizes them by their header).
        """
        namespace, fan = job
        capacity = self._config.capacity_bytes
        slot_of, sizes = self._slot, self._sizes
        found: list[tuple[_Slot, int, float]] = []
        odd: list[tuple[ObjectKey, os.stat_result]] = []
        with os.scandir(fan.path) as listing:
            files = [e for e in listing if e.is_file(follow_symlinks=False)]
        names = [e.name for e in files]
        for key, entry in zip(_keys_of(namespace, names), files, strict=True):
            # A file outside its own fan directory is not where path_of looks: it is no
            # object of this store (fsck reports it).
            if key is None or fan.name != _fan(key.name):
                continue
            try:
                status = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            size = status.st_size
            if status.st_blocks * 512 < size or (capacity is not None and size > capacity):
                odd.append((key, status))
            else:
                # Objects of one store come in few sizes: one int object each, not one
                # per key (28 bytes of the index's footprint per object).
                found.append((slot_of(key), sizes.setdefault(size, size), status.st_mtime))
        return found, odd

    def _scan_named(
        self, namespace: Namespace, fan: os.DirEntry[str]
    ) -> tuple[list[tuple[_Slot, int]], list[tuple[ObjectKey, os.stat_result]]] | None:
        """:meth:`_scan_fan` as ``(slot, size)`` pairs, for a store without eviction order.

        Slots come straight from the names; keys are built only for odd files. None (the
        caller scans with :meth:`_scan_fan`) when a name is not a valid object name.
        """
        if _SCAN_FILES is not None:
            names, file_sizes, blocks = _SCAN_FILES(os.fsencode(fan.path))
        else:
            names, file_sizes, blocks = _scan_files(fan.path)
        if not names:
            return [], []
        if not valid_names(names):
            return None
        number = _FAN_NUMBERS.get(fan.name)
        if number is None:
            return [], []  # no object name hashes to this directory
        capacity = self._config.capacity_bytes
        sizes, digest = self._sizes, xxhash.xxh32_intdigest
        kept: list[str] = []
        kept_sizes: list[int] = []
        odd: list[tuple[ObjectKey, os.stat_result]] = []
        for name, size, allocated in zip(names, file_sizes, blocks, strict=True):
            if digest(name.encode()) & 0xFF != number:
                continue  # outside its own fan directory: not where path_of looks
            if allocated * 512 < size or (capacity is not None and size > capacity):
                try:
                    status = os.stat(os.path.join(fan.path, name), follow_symlinks=False)
                except FileNotFoundError:
                    continue
                odd.append((namespace.key(name), status))
            else:
                kept.append(name)
                kept_sizes.append(sizes.setdefault(size, size))
        return list(zip(self._slots.name_slots(namespace, kept), kept_sizes, strict=True)), odd

    # ------------------------------------------------------------------ protocol

    @property
    def root(self) -> Path:
        """The store's directory."""
        return self._root

    @property
    def read_only(self) -> bool:
        """Whether it was opened to inspect only."""
        return self._config.read_only

    @property
    def file_mode(self) -> FileMode:
        """Who may read what it creates: the configured mode, else the store's own."""
        return self._mode

    @property
    def capabilities(self) -> Capabilities:
        """Zero copy, shareable by processes on this host, durable, scannable."""
        return Capabilities(
            zero_copy=True,
            shared_across_processes=True,
            shared_across_hosts=False,
            durable=True,
            bounded=self._index.bounded,
            scannable=True,
        )

    def path_of(self, key: ObjectKey) -> Path:
        """Where ``key``'s object lives."""
        return Path(self._path(key))

    def _path(self, key: ObjectKey) -> str:
        # A str, not a Path: this runs once per key on every operation.
        return f"{self._objects_prefix}{key.namespace.path}/{_fan(key.name)}/{key.name}"

    def _fan_dir(self, key: ObjectKey) -> int | None:
        """A descriptor of ``key``'s fan directory (no link followed); None when missing.

        Raises:
            OSError: it cannot be opened; a link on the way is one of ``LINK_ERRNOS``.
        """
        try:
            return open_beneath(
                None,
                f"{self._objects_prefix}{key.namespace.path}/{_fan(key.name)}",
                os.O_PATH | os.O_DIRECTORY,
            )
        except FileNotFoundError:
            return None

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored (by this or another process).

        Answered from this process's index where it holds the key (no system call), else
        from the file system. The index is a cache of what this process wrote, read or
        found: another process's delete or clear can leave a stale "yes", which a get
        then reports as a miss (and forgets); a "no" is never taken from the index.
        """
        self._check_open()
        indexed, slot = self._index.__contains__, self._slot
        return [indexed(slot(key)) or self._exists(key) for key in keys]

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys are stored (see :meth:`exists`)."""
        self._check_open()
        indexed, slot = self._index.__contains__, self._slot
        return count_prefix(indexed(slot(key)) or self._exists(key) for key in keys)

    def _exists(self, key: ObjectKey) -> bool:
        # One lstat: a link (or anything but a regular file) at the key's place is no
        # object. Reads open nothing through a link on the way either, so such a key
        # can at worst be a miss after this said it exists, never a hit.
        try:
            return stat.S_ISREG(os.stat(self._path(key), follow_symlinks=False).st_mode)
        except OSError:
            return False

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Read and verify each requested object straight into its buffers."""
        self._check_open()
        read_requests = _READ_REQUESTS
        if read_requests is not None and openat2_usable():
            results = self._get_native(read_requests, requests)
        else:
            results = self._get_python(requests)
        self._stats.record_gets(results)
        return results

    def _get_native(
        self, read_requests: _ReadRequests, requests: Sequence[GetRequest]
    ) -> list[GetResult]:
        # Each I/O thread builds its part's paths and expected headers in C (GIL held),
        # then opens, reads, verifies (header and xxh3, each payload while it is in the
        # core's cache) and closes without the GIL; this thread builds the hits, and says
        # why of anything else (_finish, as for the Python reader).
        layout = self._layout

        def read(part: list[GetRequest]) -> tuple[bytes, dict[int, _Row]]:
            return read_requests(part, layout)

        results: list[GetResult] = []
        touch, slot, hit = self._index.touch, self._slot, GetResult.hit_of
        start = 0
        sizes = [request.nbytes for request in requests]
        for codes, details in self._threads.map_parts(read, requests, sizes=sizes, kind="read"):
            part = requests[start : start + len(codes)]
            if not details:  # all verified, the usual case
                for request in part:
                    touch(slot(request.key), HEADER_SIZE + request.nbytes)
                results += [hit(request) for request in part]
            else:
                for index, (request, code) in enumerate(zip(part, codes, strict=True)):
                    if code == _VERIFIED:
                        touch(slot(request.key), HEADER_SIZE + request.nbytes)
                        results.append(hit(request))
                    else:
                        read_one = _Read(self._path(request.key), request)
                        read_one.take(code, details[index])
                        results.append(self._finish(read_one))
            start += len(codes)
        return results

    def _layout(self, namespace: Namespace, spec: ObjectSpec) -> tuple[bytes, bytes, bytes]:
        """What the C reader needs of one namespace and spec.

        The namespace's directory (with its trailing slash), and the expected header's
        bytes before and after the name.
        """
        head, tail = header_template(namespace, spec).frame()
        return os.fsencode(f"{self._objects_prefix}{namespace.path}/"), head, tail

    def _get_python(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        # Two phases: the I/O threads only open, read, hash and close (almost all of it
        # without the GIL, so they overlap); this thread then checks every header and
        # builds the results.
        reads = [_Read(self._path(r.key), r) for r in requests]
        if sum(r.nbytes for r in requests) < SPREAD_READ_BYTES * len(requests):
            # Small objects on this thread: handing the GIL back and forth between
            # threads costs more than their overlap saves (64 KiB pages read faster on
            # one).
            _read_part(reads)
        else:
            sizes = [request.nbytes for request in requests]
            self._threads.map_parts(_read_part, reads, sizes=sizes, kind="read")
        return [self._finish(read) for read in reads]

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Write each request's buffers as a whole file; existing keys are kept."""
        self._check_writable("put_from")
        write_objects = _WRITE_OBJECTS
        if (
            write_objects is not None
            and self._config.durability is not Durability.FULL
            and openat2_usable()
        ):
            results = self._put_native(write_objects, requests)
        else:
            results = self._threads.spread(self._put, requests)
        self._stats.record_puts(results)
        return results

    def _put_native(
        self, write_objects: _WriteObjects, requests: Sequence[PutRequest]
    ) -> list[PutResult]:
        # Room is reserved here (evicting as a put does); the I/O threads then hash, write
        # and rename in C without the GIL, each object through its locked temporary file
        # as _write does. _put does the rest, and says what happened: a key this process
        # knows is stored (or, under a cap, that has anything at its place: no room is
        # made for a PRESENT put), what C did not store (a file at the key's place, no
        # directory yet, an error), and the requests from the first one the cap has no
        # room for while the others are in flight (one by one, they may evict what this
        # batch stored).
        items: list[_WriteItem] = []
        native: list[tuple[int, _Slot]] = []  # each item's request position and slot
        rest: list[int] = []  # the positions of the requests _put does
        fsencode, prefix, names = os.fsencode, self._objects_prefix, self._temp_names
        tmp_dir, expected = self._tmp_prefix, _ExpectedHeaders()
        indexed, bounded = self._index.__contains__, self._index.capacity_bytes is not None
        for at, request in enumerate(requests):
            key = request.key
            slot = self._slot(key)
            if indexed(slot) or (bounded and self._occupied(key)):
                rest.append(at)
                continue
            try:
                victims = self._index.reserve(HEADER_SIZE + request.nbytes)
            except StorageError:
                rest.extend(range(at, len(requests)))
                break
            if victims:
                self._delete_slots(victims)
            native.append((at, slot))
            items.append(
                (
                    fsencode(f"{prefix}{key.namespace.path}/{_fan(key.name)}"),
                    fsencode(key.name),
                    fsencode(names.next(tmp_dir, "tmp")),
                    request.buffers,
                    expected(key, request.spec),
                )
            )
        modes = (self._file_bits, self._file_exact, self._dir_bits, self._dir_exact)
        sync = self._config.durability is Durability.DATA
        sizes = [requests[at].nbytes for at, _ in native]
        codes = b"".join(
            self._threads.map_parts(
                lambda part: write_objects(part, modes, sync), items, sizes=sizes, kind="write"
            )
        )
        results: list[PutResult | None] = [None] * len(requests)
        for code, (at, slot) in zip(codes, native, strict=True):
            request = requests[at]
            size = HEADER_SIZE + request.nbytes
            if code == _STORED:
                self._index.commit(slot, size)
                results[at] = PutResult.stored_of(request)
            else:
                self._index.release(size)
                rest.append(at)
        if rest:
            again = self._threads.spread(self._put, [requests[at] for at in rest])
            for at, result in zip(rest, again, strict=True):
                results[at] = result
        return cast("list[PutResult]", results)

    def _occupied(self, key: ObjectKey) -> bool:
        """Whether anything (a file, a link, a directory) is at ``key``'s place."""
        try:
            os.stat(self._path(key), follow_symlinks=False)
        except OSError:
            return False
        return True

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """Remove the stored ones of ``keys``."""
        self._check_writable("delete")
        removed = 0
        for key in keys:
            self._index.remove(self._slot(key))
            try:
                removed += self._unlink(key)
            except OSError as error:
                raise io_error(self.name, f"delete of {key}", error) from error
        self._stats.record_deleted(removed)

    def _unlink(self, key: ObjectKey) -> bool:
        """Remove ``key``'s file, never through a link; whether there was one.

        A link on the way (planted by someone else) counts as no object.

        Raises:
            OSError: it could not be removed.
        """
        try:
            dir_fd = self._fan_dir(key)
        except OSError as error:
            if error.errno in LINK_ERRNOS:
                return False
            raise
        if dir_fd is None:
            return False
        try:
            os.unlink(key.name, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        finally:
            os.close(dir_fd)
        return True

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace`` (other namespaces are untouched)."""
        self._check_writable("clear")
        parent, _, leaf = namespace.path.rpartition("/")
        doomed = self._temp_names.name("clear")
        parent_fd: int | None = None
        tmp_fd: int | None = None
        try:
            parent_fd = open_beneath(
                None, f"{self._objects_prefix}{parent}", os.O_PATH | os.O_DIRECTORY
            )
            # Only a real directory is moved: a link there is not this store's.
            if stat.S_ISDIR(os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                tmp_fd = self._store_dir(self._tmp_dir)
                # Renaming first makes the namespace vanish at once for every process.
                os.rename(leaf, doomed, src_dir_fd=parent_fd, dst_dir_fd=tmp_fd)
                remove_own_tree(doomed, dir_fd=tmp_fd)
        except FileNotFoundError:
            pass
        except OSError as error:
            if error.errno not in LINK_ERRNOS:
                raise io_error(self.name, f"clear of {namespace.path}", error) from error
            log.warning("file backend: not clearing %s: a link on its path", namespace.path)
        finally:
            for fd in (parent_fd, tmp_fd):
                if fd is not None:
                    os.close(fd)
        prefixes = self._slots.prefixes(namespace)  # None: no slot of it was ever made
        for slot in self._index.keys():  # noqa: SIM118 - a snapshot, not a dict
            if isinstance(slot, ObjectKey):
                ours = slot.namespace == namespace
            else:
                ours = prefixes is not None and slot.startswith(prefixes)
            if ours:
                self._index.remove(slot)

    def stats(self) -> BackendStats:
        """Contents (as this process knows them) and counters."""
        self._check_open()
        objects, nbytes = self._index.totals()
        return self._stats.snapshot(
            objects=objects, nbytes=nbytes, capacity_bytes=self._index.capacity_bytes
        )

    @property
    def quarantined(self) -> int:
        """Objects this instance moved to quarantine after a failed check."""
        with self._lock:
            return self._quarantined

    def close(self) -> None:
        """Stop the I/O threads; later calls raise ``BackendUnavailableError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._threads.close()

    def __enter__(self) -> FileBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reads

    def _finish(self, read: _Read) -> GetResult:
        request = read.request
        key = request.key
        if read.error is not None:
            scrub(request.buffers)
            return GetResult.error_of(key, io_error(self.name, f"read of {key}", read.error))
        if read.link:
            scrub(request.buffers)
            read.inode = self._link_at(key)
            if not read.inode:
                self._index.remove(self._slot(key))
                return GetResult.miss_of(key)  # a link on the way: no object of this store
        elif read.got < 0:
            self._index.remove(self._slot(key))
            return GetResult.miss_of(key)
        if read.link or read.not_regular:
            reason: str | None = "is not a regular file"
        else:
            reason = self._verify(read)
        if reason is not None:
            scrub(request.buffers)
            corrupt = CorruptObjectError(key=str(key), reason=reason)
            if self._asked_amiss(read):  # a caller error: the object itself is intact
                log.warning("file backend: %s; kept (asked for with another spec)", corrupt)
                return GetResult.corrupt_of(key, corrupt)
            self._quarantine(read.inode, key)
            log.warning("file backend: %s; quarantined", corrupt)
            return GetResult.corrupt_of(key, corrupt)
        self._index.touch(self._slot(key), HEADER_SIZE + request.nbytes)
        return GetResult.hit_of(request)

    def _link_at(self, key: ObjectKey) -> int:
        """The inode of a symbolic link at ``key``'s own place (0: none, or it dangles).

        Only the link's own entry is looked at, and whether its target exists: nothing is
        opened through it.
        """
        try:
            dir_fd = self._fan_dir(key)
        except OSError:
            return 0
        if dir_fd is None:
            return 0
        try:
            status = os.stat(key.name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISLNK(status.st_mode):
                return 0
            os.stat(key.name, dir_fd=dir_fd)  # a dangling link is a miss, as no file is
        except OSError:
            return 0
        finally:
            os.close(dir_fd)
        return status.st_ino

    def _verify(self, read: _Read) -> str | None:
        """Why the bytes read must not be delivered, or None."""
        request, header, got = read.request, read.header, read.got
        template = header_template(request.key.namespace, request.spec)
        # The whole buffer when a header's worth was read (expected_checksum reads 512 bytes).
        recorded = template.expected_checksum(
            header if got >= HEADER_SIZE else b"", request.key.name
        )
        if recorded is None:
            return self._explain(request, header, got)
        expected = HEADER_SIZE + request.nbytes
        if got < expected:
            return f"truncated: {got - HEADER_SIZE} of {request.nbytes} payload bytes"
        if got > expected:
            return "has bytes after its payload"
        if read.digest != recorded:
            return "payload checksum mismatch"
        return None

    def _explain(self, request: GetRequest, header: bytearray, got: int) -> str:
        """Why a header that is not the expected one was refused."""
        try:
            decoded = decode_header(header[: min(got, HEADER_SIZE)], where=str(request.key))
        except CorruptObjectError as error:
            return error.reason
        return (
            check_object(decoded, request.key, request.spec)
            or "header differs from the expected one"
        )

    def _asked_amiss(self, read: _Read) -> bool:
        """Whether the header read is an intact header of this very key with another spec.

        Such an object is whole as it was written; the caller asked for it with the wrong
        dtype, shape or layout, which is no reason to quarantine it.
        """
        request, got = read.request, read.got
        if read.link or read.not_regular or got < HEADER_SIZE:
            return False
        try:
            decoded = decode_header(read.header, where=str(request.key))
        except CorruptObjectError:
            return False
        return decoded.key == request.key and decoded.spec != request.spec

    def _hold_quarantined(self, nbytes: int) -> None:
        """Count ``nbytes`` more quarantined bytes against the cap, evicting as a put would.

        A damaged object's bytes move from the index to this reservation, so they stay
        counted. What eviction cannot make room for (a quarantine found at open larger
        than the cap) is only logged: purge it with ``sglang-storage fsck
        --purge-quarantine``.
        """
        if nbytes <= 0:
            return
        try:
            victims = self._index.reserve(nbytes)
        except CapacityError:
            log.warning(
                "file backend: %d quarantined bytes do not fit under the cap; purge them "
                "with `sglang-storage fsck --purge-quarantine`",
                nbytes,
            )
            return
        with self._lock:
            self._quarantine_bytes += nbytes
        self._delete_slots(victims)

    def _release_quarantined(self, nbytes: int) -> None:
        """Give back the reservation of ``nbytes`` quarantined bytes that were purged."""
        with self._lock:
            nbytes = min(nbytes, self._quarantine_bytes)
            self._quarantine_bytes -= nbytes
        self._index.release(nbytes)

    @property
    def quarantine_bytes(self) -> int:
        """Bytes this instance counts under ``quarantine/`` (against the cap, if any)."""
        with self._lock:
            return self._quarantine_bytes

    def purge_quarantine(self, *, dry_run: bool = False) -> list[tuple[str, int]]:
        """Remove what this backend moved to ``quarantine/``; returns ``(path, bytes)`` of each.

        Only regular files named as the backend names them (``<ns>.<pid>.<object
        name>``) are removed; anything else there is kept. ``dry_run`` lists them only.

        Raises:
            StateError: the backend was opened read-only (unless ``dry_run``).
        """
        self._check_open()
        if not dry_run:
            self._check_writable("purge the quarantine")
        removed: list[tuple[str, int]] = []
        try:
            quarantine_fd = self._store_dir(self._quarantine_dir)
        except FileNotFoundError:
            return removed
        try:
            for name in sorted(os.listdir(quarantine_fd)):
                if not _QUARANTINED_NAME.fullmatch(name):
                    continue
                try:
                    status = os.stat(name, dir_fd=quarantine_fd, follow_symlinks=False)
                    if not stat.S_ISREG(status.st_mode):
                        continue
                    if not dry_run:
                        os.unlink(name, dir_fd=quarantine_fd)
                except FileNotFoundError:
                    continue
                removed.append((str(self._quarantine_dir / name), status.st_size))
                if not dry_run:
                    self._release_quarantined(_allocated(status))
        finally:
            os.close(quarantine_fd)
        return removed

    def _quarantine(self, inode: int, key: ObjectKey) -> bool:
        """Move the corrupt file aside, unless another process has replaced it meanwhile.

        Returns whether it was moved (read-only: never). Nothing is resolved through a
        link: what is moved is the entry at the key's place itself.
        """
        self._index.remove(self._slot(key))
        if self._config.read_only:
            return False
        dir_fd: int | None = None
        quarantine_fd: int | None = None
        try:
            dir_fd = self._fan_dir(key)
            if (
                dir_fd is None
                or os.stat(key.name, dir_fd=dir_fd, follow_symlinks=False).st_ino != inode
            ):
                return False
            quarantine_fd = self._store_dir(self._quarantine_dir)
            target = f"{time.time_ns()}.{os.getpid()}.{key.name}"
            os.rename(key.name, target, src_dir_fd=dir_fd, dst_dir_fd=quarantine_fd)
            self._keep_private(quarantine_fd, target)
            moved = _allocated(os.stat(target, dir_fd=quarantine_fd, follow_symlinks=False))
        except OSError:
            return False
        finally:
            for fd in (dir_fd, quarantine_fd):
                if fd is not None:
                    os.close(fd)
        with self._lock:
            self._quarantined += 1
        self._hold_quarantined(moved)
        return True

    # ------------------------------------------------------------------ writes

    def _put(self, request: PutRequest) -> PutResult:
        key = request.key
        size = HEADER_SIZE + request.nbytes
        try:
            dir_fd, created = make_dirs_beneath(
                str(self._objects_dir),
                f"{key.namespace.path}/{_fan(key.name)}",
                self._dir_bits,
                exact=self._dir_exact,
            )
        except OSError as error:
            return PutResult.error_of(key, self._place_error(key, error))
        try:
            return self._put_in(request, size, dir_fd, created)
        finally:
            os.close(dir_fd)
            for fd in created:
                os.close(fd)

    def _place_error(self, key: ObjectKey, error: OSError) -> StorageError:
        if error.errno in LINK_ERRNOS:
            return BackendIOError(
                backend=self.name,
                operation=f"put of {key}",
                reason=f"a symbolic link or a file is on its path under {self._objects_dir} "
                f"({error.strerror}); links are never followed",
                code=error.errno,
            )
        return write_error(self.name, self._root, key, HEADER_SIZE, error)

    def _put_in(self, request: PutRequest, size: int, dir_fd: int, created: list[int]) -> PutResult:
        key = request.key
        slot = self._slot(key)
        try:
            held: os.stat_result | None = os.stat(key.name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            held = None
        except OSError as error:
            return PutResult.error_of(key, io_error(self.name, f"put of {key}", error))
        if held is not None:
            if stat.S_ISDIR(held.st_mode):
                # Not ours to remove, and a rename cannot replace it: this key only.
                return PutResult.error_of(
                    key,
                    BackendIOError(
                        backend=self.name,
                        operation=f"put of {key}",
                        reason=f"a directory is at its path {self._path(key)}",
                        code=errno.EISDIR,
                    ),
                )
            if stat.S_ISREG(held.st_mode) and held.st_size == size and self._holds(dir_fd, request):
                self._index.touch(slot, size=None)
                return PutResult.present_of(key)
            # Torn, of another shape, or no regular file: never acknowledged as stored;
            # the rename below replaces it.
            self._index.remove(slot)
        try:
            victims = self._index.reserve(size)
        except StorageError as error:
            return PutResult.error_of(key, error)
        if victims:
            self._delete_slots(victims)
        try:
            self._write(request, dir_fd, created)
        except OSError as error:
            self._index.release(size)
            return PutResult.error_of(key, write_error(self.name, self._root, key, size, error))
        self._index.commit(slot, size)
        return PutResult.stored_of(request)

    def _holds(self, dir_fd: int, request: PutRequest) -> bool:
        """Whether the file of ``request``'s key is a whole object of it that verifies.

        Header (key, spec, header checksum) and payload checksum, as a read checks them:
        only then is a put of the key ``PRESENT``.
        """
        key = request.key
        try:
            fd = os.open(
                key.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
            )
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            header = os.pread(fd, HEADER_SIZE, 0)
            template = header_template(key.namespace, request.spec)
            recorded = template.expected_checksum(header, key.name)
            return recorded is not None and _hash_payload(fd, request.nbytes) == recorded
        except OSError:
            return False
        finally:
            os.close(fd)

    def _keep_private(self, dir_fd: int, name: str) -> None:
        """Narrow a regular file moved aside to the store's mode (links are left alone)."""
        with contextlib.suppress(OSError):
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
            )
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISREG(mode) and exposed(mode, self._file_bits):
                    os.fchmod(fd, narrowed(mode, self._file_bits))
            finally:
                os.close(fd)

    def _write(self, request: PutRequest, dir_fd: int, created: list[int]) -> None:
        durability = self._config.durability
        header = encode_header(request.key, request.spec, checksum(request.buffers))
        # Locked from its creation until it has its final name: the lock says it is live.
        fd, tmp = create_temp(
            self._temp_names,
            self._tmp_prefix,
            "tmp",
            self._file_bits,
            exact=self._file_exact,
            nofollow=True,
        )
        try:
            try:
                _writev_full(fd, [memoryview(header), *request.buffers])
                if durability is not Durability.NONE:
                    os.fsync(fd)
                try:
                    os.replace(tmp, request.key.name, dst_dir_fd=dir_fd)
                except FileNotFoundError:
                    # Its directory was removed meanwhile (a clear): make it again.
                    dir_fd, more = self._redo_dirs(request.key)
                    created.extend(more)
                    os.replace(tmp, request.key.name, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        finally:
            os.close(fd)
        if durability is Durability.FULL:
            # The object's directory, and every directory this put created on its way
            # (with the parent of the first): each holds a new entry.
            os.fsync(dir_fd)
            for directory in created:
                os.fsync(directory)

    def _redo_dirs(self, key: ObjectKey) -> tuple[int, list[int]]:
        """``key``'s fan directory made again; closed with the put's other descriptors."""
        dir_fd, created = make_dirs_beneath(
            str(self._objects_dir),
            f"{key.namespace.path}/{_fan(key.name)}",
            self._dir_bits,
            exact=self._dir_exact,
        )
        return dir_fd, [*created, dir_fd]

    def _delete_files(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            with contextlib.suppress(OSError):
                self._unlink(key)
        self._stats.record_evicted(len(keys))

    def _delete_slots(self, slots: Sequence[_Slot]) -> None:
        """:meth:`_delete_files` of the keys of index slots (eviction victims)."""
        self._delete_files(
            [slot if isinstance(slot, ObjectKey) else self._slots.key(slot) for slot in slots]
        )

    # ------------------------------------------------------------------ threads

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailableError(backend=self.name, reason="the backend was closed")

    def _check_writable(self, operation: str) -> None:
        self._check_open()
        if self._config.read_only:
            raise StateError(
                subject=f"file backend at {self._root}: {operation}",
                reason="the backend was opened read-only (read_only=True)",
            )

    # ------------------------------------------------------------------ fsck

    def scan(self, *, payloads: bool = True, model: str | None = None) -> Iterator[ObjectReport]:
        """Report every object, temporary file and foreign file under ``root``.

        Changes nothing. Objects are checked like a read checks them (header, size and,
        with ``payloads``, the payload checksum); the temporary files of writers that no
        longer run are ``orphaned_temp``; what this backend never writes (other files,
        files outside their fan directory or with names no key has) is ``foreign``.
        """
        self._check_open()
        for entry in sorted_entries(self._root):
            if entry.name == MARKER and entry.is_file(follow_symlinks=False):
                continue
            if entry.name == "objects" and entry.is_dir(follow_symlinks=False):
                yield from self._scan_objects(payloads=payloads, model=model)
            elif entry.name == "tmp" and entry.is_dir(follow_symlinks=False):
                yield from scan_temp_dir(self._tmp_dir)
            elif entry.name == "quarantine" and entry.is_dir(follow_symlinks=False):
                yield from quarantined(
                    self._quarantine_dir,
                    "moved aside after a failed check",
                    allowed=self._file_bits,
                )
            elif entry.name.startswith(TEMP_PREFIX):
                yield temp_report(entry)  # a marker being written
            else:
                yield foreign(entry, "not part of a file store")

    def _scan_objects(self, *, payloads: bool, model: str | None) -> Iterator[ObjectReport]:
        for found in namespace_dirs(self._objects_dir):
            if isinstance(found, ObjectReport):
                yield found
            else:
                yield from self._scan_namespace(*found, payloads=payloads, model=model)

    def _scan_namespace(
        self, namespace: Namespace, directory: Path, *, payloads: bool, model: str | None
    ) -> Iterator[ObjectReport]:
        for fan in sorted_entries(directory):
            if not fan.is_dir(follow_symlinks=False) or not _FAN_NAME.fullmatch(fan.name):
                yield foreign(fan, "not a fan directory (two hex digits)")
                continue
            for entry in sorted_entries(Path(fan.path)):
                key = _key_of(namespace, entry.name)
                if not entry.is_file(follow_symlinks=False):
                    yield foreign(entry, "not a regular file")
                elif key is None:
                    yield foreign(entry, "its name is no object name")
                elif fan.name != _fan(key.name):
                    yield foreign(entry, f"not in its fan directory ({_fan(key.name)})")
                else:
                    report = _inspect_file(
                        entry.path, key, payloads=payloads, model=model, allowed=self._file_bits
                    )
                    if report is not None:
                        yield report

    def repair(self, reports: Sequence[ObjectReport]) -> list[RepairResult]:
        """Quarantine corrupt and other-version objects, remove orphans and other models.

        Exposed files (objects, quarantined ones) are narrowed to the store's file mode.
        Each problem is acted on only if it is still the file the scan saw (same inode);
        foreign files and healthy objects are kept.

        Raises:
            StateError: the backend was opened read-only.
        """
        self._check_writable("repair")
        return [self._repair(report) for report in reports]

    def _repair(self, report: ObjectReport) -> RepairResult:
        state, path = report.state, report.location
        if not report.problem:
            return RepairResult(report=report, action=RepairAction.KEPT, reason="not a problem")
        if state is ObjectState.ORPHANED_TEMP:
            return remove_orphan(report, self._tmp_dir, self._root)
        if state is ObjectState.QUARANTINED:
            if Path(path).parent != self._quarantine_dir:
                return RepairResult(
                    report=report, action=RepairAction.KEPT, reason="not in this store's quarantine"
                )
            return restrict(report, path, self._file_bits, inode=report.identity)
        key = report.key
        if key is None or path != self._path(key):
            return RepairResult(
                report=report,
                action=RepairAction.KEPT,
                reason=f"not an object location of this store ({self._objects_dir})",
            )
        try:
            dir_fd = self._fan_dir(key)
            if dir_fd is None:
                raise FileNotFoundError(errno.ENOENT, "no fan directory", path)
            try:
                inode = os.stat(key.name, dir_fd=dir_fd, follow_symlinks=False).st_ino
            finally:
                os.close(dir_fd)
        except FileNotFoundError:
            self._index.remove(self._slot(key))
            return RepairResult(report=report, action=RepairAction.GONE, reason="no longer there")
        except OSError as error:
            return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
        if inode != report.identity:
            return RepairResult(
                report=report, action=RepairAction.GONE, reason="replaced since the scan"
            )
        if not state.problem:
            return restrict(report, path, self._file_bits, inode=inode)
        if state is ObjectState.WRONG_MODEL:
            self._index.remove(self._slot(key))
            try:
                if not self._unlink(key):
                    return RepairResult(report=report, action=RepairAction.GONE)
            except OSError as error:
                return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
            self._stats.record_deleted(1)
            return RepairResult(report=report, action=RepairAction.REMOVED)
        if self._quarantine(inode, key):
            return RepairResult(report=report, action=RepairAction.QUARANTINED)
        if not os.path.exists(path):
            return RepairResult(report=report, action=RepairAction.GONE)
        return RepairResult(
            report=report, action=RepairAction.FAILED, reason="could not move it to quarantine"
        )


_FAN_NAME: Final = re.compile(r"[0-9a-f]{2}")
_QUARANTINED_NAME: Final = re.compile(r"[0-9]+\.[0-9]+\.[^/]+")
"""How :meth:`FileBackend._quarantine` names what it moves aside."""
_WHOLE: Final = (ObjectState.OK, ObjectState.WRONG_MODEL)
_STORE_DIRS: Final = ("objects", "tmp", "quarantine")
_Slot = bytes | ObjectKey
"""What the index holds for an object: a :class:`KeySlots` slot, or the key (with a policy)."""
_FanScan = tuple[list[tuple[_Slot, int, float]], list[tuple[ObjectKey, os.stat_result]]]


def _same_key(key: ObjectKey) -> ObjectKey:
    return key


_CHUNK: Final = 1 << 20


def _inspect_file(
    path: str, key: ObjectKey, *, payloads: bool, model: str | None, allowed: int
) -> ObjectReport | None:
    """Classify the object file at ``path``, which should hold ``key`` (None: gone).

    It is ``exposed`` when its mode lets group or others do more than ``allowed``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        return ObjectReport(
            state=ObjectState.CORRUPT, location=path, nbytes=0, key=key, reason=str(error)
        )
    size = inode = mode = 0
    try:
        status = os.fstat(fd)
        size, inode, mode = status.st_size, status.st_ino, status.st_mode
        raw = os.pread(fd, HEADER_SIZE, 0)
        check = inspect_header(raw, where=path, expected=key, model=model)
        digest: int | None = None
        hole = _first_hole(fd, status)
        if hole is not None and check.header is not None and check.state in _WHOLE:
            # A put writes every byte: a hole was never written, and reading it would
            # hash zeros for as long as the file claims to be.
            check = HeaderCheck(
                state=ObjectState.CORRUPT,
                header=check.header,
                reason=f"has a hole at byte {hole}: {status.st_blocks * 512} of {size} "
                "bytes are allocated (never written by a put)",
            )
        elif payloads and check.header is not None and size == check.header.object_size:
            digest = _hash_payload(fd, check.header.payload_length)
        check = inspect_object(check, stored_bytes=size, payload_checksum=digest)
    except OSError as error:
        check = HeaderCheck(state=ObjectState.CORRUPT, header=None, reason=f"unreadable: {error}")
    finally:
        os.close(fd)
    open_to_others = stat.S_ISREG(mode) and exposed(mode, allowed)
    reasons = [check.reason, exposure(mode, allowed) if open_to_others else ""]
    return ObjectReport(
        state=check.state,
        location=path,
        nbytes=size,
        key=key,
        reason="; ".join(r for r in reasons if r),
        identity=inode,
        exposed=open_to_others,
    )


def _allocated(status: os.stat_result) -> int:
    """The bytes a file takes on the medium, at most its length (a sparse file: its data)."""
    return min(status.st_size, status.st_blocks * 512) if stat.S_ISREG(status.st_mode) else 0


def _allocated_under(directory: Path) -> int:
    """:func:`_allocated` summed over the entries of ``directory`` (0 when it is missing)."""
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    total += _allocated(entry.stat(follow_symlinks=False))
    except OSError:
        return 0
    return total


def _first_hole(fd: int, status: os.stat_result) -> int | None:
    """Where the first hole of a file with fewer allocated bytes than its size is."""
    if status.st_blocks * 512 >= status.st_size:
        return None
    try:
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
    except OSError:
        return None
    return hole if hole < status.st_size else None


def _hash_payload(fd: int, length: int) -> int:
    hasher = PayloadHasher()
    offset = HEADER_SIZE
    end = HEADER_SIZE + length
    while offset < end:
        piece = os.pread(fd, min(_CHUNK, end - offset), offset)
        if not piece:
            break
        hasher.update(piece)
        offset += len(piece)
    return hasher.value


def _fan(name: str) -> str:
    """The shard directory of an object name: 256 of them per namespace."""
    return f"{xxhash.xxh32_intdigest(name.encode()) & 0xFF:02x}"


_FAN_NUMBERS: Final = {f"{n:02x}": n for n in range(256)}
"""Each fan directory's name and the low byte of the names' hashes it holds."""


_TRAILER: Final = memoryview(bytearray(1))
_MAX_RW: Final = 0x7FFFF000


class _Read:
    """One object's read in flight: filled by an I/O thread, judged by the caller."""

    __slots__ = (
        "digest",
        "error",
        "got",
        "header",
        "inode",
        "link",
        "not_regular",
        "path",
        "request",
        "views",
    )

    def __init__(self, path: str, request: GetRequest) -> None:
        self.path = path
        self.request = request
        self.header = bytearray(HEADER_SIZE)
        # One byte more than the object should have: reading it means trailing bytes.
        # Its content is never looked at, so every read shares one.
        self.views = [memoryview(self.header), *request.buffers, _TRAILER]
        self.got = -1
        """Bytes read; -1 when there was no file."""
        self.digest: int | None = None
        """The payload checksum, when exactly header + payload was read."""
        self.inode = 0
        self.error: OSError | None = None
        self.not_regular = False
        """The path holds something other than a regular file (a FIFO, a device)."""
        self.link = False
        """A symbolic link is on the path: nothing was read through it."""

    def take(self, code: int, row: _Row) -> None:
        """What the C reader found (any outcome but verified); reads it here if it could not."""
        got, inode, error, header, digest = row
        if code == _READ:
            self.inode, self.got, self.digest = inode, got, digest
            self.header[: len(header)] = header
        elif code == _LINK:
            self.link = True
        elif code == _NOT_REGULAR:
            self.inode, self.got, self.not_regular = inode, 0, True
        elif code == _FAILED:
            self.error = OSError(error, f"{os.strerror(error)}: {self.path!r}")
        elif code == _NO_OPENAT2:  # refused here: the open component by component
            _read_raw(self)


_Row = tuple[int, int, int, bytes, int | None]
"""What the C reader says of an object that did not verify: got, inode, errno, header, digest."""
_Layout = Callable[[Namespace, ObjectSpec], tuple[bytes, bytes, bytes]]
"""A namespace's directory, and the expected header's bytes before and after the name."""
_ReadRequests = Callable[[list[GetRequest], _Layout], tuple[bytes, dict[int, _Row]]]
_WriteItem = tuple[bytes, bytes, bytes, tuple[memoryview, ...], bytes]
"""What the C writer takes per object: its directory, name, temporary path, the
payload's buffers and the expected header (checksums zero)."""
_WriteObjects = Callable[[list[_WriteItem], tuple[int, bool, int, bool], bool], bytes]
"""The C writer: items, (file mode, exact, directory mode, exact), whether to fsync."""


class _ExpectedHeaders:
    """The header each key's object must have (checksums zero), for one batch.

    The template is looked up once per run of requests of one namespace and spec
    (usually the whole batch).
    """

    __slots__ = ("_namespace", "_spec", "_template")

    def __init__(self) -> None:
        self._namespace: Namespace | None = None
        self._spec: ObjectSpec | None = None
        self._template: HeaderTemplate | None = None

    def __call__(self, key: ObjectKey, spec: ObjectSpec) -> bytes:
        template = self._template
        if template is None or key.namespace is not self._namespace or spec is not self._spec:
            self._namespace, self._spec = key.namespace, spec
            template = self._template = header_template(key.namespace, spec)
        return template.expected(key.name)


def _native_module() -> ModuleType | None:
    # The system calls in C (_fileio.c), where the package was installed with them built.
    try:
        return importlib.import_module("sglang_storage.storage._fileio")
    except ImportError:
        return None


def _scan_files(path: str) -> tuple[list[str], list[int], list[int]]:
    """The regular files of directory ``path`` (no link), their sizes and 512-byte blocks."""
    names: list[str] = []
    sizes: list[int] = []
    blocks: list[int] = []
    with os.scandir(path) as listing:
        for entry in listing:
            if not entry.is_file(follow_symlinks=False):
                continue
            try:
                status = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            names.append(entry.name)
            sizes.append(status.st_size)
            blocks.append(status.st_blocks)
    return names, sizes, blocks


_FILEIO: Final = _native_module()
_READ_REQUESTS: Final = cast("_ReadRequests | None", getattr(_FILEIO, "read_requests", None))
_SCAN_FILES: Final = cast(
    "Callable[[bytes], tuple[list[str], list[int], list[int]]] | None",
    getattr(_FILEIO, "scan_files", None),
)

_WRITE_OBJECTS: Final = cast("_WriteObjects | None", getattr(_FILEIO, "write_objects", None))

NATIVE_IO: Final = all(
    native is not None for native in (_READ_REQUESTS, _WRITE_OBJECTS, _SCAN_FILES)
)
"""Whether reads (with their verification), writes and index scans run in C here (else
from Python, call by call)."""
# _fileio's outcome codes.
_READ, _MISSING, _LINK, _NOT_REGULAR, _FAILED, _NO_OPENAT2, _VERIFIED = range(7)
_STORED: Final = 0


def _read_part(reads: Sequence[_Read]) -> None:
    for read in reads:
        _read_raw(read)


def _read_raw(read: _Read) -> None:
    """Open, read and close ``read.path`` and hash the payload; the GIL is mostly free.

    The open never blocks (a FIFO planted at an object path must not hang a reader) and
    follows no link (nothing outside the store is read); a path that is not a regular
    file is read as nothing, so it fails verification.
    """
    try:
        fd = open_beneath(None, read.path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError as error:
        if error.errno in LINK_ERRNOS:
            read.link = True
        else:
            read.error = error
        return
    try:
        status = os.fstat(fd)
        read.inode = status.st_ino
        if not stat.S_ISREG(status.st_mode):
            read.got = 0
            read.not_regular = True
            return
        read.got = _readv_full(fd, read.views, 0)
        if read.got == HEADER_SIZE + read.request.nbytes:
            read.digest = checksum(read.request.buffers)
    except OSError as error:
        read.error = error
    finally:
        os.close(fd)


def _readv_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Read into ``views`` from ``offset`` until they are full or the file ends.

    A regular file returns less than asked only at its end, so a short read stops.
    """
    total = 0
    pending = views
    if len(views) <= IOV_MAX:
        # One call: full, or short at the file's end; only a read of more than Linux's
        # cap per call (MAX_RW_COUNT, just under 2 GiB) goes on.
        total = os.preadv(fd, views, offset)
        if total < _MAX_RW:
            return total
        pending = advance(views, total)
    while pending:
        batch = pending[:IOV_MAX] if len(pending) > IOV_MAX else pending
        got = os.preadv(fd, batch, offset + total)
        total += got
        if got < sum(v.nbytes for v in batch) or got == 0:
            break
        pending = advance(pending, got)
    return total


def _writev_full(fd: int, views: list[memoryview]) -> None:
    pending = [v for v in views if v.nbytes]
    while pending:
        written = os.writev(fd, pending[:IOV_MAX])
        pending = advance(pending, written)


def _key_of(namespace: Namespace, name: str) -> ObjectKey | None:
    try:
        return ObjectKey(namespace=namespace, name=name)
    except ConfigError:
        return None


def _keys_of(namespace: Namespace, names: list[str]) -> Sequence[ObjectKey | None]:
    """:func:`_key_of` of each name, checked in one match when every name is valid."""
    try:
        return namespace.keys(names) if names else []
    except ConfigError:
        return [_key_of(namespace, name) for name in names]
