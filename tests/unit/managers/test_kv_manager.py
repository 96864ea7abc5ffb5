"""The KV cache manager on CPU: the full tier life cycle, side data as one unit, faults, ranks.

Every life cycle runs against the real ``memory`` and ``file`` backends with CPU tensors as
the device: device pages go to host and storage, leave the host, come back from storage
and are loaded into other device pages, which must then equal the originals bit for bit
(the side records too). Faults are injected by a wrapper around the real backend
(corrupt or vanished objects, failing or held puts and gets) and by rank-sync doubles.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from support.faults import FaultyBackend, FaultyIO
from support.pagestores import FakeClock

from sglang_storage.errors import ConfigError, StateError
from sglang_storage.managers.kv import (
    BackupDone,
    HostReleased,
    HostWriteDone,
    KVCacheConfig,
    KVCacheManager,
    KVEvent,
    PrefetchDone,
    SidePool,
    TierHits,
)
from sglang_storage.managers.ranks import SingleRank
from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    MemoryFacts,
    RecordPool,
    RecordPoolConfig,
)
from sglang_storage.policy import (
    PrefetchStopConfig,
    WritePolicyConfig,
    make_prefetch_stop_policy,
    make_write_policy,
)
from sglang_storage.storage import Backend, create_backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint, page_hashes
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceKV,
    StoragePipeline,
    StoragePipelineConfig,
)

PAGE = 4
DEVICE_PAGES = 32
HOST_PAGES = 16
PAGES = 6
WAIT_S = 10.0
NAMESPACE = kv_namespace(model_fingerprint("test/kv", page_size=PAGE), mla=False)


class NoAgreement:
    """A rank sync double whose other ranks never answer the ops named in ``fail``."""

    rank, world_size = 0, 2

    def __init__(self, *fail: str) -> None:
        self.fail = set(fail)
        self.calls: list[str] = []

    def agree_min(self, op: str, value: int, *, timeout_s: float) -> int | None:
        self.calls.append(op)
        return None if op in self.fail else value


class OtherRankHas:
    """A rank sync double whose other rank reports at most ``limit``."""

    rank, world_size = 0, 2

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def agree_min(self, op: str, value: int, *, timeout_s: float) -> int | None:
        return min(value, self.limit)


def memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0), facts=facts))


def geometry() -> KVGeometry:
    return KVGeometry(
        attention=Attention.MHA,
        layout=KVLayout.PAGE_FIRST,
        dtype=torch.bfloat16,
        layer_num=2,
        page_size=PAGE,
        num_pages=HOST_PAGES,
        head_num=2,
        head_dim=8,
    )


def random_device(g: KVGeometry) -> DeviceKV:
    kv = DeviceKV.allocate(g, DEVICE_PAGES * PAGE)
    gen = torch.Generator().manual_seed(7)
    for layer in range(g.layer_num):
        for plane in kv.planes(layer):
            bits = torch.randint(-(2**15), 2**15, plane.shape, generator=gen, dtype=torch.int16)
            plane.view(torch.int16).copy_(bits)
    return kv


def tokens(pages: Sequence[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)], dtype=torch.int64)


def same_bits(kv: DeviceKV, src: Sequence[int], dst: Sequence[int]) -> bool:
    a, b = tokens(src), tokens(dst)
    return all(
        torch.equal(plane.view(torch.int16)[a], plane.view(torch.int16)[b])
        for layer in range(kv.geometry.layer_num)
        for plane in kv.planes(layer)
    )


class Rig:
    """A manager over real pools, pipelines and a (faulty-wrapped) real backend."""

    def __init__(
        self,
        backend: Backend,
        *,
        write: str = "write_through",
        stop: str = "wait_complete",
        ranks: object = None,
        sides: bool = True,
        side_kind: str = "record",
    ) -> None:
        g = geometry()
        self.clock = FakeClock(start=100.0)
        self.device = random_device(g)
        self.host = KVHostPool(g, memory())
        self.records: RecordPool | KVHostPool = RecordPool(
            RecordPoolConfig(shape=(3,), dtype=torch.float32, capacity=HOST_PAGES), memory()
        )
        side_rows = torch.randn(PAGES, 3, generator=torch.Generator().manual_seed(3))
        if side_kind == "kv":  # an indexer-like second KV pool: MLA, one layer
            side_geometry = KVGeometry(
                attention=Attention.MLA,
                layout=KVLayout.PAGE_FIRST,
                dtype=torch.bfloat16,
                layer_num=1,
                page_size=PAGE,
                num_pages=HOST_PAGES,
                head_num=1,
                head_dim=5,
            )
            self.records = KVHostPool(side_geometry, memory())
            side_rows = torch.randn(PAGES, side_geometry.page_numel).to(torch.bfloat16)
        self.io = FaultyIO(self.device, self.host)
        # Exists answers while the gate holds gets and puts; error keys fail puts only.
        self.store = FaultyBackend(
            backend, name=backend.name, gated={"get", "put"}, key_errors_on={"put"}
        )
        self.storage = StoragePipeline(self.store, StoragePipelineConfig(workers=2, batch_pages=4))
        self.manager = KVCacheManager(
            host=self.host,
            device=DeviceHostPipeline(self.device, self.host, io_backend=self.io),
            storage=self.storage,
            namespace=NAMESPACE,
            write_policy=make_write_policy(WritePolicyConfig(name=write)),  # type: ignore[arg-type]
            prefetch_policy=make_prefetch_stop_policy(
                PrefetchStopConfig(name=stop, threshold_tokens=0),  # type: ignore[arg-type]
                page_size=PAGE,
                clock=self.clock,
            ),
            ranks=ranks if ranks is not None else SingleRank(),  # type: ignore[arg-type]
            side_pools=[SidePool(name="mamba", pool=self.records)] if sides else [],
            config=KVCacheConfig(rank_timeout_s=1.0, prefetch_batch_pages=2),
        )
        self.keys = page_hashes(list(range(1000, 1000 + PAGES * PAGE)), PAGE)
        self.side = {"mamba": side_rows}
        self.events: list[KVEvent] = []

    def until(self, done: Callable[[], bool]) -> list[KVEvent]:
        """Poll until ``done()``; return the events seen on the way."""
        seen: list[KVEvent] = []
        for _ in range(int(WAIT_S / 0.005)):
            new = self.manager.poll()
            seen += new
            self.events += new
            if done():
                return seen
            threading.Event().wait(0.005)
        raise AssertionError(f"timed out; events so far: {seen}")

    def fetch(self, rid: str, keys: Sequence[str]) -> PrefetchDone:
        """Prefetch ``keys`` and check it until it ends."""
        assert self.manager.prefetch(rid, keys)
        result: list[PrefetchDone] = []

        def check() -> bool:
            done = self.manager.check_prefetch(rid)
            if done is not None:
                result.append(done)
            return bool(result)

        self.until(check)
        return result[0]

    def used(self) -> tuple[int, int]:
        return self.host.slots.stats().used, self.records.slots.stats().used


E = TypeVar("E", HostWriteDone, BackupDone, HostReleased)


def wait_events(rig: Rig, kind: type[E], count: int = 1) -> list[E]:
    rig.until(lambda: sum(isinstance(e, kind) for e in rig.events) >= count)
    return [e for e in rig.events if isinstance(e, kind)]


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    store = create_backend(
        request.param, {"root": str(tmp_path)} if request.param == "file" else {}
    )
    yield store
    store.close()


@pytest.fixture
def make_rig(backend: Backend) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(**options: object) -> Rig:
        rigs.append(Rig(backend, **options))  # type: ignore[arg-type]
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.store.gate.set()
        rig.storage.close(timeout_s=WAIT_S)


def store_all(rig: Rig) -> None:
    """Write the rig's pages device -> host -> storage (write-through), then evict the host."""
    write = rig.manager.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side)
    assert write is not None
    assert write.keys == tuple(rig.keys)
    [done] = wait_events(rig, BackupDone)
    assert done == BackupDone(stored=tuple(rig.keys), failed=())
    assert isinstance(rig.events[0], HostWriteDone)
    assert rig.events[0].error is None
    rig.manager.evict_host(rig.keys)
    wait_events(rig, HostReleased)
    assert rig.used() == (0, 0)


