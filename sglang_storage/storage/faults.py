"""A fault-injecting wrapper around any backend, driven by a seeded schedule.

For reliability tests and for operators who want to see how a deployment degrades: the
``faulty`` registry entry wraps another registered backend by name. The promise it checks:
under faults the system returns misses and clear errors, never wrong bytes.

- :class:`FaultKind` - what can be injected:

  - protocol faults, around any backend: a whole call failing (``error``), some keys of a
    batch failing (``partial_batch``), a call delayed (``latency``), a call stalling and
    then timing out (``timeout``), an object deleted between the existence check and the
    read (``vanished``);
  - media faults, beneath the backend's own verification, into the stored object itself:
    a write that reached the medium only in part (``torn_write``: the object keeps a
    prefix of its bytes and the put reports an error) and a flipped bit in a stored object
    just before it is read (``bit_flip``). These need a :class:`Medium` for the wrapped
    backend (:func:`medium_of`: ``file``, ``memory`` and ``hf3fs``); the wrapper declares
    which it can inject (:attr:`FaultInjectingBackend.media_faults`).

- :class:`FaultSchedule` - the seed and the rate of each kind. Every decision is a hash of
  the seed, the operation, the key (or the batch) and how often that key (batch) was seen,
  so a schedule repeats exactly for the same sequence of calls, whatever the thread timing.
- :class:`FaultInjectingBackend` - the wrapper (a :class:`~.backend.Backend`);
  :meth:`~FaultInjectingBackend.fault_stats` counts what it injected, by kind;
  :meth:`~FaultInjectingBackend.damaged_keys` names the objects media faults and
  ``vanished`` destroyed on purpose (no backend can return those, so a durability check
  leaves them out).
- :class:`FaultyBackendConfig` - the ``faulty`` registry options: the schedule plus the
  inner backend's name and options.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import xxhash

from sglang_storage.config import int_in_range, non_empty_str, number_in_range
from sglang_storage.core import (
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    PutOutcome,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import (
    BackendIOError,
    ConfigError,
    OperationTimeoutError,
    StorageError,
)
from sglang_storage.storage.backend import (
    Backend,
    BackendStats,
    Capabilities,
    count_prefix,
    scrub,
)
from sglang_storage.storage.dram import MemoryBackend
from sglang_storage.storage.file import FileBackend
from sglang_storage.storage.format import HEADER_SIZE
from sglang_storage.storage.hf3fs import Hf3fsBackend

__all__ = [
    "MEDIA_FAULTS",
    "FaultInjectingBackend",
    "FaultKind",
    "FaultSchedule",
    "FaultStats",
    "FaultyBackendConfig",
    "Medium",
    "medium_of",
]


class FaultKind(enum.Enum):
    """A kind of injected fault."""

    ERROR = "error"
    """The whole call raises :class:`~sglang_storage.errors.BackendIOError`."""
    PARTIAL_BATCH = "partial_batch"
    """Some keys of a batch fail (an ``ERROR`` result, or reported absent by ``exists``)."""
    LATENCY = "latency"
    """The call is delayed by ``latency_s`` and then proceeds."""
    TIMEOUT = "timeout"
    """The call stalls ``timeout_s`` and raises
    :class:`~sglang_storage.errors.OperationTimeoutError` (for puts after the write
    landed: the acknowledgement was lost)."""
    VANISHED = "vanished"
    """The object is deleted between the existence check and the read (the read misses)."""
    TORN_WRITE = "torn_write"
    """The stored object keeps only a prefix of its bytes; the put reports an error."""
    BIT_FLIP = "bit_flip"
    """One bit of the stored object flips just before it is read."""


MEDIA_FAULTS: Final = frozenset({FaultKind.TORN_WRITE, FaultKind.BIT_FLIP})
"""The kinds injected into the stored object, beneath the backend's verification."""

_RATE = number_in_range(0.0, 1.0)
_SECONDS = number_in_range(0.0, 60.0)


