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
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import logging
import os
import shutil
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


class FileBackend:
    """Self-checking objects as files under one directory, shareable by local processes.

    Args:
        config: Its options.
        eviction: Chooses victims when ``config.capacity_bytes`` is reached.

    Raises:
        BackendUnavailableError: ``root`` cannot be created or used, or holds a store of
            another format version.
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
        self._delete_files(self._index.over_capacity())

    def _scan(self) -> Iterator[tuple[ObjectKey, os.DirEntry[str]]]:
        for model in subdirs(self._objects_dir):
            for kind in subdirs(Path(model.path)):
                for shard in subdirs(Path(kind.path)):
                    namespace = namespace_of(model.name, kind.name, shard.name)
                    if namespace is None:
                        continue
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
    def capabilities(self) -> Capabilities:
        """Zero copy, shareable by processes on this host, durable across restarts."""
        return Capabilities(
            zero_copy=True,
            shared_across_processes=True,
            shared_across_hosts=False,
            durable=True,
            bounded=self._index.bounded,
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
        self._check_open()
        results = self._threads.spread(self._put, requests)
        self._stats.record_puts(results)
        return results

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """Remove the stored ones of ``keys``."""
        self._check_open()
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
        self._check_open()
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
        reason = self._verify(read)
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

    def _quarantine(self, inode: int, key: ObjectKey, path: str) -> None:
        """Move the corrupt file aside, unless another process has replaced it meanwhile."""
        self._index.remove(key)
        try:
            if os.stat(path).st_ino != inode:
                return
            target = self._quarantine_dir / f"{time.time_ns()}.{os.getpid()}.{key.name}"
            os.rename(path, target)
        except OSError:
            return
        with self._lock:
            self._quarantined += 1

    # ------------------------------------------------------------------ writes

    def _put(self, request: PutRequest) -> PutResult:
        key = request.key
        path = self._path(key)
        if os.path.exists(path):
            self._index.touch(key, size=None)
            return PutResult.present_of(key)
        size = HEADER_SIZE + request.nbytes
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


def _fan(name: str) -> str:
    """The shard directory of an object name: 256 of them per namespace."""
    return f"{xxhash.xxh32_intdigest(name.encode()) & 0xFF:02x}"


class _Read:
    """One object's read in flight: filled by an I/O thread, judged by the caller."""

    __slots__ = ("digest", "error", "got", "header", "inode", "path", "request", "views")

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


def _read_raw(read: _Read) -> None:
    """Open, read and close ``read.path`` and hash the payload; the GIL is mostly free."""
    try:
        fd = os.open(read.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as error:
        read.error = error
        return
    try:
        read.inode = os.fstat(fd).st_ino
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