# ---------------------------------------------------------------------- life cycle


@pytest.mark.parametrize("side_kind", ["record", "kv"])
def test_full_life_cycle_is_byte_identical(make_rig: Callable[..., Rig], side_kind: str) -> None:
    rig = make_rig(side_kind=side_kind)
    m = rig.manager
    write = m.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side)
    assert write is not None
    wait_events(rig, BackupDone)
    assert m.match(rig.keys, device_pages=1) == TierHits(
        device_pages=1, host_pages=PAGES - 1, storage_pages=0
    )
    m.evict_host(rig.keys)
    [released] = wait_events(rig, HostReleased)
    assert set(released.keys) == set(rig.keys)
    assert rig.used() == (0, 0)
    assert m.match(rig.keys) == TierHits(device_pages=0, host_pages=0, storage_pages=PAGES)

    done = rig.fetch("r1", rig.keys)
    assert done == PrefetchDone(
        request_id="r1", keys=tuple(rig.keys), requested_pages=PAGES, agreed=True
    )
    assert m.match(rig.keys).host_pages == PAGES
    target = list(range(20, 20 + PAGES))
    load = m.load(rig.keys, tokens(target))
    assert load.handle.wait().ok
    m.layer_counter.set_consumer(load.handle)
    for layer in range(2):
        m.layer_counter.wait(layer)
    assert same_bits(rig.device, range(PAGES), target)
    assert torch.equal(load.side["mamba"].view(torch.int16), rig.side["mamba"].view(torch.int16))
    m.poll()
    stats = m.stats()
    assert (stats.written_pages, stats.backed_up_pages, stats.loaded_pages) == (6, 6, 6)
    assert (stats.device_hit_pages, stats.host_hit_pages, stats.storage_hit_pages) == (1, 11, 6)
    assert (stats.prefetched_pages, stats.dropped_pages, stats.rank_misses) == (6, 0, 0)
    assert stats.host_pages == PAGES


