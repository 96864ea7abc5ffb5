"""The KV cache manager: HiCache's device <-> host <-> storage tiers as one composition.

A :class:`KVCacheManager` is a host pool (:class:`~sglang_storage.memory.KVHostPool`), a
device<->host pipeline, an optional host<->storage pipeline over a backend, a write policy, a
prefetch stop policy and a :class:`~sglang_storage.managers.ranks.RankSync`. Pages are named
by their storage keys (``storage.keys.page_hashes``), under one ``kv_namespace``. Contract:

- ``match(keys, device_pages=)`` - per-tier hits of a prefix: pages on device (the caller
  knows), then ready on host, then in storage (agreed by every rank); counted in ``stats()``.
- ``device_hit(keys, tokens, side=)`` / ``device_evict(keys, tokens, side=)`` - the write
  policy decides which device pages are written to host now (a :class:`HostWrite` whose
  handle the caller fences before reusing device pages).
- Host pages that land are backed up to storage at once under the write-through policies;
  under ``write_back`` when ``evict_host`` evicts them.
- ``evict_host(keys)`` - give host pages back; a page with a backup in flight is freed only
  once its put is acknowledged (``HostReleased`` from ``poll()``).
- ``load(keys, tokens)`` - ready host pages to device pages, layer by layer (``layer_counter``).
- ``storage_hit_pages(keys)`` - how many leading pages storage holds with every part, MIN
  over ranks; a rank that does not answer makes it 0 on every rank.
- ``prefetch(rid, keys)`` / ``check_prefetch(rid)`` - storage to host under the stop policy;
  the agreed hit ends at the first page where KV or a side part is missing, corrupt or failed,
  and nothing past it is delivered.
- ``poll()`` - finished work as typed events; ``stats()`` - a frozen :class:`KVCacheStats`.

Side data (hybrid models: mamba/SWA state, indexer pages) lives in :class:`SidePool` objects: one
slot per KV page in each, written, backed up, prefetched and released with it as one unit.
Keys of side parts are the page key plus ``-<side name>``.

The manager is the key-addressed façade of the index-addressed
:class:`~sglang_storage.managers.controller.CacheController` (the core SGLang's HiCache
adapter drives): it owns which host slots hold which key, and every page it moves goes
through the core: device<->host copies, backups, hit queries and prefetch reads on the
core's one :class:`~sglang_storage.managers.pageio.HostPageIO`. It owns the pipelines it
is given (``poll()`` drains their completions), is driven from one thread and starts no
threads.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import attrs
import torch

from sglang_storage.config import instance_of, positive_int, positive_number
from sglang_storage.core import Namespace, ObjectKey, ObjectSpec
from sglang_storage.errors import CapacityError, ConfigError, StateError, StorageError
from sglang_storage.managers.controller import BackupEnded, CacheController, ControllerConfig
from sglang_storage.managers.pageio import PageOp
from sglang_storage.managers.ranks import RankSync, SingleRank
from sglang_storage.memory import KVHostPool, RecordPool, tensor_spec
from sglang_storage.policy import EvictAction, PrefetchStopPolicy, WritePolicy
from sglang_storage.transfer import (
    CopyDirection,
    DeviceHostPipeline,
    DeviceLoadHandle,
    DeviceTransferHandle,
    LayerDoneCounter,
    OpState,
    StoragePipeline,
)

__all__ = [
    "BackupDone",
    "HostLoad",
    "HostReleased",
    "HostWrite",
    "HostWriteDone",
    "KVCacheConfig",
    "KVCacheManager",
    "KVCacheStats",
    "KVEvent",
    "PrefetchDone",
    "SidePool",
    "TierHits",
]

_SIDE_NAME = re.compile(r"[a-z0-9_]{1,24}")


def _side_name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not _SIDE_NAME.fullmatch(value):
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="is not a side pool name",
            allowed="1-24 of a-z 0-9 _",
        )


@attrs.frozen(kw_only=True)
class KVCacheConfig:
    """Bounds of a :class:`KVCacheManager`; validated on construction.

    Backups run at ``Priority.BACKGROUND``; prefetches and hit queries at ``URGENT``.
    """

    rank_timeout_s: float = attrs.field(default=5.0, validator=positive_number)
    """How long a rank agreement waits for the other ranks before it is a miss on all."""
    exists_timeout_s: float = attrs.field(default=5.0, validator=positive_number)
    """How long a storage hit query waits for the backend before it counts as 0 pages."""
    prefetch_batch_pages: int = attrs.field(default=128, validator=positive_int)
    """Pages per prefetch get: a prefetch's progress is counted in these steps."""


