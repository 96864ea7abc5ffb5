"""The cache controller core on CPU: host pages to storage and back under its contract.

Every test drives a :class:`CacheController` over a real ``KVHostPool``, a real
``StoragePipeline`` and a real ``memory`` or ``file`` backend (wrapped where a test needs
faults: the held, failing and delayed calls of ``support.faults.FaultyBackend``, or the
``faulty`` backend's latency for the cost policy), and checks what ``poll()`` reports
against what the backend and the pool really did: bytes read back, order of completion,
leading runs, pins, bounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from support.faults import FaultyBackend, PipelineCloser
from torch._C._distributed_c10d import TCPStore

from sglang_storage.core import GetRequest, GetResult, ObjectKey, PutRequest, PutResult
from sglang_storage.errors import ConfigError, StateError
from sglang_storage.managers.controller import (
    BackupEnded,
    CacheController,
    ControllerConfig,
    ControllerEvent,
    HitQueryDone,
    LoadPolicy,
    ReadProgress,
)
from sglang_storage.managers.ranks import Agreement, StoreRankSync
from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    MemoryFacts,
)
from sglang_storage.policy.cost import CostModel, CostModelConfig, Tier
from sglang_storage.storage import Backend, create_backend
from sglang_storage.storage.faults import FaultInjectingBackend, FaultSchedule
from sglang_storage.storage.keys import kv_namespace, model_fingerprint
from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig

PAGE = 4
HOST_PAGES = 160
WAIT_S = 10.0
NAMESPACE = kv_namespace(model_fingerprint("test/controller", page_size=PAGE), mla=False)

PIPELINES = PipelineCloser()
close_pipelines = PIPELINES.autouse_fixture()

E = TypeVar("E", HitQueryDone, ReadProgress, BackupEnded)


def keys(n: int, tag: str = "k") -> list[ObjectKey]:
    return [ObjectKey(namespace=NAMESPACE, name=f"{tag}{i:04d}") for i in range(n)]


def memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0), facts=facts))


def make_pool() -> KVHostPool:
    geometry = KVGeometry(
        attention=Attention.MHA,
        layout=KVLayout.PAGE_FIRST,
        dtype=torch.bfloat16,
        layer_num=2,
        page_size=PAGE,
        num_pages=HOST_PAGES,
        head_num=2,
        head_dim=8,
    )
    return KVHostPool(geometry, memory())


class SlowKeys(FaultyBackend):
    """A FaultyBackend whose calls touching a key in :attr:`slow` take ``delay_s`` longer.

    :attr:`finished` records, in order, ``(call, first key)`` of every call as it returns.
    """

    def __init__(self, inner: Backend, **options: object) -> None:
        super().__init__(inner, **options)  # type: ignore[arg-type]
        self.slow: set[ObjectKey] = set()
        self.delay_s = 0.3
        self.finished: list[tuple[str, ObjectKey]] = []
        self._order = threading.Lock()

    def _delay(self, batch: Sequence[ObjectKey]) -> None:
        if self.slow.intersection(batch):
            time.sleep(self.delay_s)

    def _done(self, call: str, batch: Sequence[ObjectKey]) -> None:
        with self._order:
            self.finished.extend((call, key) for key in batch[:1])

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._delay(keys)
        try:
            return super().exists(keys)
        finally:
            self._done("exists", keys)

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        batch = [r.key for r in requests]
        self._delay(batch)
        try:
            return super().get_into(requests)
        finally:
            self._done("get", batch)

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        batch = [r.key for r in requests]
        self._delay(batch)
        try:
            return super().put_from(requests)
        finally:
            self._done("put", batch)


class Rig:
    """A controller over a fresh host pool, a pipeline and ``store``."""

    def __init__(
        self,
        store: Backend,
        *,
        workers: int = 2,
        batch_pages: int = 4,
        merge_ops: bool = True,
        ranks: StoreRankSync | None = None,
        cost: CostModel | None = None,
        **config: object,
    ) -> None:
        self.host = make_pool()
        self.store = store
        self.pipeline = PIPELINES.track(
            StoragePipeline(
                store,
                StoragePipelineConfig(
                    workers=workers, batch_pages=batch_pages, merge_ops=merge_ops
                ),
            )
        )
        self.controller = CacheController(
            host=self.host,
            device=None,
            storage=self.pipeline,
            ranks=ranks,
            cost=cost,
            config=ControllerConfig(**config),  # type: ignore[arg-type]
        )
        self.events: list[ControllerEvent] = []
        self._gen = torch.Generator().manual_seed(11)

    def fill(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` new host pages holding random bytes; (pages, their bytes)."""
        pages = self.host.alloc(n)
        nbytes = n * self.host.page_spec.nbytes
        data = torch.randint(0, 256, (nbytes,), generator=self._gen, dtype=torch.uint8)
        self.host.write_pages(pages, data)
        return pages, self.host.read_pages(pages).clone()

    def pinned(self) -> int:
        return self.host.slots.stats().pinned

    def until(self, done: Callable[[], bool], timeout_s: float = WAIT_S) -> list[ControllerEvent]:
        """Poll until ``done()``; the events seen on the way (also kept in :attr:`events`)."""
        seen: list[ControllerEvent] = []
        deadline = time.monotonic() + timeout_s
        while True:
            new = self.controller.poll()
            seen += new
            self.events += new
            if done():
                return seen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; events so far: {seen}")
            time.sleep(0.002)

    def wait_for(self, kind: type[E], ident: int) -> E:
        """Poll until the (final) event of ``kind`` for ``ident`` arrives; return it."""

        def found() -> E | None:
            for event in self.events:
                if isinstance(event, kind) and _ident(event) == ident and _ends(event):
                    return event
            return None

        self.until(lambda: found() is not None)
        event = found()
        assert event is not None
        return event

    def backup(self, names: Sequence[ObjectKey], pages: torch.Tensor) -> BackupEnded:
        return self.wait_for(BackupEnded, self.controller.backup(names, pages))

    def query(self, names: Sequence[ObjectKey]) -> HitQueryDone:
        return self.wait_for(HitQueryDone, self.controller.query(names))

    def read(self, names: Sequence[ObjectKey], pages: torch.Tensor) -> ReadProgress:
        return self.wait_for(ReadProgress, self.controller.read(names, pages))

    def progress(self, read_id: int) -> list[ReadProgress]:
        return [e for e in self.events if isinstance(e, ReadProgress) and e.read_id == read_id]


