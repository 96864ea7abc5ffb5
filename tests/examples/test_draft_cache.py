"""The draft cache example through its life cycle, on the ``memory`` and ``file`` backends.

Every read is checked byte for byte against what was written. Faults come from the
backend side: per-key write errors and held calls (``FaultyPageStore``), and an object of
another shape under the same key (a cache reconfigured across a restart).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.pagestores import FaultyPageStore

from examples.draft_cache import DraftCache, DraftCacheConfig, DraftLoaded, DraftStored
from examples.draft_pool import DraftPool, DraftPoolConfig
from sglang_storage.core import DataKind, GetOutcome, Namespace
from sglang_storage.errors import CapacityError, ConfigError, CorruptObjectError, StorageError
from sglang_storage.memory import BudgetConfig, HostMemory, HostMemoryBudget, MemoryFacts
from sglang_storage.policy import EvictionConfig, make_eviction_policy
from sglang_storage.storage import create_backend
from sglang_storage.transfer import PageStore, StoragePipeline, StoragePipelineConfig

NAMESPACE = Namespace(model="draft-model", kind=DataKind.RECORD)
TOKENS = 8
WAIT_S = 10.0


def draft(seed: int, tokens: int = TOKENS) -> torch.Tensor:
    seeded = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (tokens,), dtype=torch.int32, generator=seeded)


def same_bytes(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and got.numpy().tobytes() == want.numpy().tobytes()


@pytest.fixture
def memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=1 << 20, headroom=0), facts=facts))


@pytest.fixture
def open_cache(memory: HostMemory) -> Iterator[Callable[..., DraftCache]]:
    """Builds caches (pool + pipeline + LRU) over a store; closes what it built afterwards."""
    opened: list[tuple[DraftCache, StoragePipeline, DraftPool]] = []

    def build(store: PageStore, *, capacity: int = 4, tokens: int = TOKENS) -> DraftCache:
        pool = DraftPool(DraftPoolConfig(tokens=tokens, capacity=capacity), memory)
        pipeline = StoragePipeline(store, StoragePipelineConfig(workers=2))
        cache = DraftCache(
            DraftCacheConfig(namespace=NAMESPACE),
            pool=pool,
            pipeline=pipeline,
            eviction=make_eviction_policy(EvictionConfig(name="lru")),
        )
        opened.append((cache, pipeline, pool))
        return cache

    yield build
    # Shut down from the top: settle the manager's transfers, stop the workers, free memory.
    for cache, pipeline, pool in opened:
        cache.drain(WAIT_S)
        pipeline.close(timeout_s=WAIT_S)
        pool.close()


@pytest.mark.parametrize("backend_name", ["memory", "file"])
def test_life_cycle(
    backend_name: str, tmp_path: Path, open_cache: Callable[..., DraftCache]
) -> None:
    options = {"root": str(tmp_path)} if backend_name == "file" else {}
    backend = create_backend(backend_name, options)
    drafts = {f"d{i}": draft(i) for i in range(6)}
    cache = open_cache(backend)

    # Write-through: the first four fill the pool.
    for name in ["d0", "d1", "d2", "d3"]:
        assert cache.put(name, drafts[name])
    assert not cache.put("d0", drafts["d0"]), "a draft already here is kept"
    events = cache.drain(WAIT_S)
    assert sorted(events, key=lambda e: e.name) == [
        DraftStored(name=n, ok=True) for n in ["d0", "d1", "d2", "d3"]
    ]
    for name in ["d1", "d2", "d3", "d0"]:  # d1 is now the least recently used
        assert same_bytes(cache.get(name), drafts[name])

    # A full pool gives up its least recently used drafts; storage still has them.
    assert cache.put("d4", drafts["d4"])
    assert cache.put("d5", drafts["d5"])
    assert all(isinstance(e, DraftStored) and e.ok for e in cache.drain(WAIT_S))
    assert cache.get("d1") is None
    assert cache.get("d2") is None
    assert cache.load("d1")
    assert not cache.load("d1"), "already loading"
    assert cache.drain(WAIT_S) == [DraftLoaded(name="d1", outcome=GetOutcome.HIT)]
    assert same_bytes(cache.get("d1"), drafts["d1"])

    # A fresh cache over the same store (reopened, for the file backend) loads every draft.
    if backend_name == "file":
        backend.close()
        backend = create_backend(backend_name, options)
    fresh = open_cache(backend, capacity=6)
    for name in drafts:
        assert fresh.load(name)
    loaded = fresh.drain(WAIT_S)
    assert all(isinstance(e, DraftLoaded) and e.hit for e in loaded)
    assert len(loaded) == len(drafts)
    for name, tokens in drafts.items():
        assert same_bytes(fresh.get(name), tokens)
    assert fresh.in_flight == 0


def test_unknown_draft_is_a_miss(open_cache: Callable[..., DraftCache]) -> None:
    cache = open_cache(create_backend("memory"))
    assert cache.load("never-written")
    assert cache.drain(WAIT_S) == [DraftLoaded(name="never-written", outcome=GetOutcome.MISS)]
    assert cache.get("never-written") is None


def test_failed_write_is_an_event_and_keeps_the_draft(
    open_cache: Callable[..., DraftCache],
) -> None:
    store = FaultyPageStore()
    store.error_keys.add(NAMESPACE.key("lost"))
    cache = open_cache(store)
    tokens = draft(7)
    cache.put("lost", tokens)
    cache.put("kept", draft(8))
    events = {event.name: event for event in cache.drain(WAIT_S)}
    lost = events["lost"]
    assert isinstance(lost, DraftStored)
    assert not lost.ok
    assert isinstance(lost.error, StorageError)
    assert events["kept"] == DraftStored(name="kept", ok=True)
    assert same_bytes(cache.get("lost"), tokens), "the host copy is still good"
    # The double stored the object before reporting the error (a write that landed but
    # was reported failed, as after a timeout): a later load finds it whole.
    store.error_keys.clear()
    fresh = open_cache(store)
    fresh.load("lost")
    assert fresh.drain(WAIT_S) == [DraftLoaded(name="lost", outcome=GetOutcome.HIT)]
    assert same_bytes(fresh.get("lost"), tokens)


def test_object_of_another_shape_is_corrupt_and_never_delivered(
    open_cache: Callable[..., DraftCache],
) -> None:
    backend = create_backend("memory")
    old = open_cache(backend, tokens=TOKENS)
    old.put("x", draft(1))
    old.drain(WAIT_S)
    shorter = open_cache(backend, tokens=TOKENS // 2)
    shorter.load("x")
    [event] = shorter.drain(WAIT_S)
    assert isinstance(event, DraftLoaded)
    assert event.outcome is GetOutcome.CORRUPT
    assert isinstance(event.error, CorruptObjectError)
    assert shorter.get("x") is None


def test_slots_in_flight_are_never_evicted(open_cache: Callable[..., DraftCache]) -> None:
    store = FaultyPageStore()
    store.gate.clear()  # hold every backend call
    cache = open_cache(store, capacity=2)
    with store.released_on_exit():
        cache.put("a", draft(1))
        cache.put("b", draft(2))
        with pytest.raises(CapacityError):
            cache.put("c", draft(3))
        assert cache.in_flight == 2
    assert len(cache.drain(WAIT_S)) == 2
    assert cache.put("c", draft(3)), "a settled draft can be evicted now"
    assert cache.get("a") is None
    assert same_bytes(cache.get("b"), draft(2))


def test_bad_tokens_are_refused_and_leak_nothing(open_cache: Callable[..., DraftCache]) -> None:
    cache = open_cache(create_backend("memory"), capacity=1)
    with pytest.raises(ConfigError):
        cache.put("bad", torch.zeros(TOKENS, dtype=torch.int64))
    assert cache.put("good", draft(1)), "the slot was given back"


def test_the_cache_starts_no_threads(open_cache: Callable[..., DraftCache]) -> None:
    backend = create_backend("memory")
    cache = open_cache(backend)  # the pipeline's workers start here
    before = threading.active_count()
    for i in range(2):
        cache.put(f"t{i}", draft(i))
        cache.load(f"u{i}")
    cache.drain(WAIT_S)
    assert threading.active_count() == before