def test_write_through_selective_writes_on_the_second_hit(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(write="write_through_selective")
    assert rig.manager.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side) is None
    write = rig.manager.device_hit(rig.keys[:3], tokens(range(3)), side=rig.side)
    assert write is not None
    assert write.keys == tuple(rig.keys[:3])
    [done] = wait_events(rig, BackupDone)
    assert done.stored == tuple(rig.keys[:3])
    # Already on host: a third hit writes nothing.
    assert rig.manager.device_hit(rig.keys[:3], tokens(range(3)), side=rig.side) is None


def test_write_back_backs_up_on_host_eviction_and_frees_after_the_ack(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(write="write_back")
    m = rig.manager
    assert m.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side) is None
    write = m.device_evict(rig.keys, tokens(range(PAGES)), side=rig.side)
    assert write is not None
    wait_events(rig, HostWriteDone)
    assert not any(isinstance(e, BackupDone) for e in rig.events)  # nothing written yet
    rig.store.gate.clear()  # hold the backup
    m.evict_host(rig.keys)
    for _ in range(5):
        assert not any(isinstance(e, HostReleased) for e in m.poll())
    assert rig.used() == (PAGES, PAGES)  # not released before the acknowledgement
    rig.store.gate.set()
    wait_events(rig, HostReleased)
    assert rig.used() == (0, 0)
    assert m.stats().backed_up_pages == PAGES
    # What write-back stored reads back bit for bit.
    done = rig.fetch("r", rig.keys)
    assert len(done.keys) == PAGES
    load = m.load(done.keys, tokens(range(10, 16)))
    assert load.handle.wait().ok
    assert same_bits(rig.device, range(PAGES), range(10, 16))


