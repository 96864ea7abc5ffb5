"""The sparse KV manager on CPU: top-k prefetch with hit detection, eviction, backup, faults.

A reference model keeps the KV bytes each token was given when it was appended; after
every prefetch, the device rows the manager names must hold exactly those bytes. Backup
and restore run against the real ``memory`` and ``file`` backends, with faults injected
at the backend and in the device copies.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import torch
from support.faults import FaultyBackend, FaultyIO

from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.managers.sparse import (
    BackupDone,
    BackupFailed,
    Restored,
    SparseEvent,
    SparseKVConfig,
    SparseKVManager,
    TokensLost,
)
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
from sglang_storage.storage import Backend, MemoryBackend, create_backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint, page_hashes
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceKV,
    StoragePipeline,
    StoragePipelineConfig,
)

SLOTS, MAX_TOKENS, MAX_REQUESTS = 8, 96, 3
WAIT_S = 10.0
NAMESPACE = kv_namespace(model_fingerprint("test/sparse", page_size=1), mla=True)


def geometry(num_pages: int, attention: Attention) -> KVGeometry:
    mla = attention is Attention.MLA
    return KVGeometry(
        attention=attention,
        layout=KVLayout.LAYER_FIRST,
        dtype=torch.bfloat16,
        layer_num=2,
        page_size=1,
        num_pages=num_pages,
        head_num=1 if mla else 2,
        head_dim=16 if mla else 8,
    )


def memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0), facts=facts))


class Rig:
    """A manager over CPU pools, and the reference bytes of every appended token."""

    def __init__(
        self,
        backend: Backend | None,
        *,
        attention: Attention = Attention.MLA,
        host_pages: int = MAX_REQUESTS * MAX_TOKENS,
        pipeline: StoragePipelineConfig | None = None,
    ) -> None:
        g = geometry(host_pages, attention)
        self.device_kv = DeviceKV.allocate(g, MAX_REQUESTS * SLOTS)
        self.host = KVHostPool(g, memory())
        self.io = FaultyIO(self.device_kv, self.host)
        self.device = DeviceHostPipeline(self.device_kv, self.host, io_backend=self.io)
        self.store = None if backend is None else FaultyBackend(backend, name=backend.name)
        self.storage = (
            None
            if self.store is None
            else StoragePipeline(
                self.store, pipeline or StoragePipelineConfig(workers=2, batch_pages=16)
            )
        )
        self.manager = SparseKVManager(
            host=self.host,
            device=self.device,
            config=SparseKVConfig(
                device_slots=SLOTS, max_tokens=MAX_TOKENS, max_requests=MAX_REQUESTS
            ),
            storage=self.storage,
            namespace=None if backend is None else NAMESPACE,
        )
        self.truth: dict[str, list[list[torch.Tensor]]] = {}
        self.gen = torch.Generator().manual_seed(7)

    def rows(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The device rows of ``tokens``, every layer and plane, as int16 bits."""
        return [
            plane[tokens].view(torch.int16).clone()
            for layer in range(self.device_kv.geometry.layer_num)
            for plane in self.device_kv.planes(layer)
        ]

    def append(self, rid: str, count: int) -> None:
        """Append ``count`` tokens and write fresh random KV into their device slots."""
        tokens = self.manager.append(rid, count)
        for layer in range(self.device_kv.geometry.layer_num):
            for plane in self.device_kv.planes(layer):
                shape = (count, *plane.shape[1:])
                bits = torch.randint(-(2**15), 2**15, shape, generator=self.gen, dtype=torch.int16)
                plane.view(torch.int16)[tokens] = bits
        rows = self.rows(tokens)
        self.truth.setdefault(rid, []).extend([[r[i] for r in rows] for i in range(count)])

    def check(self, rid: str, positions: Sequence[int], device_tokens: torch.Tensor) -> None:
        rows = self.rows(device_tokens)
        for i, p in enumerate(positions):
            for got, want in zip((r[i] for r in rows), self.truth[rid][p], strict=True):
                assert torch.equal(got, want), f"token {p} of {rid} differs"

    def settle(self) -> list[SparseEvent]:
        events: list[SparseEvent] = []
        for _ in range(int(WAIT_S / 0.05)):
            events += self.manager.poll(timeout_s=0.05)
            if not self.manager.busy:
                return events
        raise AssertionError("the manager did not settle")


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    store = create_backend(
        request.param, {"root": str(tmp_path)} if request.param == "file" else {}
    )
    yield store
    store.close()


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(backend: Backend | None = None, **options: object) -> Rig:
        rigs.append(Rig(backend, **options))  # type: ignore[arg-type]
        return rigs[-1]

    yield make
    for rig in rigs:
        if rig.storage is not None:
            assert rig.storage.close(timeout_s=WAIT_S).clean


