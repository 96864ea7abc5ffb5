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
- ``offload_layer(request_id, layer, positions, rows)`` - write one layer's KV of
  ``positions`` straight to the host (new positions extend the request); per layer, the
  first write of a position must follow the positions already written on that layer.
- ``materialize_layer(request_id, layer, positions, window=, out=)`` - one layer's KV of
  the selected positions into ``out``: those the previous call for this layer left in the
  caller's per-layer device ``window`` are hits (copied from it), the others are read from
  the host; the window then holds this selection.
- ``read_layer_prefix(request_id, layer, count, out=)`` - one layer's KV of the first
  ``count`` tokens, read from the host (a prefill's whole prefix).
- ``poll(timeout_s)`` - finished storage work and device copy failures, as
  :data:`SparseEvent` values. Backups and restores go through a
  :class:`~sglang_storage.managers.pageio.HostPageIO`: their host pages stay pinned until
  ``poll`` collects them.

Host backing is a :class:`~sglang_storage.memory.KVHostPool` with ``page_size=1`` (a page is
one token) rather than a ``RecordPool``: the device<->host pipeline moves exactly such pages
(async streams, layer events, SGLang's transfer kernels), in SGLang's host layouts, and the
pool hands out the page views a zero-copy storage request needs.

Two ways to drive a request, not mixed: token-wise (``append`` / ``evict`` / ``prefetch``,
every layer of a token at once through the device pipeline; HiSparse) or layer-wise
(``offload_layer`` / ``materialize_layer`` / ``read_layer_prefix``, the NPU sparse path:
every layer written to the host as it is computed, read back per layer with its own top-k;
MLA pools only, and no device pipeline is needed). A layer-wise request backs up the
tokens written on every layer; a restored request can be driven either way.

Faults: a failed device->host copy loses the tokens it carried once they leave the device
(:class:`TokensLost`; prefetching them is a :class:`StateError`, never stale bytes); a
failed load leaves its tokens non-resident; storage failures are reported, never retried.
Locking: not thread-safe; one thread drives it. It owns its pipelines' results.
"""

from __future__ import annotations

import math
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
    "LayerFill",
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
class LayerFill:
    """What :meth:`SparseKVManager.materialize_layer` copied into ``out``.

    ``hits``: selected tokens copied from the request's device window (the previous
    selection of this layer); ``misses``: tokens read from the host.
    """

    hits: int
    misses: int


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
    written: Positions  # layer -> tokens written on the host (layer-wise and restored)
    length: int = 0
    layered: bool = False  # driven layer-wise (offload_layer)
    window: Positions | None = None  # [layer, device_slots] -> position in the window, or -1
    storage: PageOp | None = None  # a backup or a restore in flight (its pages pinned)
    restoring: bool = False  # ``storage`` is a restore
    released: bool = False  # dropped while ``storage`` was in flight


class SparseKVManager:
    """Per-request device token buffers backed by host pages, with top-k prefetch.

    Args:
        host: The host pool; ``page_size`` must be 1 (a page is a token).
        device: The pipeline between the device pool (``max_requests * device_slots``
            tokens, page size 1) and ``host``; None for a manager driven layer-wise only
            (then ``append``, ``evict`` and ``prefetch`` raise :class:`StateError`).
        config: Slots, limits, storage priority.
        storage: The host<->storage pipeline for backup and restore (optional).
        namespace: Where backed-up tokens are stored (required with ``storage``).
        eviction: Makes each request's policy over its resident tokens (default LRU).
    """

    def __init__(
        self,
        *,
        host: KVHostPool,
        device: DeviceHostPipeline | None = None,
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
            written=np.zeros(self._host.geometry.layer_num, dtype=np.int64),
        )

    def append(self, request_id: str, count: int) -> torch.Tensor:
        """Device token indices for the request's next ``count`` tokens, now resident.

        Raises:
            ConfigError: more than ``device_slots`` or past ``max_tokens``.
        """
        r = self._token_wise(request_id, "append")
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
        r = self._token_wise(request_id, "evict")
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
        r = self._token_wise(request_id, "prefetch")
        device = self._pipeline("prefetch")
        self._collect(device.poll())
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
                load = device.load(torch.from_numpy(r.host[misses]), free + r.base)
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
        complete = r.length
        if r.layered:  # only tokens written on every layer are whole
            complete = min(r.length, int(r.written.min()))
        else:
            self.evict(request_id, self.resident(request_id))
        if self._device is not None:
            self._collect(self._device.drain())  # the put reads what the copies wrote
        keys = page_hashes(list(token_ids), 1, seed)
        pages = r.host[:complete].tolist()
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
        if self._device is not None and self._device.in_flight:
            self._collect(self._device.drain())  # pinned host pages cannot be freed
        self._forget(r)

    # ------------------------------------------------------------------ layer-wise

    def offload_layer(
        self,
        request_id: str,
        layer: int,
        positions: Sequence[int] | torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Write layer ``layer``'s KV of ``positions`` to the host; ``rows[i]`` is ``positions[i]``.

        ``rows`` is ``[n, head_num, head_dim]`` of the pool's dtype, on any device.
        Positions already written on this layer are overwritten; the others must be the
        next ones of this layer (no gaps); positions past the request's length extend it.

        Raises:
            ConfigError: a repeated or out-of-range position, a gap, a wrong row shape or
                dtype, a layer out of range, or a non-MLA host pool.
            StateError: the request has tokens in its device buffer (it is driven
                token-wise) or is busy with a backup or restore.
            CapacityError: no host pages for the new tokens (nothing changes).
        """
        r, view = self._layer_wise(request_id, layer, "offload_layer")
        if r.slots.free_count != self._config.device_slots:
            raise StateError(
                subject=f"sparse KV {request_id!r}",
                reason="has tokens in its device buffer (driven token-wise): write them "
                "with append, not offload_layer",
            )
        wanted = self._layer_positions(positions, self._config.max_tokens, "offload_layer")
        done = int(r.written[layer])
        new = np.sort(wanted[wanted >= done])
        if not np.array_equal(new, np.arange(done, done + new.size)):
            reason = f"positions not yet written on layer {layer} must continue at {done}"
            raise _refuse("offload_layer", "positions", new[:8].tolist(), reason)
        data = self._layer_rows(rows, wanted.size, "offload_layer", "rows")
        end = done + new.size
        if end > r.length:
            pages = self._host.alloc(end - r.length)
            r.host[r.length : end] = pages.numpy()
            r.length = end
        index = torch.from_numpy(r.host[wanted])
        view.index_copy_(0, index, data.to("cpu"))
        r.written[layer] = end
        r.layered = True

    def materialize_layer(
        self,
        request_id: str,
        layer: int,
        positions: Sequence[int] | torch.Tensor,
        *,
        window: torch.Tensor,
        out: torch.Tensor,
    ) -> LayerFill:
        """Fill ``out[i]`` with layer ``layer``'s KV of ``positions[i]``; see :class:`LayerFill`.

        ``window`` is the request's device window of this layer (``[device_slots,
        head_num, head_dim]``, the same tensor every call for this request and layer):
        positions the previous call left there are copied from it, the others from the
        host; then ``window[i]`` holds ``out[i]`` and the window remembers ``positions``.
        ``out`` has at least ``len(positions)`` rows, on ``window``'s device; rows past
        them are left as they are.

        Raises:
            ConfigError: a repeated position, more than ``device_slots``, a position not
                written on this layer, or a wrong ``window`` / ``out`` shape or dtype.
            StateError: a selected token was lost, or the request is busy.
        """
        r, view = self._layer_wise(request_id, layer, "materialize_layer")
        slots = self._config.device_slots
        wanted = self._layer_positions(positions, int(r.written[layer]), "materialize_layer")
        if wanted.size > slots:
            reason = f"at most device_slots ({slots})"
            raise _refuse("materialize_layer", "positions", wanted.size, reason)
        self._layer_rows(window, slots, "materialize_layer", "window")
        n = wanted.size
        target = self._layer_rows(out, n, "materialize_layer", "out", at_least=True)
        if r.window is None:
            r.window = np.full((self._host.geometry.layer_num, slots), -1, dtype=np.int64)
        held = r.window[layer]
        filled = np.flatnonzero(held >= 0)
        order = np.argsort(held[filled], kind="stable")
        known = held[filled][order]
        at = np.minimum(np.searchsorted(known, wanted), max(known.size - 1, 0))
        hit = known[at] == wanted if known.size else np.zeros(n, dtype=bool)
        misses = wanted[~hit]
        if misses.size and bool((r.host[misses] < 0).any()):
            lost = misses[r.host[misses] < 0][:8].tolist()
            raise StateError(
                subject=f"sparse KV {request_id!r}", reason=f"tokens {lost} have no host copy"
            )
        device = window.device
        if hit.any():
            source = torch.from_numpy(filled[order[at[hit]]]).to(device)
            rows = window.index_select(0, source)
            target.index_copy_(0, torch.from_numpy(np.flatnonzero(hit)).to(device), rows)
        if misses.size:
            pages = torch.from_numpy(r.host[misses])
            rows = view.index_select(0, pages)
            miss_rows = torch.from_numpy(np.flatnonzero(~hit)).to(device)
            target.index_copy_(0, miss_rows, rows.to(device))
        window.narrow(0, 0, n).copy_(target.narrow(0, 0, n))
        held[:] = -1
        held[:n] = wanted
        return LayerFill(hits=int(hit.sum()), misses=int(misses.size))

    def read_layer_prefix(
        self, request_id: str, layer: int, count: int, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Layer ``layer``'s KV of the request's first ``count`` tokens, read from the host.

        Returns ``[count, head_num, head_dim]``: ``out`` (any device) filled, or a new
        host tensor.

        Raises:
            ConfigError: ``count`` is more than the tokens written on this layer, or
                ``out`` has the wrong shape or dtype.
            StateError: one of the tokens was lost, or the request is busy.
        """
        r, view = self._layer_wise(request_id, layer, "read_layer_prefix")
        written = int(r.written[layer])
        if not 0 <= count <= written:
            reason = f"must be 0..{written} (the tokens written on layer {layer})"
            raise _refuse("read_layer_prefix", "count", count, reason)
        pages = r.host[:count]
        if bool((pages < 0).any()):
            lost = np.flatnonzero(pages < 0)[:8].tolist()
            raise StateError(
                subject=f"sparse KV {request_id!r}", reason=f"tokens {lost} have no host copy"
            )
        rows = view.index_select(0, torch.from_numpy(pages))
        if out is None:
            return rows
        target = self._layer_rows(out, count, "read_layer_prefix", "out")
        target.copy_(rows)
        return target

    # ------------------------------------------------------------------ completions

    @property
    def busy(self) -> bool:
        """Whether a backup or restore is in flight."""
        return bool(self._storage_ops)

    def poll(self, timeout_s: float = 0.0) -> list[SparseEvent]:
        """Collect finished copies and storage work; return what happened, in order."""
        if self._device is not None:
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

    def _pipeline(self, op: str) -> DeviceHostPipeline:
        if self._device is None:
            raise StateError(
                subject=f"SparseKVManager.{op}",
                reason="this manager has no device pipeline (it is driven layer-wise)",
            )
        return self._device

    def _token_wise(self, request_id: str, op: str) -> _Request:
        r = self._ready(request_id)
        self._pipeline(op)
        if r.layered:
            raise StateError(
                subject=f"sparse KV {request_id!r}",
                reason=f"is driven layer-wise (offload_layer); {op} moves every layer at once",
            )
        return r

    def _layer_wise(self, request_id: str, layer: int, op: str) -> tuple[_Request, torch.Tensor]:
        """The request and the host pool's ``(pages, head_num, head_dim)`` view of ``layer``."""
        g = self._host.geometry
        if not g.is_mla:
            reason = "the layer-wise API serves MLA host pools"
            raise _refuse(op, "host", g.attention.value, reason)
        r = self._ready(request_id)
        view = self._host.layer(layer).k  # ConfigError for a layer out of range
        return r, view.view(g.num_pages, g.head_num, g.head_dim)

    def _layer_positions(
        self, positions: Sequence[int] | torch.Tensor, limit: int, op: str
    ) -> Positions:
        raw = positions.cpu().numpy() if isinstance(positions, torch.Tensor) else positions
        wanted = np.asarray(raw, dtype=np.int64).reshape(-1)
        if wanted.size and (wanted.min() < 0 or wanted.max() >= limit):
            bad = wanted[(wanted < 0) | (wanted >= limit)][:8].tolist()
            raise _refuse(op, "positions", bad, f"must be 0..{limit - 1}")
        if np.unique(wanted).size != wanted.size:
            raise _refuse(op, "positions", wanted[:8].tolist(), "must be distinct")
        return wanted

    def _layer_rows(
        self, rows: torch.Tensor, n: int, op: str, field: str, *, at_least: bool = False
    ) -> torch.Tensor:
        """``rows`` as ``[n, head_num, head_dim]`` of the pool's dtype, or a ConfigError.

        Output tensors (``at_least`` or an ``out``) must have that shape; input rows may
        have any row shape of ``head_num * head_dim`` elements.
        """
        g = self._host.geometry
        shape = (g.head_num, g.head_dim)
        output = field != "rows"
        fits = (
            rows.dtype == g.dtype
            and rows.dim() >= 1
            and (rows.shape[0] >= n if at_least else rows.shape[0] == n)
            and (
                tuple(rows.shape[1:]) == shape
                if output
                else math.prod(rows.shape[1:]) == g.head_num * g.head_dim
            )
        )
        if not fits:
            got = (tuple(rows.shape), rows.dtype)
            want = f"{'at least ' if at_least else ''}{n} rows of {shape} {g.dtype}"
            raise _refuse(op, field, got, f"must be {want}")
        return rows if output else rows.reshape(rows.shape[0], *shape)

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
                device = self._pipeline("evict")
                handle = device.offload(pages, torch.from_numpy(r.device[dirty] + r.base))
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
            r.written[:] = found
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
