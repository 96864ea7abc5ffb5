"""HostPageIO on CPU: multi-part pages to storage and back, leading runs, pins, refusals.

Every test runs real pools (a ``KVHostPool`` and a ``RecordPool`` side part), a real
``StoragePipeline`` and a real ``memory`` backend, wrapped where a test needs it: the
``faulty`` backend's latency to make a deadline pass, ``support.faults.FaultyBackend`` to
hold calls or fail one key. What a :class:`PageOp` reports is checked against the bytes the
pools hold afterwards, the backend's objects and the pools' pin counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from support.faults import FaultyBackend, PipelineCloser

from sglang_storage.core import ObjectKey
from sglang_storage.errors import (
    CapacityError,
    ConfigError,
    OperationTimeoutError,
    StateError,
    StorageError,
)
from sglang_storage.managers.kv import SidePool
from sglang_storage.managers.pageio import HostPageIO, PageKeys, PageOp
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
from sglang_storage.storage import Backend, create_backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint
from sglang_storage.transfer import OpState, Priority, StoragePipeline, StoragePipelineConfig

PAGE, HOST_PAGES, WAIT_S = 4, 32, 10.0
NAMESPACE = kv_namespace(model_fingerprint("test/pageio", page_size=PAGE), mla=False)

PIPELINES = PipelineCloser()
close_pipelines = PIPELINES.autouse_fixture()


def memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0), facts=facts))


class Rig:
    """A KV pool plus a record side part, and the HostPageIO over them and ``store``."""

    def __init__(self, store: Backend, **pipeline: object) -> None:
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
        self.store = store
        self.kv = KVHostPool(geometry, memory())
        records = RecordPoolConfig(shape=(3,), dtype=torch.float32, capacity=HOST_PAGES)
        self.records = RecordPool(records, memory())
        config = StoragePipelineConfig(**{"workers": 2, "batch_pages": 8, **pipeline})  # type: ignore[arg-type]
        self.pipeline = PIPELINES.track(StoragePipeline(store, config))
        self.io = HostPageIO([self.kv, SidePool(name="rec", pool=self.records)], self.pipeline)
        self._gen = torch.Generator().manual_seed(0)

    def pages(self, n: int) -> torch.Tensor:
        """``n`` pages of random bytes in both parts: ``(n, 2)`` slots, KV then record."""
        kv, rec = self.kv.alloc(n), self.records.alloc(n)
        raw = torch.randint(0, 256, (n * self.kv.geometry.page_bytes,), generator=self._gen)
        self.kv.write_pages(kv, raw.to(torch.uint8))
        self.records.write(rec, torch.randn(n, 3, generator=self._gen))
        return torch.stack([kv, rec], dim=1)

    def blank(self, n: int) -> torch.Tensor:
        """``n`` zeroed pages in both parts."""
        kv, rec = self.kv.alloc(n), self.records.alloc(n)
        self.kv.write_pages(kv, torch.zeros(n * self.kv.geometry.page_bytes, dtype=torch.uint8))
        self.records.write(rec, torch.zeros(n, 3))
        return torch.stack([kv, rec], dim=1)

    def same(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether pages ``a`` and ``b`` hold the same bytes in every part."""
        kv_a, kv_b = self.kv.read_pages(a[:, 0]), self.kv.read_pages(b[:, 0])
        rec_a, rec_b = self.records.read(a[:, 1]), self.records.read(b[:, 1])
        return torch.equal(kv_a.view(torch.int16), kv_b.view(torch.int16)) and torch.equal(
            rec_a, rec_b
        )

    def pinned(self) -> tuple[int, int]:
        """Pinned slots of the KV pool and of the record pool."""
        return self.kv.slots.stats().pinned, self.records.slots.stats().pinned

    def free(self, slots: torch.Tensor) -> None:
        self.kv.free(slots[:, 0])
        self.records.free(slots[:, 1])


