"""The decode offload manager on CPU: strides, backup on finish, host freed on ack, faults.

Each life cycle runs against the real ``memory`` and ``file`` backends with CPU tensors as
the device. What was stored is read back from the backend into a fresh host pool, loaded
into a fresh device pool, and compared bit for bit with the original device KV.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.faults import FaultyBackend, FaultyIO

from sglang_storage.core import GetRequest
from sglang_storage.errors import ConfigError, StateError
from sglang_storage.managers.decode import (
    BackupDone,
    BackupFailed,
    DecodeEvent,
    DecodeOffloadConfig,
    DecodeOffloadManager,
    DeviceReleased,
    OffloadFailed,
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
from sglang_storage.storage import Backend, create_backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint, namespace_seed, page_hashes
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceKV,
    StoragePipeline,
    StoragePipelineConfig,
)

PAGE = 4
DEVICE_PAGES = 64
WAIT_S = 10.0
NAMESPACE = kv_namespace(model_fingerprint("test/decode", page_size=PAGE), mla=False)


def geometry(num_pages: int, attention: Attention = Attention.MHA) -> KVGeometry:
    return KVGeometry(
        attention=attention,
        layout=KVLayout.PAGE_FIRST,
        dtype=torch.bfloat16,
        layer_num=2,
        page_size=PAGE,
        num_pages=num_pages,
        head_num=2 if attention is Attention.MHA else 1,
        head_dim=8,
    )


def memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0), facts=facts))


def random_device(g: KVGeometry, seed: int = 0) -> DeviceKV:
    kv = DeviceKV.allocate(g, DEVICE_PAGES * PAGE)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(g.layer_num):
        for plane in kv.planes(layer):
            plane.view(torch.int16).copy_(
                torch.randint(-(2**15), 2**15, plane.shape, generator=gen, dtype=torch.int16)
            )
    return kv


class Rig:
    def __init__(
        self,
        backend: Backend,
        *,
        host_pages: int = 32,
        pipeline: StoragePipelineConfig | None = None,
        **config: object,
    ) -> None:
        g = geometry(host_pages)
        self.device_kv = random_device(g)
        self.host = KVHostPool(g, memory())
        self.io = FaultyIO(self.device_kv, self.host)
        self.device = DeviceHostPipeline(self.device_kv, self.host, io_backend=self.io)
        self.store = FaultyBackend(backend, name=backend.name, key_errors_on={"put"})
        self.storage = StoragePipeline(
            self.store, pipeline or StoragePipelineConfig(workers=2, batch_pages=8)
        )
        self.manager = DecodeOffloadManager(
            host=self.host,
            device=self.device,
            storage=self.storage,
            namespace=NAMESPACE,
            config=DecodeOffloadConfig(**config),  # type: ignore[arg-type]
        )

    def settle(self) -> list[DecodeEvent]:
        events: list[DecodeEvent] = []
        for _ in range(int(WAIT_S / 0.05)):
            events += self.manager.poll(timeout_s=0.05)
            if not self.manager.busy:
                return events
        raise AssertionError("the manager did not settle")

    def read_back(self, keys: list[str], device_pages: list[int]) -> DeviceKV:
        """Stored pages -> a fresh host pool -> a fresh zeroed device at ``device_pages``."""
        g = self.host.geometry
        host = KVHostPool(g, memory())
        pages = host.alloc(len(keys))
        requests = [
            GetRequest(key=NAMESPACE.key(k), spec=host.page_spec, buffers=host.page_views(p))
            for k, p in zip(keys, pages.tolist(), strict=True)
        ]
        assert all(r.hit for r in self.store.inner.get_into(requests))
        fresh = DeviceKV.allocate(g, DEVICE_PAGES * PAGE)
        DeviceHostPipeline(fresh, host).load(pages, g.token_indices(torch.tensor(device_pages)))
        return fresh


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
        assert rig.storage.close(timeout_s=WAIT_S).clean


def same_bits(a: DeviceKV, b: DeviceKV, device_pages: list[int]) -> bool:
    tokens = a.geometry.token_indices(torch.tensor(device_pages, dtype=torch.int64))
    return all(
        torch.equal(x[tokens].view(torch.int16), y[tokens].view(torch.int16))
        for layer in range(a.geometry.layer_num)
        for x, y in zip(a.planes(layer), b.planes(layer), strict=True)
    )


def decode(rig: Rig, rid: str, prompt: list[int], steps: int, pages: list[int]) -> list[int]:
    """Feed ``steps`` decoded tokens one at a time; return the pages offloaded per step."""
    tokens = list(prompt)
    offloaded = []
    for step in range(steps):
        token = 1000 + step
        tokens.append(token)
        offloaded.append(rig.manager.on_decoded(rid, [token], pages))
    return offloaded


def test_life_cycle_strides_backup_and_read_back(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig(stride_pages=2)
    prompt = list(range(7))
    pages = torch.randperm(DEVICE_PAGES)[:10].tolist()  # scattered device pages
    seed = namespace_seed("lora-a", None)
    rig.manager.start("r1", prompt, seed=seed)
    per_step = decode(rig, "r1", prompt, 26, pages)  # 33 tokens: 8 full pages
    # 2-page strides as soon as two full pages exist: at tokens 8 and 16, 24, 32.
    assert [i for i, n in enumerate(per_step) if n] == [0, 8, 16, 24]
    assert sum(per_step) == 8
    assert rig.host.stats().used_bytes == 8 * rig.host.geometry.page_bytes
    copying_before = rig.manager.copying  # until poll sees the (CPU: finished) copies
    assert copying_before
    rig.manager.finish("r1")
    events = rig.settle()
    assert events == [
        DeviceReleased(request_id="r1", pages=8),
        BackupDone(request_id="r1", pages=8, attempts=1),
    ]
    assert rig.host.stats().used_bytes == 0
    assert not rig.manager.copying
    tokens = prompt + [1000 + i for i in range(26)]
    keys = page_hashes(tokens[: 8 * PAGE], PAGE, seed)
    fresh = rig.read_back(keys, pages[:8])
    assert same_bits(rig.device_kv, fresh, pages[:8])
    stats = rig.manager.stats()
    assert (stats.requests, stats.offloaded_pages, stats.stored_pages) == (0, 8, 8)


def test_prefill_stored_pages_seed_the_chain(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig()
    prompt = list(range(10))
    pages = list(range(20, 30))
    rig.manager.start("r", prompt, stored_tokens=8)
    # Pages 2 and 3 fill at tokens 12 and 16; pages 0 and 1 are the prefill side's.
    assert decode(rig, "r", prompt, 6, pages) == [0, 1, 0, 0, 0, 1]
    rig.manager.finish("r")
    assert rig.settle()[-1] == BackupDone(request_id="r", pages=2, attempts=1)
    tokens = prompt + [1000 + i for i in range(6)]
    keys = page_hashes(tokens, PAGE)[2:4]
    assert same_bits(rig.device_kv, rig.read_back(keys, pages[2:4]), pages[2:4])
    assert not backend.exists([NAMESPACE.key(k) for k in page_hashes(tokens[:8], PAGE)])[0]


def test_backend_failure_frees_everything_and_is_reported(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig()
    rig.manager.start("r", [])
    rig.manager.on_decoded("r", list(range(12)), [3, 4, 5])
    rig.store.raise_next = 1
    rig.manager.finish("r")
    events = rig.settle()
    assert isinstance(events[-1], BackupFailed)
    assert (events[-1].pages, events[-1].stored) == (3, 0)
    assert rig.host.stats().used_bytes == 0
    assert rig.manager.stats().failed_backups == 1


def test_failed_backup_is_retried(backend: Backend, make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(max_retries=1)
    rig.manager.start("r", [])
    rig.manager.on_decoded("r", list(range(8)), [7, 9])
    rig.store.raise_next = 1
    rig.manager.finish("r")
    assert rig.settle()[-1] == BackupDone(request_id="r", pages=2, attempts=2)
    keys = page_hashes(list(range(8)), PAGE)
    assert same_bits(rig.device_kv, rig.read_back(keys, [7, 9]), [7, 9])


def test_per_page_failure_reports_what_was_stored(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig()
    rig.manager.start("r", [])
    rig.manager.on_decoded("r", list(range(16)), [0, 1, 2, 3])
    keys = page_hashes(list(range(16)), PAGE)
    rig.store.error_keys = {NAMESPACE.key(keys[1])}
    rig.manager.finish("r")
    failed = rig.settle()[-1]
    assert isinstance(failed, BackupFailed)
    assert (failed.pages, failed.stored) == (4, 3)
    assert rig.host.stats().used_bytes == 0
    assert backend.exists([NAMESPACE.key(k) for k in keys]) == [True, False, True, True]


def test_failed_copy_stops_the_request_and_keeps_the_prefix(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig()
    rig.manager.start("r", [])
    assert rig.manager.on_decoded("r", list(range(4)), [5]) == 1
    rig.io.fail = True
    assert rig.manager.on_decoded("r", list(range(4, 8)), [5, 6]) == 1
    rig.io.fail = False
    events = rig.manager.poll()
    assert isinstance(events[0], OffloadFailed)
    assert events[0].pages == 1
    assert rig.manager.on_decoded("r", list(range(8, 12)), [5, 6, 7]) == 0  # stopped
    rig.manager.finish("r")
    assert rig.settle()[-1] == BackupDone(request_id="r", pages=1, attempts=1)
    assert rig.host.stats().used_bytes == 0
    keys = page_hashes(list(range(8)), PAGE)
    assert backend.exists([NAMESPACE.key(k) for k in keys]) == [True, False]


def test_abort_frees_host_pages_and_stores_nothing(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig()
    rig.manager.start("r", [])
    rig.manager.on_decoded("r", list(range(8)), [1, 2])
    rig.manager.abort("r")
    assert rig.settle() == [DeviceReleased(request_id="r", pages=2)]
    assert rig.host.stats().used_bytes == 0
    assert backend.exists([NAMESPACE.key(page_hashes(list(range(4)), PAGE)[0])]) == [False]
    rig.manager.abort("r")  # unknown now: ignored


def test_abort_during_backup_frees_after_it_ends(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig()
    rig.store.gate.clear()
    rig.manager.start("r", [])
    rig.manager.on_decoded("r", list(range(8)), [1, 2])
    rig.manager.finish("r")
    assert rig.manager.poll() == [DeviceReleased(request_id="r", pages=2)]  # backup submitted
    rig.manager.abort("r")
    assert rig.host.stats().used_bytes > 0  # the backup may still read them
    rig.store.gate.set()
    assert rig.settle() == []
    assert rig.host.stats().used_bytes == 0


def test_full_host_pool_defers_the_stride(backend: Backend, make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host_pages=2)
    rig.manager.start("a", [])
    rig.manager.start("b", [])
    assert rig.manager.on_decoded("a", list(range(8)), [0, 1]) == 2
    assert rig.manager.on_decoded("b", list(range(4)), [2]) == 0  # pool full
    assert rig.manager.stats().deferred == 1
    rig.manager.finish("a")
    rig.settle()
    assert rig.manager.on_decoded("b", [], [2]) == 1  # retried once room is back
    rig.manager.finish("b")
    assert rig.settle()[-1] == BackupDone(request_id="b", pages=1, attempts=1)


def test_full_storage_queue_defers_the_backup(
    backend: Backend, make_rig: Callable[..., Rig]
) -> None:
    rig = make_rig(pipeline=StoragePipelineConfig(workers=1, queue_depth=1))
    rig.store.gate.clear()  # the worker holds the first backup
    for i in range(3):
        rig.manager.start(f"r{i}", [])
        rig.manager.on_decoded(f"r{i}", [100 * i + t for t in range(4)], [i])
        rig.manager.finish(f"r{i}")
    events = rig.manager.poll()
    assert rig.storage.metrics().put.rejected >= 1  # a backup found the queue full
    rig.store.gate.set()
    events += rig.settle()
    done = sorted(e.request_id for e in events if isinstance(e, BackupDone))
    assert done == ["r0", "r1", "r2"]
    assert rig.host.stats().used_bytes == 0


def test_many_requests_interleaved(backend: Backend, make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host_pages=64)
    # Distinct tokens per request: keys name content, and this device's KV is random.
    requests = {f"r{i}": list(range(i * 8, i * 8 + 8)) for i in range(6)}
    for rid in requests:
        rig.manager.start(rid, [])
    events: list[DecodeEvent] = []
    for step in range(24):
        for i, rid in enumerate(requests):
            if step <= 10 + i:
                rig.manager.on_decoded(rid, [1000 * i + step], requests[rid])
            if step == 10 + i:
                rig.manager.finish(rid)
        events += rig.manager.poll()
    events += rig.settle()
    done = {e.request_id: e.pages for e in events if isinstance(e, BackupDone)}
    assert done == {f"r{i}": (11 + i) // PAGE for i in range(6) if (11 + i) // PAGE}
    for i, rid in enumerate(requests):
        n = (11 + i) // PAGE
        keys = page_hashes([1000 * i + s for s in range(11 + i)], PAGE)[:n]
        fresh = rig.read_back(keys, requests[rid][:n])
        assert same_bits(rig.device_kv, fresh, requests[rid][:n])
    assert rig.host.stats().used_bytes == 0


def test_misuse_is_refused(backend: Backend, make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    with pytest.raises(StateError):
        rig.manager.on_decoded("nobody", [1], [0])
    rig.manager.start("r", [])
    with pytest.raises(StateError):
        rig.manager.start("r", [])
    with pytest.raises(ConfigError):
        rig.manager.start("s", [1, 2, 3], stored_tokens=3)
    with pytest.raises(ConfigError):
        rig.manager.on_decoded("r", list(range(8)), [0])  # names one page of two
    with pytest.raises(ConfigError):
        rig.manager.on_decoded("r", list(range(8)), [0, DEVICE_PAGES])  # no such page
    assert rig.host.stats().used_bytes == 0
    assert rig.manager.on_decoded("r", list(range(4)), [0]) == 1  # nothing was kept
    rig.manager.finish("r")
    with pytest.raises(StateError):
        rig.manager.finish("r")
    with pytest.raises(ConfigError):
        DecodeOffloadConfig(stride_pages=0)