def _ends(event: ControllerEvent) -> bool:
    """Whether ``event`` is the last of its operation (a read's progress: only the final)."""
    return not isinstance(event, ReadProgress) or event.final


def _ident(event: ControllerEvent) -> int:
    if isinstance(event, HitQueryDone):
        return event.query_id
    if isinstance(event, ReadProgress):
        return event.read_id
    return event.backup_id


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    store = create_backend(
        request.param, {"root": str(tmp_path)} if request.param == "file" else {}
    )
    yield store
    PIPELINES.close_all()
    store.close()


@pytest.fixture
def faulty(backend: Backend) -> Iterator[SlowKeys]:
    store = SlowKeys(backend, key_errors_on={"put"})
    yield store
    store.gate.set()  # a failing test must not leave a worker held at the gate


# ---------------------------------------------------------------------- round trip


def test_backup_then_read_round_trip_is_byte_exact(backend: Backend) -> None:
    rig = Rig(backend)
    names = keys(6)
    pages, data = rig.fill(6)
    ended = rig.backup(names, pages)
    assert (ended.stored_pages, ended.requested_pages, ended.error) == (6, 6, None)
    assert rig.pinned() == 0
    assert rig.controller.local_hit_pages(names) == 6
    assert rig.controller.local_hit_pages([*names[:4], *keys(1, "absent"), *names[4:]]) == 4
    hit = rig.query(names)
    assert (hit.pages, hit.local_pages, hit.agreed, hit.cost_skipped) == (6, 6, True, False)

    # Overwrite the originals, then read into other pages, in reverse order of keys.
    rig.host.write_pages(pages, torch.zeros(6 * rig.host.page_spec.nbytes, dtype=torch.uint8))
    target = rig.host.alloc(6)
    final = rig.read(names[::-1], target)
    assert (final.pages, final.requested_pages, final.final, final.agreed) == (6, 6, True, True)
    assert torch.equal(
        rig.host.read_pages(target).view(torch.uint8), data.flip(0).view(torch.uint8)
    )
    assert rig.pinned() == 0
    stats = rig.controller.stats()
    assert (stats.backups, stats.backed_up_pages, stats.backup_failed_pages) == (1, 6, 0)
    assert (stats.reads, stats.read_pages, stats.hit_queries, stats.hit_pages) == (1, 6, 1, 6)
    assert rig.controller.in_flight == 0


