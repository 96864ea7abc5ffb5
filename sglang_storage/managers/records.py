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

With storage, a stored record's host copy is dropped (unless ``keep_host_copy``), so the
reader may be another process. Not thread-safe: one owner thread calls every method. The
store drains its pipeline's completions, so the pipeline must not be shared.
"""

from __future__ import annotations

import contextlib
import enum

import attrs
import torch

from sglang_storage.config import instance_of
from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    GetResult,
    Namespace,
    ObjectSpec,
    PutOutcome,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import ConfigError, StateError, StorageError
from sglang_storage.memory import BlobPool, tensor_bytes, tensor_spec
from sglang_storage.storage import Backend
from sglang_storage.transfer import AnyHandle, Priority, StoragePipeline

__all__ = [
    "RecordEvent",
    "RecordStore",
    "RecordStoreConfig",
    "RecordTaken",
    "RecordWritten",
    "TakeOutcome",
]


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