@pytest.mark.parametrize("attention", [Attention.MLA, Attention.MHA])
def test_random_steps_keep_the_device_buffer_exact(
    make_rig: Callable[..., Rig], attention: Attention
) -> None:
    rig = make_rig(MemoryBackend(), attention=attention)
    rng = random.Random(attention.value)
    rids = ["a", "b", "c"]
    for rid in rids:
        rig.manager.admit(rid)
        rig.append(rid, SLOTS)  # the prefill fills the buffer
    totals = {"hits": 0, "misses": 0}
    for _ in range(300):
        rid = rng.choice(rids)
        length = len(rig.truth[rid])
        if length < MAX_TOKENS:
            rig.append(rid, 1)  # the decoded token
            length += 1
        if rng.random() < 0.2:
            rig.manager.evict(rid, rng.sample(range(length), rng.randint(1, 4)))
        before = set(rig.manager.resident(rid).tolist())
        topk = rng.sample(range(length), rng.randint(1, SLOTS))
        result = rig.manager.prefetch(rid, topk)
        assert result.hits == len(before & set(topk))
        assert result.misses == len(topk) - result.hits
        assert (result.load is None) == (result.misses == 0)
        rig.check(rid, topk, result.device_tokens)
        assert set(topk) <= set(rig.manager.resident(rid).tolist())
        totals["hits"] += result.hits
        totals["misses"] += result.misses
    assert totals["hits"] > 0
    assert totals["misses"] > 0
    assert rig.manager.poll() == []
    # Then each request goes to storage (dirty and clean tokens alike) and comes back.
    for n, rid in enumerate(rids):
        tokens = [10_000 * n + i for i in range(len(rig.truth[rid]))]
        rig.manager.finish(rid, tokens)
        assert rig.settle() == [BackupDone(request_id=rid, tokens=len(tokens))]
        rig.manager.restore(rid, tokens)
        assert rig.settle() == [Restored(request_id=rid, tokens=len(tokens), requested=len(tokens))]
        for start in range(0, len(tokens), SLOTS):
            wanted = list(range(start, min(start + SLOTS, len(tokens))))
            rig.check(rid, wanted, rig.manager.prefetch(rid, wanted).device_tokens)
        rig.manager.release(rid)
    assert rig.host.stats().used_bytes == 0