def test_events_come_in_submission_order_though_later_ops_finish_first(
    faulty: SlowKeys,
) -> None:
    rig = Rig(faulty, workers=2, batch_pages=4, merge_ops=False)
    first, second = keys(2, "a"), keys(2, "b")
    faulty.slow = {first[0]}  # every call touching it takes 0.3 s longer

    def finished_first(call: str) -> bool:
        order = [key for kind, key in faulty.finished if kind == call]
        return order.index(second[0]) < order.index(first[0])

    backups = [rig.controller.backup(names, rig.fill(2)[0]) for names in (first, second)]
    rig.until(lambda: rig.controller.in_flight == 0)
    queries = [rig.controller.query(names) for names in (first, second)]
    rig.until(lambda: rig.controller.in_flight == 0)
    reads = [rig.controller.read(names, rig.host.alloc(2)) for names in (first, second)]
    rig.until(lambda: rig.controller.in_flight == 0)
    # The backend really finished the later ones first...
    assert finished_first("put")
    assert finished_first("exists")
    assert finished_first("get")
    # ...and the controller reported them in submission order, per kind.
    ended = [e for e in rig.events if isinstance(e, BackupEnded)]
    hits = [e for e in rig.events if isinstance(e, HitQueryDone)]
    finals = [e for e in rig.events if isinstance(e, ReadProgress) and e.final]
    assert [(e.backup_id, e.stored_pages) for e in ended] == [(b, 2) for b in backups]
    assert [(e.query_id, e.pages) for e in hits] == [(q, 2) for q in queries]
    assert [(e.read_id, e.pages) for e in finals] == [(r, 2) for r in reads]
    assert rig.pinned() == 0


def test_backup_stored_pages_is_the_leading_run(faulty: SlowKeys) -> None:
    rig = Rig(faulty)
    names = keys(8)
    faulty.error_keys = {names[3]}
    ended = rig.backup(names, rig.fill(8)[0])
    assert (ended.stored_pages, ended.requested_pages) == (3, 8)
    assert rig.pinned() == 0
    # Pages after the failed one may be stored, but only the leading run counts.
    assert faulty.inner.exists(names) == [True] * 3 + [False] + [True] * 4
    assert rig.controller.local_hit_pages(names) == 3
    hit = rig.query(names)
    assert (hit.pages, hit.local_pages) == (3, 3)
    stats = rig.controller.stats()
    assert (stats.backed_up_pages, stats.backup_failed_pages) == (3, 5)


# ---------------------------------------------------------------------- reads


def test_read_in_batches_reports_monotonic_progress_then_unpins(faulty: SlowKeys) -> None:
    rig = Rig(faulty, read_batch_pages=2)
    names = keys(7)
    assert rig.backup(names, rig.fill(7)[0]).stored_pages == 7
    target = rig.host.alloc(7)
    faulty.gate.clear()  # hold the reads so the pins can be seen
    read_id = rig.controller.read(names, target)
    assert rig.pinned() == 7
    with pytest.raises(StateError):
        rig.host.free(target)  # in flight: the pool refuses
    faulty.gate.set()
    final = rig.wait_for(ReadProgress, read_id)
    progress = rig.progress(read_id)
    assert [p.pages for p in progress] == [2, 4, 6, 7]
    assert [p.final for p in progress] == [False, False, False, True]
    assert all(p.agreed and p.requested_pages == 7 for p in progress)
    assert progress[-1] == final
    rig.until(lambda: True)
    assert rig.progress(read_id) == progress  # nothing after the final one
    assert rig.pinned() == 0
    rig.host.free(target)  # every page is unpinned: freeing works
    assert rig.controller.stats().read_pages == 7