def keys(n: int, tag: str = "p") -> list[tuple[ObjectKey, ObjectKey]]:
    """One (KV, record) key pair per page."""
    return [(NAMESPACE.key(f"{tag}{i:03d}"), NAMESPACE.key(f"{tag}{i:03d}-rec")) for i in range(n)]


def ended(op: PageOp) -> PageOp:
    assert op.wait(WAIT_S), "the operation did not end"
    return op


@pytest.fixture
def backend() -> Iterator[Backend]:
    store = create_backend("memory")
    yield store
    PIPELINES.close_all()
    store.close()


@pytest.fixture
def held(backend: Backend) -> FaultyBackend:
    return FaultyBackend(backend)


def test_multi_part_pages_round_trip_byte_for_byte(backend: Backend) -> None:
    rig = Rig(backend)
    names, pages = keys(5), rig.pages(5)
    put = ended(rig.io.put(names, pages))
    assert put.error is None
    assert put.page_ok() == [True] * 5
    assert put.leading() == 5
    page_bytes = rig.kv.geometry.page_bytes + 3 * 4
    assert rig.io.page_bytes == page_bytes
    assert put.moved_bytes() == 5 * page_bytes
    assert backend.exists([k for pair in names for k in pair]) == [True] * 10
    put.collect()

    into = rig.blank(5)
    assert not rig.same(pages, into)
    got = ended(rig.io.get(names, into, priority=Priority.NORMAL))
    assert got.leading() == 5
    assert got.first_error() is None
    got.collect()
    assert rig.same(pages, into)
    assert rig.pinned() == (0, 0)


def test_a_missing_part_ends_the_leading_run(backend: Backend) -> None:
    rig = Rig(backend)
    names, pages = keys(4), rig.pages(4)
    ended(rig.io.put(names, pages)).collect()
    backend.delete([names[1][1]])  # page 1 keeps its KV but loses its record

    found = ended(rig.io.exists(names, deadline_s=WAIT_S))
    assert found.page_ok() == [True, False, True, True]
    assert found.leading() == 1

    into = rig.blank(4)
    got = ended(rig.io.get(names, into))
    assert got.page_ok() == [True, False, True, True]
    assert got.leading() == 1
    assert got.error is None
    assert got.first_error() is None
    assert got.moved_bytes() == rig.io.page_bytes
    got.collect()
    assert rig.same(pages[:1], into[:1])
    assert rig.same(pages[2:], into[2:])


def test_a_failed_part_is_the_first_error_and_breaks_the_run(held: FaultyBackend) -> None:
    rig = Rig(held)
    names = keys(4)
    held.error_keys = {names[2][1]}
    op = ended(rig.io.put(names, rig.pages(4)))
    op.collect()
    assert op.handle is not None
    assert op.handle.state is OpState.DONE
    assert op.error is None
    assert op.page_ok() == [True, True, False, True]
    assert op.leading() == 2
    assert isinstance(op.first_error(), StorageError)
    assert held.inner.exists([names[2][0], names[2][1]]) == [True, False]


def test_pages_stay_pinned_until_collect(held: FaultyBackend) -> None:
    rig = Rig(held)
    pages = rig.pages(3)
    held.gate.clear()  # hold the put inside the backend
    op = rig.io.put(keys(3), pages)
    assert held.entered.wait(WAIT_S)
    assert not op.done()
    assert op.leading() == 0
    assert op.page_ok() == [False] * 3
    assert rig.pinned() == (3, 3)
    with pytest.raises(StateError):
        op.collect()  # refused while it runs
    with pytest.raises(StateError):
        rig.kv.free(pages[:, 0])
    held.gate.set()
    ended(op)
    assert rig.pinned() == (3, 3)  # done is not collected
    with pytest.raises(StateError):
        rig.records.free(pages[:, 1])
    op.collect()
    op.collect()  # idempotent: one unpin
    assert rig.pinned() == (0, 0)
    rig.free(pages)


