"""The general cache controller: host pages named by the caller, moved between tiers.

A :class:`CacheController` is the index-addressed core of the KV tiers: the caller (SGLang's
radix tree through the HiCache adapter, or :class:`~sglang_storage.managers.kv.KVCacheManager`)
owns which host page holds which key, and the controller moves pages:

- device <-> host through a :class:`~sglang_storage.transfer.DeviceHostPipeline`
  (``offload`` / ``load``);
- host <-> storage through one :class:`~sglang_storage.managers.pageio.HostPageIO`
  (``backup``, ``read``, ``query``, ``local_hit_pages``);
- under a :class:`~sglang_storage.managers.ranks.ProposingRankSync`: every rank sharing the
  cache learns the same hit counts and the same read progress, and a rank that stalls turns
  the operation into a miss on every rank within ``rank_timeout_s``; nothing waits for
  another rank;
- under a load policy: with :attr:`LoadPolicy.COST` a storage hit whose load is estimated to
  take longer than recomputing it (:class:`~sglang_storage.policy.cost.CostModel`, fed with
  every read's measured time) counts as a miss.

The controller owns its storage pipeline's completion list (``poll()`` empties it).
``poll()`` returns what finished as values, in submission order per kind (the order every
rank sees): :class:`HitQueryDone`, :class:`ReadProgress` (several per read, the last with
``final=True``, after which none of the read's pages is in flight) and :class:`BackupEnded`.
The controller is driven from one thread and starts none.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, TypeAlias

import attrs
import torch

from sglang_storage.config import positive_int, positive_number
from sglang_storage.errors import ConfigError, StateError, StorageError
from sglang_storage.managers.pageio import HostPageIO, PageKeys, PageOp, PagePart
from sglang_storage.managers.ranks import (
    Agreement,
    Proposal,
    ProposingRankSync,
    RankSync,
    SingleRank,
)
from sglang_storage.memory import KVHostPool
from sglang_storage.policy.cost import CostModel, CostModelConfig, Tier
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceLoadHandle,
    DeviceTransferHandle,
    StoragePipeline,
)

__all__ = [
    "BackupEnded",
    "CacheController",
    "ControllerConfig",
    "ControllerEvent",
    "ControllerStats",
    "HitQueryDone",
    "LoadPolicy",
    "ReadProgress",
]


class LoadPolicy(enum.StrEnum):
    """Which storage hits are loaded (``--storage-load-policy``)."""

    ALWAYS = "always"
    """Every hit at or above the prefetch threshold (SGLang's behaviour)."""
    COST = "cost"
    """Only hits the cost model says load faster than they recompute."""


def _load_policy(value: object) -> LoadPolicy:
    """A policy name as :class:`LoadPolicy`; anything else is left for the validator."""
    if isinstance(value, str) and value in set(LoadPolicy):
        return LoadPolicy(value)
    return value  # type: ignore[return-value]  # refused by _is_load_policy


def _is_load_policy(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, LoadPolicy):
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="is not a load policy",
            allowed=", ".join(p.value for p in LoadPolicy),
        )


@attrs.frozen(kw_only=True)
class ControllerConfig:
    """Bounds and policy of a :class:`CacheController`; validated on construction."""

    rank_timeout_s: float = attrs.field(default=5.0, validator=positive_number)
    """How long an agreement waits for the other ranks before it is a miss on all."""
    exists_timeout_s: float = attrs.field(default=5.0, validator=positive_number)
    """How long a hit query waits for the backend before it counts as 0 pages."""
    read_batch_pages: int = attrs.field(default=128, validator=positive_int)
    """Pages per storage read: a read's progress is agreed in these steps."""
    load_policy: LoadPolicy = attrs.field(
        default=LoadPolicy.ALWAYS,
        converter=_load_policy,
        validator=_is_load_policy,
    )
    """Which hits are loaded."""