# ---------------------------------------------------------------------- side data as one unit


@pytest.mark.parametrize("fault", ["corrupt", "vanished"])
@pytest.mark.parametrize("part", ["kv", "side"])
def test_a_bad_part_truncates_the_hit_and_nothing_past_it_is_delivered(
    make_rig: Callable[..., Rig], fault: str, part: str
) -> None:
    rig = make_rig()
    store_all(rig)
    bad = NAMESPACE.key(rig.keys[3] + ("" if part == "kv" else "-mamba"))
    getattr(rig.store, fault).add(bad)
    assert rig.manager.storage_hit_pages(rig.keys) == PAGES  # exists says yes...
    done = rig.fetch("r", rig.keys)
    assert done.keys == tuple(rig.keys[:3])  # ...the read says the prefix ends at page 3
    assert rig.manager.host_hit_pages(rig.keys) == 3
    with pytest.raises(StateError):
        rig.manager.load(rig.keys[:4], tokens(range(20, 24)))
    rig.manager.poll()
    assert rig.used() == (3, 3)  # pages past the hit were given back
    assert rig.manager.stats().prefetch_truncated_pages == PAGES - 3


def test_a_missing_side_object_ends_the_storage_hit(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    store_all(rig)
    rig.store.inner.delete([NAMESPACE.key(rig.keys[2] + "-mamba")])
    assert rig.manager.storage_hit_pages(rig.keys) == 2
    assert rig.manager.match(rig.keys).storage_pages == 2


# ---------------------------------------------------------------------- backend failures


def test_failed_backup_is_reported_and_the_page_is_dropped_on_eviction(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig()
    rig.store.fail_puts = True
    rig.manager.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side)
    [done] = wait_events(rig, BackupDone)
    assert done == BackupDone(stored=(), failed=tuple(rig.keys))
    assert rig.manager.match(rig.keys).host_pages == PAGES  # still served from host
    rig.manager.evict_host(rig.keys)
    wait_events(rig, HostReleased)
    stats = rig.manager.stats()
    assert (stats.backup_failed_pages, stats.dropped_pages, stats.backed_up_pages) == (6, 6, 0)
    assert rig.manager.storage_hit_pages(rig.keys) == 0


def test_a_side_part_that_failed_to_store_is_not_a_backup(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.store.error_keys.add(NAMESPACE.key(rig.keys[4] + "-mamba"))
    rig.manager.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side)
    [done] = wait_events(rig, BackupDone)
    assert done.failed == (rig.keys[4],)
    assert len(done.stored) == PAGES - 1
    assert rig.manager.storage_hit_pages(rig.keys) == 4


def test_backup_in_flight_holds_the_host_page_until_acknowledged(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig()
    rig.store.gate.clear()
    rig.manager.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side)
    wait_events(rig, HostWriteDone)
    rig.manager.evict_host(rig.keys)
    assert rig.manager.host_hit_pages(rig.keys) == 0
    for _ in range(5):
        assert not any(isinstance(e, HostReleased) for e in rig.manager.poll())
    assert rig.used() == (PAGES, PAGES)
    rig.store.gate.set()
    wait_events(rig, HostReleased)
    assert rig.used() == (0, 0)
    assert rig.manager.stats().dropped_pages == 0
    assert rig.manager.storage_hit_pages(rig.keys) == PAGES


def test_a_prefetch_landing_on_a_host_copy_being_released_keeps_that_copy(
    make_rig: Callable[..., Rig],
) -> None:
    # The replay demo found this: a prefetch of pages whose host copies were released
    # meanwhile (backup acks not yet drained) reported them delivered, and load() then
    # refused them. Now the released copy is wanted again and stays.
    rig = make_rig()
    m = rig.manager
    store_all(rig)
    rig.store.gate.clear()
    assert m.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side) is not None
    wait_events(rig, HostWriteDone, count=2)  # the backups (PRESENT) are now held
    assert m.prefetch("r", rig.keys)
    m.evict_host(rig.keys)
    assert m.host_hit_pages(rig.keys) == 0
    rig.store.gate.set()
    done: PrefetchDone | None = None
    for _ in range(int(WAIT_S / 0.005)):  # no poll(): the backup acks stay undrained
        done = m.check_prefetch("r")
        if done is not None:
            break
        threading.Event().wait(0.005)
    assert done is not None
    assert done.keys == tuple(rig.keys)
    assert m.host_hit_pages(rig.keys) == PAGES
    target = list(range(20, 20 + PAGES))
    load = m.load(rig.keys, tokens(target))
    assert load.handle.wait().ok
    assert same_bits(rig.device, range(PAGES), target)
    for _ in range(5):
        assert not any(isinstance(e, HostReleased) for e in m.poll())
    assert rig.used() == (PAGES, PAGES)  # one copy each; the prefetched slots went back


