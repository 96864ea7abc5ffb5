"""The ``file`` backend: one self-checking file per object under a local directory.

The embedded default. Layout under ``root``::

    sglang-storage.json                      marker: format version
    objects/<model>/<kind>/<shard>/<xx>/<name>  one object (header + payload); xx: 256 shards
    tmp/<pid>.<random>.tmp                   writes in progress
    quarantine/                              objects that failed verification

Writes go to a temporary file, optionally fsync'ed, then are renamed into place, so a
reader (in any process) sees either no object or a whole one, and concurrent writers of
one key leave one whole object. A read is one ``preadv`` of header and payload straight
into the caller's buffers, then verification; a failed check zeroes the buffers,
quarantines the file and reports the key corrupt. Batches are spread over a few I/O
threads (the system calls and the checksum release the GIL).

Several processes (TP ranks) may share one root. Each keeps its own index of what is
stored (rebuilt by a directory scan when it opens), learns of other processes' objects
when it meets them, and enforces ``capacity_bytes`` over what it knows.

Opening removes the temporary files of writers that no longer run (a ``kill -9``
mid-write leaves one). Opened ``read_only``, the backend changes nothing under ``root``:
no directories, marker or cleanup at open, no quarantine on a failed read, and writes,
deletes and clears are refused - how ``sglang-storage fsck`` inspects a store. It is
:class:`~sglang_storage.storage.backend.Scannable`: ``scan()`` reports every object (its
header, size and payload checksum), orphaned temporary file and foreign file, and
``repair()`` quarantines damaged objects and removes orphans.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import attrs
import xxhash

from sglang_storage.config import BYTES, instance_of, int_in_range, optional, positive_int
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
    foreign,
    inspect_header,
    inspect_object,
    namespace_dirs,
    quarantined,
    remove_orphan,
    scan_temp_dir,
    sorted_entries,
)
from sglang_storage.storage.posix import (
    IOV_MAX,
    IOThreads,
    advance,
    io_error,
    namespace_of,
    process_alive,
    subdirs,
    write_error,
)

__all__ = ["Durability", "FileBackend", "FileBackendConfig"]

log = logging.getLogger(__name__)

MARKER: Final = "sglang-storage.json"


class Durability(enum.Enum):
    """How hard a write works to survive a crash before it is acknowledged."""

    NONE = "none"
    """No fsync. A crash of the host can lose recent objects (never corrupt a read:
    damaged objects fail verification). SGLang's own file backend behaves like this."""
    DATA = "data"
    """fsync the object's file before renaming it into place."""
    FULL = "full"
    """fsync the file, rename, then fsync its directory: an acknowledged object survives
    power loss."""


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


