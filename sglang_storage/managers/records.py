"""Write-once, read-once records: large per-request payloads that move through storage.

RL top-k token ids and logprobs, rope/position tensors and the like are written once by one
process (the scheduler) and read once by another (tokenizer, detokenizer, trainer), instead
of being pickled through ZMQ. A :class:`RecordStore` composes a
:class:`~sglang_storage.memory.BlobPool` (host copies, any dtype and shape), a
:class:`~sglang_storage.transfer.StoragePipeline` and the backend it runs on (for deletes,
which the pipeline does not carry). Contract, one line each:

- ``write(key, tensor)`` - copy ``tensor`` (any device) to host and queue a storage put; a
  key that is live here is a :class:`StateError` (one already in storage is reported by
  ``poll`` as a ``PRESENT`` write, a conflict).
- ``take(key, out)`` - read the record into ``out`` once and delete it from host and storage:
  TAKEN (a host copy, done now), PENDING (a storage get; a :class:`RecordTaken` follows) or
  MISS. ``out``'s dtype and shape are the expected spec: a host copy of another spec is a
  :class:`ConfigError`; a stored object of another spec is a ``CORRUPT`` take.
- ``discard(key)`` - drop a record without reading it (an aborted request).
- ``poll(timeout_s)`` - finished storage work as :class:`RecordWritten` / :class:`RecordTaken`.

A reader in another process that holds no store (an RL trainer) gets a
:class:`RecordHandle` from the writer (the key, spec and backend location, a few hundred
bytes that travel where the record would have) and calls :func:`read_record` (read once,
then delete; ``keep=True`` to read again) or :func:`delete_record` (drop it unread).

With storage, a stored record's host copy is dropped (unless ``keep_host_copy``), so the
reader may be another process. Not thread-safe: one owner thread calls every method. The
store drains its pipeline's completions, so the pipeline must not be shared.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
import torch

from sglang_storage.config import instance_of, non_empty_str, non_negative_int, tuple_of
from sglang_storage.core import (
    DataKind,
    EvictionPolicy,
    GetOutcome,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import ConfigError, StateError, StorageError
from sglang_storage.memory import BlobPool, tensor_bytes, tensor_spec
from sglang_storage.memory.layouts import ELEMENT_DTYPES
from sglang_storage.memory.tensors import dtype_name
from sglang_storage.policy.eviction import EvictionConfig, make_eviction_policy
from sglang_storage.storage import Backend, create_backend
from sglang_storage.transfer import AnyHandle, Priority, StoragePipeline

__all__ = [
    "HANDLE_PREFIX",
    "RecordEvent",
    "RecordHandle",
    "RecordStore",
    "RecordStoreConfig",
    "RecordTaken",
    "RecordWritten",
    "TakeOutcome",
    "close_readers",
    "delete_record",
    "read_record",
]

log = logging.getLogger(__name__)


class TakeOutcome(enum.Enum):
    """What ``take`` did."""

    TAKEN = "taken"
    """``out`` holds the record; it is gone from host and storage."""
    PENDING = "pending"
    """A storage get is in flight; a :class:`RecordTaken` will say how it ended."""
    MISS = "miss"
    """No such record here, and no storage to ask."""


@attrs.frozen(kw_only=True)
class RecordWritten:
    """A storage put of ``key`` finished (``PRESENT``: another writer's record has the key)."""

    key: str
    outcome: PutOutcome
    error: StorageError | None = None


@attrs.frozen(kw_only=True)
class RecordTaken:
    """A storage take of ``key`` finished; on a hit ``out`` holds the record (else undefined)."""

    key: str
    outcome: GetOutcome
    error: StorageError | None = None


RecordEvent = RecordWritten | RecordTaken
"""What ``poll`` returns."""


@attrs.frozen(kw_only=True)
class RecordStoreConfig:
    """How a record store runs."""

    model: str = attrs.field(validator=instance_of(str))
    """The model fingerprint naming the storage namespace."""
    kind: DataKind = attrs.field(default=DataKind.RECORD, validator=instance_of(DataKind))
    keep_host_copy: bool = attrs.field(default=False, validator=instance_of(bool))
    """Keep a record on host after storage acknowledged it (for a reader in this process)."""
    put_priority: Priority = attrs.field(default=Priority.NORMAL, validator=instance_of(Priority))
    get_priority: Priority = attrs.field(default=Priority.URGENT, validator=instance_of(Priority))

    @property
    def namespace(self) -> Namespace:
        """Where the records are stored."""
        return Namespace(model=self.model, kind=self.kind)

    def __attrs_post_init__(self) -> None:
        try:
            Namespace(model=self.model, kind=self.kind)
        except ConfigError as error:
            raise error.renamed(owner="RecordStoreConfig", field="model") from None


@attrs.define
class _Local:
    spec: ObjectSpec
    storing: bool = False
    stored: bool = False
    """Storage acknowledged this writer's put (so a take deletes the stored object too)."""
    gone: bool = False
    """Taken or discarded while its put was in flight: delete once the put ends."""


class RecordStore:
    """Keyed write-once/read-once records on host, optionally through storage.

    Args:
        config: Namespace and behaviour.
        pool: Host copies of the records.
        storage: The pipeline to ``backend``; ``None`` (with ``backend``) for host only.
        backend: The store ``storage`` runs on; records taken from it are deleted there.
    """

    def __init__(
        self,
        config: RecordStoreConfig,
        pool: BlobPool,
        storage: StoragePipeline | None = None,
        backend: Backend | None = None,
    ) -> None:
        if (storage is None) != (backend is None):
            raise ConfigError(
                owner="RecordStore",
                field="backend",
                reason="must be given exactly when storage is (deletes go to the backend)",
            )
        self._config = config
        self._pool = pool
        self._storage = storage
        self._backend = backend
        self._namespace = config.namespace
        self._local: dict[str, _Local] = {}
        self._ops: dict[int, tuple[str, torch.Tensor | None, torch.Tensor | None]] = {}
        self._taking: set[str] = set()
        self._early: list[RecordEvent] = []

    @property
    def config(self) -> RecordStoreConfig:
        """The store's configuration."""
        return self._config

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is live on host here."""
        return isinstance(key, str) and key in self._local and not self._local[key].gone

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (any device, dtype and shape) once as ``key``.

        Raises:
            StateError: ``key`` is live here (written and not yet taken).
            CapacityError: the host pool has no room; nothing was stored.
            ConfigError: a bad key or an empty tensor.
        """
        object_key = self._namespace.key(key)
        if key in self._local or key in self._taking:
            raise StateError(
                subject="RecordStore.write", reason=f"record {key!r} is already written"
            )
        spec = tensor_spec(tensor.dtype, tuple(tensor.shape))
        self._pool.put(key, tensor)
        local = self._local[key] = _Local(spec=spec)
        if self._storage is None:
            return
        self._pool.pin(key)
        buffers = [tensor_bytes(self._view(key, spec))]
        try:
            handle = self._storage.submit_put(
                [PutRequest(key=object_key, spec=spec, buffers=buffers)],
                priority=self._config.put_priority,
            )
        except StorageError as error:  # a full queue or a closed pipeline: keep the host copy
            self._pool.unpin(key)
            self._early.append(RecordWritten(key=key, outcome=PutOutcome.ERROR, error=error))
            return
        local.storing = True
        self._ops[handle.op_id] = (key, None, None)

    def take(self, key: str, out: torch.Tensor) -> TakeOutcome:
        """Read record ``key`` into ``out`` once, then delete it everywhere.

        Raises:
            ConfigError: the host copy's dtype or shape differs from ``out``'s.
            StateError: a take of ``key`` is already in flight.
        """
        object_key = self._namespace.key(key)
        spec = tensor_spec(out.dtype, tuple(out.shape))
        local = self._local.get(key)
        if local is not None and local.gone:
            return TakeOutcome.MISS  # taken already; its put is still finishing
        if local is not None:
            if local.spec != spec:
                raise ConfigError(
                    owner="RecordStore.take",
                    field="out",
                    value=f"{spec.dtype} {spec.shape}",
                    reason=f"must match record {key!r}: {local.spec.dtype} {local.spec.shape}",
                )
            out.copy_(self._view(key, spec))
            self._forget(key)
            return TakeOutcome.TAKEN
        if self._storage is None:
            return TakeOutcome.MISS
        if key in self._taking:
            raise StateError(subject="RecordStore.take", reason=f"{key!r} is already being taken")
        direct = out.device.type == "cpu" and out.is_contiguous()
        staging = out if direct else torch.empty(out.shape, dtype=out.dtype)
        request = GetRequest(key=object_key, spec=spec, buffers=[tensor_bytes(staging)])
        try:
            handle = self._storage.submit_get([request], priority=self._config.get_priority)
        except StorageError as error:
            self._early.append(RecordTaken(key=key, outcome=GetOutcome.ERROR, error=error))
            return TakeOutcome.PENDING
        self._taking.add(key)
        self._ops[handle.op_id] = (key, out, None if direct else staging)
        return TakeOutcome.PENDING

    def discard(self, key: str) -> None:
        """Drop record ``key`` from host and storage without reading it (absent is fine)."""
        self._namespace.key(key)  # checks the name
        if key in self._local:
            self._forget(key)
        else:
            self._delete_stored(key)

    def poll(self, timeout_s: float = 0.0) -> list[RecordEvent]:
        """Finished storage work since the last call (waits up to ``timeout_s`` for some)."""
        events, self._early = self._early, []
        if self._storage is None:
            return events
        for handle in self._storage.completions(timeout_s):
            op = self._ops.pop(handle.op_id, None)
            if op is not None:
                events.append(self._finish(handle, *op))
        return events

    # ------------------------------------------------------------------ internals

    def _finish(
        self, handle: AnyHandle, key: str, out: torch.Tensor | None, staging: torch.Tensor | None
    ) -> RecordEvent:
        (result,) = handle.partial()
        if isinstance(result, GetResult):
            self._taking.discard(key)
            if result.hit:
                if out is not None and staging is not None:
                    out.copy_(staging)
                self._delete_stored(key)
            return RecordTaken(key=key, outcome=result.outcome, error=result.error)
        assert isinstance(result, PutResult)  # the store submits no exists
        self._pool.unpin(key)
        local = self._local[key]
        local.storing = False
        local.stored = result.outcome is PutOutcome.STORED
        if local.gone:
            self._forget(key)
        elif result.outcome is PutOutcome.STORED and not self._config.keep_host_copy:
            self._pool.remove(key)  # the record lives in storage now
            del self._local[key]
        error = result.error
        if result.outcome is PutOutcome.PRESENT:
            error = StateError(subject="RecordStore.write", reason=f"{key!r} was already stored")
        return RecordWritten(key=key, outcome=result.outcome, error=error)

    def _forget(self, key: str) -> None:
        """Drop a local record; its put still in flight finishes first (then this runs again)."""
        local = self._local[key]
        if local.storing:
            local.gone = True
            return
        del self._local[key]
        self._pool.remove(key)
        if local.stored:
            self._delete_stored(key)

    def _delete_stored(self, key: str) -> None:
        if self._backend is None:
            return
        # Synchronous: the pipeline carries no deletes. On failure the object stays until the
        # backend's own eviction; nothing wrong is ever read.
        with contextlib.suppress(StorageError):
            self._backend.delete([self._namespace.key(key)])

    def _view(self, key: str, spec: ObjectSpec) -> torch.Tensor:
        dtype = getattr(torch, spec.dtype)
        view = self._pool.view(key, dtype, spec.shape)
        assert view is not None  # only called for keys in the pool
        return view


# ---------------------------------------------------------------------- handles and readers

HANDLE_PREFIX: Final = b"sglang_storage.record "
"""The first bytes of :meth:`RecordHandle.to_bytes` (what tells a handle from raw rows)."""
_DTYPES: Final = tuple(dtype_name(d) for d in ELEMENT_DTYPES)


def _options(value: Mapping[str, object]) -> Mapping[str, object]:
    return dict(value)


def _shape(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


def _dtype(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in _DTYPES:
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="is not an element type a record holds",
            allowed=", ".join(_DTYPES),
        )


@attrs.frozen(kw_only=True)
class RecordHandle:
    """Where one stored record is, for a reader in another process.

    Built by the writer once the record is written (its put may still be in flight:
    :func:`read_record` retries a miss); small, JSON-serialisable (:meth:`to_bytes`).
    """

    key: str = attrs.field(validator=non_empty_str)
    """The record's name in the namespace (what ``RecordStore.write`` was given)."""
    model: str = attrs.field(validator=non_empty_str)
    """The namespace's model fingerprint (``RecordStoreConfig.model``)."""
    kind: DataKind = attrs.field(default=DataKind.RECORD, converter=DataKind)
    """The namespace's data kind (``RecordStoreConfig.kind``)."""
    shape: tuple[int, ...] = attrs.field(converter=_shape, validator=tuple_of(non_negative_int))
    """The record's shape; a record with no elements was never stored."""
    dtype: str = attrs.field(validator=_dtype)
    """Its element type, by name (``"int32"``)."""
    backend: str = attrs.field(validator=non_empty_str)
    """The registered backend name that holds it (``file``, ``mooncake``, ...)."""
    options: Mapping[str, object] = attrs.field(factory=dict, converter=_options)
    """That backend's options, as JSON shapes (the file root, the Mooncake master, ...)."""
    tag: str = attrs.field(default="", validator=instance_of(str))
    """What the writer says the record is (e.g. ``routed_experts``)."""

    def __attrs_post_init__(self) -> None:
        self.object_key  # noqa: B018  # checks the names

    @property
    def object_key(self) -> ObjectKey:
        """The record's key in the backend."""
        return Namespace(model=self.model, kind=self.kind).key(self.key)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type."""
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the record."""
        count = self.torch_dtype.itemsize
        for dim in self.shape:
            count *= dim
        return count

    def to_bytes(self) -> bytes:
        """:data:`HANDLE_PREFIX` and compact JSON (a few hundred bytes)."""
        body = {
            "key": self.key,
            "model": self.model,
            "kind": self.kind.value,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "backend": self.backend,
            "options": dict(self.options),
            "tag": self.tag,
        }
        return HANDLE_PREFIX + json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RecordHandle:
        """Parse :meth:`to_bytes` output.

        Raises:
            ConfigError: ``data`` is not a handle (does not start with
                :data:`HANDLE_PREFIX`) or is malformed.
        """
        if not data.startswith(HANDLE_PREFIX):
            raise ConfigError(
                owner="RecordHandle",
                field="data",
                value=f"{len(data)} bytes",
                reason="is not a sglang_storage record handle",
                allowed=f"bytes starting with {HANDLE_PREFIX!r}",
            )
        try:
            body = json.loads(data[len(HANDLE_PREFIX) :])
            return cls(**body)
        except (ValueError, TypeError) as error:
            raise ConfigError(
                owner="RecordHandle", field="data", reason=f"is a malformed handle: {error}"
            ) from None

    @classmethod
    def from_base64(cls, text: str) -> RecordHandle:
        """Parse the base64 of :meth:`to_bytes` (as an HTTP JSON body carries it).

        Raises:
            ConfigError: not base64, or not a handle (see :meth:`from_bytes`).
        """
        try:
            data = base64.b64decode(text, validate=True)
        except (ValueError, TypeError) as error:
            raise ConfigError(
                owner="RecordHandle", field="text", reason=f"is not base64: {error}"
            ) from None
        return cls.from_bytes(data)


_readers: dict[str, Backend] = {}
_readers_lock = threading.Lock()


def _reader(handle: RecordHandle, override: Mapping[str, object] | None) -> Backend:
    """This process's backend for ``handle`` (one per backend and options, kept open)."""
    options = dict(handle.options if override is None else override)
    if handle.backend == "mooncake" and override is None:
        options["global_segment_size"] = 0  # a reader contributes no memory to the cluster
    name = json.dumps([handle.backend, options], sort_keys=True, default=str)
    with _readers_lock:
        backend = _readers.get(name)
        if backend is None:
            eviction: EvictionPolicy[ObjectKey] | None = None
            if options.get("capacity_bytes") is not None:  # the writer's cap, same options
                eviction = make_eviction_policy(EvictionConfig())
            backend = _readers[name] = create_backend(handle.backend, options, eviction=eviction)
        return backend


def read_record(
    handle: RecordHandle,
    *,
    timeout_s: float = 30.0,
    keep: bool = False,
    backend_options: Mapping[str, object] | None = None,
) -> torch.Tensor:
    """The record ``handle`` names, read from its backend, then deleted there unless ``keep``.

    A miss is retried until ``timeout_s`` (the writer's put may still be in flight).
    ``backend_options`` replace the writer's (e.g. the file root as this host mounts it);
    a Mooncake reader mounts no segment of its own.

    Raises:
        StorageError: still a miss after ``timeout_s`` (taken already, deleted, evicted or
            never stored), a corrupt object (a checksum or spec mismatch), or a backend
            error.
        ConfigError: ``timeout_s`` is negative, or bad backend options.
    """
    if not timeout_s >= 0:
        raise ConfigError(
            owner="read_record", field="timeout_s", value=timeout_s, reason="must be >= 0"
        )
    out = torch.empty(handle.shape, dtype=handle.torch_dtype)
    if out.numel() == 0:
        return out
    backend = _reader(handle, backend_options)
    request = GetRequest(
        key=handle.object_key,
        spec=tensor_spec(out.dtype, handle.shape),
        buffers=[tensor_bytes(out)],
    )
    end = time.monotonic() + timeout_s
    while True:
        (result,) = backend.get_into([request])
        if result.hit:
            break
        if result.outcome is not GetOutcome.MISS or time.monotonic() >= end:
            waited = f" after {timeout_s:g} s" if result.outcome is GetOutcome.MISS else ""
            detail = f" ({result.error})" if result.error is not None else ""
            raise StorageError(
                f"record {handle.key!r} ({handle.tag or handle.kind.value}) in "
                f"{handle.backend}: {result.outcome.value}{waited}{detail}"
            )
        time.sleep(0.01)
    if not keep:
        try:
            backend.delete([handle.object_key])
        except StorageError as error:  # read already; the object ages out of storage
            log.warning("deleting record %r after reading it failed: %s", handle.key, error)
    return out


def delete_record(
    handle: RecordHandle, *, backend_options: Mapping[str, object] | None = None
) -> None:
    """Delete the record ``handle`` names without reading it (absent is fine).

    Raises:
        StorageError: the backend failed.
    """
    if handle.nbytes == 0:
        return
    _reader(handle, backend_options).delete([handle.object_key])


def close_readers() -> None:
    """Close the backends :func:`read_record` and :func:`delete_record` opened here."""
    with _readers_lock:
        backends = list(_readers.values())
        _readers.clear()
    for backend in backends:
        with contextlib.suppress(StorageError):
            backend.close()