def test_resident_tokens_are_hits_and_not_copied(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.manager.admit("r")
    rig.append("r", SLOTS)
    rig.append("r", 4)  # evicts the 4 least recently used: 0..3, written to host
    assert rig.manager.resident("r").tolist() == list(range(4, 12))
    assert rig.host.stats().used_bytes == 4 * rig.host.geometry.page_bytes
    first = rig.manager.prefetch("r", [0, 1, 5])
    assert (first.hits, first.misses, first.evicted, first.written) == (1, 2, 2, 2)
    again = rig.manager.prefetch("r", [0, 1, 5])
    assert (again.hits, again.misses, again.evicted, again.load) == (3, 0, 0, None)
    assert torch.equal(first.device_tokens, again.device_tokens)
    rig.check("r", [0, 1, 5], again.device_tokens)
    # A token loaded from host is clean: evicting it again copies nothing.
    evicted = rig.manager.evict("r", [0, 1, 2])  # 2 is not resident: ignored
    assert (evicted.evicted, evicted.written, len(rig.manager.resident("r"))) == (2, 0, 6)


def test_backup_and_restore_round_trip(backend: Backend, make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(backend)
    rig.manager.admit("r")
    for _ in range(5):
        rig.append("r", SLOTS)
    tokens = [9000 + i for i in range(5 * SLOTS)]
    rig.manager.finish("r", tokens)
    assert rig.settle() == [BackupDone(request_id="r", tokens=len(tokens))]
    assert rig.host.stats().used_bytes == 0
    rig.manager.restore("s", tokens)
    assert rig.settle() == [Restored(request_id="s", tokens=len(tokens), requested=len(tokens))]
    rig.truth["s"] = rig.truth["r"]
    for start in range(0, len(tokens), SLOTS):
        wanted = list(range(start, start + SLOTS))
        result = rig.manager.prefetch("s", wanted)
        assert result.misses == SLOTS
        rig.check("s", wanted, result.device_tokens)
    rig.manager.release("s")
    assert rig.host.stats().used_bytes == 0


def test_failed_backup_frees_host_and_is_reported(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig(backend)
    rig.manager.admit("r")
    rig.append("r", 6)
    assert rig.store is not None
    rig.store.raise_next = 1
    rig.manager.finish("r", list(range(6)))
    (failed,) = rig.settle()
    assert isinstance(failed, BackupFailed)
    assert (failed.tokens, failed.stored) == (6, 0)
    assert rig.host.stats().used_bytes == 0
    rig.manager.admit("r")  # the region came back too


def test_restore_stops_at_the_first_missing_token(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig(backend)
    rig.manager.admit("r")
    rig.append("r", 8)
    tokens = list(range(100, 108))
    rig.manager.finish("r", tokens)
    rig.settle()
    assert rig.store is not None
    rig.store.error_keys = {NAMESPACE.key(page_hashes(tokens, 1)[5])}
    rig.manager.restore("s", [*tokens, 1, 2])  # two tokens were never stored
    assert rig.settle() == [Restored(request_id="s", tokens=5, requested=10)]
    assert rig.host.stats().used_bytes == 5 * rig.host.geometry.page_bytes
    rig.truth["s"] = rig.truth["r"]
    result = rig.manager.prefetch("s", [4, 0, 2])
    rig.check("s", [4, 0, 2], result.device_tokens)
    with pytest.raises(ConfigError):
        rig.manager.prefetch("s", [5])  # not restored: not part of the request
    rig.store.raise_next = 1
    rig.manager.restore("t", tokens)
    assert rig.settle() == [Restored(request_id="t", tokens=0, requested=8)]


def test_release_during_backup_frees_everything(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig(backend)
    rig.manager.admit("r")
    rig.append("r", 8)
    rig.manager.finish("r", list(range(8)))
    with pytest.raises(StateError):
        rig.manager.prefetch("r", [0])  # busy with its backup
    rig.manager.release("r")
    assert rig.settle() == []
    assert rig.host.stats().used_bytes == 0


def test_full_storage_queue_refuses_and_keeps_the_request(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig(backend, pipeline=StoragePipelineConfig(workers=1, queue_depth=1))
    assert rig.store is not None
    rig.store.gate.clear()
    for rid in "abc":
        rig.manager.admit(rid)
        rig.append(rid, 4)
    rig.manager.finish("a", [1, 2, 3, 4])
    assert rig.store.entered.wait(WAIT_S)  # the worker holds a's backup
    rig.manager.finish("b", [5, 6, 7, 8])  # queued
    with pytest.raises(CapacityError):
        rig.manager.finish("c", [9, 10, 11, 12])
    result = rig.manager.prefetch("c", [3, 1])  # c is intact, all of it on host now
    assert (result.hits, result.misses) == (0, 2)
    rig.check("c", [3, 1], result.device_tokens)
    with pytest.raises(CapacityError):
        rig.manager.restore("d", [1, 2])  # no region left while c holds one
    rig.manager.release("c")
    rig.manager.release("b")  # its queued backup is cancelled; poll frees its pages
    rig.manager.restore("d", [1, 2, 3, 4, 5])  # queued behind a's backup
    rig.store.gate.set()
    events = rig.settle()
    assert events == [
        BackupDone(request_id="a", tokens=4),
        Restored(request_id="d", tokens=4, requested=5),
    ]
    rig.manager.release("d")
    assert rig.host.stats().used_bytes == 0
    for rid in "xyz":
        rig.manager.admit(rid)  # every region came back


def test_failed_device_copy_loses_tokens_not_bytes(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.manager.admit("r")
    rig.append("r", SLOTS)
    rig.io.fail = True
    rig.manager.evict("r", [0, 1])
    rig.io.fail = False
    with pytest.raises(StateError, match="lost"):
        rig.manager.prefetch("r", [0, 2])
    (lost,) = rig.manager.poll()
    assert isinstance(lost, TokensLost)
    assert lost.positions == (0, 1)
    assert rig.host.stats().used_bytes == 0
    result = rig.manager.prefetch("r", [2, 3])
    rig.check("r", [2, 3], result.device_tokens)
    rig.manager.evict("r", [4])
    rig.io.fail = True
    with pytest.raises(StateError):
        rig.manager.prefetch("r", [4]).load.wait_layer(0)  # type: ignore[union-attr]
    rig.io.fail = False
    rig.manager.poll()
    assert 4 not in rig.manager.resident("r").tolist()  # the failed load left no residue
    result = rig.manager.prefetch("r", [4])
    rig.check("r", [4], result.device_tokens)


def test_full_host_pool_refuses_and_changes_nothing(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host_pages=2)
    rig.manager.admit("r")
    rig.append("r", SLOTS)
    rig.append("r", 2)
    with pytest.raises(CapacityError):
        rig.append("r", 1)  # its victim has no host page to go to
    assert len(rig.manager.resident("r")) == SLOTS
    result = rig.manager.prefetch("r", list(range(2, 10)))
    assert result.hits == SLOTS
    rig.check("r", list(range(2, 10)), result.device_tokens)


def test_misuse_is_refused(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    with pytest.raises(StateError):
        rig.manager.append("nobody", 1)
    rig.manager.admit("r")
    with pytest.raises(StateError):
        rig.manager.admit("r")
    rig.append("r", 4)
    with pytest.raises(ConfigError):
        rig.manager.prefetch("r", [1, 1])
    with pytest.raises(ConfigError):
        rig.manager.prefetch("r", [4])
    with pytest.raises(ConfigError):
        rig.manager.append("r", SLOTS + 1)
    with pytest.raises(StateError):
        rig.manager.restore("x", [1])  # no storage
    rig.manager.admit("s")
    rig.manager.admit("t")
    with pytest.raises(CapacityError):
        rig.manager.admit("u")  # every region is taken
    paged = attrs.evolve(geometry(4, Attention.MLA), page_size=2)
    host = KVHostPool(paged, memory())
    with pytest.raises(ConfigError):
        SparseKVManager(
            host=host,
            device=DeviceHostPipeline(DeviceKV.allocate(paged, 8), host),
            config=SparseKVConfig(device_slots=1, max_tokens=1, max_requests=1),
        )
