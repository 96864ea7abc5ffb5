"""EmbeddingCacheManager: insert, put, evict, prefetch, load, with real backends and faults."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from support.faults import FaultyBackend, PipelineCloser
from support.pagestores import GatedPageStore

from sglang_storage.core import GetOutcome, PutOutcome
from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.managers.embedding import (
    EmbeddingCacheConfig,
    EmbeddingCacheManager,
    EmbeddingEvent,
    EmbeddingFetched,
    EmbeddingState,
    EmbeddingStored,
    content_hash,
)
from sglang_storage.memory import (
    BudgetConfig,
    EmbeddingPool,
    EmbeddingPoolConfig,
    HostMemory,
    HostMemoryBudget,
    MemoryFacts,
    tensor_bytes,
)
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage import Backend, FileBackend, FileBackendConfig, MemoryBackend
from sglang_storage.transfer import PageStore, StoragePipeline, StoragePipelineConfig

DIM = 64
ROWS_PER_PAGE = 4
PAGE_BYTES = ROWS_PER_PAGE * DIM * 2  # bfloat16
WAIT_S = 10.0


_PIPELINES = PipelineCloser()
_close_pipelines = _PIPELINES.autouse_fixture()


def _memory(total: int = 16 << 20) -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=total, headroom=0), facts=facts))


def _pool(pages: int = 8) -> EmbeddingPool:
    config = EmbeddingPoolConfig(
        dim=DIM, dtype=torch.bfloat16, capacity=pages * PAGE_BYTES, rows_per_page=ROWS_PER_PAGE
    )
    return EmbeddingPool(config, _memory())


class Parts(NamedTuple):
    manager: EmbeddingCacheManager
    pool: EmbeddingPool
    pipeline: StoragePipeline | None


def _parts(
    store: PageStore | None, *, pages: int = 8, rank: int = 0, owner: int | None = None
) -> Parts:
    pipeline = None if store is None else StoragePipeline(store, StoragePipelineConfig(workers=1))
    if pipeline is not None:
        _PIPELINES.track(pipeline)
    config = EmbeddingCacheConfig(model="test-model", rank=rank, owner_rank=owner)
    pool = _pool(pages)
    return Parts(EmbeddingCacheManager(config, pool, LRUPolicy(), pipeline), pool, pipeline)


def _manager(store: PageStore | None, **options: int | None) -> EmbeddingCacheManager:
    return _parts(store, **options).manager  # type: ignore[arg-type]


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn((n, DIM), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _events(manager: EmbeddingCacheManager, count: int) -> list[EmbeddingEvent]:
    events: list[EmbeddingEvent] = []
    end = time.monotonic() + WAIT_S
    while len(events) < count and time.monotonic() < end:
        events += manager.poll(timeout_s=0.2)
    assert len(events) == count, events
    return events


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    store: Backend
    if request.param == "memory":
        store = MemoryBackend()
    else:
        store = FileBackend(FileBackendConfig(root=tmp_path / "store"))
    yield store
    _PIPELINES.close_all()  # before the store: no worker may still be calling it
    store.close()


def _key(seed: int) -> str:
    return content_hash(_rows(1, seed))


# ---------------------------------------------------------------- content hash


def test_content_hash_is_stable_and_covers_dtype_and_shape() -> None:
    t = torch.arange(12, dtype=torch.int32)
    digest = content_hash(t, b"prompt")
    assert len(digest) == 64
    assert digest == content_hash(t.clone(), b"prompt")
    assert digest != content_hash(t.view(3, 4), b"prompt")
    assert digest != content_hash(t.view(torch.float32), b"prompt")
    assert digest != content_hash(b"prompt", t)
    code = (
        "import torch; from sglang_storage.managers.embedding import content_hash; "
        "print(content_hash(torch.arange(12, dtype=torch.int32), b'prompt'))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == digest  # another process, another hash() seed


# ---------------------------------------------------------------- life cycle


def test_insert_put_then_prefetch_and_load_on_another_manager(backend: Backend) -> None:
    writer, reader = _manager(backend), _manager(backend)
    rows = {_key(i): _rows(3 + i, i) for i in range(3)}
    for key, value in rows.items():
        writer.insert(key, value)
        assert writer.state(key) is EmbeddingState.READY
    stored = _events(writer, 3)
    assert {e.key for e in stored} == set(rows)
    assert all(isinstance(e, EmbeddingStored) and e.outcome is PutOutcome.STORED for e in stored)

    states = reader.prefetch(list(rows), [v.shape[0] for v in rows.values()])
    assert states == [EmbeddingState.LOADING] * 3
    fetched = _events(reader, 3)
    assert all(isinstance(e, EmbeddingFetched) and e.outcome is GetOutcome.HIT for e in fetched)
    for key, value in rows.items():
        out = torch.empty_like(value)
        reader.load(key, out)
        assert _same_bytes(out, value)
    # A second prefetch is a host hit; nothing goes to storage.
    assert reader.prefetch(list(rows), [1, 1, 1]) == [EmbeddingState.READY] * 3
    assert reader.poll() == []


def test_eviction_makes_room_and_storage_brings_evicted_rows_back(backend: Backend) -> None:
    manager = _manager(backend, pages=4)  # 16 rows
    first, second, third = (_key(i) for i in range(3))
    manager.insert(first, _rows(8, 0))
    manager.insert(second, _rows(8, 1))
    _events(manager, 2)
    out = torch.empty((8, DIM), dtype=torch.bfloat16)
    manager.load(first, out)  # first is now the most recent: second is the victim
    manager.insert(third, _rows(5, 2))
    assert manager.state(second) is EmbeddingState.ABSENT
    assert manager.state(first) is EmbeddingState.READY
    _events(manager, 1)
    manager.load(third, out[:5])  # third is now the most recent: first is the victim
    assert manager.prefetch([second], [8]) == [EmbeddingState.LOADING]
    assert manager.state(first) is EmbeddingState.ABSENT
    (event,) = _events(manager, 1)
    assert isinstance(event, EmbeddingFetched)
    assert event.outcome is GetOutcome.HIT
    manager.load(second, out)
    assert _same_bytes(out, _rows(8, 1))


def test_entries_with_puts_in_flight_are_never_evicted() -> None:
    store = GatedPageStore()  # holds every backend call until the gate opens
    manager = _manager(store, pages=4)
    with store.released_on_exit():
        manager.insert(_key(0), _rows(16, 0))
        with pytest.raises(CapacityError):
            manager.insert(_key(1), _rows(4, 1))
        assert manager.state(_key(1)) is EmbeddingState.ABSENT
    _events(manager, 1)
    manager.insert(_key(1), _rows(4, 1))  # acknowledged: now evictable
    assert manager.state(_key(0)) is EmbeddingState.ABSENT


def test_host_only_cache_and_non_owner_rank_never_write(backend: Backend) -> None:
    host_only = _manager(None)
    host_only.insert(_key(0), _rows(2, 0))
    assert host_only.poll() == []
    assert host_only.prefetch([_key(1)], [2]) == [EmbeddingState.ABSENT]

    follower = _manager(backend, rank=1, owner=0)
    follower.insert(_key(0), _rows(2, 0))
    assert follower.poll(timeout_s=0.2) == []
    assert backend.exists([follower.config.namespace.key(_key(0))]) == [False]
    owner = _manager(backend, rank=0, owner=0)
    owner.insert(_key(0), _rows(2, 0))
    _events(owner, 1)
    assert follower.prefetch([_key(3)], [2]) == [EmbeddingState.LOADING]
    (miss,) = _events(follower, 1)
    assert isinstance(miss, EmbeddingFetched)
    assert miss.outcome is GetOutcome.MISS
    assert follower.state(_key(3)) is EmbeddingState.ABSENT


# ---------------------------------------------------------------- faults


def test_failed_puts_are_reported_and_the_rows_stay_on_host(backend: Backend) -> None:
    faulty = FaultyBackend(backend)
    manager = _manager(faulty)
    faulty.fail_puts = True
    manager.insert(_key(0), _rows(3, 0))
    (event,) = _events(manager, 1)
    assert isinstance(event, EmbeddingStored)
    assert event.outcome is PutOutcome.ERROR
    assert event.error is not None
    out = torch.empty((3, DIM), dtype=torch.bfloat16)
    manager.load(_key(0), out)
    assert _same_bytes(out, _rows(3, 0))


@pytest.mark.parametrize("fault", ["call", "key", "spec"])
def test_failed_gets_become_misses_and_free_the_rows(backend: Backend, fault: str) -> None:
    faulty = FaultyBackend(backend)
    writer, (reader, reader_pool, _) = _manager(faulty), _parts(faulty)
    writer.insert(_key(0), _rows(4, 0))
    _events(writer, 1)
    faulty.fail_gets = fault == "call"
    if fault == "key":
        faulty.error_keys.add(_key(0))
    rows = 3 if fault == "spec" else 4  # a wrong row count is a spec mismatch: corrupt
    assert reader.prefetch([_key(0)], [rows]) == [EmbeddingState.LOADING]
    with pytest.raises(StateError):
        reader.load(_key(0), torch.empty((rows, DIM), dtype=torch.bfloat16))
    (event,) = _events(reader, 1)
    expected = GetOutcome.CORRUPT if fault == "spec" else GetOutcome.ERROR
    assert isinstance(event, EmbeddingFetched)
    assert event.outcome is expected
    assert reader.state(_key(0)) is EmbeddingState.ABSENT
    stats = reader_pool.stats()
    assert stats.used_bytes == 0
    assert stats.pinned_bytes == 0


def test_refused_submissions_become_errors_and_misses(backend: Backend) -> None:
    manager, pool, pipeline = _parts(backend)
    assert pipeline is not None
    pipeline.close()
    manager.insert(_key(0), _rows(2, 0))
    (event,) = manager.poll()
    assert isinstance(event, EmbeddingStored)
    assert event.outcome is PutOutcome.ERROR
    assert manager.state(_key(0)) is EmbeddingState.READY
    assert manager.prefetch([_key(1)], [2]) == [EmbeddingState.ABSENT]
    assert pool.stats().pinned_bytes == 0


def test_bad_configuration_and_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="model"):
        EmbeddingCacheConfig(model="bad/name")
    with pytest.raises(ConfigError, match="owner_rank"):
        EmbeddingCacheConfig(model="m", owner_rank=-1)
    manager = _manager(None)
    with pytest.raises(ConfigError, match="num_rows"):
        manager.prefetch([_key(0)], [])
    stored = _manager(MemoryBackend())
    with pytest.raises(ConfigError, match="num_rows"):
        stored.prefetch([_key(0), _key(1)], [2, 0])
    with pytest.raises(ConfigError):
        stored.prefetch([_key(0), "bad key"], [2, 2])
    assert stored.state(_key(0)) is EmbeddingState.ABSENT  # refused before any work
    with pytest.raises(ConfigError):
        manager.insert("not a safe name!", _rows(1, 0))
    with pytest.raises(ConfigError, match="contiguous"):
        tensor_bytes(torch.ones((2, 2)).t())