def test_read_stops_counting_at_the_first_missing_page(backend: Backend) -> None:
    rig = Rig(backend, read_batch_pages=2)
    names = keys(6)
    pages = rig.fill(6)[0]
    rig.backup(names[:3], pages[:3])
    rig.backup(names[4:], pages[4:])  # names[3] never stored
    read_id = rig.controller.read(names, rig.host.alloc(6))
    rig.wait_for(ReadProgress, read_id)
    progress = rig.progress(read_id)
    assert [p.pages for p in progress] == [2, 3, 3]
    assert progress[-1].final
    assert rig.pinned() == 0


def test_cancel_read_still_ends_with_a_final_event_and_no_pin(faulty: SlowKeys) -> None:
    rig = Rig(faulty, workers=1, batch_pages=2, read_batch_pages=2)
    names = keys(6)
    assert rig.backup(names, rig.fill(6)[0]).stored_pages == 6
    target = rig.host.alloc(6)
    faulty.gate.clear()
    faulty.entered.clear()
    read_id = rig.controller.read(names, target)
    assert faulty.entered.wait(WAIT_S)  # the first batch is in the backend
    rig.controller.cancel_read(read_id)
    rig.controller.cancel_read(read_id)  # idempotent
    faulty.gate.set()
    final = rig.wait_for(ReadProgress, read_id)
    assert final.final
    assert final.requested_pages == 6
    assert final.pages <= 2  # only the batch already in the backend can have landed
    assert rig.progress(read_id)[-1] == final
    assert rig.pinned() == 0
    rig.host.free(target)
    assert rig.controller.stats().read_cancelled == 1
    assert rig.controller.in_flight == 0


def test_read_refuses_pages_and_keys_of_different_lengths(backend: Backend) -> None:
    rig = Rig(backend)
    with pytest.raises(ConfigError, match="per key"):
        rig.controller.read(keys(3), rig.host.alloc(4))
    with pytest.raises(ConfigError, match="per key"):
        rig.controller.backup(keys(3), rig.host.alloc(2))
    assert rig.pinned() == 0


def test_read_refuses_mismatched_lengths_across_batches_without_pinning(
    backend: Backend,
) -> None:
    # Every batch's own slice can match (4 keys, 6 pages in batches of 2), or only the
    # last can fail (5 keys, 4 pages): the read is refused whole, nothing pinned.
    rig = Rig(backend, read_batch_pages=2)
    with pytest.raises(ConfigError, match="per key"):
        rig.controller.read(keys(5), rig.host.alloc(4))
    assert rig.pinned() == 0
    assert rig.controller.in_flight == 0
    with pytest.raises(ConfigError, match="per key"):
        rig.controller.read(keys(4), rig.host.alloc(6))


# ---------------------------------------------------------------------- hit queries


def test_hit_query_slower_than_exists_timeout_counts_zero(backend: Backend) -> None:
    store = SlowKeys(backend, gated={"exists"})
    try:
        rig = Rig(store, exists_timeout_s=0.2)
        names = keys(4)
        assert rig.backup(names, rig.fill(4)[0]).stored_pages == 4
        assert rig.query(names).pages == 4
        store.gate.clear()
        started = time.monotonic()
        hit = rig.query(names)
        elapsed = time.monotonic() - started
        assert (hit.pages, hit.local_pages, hit.agreed) == (0, 0, True)
        assert 0.2 <= elapsed < 2.0
        started = time.monotonic()
        assert rig.controller.local_hit_pages(names) == 0
        assert time.monotonic() - started < 2.0
    finally:
        store.gate.set()


def test_hit_query_is_the_min_over_ranks_and_a_silent_rank_is_a_miss(
    backend: Backend,
) -> None:
    server = TCPStore(
        "127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    other = StoreRankSync(
        TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=10)),
        rank=1,
        world_size=2,
    )
    mine = StoreRankSync(
        TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=10)),
        rank=0,
        world_size=2,
    )
    rig = Rig(backend, ranks=mine, rank_timeout_s=0.3, read_batch_pages=2)
    names = keys(4)
    assert rig.backup(names, rig.fill(4)[0]).stored_pages == 4
    # The other rank holds 2: both learn 2.
    theirs = other.propose("hit", 2, timeout_s=5.0)
    hit = rig.query(names)
    assert (hit.pages, hit.local_pages, hit.agreed) == (2, 4, True)
    assert theirs.poll() == Agreement(2)
    # The other rank never answers: a miss within the bound, for the query and the read.
    started = time.monotonic()
    hit = rig.query(names)
    assert (hit.pages, hit.local_pages, hit.agreed) == (0, 4, False)
    target = rig.host.alloc(4)
    final = rig.read(names, target)
    assert time.monotonic() - started < 0.3 * 2 + 2.0
    assert (final.pages, final.final, final.agreed) == (0, True, False)
    assert rig.pinned() == 0
    rig.host.free(target)
    assert rig.controller.stats().rank_misses == 2


