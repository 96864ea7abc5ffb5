"""Fault matrix, embedding cache: seeded fault schedules x the encoder embedding cache.

A writer cache inserts encoder outputs (variable row counts, keyed by content hash) and puts
them to storage through a :class:`~sglang_storage.storage.FaultInjectingBackend` around the
real ``memory`` and ``file`` (``durability=full``) backends; a reader cache with a smaller
host pool (so it evicts) prefetches them in batches and loads what is READY. Asserted, and
recorded in the ledger: every row loaded equals what was inserted (a miss or an error event
is fine), no call or wait passes its bound, no host rows stay pinned, and once faults stop
every acknowledged entry (not destroyed on purpose) reads back exactly (after reopening the
store, for ``file``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import torch
from support.ledger import Ledger

from sglang_storage.core import GetOutcome, PutOutcome
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
)
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage import (
    Backend,
    Durability,
    FaultInjectingBackend,
    FaultSchedule,
    FileBackend,
    FileBackendConfig,
    MemoryBackend,
)
from sglang_storage.transfer import PageStore, StoragePipeline, StoragePipelineConfig

LEDGER_AREA = "fault matrix: embedding cache"

SCHEDULES = {
    "errors": FaultSchedule(seed=301, error_rate=0.15, partial_batch_rate=0.2),
    "slow": FaultSchedule(
        seed=302, latency_rate=0.3, latency_s=0.005, timeout_rate=0.1, timeout_s=0.02
    ),
    "media": FaultSchedule(seed=303, vanish_rate=0.1, torn_write_rate=0.15, bit_flip_rate=0.15),
    "all": FaultSchedule(
        seed=304,
        error_rate=0.05,
        partial_batch_rate=0.1,
        latency_rate=0.1,
        latency_s=0.005,
        timeout_rate=0.05,
        timeout_s=0.02,
        vanish_rate=0.05,
        torn_write_rate=0.05,
        bit_flip_rate=0.05,
    ),
}
WAIT_BOUND_S = 15.0
"""The longest any wait for the manager may take; past it, a hang."""
CALL_BOUND_S = 5.0
"""The longest one manager call may block the scheduler thread; past it, a hang."""

DIM = 32
ROWS_PER_PAGE = 4
PAGE_BYTES = ROWS_PER_PAGE * DIM * 2  # bfloat16
ENTRIES = 32
BATCH = 4
MODEL = "test-embedding-faults"


def _memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0), facts=facts))


def _cache(
    store: PageStore, pages: int, *, merge: bool = True
) -> tuple[EmbeddingCacheManager, EmbeddingPool, StoragePipeline]:
    config = EmbeddingPoolConfig(
        dim=DIM, dtype=torch.bfloat16, capacity=pages * PAGE_BYTES, rows_per_page=ROWS_PER_PAGE
    )
    pool = EmbeddingPool(config, _memory())
    pipeline = StoragePipeline(store, StoragePipelineConfig(workers=2, merge_ops=merge))
    manager = EmbeddingCacheManager(EmbeddingCacheConfig(model=MODEL), pool, LRUPolicy(), pipeline)
    return manager, pool, pipeline


def _entries(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    entries = {}
    for i in range(ENTRIES):
        rows = torch.randn((1 + i % 8, DIM), generator=gen).to(torch.bfloat16)
        entries[content_hash(rows, f"item{i}".encode())] = rows
    return entries


def _wrong_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


class Watch:
    """Bounds on the scheduler thread's calls and waits; a bound passed is a hang."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def call(self, fn: Callable[[], object]) -> object:
        """Run one manager call, counted as an operation; a slow one is a hang."""
        start = time.monotonic()
        result = fn()
        self.ledger.operation()
        if time.monotonic() - start > CALL_BOUND_S:
            self.ledger.hang()
        return result

    def until(self, poll: Callable[[], None], done: Callable[[], bool]) -> bool:
        """Poll until ``done()``; False (and a hang) once the bound passes."""
        end = time.monotonic() + WAIT_BOUND_S
        while time.monotonic() < end:
            poll()
            if done():
                return True
        self.ledger.hang()
        return False


