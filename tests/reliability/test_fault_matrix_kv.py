"""Fault matrix, KV cache: seeded fault schedules x the KV cache manager's tier life cycle.

The manager runs over real host pools and pipelines (CPU tensors as the device) and a
:class:`~sglang_storage.storage.FaultInjectingBackend` around the real ``memory``, ``file``
(``durability=full``) and ``hf3fs`` (its POSIX client under ``tmp_path``) backends. Each
round writes device pages to host and storage (write-through, with a side record per page),
evicts them from host, asks storage for the hit, prefetches and loads them into other device
pages. Asserted, and recorded in the ledger: every byte loaded equals the original (a shorter
hit or an error is fine), no call or wait passes its bound, and once faults stop every page
the manager reported backed up is still readable, byte for byte (after reopening the store,
for ``file`` and ``hf3fs``), unless the injector destroyed it on purpose (torn, flipped,
vanished).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import torch
from support.fault_matrix import (
    WAIT_BOUND_S,
    Watch,
    host_memory,
    schedules,
)
from support.ledger import Ledger

from sglang_storage.core import GetRequest, ObjectKey, ObjectSpec
from sglang_storage.managers.kv import (
    BackupDone,
    KVCacheConfig,
    KVCacheManager,
    KVEvent,
    PrefetchDone,
    SidePool,
)
from sglang_storage.memory import (
    Attention,
    HostMemory,
    KVGeometry,
    KVHostPool,
    KVLayout,
    RecordPool,
    RecordPoolConfig,
)
from sglang_storage.policy import (
    PrefetchStopConfig,
    WritePolicyConfig,
    make_prefetch_stop_policy,
    make_write_policy,
)
from sglang_storage.storage import (
    Backend,
    Durability,
    FaultInjectingBackend,
    FileBackend,
    FileBackendConfig,
    Hf3fsBackend,
    Hf3fsBackendConfig,
    MemoryBackend,
)
from sglang_storage.storage.keys import kv_namespace, model_fingerprint, page_hashes
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceKV,
    StoragePipeline,
    StoragePipelineConfig,
)

LEDGER_AREA = "fault matrix: KV cache"

SCHEDULES = schedules(100)

PAGE = 4
PAGES = 4
ROUNDS = 8
DEVICE_PAGES = 2 * PAGES * ROUNDS
HOST_PAGES = 16
NAMESPACE = kv_namespace(model_fingerprint("test/kv-faults", page_size=PAGE), mla=False)
SIDE = "mamba"


def _memory() -> HostMemory:
    return host_memory(64 << 20)


def _geometry(num_pages: int) -> KVGeometry:
    return KVGeometry(
        attention=Attention.MHA,
        layout=KVLayout.PAGE_FIRST,
        dtype=torch.bfloat16,
        layer_num=2,
        page_size=PAGE,
        num_pages=num_pages,
        head_num=2,
        head_dim=8,
    )


def _tokens(pages: Sequence[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)], dtype=torch.int64)


def _random_device(g: KVGeometry) -> DeviceKV:
    kv = DeviceKV.allocate(g, DEVICE_PAGES * PAGE)
    gen = torch.Generator().manual_seed(5)
    for layer in range(g.layer_num):
        for plane in kv.planes(layer):
            bits = torch.randint(-(2**15), 2**15, plane.shape, generator=gen, dtype=torch.int16)
            plane.view(torch.int16).copy_(bits)
    return kv


def _wrong_bytes(kv: DeviceKV, src: Sequence[int], dst: Sequence[int]) -> int:
    a, b = _tokens(src), _tokens(dst)
    return sum(
        int((plane.view(torch.uint8)[a] != plane.view(torch.uint8)[b]).sum())
        for layer in range(kv.geometry.layer_num)
        for plane in kv.planes(layer)
    )


class Rig:
    """A KV cache manager over a faulty-wrapped real backend."""

    def __init__(self, store: FaultInjectingBackend) -> None:
        g = _geometry(HOST_PAGES)
        self.device = _random_device(g)
        self.host = KVHostPool(g, _memory())
        self.records = RecordPool(
            RecordPoolConfig(shape=(3,), dtype=torch.float32, capacity=HOST_PAGES), _memory()
        )
        self.side_pool = SidePool(name=SIDE, pool=self.records)
        self.store = store
        self.storage = StoragePipeline(store, StoragePipelineConfig(workers=2, batch_pages=4))
        self.manager = KVCacheManager(
            host=self.host,
            device=DeviceHostPipeline(self.device, self.host),
            storage=self.storage,
            namespace=NAMESPACE,
            write_policy=make_write_policy(WritePolicyConfig(name="write_through")),
            prefetch_policy=make_prefetch_stop_policy(
                PrefetchStopConfig(name="wait_complete", threshold_tokens=0), page_size=PAGE
            ),
            side_pools=[self.side_pool],
            config=KVCacheConfig(rank_timeout_s=1.0, exists_timeout_s=1.0, prefetch_batch_pages=2),
        )
        gen = torch.Generator().manual_seed(9)
        self.side_rows = torch.randn(DEVICE_PAGES, 3, generator=gen)
        self.events: list[KVEvent] = []

    def poll(self) -> None:
        self.events += self.manager.poll()

    def host_used(self) -> tuple[int, int]:
        return self.host.slots.stats().used, self.records.slots.stats().used

    def expected_pages(self, pages: Sequence[int]) -> list[bytes]:
        """The stored payload of each device page, through a fault-free host pool."""
        ref = KVHostPool(_geometry(len(pages)), _memory())
        slots = ref.alloc(len(pages))
        DeviceHostPipeline(self.device, ref).offload(slots, _tokens(pages))
        return [b"".join(bytes(v) for v in ref.page_views(int(s))) for s in slots.tolist()]


def _read(store: Backend, key: ObjectKey, spec: ObjectSpec) -> bytes | None:
    buffer = bytearray(spec.nbytes)
    (result,) = store.get_into([GetRequest(key=key, spec=spec, buffers=[buffer])])
    return bytes(buffer) if result.hit else None


def _hf3fs_config(root: Path) -> Hf3fsBackendConfig:
    return Hf3fsBackendConfig(
        root=root, client="posix", allow_non_3fs=True, data_file_size=1 << 20, data_files=2
    )


def _reopen(backend: Backend) -> Backend:
    """A new instance on ``backend``'s durable store (closing it), or ``backend`` itself."""
    if isinstance(backend, FileBackend):
        backend.close()
        return FileBackend(FileBackendConfig(root=backend.root, durability=Durability.FULL))
    if isinstance(backend, Hf3fsBackend):
        backend.close()
        return Hf3fsBackend(_hf3fs_config(backend.root))
    return backend


