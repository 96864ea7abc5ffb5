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

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from support.fault_matrix import (
    WAIT_BOUND_S,
    Watch,
    host_memory,
    open_inner,
    schedules,
)
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
    EmbeddingPool,
    EmbeddingPoolConfig,
    HostMemory,
)
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage import (
    Backend,
    Durability,
    FaultInjectingBackend,
    FileBackend,
    FileBackendConfig,
)
from sglang_storage.transfer import PageStore, StoragePipeline, StoragePipelineConfig

LEDGER_AREA = "fault matrix: embedding cache"

SCHEDULES = schedules(300)

DIM = 32
ROWS_PER_PAGE = 4
PAGE_BYTES = ROWS_PER_PAGE * DIM * 2  # bfloat16
ENTRIES = 32
BATCH = 4
MODEL = "test-embedding-faults"


def _memory() -> HostMemory:
    return host_memory(16 << 20)


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


@pytest.fixture(params=["memory", "file"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend = open_inner(request.param, tmp_path / "embedding")
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