@attrs.frozen(kw_only=True)
class FaultSchedule:
    """When faults happen: a seed and, per kind, the fraction of chances that fault.

    The chances of each kind: ``error``, ``latency`` and ``timeout`` - every ``exists``,
    ``get_into``, ``put_from`` and ``delete`` call; ``partial_batch`` - every ``exists``,
    ``get_into`` and ``put_from`` call with at least one key; ``vanished`` and ``bit_flip`` -
    every key read; ``torn_write`` - every key written.
    """

    seed: int = attrs.field(default=0, validator=int_in_range(0, 2**63 - 1))
    error_rate: float = attrs.field(default=0.0, validator=_RATE)
    partial_batch_rate: float = attrs.field(default=0.0, validator=_RATE)
    latency_rate: float = attrs.field(default=0.0, validator=_RATE)
    latency_s: float = attrs.field(default=0.01, validator=_SECONDS)
    """The delay of a ``latency`` fault."""
    timeout_rate: float = attrs.field(default=0.0, validator=_RATE)
    timeout_s: float = attrs.field(default=0.05, validator=_SECONDS)
    """How long a ``timeout`` fault stalls before it raises."""
    vanish_rate: float = attrs.field(default=0.0, validator=_RATE)
    torn_write_rate: float = attrs.field(default=0.0, validator=_RATE)
    bit_flip_rate: float = attrs.field(default=0.0, validator=_RATE)

    def rate(self, kind: FaultKind) -> float:
        """The rate of ``kind``."""
        return {
            FaultKind.ERROR: self.error_rate,
            FaultKind.PARTIAL_BATCH: self.partial_batch_rate,
            FaultKind.LATENCY: self.latency_rate,
            FaultKind.TIMEOUT: self.timeout_rate,
            FaultKind.VANISHED: self.vanish_rate,
            FaultKind.TORN_WRITE: self.torn_write_rate,
            FaultKind.BIT_FLIP: self.bit_flip_rate,
        }[kind]

    @property
    def kinds(self) -> frozenset[FaultKind]:
        """The kinds this schedule injects (rate above 0)."""
        return frozenset(kind for kind in FaultKind if self.rate(kind) > 0)


def _options(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="must be a mapping of option names to values",
            allowed="the inner backend's options, e.g. {'root': '/tmp/store'}",
        )


def _copy_mapping(value: object) -> object:
    return dict(value) if isinstance(value, Mapping) else value


@attrs.frozen(kw_only=True)
class FaultyBackendConfig(FaultSchedule):
    """Options of the ``faulty`` backend: the inner backend and the :class:`FaultSchedule`.

    Example (JSON): ``{"inner": "file", "inner_options": {"root": "/tmp/s"}, "seed": 1,
    "error_rate": 0.05, "bit_flip_rate": 0.01}``.
    """

    inner: str = attrs.field(validator=non_empty_str)
    """The registered name of the wrapped backend."""
    inner_options: Mapping[str, object] = attrs.field(
        factory=dict, converter=_copy_mapping, validator=_options
    )
    """The wrapped backend's options."""

    @property
    def schedule(self) -> FaultSchedule:
        """The schedule alone."""
        return FaultSchedule(**{f.name: getattr(self, f.name) for f in attrs.fields(FaultSchedule)})


@attrs.frozen(kw_only=True)
class FaultStats:
    """What a :class:`FaultInjectingBackend` has injected since it was built."""

    calls: int
    """Calls of ``exists``, ``get_into``, ``put_from`` and ``delete`` it received."""
    counts: tuple[tuple[FaultKind, int], ...]
    """Injected faults per kind (every kind, in :class:`FaultKind` order)."""

    @property
    def by_kind(self) -> dict[str, int]:
        """The non-zero counts by kind name (``{"bit_flip": 3, ...}``)."""
        return {kind.value: count for kind, count in self.counts if count}

    @property
    def total(self) -> int:
        """Every injected fault."""
        return sum(count for _, count in self.counts)

    def count(self, kind: FaultKind) -> int:
        """Faults of ``kind`` injected."""
        return dict(self.counts)[kind]


class Medium(Protocol):
    """Damage to stored objects where a backend keeps them, beneath its verification.

    ``size`` is the whole object's size (header and payload), which the caller knows from
    the request. Both return whether an object was there to damage.
    """

    def tear(self, key: ObjectKey, keep: int, size: int) -> bool:
        """Keep only the first ``keep`` of the object's ``size`` bytes."""
        ...

    def flip(self, key: ObjectKey, offset: int, mask: int) -> bool:
        """XOR the object's byte at ``offset`` with ``mask`` (1-255)."""
        ...