@attrs.frozen(kw_only=True)
class SidePool:
    """Side data kept with every KV page: one ``pool`` slot (a page or a record) per page."""

    name: str = attrs.field(validator=_side_name)
    pool: KVHostPool | RecordPool = attrs.field(validator=instance_of(KVHostPool, RecordPool))

    @property
    def spec(self) -> ObjectSpec:
        """The stored object's spec of one slot."""
        if isinstance(self.pool, KVHostPool):
            return self.pool.page_spec
        c = self.pool.config
        return tensor_spec(c.dtype, c.shape)

    def views(self, slot: int) -> tuple[memoryview, ...]:
        """Writable byte views of one slot (what a get fills and a put stores)."""
        if isinstance(self.pool, KVHostPool):
            return self.pool.page_views(slot)
        # RecordPool has no byte-view accessor (unlike KVHostPool.page_views): view it here.
        return (self.pool.records[slot].reshape(-1).view(torch.uint8).numpy().data,)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` (one per slot) into ``slots``."""
        if isinstance(self.pool, KVHostPool):
            self.pool.write_pages(slots, rows.to("cpu"))
        else:
            self.pool.write(slots, rows.to("cpu"))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of ``slots``' rows."""
        if isinstance(self.pool, KVHostPool):
            return self.pool.read_pages(slots)
        return self.pool.read(slots)

    def pin(self, slots: torch.Tensor) -> None:
        """Keep ``slots`` from being freed while they move."""
        self.pool.pin(slots)

    def unpin(self, slots: torch.Tensor) -> None:
        """Undo one :meth:`pin` of ``slots``."""
        self.pool.unpin(slots)


@attrs.frozen(kw_only=True)
class TierHits:
    """Where the leading pages of a prefix are: device, then host, then storage."""

    device_pages: int
    host_pages: int
    storage_pages: int


@attrs.frozen(kw_only=True)
class HostWrite:
    """Device pages being written to host; ``handle.fence()`` before reusing them."""

    keys: tuple[str, ...]
    handle: DeviceTransferHandle


@attrs.frozen(kw_only=True, eq=False)
class HostLoad:
    """Host pages being loaded to device (layer by layer), and their side rows per side pool."""

    keys: tuple[str, ...]
    handle: DeviceLoadHandle
    side: Mapping[str, torch.Tensor]


@attrs.frozen(kw_only=True)
class HostWriteDone:
    """A device->host write ended; on failure its host pages were given back."""

    keys: tuple[str, ...]
    error: StorageError | None


@attrs.frozen(kw_only=True)
class BackupDone:
    """A host->storage backup ended: which pages are stored with every part, which failed."""

    stored: tuple[str, ...]
    failed: tuple[str, ...]


@attrs.frozen(kw_only=True)
class HostReleased:
    """Host pages given back after the transfers using them ended."""

    keys: tuple[str, ...]


@attrs.frozen(kw_only=True)
class PrefetchDone:
    """A prefetch ended: ``keys`` (a prefix of those asked) are ready on host; 0 is a miss."""

    request_id: str
    keys: tuple[str, ...]
    requested_pages: int
    agreed: bool
    """False when the ranks did not agree in time (then ``keys`` is empty)."""


KVEvent: TypeAlias = HostWriteDone | BackupDone | HostReleased


@attrs.frozen(kw_only=True)
class KVCacheStats:
    """Counts since the manager was built, and host pages held now."""

    device_hit_pages: int = 0
    host_hit_pages: int = 0
    storage_hit_pages: int = 0
    host_pages: int = 0
    written_pages: int = 0
    loaded_pages: int = 0
    backed_up_pages: int = 0
    backup_failed_pages: int = 0
    prefetched_pages: int = 0
    prefetch_truncated_pages: int = 0
    """Pages that arrived but were not delivered: a part was missing, corrupt or failed."""
    dropped_pages: int = 0
    """Host pages evicted with no copy below (their data left the cache)."""
    rank_misses: int = 0
    """Operations turned into misses because the ranks did not agree in time."""


@attrs.define
class _Page:
    slots: tuple[int, ...]  # KV host page, then one slot per side pool
    ready: bool = False
    backed_up: bool = False
    backing_up: bool = False
    release: bool = False
    busy: int = 0  # transfers using the slots


@attrs.define
class _Prefetch:
    keys: tuple[str, ...]
    slots: list[tuple[int, ...]]
    reads: list[tuple[PageOp, int, int]]  # (read, first page, pages)
    started_at: float | None = None


def _succeeded(read: PageOp) -> bool:
    """Whether a read ended done (not failed or cancelled)."""
    return read.handle is not None and read.handle.state is OpState.DONE


class KVCacheManager:
    """HiCache's tiers over typed pools, pipelines and policies; see the module contract.

    Args:
        host: The host tier.
        device: Moves pages between the device pool and ``host``.
        storage: Moves pages between host pools and the backend; None for no storage tier.
        namespace: Where this rank's pages are stored (``storage.keys.kv_namespace``).
        write_policy: When pages are written down a tier.
        prefetch_policy: When a waiting prefetch stops; its page size must be the host's.
        ranks: Agreement with the other ranks sharing the cache.
        side_pools: Side data committed and restored with every KV page.
        config: Bounds.
    """

    def __init__(
        self,
        *,
        host: KVHostPool,
        device: DeviceHostPipeline,
        storage: StoragePipeline | None,
        namespace: Namespace,
        write_policy: WritePolicy,
        prefetch_policy: PrefetchStopPolicy,
        ranks: RankSync | None = None,
        side_pools: Sequence[SidePool] = (),
        config: KVCacheConfig | None = None,
    ) -> None:
        self._page_size = host.geometry.page_size
        if prefetch_policy.page_size != self._page_size:
            raise ConfigError(
                owner="KVCacheManager",
                field="prefetch_policy",
                value=prefetch_policy.page_size,
                reason=f"has another page size than the host pool ({self._page_size})",
            )
        if len({s.name for s in side_pools}) != len(side_pools):
            raise ConfigError(owner="KVCacheManager", field="side_pools", reason="names repeat")
        self._host, self._device, self._storage = host, device, storage
        self._ns, self._write, self._stop = namespace, write_policy, prefetch_policy
        self._ranks: RankSync = ranks if ranks is not None else SingleRank()
        self._sides = tuple(side_pools)
        self._pools = (host, *(s.pool for s in side_pools))
        self._config = config if config is not None else KVCacheConfig()
        self._pages: dict[str, _Page] = {}
        self._releasing: dict[str, None] = {}  # ordered set: pages to free once not busy
        self._device_hits: dict[str, int] = {}
        self._device_ops: dict[int, tuple[DeviceTransferHandle, tuple[str, ...]]] = {}
        self._puts: dict[int, tuple[str, ...]] = {}  # core backup id -> its keys
        self._orphans: list[tuple[PageOp, list[tuple[int, ...]]]] = []
        self._core = CacheController(
            host=host,
            device=device,
            storage=storage,
            sides=self._sides,
            ranks=self._ranks,
            config=ControllerConfig(
                rank_timeout_s=self._config.rank_timeout_s,
                exists_timeout_s=self._config.exists_timeout_s,
                read_batch_pages=self._config.prefetch_batch_pages,
            ),
        )
        self._prefetches: dict[str, _Prefetch] = {}
        self._counts: Counter[str] = Counter()

    @property
    def backups_in_flight(self) -> int:
        """Backups started and not yet acknowledged by :meth:`poll`."""
        return len(self._puts)

    @property
    def layer_counter(self) -> LayerDoneCounter:
        """What the forward pass waits on for layer-wise loads."""
        return self._device.layer_counter

    # ------------------------------------------------------------------ queries

    def match(self, keys: Sequence[str], *, device_pages: int = 0) -> TierHits:
        """Per-tier hits of the prefix ``keys`` whose first ``device_pages`` are on device."""
        host = self.host_hit_pages(keys[device_pages:])
        # Every rank asks storage, even with nothing left, so agreements stay in step.
        storage = self.storage_hit_pages(keys[device_pages + host :])
        hits = TierHits(device_pages=device_pages, host_pages=host, storage_pages=storage)
        self._counts.update(
            device_hit_pages=device_pages, host_hit_pages=host, storage_hit_pages=storage
        )
        return hits

    def host_hit_pages(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are ready on host with every part."""
        count = 0
        for key in keys:
            page = self._pages.get(key)
            if page is None or not page.ready or page.release:
                break
            count += 1
        return count

    def storage_hit_pages(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` storage holds with every part, agreed (MIN) by every rank.

        A backend that fails or does not answer within ``exists_timeout_s`` counts as 0
        pages on this rank, a rank that does not answer in time as 0 pages on every rank.
        """
        if self._storage is None:  # the same on every rank: nothing to agree on
            return 0
        local = self._core.local_hit_pages([self._keys(key) for key in keys])
        return self._agree("storage_hit", local) or 0

    # ------------------------------------------------------------------ device -> host

    def device_hit(
        self,
        keys: Sequence[str],
        device_tokens: torch.Tensor,
        *,
        side: Mapping[str, torch.Tensor] | None = None,
    ) -> HostWrite | None:
        """Count a hit on device pages; write those the write policy picks to host now.

        Args:
            keys: The pages' keys.
            device_tokens: Their token indices on device, ``page_size`` per page.
            side: Every side pool's rows for these pages (needed when a write starts).

        Hit counts are kept per key until the page is written or ``device_evict`` forgets it.

        Raises:
            CapacityError: host memory is short; nothing was written.
            ConfigError: bad tokens, or ``side`` misses a side pool.
        """
        chosen = []
        for i, key in enumerate(keys):
            decision = self._write.on_hit(
                self._device_hits.get(key, 0), backed_up=key in self._pages
            )
            self._device_hits[key] = decision.hit_count
            if decision.write:
                chosen.append(i)
        return self._write_pages(keys, device_tokens, side, chosen)

    def device_evict(
        self,
        keys: Sequence[str],
        device_tokens: torch.Tensor,
        *,
        side: Mapping[str, torch.Tensor] | None = None,
    ) -> HostWrite | None:
        """Device pages are being evicted: write back those the write policy keeps (write_back).

        Arguments and errors as for :meth:`device_hit`.
        """
        chosen = [
            i
            for i, key in enumerate(keys)
            if self._write.on_evict(backed_up=key in self._pages) is EvictAction.WRITE_BACK
        ]
        write = self._write_pages(keys, device_tokens, side, chosen)
        for key in keys:
            self._device_hits.pop(key, None)
        return write

    def _write_pages(
        self,
        keys: Sequence[str],
        tokens: torch.Tensor,
        side: Mapping[str, torch.Tensor] | None,
        chosen: list[int],
    ) -> HostWrite | None:
        if not chosen:
            return None
        if self._sides and (side is None or set(side) != {s.name for s in self._sides}):
            raise ConfigError(
                owner="KVCacheManager",
                field="side",
                value=None if side is None else sorted(side),
                reason="must give rows of every side pool",
                allowed=", ".join(s.name for s in self._sides),
            )
        index = torch.tensor(chosen, dtype=torch.int64)
        page_tokens = tokens.reshape(len(keys), self._page_size)
        slots = self._alloc(len(chosen))
        try:
            for n, s in enumerate(self._sides):
                assert side is not None
                s.write(slots[n + 1], side[s.name].index_select(0, index.to(side[s.name].device)))
            handle = self._core.offload(
                slots[0], page_tokens.index_select(0, index.to(tokens.device)).reshape(-1)
            )
        except BaseException:
            self._free(slots)
            raise
        written = tuple(keys[i] for i in chosen)
        for i, key in enumerate(written):
            self._device_hits.pop(key, None)
            self._pages[key] = _Page(slots=tuple(int(t[i]) for t in slots), busy=1)
        self._device_ops[handle.transfer_id] = (handle, written)
        return HostWrite(keys=written, handle=handle)

    # ------------------------------------------------------------------ host -> device

    def load(self, keys: Sequence[str], device_tokens: torch.Tensor) -> HostLoad:
        """Load ready host pages into device pages, layer by layer.

        Raises:
            StateError: a key is not ready on host.
        """
        if self.host_hit_pages(keys) < len(keys):
            raise StateError(subject="KVCacheManager.load", reason="a key is not ready on host")
        pages = [self._pages[k] for k in keys]
        columns = self._columns([p.slots for p in pages])
        handle = self._core.load(columns[0], device_tokens)
        for p in pages:
            p.busy += 1
        self._device_ops[handle.transfer_id] = (handle, tuple(keys))
        side = {s.name: s.read(columns[n + 1]) for n, s in enumerate(self._sides)}
        return HostLoad(keys=tuple(keys), handle=handle, side=side)

    # ------------------------------------------------------------------ host tier

    def evict_host(self, keys: Sequence[str]) -> None:
        """Give host pages back, per the write policy; see ``HostReleased`` from ``poll()``.

        A backed-up page is freed; one whose backup is in flight, once it is acknowledged;
        under ``write_back`` one without a backup is backed up first; otherwise it is dropped.
        """
        backup = []
        for key in keys:
            page = self._pages.get(key)
            if page is None or page.release:
                continue
            page.release = True
            self._releasing[key] = None
            if page.backed_up or page.backing_up or not page.ready:
                continue  # freed after the ack, or decided when its write lands (poll)
            if self._write.on_evict(backed_up=False) is EvictAction.WRITE_BACK:
                backup.append(key)
            else:
                self._counts["dropped_pages"] += 1
        self._backup(backup)

    def _backup(self, keys: Sequence[str]) -> None:
        pages = [self._pages[k] for k in keys]
        if not keys or self._storage is None:  # no tier below: evicted pages are lost
            self._counts["dropped_pages"] += sum(p.release for p in pages)
            return
        rows = torch.tensor([p.slots for p in pages], dtype=torch.int64)
        backup = self._core.backup([self._keys(k) for k in keys], rows)
        for p in pages:
            p.busy, p.backing_up = p.busy + 1, True
        self._puts[backup] = tuple(keys)

    # ------------------------------------------------------------------ storage -> host

    def prefetch(self, request_id: str, keys: Sequence[str]) -> bool:
        """Start reading ``keys`` (not on host) from storage into host pages.

        Every rank starts the prefetch or none does: False, starting nothing, when there is
        no storage, the policy does not admit it, or host memory is short on some rank. A
        page whose get the pipeline refuses is not delivered (the hit ends before it).
        """
        n, columns = len(keys), None
        if self._storage is None or request_id in self._prefetches:
            return False
        if self._stop.admits(n * self._page_size):
            with contextlib.suppress(CapacityError):
                columns = self._alloc(n)
        if self._agree("prefetch_start", int(columns is not None)) != 1:
            self._free(columns or [])
            return False
        assert columns is not None
        slots = [tuple(int(c[i]) for c in columns) for i in range(n)]
        op = _Prefetch(keys=tuple(keys), slots=slots, reads=[])
        step, io = self._config.prefetch_batch_pages, self._core.page_io
        assert io is not None  # a storage pipeline was given
        for first in range(0, n, step):
            last = min(first + step, n)
            read = io.get(
                [self._keys(k) for k in keys[first:last]],
                torch.tensor(slots[first:last], dtype=torch.int64),
            )
            if read.handle is None:  # refused: the hit ends before this batch
                break
            op.reads.append((read, first, last - first))
        self._prefetches[request_id] = op
        return True

    def check_prefetch(self, request_id: str) -> PrefetchDone | None:
        """End the prefetch when the stop policy (on any rank) says so; None while it waits.

        Every rank sharing the cache calls this for the same request at the same step.

        Raises:
            StateError: no prefetch of ``request_id`` is in progress.
        """
        op = self._prefetches.get(request_id)
        if op is None:
            raise StateError(subject=f"prefetch {request_id!r}", reason="is not in progress")
        landed = 0
        for read, _, pages in op.reads:
            if not _succeeded(read):
                break
            landed += pages
        finished = all(r.done() for r, _, _ in op.reads)
        if op.started_at is None:
            op.started_at = self._stop.now()
        decision = self._stop.decide(
            started_at=op.started_at,
            n_tokens=len(op.keys) * self._page_size,
            completed_tokens=landed * self._page_size,
            finished=finished,
        )
        go_on = self._agree("prefetch_stop", 0 if decision.terminate else 1)
        if go_on == 1:
            return None
        del self._prefetches[request_id]
        valid = self._valid_prefix(op)
        hit = None if go_on is None else self._agree("prefetch_hit", valid)
        delivered = 0 if hit is None else hit
        for read, _, _ in op.reads:  # what is delivered or freed here is no longer read into
            if read.done():
                read.collect()
        for i, (key, slots) in enumerate(zip(op.keys[:delivered], op.slots, strict=False)):
            page = self._pages.get(key)
            if page is None:
                self._pages[key] = _Page(slots=slots, ready=True, backed_up=True)
            elif not page.release:  # written meanwhile: keep that copy
                self._free_rows([slots])
            elif page.ready:  # on its way out but intact: wanted again, so it stays
                page.release = False
                self._releasing.pop(key, None)
                self._free_rows([slots])
            else:  # a failed write being dropped; its slots are not ours to reuse yet
                delivered = i
                break
            op.slots[i] = ()
        self._counts.update(
            prefetched_pages=delivered, prefetch_truncated_pages=max(0, landed - valid)
        )
        self._abandon(op)
        return PrefetchDone(
            request_id=request_id,
            keys=op.keys[:delivered],
            requested_pages=len(op.keys),
            agreed=hit is not None,
        )

    def _valid_prefix(self, op: _Prefetch) -> int:
        valid = 0
        for read, _, _ in op.reads:
            if not _succeeded(read):
                return valid
            for ok in read.page_ok():
                if not ok:
                    return valid
                valid += 1
        return valid

    def _abandon(self, op: _Prefetch) -> None:
        """Free the slots of ``op`` not delivered, each once its get is terminal."""
        for read, first, pages in op.reads:
            slots = [s for s in op.slots[first : first + pages] if s]
            read.cancel()
            if read.done():
                read.collect()
                self._free_rows(slots)
            else:
                self._orphans.append((read, slots))
        covered = sum(pages for _, _, pages in op.reads)
        self._free_rows([s for s in op.slots[covered:] if s])

    # ------------------------------------------------------------------ completions

    def poll(self) -> list[KVEvent]:
        """Collect finished transfers: land writes, start backups, acknowledge, release."""
        events: list[KVEvent] = []
        for result in self._device.poll():  # collected: the host pages are unpinned now
            _, keys = self._device_ops.pop(result.transfer_id)
            pages = [self._pages[k] for k in keys]
            for p in pages:
                p.busy -= 1
            if result.direction is CopyDirection.LOAD:
                self._counts["loaded_pages"] += len(keys) if result.ok else 0
                continue
            events.append(HostWriteDone(keys=keys, error=result.error))
            for k, p in zip(keys, pages, strict=True):
                p.ready, p.release = result.ok, p.release or not result.ok
                if p.release:
                    self._releasing[k] = None
            if result.ok:
                # Write-through backs up what stays; write_back what was evicted meanwhile.
                through = self._write.threshold is not None
                self._counts["written_pages"] += len(keys)
                self._counts["dropped_pages"] += through * sum(p.release for p in pages)
                self._backup([k for k, p in zip(keys, pages, strict=True) if p.release != through])
        events.extend(
            self._acknowledge(self._puts.pop(event.backup_id), event.page_ok)
            for event in self._core.poll()
            if isinstance(event, BackupEnded)
        )
        ended = [(read, slots) for read, slots in self._orphans if read.done()]
        self._orphans = [entry for entry in self._orphans if entry not in ended]
        for read, slots in ended:
            read.collect()
            self._free_rows(slots)
        released = tuple(k for k in self._releasing if self._pages[k].busy == 0)
        for key in released:
            del self._releasing[key]
        self._free_rows([self._pages.pop(key).slots for key in released])
        if released:
            events.append(HostReleased(keys=released))
        return events

    def _acknowledge(self, keys: tuple[str, ...], page_ok: Sequence[bool]) -> BackupDone:
        stored: list[str] = []
        failed: list[str] = []
        for key, ok in zip(keys, page_ok, strict=True):
            page = self._pages[key]
            page.busy, page.backing_up, page.backed_up = page.busy - 1, False, ok
            (stored if ok else failed).append(key)
            self._counts["dropped_pages"] += page.release and not ok
        self._counts.update(backed_up_pages=len(stored), backup_failed_pages=len(failed))
        return BackupDone(stored=tuple(stored), failed=tuple(failed))

    def stats(self) -> KVCacheStats:
        """Per-tier hits and transfer counts so far, and host pages held now."""
        return KVCacheStats(host_pages=len(self._pages), **self._counts)

    # ------------------------------------------------------------------ helpers

    def _agree(self, op: str, value: int) -> int | None:
        agreed = self._ranks.agree_min(op, value, timeout_s=self._config.rank_timeout_s)
        self._counts["rank_misses"] += agreed is None
        return agreed

    def _keys(self, key: str) -> tuple[ObjectKey, ...]:
        """The object keys of a page: its KV page, then each side part."""
        return (self._ns.key(key), *(self._ns.key(f"{key}-{s.name}") for s in self._sides))

    def _alloc(self, n: int) -> list[torch.Tensor]:
        """``n`` slots of the KV pool and of each side pool, all or none."""
        got: list[torch.Tensor] = []
        try:
            got.extend(pool.alloc(n) for pool in self._pools)
        except BaseException:
            self._free(got)
            raise
        return got

    def _free(self, columns: Sequence[torch.Tensor]) -> None:
        for pool, column in zip(self._pools, columns, strict=False):
            pool.free(column)

    def _columns(self, rows: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """Per-page slot tuples as one slot tensor per pool."""
        return [
            torch.tensor([r[n] for r in rows], dtype=torch.int64) for n in range(len(self._pools))
        ]

    def _free_rows(self, rows: Sequence[tuple[int, ...]]) -> None:
        if rows:
            self._free(self._columns(rows))
