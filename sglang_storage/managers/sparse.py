"""Sparse KV: token-granular offload and top-k prefetch between a device buffer and host.

Sparse attention reads only the top-k tokens a step selects, so a request keeps a small
device buffer of ``device_slots`` token slots while its whole KV lives on the host; each
step brings the selected tokens that are not resident into the buffer first (SGLang's
HiSparse ``HiSparseCoordinator`` and the NPU ``SparseKVCacheManager``, map section 4).
Contract, one line per primitive:

- ``admit(request_id)`` - give the request a device region of ``device_slots`` slots.
- ``append(request_id, count)`` - device token slots for its next ``count`` tokens (the
  model writes their KV there); least recently used tokens make room if needed.
- ``evict(request_id, positions)`` - take tokens out of the device buffer; those with no
  host copy yet are written device->host first.
- ``prefetch(request_id, positions)`` - make the selected tokens resident before the step
  that reads them: resident ones are hits (not copied), misses are loaded host->device
  into free or evicted slots; returns their device slots and the load to wait on.
- ``finish(request_id, token_ids=, seed=)`` - done: with ``token_ids``, every token goes to
  storage (one object per token, keyed by SGLang's hash chain with page size 1) before its
  host page is freed; without, everything is freed now. ``release`` drops a request.
- ``restore(request_id, token_ids, seed=)`` - read a stored request's tokens back to the
  host (the longest stored prefix); the request is usable once ``poll`` reports it.
- ``poll(timeout_s)`` - finished storage work and device copy failures, as
  :data:`SparseEvent` values. Backups and restores go through a
  :class:`~sglang_storage.managers.pageio.HostPageIO`: their host pages stay pinned until
  ``poll`` collects them.

Host backing is a :class:`~sglang_storage.memory.KVHostPool` with ``page_size=1`` (a page is
one token) rather than a ``RecordPool``: the device<->host pipeline moves exactly such pages
(async streams, layer events, SGLang's transfer kernels), in SGLang's host layouts, and the
pool hands out the page views a zero-copy storage request needs.

Faults: a failed device->host copy loses the tokens it carried once they leave the device
(:class:`TokensLost`; prefetching them is a :class:`StateError`, never stale bytes); a
failed load leaves its tokens non-resident; storage failures are reported, never retried.
Locking: not thread-safe; one thread drives it. It owns its pipelines' results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from sglang_storage.config import instance_of, optional, positive_int, positive_number
from sglang_storage.core import EvictionPolicy, Namespace
from sglang_storage.errors import ConfigError, StateError, StorageError
from sglang_storage.managers.pageio import HostPageIO, PageOp
from sglang_storage.memory import KVHostPool, SlotAllocator
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage.keys import page_hashes
from sglang_storage.transfer import (
    CopyDirection,
    DeviceHostPipeline,
    DeviceLoadHandle,
    DeviceTransferResult,
    Priority,
    StoragePipeline,
)

__all__ = [
    "BackupDone",
    "BackupFailed",
    "EvictResult",
    "PrefetchResult",
    "Restored",
    "SparseEvent",
    "SparseKVConfig",
    "SparseKVManager",
    "TokensLost",
]

Positions = npt.NDArray[np.int64]


def _refuse(op: str, field: str, value: object, reason: str) -> ConfigError:
    return ConfigError(owner=f"SparseKVManager.{op}", field=field, value=value, reason=reason)


@attrs.frozen(kw_only=True)
class SparseKVConfig:
    """Sizes of a :class:`SparseKVManager`; validated on construction."""

    device_slots: int = attrs.field(validator=positive_int)
    """Device token slots per request (SGLang's ``device_buffer_size``)."""
    max_tokens: int = attrs.field(validator=positive_int)
    """Most tokens one request holds (SGLang's ``max_context_len``)."""
    max_requests: int = attrs.field(validator=positive_int)
    """Requests at once; the device pool holds ``max_requests * device_slots`` tokens."""
    priority: Priority = attrs.field(default=Priority.NORMAL, validator=instance_of(Priority))
    deadline_s: float | None = attrs.field(default=None, validator=optional(positive_number))


@attrs.frozen(kw_only=True, eq=False)
class PrefetchResult:
    """Where the selected tokens are on the device, and what it took to put them there.

    ``device_tokens``: the device token index of each selected position, in order;
    ``hits``: selected tokens already resident (not copied); ``misses``: tokens loaded
    host->device; ``evicted``: resident tokens evicted to make room, ``written`` of them
    copied device->host first (they had no host copy); ``load``: the load of the misses,
    to wait on per layer before attention (None without misses).
    """

    device_tokens: torch.Tensor
    hits: int
    misses: int
    evicted: int
    written: int
    load: DeviceLoadHandle | None


@attrs.frozen(kw_only=True)
class EvictResult:
    """Tokens taken out of the device buffer, and how many were copied to host first."""

    evicted: int
    written: int


@attrs.frozen(kw_only=True)
class BackupDone:
    """Every token of the finished request is in storage; its host pages are free."""

    request_id: str
    tokens: int


@attrs.frozen(kw_only=True)
class BackupFailed:
    """The backup failed: ``stored`` of ``tokens`` reached storage; host pages are free."""

    request_id: str
    tokens: int
    stored: int
    error: StorageError


@attrs.frozen(kw_only=True)
class Restored:
    """``tokens`` of the ``requested`` leading tokens are on the host; the request is usable."""

    request_id: str
    tokens: int
    requested: int


@attrs.frozen(kw_only=True)
class TokensLost:
    """A device->host copy failed and these tokens are no longer anywhere."""

    request_id: str
    positions: tuple[int, ...]
    error: StorageError


SparseEvent = BackupDone | BackupFailed | Restored | TokensLost
"""What :meth:`SparseKVManager.poll` reports."""


@attrs.define(eq=False)
class _Request:
    request_id: str
    region: int
    base: int
    slots: SlotAllocator
    device: Positions  # position -> slot in the region, or -1
    host: Positions  # position -> host page, or -1
    lru: EvictionPolicy[int]  # resident positions
    length: int = 0
    storage: PageOp | None = None  # a backup or a restore in flight (its pages pinned)
    restoring: bool = False  # ``storage`` is a restore
    released: bool = False  # dropped while ``storage`` was in flight


class SparseKVManager:
    """Per-request device token buffers backed by host pages, with top-k prefetch.

    Args:
        host: The host pool; ``page_size`` must be 1 (a page is a token).
        device: The pipeline between the device pool (``max_requests * device_slots``
            tokens, page size 1) and ``host``.
        config: Slots, limits, storage priority.
        storage: The host<->storage pipeline for backup and restore (optional).
        namespace: Where backed-up tokens are stored (required with ``storage``).
        eviction: Makes each request's policy over its resident tokens (default LRU).
    """

    def __init__(
        self,
        *,
        host: KVHostPool,
        device: DeviceHostPipeline,
        config: SparseKVConfig,
        storage: StoragePipeline | None = None,
        namespace: Namespace | None = None,
        eviction: Callable[[], EvictionPolicy[int]] = LRUPolicy,
    ) -> None:
        if host.geometry.page_size != 1 or (storage is None) != (namespace is None):
            reason = "the host pool's page_size must be 1, and storage needs a namespace"
            raise _refuse("__init__", "host", host.geometry.page_size, reason)
        self._host, self._device, self._config = host, device, config
        self._storage, self._namespace, self._eviction = storage, namespace, eviction
        self._io = None if storage is None else HostPageIO(host, storage)
        self._regions = SlotAllocator(config.max_requests, name="sparse KV regions")
        self._requests: dict[str, _Request] = {}
        self._offloads: dict[int, tuple[str, Positions]] = {}  # D2H id -> what it wrote
        self._loads: dict[int, tuple[str, Positions]] = {}
        self._storage_ops: dict[int, str] = {}
        self._events: list[SparseEvent] = []

    # ------------------------------------------------------------------ requests

    def admit(self, request_id: str) -> None:
        """Give ``request_id`` a device region; CapacityError when all are taken."""
        if request_id in self._requests:
            raise StateError(subject=f"sparse KV {request_id!r}", reason="already admitted")
        region = int(self._regions.alloc(1)[0])
        c = self._config
        self._requests[request_id] = _Request(
            request_id=request_id,
            region=region,
            base=region * c.device_slots,
            slots=SlotAllocator(c.device_slots, name=f"{request_id} device slots"),
            device=np.full(c.max_tokens, -1, dtype=np.int64),
            host=np.full(c.max_tokens, -1, dtype=np.int64),
            lru=self._eviction(),
        )

    def append(self, request_id: str, count: int) -> torch.Tensor:
        """Device token indices for the request's next ``count`` tokens, now resident.

        Raises:
            ConfigError: more than ``device_slots`` or past ``max_tokens``.
        """
        r = self._ready(request_id)
        c = self._config
        if not 0 < count <= c.device_slots or r.length + count > c.max_tokens:
            reason = f"must be 1..{c.device_slots} and fit {c.max_tokens} tokens in all"
            raise _refuse("append", "count", count, reason)
        self._make_room(r, count - r.slots.free_count, np.empty(0, dtype=np.int64))
        positions = np.arange(r.length, r.length + count, dtype=np.int64)
        slots = r.slots.alloc(count)
        r.device[positions] = slots.numpy()
        for p in positions.tolist():
            r.lru.insert(p)
        r.length += count
        return slots + r.base

    def evict(self, request_id: str, positions: Sequence[int] | torch.Tensor) -> EvictResult:
        """Take resident ``positions`` out of the device buffer (others are ignored)."""
        r = self._ready(request_id)
        wanted = self._positions(r, positions, "evict")
        resident = wanted[r.device[wanted] >= 0]
        written = self._drop(r, resident)
        for p in resident.tolist():
            r.lru.remove(p)
        return EvictResult(evicted=resident.size, written=written)

    def prefetch(self, request_id: str, positions: Sequence[int] | torch.Tensor) -> PrefetchResult:
        """Make the selected ``positions`` resident; see :class:`PrefetchResult`.

        Raises:
            ConfigError: a position is repeated, not yet appended, or there are more than
                ``device_slots``.
            StateError: a selected token was lost (see :class:`TokensLost`).
        """
        self._collect(self._device.poll())
        r = self._ready(request_id)
        wanted = self._positions(r, positions, "prefetch")
        slots = self._config.device_slots
        if wanted.size > slots or np.unique(wanted).size != wanted.size:
            reason = f"must be distinct and at most device_slots ({slots})"
            raise _refuse("prefetch", "positions", wanted[:8].tolist(), reason)
        hit = r.device[wanted] >= 0
        misses = wanted[~hit]
        lost = misses[r.host[misses] < 0]
        if lost.size:
            raise StateError(
                subject=f"sparse KV {request_id!r}",
                reason=f"tokens {lost[:8].tolist()} were lost (a device->host copy failed)",
            )
        hits = wanted[hit].tolist()
        for p in hits:
            r.lru.access(p)
        evicted, written = self._make_room(r, misses.size - r.slots.free_count, wanted[hit])
        load = None
        if misses.size:
            free = r.slots.alloc(misses.size)
            try:
                load = self._device.load(torch.from_numpy(r.host[misses]), free + r.base)
            except BaseException:
                r.slots.free(free)
                raise
            r.device[misses] = free.numpy()
            for p in misses.tolist():
                r.lru.insert(p)
            self._loads[load.transfer_id] = (request_id, misses)
        return PrefetchResult(
            device_tokens=torch.from_numpy(r.device[wanted] + r.base),
            hits=len(hits),
            misses=misses.size,
            evicted=evicted,
            written=written,
            load=load,
        )

    def finish(
        self, request_id: str, token_ids: Sequence[int] | None = None, *, seed: str | None = None
    ) -> None:
        """The request is done; with ``token_ids`` (all its tokens) back it up first.

        The device region is free when this returns; the host pages once :meth:`poll`
        reports the backup. Without storage or ``token_ids``, this is :meth:`release`.

        Raises:
            CapacityError: the storage queue is full (all tokens are on the host now and
                the request stays admitted: finish again later, or release it).
        """
        r = self._ready(request_id)
        if self._io is None or self._namespace is None or token_ids is None:
            self.release(request_id)
            return
        if len(token_ids) != r.length:
            reason = f"must be the request's {r.length} tokens"
            raise _refuse("finish", "token_ids", len(token_ids), reason)
        self.evict(request_id, self.resident(request_id))
        self._collect(self._device.drain())  # the put reads what the copies wrote
        keys = page_hashes(list(token_ids), 1, seed)
        pages = r.host[: r.length].tolist()
        if min(pages, default=0) < 0:  # lost tokens: only the prefix before them is sound
            del pages[pages.index(-1) :]
        c = self._config
        op = self._io.put(
            [self._namespace.key(k) for k in keys[: len(pages)]],
            torch.tensor(pages, dtype=torch.int64),
            priority=c.priority,
            deadline_s=c.deadline_s,
        )
        self._storage_ops[_started(op)] = request_id
        r.storage = op
        self._regions.free([r.region])
        r.region = -1

    def restore(
        self, request_id: str, token_ids: Sequence[int], *, seed: str | None = None
    ) -> None:
        """Admit ``request_id`` and read its stored tokens back to the host.

        Raises:
            StateError: no storage, or the request is already admitted.
            CapacityError: no device region, host pages or room in the storage queue.
        """
        if self._io is None or self._namespace is None:
            raise StateError(subject="SparseKVManager.restore", reason="there is no storage")
        c = self._config
        if len(token_ids) > c.max_tokens:
            reason = f"must be at most max_tokens ({c.max_tokens})"
            raise _refuse("restore", "token_ids", len(token_ids), reason)
        self.admit(request_id)
        r = self._requests[request_id]
        try:  # a refusal (no host pages, a full storage queue) leaves nothing held
            keys = [self._namespace.key(k) for k in page_hashes(list(token_ids), 1, seed)]
            pages = self._host.alloc(len(token_ids))
            r.host[: len(token_ids)] = pages.numpy()
            op = self._io.get(keys, pages, priority=c.priority, deadline_s=c.deadline_s)
            op_id = _started(op)
        except BaseException:
            self.release(request_id)
            raise
        r.storage, r.restoring = op, True
        self._storage_ops[op_id] = request_id

    def release(self, request_id: str) -> None:
        """Drop the request now; a backup or restore in flight is cancelled and freed by poll."""
        r = self._requests.get(request_id)
        if r is None:
            return
        if r.storage is not None:
            r.storage.cancel()
            r.released = True  # poll frees it, without an event
            return
        if self._device.in_flight:
            self._collect(self._device.drain())  # pinned host pages cannot be freed
        self._forget(r)

    # ------------------------------------------------------------------ completions

    @property
    def busy(self) -> bool:
        """Whether a backup or restore is in flight."""
        return bool(self._storage_ops)

    def poll(self, timeout_s: float = 0.0) -> list[SparseEvent]:
        """Collect finished copies and storage work; return what happened, in order."""
        self._collect(self._device.poll())
        if self._storage is not None:
            for handle in self._storage.completions(timeout_s if self._storage_ops else 0.0):
                request_id = self._storage_ops.pop(handle.op_id, None)
                if request_id is not None:
                    self._stored(request_id, self._requests[request_id])
        events, self._events = self._events, []
        return events

    def resident(self, request_id: str) -> torch.Tensor:
        """The positions of the request's tokens now in its device buffer."""
        r = self._ready(request_id)
        return torch.from_numpy(np.flatnonzero(r.device[: r.length] >= 0))

    # ------------------------------------------------------------------ internals

    def _ready(self, request_id: str) -> _Request:
        r = self._requests.get(request_id)
        if r is None or r.storage is not None:
            state = "not admitted" if r is None else "busy with a backup or restore"
            raise StateError(subject=f"sparse KV {request_id!r}", reason=state)
        return r

    def _positions(
        self, r: _Request, positions: Sequence[int] | torch.Tensor, op: str
    ) -> Positions:
        raw = positions.cpu().numpy() if isinstance(positions, torch.Tensor) else positions
        wanted = np.asarray(raw, dtype=np.int64).reshape(-1)
        if wanted.size and (wanted.min() < 0 or wanted.max() >= r.length):
            bad = wanted[(wanted < 0) | (wanted >= r.length)][:8].tolist()
            raise _refuse(op, "positions", bad, f"must be appended tokens 0..{r.length - 1}")
        return wanted

    def _make_room(self, r: _Request, need: int, keep: Positions) -> tuple[int, int]:
        """Evict ``need`` least recently used tokens not in ``keep``; (evicted, written)."""
        if need <= 0:
            return 0, 0
        kept = keep.tolist()
        for p in kept:
            r.lru.pin(p)
        victims = np.asarray(r.lru.evict(need), dtype=np.int64)
        for p in kept:
            r.lru.unpin(p)
        try:
            return victims.size, self._drop(r, victims)
        except BaseException:  # no host page for a dirty victim: they stay resident
            for p in victims.tolist():
                r.lru.insert(p)
            raise

    def _drop(self, r: _Request, resident: Positions) -> int:
        """Free the slots of ``resident`` (untracked by the policy), writing dirty ones first."""
        dirty = resident[r.host[resident] < 0]
        if dirty.size:
            pages = self._host.alloc(dirty.size)
            try:
                handle = self._device.offload(pages, torch.from_numpy(r.device[dirty] + r.base))
            except BaseException:
                self._host.free(pages)
                raise
            handle.fence()  # the freed slots may be loaded into next
            r.host[dirty] = pages.numpy()
            self._offloads[handle.transfer_id] = (r.request_id, dirty)
        r.slots.free(torch.from_numpy(r.device[resident]))
        r.device[resident] = -1
        return dirty.size

    def _collect(self, results: list[DeviceTransferResult]) -> None:
        """Undo what failed copies claimed: lost host copies, garbage device slots."""
        for result in results:
            table = self._offloads if result.direction is CopyDirection.OFFLOAD else self._loads
            request_id, positions = table.pop(result.transfer_id, ("", np.empty(0, np.int64)))
            r = self._requests.get(request_id)
            if result.ok or r is None:
                continue
            assert result.error is not None
            if result.direction is CopyDirection.OFFLOAD:
                self._host.free(torch.from_numpy(r.host[positions]))
                r.host[positions] = -1
            stale = positions[r.device[positions] >= 0]  # loaded from, or into, bad bytes
            for p in stale.tolist():
                r.lru.remove(p)
            r.slots.free(torch.from_numpy(r.device[stale]))
            r.device[stale] = -1
            gone = positions[(r.host[positions] < 0) & (r.device[positions] < 0)]
            if gone.size:
                self._events.append(
                    TokensLost(
                        request_id=request_id, positions=tuple(gone.tolist()), error=result.error
                    )
                )

    def _stored(self, request_id: str, r: _Request) -> None:
        op, released, restoring = r.storage, r.released, r.restoring
        assert op is not None
        op.collect()  # its host pages may be freed from here
        oks = op.page_ok()
        r.storage, r.restoring = None, False
        if restoring and not released:
            found = op.leading()
            self._host.free(torch.from_numpy(r.host[found : len(oks)]))
            r.host[found : len(oks)] = -1
            r.length = found
            self._events.append(Restored(request_id=request_id, tokens=found, requested=len(oks)))
            return
        self._forget(r)
        if released:
            return
        if op.error is None and all(oks):
            self._events.append(BackupDone(request_id=request_id, tokens=len(oks)))
            return
        error = op.error or StorageError(f"{oks.count(False)} tokens were not stored")
        self._events.append(
            BackupFailed(request_id=request_id, tokens=len(oks), stored=sum(oks), error=error)
        )

    def _forget(self, r: _Request) -> None:
        """Free the request's device region and host pages; stop tracking it."""
        if r.region >= 0:
            self._regions.free([r.region])
        held = r.host[r.host >= 0]
        if held.size:
            self._host.free(torch.from_numpy(held))
        del self._requests[r.request_id]


def _started(op: PageOp) -> int:
    """The pipeline id of ``op``; raises why its submission was refused (nothing is pinned)."""
    if op.op_id is None:
        assert op.error is not None  # a refusal says why
        raise op.error
    return op.op_id