@attrs.frozen(kw_only=True)
class HitQueryDone:
    """A hit query ended: ``pages`` leading pages are stored on every rank (the MIN)."""

    query_id: int
    pages: int
    local_pages: int
    """This rank's own count (before the cost policy and the agreement)."""
    cost_skipped: bool
    """The cost policy made this rank's hit a miss (loading would be slower)."""
    agreed: bool
    """False when some rank did not answer in time (``pages`` is 0 then)."""


@attrs.frozen(kw_only=True)
class ReadProgress:
    """A read's leading pages now in host memory on every rank (the MIN so far)."""

    read_id: int
    pages: int
    requested_pages: int
    final: bool
    """The read has ended: no page of it is in flight any more; no event follows."""
    agreed: bool
    """False when some rank did not answer in time (``pages`` stays what was agreed)."""


@attrs.frozen(kw_only=True)
class BackupEnded:
    """A backup ended: the leading ``stored_pages`` of it are in storage."""

    backup_id: int
    stored_pages: int
    requested_pages: int
    error: StorageError | None
    page_ok: tuple[bool, ...] = ()
    """Per page, whether every part of it was stored (pages after a failed one may be)."""


ControllerEvent: TypeAlias = HitQueryDone | ReadProgress | BackupEnded


@attrs.frozen(kw_only=True)
class ControllerStats:
    """Counts since the controller was built."""

    hit_queries: int = 0
    hit_pages: int = 0
    """Pages agreed stored over every hit query."""
    cost_skipped_queries: int = 0
    """Hit queries the cost policy turned into a miss on this rank."""
    cost_skipped_pages: int = 0
    """Pages of those hits."""
    rank_misses: int = 0
    """Agreements that some rank did not answer in time."""
    backups: int = 0
    backed_up_pages: int = 0
    backup_failed_pages: int = 0
    reads: int = 0
    read_pages: int = 0
    """Pages agreed read into host memory."""
    read_cancelled: int = 0


@attrs.define
class _Query:
    query_id: int
    op: PageOp
    started: float
    proposal: Proposal | None = None
    local: int = 0
    cost_skipped: bool = False


@attrs.define
class _Read:
    read_id: int
    ops: list[PageOp]
    requested: int
    posted: int = 0  # batches whose count was proposed
    local: int = 0  # this rank's leading pages over the batches proposed
    broken: bool = False  # a batch came up short: later batches add nothing
    agreed: int = 0
    proposal: Proposal | None = None
    abandoned: bool = False
    cancelled: bool = False


