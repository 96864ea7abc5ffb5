"""Worked example, part 2 of a new data kind: the manager of speculative-decoding drafts.

A manager is a composition, not an engine. :class:`DraftCache` is handed its collaborators
and adds only the bookkeeping that ties them together:

- a :class:`~examples.draft_pool.DraftPool` - host memory, one draft per slot;
- a :class:`~sglang_storage.transfer.StoragePipeline` over any backend - it moves drafts
  between the pool and storage on its own workers and reports finished transfers;
- an :class:`~sglang_storage.core.EvictionPolicy` - which host drafts to drop when the pool
  is full (``make_eviction_policy`` builds one by name).

It owns no threads and no queues: :meth:`DraftCache.put` and :meth:`DraftCache.load` return at
once, and :meth:`DraftCache.poll` returns what finished as frozen values. A slot is pinned
(in the pool and in the policy) while a transfer uses its memory, so nothing in flight is
evicted or freed. Faults arrive as per-key results from the pipeline and leave as events:
a failed write is ``DraftStored(ok=False)``, a missing or corrupt object is a
``DraftLoaded`` that is not a hit, and the slot is freed, so a draft never holds bytes that
failed verification.

Not thread-safe: one owner (the scheduler thread) calls it, as with the policies it uses.
"""

from __future__ import annotations

import time
from typing import TypeAlias

import attrs
import torch

from examples.draft_pool import DraftPool
from sglang_storage.config import instance_of
from sglang_storage.core import (
    EvictionPolicy,
    GetOutcome,
    GetRequest,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutRequest,
)
from sglang_storage.errors import ConfigError, StorageError
from sglang_storage.transfer import GetHandle, Priority, PutHandle, StoragePipeline

__all__ = ["DraftCache", "DraftCacheConfig", "DraftEvent", "DraftLoaded", "DraftStored"]


@attrs.frozen(kw_only=True)
class DraftCacheConfig:
    """Where drafts are stored and how urgent their transfers are."""

    namespace: Namespace = attrs.field(validator=instance_of(Namespace))
    """The storage namespace of the drafts (model fingerprint, data kind, shard)."""
    load_priority: Priority = attrs.field(default=Priority.URGENT, validator=instance_of(Priority))
    """A load is on a request's critical path."""
    store_priority: Priority = attrs.field(
        default=Priority.BACKGROUND, validator=instance_of(Priority)
    )
    """Nobody waits for a write-through."""


@attrs.frozen(kw_only=True)
class DraftStored:
    """A draft's write to storage finished."""

    name: str
    ok: bool
    """Whether storage holds the draft now (written, or already there)."""
    error: StorageError | None = None


@attrs.frozen(kw_only=True)
class DraftLoaded:
    """A draft's load from storage finished; on a hit it is in host memory now."""

    name: str
    outcome: GetOutcome
    error: StorageError | None = None

    @property
    def hit(self) -> bool:
        """Whether the draft was found, verified and is readable with ``get``."""
        return self.outcome is GetOutcome.HIT


DraftEvent: TypeAlias = DraftStored | DraftLoaded


@attrs.frozen
class _Store:
    name: str
    slot: int
    handle: PutHandle


@attrs.frozen
class _Load:
    name: str
    slot: int
    handle: GetHandle