# ---------------------------------------------------------------------- close and refusals


def test_close_ends_everything_in_flight_within_its_bound(faulty: SlowKeys) -> None:
    rig = Rig(faulty)
    names = keys(4)
    assert rig.backup(names, rig.fill(4)[0]).stored_pages == 4
    faulty.gate.clear()
    q = rig.controller.query(names)
    r = rig.controller.read(names, rig.host.alloc(4))
    b = rig.controller.backup(keys(4, "late"), rig.fill(4)[0])
    started = time.monotonic()
    events = rig.controller.close(timeout_s=0.3)
    assert time.monotonic() - started < 2.0
    # One final event per operation (order is per kind only); nothing stored or found.
    (hit,) = [e for e in events if isinstance(e, HitQueryDone)]
    (read,) = [e for e in events if isinstance(e, ReadProgress)]
    (backup,) = [e for e in events if isinstance(e, BackupEnded)]
    assert len(events) == 3
    assert (hit.query_id, hit.pages) == (q, 0)  # cancelled: agreed at 0 or not agreed
    assert (read.read_id, read.pages, read.final) == (r, 0, True)
    assert (backup.backup_id, backup.stored_pages) == (b, 0)
    assert rig.controller.in_flight == 0
    faulty.gate.set()
    assert rig.controller.poll() == []


