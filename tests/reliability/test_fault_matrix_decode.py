"""Fault matrix, decode offload: seeded fault schedules x the decode offload manager.

Several decoding requests offload their KV stride by stride (CPU tensors as the device) and
back it up on finish through a :class:`~sglang_storage.storage.FaultInjectingBackend`
around the real ``memory`` and ``file`` (``durability=full``) backends, with retries. Then
a later reader (a prefill side) reads every page the manager reported backed up through the
faulty store. Asserted, and recorded in the ledger: every byte read is the original (a miss,
a corrupt object or an error is fine), no call or wait passes its bound, the host pool is
empty at the end, and once faults stop every acknowledged page (not destroyed on purpose)
reads back exactly (after reopening the store, for ``file``).
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
    open_inner,
    schedules,
)
from support.ledger import Ledger

from sglang_storage.core import GetRequest, ObjectKey, PutOutcome, PutRequest
from sglang_storage.errors import StorageError
from sglang_storage.managers.decode import (
    BackupDone,
    DecodeEvent,
    DecodeOffloadConfig,
    DecodeOffloadManager,
)
from sglang_storage.memory import (
    Attention,
    HostMemory,
    KVGeometry,
    KVHostPool,
    KVLayout,
)
from sglang_storage.storage import (
    Backend,
    Durability,
    FaultInjectingBackend,
    FaultSchedule,
    FileBackend,
    FileBackendConfig,
)
from sglang_storage.storage.keys import kv_namespace, model_fingerprint, page_hashes
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceKV,
    StoragePipeline,
    StoragePipelineConfig,
)

LEDGER_AREA = "fault matrix: decode offload"

SCHEDULES = schedules(200)

PAGE = 4
REQUESTS = 6
PAGES_PER_REQUEST = 4
DEVICE_PAGES = REQUESTS * PAGES_PER_REQUEST
NAMESPACE = kv_namespace(model_fingerprint("test/decode-faults", page_size=PAGE), mla=False)


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


def _random_device(g: KVGeometry) -> DeviceKV:
    kv = DeviceKV.allocate(g, DEVICE_PAGES * PAGE)
    gen = torch.Generator().manual_seed(11)
    for layer in range(g.layer_num):
        for plane in kv.planes(layer):
            bits = torch.randint(-(2**15), 2**15, plane.shape, generator=gen, dtype=torch.int16)
            plane.view(torch.int16).copy_(bits)
    return kv


def _expected_pages(device: DeviceKV, pages: Sequence[int]) -> list[bytes]:
    """The stored payload of each device page, through a fault-free host pool."""
    ref = KVHostPool(_geometry(max(1, len(pages))), _memory())
    slots = ref.alloc(len(pages))
    tokens = device.geometry.token_indices(torch.tensor(list(pages), dtype=torch.int64))
    DeviceHostPipeline(device, ref).offload(slots, tokens)
    return [b"".join(bytes(v) for v in ref.page_views(int(s))) for s in slots.tolist()]


@pytest.fixture(params=["memory", "file"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend = open_inner(request.param, tmp_path / "decode")
    yield backend
    backend.close()


def _read_back(
    store: Backend, host: KVHostPool, acked: dict[str, bytes], ledger: Ledger
) -> tuple[int, int]:
    """Read ``acked`` pages through ``store``: (wrong bytes among hits, hits)."""
    wrong = hits = 0
    reader = KVHostPool(host.geometry, _memory())
    for key, expected in acked.items():
        (page,) = reader.alloc(1).tolist()
        for view in reader.page_views(page):
            view[:] = bytes(view.nbytes)  # a reused page: clear what the last read left
        request = GetRequest(
            key=NAMESPACE.key(key), spec=host.page_spec, buffers=reader.page_views(page)
        )
        ledger.operation()
        try:
            (result,) = store.get_into([request])
        except StorageError:
            result = None
        got = b"".join(bytes(v) for v in reader.page_views(page))
        if result is not None and result.hit:
            hits += 1
            wrong += sum(a != b for a, b in zip(got, expected, strict=True))
        elif any(got):
            wrong += sum(1 for b in got if b)  # a failed read left bytes behind
        reader.free([page])
    return wrong, hits


def _lost(store: FaultInjectingBackend, host: KVHostPool, acked: dict[str, bytes]) -> int:
    """Acknowledged pages (not destroyed on purpose) that no longer read back exactly."""
    inner = store.inner
    survivor = inner
    if isinstance(inner, FileBackend):
        inner.close()
        survivor = FileBackend(FileBackendConfig(root=inner.root, durability=Durability.FULL))
    damaged: frozenset[ObjectKey] = store.damaged_keys()
    kept = {k: v for k, v in acked.items() if NAMESPACE.key(k) not in damaged}
    try:
        wrong, hits = _read_back(survivor, host, kept, Ledger("lost check", "scratch"))
    finally:
        if survivor is not inner:
            survivor.close()
    return len(kept) - hits + (wrong > 0)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_decode_offload_under_faults_stores_only_correct_bytes(
    inner: Backend, schedule: str, seed: int, ledger: Ledger
) -> None:
    store = FaultInjectingBackend(inner, attrs.evolve(SCHEDULES[schedule], seed=seed))
    g = _geometry(DEVICE_PAGES)
    device = _random_device(g)
    host = KVHostPool(g, _memory())
    storage = StoragePipeline(store, StoragePipelineConfig(workers=2, batch_pages=4))
    manager = DecodeOffloadManager(
        host=host,
        device=DeviceHostPipeline(device, host),
        storage=storage,
        namespace=NAMESPACE,
        config=DecodeOffloadConfig(stride_pages=1, max_retries=2),
    )
    watch = Watch(ledger)
    events: list[DecodeEvent] = []
    tokens = {
        f"r{i}": [1000 * (i + 1) + t for t in range(PAGES_PER_REQUEST * PAGE)]
        for i in range(REQUESTS)
    }
    pages = {
        f"r{i}": list(range(i * PAGES_PER_REQUEST, (i + 1) * PAGES_PER_REQUEST))
        for i in range(REQUESTS)
    }
    try:
        for rid in tokens:
            watch.call(lambda rid=rid: manager.start(rid, []))  # type: ignore[misc]
        for step in range(PAGES_PER_REQUEST * PAGE):
            for rid in tokens:
                token = tokens[rid][step]
                watch.call(lambda r=rid, t=token: manager.on_decoded(r, [t], pages[r]))  # type: ignore[misc]
            events += manager.poll()
        for rid in tokens:
            watch.call(lambda rid=rid: manager.finish(rid))  # type: ignore[misc]

        def poll() -> None:
            events.extend(manager.poll(timeout_s=0.01))

        watch.until(poll, lambda: not manager.busy)
        assert host.stats().used_bytes == 0  # every host page given back, done or failed
    finally:
        storage.close(timeout_s=WAIT_BOUND_S)

    acked: dict[str, bytes] = {}
    for event in events:
        if isinstance(event, BackupDone):
            rid = event.request_id
            keys = page_hashes(tokens[rid], PAGE)[: event.pages]
            expected = _expected_pages(device, pages[rid][: event.pages])
            acked.update(zip(keys, expected, strict=True))
    # A later reader, faults still on: hits must be exact.
    wrong, hits = _read_back(store, host, acked, ledger)
    ledger.wrong(wrong)
    ledger.add_faults(store.fault_stats().by_kind)
    store.pause()  # faults stop
    ledger.lost(_lost(store, host, acked))

    assert ledger.wrong_bytes == 0
    assert ledger.hangs == 0
    assert ledger.lost_durable == 0
    assert sum(ledger.faults.values()) > 0, "the schedule injected nothing"
    assert hits > 0, "no page was read back: the test checked no delivery"


def test_a_retried_put_of_a_torn_object_is_not_acknowledged(inner: Backend, ledger: Ledger) -> None:
    store = FaultInjectingBackend(inner, FaultSchedule(seed=1, torn_write_rate=1.0))
    g = _geometry(1)
    host = KVHostPool(g, _memory())
    (page,) = host.alloc(1).tolist()
    key = NAMESPACE.key("torn-page")
    request = PutRequest(key=key, spec=host.page_spec, buffers=host.page_views(page))
    (first,) = store.put_from([request])
    ledger.add_faults(store.fault_stats().by_kind)
    ledger.operation(2)
    assert first.outcome is PutOutcome.ERROR  # torn: the write did not complete
    store.pause()
    (retry,) = store.put_from([request])
    assert retry.outcome is not PutOutcome.PRESENT  # nothing readable is there to keep