class CacheController:
    """Index-addressed device/host/storage page movement; see the module contract.

    Args:
        host: The host pool whose pages the caller names.
        device: Moves pages between the device pool and ``host``.
        storage: Moves pages between ``host`` and the backend; None for no storage tier.
        sides: Pools holding further parts of every page (hybrid models' side data):
            keys and slots are then given per page as a tuple of keys and a row of slots,
            the KV page first.
        ranks: Agreement with the other ranks sharing the cache; one without ``propose``
            agrees by blocking (bounded) when a proposal is made.
        cost: The load-vs-recompute model (needed by :attr:`LoadPolicy.COST`; fed either way).
        config: Bounds and policy.
    """

    def __init__(
        self,
        *,
        host: KVHostPool,
        device: DeviceHostPipeline | None,
        storage: StoragePipeline | None,
        sides: Sequence[PagePart] = (),
        ranks: RankSync | None = None,
        cost: CostModel | None = None,
        config: ControllerConfig | None = None,
    ) -> None:
        self._config = config if config is not None else ControllerConfig()
        self._host = host
        self._device = device
        self._io = None if storage is None else HostPageIO([host, *sides], storage)
        if ranks is None:
            ranks = SingleRank()
        self._ranks = ranks if isinstance(ranks, ProposingRankSync) else _Blocking(ranks)
        self._page_size = host.geometry.page_size
        self._cost = cost
        if cost is None and self._config.load_policy is LoadPolicy.COST:
            per_token = max(1, host.page_spec.nbytes // self._page_size)
            self._cost = CostModel(CostModelConfig(), bytes_per_token={"kv": per_token})
        self._ids = 0
        self._queries: deque[_Query] = deque()
        self._reads: deque[_Read] = deque()
        self._reads_by_id: dict[int, _Read] = {}
        self._backups: deque[tuple[int, PageOp]] = deque()
        self._lingering: list[PageOp] = []  # reported ended by close(), calls still running
        self._counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ parts

    @property
    def config(self) -> ControllerConfig:
        """Bounds and policy."""
        return self._config

    @property
    def host(self) -> KVHostPool:
        """The host pool."""
        return self._host

    @property
    def device(self) -> DeviceHostPipeline | None:
        """The device<->host pipeline (None when the caller moves device pages itself)."""
        return self._device

    @property
    def page_io(self) -> HostPageIO | None:
        """The host<->storage page I/O; None without a storage tier."""
        return self._io

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model the load policy consults."""
        return self._cost

    @property
    def in_flight(self) -> int:
        """Queries, reads and backups not yet reported final by ``poll()``."""
        return len(self._queries) + len(self._reads) + len(self._backups)

    # ------------------------------------------------------------------ device <-> host

    def offload(
        self, host_pages: torch.Tensor, device_tokens: torch.Tensor
    ) -> DeviceTransferHandle:
        """Copy device tokens into host pages (every layer).

        Raises:
            StateError: no device pipeline.
        """
        return self._require_device().offload(host_pages, device_tokens)

    def load(self, host_pages: torch.Tensor, device_tokens: torch.Tensor) -> DeviceLoadHandle:
        """Copy host pages into device tokens, layer by layer.

        Raises:
            StateError: no device pipeline.
        """
        return self._require_device().load(host_pages, device_tokens)

    def _require_device(self) -> DeviceHostPipeline:
        if self._device is None:
            raise StateError(subject="CacheController", reason="has no device pipeline")
        return self._device

    # ------------------------------------------------------------------ host <-> storage

    def local_hit_pages(self, keys: Sequence[PageKeys]) -> int:
        """How many leading ``keys`` storage holds on this rank (bounded; not agreed)."""
        if self._io is None:
            return 0
        return self._io.exists_now(keys, timeout_s=self._config.exists_timeout_s)

    def query(self, keys: Sequence[PageKeys]) -> int:
        """Start a hit query agreed by every rank; :class:`HitQueryDone` from ``poll()``."""
        query_id = self._next_id()
        if self._io is None:
            op = PageOp.refused(len(keys))
        else:
            op = self._io.exists(keys, deadline_s=self._config.exists_timeout_s)
        self._queries.append(_Query(query_id=query_id, op=op, started=time.monotonic()))
        self._counts["hit_queries"] += 1
        return query_id

    def backup(self, keys: Sequence[PageKeys], host_pages: torch.Tensor) -> int:
        """Store host pages under ``keys``; its :class:`BackupEnded` comes from ``poll()``.

        A backup refused at submission ends with 0 pages stored (reported in order).
        """
        backup_id = self._next_id()
        op = PageOp.refused(len(keys)) if self._io is None else self._io.put(keys, host_pages)
        self._backups.append((backup_id, op))
        self._counts["backups"] += 1
        return backup_id

    def read(self, keys: Sequence[PageKeys], host_pages: torch.Tensor) -> int:
        """Read ``keys`` into host pages in batches; :class:`ReadProgress` from ``poll()``.

        Raises:
            ConfigError: ``host_pages`` and ``keys`` differ in pages (nothing started).
        """
        read_id = self._next_id()
        rows = host_pages.to("cpu", torch.int64)
        rows = rows.reshape(-1, 1) if rows.dim() <= 1 else rows
        if rows.shape[0] != len(keys):
            raise ConfigError(
                owner="CacheController.read",
                field="host_pages",
                value=int(rows.shape[0]),
                reason=f"must give one page (row of slots) per key ({len(keys)} keys)",
            )
        step, io = self._config.read_batch_pages, self._io
        ops = (
            []
            if io is None
            else [
                io.get(keys[first : first + step], rows[first : first + step])
                for first in range(0, len(keys), step)
            ]
        )
        read = _Read(read_id=read_id, ops=ops, requested=len(keys) if ops else 0)
        self._reads.append(read)
        self._reads_by_id[read_id] = read
        self._counts["reads"] += 1
        return read_id

    def cancel_read(self, read_id: int) -> None:
        """Stop a read's remaining batches; its final :class:`ReadProgress` still comes."""
        read = self._reads_by_id.get(read_id)
        if read is None or read.cancelled:
            return
        read.cancelled = True
        self._counts["read_cancelled"] += 1
        for op in read.ops:
            op.cancel()

    # ------------------------------------------------------------------ completions

    def poll(self) -> list[ControllerEvent]:
        """What finished since the last call, in submission order per kind; never blocks."""
        events: list[ControllerEvent] = []
        if self._io is not None and self._io.pipeline.config.track_completions:
            self._io.pipeline.completions(0.0)  # ours are tracked by handle: let them go
        self._poll_queries(events)
        self._poll_reads(events)
        self._poll_backups(events)
        for op in [op for op in self._lingering if op.done()]:
            self._lingering.remove(op)
            op.collect()  # a call that outlived close() has returned: its pages are free
        return events

    def close(self, timeout_s: float = 10.0) -> list[ControllerEvent]:
        """Cancel reads and queries, wait (bounded) for backups; the final events.

        Agreements still open are not waited for: what the ranks did not decide in time
        is reported as not agreed (0 pages). A read or backup whose backend call outlives
        the bound is reported ended with what had landed, but its pages stay pinned (the
        call still writes or reads them) until a later ``poll()`` sees the call return.
        """
        deadline = time.monotonic() + timeout_s
        for read in self._reads:
            self.cancel_read(read.read_id)
        for query in self._queries:
            query.op.cancel()
        events = self.poll()
        ops = [op for _, op in self._backups] + [op for r in self._reads for op in r.ops]
        for op in ops:
            op.wait(max(0.0, deadline - time.monotonic()))
        events += self.poll()
        for query in self._queries:
            events.append(
                HitQueryDone(
                    query_id=query.query_id,
                    pages=0,
                    local_pages=0,
                    cost_skipped=False,
                    agreed=False,
                )
            )
        self._queries.clear()
        for read in self._reads:
            for op in read.ops:
                self._collect_or_linger(op)
            events.append(
                ReadProgress(
                    read_id=read.read_id,
                    pages=read.agreed,
                    requested_pages=read.requested,
                    final=True,
                    agreed=False,
                )
            )
        self._reads.clear()
        self._reads_by_id.clear()
        for backup_id, op in self._backups:
            self._collect_or_linger(op)
            events.append(
                BackupEnded(
                    backup_id=backup_id,
                    stored_pages=op.leading(),
                    requested_pages=op.pages,
                    error=op.error,
                    page_ok=tuple(op.page_ok()),
                )
            )
        self._backups.clear()
        return events

    def _collect_or_linger(self, op: PageOp) -> None:
        if op.done():
            op.collect()
        else:
            self._lingering.append(op)

    def stats(self) -> ControllerStats:
        """Counts so far."""
        return ControllerStats(**self._counts)

    # ------------------------------------------------------------------ internals

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _agreement_timeout(self) -> float:
        return self._config.rank_timeout_s

    def _poll_queries(self, events: list[ControllerEvent]) -> None:
        # Propose in submission order (agreements are matched by order across ranks).
        for query in self._queries:
            if query.proposal is not None:
                continue
            if not query.op.done():
                if time.monotonic() - query.started <= self._config.exists_timeout_s:
                    break
                query.op.cancel()  # the backend did not answer in time: 0 pages here
                local = 0
            else:
                local = query.op.leading()
            query.local = local
            value = self._cost_filter(query, local)
            query.proposal = self._ranks.propose("hit", value, timeout_s=self._agreement_timeout())
        while self._queries and self._queries[0].proposal is not None:
            query = self._queries[0]
            assert query.proposal is not None
            agreement = query.proposal.poll()
            if agreement is None:
                break
            self._queries.popleft()
            pages = agreement.value or 0
            self._counts["rank_misses"] += agreement.value is None
            self._counts["hit_pages"] += pages
            events.append(
                HitQueryDone(
                    query_id=query.query_id,
                    pages=pages,
                    local_pages=query.local,
                    cost_skipped=query.cost_skipped,
                    agreed=agreement.value is not None,
                )
            )

    def _cost_filter(self, query: _Query, local: int) -> int:
        if self._config.load_policy is not LoadPolicy.COST or local == 0 or self._cost is None:
            return local
        decision = self._cost.decide(Tier.STORAGE, local * self._page_size)
        if decision.load:
            return local
        query.cost_skipped = True
        self._counts.update(cost_skipped_queries=1, cost_skipped_pages=local)
        return 0

    def _poll_reads(self, events: list[ControllerEvent]) -> None:
        while self._reads:
            read = self._reads[0]
            if not self._advance(read, events):
                return
            self._reads.popleft()
            del self._reads_by_id[read.read_id]

    def _advance(self, read: _Read, events: list[ControllerEvent]) -> bool:
        """Move ``read`` on; True once its final event is out."""
        while True:
            if read.proposal is not None:
                agreement = read.proposal.poll()
                if agreement is None:
                    return False
                read.proposal = None
                if agreement.value is None:
                    self._counts["rank_misses"] += 1
                    read.abandoned = True
                    for op in read.ops:
                        op.cancel()
                else:
                    self._counts["read_pages"] += agreement.value - read.agreed
                    read.agreed = agreement.value
                last = read.posted == len(read.ops)
                if not last and not read.abandoned:
                    events.append(self._progress(read, final=False))
            if read.abandoned or read.posted == len(read.ops):
                if not all(op.done() for op in read.ops):
                    return False  # pages still being written: not final yet
                for op in read.ops:
                    op.collect()
                events.append(self._progress(read, final=True))
                return True
            op = read.ops[read.posted]
            if not op.done():
                return False
            self._observe(op)
            count = 0 if read.broken else op.leading()
            read.broken = read.broken or count < op.pages
            read.local += count
            read.posted += 1
            read.proposal = self._ranks.propose(
                "read", read.local, timeout_s=self._agreement_timeout()
            )

    def _progress(self, read: _Read, *, final: bool) -> ReadProgress:
        return ReadProgress(
            read_id=read.read_id,
            pages=read.agreed,
            requested_pages=read.requested,
            final=final,
            agreed=not read.abandoned,
        )

    def _observe(self, op: PageOp) -> None:
        if self._cost is None or op.latency_s <= 0:
            return
        nbytes = op.moved_bytes()
        if nbytes > 0:
            self._cost.observe(Tier.STORAGE, nbytes, op.latency_s)

    def _poll_backups(self, events: list[ControllerEvent]) -> None:
        while self._backups and self._backups[0][1].done():
            backup_id, op = self._backups.popleft()
            op.collect()
            stored = op.leading()
            self._counts.update(backed_up_pages=stored, backup_failed_pages=op.pages - stored)
            events.append(
                BackupEnded(
                    backup_id=backup_id,
                    stored_pages=stored,
                    requested_pages=op.pages,
                    error=op.error,
                    page_ok=tuple(op.page_ok()),
                )
            )


class _Blocking:
    """A :class:`RankSync` without ``propose``: each proposal agrees at once (bounded wait)."""

    def __init__(self, ranks: RankSync) -> None:
        self._ranks = ranks

    @property
    def rank(self) -> int:
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        return self._ranks.world_size

    def agree_min(self, op: str, value: int, *, timeout_s: float) -> int | None:
        return self._ranks.agree_min(op, value, timeout_s=timeout_s)

    def propose(self, op: str, value: int, *, timeout_s: float) -> Proposal:
        return _Agreed(Agreement(self._ranks.agree_min(op, value, timeout_s=timeout_s)))


@attrs.frozen
class _Agreed:
    agreement: Agreement

    def poll(self) -> Agreement | None:
        return self.agreement