def test_close_past_its_bound_leaves_no_page_pinned_once_the_calls_return(
    faulty: SlowKeys,
) -> None:
    rig = Rig(faulty)
    faulty.gate.clear()
    faulty.entered.clear()
    rig.controller.read(keys(4), rig.host.alloc(4))
    rig.controller.backup(keys(4, "b"), rig.fill(4)[0])
    assert faulty.entered.wait(WAIT_S)
    rig.controller.close(timeout_s=0.2)  # the calls are held: past the bound
    faulty.gate.set()
    deadline = time.monotonic() + WAIT_S
    while faulty.started["get"] + faulty.started["put"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    rig.pipeline.close(timeout_s=WAIT_S)  # every backend call has returned now
    rig.controller.poll()
    rig.controller.close(timeout_s=1.0)
    assert rig.pinned() == 0


def test_close_waits_for_backups_and_unpins(backend: Backend) -> None:
    rig = Rig(backend)
    names = keys(8)
    ids = [rig.controller.backup(names[i : i + 4], rig.fill(4)[0]) for i in (0, 4)]
    events = rig.controller.close(timeout_s=WAIT_S)
    ended = [e for e in rig.events + events if isinstance(e, BackupEnded)]
    assert [(e.backup_id, e.stored_pages) for e in ended] == [(ids[0], 4), (ids[1], 4)]
    assert rig.pinned() == 0
    assert backend.exists(names) == [True] * 8


def test_a_closed_pipeline_gives_failed_ops_reported_in_order(backend: Backend) -> None:
    rig = Rig(backend)
    names = keys(4)
    first = rig.controller.backup(names, rig.fill(4)[0])
    rig.until(lambda: rig.controller.in_flight == 0)
    rig.pipeline.close(timeout_s=WAIT_S)
    refused = rig.controller.backup(keys(4, "x"), rig.fill(4)[0])
    query = rig.controller.query(names)
    read = rig.controller.read(names, rig.host.alloc(4))
    rig.until(lambda: rig.controller.in_flight == 0)
    ended = [e for e in rig.events if isinstance(e, BackupEnded)]
    assert [e.backup_id for e in ended] == [first, refused]
    assert ended[0].stored_pages == 4
    assert ended[0].error is None
    assert (ended[1].stored_pages, ended[1].requested_pages) == (0, 4)
    assert isinstance(ended[1].error, StateError)
    hit = rig.wait_for(HitQueryDone, query)
    assert hit.pages == 0
    final = rig.wait_for(ReadProgress, read)
    assert (final.pages, final.final) == (0, True)
    assert rig.pinned() == 0
    assert rig.controller.stats().backup_failed_pages == 4


def test_without_storage_everything_is_a_miss() -> None:
    host = make_pool()
    controller = CacheController(host=host, device=None, storage=None)
    names = keys(3)
    pages = host.alloc(3)
    ids = (controller.query(names), controller.read(names, pages), controller.backup(names, pages))
    hit, read, backup = controller.poll()
    assert isinstance(hit, HitQueryDone)
    assert isinstance(read, ReadProgress)
    assert isinstance(backup, BackupEnded)
    assert (hit.query_id, hit.pages, hit.local_pages, hit.agreed) == (ids[0], 0, 0, True)
    assert (read.read_id, read.pages, read.requested_pages, read.final) == (ids[1], 0, 0, True)
    assert (backup.backup_id, backup.stored_pages, backup.requested_pages) == (ids[2], 0, 3)
    assert backup.error is None
    assert controller.poll() == []
    assert controller.in_flight == 0
    assert controller.local_hit_pages(names) == 0
    with pytest.raises(StateError):
        controller.offload(pages, torch.arange(3 * PAGE))


# ---------------------------------------------------------------------- load policy


def slow_backend(latency_s: float) -> FaultInjectingBackend:
    schedule = FaultSchedule(seed=1, latency_rate=1.0, latency_s=latency_s)
    return FaultInjectingBackend(create_backend("memory", {}), schedule)


def test_cost_policy_skips_a_hit_that_loads_slower_than_it_recomputes() -> None:
    store = slow_backend(0.05)  # every call 50 ms; 4 pages recompute in 1.6 ms
    try:
        rig = Rig(store, load_policy="cost")
        names = keys(4)
        assert rig.backup(names, rig.fill(4)[0]).stored_pages == 4
        # No observation yet: the prior (1 ms, 1 GiB/s) says loading wins.
        hit = rig.query(names)
        assert (hit.pages, hit.cost_skipped) == (4, False)
        for _ in range(3):
            target = rig.host.alloc(4)
            assert rig.read(names, target).pages == 4
            rig.host.free(target)
        model = rig.controller.cost_model
        assert model is not None
        (storage,) = [t for t in model.stats().tiers if t.tier == Tier.STORAGE]
        assert storage.observations == 3
        hit = rig.query(names)
        assert (hit.pages, hit.local_pages, hit.cost_skipped, hit.agreed) == (0, 4, True, True)
        stats = rig.controller.stats()
        assert (stats.cost_skipped_queries, stats.cost_skipped_pages) == (1, 4)
        assert stats.hit_pages == 4  # only the first query counted

        # The same backend under "always": the hit is loaded.
        always = Rig(store, load_policy=LoadPolicy.ALWAYS)
        hit = always.query(names)
        assert (hit.pages, hit.cost_skipped) == (4, False)
        assert always.controller.stats().cost_skipped_queries == 0
    finally:
        PIPELINES.close_all()
        store.close()


def test_cost_policy_loads_from_a_fast_backend(backend: Backend) -> None:
    # 64 pages = 256 tokens recompute in 256 ms at 1000 tokens/s; a local read is far faster.
    per_token = make_pool().page_spec.nbytes // PAGE
    model = CostModel(
        CostModelConfig(prior_prefill_tokens_per_s=1000.0), bytes_per_token={"kv": per_token}
    )
    rig = Rig(backend, load_policy="cost", cost=model, batch_pages=64)
    names = keys(64)
    assert rig.backup(names, rig.fill(64)[0]).stored_pages == 64
    for _ in range(3):
        target = rig.host.alloc(64)
        assert rig.read(names, target).pages == 64
        rig.host.free(target)
    (storage,) = [t for t in model.stats().tiers if t.tier == Tier.STORAGE]
    assert storage.observations == 3
    hit = rig.query(names)
    assert (hit.pages, hit.cost_skipped) == (64, False)
    decision = model.stats().last_decision
    assert decision is not None
    assert decision.load
    assert decision.n_tokens == 64 * PAGE
    assert rig.controller.stats().cost_skipped_queries == 0