@pytest.fixture(params=["memory", "file", "hf3fs"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend: Backend
    if request.param == "memory":
        backend = MemoryBackend()
    elif request.param == "file":
        backend = FileBackend(FileBackendConfig(root=tmp_path / "kv", durability=Durability.FULL))
    else:
        (tmp_path / "hf3fs").mkdir()
        backend = Hf3fsBackend(_hf3fs_config(tmp_path / "hf3fs"))
    yield backend
    backend.close()


def _round(rig: Rig, watch: Watch, r: int, acked: dict[str, int]) -> int:
    """One life cycle of ``PAGES`` pages; returns the pages loaded back (and checked)."""
    m, ledger = rig.manager, watch.ledger
    src = list(range(r * PAGES, (r + 1) * PAGES))
    dst = [p + PAGES * ROUNDS for p in src]
    keys = page_hashes([10_000 * (r + 1) + t for t in range(PAGES * PAGE)], PAGE)
    rig.events.clear()
    watch.call(lambda: m.device_hit(keys, _tokens(src), side={SIDE: rig.side_rows[src]}))

    def ended() -> set[str]:
        return {k for e in rig.events if isinstance(e, BackupDone) for k in e.stored + e.failed}

    watch.until(rig.poll, lambda: ended() >= set(keys))
    for e in rig.events:
        if isinstance(e, BackupDone):
            acked.update({k: src[keys.index(k)] for k in e.stored})
    watch.call(lambda: m.evict_host(keys))
    watch.until(rig.poll, lambda: rig.host_used() == (0, 0))
    watch.call(lambda: m.storage_hit_pages(keys))
    if not watch.call(lambda: m.prefetch(f"r{r}", keys)):
        return 0
    done: list[PrefetchDone] = []

    def check() -> None:
        found = m.check_prefetch(f"r{r}")
        if found is not None:
            done.append(found)

    if not watch.until(check, lambda: bool(done)):
        return 0
    got = list(done[0].keys)
    assert got == keys[: len(got)]  # a prefix of what was asked, never more
    n = len(got)
    if not n:
        return 0
    load = m.load(got, _tokens(dst[:n]))
    ledger.operation()
    if load.handle.wait().ok:
        ledger.wrong(_wrong_bytes(rig.device, src[:n], dst[:n]))
        side, expected = load.side[SIDE], rig.side_rows[src[:n]]
        ledger.wrong(int((side.view(torch.uint8) != expected.view(torch.uint8)).sum()))
    watch.call(lambda: m.evict_host(got))
    watch.until(rig.poll, lambda: rig.host_used() == (0, 0))
    return n


def _lost(rig: Rig, store: FaultInjectingBackend, acked: dict[str, int]) -> int:
    """Acknowledged pages (not destroyed on purpose) that no longer read back exactly."""
    inner = store.inner
    survivor = _reopen(inner)
    damaged = store.damaged_keys()
    expected = dict(zip(acked, rig.expected_pages(list(acked.values())), strict=True))
    lost = 0
    try:
        for page_key, device_page in acked.items():
            kv_key, side_key = NAMESPACE.key(page_key), NAMESPACE.key(f"{page_key}-{SIDE}")
            if kv_key in damaged or side_key in damaged:
                continue
            ok = _read(survivor, kv_key, rig.host.page_spec) == expected[page_key]
            side_bytes = rig.side_rows[device_page].numpy().tobytes()
            ok = ok and _read(survivor, side_key, rig.side_pool.spec) == side_bytes
            lost += not ok
    finally:
        if survivor is not inner:
            survivor.close()
    return lost


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_kv_cache_under_faults_returns_only_correct_bytes(
    inner: Backend, schedule: str, seed: int, ledger: Ledger
) -> None:
    store = FaultInjectingBackend(inner, attrs.evolve(SCHEDULES[schedule], seed=seed))
    rig = Rig(store)
    acked: dict[str, int] = {}  # page key -> the device page it was written from
    loaded = 0
    try:
        for r in range(ROUNDS):
            loaded += _round(rig, Watch(ledger), r, acked)
    finally:
        ledger.add_faults(store.fault_stats().by_kind)
        rig.storage.close(timeout_s=WAIT_BOUND_S)
    store.pause()  # faults stop
    ledger.operation(len(acked))
    ledger.lost(_lost(rig, store, acked))

    assert ledger.wrong_bytes == 0
    assert ledger.hangs == 0
    assert ledger.lost_durable == 0
    assert sum(ledger.faults.values()) > 0, "the schedule injected nothing"
    assert loaded > 0, "nothing was loaded back: the test checked no delivery"
