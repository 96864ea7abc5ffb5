"""The device<->host pipeline on CUDA, every layout x attention: what the basic file leaves out.

``test_device_pipeline.py`` checks each layout x attention x dtype x backend byte-exactly, one
transfer at a time, and the layer waits and concurrency on one layout each. This file adds,
for every layout x attention (MHA and MLA):

- layer-wise waits: a slow load (a device-side sleep before each layer), each layer read
  right after ``layer_counter.wait(layer)`` sees exactly the loaded bytes;
- concurrent offload and load: both in flight together on their own streams (disjoint
  pages), both byte-exact, results drained in submission order;
- a round trip: every host page offloaded from shuffled device pages, then loaded into other
  device pages, in page-locked (UVA) and pageable (staged) host memory;
- crossing directions on one host page: a load submitted while an offload still writes the
  page reads the new bytes, and an offload submitted while a load still reads the page waits
  for it (the two directions run on different streams).

Marked ``gpu``: skipped with a reason where CUDA is absent. The reference is computed on CPU
copies with SGLang's layout formulas, as in ``test_device_pipeline.py`` (both use
``tests/support/gpu_kv.py``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from support import gpu_kv
from support.gpu_kv import (
    COMBO_IDS,
    COMBOS,
    expected_load,
    expected_offload,
    make_host,
    same_bits,
    tensors,
)

from sglang_storage.memory import (
    Attention,
    KVGeometry,
    KVHostPool,
    KVLayout,
    Pinning,
)
from sglang_storage.transfer.device import (
    DeviceHostPipeline,
    DeviceTransferConfig,
    DeviceTransferState,
)
from sglang_storage.transfer.device_kv import DeviceKV
from sglang_storage.transfer.io import IOBackend, TorchIOBackend

pytestmark = pytest.mark.gpu

MHA, MLA = Attention.MHA, Attention.MLA
LAYERS, PAGE, HOST_PAGES, DEVICE_PAGES, HEADS, DIM, MLA_DIM = 4, 16, 10, 24, 4, 64, 576
SLEEP_CYCLES = 50_000_000  # about 25 ms at 2 GHz


def device_sleep() -> None:
    """Keep the current stream busy for about 25 ms."""
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]


def make_device(g: KVGeometry, seed: int) -> DeviceKV:
    return gpu_kv.make_device(g, DEVICE_PAGES * PAGE, seed)


def tokens_of(pages: list[int]) -> list[int]:
    return gpu_kv.tokens_of(pages, PAGE)


def slow_backend(inner: IOBackend, *, loads: bool = True, offloads: bool = True) -> IOBackend:
    return gpu_kv.SlowBackend(inner, device_sleep, loads=loads, offloads=offloads)


def make_geometry(attention: Attention, layout: KVLayout) -> KVGeometry:
    mla = attention is MLA
    return KVGeometry(
        attention=attention,
        layout=layout,
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=HOST_PAGES,
        head_num=1 if mla else HEADS,
        head_dim=MLA_DIM if mla else DIM,
    )


def slow_pipeline(
    device: DeviceKV, host: KVHostPool, *, loads: bool = True, offloads: bool = True
) -> DeviceHostPipeline:
    backend = slow_backend(TorchIOBackend(device, host), loads=loads, offloads=offloads)
    return DeviceHostPipeline(device, host, io_backend=backend)


@pytest.fixture(autouse=True)
def device_synchronized() -> Iterator[None]:
    yield
    torch.cuda.synchronize()


@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_each_layer_is_complete_after_its_wait(attention: Attention, layout: KVLayout) -> None:
    g = make_geometry(attention, layout)
    device, host = make_device(g, 1), make_host(g, Pinning.ALWAYS, 2)
    pairs = [(3, 11), (0, 2), (7, 19)]
    want = expected_load(host.kv_buffer, [t.cpu() for t in tensors(device)], g, pairs)
    rows = torch.tensor(tokens_of([d for _, d in pairs]), device="cuda")
    before = [t.cpu() for t in tensors(device)]
    planes = g.kv_planes
    with slow_pipeline(device, host) as pipe:
        load = pipe.load([h for h, _ in pairs], tokens_of([d for _, d in pairs]))
        pipe.layer_counter.set_consumer(load)
        seen: list[list[torch.Tensor]] = []
        ahead: list[list[torch.Tensor]] = []
        for layer in range(LAYERS):
            pipe.layer_counter.wait(layer)  # the current stream waits for this layer only
            # Clones on the current stream, ordered after the wait and before later layers land.
            seen.append(
                [tensors(device)[p * LAYERS + layer].index_select(0, rows) for p in range(planes)]
            )
            if layer + 1 < LAYERS:  # the next layer is behind a 25 ms sleep: still the old rows
                ahead.append(
                    [
                        tensors(device)[p * LAYERS + layer + 1].index_select(0, rows)
                        for p in range(planes)
                    ]
                )
        assert load.wait().ok
    for layer in range(LAYERS):
        for p in range(planes):
            assert same_bits(seen[layer][p], want[p * LAYERS + layer][rows.cpu()])
    # Waiting for layer i did not wait for the whole load.
    for layer in range(LAYERS - 1):
        for p in range(planes):
            assert same_bits(ahead[layer][p], before[p * LAYERS + layer + 1][rows.cpu()])


@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_offload_and_load_in_flight_together(attention: Attention, layout: KVLayout) -> None:
    g = make_geometry(attention, layout)
    device, host = make_device(g, 3), make_host(g, Pinning.ALWAYS, 4)
    out_pairs = [(1, 5), (4, 9), (8, 0)]  # host pages 1, 4, 8 <- device pages 5, 9, 0
    in_pairs = [(2, 14), (6, 21)]  # host pages 2, 6 -> device pages 14, 21 (all disjoint)
    before_device = [t.cpu() for t in tensors(device)]
    want_host = expected_offload(host.kv_buffer, before_device, g, out_pairs)
    want_device = expected_load(host.kv_buffer, before_device, g, in_pairs)
    with slow_pipeline(device, host) as pipe:
        offload = pipe.offload([h for h, _ in out_pairs], tokens_of([d for _, d in out_pairs]))
        load = pipe.load([h for h, _ in in_pairs], tokens_of([d for _, d in in_pairs]))
        assert pipe.in_flight == 2
        assert not offload.done()
        assert not load.done()
        assert host.stats().pinned_bytes == 5 * g.page_bytes
        results = pipe.drain()
        assert [r.transfer_id for r in results] == [offload.transfer_id, load.transfer_id]
        assert all(r.ok for r in results)
        assert host.stats().pinned_bytes == 0
    assert same_bits(host.kv_buffer, want_host)
    assert all(same_bits(a, b) for a, b in zip(want_device, tensors(device), strict=True))


@pytest.mark.parametrize("pinning", [Pinning.ALWAYS, Pinning.NEVER], ids=["uva", "staged"])
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_every_page_round_trips(attention: Attention, layout: KVLayout, pinning: Pinning) -> None:
    g = make_geometry(attention, layout)
    device, host = make_device(g, 5), make_host(g, pinning, 6)
    rng = random.Random(7)
    sources = rng.sample(range(DEVICE_PAGES), HOST_PAGES)
    targets = rng.sample([p for p in range(DEVICE_PAGES) if p not in sources], HOST_PAGES)
    host_pages = list(range(HOST_PAGES))
    rng.shuffle(host_pages)
    original = [t.cpu() for t in tensors(device)]
    config = DeviceTransferConfig(io_backend="torch")
    with DeviceHostPipeline(device, host, config) as pipe:
        assert pipe.offload(host_pages, tokens_of(sources)).wait().ok
        load = pipe.load(torch.tensor(host_pages), torch.tensor(tokens_of(targets)))
        assert load.wait().ok
    for before, after in zip(original, tensors(device), strict=True):
        src = torch.tensor(tokens_of(sources))
        dst = torch.tensor(tokens_of(targets))
        assert same_bits(after.cpu()[dst], before[src])  # loaded back, byte for byte
        assert same_bits(after.cpu()[src], before[src])  # the sources are untouched


@pytest.mark.parametrize(("attention", "layout"), COMBOS[:2], ids=COMBO_IDS[:2])
def test_a_load_of_a_host_page_being_offloaded_reads_the_new_bytes(
    attention: Attention, layout: KVLayout
) -> None:
    g = make_geometry(attention, layout)
    device, host = make_device(g, 21), make_host(g, Pinning.ALWAYS, 22)
    before = [t.cpu() for t in tensors(device)]
    # Only the offload sleeps: without ordering the load would read host page 3 first.
    with slow_pipeline(device, host, loads=False) as pipe:
        offload = pipe.offload([3], tokens_of([5]))  # host 3 <- device 5
        load = pipe.load([3], tokens_of([12]))  # host 3 -> device 12, the other stream
        assert not offload.done()
        assert [r.ok for r in pipe.drain()] == [True, True]
        assert load.state is DeviceTransferState.DONE
    src, dst = torch.tensor(tokens_of([5])), torch.tensor(tokens_of([12]))
    for old, new in zip(before, tensors(device), strict=True):
        assert same_bits(new.cpu()[dst], old[src])


@pytest.mark.parametrize(("attention", "layout"), COMBOS[:2], ids=COMBO_IDS[:2])
def test_an_offload_into_a_host_page_being_loaded_waits_for_the_load(
    attention: Attention, layout: KVLayout
) -> None:
    g = make_geometry(attention, layout)
    device, host = make_device(g, 23), make_host(g, Pinning.ALWAYS, 24)
    before = [t.cpu() for t in tensors(device)]
    want_device = expected_load(host.kv_buffer, before, g, [(3, 12)])  # the old host page
    want_host = expected_offload(host.kv_buffer, before, g, [(3, 5)])  # then overwritten
    # Only the load sleeps (before each layer): unordered, the offload would overwrite
    # host page 3 before the load's later layers read it.
    with slow_pipeline(device, host, offloads=False) as pipe:
        load = pipe.load([3], tokens_of([12]))
        offload = pipe.offload([3], tokens_of([5]))
        assert not load.done()
        assert [r.ok for r in pipe.drain()] == [True, True]
        assert offload.state is DeviceTransferState.DONE
    assert all(same_bits(a, b) for a, b in zip(want_device, tensors(device), strict=True))
    assert same_bits(host.kv_buffer, want_host)
