"""RecordStore: write-once/read-once records through host and storage, with faults."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import attrs
import pytest
import torch
from support.faults import FaultyBackend, PipelineCloser

from sglang_storage.core import GetOutcome, PutOutcome
from sglang_storage.errors import ConfigError, StateError, StorageError
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
)
from sglang_storage.storage import Backend, FileBackend, FileBackendConfig, MemoryBackend
from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig

WAIT_S = 10.0


_PIPELINES = PipelineCloser()
_close_pipelines = _PIPELINES.autouse_fixture()


def _pool() -> BlobPool:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0), facts=facts))
    return BlobPool(BlobPoolConfig(capacity=1 << 20), memory)


class Parts(NamedTuple):
    store: RecordStore
    pool: BlobPool
    pipeline: StoragePipeline | None


def _parts(backend: FaultyBackend | Backend | None, *, keep_host_copy: bool = False) -> Parts:
    config = RecordStoreConfig(model="test-model", keep_host_copy=keep_host_copy)
    pool = _pool()
    if backend is None:
        return Parts(RecordStore(config, pool), pool, None)
    pipeline = StoragePipeline(backend, StoragePipelineConfig(workers=1))
    _PIPELINES.track(pipeline)
    store = RecordStore(config, pool, pipeline, backend)
    return Parts(store, pool, pipeline)


def _store(backend: FaultyBackend | Backend | None, *, keep_host_copy: bool = False) -> RecordStore:
    return _parts(backend, keep_host_copy=keep_host_copy).store


def _events(store: RecordStore, count: int) -> list[RecordEvent]:
    events: list[RecordEvent] = []
    end = time.monotonic() + WAIT_S
    while len(events) < count and time.monotonic() < end:
        events += store.poll(timeout_s=0.2)
    assert len(events) == count, events
    return events


def _records() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "req-1.topk_ids": torch.randint(0, 150_000, (7, 20), generator=g),
        "req-1.topk_logprobs": torch.randn((7, 20), generator=g),
        "req-2.mrope_positions": torch.randint(0, 4096, (3, 33), generator=g, dtype=torch.int32),
        "req-2.rope_deltas": torch.randn((1, 1), generator=g).to(torch.bfloat16),
    }


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_flat(a), _flat(b))


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


def _stored(backend: Backend | FaultyBackend, store: RecordStore, key: str) -> bool:
    return backend.exists([store.config.namespace.key(key)]) == [True]


# ---------------------------------------------------------------- life cycle


def test_host_only_records_are_read_once() -> None:
    store = _store(None)
    records = _records()
    for key, value in records.items():
        store.write(key, value)
    for key, value in records.items():
        out = torch.empty_like(value)
        assert store.take(key, out) is TakeOutcome.TAKEN
        assert _same_bytes(out, value)
        assert store.take(key, out) is TakeOutcome.MISS
    assert store.poll() == []
    store.write("req-1.topk_ids", records["req-1.topk_ids"])  # taken keys may be reused


def test_records_move_through_storage_to_another_process(backend: Backend) -> None:
    writer, reader = _store(backend), _store(backend)
    records = _records()
    for key, value in records.items():
        writer.write(key, value)
    written = _events(writer, len(records))
    assert all(isinstance(e, RecordWritten) and e.outcome is PutOutcome.STORED for e in written)
    assert not any(key in writer for key in records)  # host copies dropped once stored
    outs = {key: torch.empty_like(value) for key, value in records.items()}
    for key, out in outs.items():
        assert reader.take(key, out) is TakeOutcome.PENDING
    taken = _events(reader, len(records))
    assert all(isinstance(e, RecordTaken) and e.outcome is GetOutcome.HIT for e in taken)
    for key, value in records.items():
        assert _same_bytes(outs[key], value)
        assert not _stored(backend, writer, key)  # read once: deleted from storage
    out = outs["req-1.topk_ids"]
    assert reader.take("req-1.topk_ids", out) is TakeOutcome.PENDING
    (miss,) = _events(reader, 1)
    assert isinstance(miss, RecordTaken)
    assert miss.outcome is GetOutcome.MISS


def test_a_non_contiguous_out_is_staged(backend: Backend) -> None:
    writer, reader = _store(backend), _store(backend)
    value = torch.arange(12, dtype=torch.int64).view(3, 4)
    writer.write("r", value)
    _events(writer, 1)
    out = torch.zeros((4, 3), dtype=torch.int64).t()
    assert reader.take("r", out) is TakeOutcome.PENDING
    _events(reader, 1)
    assert torch.equal(out, value)


def test_keep_host_copy_takes_locally_and_deletes_the_stored_copy(backend: Backend) -> None:
    store = _store(backend, keep_host_copy=True)
    value = _records()["req-1.topk_logprobs"]
    store.write("r", value)
    _events(store, 1)
    assert "r" in store
    assert _stored(backend, store, "r")
    out = torch.empty_like(value)
    assert store.take("r", out) is TakeOutcome.TAKEN
    assert _same_bytes(out, value)
    assert not _stored(backend, store, "r")


def test_take_and_discard_while_the_put_is_in_flight(backend: Backend) -> None:
    faulty = FaultyBackend(backend, gated={"put"}, key_errors_on={"get"})
    store, pool, _ = _parts(faulty)
    faulty.gate.clear()
    try:
        value = _records()["req-1.topk_ids"]
        store.write("a", value)
        store.write("b", value)
        out = torch.empty_like(value)
        assert store.take("a", out) is TakeOutcome.TAKEN
        assert _same_bytes(out, value)
        assert store.take("a", out) is TakeOutcome.MISS
        store.discard("b")
        with pytest.raises(StateError):
            store.write("a", value)  # its put is still finishing
    finally:
        faulty.gate.set()
    _events(store, 2)
    assert not _stored(faulty, store, "a")
    assert not _stored(faulty, store, "b")
    assert _pool_empty(pool)


def _pool_empty(pool: BlobPool) -> bool:
    stats = pool.stats()
    return stats.used_bytes == 0 and stats.pinned_bytes == 0


# ---------------------------------------------------------------- write once, specs, faults


def test_a_second_write_is_an_error_and_a_stored_duplicate_a_conflict(backend: Backend) -> None:
    first, second = _store(backend), _store(backend)
    value = torch.ones(4)
    first.write("r", value)
    with pytest.raises(StateError, match="already written"):
        first.write("r", value)
    _events(first, 1)
    second.write("r", torch.zeros(4))  # another writer, same key, already in storage
    (event,) = _events(second, 1)
    assert isinstance(event, RecordWritten)
    assert event.outcome is PutOutcome.PRESENT
    assert isinstance(event.error, StateError)
    out = torch.empty(4)
    assert second.take("r", out) is TakeOutcome.TAKEN
    assert torch.equal(out, torch.zeros(4))
    assert _stored(backend, second, "r")  # the first writer's record is not deleted


def test_spec_is_checked_on_host_and_in_storage(backend: Backend) -> None:
    local = _store(None)
    local.write("r", torch.ones((2, 3)))
    with pytest.raises(ConfigError, match="must match"):
        local.take("r", torch.empty((3, 2)))
    with pytest.raises(ConfigError, match="must match"):
        local.take("r", torch.empty((2, 3), dtype=torch.float64))
    assert "r" in local  # a refused take keeps the record

    writer, reader = _store(backend), _store(backend)
    writer.write("r", torch.ones((2, 3)))
    _events(writer, 1)
    reader.take("r", torch.empty((2, 3), dtype=torch.int32))  # same size, other dtype
    (event,) = _events(reader, 1)
    assert isinstance(event, RecordTaken)
    assert event.outcome is GetOutcome.CORRUPT


@pytest.mark.parametrize("fault", ["call", "key"])
def test_failed_takes_are_typed_and_keep_nothing_wrong(backend: Backend, fault: str) -> None:
    faulty = FaultyBackend(backend, gated={"put"}, key_errors_on={"get"})
    writer, reader = _store(faulty), _store(faulty)
    writer.write("r", torch.arange(8))
    _events(writer, 1)
    faulty.fail_gets = fault == "call"
    faulty.error_keys = {"r"} if fault == "key" else set()
    assert reader.take("r", torch.empty(8, dtype=torch.int64)) is TakeOutcome.PENDING
    (event,) = _events(reader, 1)
    assert isinstance(event, RecordTaken)
    assert event.outcome is GetOutcome.ERROR
    assert event.error is not None
    faulty.fail_gets, faulty.error_keys = False, set()
    out = torch.empty(8, dtype=torch.int64)
    reader.take("r", out)  # the record survived the failed take
    (event,) = _events(reader, 1)
    assert event.outcome is GetOutcome.HIT
    assert torch.equal(out, torch.arange(8))


def test_failed_puts_and_deletes_keep_the_host_copy_readable(backend: Backend) -> None:
    faulty = FaultyBackend(backend, gated={"put"}, key_errors_on={"get"})
    store, pool, _ = _parts(faulty, keep_host_copy=True)
    faulty.fail_puts = True
    store.write("r", torch.arange(5))
    (event,) = _events(store, 1)
    assert isinstance(event, RecordWritten)
    assert event.outcome is PutOutcome.ERROR
    out = torch.empty(5, dtype=torch.int64)
    assert store.take("r", out) is TakeOutcome.TAKEN
    assert torch.equal(out, torch.arange(5))
    faulty.fail_puts, faulty.fail_deletes = False, True
    store.write("s", torch.arange(5))
    _events(store, 1)
    assert store.take("s", out) is TakeOutcome.TAKEN  # the failed delete is not an error
    assert _pool_empty(pool)


def test_refused_submissions_become_error_events(backend: Backend) -> None:
    store, _, pipeline = _parts(backend)
    assert pipeline is not None
    pipeline.close()
    store.write("r", torch.arange(3))
    assert store.take("x", torch.empty(3, dtype=torch.int64)) is TakeOutcome.PENDING
    events = store.poll()
    assert [type(e) for e in events] == [RecordWritten, RecordTaken]
    assert all(e.error is not None for e in events)
    out = torch.empty(3, dtype=torch.int64)
    assert store.take("r", out) is TakeOutcome.TAKEN
    assert torch.equal(out, torch.arange(3))


def test_bad_configuration_and_arguments_are_config_errors(backend: Backend) -> None:
    with pytest.raises(ConfigError, match="model"):
        RecordStoreConfig(model="")
    pipeline = StoragePipeline(backend)
    with pytest.raises(ConfigError, match="backend"):
        RecordStore(RecordStoreConfig(model="m"), _pool(), pipeline)
    pipeline.close()
    store = _store(None)
    with pytest.raises(ConfigError):
        store.write("bad key", torch.ones(1))
    with pytest.raises(ConfigError):
        store.write("empty", torch.ones(0))
    assert store.take("absent", torch.ones(1)) is TakeOutcome.MISS


# ---------------------------------------------------------------- handles and readers


def test_a_handle_names_a_record_another_reader_reads_once(tmp_path: Path) -> None:
    from sglang_storage.managers.records import (
        RecordHandle,
        close_readers,
        delete_record,
        read_record,
    )

    root = tmp_path / "store"
    backend = FileBackend(FileBackendConfig(root=root))
    store, _, _ = _parts(backend)
    value = torch.randint(0, 1 << 20, (5, 4, 3), dtype=torch.int32)
    store.write("req-7.routed_experts", value)
    handle = RecordHandle(
        key="req-7.routed_experts",
        model=store.config.model,
        shape=tuple(value.shape),
        dtype="int32",
        backend="file",
        options={"root": str(root)},
        tag="routed_experts",
    )
    assert RecordHandle.from_bytes(handle.to_bytes()) == handle
    assert len(handle.to_bytes()) < 400
    try:
        kept = read_record(handle, timeout_s=WAIT_S, keep=True)  # retried until stored
        assert _same_bytes(kept, value)
        assert _same_bytes(read_record(handle, timeout_s=0.0), value)  # read, then deleted
        with pytest.raises(StorageError, match="miss"):
            read_record(handle, timeout_s=0.05)
        delete_record(handle)  # absent is fine
        empty = attrs.evolve(handle, shape=(0, 4, 3))
        assert read_record(empty, timeout_s=0.0).shape == (0, 4, 3)
    finally:
        close_readers()
        _PIPELINES.close_all()
        backend.close()


def test_handles_reject_what_is_not_one() -> None:
    from sglang_storage.managers.records import RecordHandle, read_record

    good = RecordHandle(key="k", model="m", shape=(2,), dtype="int32", backend="memory")
    with pytest.raises(ConfigError, match="not a sglang_storage record handle"):
        RecordHandle.from_bytes(b"\0" * 8)
    with pytest.raises(ConfigError, match="malformed"):
        RecordHandle.from_bytes(b"sglang_storage.record {")
    with pytest.raises(ConfigError, match="base64"):
        RecordHandle.from_base64("***")
    with pytest.raises(ConfigError, match="element type"):
        attrs.evolve(good, dtype="int128")
    with pytest.raises(ConfigError):
        attrs.evolve(good, key="bad key")
    with pytest.raises(ConfigError, match="timeout_s"):
        read_record(good, timeout_s=-1.0)
