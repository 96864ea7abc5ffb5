"""Decode-side request offload: a decoding request's KV goes to storage in strides.

The decode side of PD disaggregation keeps no cache; what it decodes is written through
to storage for later requests with the same prefix (SGLang's ``DecodeKVCacheOffloadManager``,
map section 3). Contract, one line per primitive:

- ``start(request_id, token_ids, stored_tokens=, seed=)`` - track a request; its first
  ``stored_tokens`` (whole pages, written by the prefill side) are not offloaded again but
  seed the key chain.
- ``on_decoded(request_id, token_ids, device_pages)`` - the request's KV grew by
  ``token_ids``; every whole stride of full pages not yet offloaded is copied device->host
  now (one D2H transfer per call). Returns the pages submitted.
- ``finish(request_id)`` - no more tokens; once its copies have landed, the request's host
  pages are backed up to storage under SGLang's page keys.
- ``abort(request_id)`` - drop the request; nothing more is stored.
- ``poll(timeout_s)`` - collect finished copies and backups and return what happened as
  :data:`DecodeEvent` values. Host pages are freed only here: on a backup's completion,
  done or failed, all of the request's pages at once, never while a transfer uses them
  (backups go through a :class:`~sglang_storage.managers.pageio.HostPageIO`, which pins
  their pages until the backup is collected here).
- ``stats()`` - counts, as :class:`DecodeOffloadStats`.

Failures: a failed D2H copy ends the request's offload there (later pages are not stored,
their keys would chain through a hole) and is reported as :class:`OffloadFailed`; a backup
that fails (or stores only some pages) is retried up to ``max_retries`` times, then reported
as :class:`BackupFailed`. Keys name content, so a stored page is never wrong.

Locking: not thread-safe; call every method from the scheduler thread. The manager owns
its two pipelines' results: nobody else may call their ``poll()`` / ``completions()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from sglang_storage.config import instance_of, int_in_range, optional, positive_int, positive_number
from sglang_storage.core import Namespace
from sglang_storage.errors import CapacityError, ConfigError, StateError, StorageError
from sglang_storage.managers.pageio import HostPageIO, PageOp
from sglang_storage.memory import KVHostPool
from sglang_storage.storage.keys import page_hashes
from sglang_storage.transfer import DeviceHostPipeline, Priority, StoragePipeline
from sglang_storage.transfer.device_kv import as_index_tensor

__all__ = [
    "BackupDone",
    "BackupFailed",
    "DecodeEvent",
    "DecodeOffloadConfig",
    "DecodeOffloadManager",
    "DecodeOffloadStats",
    "DeviceReleased",
    "OffloadFailed",
]

_OWNER = "DecodeOffloadManager"


@attrs.frozen(kw_only=True)
class DecodeOffloadConfig:
    """How a :class:`DecodeOffloadManager` offloads; validated on construction."""

    stride_pages: int = attrs.field(default=1, validator=positive_int)
    """Full pages per offload step (SGLang: ``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE`` in pages)."""
    max_retries: int = attrs.field(default=0, validator=int_in_range(0, 16))
    """Times a failed backup is resubmitted before it is reported failed."""
    priority: Priority = attrs.field(default=Priority.BACKGROUND, validator=instance_of(Priority))
    """Storage priority of backups (nobody waits for them)."""
    deadline_s: float | None = attrs.field(default=None, validator=optional(positive_number))
    """Storage deadline of each backup (``None``: the pipeline's default)."""


@attrs.frozen(kw_only=True)
class OffloadFailed:
    """A D2H copy of the request failed; pages from there on are not offloaded."""

    request_id: str
    pages: int
    error: StorageError


@attrs.frozen(kw_only=True)
class DeviceReleased:
    """The finished (or aborted) request's copies have all landed: its device KV may be freed."""

    request_id: str
    pages: int
    """Pages copied to host."""


@attrs.frozen(kw_only=True)
class BackupDone:
    """Every offloaded page of the request is in storage; its host pages are free."""

    request_id: str
    pages: int
    attempts: int


@attrs.frozen(kw_only=True)
class BackupFailed:
    """The backup gave up; ``stored`` of ``pages`` reached storage; host pages are free."""

    request_id: str
    pages: int
    stored: int
    error: StorageError


DecodeEvent = OffloadFailed | DeviceReleased | BackupDone | BackupFailed
"""What :meth:`DecodeOffloadManager.poll` reports."""


@attrs.frozen(kw_only=True)
class DecodeOffloadStats:
    """A snapshot of the manager's counts."""

    requests: int
    host_pages: int
    """Host pages held (copied or being copied, not yet backed up)."""
    offloaded_pages: int
    stored_pages: int
    failed_backups: int
    deferred: int
    """Offload steps put off because the host pool was full."""


@attrs.define
class _Stride:
    transfer_id: int
    host_pages: torch.Tensor
    keys: list[str]
    ok: bool | None = None  # None while the copy is in flight


@attrs.define
class _Request:
    tokens: list[int]
    next_page: int
    last_hash: str | None
    strides: list[_Stride] = attrs.Factory(list)
    finished: bool = False
    aborted: bool = False
    released: bool = False
    broken: bool = False
    backup: PageOp | None = None
    attempts: int = 0


class DecodeOffloadManager:
    """Offloads decoding requests' KV stride by stride and backs it up on finish.

    Args:
        host: The host pool pages are staged in (its page size is the device's).
        device: The device<->host pipeline that copies pages out of the device pool.
        storage: The host<->storage pipeline the backups go through.
        namespace: Where the pages are stored (see ``storage.keys.kv_namespace``).
        config: Stride, retries and storage priority.
    """

    def __init__(
        self,
        *,
        host: KVHostPool,
        device: DeviceHostPipeline,
        storage: StoragePipeline,
        namespace: Namespace,
        config: DecodeOffloadConfig | None = None,
    ) -> None:
        self._host = host
        self._device = device
        self._storage = storage
        self._io = HostPageIO(host, storage)
        self._namespace = namespace
        self._config = config or DecodeOffloadConfig()
        self._page = host.geometry.page_size
        self._requests: dict[str, _Request] = {}
        self._transfers: dict[int, str] = {}  # D2H transfer id -> request
        self._backups: dict[int, str] = {}  # storage op id -> request
        self._counts = {"offloaded": 0, "stored": 0, "failed": 0, "deferred": 0}

    # ------------------------------------------------------------------ requests

    def start(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        stored_tokens: int = 0,
        seed: str | None = None,
    ) -> None:
        """Track ``request_id``, whose KV on the device covers ``token_ids`` so far.

        Args:
            request_id: The request.
            token_ids: The tokens whose KV is on the device now.
            stored_tokens: Leading tokens (whole pages) already stored by the prefill side.
            seed: The request's key-chain seed (``storage.keys.namespace_seed``), if any.

        Raises:
            StateError: the request is already tracked.
            ConfigError: ``stored_tokens`` is not whole pages of ``token_ids``.
        """
        if request_id in self._requests:
            raise StateError(subject=f"decode offload {request_id!r}", reason="already started")
        if stored_tokens % self._page or not 0 <= stored_tokens <= len(token_ids):
            reason = f"must be whole pages ({self._page} tokens) of token_ids"
            raise ConfigError(
                owner=_OWNER, field="stored_tokens", value=stored_tokens, reason=reason
            )
        tokens = list(token_ids)
        prefix = page_hashes(tokens[:stored_tokens], self._page, seed)
        self._requests[request_id] = _Request(
            tokens=tokens,
            next_page=stored_tokens // self._page,
            last_hash=prefix[-1] if prefix else seed,
        )

    def on_decoded(
        self,
        request_id: str,
        token_ids: Sequence[int],
        device_pages: torch.Tensor | Sequence[int],
    ) -> int:
        """Append ``token_ids`` and offload every whole stride of full pages not yet offloaded.

        Args:
            request_id: The request.
            token_ids: Tokens whose KV was written to the device since the last call.
            device_pages: The device page of each of the request's pages, in order
                (SGLang's ``req_to_token`` row, one entry per page). Read only when a
                stride is due: a device tensor is copied to the host (waiting for the GPU)
                at most once per stride, not at every call.

        Returns:
            Pages submitted for D2H now (0 when no stride is due or the host pool is full;
            a put-off stride is offloaded by a later call).

        Raises:
            StateError: the request is not tracked or already finished.
            ConfigError: ``device_pages`` is shorter than the pages to offload.
        """
        r = self._live(request_id)
        new, ps, stride = list(token_ids), self._page, self._config.stride_pages
        due = ((len(r.tokens) + len(new)) // ps - r.next_page) // stride * stride
        count = 0 if r.broken else due
        first, end = r.next_page, r.next_page + count
        pages, keys = torch.empty(0, dtype=torch.int64), list[str]()
        if count:  # everything is checked before anything changes
            pages = as_index_tensor(device_pages, owner=_OWNER, field="device_pages")
            if pages.numel() < end:
                reason = f"must name at least the request's first {end} pages"
                raise ConfigError(
                    owner=_OWNER, field="device_pages", value=pages.numel(), reason=reason
                )
            keys = page_hashes([*r.tokens[first * ps :], *new][: count * ps], ps, r.last_hash)
        r.tokens += new
        if not count:
            return 0
        try:
            host_pages = self._host.alloc(count)
        except CapacityError:
            self._counts["deferred"] += 1
            return 0
        try:
            handle = self._device.offload(
                host_pages, self._host.geometry.token_indices(pages[first:end])
            )
        except BaseException:  # refused (e.g. a device page out of range): nothing changes
            self._host.free(host_pages)
            del r.tokens[len(r.tokens) - len(new) :]
            raise
        r.last_hash, r.next_page = keys[-1], end
        r.strides.append(_Stride(handle.transfer_id, host_pages, keys))
        self._transfers[handle.transfer_id] = request_id
        return count

    def finish(self, request_id: str) -> None:
        """No more tokens: back the request's offloaded pages up once they have landed.

        Raises:
            StateError: the request is not tracked or already finished.
        """
        self._live(request_id).finished = True

    def abort(self, request_id: str) -> None:
        """Drop the request: store nothing more; its host pages are freed by :meth:`poll`.

        Unknown requests are ignored (an abort may race a backup's completion).
        """
        r = self._requests.get(request_id)
        if r is None:
            return
        r.finished = r.aborted = True
        if r.backup is not None:
            r.backup.cancel()

    # ------------------------------------------------------------------ completions

    @property
    def copying(self) -> bool:
        """Whether a D2H copy is in flight: some device KV is still being read.

        SGLang's ``has_inflight_device_transfer`` (the decode idle gate) and the check
        before retracting a request.
        """
        return bool(self._transfers)

    @property
    def busy(self) -> bool:
        """Whether any copy or backup is in flight, or a finished request awaits its backup."""
        return bool(self._transfers or self._backups) or any(
            r.finished for r in self._requests.values()
        )

    def poll(self, timeout_s: float = 0.0) -> list[DecodeEvent]:
        """Collect finished copies and backups; return what happened, in order.

        Args:
            timeout_s: With backups in flight and none finished, wait this long for one.
        """
        events: list[DecodeEvent] = []
        for result in self._device.poll():
            request_id = self._transfers.pop(result.transfer_id, None)
            if request_id is None:
                continue
            r = self._requests[request_id]
            stride = next(s for s in r.strides if s.transfer_id == result.transfer_id)
            stride.ok = result.ok
            if not result.ok and not r.broken:
                assert result.error is not None
                r.broken = True
                events.append(
                    OffloadFailed(request_id=request_id, pages=result.pages, error=result.error)
                )
        for request_id, r in list(self._requests.items()):
            if r.finished and r.backup is None and all(s.ok is not None for s in r.strides):
                events += self._backup(request_id, r)
        wait = timeout_s if self._backups else 0.0
        for handle in self._storage.completions(wait):
            request_id = self._backups.pop(handle.op_id, None)
            if request_id is not None:
                events += self._backed_up(request_id, self._requests[request_id])
        return events

    def stats(self) -> DecodeOffloadStats:
        """The manager's counts now."""
        c = self._counts
        held = sum(s.host_pages.numel() for r in self._requests.values() for s in r.strides)
        return DecodeOffloadStats(
            requests=len(self._requests),
            host_pages=held,
            offloaded_pages=c["offloaded"],
            stored_pages=c["stored"],
            failed_backups=c["failed"],
            deferred=c["deferred"],
        )

    # ------------------------------------------------------------------ internals

    def _live(self, request_id: str) -> _Request:
        r = self._requests.get(request_id)
        if r is None or r.finished:
            state = "not started" if r is None else "already finished"
            raise StateError(subject=f"decode offload {request_id!r}", reason=state)
        return r

    def _backup(self, request_id: str, r: _Request) -> list[DecodeEvent]:
        """Every copy landed: release the device, drop what cannot be stored, submit the rest."""
        events: list[DecodeEvent] = []
        if not r.released:
            r.released = True
            landed = sum(s.host_pages.numel() for s in r.strides if s.ok)
            self._counts["offloaded"] += landed
            events.append(DeviceReleased(request_id=request_id, pages=landed))
        good = 0
        while good < len(r.strides) and r.strides[good].ok:
            good += 1
        for stride in r.strides[good:]:  # after a failed copy: keys chain through a hole
            self._host.free(stride.host_pages)
        del r.strides[good:]
        if r.aborted or not r.strides:
            self._drop(request_id, r)
            return events
        return events + self._submit(request_id, r)

    def _submit(self, request_id: str, r: _Request) -> list[DecodeEvent]:
        """Submit the request's backup; a full storage queue leaves it for the next poll."""
        keys = [self._namespace.key(key) for s in r.strides for key in s.keys]
        pages = torch.cat([s.host_pages for s in r.strides])
        c = self._config
        op = self._io.put(keys, pages, priority=c.priority, deadline_s=c.deadline_s)
        if op.op_id is None:  # refused: nothing is pinned
            r.backup = None
            if op.queue_full:
                return []
            assert op.error is not None  # the pipeline is closed: give up now
            return self._failed(request_id, r, op.pages, 0, op.error)
        r.backup, r.attempts = op, r.attempts + 1
        self._backups[op.op_id] = request_id
        return []

    def _backed_up(self, request_id: str, r: _Request) -> list[DecodeEvent]:
        op = r.backup
        assert op is not None
        op.collect()  # the pages are freed or stored again from here
        pages, stored = op.pages, sum(op.page_ok())
        if r.aborted:
            self._drop(request_id, r)
            return []
        if stored == pages and op.error is None:
            self._counts["stored"] += stored
            self._drop(request_id, r)
            return [BackupDone(request_id=request_id, pages=stored, attempts=r.attempts)]
        if r.attempts <= self._config.max_retries:
            return self._submit(request_id, r)  # stored pages come back PRESENT
        error = op.first_error() or StorageError(f"{pages - stored} pages were not stored")
        return self._failed(request_id, r, pages, stored, error)

    def _failed(
        self, request_id: str, r: _Request, pages: int, stored: int, error: StorageError
    ) -> list[DecodeEvent]:
        self._drop(request_id, r)
        self._counts["failed"] += 1
        return [BackupFailed(request_id=request_id, pages=pages, stored=stored, error=error)]

    def _drop(self, request_id: str, r: _Request) -> None:
        for stride in r.strides:
            self._host.free(stride.host_pages)
        del self._requests[request_id]