class FileMedium:
    """The ``file`` backend's objects: one file each (truncated, or patched in place)."""

    def __init__(self, backend: FileBackend) -> None:
        self._backend = backend

    def tear(self, key: ObjectKey, keep: int, size: int) -> bool:
        """Truncate the object's file to ``keep`` bytes."""
        try:
            os.truncate(self._backend.path_of(key), keep)
        except OSError:
            return False
        return True

    def flip(self, key: ObjectKey, offset: int, mask: int) -> bool:
        """Patch one byte of the object's file."""
        return _flip_at(self._backend.path_of(key), offset, mask)


class MemoryMedium:
    """The ``memory`` backend's objects, through :meth:`MemoryBackend.rewrite_raw`."""

    def __init__(self, backend: MemoryBackend) -> None:
        self._backend = backend

    def tear(self, key: ObjectKey, keep: int, size: int) -> bool:
        """Cut the stored bytes to ``keep``."""
        return self._backend.rewrite_raw(key, lambda data: data[:keep])

    def flip(self, key: ObjectKey, offset: int, mask: int) -> bool:
        """XOR one stored byte."""

        def edit(data: bytes) -> bytes:
            if offset >= len(data):
                return data
            return data[:offset] + bytes([data[offset] ^ mask]) + data[offset + 1 :]

        return self._backend.rewrite_raw(key, edit)


class Hf3fsMedium:
    """The ``hf3fs`` backend's objects: slots in data files (a torn slot's tail is zeroed)."""

    def __init__(self, backend: Hf3fsBackend) -> None:
        self._backend = backend

    def tear(self, key: ObjectKey, keep: int, size: int) -> bool:
        """Zero the slot's bytes from ``keep`` to ``size``: what an unfinished write leaves."""
        where = self._backend.locate(key)
        if where is None:
            return False
        try:
            with where.path.open("r+b") as f:
                f.seek(where.offset + keep)
                f.write(bytes(max(0, min(size, where.slot_size) - keep)))
        except OSError:
            return False
        return True

    def flip(self, key: ObjectKey, offset: int, mask: int) -> bool:
        """Patch one byte of the slot."""
        where = self._backend.locate(key)
        if where is None or offset >= where.slot_size:
            return False
        return _flip_at(where.path, where.offset + offset, mask)