class FileBackend:
    """Self-checking objects as files under one directory, shareable by local processes.

    Args:
        config: Its options.
        eviction: Chooses victims when ``config.capacity_bytes`` is reached.

    Raises:
        BackendUnavailableError: ``root`` cannot be created or used, or holds a store of
            another format version; read-only: ``root`` is not a directory.
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
        self._objects_dir = self._root / "objects"
        self._objects_prefix = f"{self._objects_dir}/"
        self._tmp_dir = self._root / "tmp"
        # Temp names: the writer's pid (orphan cleanup reads it), a token, a counter.
        self._tmp_token = uuid.uuid4().hex[:12]
        self._tmp_counter = itertools.count()
        self._quarantine_dir = self._root / "quarantine"
        self._index: CapacityIndex[ObjectKey] = CapacityIndex(
            config.capacity_bytes, eviction, owner=f"file backend at {self._root}"
        )
        self._stats = StatsRecorder()
        self._quarantined = 0
        self._lock = threading.Lock()
        self._threads = IOThreads(config.io_threads, self.name)
        self._closed = False
        self._prepare()
        self._rebuild_index()

    # ------------------------------------------------------------------ opening

    def _prepare(self) -> None:
        if self._config.read_only:
            self._check_store()
            return
        try:
            for directory in (self._objects_dir, self._tmp_dir, self._quarantine_dir):
                directory.mkdir(parents=True, exist_ok=True)
            marker = self._root / MARKER
            if marker.exists():
                content = json.loads(marker.read_text())
                version = content.get("format_version") if isinstance(content, dict) else None
                if version != FORMAT_VERSION:
                    raise BackendUnavailableError(
                        backend=self.name,
                        reason=f"{self._root} holds a store of format version {version}; "
                        f"this build writes version {FORMAT_VERSION} (use another root)",
                    )
            else:
                tmp = self._tmp_dir / f"{os.getpid()}.{uuid.uuid4().hex}.marker"
                tmp.write_text(json.dumps({"format_version": FORMAT_VERSION}) + "\n")
                os.replace(tmp, marker)
            self._remove_orphans()
        except (OSError, ValueError) as error:
            raise BackendUnavailableError(
                backend=self.name, reason=f"cannot use {self._root}: {error}"
            ) from error

    def _check_store(self) -> None:
        """Read-only open: the root must exist and hold no store of another version."""
        marker = self._root / MARKER
        try:
            if not self._root.is_dir():
                raise BackendUnavailableError(
                    backend=self.name,
                    reason=f"{self._root} is not a directory (a read-only open creates nothing)",
                )
            if marker.exists():
                content = json.loads(marker.read_text())
                version = content.get("format_version") if isinstance(content, dict) else None
                if version != FORMAT_VERSION:
                    raise BackendUnavailableError(
                        backend=self.name,
                        reason=f"{self._root} holds a store of format version {version}; "
                        f"this build reads version {FORMAT_VERSION}",
                    )
        except (OSError, ValueError) as error:
            raise BackendUnavailableError(
                backend=self.name, reason=f"cannot use {self._root}: {error}"
            ) from error

    def _remove_orphans(self) -> None:
        """Delete temporary files left by processes that no longer run."""
        for entry in os.scandir(self._tmp_dir):
            pid_text = entry.name.split(".", 1)[0]
            if pid_text.isdigit() and not process_alive(int(pid_text)):
                if entry.is_dir(follow_symlinks=False):
                    # A namespace a dead process was clearing.
                    shutil.rmtree(entry.path, ignore_errors=True)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def _rebuild_index(self) -> None:
        """Index every object under ``objects/``, oldest first (the eviction order)."""
        found: list[tuple[float, ObjectKey, int]] = []
        for key, entry in self._scan():
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            found.append((stat.st_mtime, key, stat.st_size))
        found.sort(key=lambda item: item[0])
        for _, key, size in found:
            self._index.add(key, size)
        if not self._config.read_only:
            self._delete_files(self._index.over_capacity())

    def _scan(self) -> Iterator[tuple[ObjectKey, os.DirEntry[str]]]:
        for model in subdirs(self._objects_dir):
            for kind in subdirs(Path(model.path)):
                for shard in subdirs(Path(kind.path)):
                    namespace = namespace_of(model.name, kind.name, shard.name)
                    if namespace is None or namespace.shard.label != shard.name:
                        continue  # "tp0of1" parses, but path_of never looks there
                    for fan in subdirs(Path(shard.path)):
                        for entry in os.scandir(fan.path):
                            key = _key_of(namespace, entry.name)
                            # A file outside its own fan directory is not where path_of
                            # looks: it is no object of this store (fsck reports it).
                            if (
                                key is not None
                                and fan.name == _fan(key.name)
                                and entry.is_file(follow_symlinks=False)
                            ):
                                yield key, entry

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

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored (by this or another process)."""
        self._check_open()
        return [self._exists(key) for key in keys]

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys are stored."""
        self._check_open()
        return count_prefix(self._exists(key) for key in keys)

    def _exists(self, key: ObjectKey) -> bool:
        return os.path.exists(self._path(key))

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Read and verify each requested object straight into its buffers."""
        self._check_open()
        # Two phases: the I/O threads only open, read, hash and close (almost all of it
        # without the GIL, so they overlap); this thread then checks every header and
        # builds the results.
        reads = [_Read(self._path(r.key), r) for r in requests]
        self._threads.spread(_read_raw, reads)
        results = [self._finish(read) for read in reads]
        self._stats.record_gets(results)
        return results

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Write each request's buffers as a whole file; existing keys are kept."""
        self._check_writable("put_from")
        results = self._threads.spread(self._put, requests)
        self._stats.record_puts(results)
        return results

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """Remove the stored ones of ``keys``."""
        self._check_writable("delete")
        removed = 0
        for key in keys:
            self._index.remove(key)
            try:
                os.unlink(self._path(key))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as error:
                raise io_error(self.name, f"delete of {key}", error) from error
        self._stats.record_deleted(removed)

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace`` (other namespaces are untouched)."""
        self._check_writable("clear")
        directory = self._objects_dir / namespace.path
        doomed = self._tmp_dir / f"{os.getpid()}.{uuid.uuid4().hex}.clear"
        try:
            # Renaming first makes the namespace vanish at once for every process.
            os.rename(directory, doomed)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise io_error(self.name, f"clear of {namespace.path}", error) from error
        else:
            shutil.rmtree(doomed, ignore_errors=True)
        for key in self._index.keys():  # noqa: SIM118 - a snapshot, not a dict
            if key.namespace == namespace:
                self._index.remove(key)

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
        if read.got < 0:
            self._index.remove(key)
            return GetResult.miss_of(key)
        reason = "is not a regular file" if read.not_regular else self._verify(read)
        if reason is not None:
            scrub(request.buffers)
            self._quarantine(read.inode, key, read.path)
            corrupt = CorruptObjectError(key=str(key), reason=reason)
            log.warning("file backend: %s; quarantined", corrupt)
            return GetResult.corrupt_of(key, corrupt)
        self._index.touch(key, HEADER_SIZE + request.nbytes)
        return GetResult.hit_of(request)

    def _verify(self, read: _Read) -> str | None:
        """Why the bytes read must not be delivered, or None."""
        request, header, got = read.request, read.header, read.got
        template = header_template(request.key.namespace, request.spec)
        recorded = template.expected_checksum(header[: min(got, HEADER_SIZE)], request.key.name)
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

    def _quarantine(self, inode: int, key: ObjectKey, path: str) -> bool:
        """Move the corrupt file aside, unless another process has replaced it meanwhile.

        Returns whether it was moved (read-only: never).
        """
        self._index.remove(key)
        if self._config.read_only:
            return False
        try:
            if os.stat(path).st_ino != inode:
                return False
            target = self._quarantine_dir / f"{time.time_ns()}.{os.getpid()}.{key.name}"
            os.rename(path, target)
        except OSError:
            return False
        with self._lock:
            self._quarantined += 1
        return True

    # ------------------------------------------------------------------ writes

    def _put(self, request: PutRequest) -> PutResult:
        key = request.key
        path = self._path(key)
        size = HEADER_SIZE + request.nbytes
        try:
            held: int | None = os.stat(path).st_size
        except FileNotFoundError:
            held = None
        except OSError as error:
            return PutResult.error_of(key, io_error(self.name, f"put of {key}", error))
        if held == size:
            self._index.touch(key, size=None)
            return PutResult.present_of(key)
        if held is not None:
            # Torn, or of another shape: never acknowledged as stored; replaced.
            self._index.remove(key)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        try:
            victims = self._index.reserve(size)
        except StorageError as error:
            return PutResult.error_of(key, error)
        if victims:
            self._delete_files(victims)
        try:
            self._write(request, path)
        except OSError as error:
            self._index.release(size)
            return PutResult.error_of(key, write_error(self.name, self._root, key, size, error))
        self._index.commit(key, size)
        return PutResult.stored_of(request)

    def _write(self, request: PutRequest, path: str) -> None:
        durability = self._config.durability
        header = encode_header(request.key, request.spec, checksum(request.buffers))
        tmp = f"{self._tmp_dir}/{os.getpid()}.{self._tmp_token}.{next(self._tmp_counter)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                _writev_full(fd, [memoryview(header), *request.buffers])
                if durability is not Durability.NONE:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, path)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if durability is Durability.FULL:
            _fsync_dir(os.path.dirname(path))

    def _delete_files(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key))
        self._stats.record_evicted(len(keys))

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
                yield from quarantined(self._quarantine_dir, "moved aside after a failed check")
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
                    report = _inspect_file(entry.path, key, payloads=payloads, model=model)
                    if report is not None:
                        yield report

    def repair(self, reports: Sequence[ObjectReport]) -> list[RepairResult]:
        """Quarantine corrupt and other-version objects, remove orphans and other models.

        Each problem is acted on only if it is still the file the scan saw (same inode);
        foreign files and healthy objects are kept.

        Raises:
            StateError: the backend was opened read-only.
        """
        self._check_writable("repair")
        return [self._repair(report) for report in reports]

    def _repair(self, report: ObjectReport) -> RepairResult:
        state, path = report.state, report.location
        if not state.problem:
            return RepairResult(report=report, action=RepairAction.KEPT, reason="not a problem")
        if state is ObjectState.ORPHANED_TEMP:
            return remove_orphan(report, self._tmp_dir)
        key = report.key
        if key is None or path != self._path(key):
            return RepairResult(
                report=report,
                action=RepairAction.KEPT,
                reason=f"not an object location of this store ({self._objects_dir})",
            )
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            self._index.remove(key)
            return RepairResult(report=report, action=RepairAction.GONE, reason="no longer there")
        except OSError as error:
            return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
        if inode != report.identity:
            return RepairResult(
                report=report, action=RepairAction.GONE, reason="replaced since the scan"
            )
        if state is ObjectState.WRONG_MODEL:
            self._index.remove(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                return RepairResult(report=report, action=RepairAction.GONE)
            except OSError as error:
                return RepairResult(report=report, action=RepairAction.FAILED, reason=str(error))
            self._stats.record_deleted(1)
            return RepairResult(report=report, action=RepairAction.REMOVED)
        if self._quarantine(inode, key, path):
            return RepairResult(report=report, action=RepairAction.QUARANTINED)
        if not os.path.exists(path):
            return RepairResult(report=report, action=RepairAction.GONE)
        return RepairResult(
            report=report, action=RepairAction.FAILED, reason="could not move it to quarantine"
        )


_FAN_NAME: Final = re.compile(r"[0-9a-f]{2}")
_CHUNK: Final = 1 << 20


def _inspect_file(
    path: str, key: ObjectKey, *, payloads: bool, model: str | None
) -> ObjectReport | None:
    """Classify the object file at ``path``, which should hold ``key`` (None: gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        return ObjectReport(
            state=ObjectState.CORRUPT, location=path, nbytes=0, key=key, reason=str(error)
        )
    size = inode = 0
    try:
        status = os.fstat(fd)
        size, inode = status.st_size, status.st_ino
        raw = os.pread(fd, HEADER_SIZE, 0)
        check = inspect_header(raw, where=path, expected=key, model=model)
        digest: int | None = None
        if payloads and check.header is not None and size == check.header.object_size:
            digest = _hash_payload(fd, check.header.payload_length)
        check = inspect_object(check, stored_bytes=size, payload_checksum=digest)
    except OSError as error:
        check = HeaderCheck(state=ObjectState.CORRUPT, header=None, reason=f"unreadable: {error}")
    finally:
        os.close(fd)
    return ObjectReport(
        state=check.state, location=path, nbytes=size, key=key, reason=check.reason, identity=inode
    )


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


class _Read:
    """One object's read in flight: filled by an I/O thread, judged by the caller."""

    __slots__ = (
        "digest",
        "error",
        "got",
        "header",
        "inode",
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
        self.views = [memoryview(self.header), *request.buffers, memoryview(bytearray(1))]
        self.got = -1
        """Bytes read; -1 when there was no file."""
        self.digest: int | None = None
        """The payload checksum, when exactly header + payload was read."""
        self.inode = 0
        self.error: OSError | None = None
        self.not_regular = False
        """The path holds something other than a regular file (a FIFO, a device)."""


def _read_raw(read: _Read) -> None:
    """Open, read and close ``read.path`` and hash the payload; the GIL is mostly free.

    The open never blocks (a FIFO planted at an object path must not hang a reader); a
    path that is not a regular file is read as nothing, so it fails verification.
    """
    try:
        fd = os.open(read.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError as error:
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


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _key_of(namespace: Namespace, name: str) -> ObjectKey | None:
    try:
        return ObjectKey(namespace=namespace, name=name)
    except ConfigError:
        return None
