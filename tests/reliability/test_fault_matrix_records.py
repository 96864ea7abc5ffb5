"""Fault matrix, records: seeded fault schedules x the write-once/read-once record store.

A writer :class:`~sglang_storage.managers.records.RecordStore` writes records of several
dtypes and shapes through a :class:`~sglang_storage.storage.FaultInjectingBackend` around
the real ``memory`` and ``file`` (``durability=full``) backends; records whose put failed
stay on the writer's host and are taken there. Faults then stop: every record storage
acknowledged (not destroyed on purpose) must read back exactly (after reopening the store,
for ``file``). Faults resume (another seed) and a reader store takes every record from
storage. Asserted, and recorded in the ledger: every byte taken equals what was written (a
miss or an error is fine), no call or wait passes its bound, no host bytes stay held.
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
    open_inner,
    schedules,
)
from support.ledger import Ledger

from sglang_storage.core import GetOutcome, GetRequest, PutOutcome
from sglang_storage.managers.records import (
    RecordEvent,
    RecordStore,
    RecordStoreConfig,
    RecordTaken,
    RecordWritten,
    TakeOutcome,
)
from sglang_storage.memory import (
    BlobPool,
    BlobPoolConfig,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    MemoryFacts,
    tensor_bytes,
    tensor_spec,
)
from sglang_storage.storage import (
    Backend,
    Durability,
    FaultInjectingBackend,
    FileBackend,
    FileBackendConfig,
)
from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig

LEDGER_AREA = "fault matrix: records"

SCHEDULES = schedules(400)

RECORDS = 24
MODEL = "test-records-faults"


def _pool() -> BlobPool:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0), facts=facts))
    return BlobPool(BlobPoolConfig(capacity=1 << 20), memory)


def _records(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    made: dict[str, torch.Tensor] = {}
    for i in range(RECORDS):
        kind = i % 4
        if kind == 0:
            made[f"req-{i}.topk_ids"] = torch.randint(0, 150_000, (1 + i % 7, 20), generator=g)
        elif kind == 1:
            made[f"req-{i}.topk_logprobs"] = torch.randn((1 + i % 5, 20), generator=g)
        elif kind == 2:
            made[f"req-{i}.mrope_positions"] = torch.randint(
                0, 4096, (3, 1 + i), generator=g, dtype=torch.int32
            )
        else:
            made[f"req-{i}.rope_deltas"] = torch.randn((1, 1), generator=g).to(torch.bfloat16)
    return made


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(t.contiguous()))


def _wrong_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.dtype != b.dtype or a.shape != b.shape:
        return max(a.nbytes, b.nbytes)
    return sum(x != y for x, y in zip(_bytes(a), _bytes(b), strict=True))


@pytest.fixture(params=["memory", "file"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend = open_inner(request.param, tmp_path / "records")
    yield backend
    backend.close()


def _store(backend: Backend) -> tuple[RecordStore, BlobPool, StoragePipeline]:
    pool = _pool()
    pipeline = StoragePipeline(backend, StoragePipelineConfig(workers=2, merge_ops=False))
    return RecordStore(RecordStoreConfig(model=MODEL), pool, pipeline, backend), pool, pipeline


def _pool_empty(pool: BlobPool) -> bool:
    stats = pool.stats()
    return stats.used_bytes == 0 and stats.pinned_bytes == 0


def _write(
    backend: Backend, records: dict[str, torch.Tensor], watch: Watch
) -> tuple[set[str], int]:
    """Write ``records``; take back those whose put failed: (acknowledged keys, wrong bytes)."""
    writer, pool, pipeline = _store(backend)
    events: list[RecordEvent] = []
    wrong = 0
    try:
        for key, value in records.items():
            watch.call(lambda k=key, v=value: writer.write(k, v))  # type: ignore[misc]

        def poll() -> None:
            events.extend(writer.poll(timeout_s=0.01))

        watch.until(poll, lambda: len(events) >= len(records))
        acked = {
            e.key for e in events if isinstance(e, RecordWritten) and e.outcome is PutOutcome.STORED
        }
        for key, value in records.items():
            if key in acked:
                assert key not in writer  # the host copy went once storage had it
                continue
            out = torch.empty_like(value)
            taken = watch.call(lambda k=key, o=out: writer.take(k, o))  # type: ignore[misc]
            assert taken is TakeOutcome.TAKEN  # a failed put keeps the host copy
            wrong += _wrong_bytes(out, value)
        assert _pool_empty(pool)
    finally:
        pipeline.close(timeout_s=WAIT_BOUND_S)
    return acked, wrong


def _take(backend: Backend, records: dict[str, torch.Tensor], watch: Watch) -> tuple[int, int]:
    """Take ``records`` from storage with a fresh reader: (wrong bytes, hits)."""
    reader, pool, pipeline = _store(backend)
    outs = {key: torch.zeros_like(value) for key, value in records.items()}
    events: list[RecordEvent] = []
    wrong = hits = 0
    try:
        for key, out in outs.items():
            taken = watch.call(lambda k=key, o=out: reader.take(k, o))  # type: ignore[misc]
            assert taken is TakeOutcome.PENDING

        def poll() -> None:
            events.extend(reader.poll(timeout_s=0.01))

        watch.until(poll, lambda: len(events) >= len(records))
        for event in events:
            assert isinstance(event, RecordTaken)
            if event.outcome is GetOutcome.HIT:
                hits += 1
                wrong += _wrong_bytes(outs[event.key], records[event.key])
            else:
                assert event.outcome is GetOutcome.MISS or event.error is not None
        assert _pool_empty(pool)
    finally:
        pipeline.close(timeout_s=WAIT_BOUND_S)
    return wrong, hits


def _lost(backend: Backend, records: dict[str, torch.Tensor]) -> int:
    """Records of ``records`` that do not read back exactly (plain reads: nothing deleted)."""
    namespace = RecordStoreConfig(model=MODEL).namespace
    lost = 0
    for key, value in records.items():
        spec = tensor_spec(value.dtype, tuple(value.shape))
        buffer = bytearray(spec.nbytes)
        request = GetRequest(key=namespace.key(key), spec=spec, buffers=[buffer])
        (result,) = backend.get_into([request])
        lost += not (result.hit and bytes(buffer) == _bytes(value))
    return lost


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_records_under_faults_take_only_correct_bytes(
    inner: Backend, schedule: str, seed: int, ledger: Ledger
) -> None:
    records = _records(seed)
    watch = Watch(ledger)
    store = FaultInjectingBackend(inner, attrs.evolve(SCHEDULES[schedule], seed=seed))
    acked, wrong = _write(store, records, watch)
    ledger.wrong(wrong)
    ledger.add_faults(store.fault_stats().by_kind)

    # Faults stop: acknowledged records (not destroyed on purpose) are all there.
    survivor: Backend = inner
    if isinstance(inner, FileBackend):
        inner.close()
        survivor = FileBackend(FileBackendConfig(root=inner.root, durability=Durability.FULL))
    damaged = {key.name for key in store.damaged_keys()}
    kept = {k: records[k] for k in acked if k not in damaged}
    ledger.operation(len(kept))
    ledger.lost(_lost(survivor, kept))

    # Faults resume, under another seed: a reader takes every record from storage.
    again = FaultInjectingBackend(survivor, attrs.evolve(store.schedule, seed=seed + 1000))
    try:
        wrong, hits = _take(again, {k: records[k] for k in acked}, watch)
    finally:
        ledger.add_faults(again.fault_stats().by_kind)
        if survivor is not inner:
            survivor.close()
    ledger.wrong(wrong)

    assert ledger.wrong_bytes == 0
    assert ledger.hangs == 0
    assert ledger.lost_durable == 0
    assert sum(ledger.faults.values()) > 0, "the schedule injected nothing"
    assert hits + (RECORDS - len(acked)) > 0, "nothing was read back: the test checked nothing"