def test_failed_device_copies_give_pages_back_and_store_nothing(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig()
    rig.io.fail = True
    assert rig.manager.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side) is not None
    [done] = wait_events(rig, HostWriteDone)
    assert done.error is not None
    wait_events(rig, HostReleased)
    assert rig.used() == (0, 0)
    assert not any(isinstance(e, BackupDone) for e in rig.events)
    assert rig.manager.host_hit_pages(rig.keys) == 0
    # A failed load is reported through its handle; the host pages stay usable.
    rig.io.fail = False
    rig.manager.device_hit(rig.keys, tokens(range(PAGES)), side=rig.side)
    wait_events(rig, BackupDone)
    rig.io.fail = True
    assert not rig.manager.load(rig.keys, tokens(range(20, 26))).handle.wait().ok
    rig.manager.poll()
    assert rig.manager.stats().loaded_pages == 0
    assert rig.manager.host_hit_pages(rig.keys) == PAGES


def test_a_failing_exists_is_zero_storage_hits(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    store_all(rig)
    rig.store.fail_exists = True
    assert rig.manager.storage_hit_pages(rig.keys) == 0


# ---------------------------------------------------------------------- prefetch stop policy


def test_timeout_policy_ends_a_stuck_prefetch_and_frees_its_pages_later(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(stop="timeout")
    store_all(rig)
    rig.store.gate.clear()  # every get is stuck
    m = rig.manager
    assert m.prefetch("r", rig.keys)
    rig.until(lambda: rig.store.started["get"] > 0)
    assert m.check_prefetch("r") is None
    rig.clock.advance(1.0)  # SGLang's deadline: 1 s + 6 pages * 4/1024 * 0.25 s
    assert m.check_prefetch("r") is None
    rig.clock.advance(0.01)
    done = m.check_prefetch("r")
    assert done is not None
    assert done.keys == ()
    assert done.agreed
    assert rig.used() != (0, 0)  # the stuck gets still write into their pages
    rig.store.gate.set()
    rig.until(lambda: rig.used() == (0, 0))


def test_best_effort_returns_what_landed(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(stop="best_effort")
    store_all(rig)
    m = rig.manager
    assert m.prefetch("r", rig.keys)
    rig.until(lambda: rig.storage.metrics().in_flight == 0)
    done = m.check_prefetch("r")
    assert done is not None
    assert done.keys == tuple(rig.keys)


# ---------------------------------------------------------------------- rank agreement


def test_no_rank_agreement_on_storage_hits_is_a_miss(make_rig: Callable[..., Rig]) -> None:
    ranks = NoAgreement("storage_hit")
    rig = make_rig(ranks=ranks)
    store_all(rig)
    assert rig.manager.storage_hit_pages(rig.keys) == 0
    assert rig.manager.match(rig.keys) == TierHits(device_pages=0, host_pages=0, storage_pages=0)
    assert rig.manager.stats().rank_misses == 2


def test_no_rank_agreement_to_start_starts_nothing(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(ranks=NoAgreement("prefetch_start"))
    store_all(rig)
    assert not rig.manager.prefetch("r", rig.keys)
    assert rig.used() == (0, 0)
    with pytest.raises(StateError):
        rig.manager.check_prefetch("r")


@pytest.mark.parametrize("op", ["prefetch_stop", "prefetch_hit"])
def test_no_rank_agreement_on_a_prefetch_is_a_miss_and_releases_everything(
    make_rig: Callable[..., Rig], op: str
) -> None:
    ranks = NoAgreement(op)
    rig = make_rig(ranks=ranks)
    store_all(rig)
    done = rig.fetch("r", rig.keys)
    assert done == PrefetchDone(request_id="r", keys=(), requested_pages=PAGES, agreed=False)
    rig.until(lambda: rig.used() == (0, 0))
    assert rig.manager.stats().rank_misses == 1
    assert rig.manager.stats().prefetched_pages == 0
    assert rig.manager.host_hit_pages(rig.keys) == 0
    assert ranks.calls[-1] == op


def test_the_agreed_hit_is_the_minimum_over_ranks(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(ranks=OtherRankHas(4))
    store_all(rig)
    assert rig.manager.storage_hit_pages(rig.keys) == 4
    done = rig.fetch("r", rig.keys)
    assert done.keys == tuple(rig.keys[:4])
    rig.manager.poll()
    assert rig.used() == (4, 4)


# ---------------------------------------------------------------------- arguments


def test_configuration_and_argument_errors(make_rig: Callable[..., Rig]) -> None:
    with pytest.raises(ConfigError, match="rank_timeout_s"):
        KVCacheConfig(rank_timeout_s=0)
    with pytest.raises(ConfigError, match="name"):
        SidePool(name="Bad Name", pool=geometry_pool())
    rig = make_rig()
    with pytest.raises(ConfigError, match="side"):
        rig.manager.device_hit(rig.keys, tokens(range(PAGES)))
    assert rig.used() == (0, 0)
    with pytest.raises(StateError):
        rig.manager.load(rig.keys, tokens(range(PAGES)))
    with pytest.raises(ConfigError, match="page size"):
        KVCacheManager(
            host=rig.host,
            device=DeviceHostPipeline(rig.device, rig.host),
            storage=None,
            namespace=NAMESPACE,
            write_policy=make_write_policy(WritePolicyConfig()),
            prefetch_policy=make_prefetch_stop_policy(PrefetchStopConfig(), page_size=8),
        )


def test_without_storage_the_host_is_the_last_tier() -> None:
    g = geometry()
    device = random_device(g)
    host = KVHostPool(g, memory())
    m = KVCacheManager(
        host=host,
        device=DeviceHostPipeline(device, host),
        storage=None,
        namespace=NAMESPACE,
        write_policy=make_write_policy(WritePolicyConfig(name="write_back")),
        prefetch_policy=make_prefetch_stop_policy(PrefetchStopConfig(), page_size=PAGE),
    )
    keys = page_hashes(list(range(PAGES * PAGE)), PAGE)
    assert m.device_evict(keys, tokens(range(PAGES))) is not None
    assert [type(e) for e in m.poll()] == [HostWriteDone]
    assert m.match(keys) == TierHits(device_pages=0, host_pages=PAGES, storage_pages=0)
    assert not m.prefetch("r", keys)
    m.evict_host(keys)
    assert [type(e) for e in m.poll()] == [HostReleased]
    assert m.stats().dropped_pages == PAGES
    assert host.slots.stats().used == 0


def geometry_pool() -> KVHostPool:
    return KVHostPool(geometry(), memory())
