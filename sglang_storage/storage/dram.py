"""The ``memory`` backend: objects in this process's DRAM.

For single-process use and tests. Objects are kept in the same self-checking format as on
disk and verified on every read, so it behaves exactly like the other backends, including
corruption detection.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

import attrs

from sglang_storage.config import BYTES, optional, positive_int
from sglang_storage.core import (
    EvictionPolicy,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import BackendUnavailableError, CorruptObjectError, StorageError
from sglang_storage.storage.backend import (
    BackendStats,
    Capabilities,
    StatsRecorder,
    count_prefix,
    scrub,
)
from sglang_storage.storage.capacity import CapacityIndex
from sglang_storage.storage.format import (
    HEADER_SIZE,
    check_object,
    checksum,
    decode_header,
    encode_header,
)
from sglang_storage.storage.fsck import (
    ObjectReport,
    RepairAction,
    RepairResult,
    inspect_header,
    inspect_object,
)

__all__ = ["MemoryBackend", "MemoryBackendConfig"]


@attrs.frozen(kw_only=True)
class MemoryBackendConfig:
    """Options of the ``memory`` backend."""

    capacity_bytes: int | None = attrs.field(
        default=None, validator=optional(positive_int), metadata=BYTES
    )
    """The most bytes held (headers included); ``None`` for no cap. A cap needs an
    eviction policy."""


class MemoryBackend:
    """An in-process store of self-checking objects.

    Args:
        config: Its options.
        eviction: Chooses victims when ``config.capacity_bytes`` is reached.
    """

    name = "memory"

    def __init__(
        self,
        config: MemoryBackendConfig | None = None,
        *,
        eviction: EvictionPolicy[ObjectKey] | None = None,
    ) -> None:
        self._config = config or MemoryBackendConfig()
        self._index: CapacityIndex[ObjectKey] = CapacityIndex(
            self._config.capacity_bytes, eviction, owner="memory backend"
        )
        self._objects: dict[ObjectKey, bytearray] = {}
        # Which put stored each object: how repair tells it from a later one of the same key
        # (``id()`` is no such thing: a new object may get a freed one's address).
        self._born: dict[ObjectKey, int] = {}
        self._puts = itertools.count()
        self._lock = threading.Lock()
        self._stats = StatsRecorder()
        self._closed = False

    @property
    def capabilities(self) -> Capabilities:
        """Zero copy; private to this process; gone when the process ends; scannable."""
        return Capabilities(
            zero_copy=True,
            shared_across_processes=False,
            shared_across_hosts=False,
            durable=False,
            bounded=self._index.bounded,
            scannable=True,
        )

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored."""
        self._check_open()
        with self._lock:
            return [key in self._objects for key in keys]

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys are stored."""
        self._check_open()
        with self._lock:
            return count_prefix(key in self._objects for key in keys)

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Verify and copy each requested object into its buffers."""
        self._check_open()
        results = [self._get(request) for request in requests]
        self._stats.record_gets(results)
        return results

    def _get(self, request: GetRequest) -> GetResult:
        with self._lock:
            stored = self._objects.get(request.key)
        if stored is None:
            return GetResult.miss_of(request.key)
        try:
            view = memoryview(stored)
            header = decode_header(view[:HEADER_SIZE], where=str(request.key))
            reason = check_object(header, request.key, request.spec)
            payload = view[HEADER_SIZE:]
            if reason is None and payload.nbytes != header.payload_length:
                reason = (
                    f"holds {payload.nbytes} payload bytes, header says {header.payload_length}"
                )
            if reason is None and checksum([payload]) != header.payload_checksum:
                reason = "payload checksum mismatch"
            if reason is not None:
                raise CorruptObjectError(key=str(request.key), reason=reason)
        except CorruptObjectError as error:
            scrub(request.buffers)
            self._drop(request.key, stored)
            return GetResult.corrupt_of(request.key, error)
        offset = 0
        for buffer in request.buffers:
            buffer[:] = payload[offset : offset + buffer.nbytes]
            offset += buffer.nbytes
        self._index.access(request.key)
        return GetResult.hit_of(request)

    def _drop(self, key: ObjectKey, stored: bytearray) -> None:
        with self._lock:
            if self._objects.get(key) is stored:
                del self._objects[key]
                self._born.pop(key, None)
                self._index.remove(key)

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Store a verified copy of each request's buffers; existing keys are kept."""
        self._check_open()
        results = [self._put(request) for request in requests]
        self._stats.record_puts(results)
        return results

    def _put(self, request: PutRequest) -> PutResult:
        size = HEADER_SIZE + request.nbytes
        with self._lock:
            held = self._objects.get(request.key)
            if held is not None and len(held) != size:
                # Torn, or of another shape: never acknowledged as stored; replaced.
                del self._objects[request.key]
                self._born.pop(request.key, None)
                self._index.remove(request.key)
                held = None
        if held is not None:
            self._index.access(request.key)
            return PutResult.present_of(request.key)
        try:
            victims = self._index.reserve(size)
        except StorageError as error:
            return PutResult.error_of(request.key, error)
        try:
            # One allocation of the final size, filled by copying (no zero fill first).
            header = encode_header(request.key, request.spec, checksum(request.buffers))
            stored = bytearray().join((header, *request.buffers))
        except BaseException:
            self._index.release(size)
            raise
        with self._lock:
            for victim in victims:
                self._objects.pop(victim, None)
                self._born.pop(victim, None)
            self._objects[request.key] = stored
            self._born[request.key] = next(self._puts)
        self._index.commit(request.key, size)
        self._stats.record_evicted(len(victims))
        return PutResult.stored_of(request)

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """Remove the stored ones of ``keys``."""
        self._check_open()
        removed = 0
        with self._lock:
            for key in keys:
                if self._objects.pop(key, None) is not None:
                    self._born.pop(key, None)
                    removed += 1
        for key in keys:
            self._index.remove(key)
        self._stats.record_deleted(removed)

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace``."""
        self._check_open()
        with self._lock:
            doomed = [key for key in self._objects if key.namespace == namespace]
            for key in doomed:
                del self._objects[key]
                self._born.pop(key, None)
        for key in doomed:
            self._index.remove(key)

    def rewrite_raw(self, key: ObjectKey, edit: Callable[[bytes], bytes]) -> bool:
        """Replace ``key``'s stored bytes (header and payload) with ``edit(stored bytes)``.

        Unverified, as a damaged medium would: for fault injection (``storage.faults``). The
        next read verifies the result as usual. Returns whether ``key`` was stored.
        """
        self._check_open()
        with self._lock:
            stored = self._objects.get(key)
            if stored is None:
                return False
            self._objects[key] = bytearray(edit(bytes(stored)))
        return True

    def stats(self) -> BackendStats:
        """Contents and counters."""
        self._check_open()
        objects, nbytes = self._index.totals()
        return self._stats.snapshot(
            objects=objects, nbytes=nbytes, capacity_bytes=self._index.capacity_bytes
        )

    def scan(self, *, payloads: bool = True, model: str | None = None) -> Iterator[ObjectReport]:
        """Report every object held (checked like a read checks it); changes nothing."""
        self._check_open()
        with self._lock:
            held = [(key, stored, self._born.get(key, -1)) for key, stored in self._objects.items()]
        for key, stored, born in held:
            view = memoryview(stored)
            check = inspect_header(view[:HEADER_SIZE], where=str(key), expected=key, model=model)
            digest: int | None = None
            if payloads and check.header is not None and len(stored) == check.header.object_size:
                digest = checksum([view[HEADER_SIZE:]])
            check = inspect_object(check, stored_bytes=len(stored), payload_checksum=digest)
            yield ObjectReport(
                state=check.state,
                location=str(key),
                nbytes=len(stored),
                key=key,
                reason=check.reason,
                identity=born,
            )

    def repair(self, reports: Sequence[ObjectReport]) -> list[RepairResult]:
        """Drop the reported damaged, other-version and other-model objects."""
        self._check_open()
        results: list[RepairResult] = []
        for report in reports:
            key = report.key
            if not report.state.problem or key is None:
                results.append(RepairResult(report=report, action=RepairAction.KEPT))
                continue
            with self._lock:
                current = key in self._objects and self._born.get(key) == report.identity
                if current:
                    del self._objects[key]
                    del self._born[key]
            if not current:
                results.append(
                    RepairResult(report=report, action=RepairAction.GONE, reason="not there now")
                )
                continue
            self._index.remove(key)
            self._stats.record_deleted(1)
            results.append(RepairResult(report=report, action=RepairAction.REMOVED))
        return results

    def close(self) -> None:
        """Drop every object; later calls raise ``BackendUnavailableError``."""
        with self._lock:
            self._closed = True
            self._objects.clear()
            self._born.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailableError(backend=self.name, reason="the backend was closed")