def test_a_full_queue_refusal_is_told_apart_and_pins_nothing(held: FaultyBackend) -> None:
    rig = Rig(held, workers=1, queue_depth=1, merge_ops=False)
    held.gate.clear()
    running = rig.io.put(keys(2, "a"), rig.pages(2))
    assert held.entered.wait(WAIT_S)  # the only worker holds it: the queue is empty
    queued = rig.io.put(keys(2, "b"), rig.pages(2))
    pages = rig.pages(2)
    refused = rig.io.put(keys(2, "c"), pages)
    assert refused.handle is None
    assert refused.op_id is None
    assert refused.queue_full
    assert isinstance(refused.error, CapacityError)
    assert refused.first_error() is refused.error
    assert refused.done()
    assert refused.leading() == 0
    assert refused.page_ok() == [False] * 2
    assert rig.pinned() == (4, 4)  # the two accepted puts only
    refused.collect()
    rig.free(pages)  # nothing of the refused put is pinned
    assert queued.op_id is not None
    assert running.op_id is not None
    assert queued.op_id != running.op_id
    assert not queued.queue_full
    held.gate.set()
    for op in (running, queued):
        ended(op).collect()
        assert op.leading() == 2
    assert rig.pinned() == (0, 0)


@pytest.mark.parametrize("kind", ["put", "get"])
def test_a_closed_pipeline_refuses_without_a_full_queue(backend: Backend, kind: str) -> None:
    rig = Rig(backend)
    rig.pipeline.close()
    pages = rig.pages(2)
    submit = rig.io.put if kind == "put" else rig.io.get
    op = submit(keys(2), pages)
    assert op.handle is None
    assert op.done()
    assert not op.queue_full
    assert isinstance(op.error, StorageError)
    assert not isinstance(op.error, CapacityError)
    assert rig.pinned() == (0, 0)
    rig.free(pages)


@pytest.mark.parametrize("kind", ["put", "get"])
def test_the_deadline_reaches_the_pipeline(kind: str) -> None:
    slow = {"inner": "memory", "latency_rate": 1.0, "latency_s": 0.3}
    store = create_backend("faulty", slow)
    try:
        rig = Rig(store, workers=1, merge_ops=False)
        names = keys(2)
        ended(rig.io.put(names, rig.pages(2))).collect()

        def submit(pages: torch.Tensor, deadline_s: float | None) -> PageOp:
            ks: Sequence[PageKeys] = names if kind == "get" else keys(2, "d")
            if kind == "put":
                return rig.io.put(ks, pages, deadline_s=deadline_s)
            return rig.io.get(ks, pages, deadline_s=deadline_s)

        blocker = rig.io.put(keys(2, "x"), rig.pages(2), priority=Priority.URGENT)
        assert blocker.handle is not None
        give_up = time.monotonic() + WAIT_S
        while blocker.handle.state is OpState.PENDING:  # then the only worker has it for 0.3 s
            assert time.monotonic() < give_up, "the worker never took the blocker"
            time.sleep(0.001)
        late_pages, kept_pages = rig.pages(2), rig.pages(2)
        late = submit(late_pages, 0.05)
        kept = submit(kept_pages, None)
        for op in (blocker, late, kept):
            ended(op).collect()
        assert isinstance(late.error, OperationTimeoutError)
        assert late.leading() == 0
        assert late.page_ok() == [False, False]
        assert kept.error is None
        assert kept.leading() == 2
        assert rig.pinned() == (0, 0)
        rig.free(late_pages)
    finally:
        PIPELINES.close_all()
        store.close()


def test_keys_and_slots_must_match_pages_and_parts(backend: Backend) -> None:
    rig = Rig(backend)
    pages = rig.pages(2)
    with pytest.raises(ConfigError):
        rig.io.put(keys(3), pages)  # one key too many
    with pytest.raises(ConfigError):
        rig.io.put([pair[0] for pair in keys(2)], pages)  # one key per page, two parts
    with pytest.raises(ConfigError):
        rig.io.get(keys(2), pages[:, 0])  # one slot per page, two parts
    assert rig.pinned() == (0, 0)