@pytest.fixture(params=["memory", "file"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend: Backend
    if request.param == "memory":
        backend = MemoryBackend()
    else:
        root = tmp_path / "embedding"
        backend = FileBackend(FileBackendConfig(root=root, durability=Durability.FULL))
    yield backend
    backend.close()


def _read_all(store: PageStore, entries: dict[str, torch.Tensor], watch: Watch) -> tuple[int, int]:
    """Prefetch and load ``entries`` through a small reader cache: (wrong bytes, hits)."""
    manager, pool, pipeline = _cache(store, pages=16)
    wrong = hits = 0
    keys = list(entries)
    try:
        for first in range(0, len(keys), BATCH):
            batch = keys[first : first + BATCH]
            rows = [entries[k].shape[0] for k in batch]
            states = watch.call(lambda b=batch, r=rows: manager.prefetch(b, r))  # type: ignore[misc]
            assert isinstance(states, list)
            loading = {k for k, s in zip(batch, states, strict=True) if s is EmbeddingState.LOADING}
            events: list[EmbeddingEvent] = []

            def poll(sink: list[EmbeddingEvent] = events) -> None:
                sink.extend(manager.poll(timeout_s=0.01))

            watch.until(poll, lambda e=events, w=loading: {x.key for x in e} >= w)  # type: ignore[misc]
            for key in batch:
                if manager.state(key) is not EmbeddingState.READY:
                    continue
                out = torch.empty_like(entries[key])
                watch.call(lambda k=key, o=out: manager.load(k, o))  # type: ignore[misc]
                wrong += _wrong_bytes(out, entries[key])
                hits += 1
            fetched = [e for e in events if isinstance(e, EmbeddingFetched)]
            clean = (GetOutcome.HIT, GetOutcome.MISS)
            assert all((e.outcome in clean) == (e.error is None) for e in fetched)
        assert pool.stats().pinned_bytes == 0
    finally:
        pipeline.close(timeout_s=WAIT_BOUND_S)
    return wrong, hits


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_embedding_cache_under_faults_loads_only_correct_rows(
    inner: Backend, schedule: str, seed: int, ledger: Ledger
) -> None:
    store = FaultInjectingBackend(inner, attrs.evolve(SCHEDULES[schedule], seed=seed))
    watch = Watch(ledger)
    entries = _entries(seed)
    writer, writer_pool, pipeline = _cache(store, pages=96, merge=False)
    events: list[EmbeddingEvent] = []
    try:
        for key, rows in entries.items():
            watch.call(lambda k=key, r=rows: writer.insert(k, r))  # type: ignore[misc]

        def poll() -> None:
            events.extend(writer.poll(timeout_s=0.01))

        watch.until(poll, lambda: len(events) >= ENTRIES)
        assert writer_pool.stats().pinned_bytes == 0
    finally:
        pipeline.close(timeout_s=WAIT_BOUND_S)
    acked = {
        e.key: entries[e.key]
        for e in events
        if isinstance(e, EmbeddingStored) and e.outcome is not PutOutcome.ERROR
    }
    wrong, hits = _read_all(store, entries, watch)  # faults still on
    ledger.wrong(wrong)
    ledger.add_faults(store.fault_stats().by_kind)

    store.pause()  # faults stop
    survivor: Backend = inner
    if isinstance(inner, FileBackend):
        inner.close()
        survivor = FileBackend(FileBackendConfig(root=inner.root, durability=Durability.FULL))
    damaged = {key.name for key in store.damaged_keys()}
    kept = {k: v for k, v in acked.items() if k not in damaged}
    try:
        wrong, survived = _read_all(survivor, kept, Watch(Ledger("lost check", "scratch")))
    finally:
        if survivor is not inner:
            survivor.close()
    ledger.operation(len(kept))
    ledger.lost(len(kept) - survived + (wrong > 0))

    assert ledger.wrong_bytes == 0
    assert ledger.hangs == 0
    assert ledger.lost_durable == 0
    assert sum(ledger.faults.values()) > 0, "the schedule injected nothing"
    assert hits > 0, "nothing was loaded: the test checked no delivery"