def _flip_at(path: Path, offset: int, mask: int) -> bool:
    try:
        with path.open("r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            if len(byte) != 1:
                return False
            f.seek(offset)
            f.write(bytes([byte[0] ^ mask]))
    except OSError:
        return False
    return True


def medium_of(backend: Backend) -> Medium | None:
    """The media-fault hook of a built-in backend, or ``None`` for any other."""
    if isinstance(backend, FileBackend):
        return FileMedium(backend)
    if isinstance(backend, MemoryBackend):
        return MemoryMedium(backend)
    if isinstance(backend, Hf3fsBackend):
        return Hf3fsMedium(backend)
    return None


_SCALE: Final = float(2**64)
_SEEN_MAX: Final = 1 << 20
"""Occurrences remembered; past it they restart at 1 (a schedule repeats exactly only
for runs that meet fewer distinct keys and batches)."""


class FaultInjectingBackend:
    """A backend that injects the faults of a :class:`FaultSchedule` into another one.

    Args:
        inner: The wrapped backend; it is closed with the wrapper.
        schedule: When faults happen.
        medium: The hook media faults go through; default :func:`medium_of` ``(inner)``.

    Raises:
        ConfigError: ``schedule`` asks for media faults that ``medium`` cannot inject.

    Faults never make it return wrong bytes itself: it only fails calls and keys (with
    :class:`~sglang_storage.errors.BackendIOError` /
    :class:`~sglang_storage.errors.OperationTimeoutError`), delays them, deletes objects,
    or damages stored objects before the wrapped backend reads and verifies them. Thread
    safe, like the backends it wraps. :meth:`pause` and :meth:`resume` switch injection off
    and on.
    """

    name = "faulty"

    def __init__(
        self, inner: Backend, schedule: FaultSchedule, *, medium: Medium | None = None
    ) -> None:
        self._inner = inner
        self._schedule = schedule
        self._medium = medium if medium is not None else medium_of(inner)
        wanted = schedule.kinds & MEDIA_FAULTS
        if wanted and self._medium is None:
            raise ConfigError(
                owner="FaultInjectingBackend",
                field="schedule",
                value=sorted(kind.value for kind in wanted),
                reason=f"asks for media faults, which cannot be injected into {inner.name!r}",
                allowed="media faults around file, memory or hf3fs (or pass a Medium); "
                "protocol faults around any backend",
            )
        self._lock = threading.Lock()
        self._seen: Counter[str] = Counter()
        self._counts: Counter[FaultKind] = Counter()
        self._calls = 0
        self._damaged: set[ObjectKey] = set()
        self._active = True

    # ------------------------------------------------------------------ declared

    @property
    def inner(self) -> Backend:
        """The wrapped backend."""
        return self._inner

    @property
    def schedule(self) -> FaultSchedule:
        """The schedule in force."""
        return self._schedule

    @property
    def media_faults(self) -> frozenset[FaultKind]:
        """The media faults this wrapper can inject into its backend."""
        return MEDIA_FAULTS if self._medium is not None else frozenset()

    @property
    def capabilities(self) -> Capabilities:
        """The inner backend's, less memory registration and scanning (fsck the inner one)."""
        return attrs.evolve(self._inner.capabilities, registers_memory=False, scannable=False)

    # ------------------------------------------------------------------ observations

    def fault_stats(self) -> FaultStats:
        """What has been injected so far."""
        with self._lock:
            counts = tuple((kind, self._counts[kind]) for kind in FaultKind)
            return FaultStats(calls=self._calls, counts=counts)

    def damaged_keys(self) -> frozenset[ObjectKey]:
        """Objects destroyed on purpose (torn, flipped, vanished)."""
        with self._lock:
            return frozenset(self._damaged)

    def pause(self) -> None:
        """Stop injecting; calls go straight to the inner backend."""
        with self._lock:
            self._active = False

    def resume(self) -> None:
        """Inject again."""
        with self._lock:
            self._active = True

    # ------------------------------------------------------------------ protocol

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """The inner answer; a ``partial_batch`` fault reports some keys absent."""
        self._call("exists", keys)
        found = self._inner.exists(keys)
        failing = self._partial("exists", keys)
        return [present and not bad for present, bad in zip(found, failing, strict=True)]

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """Leading stored keys, as :meth:`exists` (faults included) reports them."""
        return count_prefix(self.exists(keys))

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """The inner reads, after vanishing and flipping objects; failed keys are errors."""
        keys = [r.key for r in requests]
        self._call("get", keys)
        failing = self._partial("get", keys)
        passing = [r for r, bad in zip(requests, failing, strict=True) if not bad]
        for request in passing:
            self._before_read(request)
        read = iter(self._inner.get_into(passing))
        results = []
        for request, bad in zip(requests, failing, strict=True):
            if bad:
                scrub(request.buffers)
                error = self._error(f"read of {request.key}", "injected partial batch failure")
                results.append(GetResult.error_of(request.key, error))
            else:
                results.append(next(read))
        return results

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """The inner writes; failed keys are errors, torn objects are errors too."""
        keys = [r.key for r in requests]
        timeout = self._call("put", keys, defer_timeout=True)
        failing = self._partial("put", keys)
        passing = [r for r, bad in zip(requests, failing, strict=True) if not bad]
        written = iter(self._inner.put_from(passing))
        results = []
        for request, bad in zip(requests, failing, strict=True):
            if bad:
                error = self._error(f"write of {request.key}", "injected partial batch failure")
                results.append(PutResult.error_of(request.key, error))
                continue
            result = next(written)
            if result.outcome is PutOutcome.STORED:
                result = self._after_write(request, result)
            results.append(result)
        if timeout is not None:
            time.sleep(self._schedule.timeout_s)
            raise timeout
        return results

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """The inner delete, after the call faults."""
        self._call("delete", keys)
        self._inner.delete(keys)

    def clear(self, namespace: Namespace) -> None:
        """The inner backend's (no faults)."""
        self._inner.clear(namespace)

    def stats(self) -> BackendStats:
        """The inner backend's."""
        return self._inner.stats()

    def close(self) -> None:
        """Close the inner backend."""
        self._inner.close()

    # ------------------------------------------------------------------ decisions

    def _draw(self, kind: FaultKind, token: str) -> bool:
        """Whether ``kind`` strikes at this occurrence of ``token``; counts it when it does."""
        rate = self._schedule.rate(kind)
        if rate <= 0.0:
            return False
        with self._lock:
            if not self._active:
                return False
            if len(self._seen) >= _SEEN_MAX:  # bounded memory for long operator runs
                self._seen.clear()
            self._seen[f"{kind.value}|{token}"] += 1
            occurrence = self._seen[f"{kind.value}|{token}"]
        value = self._hash(kind.value, token, occurrence) / _SCALE
        return value < rate

    def _hash(self, *parts: object) -> int:
        text = "|".join(str(p) for p in (self._schedule.seed, *parts))
        return xxhash.xxh64_intdigest(text.encode())

    def _count(self, kind: FaultKind, key: ObjectKey | None = None) -> None:
        with self._lock:
            self._counts[kind] += 1
            if key is not None:
                self._damaged.add(key)

    def _error(self, operation: str, reason: str) -> BackendIOError:
        return BackendIOError(backend=self.name, operation=operation, reason=reason)

    def _call(
        self, op: str, keys: Sequence[ObjectKey], *, defer_timeout: bool = False
    ) -> OperationTimeoutError | None:
        """Apply the call faults; a deferred timeout is returned for the caller to raise."""
        with self._lock:
            self._calls += 1
        token = f"{op}|{len(keys)}|{keys[0] if keys else ''}|{keys[-1] if keys else ''}"
        what = f"{op} of {len(keys)} keys on {self._inner.name!r} (injected)"
        if self._draw(FaultKind.TIMEOUT, token):
            self._count(FaultKind.TIMEOUT)
            timeout = OperationTimeoutError(operation=what, timeout_s=self._schedule.timeout_s)
            if defer_timeout:
                return timeout
            time.sleep(self._schedule.timeout_s)
            raise timeout
        if self._draw(FaultKind.ERROR, token):
            self._count(FaultKind.ERROR)
            raise self._error(what, "injected call failure")
        if self._draw(FaultKind.LATENCY, token):
            self._count(FaultKind.LATENCY)
            time.sleep(self._schedule.latency_s)
        return None

    def _partial(self, op: str, keys: Sequence[ObjectKey]) -> list[bool]:
        """Which keys a ``partial_batch`` fault fails (none, usually; at least one if any)."""
        none = [False] * len(keys)
        if not keys:
            return none
        token = f"{op}|{len(keys)}|{keys[0]}|{keys[-1]}"
        if not self._draw(FaultKind.PARTIAL_BATCH, token):
            return none
        salt = self._hash("partial", token)
        failing = [self._hash(salt, key) % 2 == 0 for key in keys]
        if not any(failing):
            failing[salt % len(keys)] = True
        self._count(FaultKind.PARTIAL_BATCH)
        return failing

    def _before_read(self, request: GetRequest) -> None:
        key = request.key
        if self._draw(FaultKind.VANISHED, str(key)):
            with contextlib.suppress(StorageError):
                if self._inner.exists([key])[0]:
                    self._inner.delete([key])
                    self._count(FaultKind.VANISHED, key)
            return
        if self._medium is not None and self._draw(FaultKind.BIT_FLIP, str(key)):
            size = HEADER_SIZE + request.nbytes
            point = self._hash("flip", key, size)
            if self._medium.flip(key, point % size, 1 << (point >> 32) % 8):
                self._count(FaultKind.BIT_FLIP, key)

    def _after_write(self, request: PutRequest, result: PutResult) -> PutResult:
        key = request.key
        if self._medium is None or not self._draw(FaultKind.TORN_WRITE, str(key)):
            return result
        size = HEADER_SIZE + request.nbytes
        keep = self._hash("tear", key, size) % size
        if not self._medium.tear(key, keep, size):
            return result
        self._count(FaultKind.TORN_WRITE, key)
        error = self._error(f"write of {key}", f"torn: {keep} of {size} bytes reached the medium")
        return PutResult.error_of(key, error)