class DraftCache:
    """Drafts in host memory, written through to storage and loaded back on demand.

    Args:
        config: Namespace and priorities.
        pool: Host memory for the drafts.
        pipeline: Moves drafts to and from storage; this cache is its only user (it
            drains the pipeline's completions).
        eviction: Chooses which host drafts to drop when the pool is full.
    """

    def __init__(
        self,
        config: DraftCacheConfig,
        *,
        pool: DraftPool,
        pipeline: StoragePipeline,
        eviction: EvictionPolicy[str],
    ) -> None:
        self._config = config
        self._pool = pool
        self._pipeline = pipeline
        self._eviction = eviction
        self._spec = ObjectSpec(dtype="int32", shape=(pool.config.tokens,))
        self._slots: dict[str, int] = {}
        """Drafts readable in host memory, by name."""
        self._loading: set[str] = set()
        self._flights: dict[int, _Store | _Load] = {}
        """Transfers in flight, by the pipeline's operation id."""

    def put(self, name: str, tokens: torch.Tensor) -> bool:
        """Keep ``tokens`` as draft ``name`` and start writing it to storage.

        Returns False (and does nothing) if the draft is already here or being loaded.

        Raises:
            CapacityError: every slot is pinned by a transfer in flight, or the
                pipeline's queue is full.
            ConfigError: ``tokens`` has the wrong shape or element type.
            StateError: the pipeline is closed.
        """
        if name in self._slots or name in self._loading:
            return False
        slot = self._take_slot()
        try:
            self._pool.write(slot, tokens)
        except ConfigError:
            self._pool.free([slot])
            raise
        self._slots[name] = slot
        self._eviction.insert(name)
        self._pool.pin([slot])
        self._eviction.pin(name)
        buffer = self._pool.bytes_of(slot)
        request = PutRequest(key=self._key(name), spec=self._spec, buffers=[buffer])
        try:
            handle = self._pipeline.submit_put([request], priority=self._config.store_priority)
        except StorageError:  # a full queue or a closed pipeline: the draft stays, unstored
            self._pool.unpin([slot])
            self._eviction.unpin(name)
            raise
        self._flights[handle.op_id] = _Store(name, slot, handle)
        return True

    def get(self, name: str) -> torch.Tensor | None:
        """Draft ``name`` if it is in host memory (a use, for eviction), else None."""
        slot = self._slots.get(name)
        if slot is None:
            return None
        self._eviction.access(name)
        return self._pool.read(slot)

    def load(self, name: str) -> bool:
        """Start loading draft ``name`` from storage; :meth:`poll` reports the outcome.

        Returns False (and does nothing) if the draft is already here or being loaded.

        Raises:
            CapacityError: every slot is pinned by a transfer in flight, or the
                pipeline's queue is full.
            StateError: the pipeline is closed.
        """
        if name in self._slots or name in self._loading:
            return False
        slot = self._take_slot()
        self._pool.pin([slot])
        buffer = self._pool.bytes_of(slot)
        request = GetRequest(key=self._key(name), spec=self._spec, buffers=[buffer])
        try:
            handle = self._pipeline.submit_get([request], priority=self._config.load_priority)
        except StorageError:
            self._pool.unpin([slot])
            self._pool.free([slot])
            raise
        self._flights[handle.op_id] = _Load(name, slot, handle)
        self._loading.add(name)
        return True

    def poll(self, timeout_s: float = 0.0) -> list[DraftEvent]:
        """The transfers that finished since the last call, as events.

        Args:
            timeout_s: With nothing finished, wait this long for a completion.
        """
        return [
            self._finish(self._flights.pop(handle.op_id))
            for handle in self._pipeline.completions(timeout_s)
            if handle.op_id in self._flights
        ]

    def drain(self, timeout_s: float) -> list[DraftEvent]:
        """Wait (at most ``timeout_s`` in all) for every transfer in flight; their events."""
        deadline = time.monotonic() + timeout_s
        events: list[DraftEvent] = []
        while self._flights and time.monotonic() < deadline:
            events += self.poll(timeout_s=deadline - time.monotonic())
        return events

    @property
    def in_flight(self) -> int:
        """Transfers started and not yet reported by :meth:`poll`."""
        return len(self._flights)

    def _finish(self, flight: _Store | _Load) -> DraftEvent:
        self._pool.unpin([flight.slot])
        if isinstance(flight, _Store):
            self._eviction.unpin(flight.name)
            [stored] = flight.handle.partial()
            return DraftStored(name=flight.name, ok=stored.ok, error=stored.error)
        self._loading.discard(flight.name)
        [loaded] = flight.handle.partial()
        if loaded.hit:
            self._slots[flight.name] = flight.slot
            self._eviction.insert(flight.name)
        else:
            self._pool.free([flight.slot])  # the slot was zeroed or never written: drop it
        return DraftLoaded(name=flight.name, outcome=loaded.outcome, error=loaded.error)

    def _take_slot(self) -> int:
        """A free slot; when the pool is full, the eviction policy's victim gives up its own."""
        if self._pool.slots.free_count == 0:
            for victim in self._eviction.evict(1):
                self._pool.free([self._slots.pop(victim)])
        return int(self._pool.alloc(1)[0])

    def _key(self, name: str) -> ObjectKey:
        return self._config.namespace.key(name)
