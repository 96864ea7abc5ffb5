"""The device<->host pipeline on CUDA: streams, events, layer-wise waits, both I/O backends.

Marked ``gpu``: skipped with a reason where CUDA is absent. Expected bytes are computed on
CPU copies with SGLang's layout formulas (the same reference as the CPU unit tests). Slow
transfers are made with ``torch.cuda._sleep`` on the transfer stream, so that "still in
flight" is observable and the layer waits are what makes the results right.
"""

from __future__ import annotations

import random
import time
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

from sglang_storage.errors import BackendUnavailableError
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
from sglang_storage.transfer.io import IOBackend, IOBackendChoice, TorchIOBackend
from sglang_storage.transfer.io_kernel import kernel_unavailable_reason

pytestmark = pytest.mark.gpu

MHA, MLA = Attention.MHA, Attention.MLA
DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
DTYPE_IDS = ["bf16", "fp8"]
LAYERS, PAGE, HOST_PAGES, DEVICE_PAGES, HEADS, DIM, MLA_DIM = 3, 16, 12, 20, 4, 64, 576
SLEEP_CYCLES = 100_000_000  # about 50 ms at 2 GHz


def device_sleep() -> None:
    """Keep the current stream busy for about 50 ms."""
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]


def make_device(g: KVGeometry, seed: int) -> DeviceKV:
    return gpu_kv.make_device(g, DEVICE_PAGES * PAGE, seed)


def tokens_of(pages: list[int]) -> list[int]:
    return gpu_kv.tokens_of(pages, PAGE)


def slow_backend(inner: IOBackend) -> IOBackend:
    return gpu_kv.SlowBackend(inner, device_sleep)


def make_geometry(attention: Attention, layout: KVLayout, dtype: torch.dtype) -> KVGeometry:
    mla = attention is MLA
    return KVGeometry(
        attention=attention,
        layout=layout,
        dtype=dtype,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=HOST_PAGES,
        head_num=1 if mla else HEADS,
        head_dim=MLA_DIM if mla else DIM,
    )


def random_pairs(seed: int, n: int = 5) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    hosts, devices = rng.sample(range(HOST_PAGES), n), rng.sample(range(DEVICE_PAGES), n)
    return list(zip(hosts, devices, strict=True))


def skip_without_kernel(device: DeviceKV, host: KVHostPool) -> None:
    reason = kernel_unavailable_reason(device, host)
    if reason is not None:
        pytest.skip(f"the kernel backend cannot run here: {reason}")


@pytest.fixture(autouse=True)
def device_synchronized() -> Iterator[None]:
    yield
    torch.cuda.synchronize()


# ---------------------------------------------------------------------- byte exactness


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize(
    ("backend", "pinning"),
    [("torch", Pinning.ALWAYS), ("torch", Pinning.NEVER), ("kernel", Pinning.ALWAYS)],
    ids=["torch-uva", "torch-staged", "kernel"],
)
def test_offload_and_load_match_reference(
    backend: str, pinning: Pinning, attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> None:
    g = make_geometry(attention, layout, dtype)
    device, host = make_device(g, 1), make_host(g, pinning, 2)
    if backend == "kernel":
        skip_without_kernel(device, host)
    config = DeviceTransferConfig(io_backend=IOBackendChoice(backend))
    with DeviceHostPipeline(device, host, config) as pipe:
        assert pipe.io_backend == backend
        out_pairs = random_pairs(3)
        want_host = expected_offload(
            host.kv_buffer, [t.cpu() for t in tensors(device)], g, out_pairs
        )
        offload = pipe.offload([h for h, _ in out_pairs], tokens_of([d for _, d in out_pairs]))
        assert offload.wait().ok
        assert same_bits(host.kv_buffer, want_host)

        in_pairs = random_pairs(4)
        want_device = expected_load(host.kv_buffer, [t.cpu() for t in tensors(device)], g, in_pairs)
        load = pipe.load(
            torch.tensor([h for h, _ in in_pairs]),
            torch.tensor(tokens_of([d for _, d in in_pairs]), device="cuda"),  # device indices
        )
        pipe.layer_counter.set_consumer(load)
        for layer in range(LAYERS):
            pipe.layer_counter.wait(layer)
        assert load.wait().ok
        assert all(same_bits(a, b) for a, b in zip(want_device, tensors(device), strict=True))
        held = {h for h, _ in out_pairs} | {h for h, _ in in_pairs}
        assert host.stats().pinned_bytes == len(held) * g.page_bytes  # waited on, not collected
        assert [r.transfer_id for r in pipe.poll()] == [offload.transfer_id, load.transfer_id]
        assert host.stats().pinned_bytes == 0


def test_torch_backend_modes() -> None:
    g = make_geometry(MHA, KVLayout.PAGE_FIRST, torch.bfloat16)
    device = make_device(g, 5)
    assert TorchIOBackend(device, make_host(g, Pinning.ALWAYS, 6)).mode == "uva"
    assert TorchIOBackend(device, make_host(g, Pinning.NEVER, 7)).mode == "staged"


def test_kernel_needs_page_locked_host_memory() -> None:
    g = make_geometry(MHA, KVLayout.LAYER_FIRST, torch.bfloat16)
    device, host = make_device(g, 8), make_host(g, Pinning.NEVER, 9)
    with pytest.raises(BackendUnavailableError, match="page-locked"):
        DeviceHostPipeline(device, host, DeviceTransferConfig(io_backend="kernel"))
    assert DeviceHostPipeline(device, host).io_backend == "torch"  # auto falls back, and logs


def test_auto_prefers_the_kernel_where_it_runs() -> None:
    g = make_geometry(MHA, KVLayout.PAGE_FIRST, torch.bfloat16)
    device, host = make_device(g, 10), make_host(g, Pinning.ALWAYS, 11)
    expected = "torch" if kernel_unavailable_reason(device, host) else "kernel"
    assert DeviceHostPipeline(device, host).io_backend == expected


# ---------------------------------------------------------------------- asynchrony


def slow_pipeline(device: DeviceKV, host: KVHostPool) -> DeviceHostPipeline:
    return DeviceHostPipeline(device, host, io_backend=slow_backend(TorchIOBackend(device, host)))


def test_load_is_asynchronous_and_layer_waits_order_compute() -> None:
    g = make_geometry(MHA, KVLayout.PAGE_FIRST, torch.bfloat16)
    device, host = make_device(g, 12), make_host(g, Pinning.ALWAYS, 13)
    pairs = [(2, 7), (9, 3)]
    rows = torch.tensor(tokens_of([d for _, d in pairs]), device="cuda")
    # Warm every kernel and allocation below first: the first launch of a kernel in a
    # process (CUDA's lazy module loading) and a new allocator segment can wait for the
    # whole device, sleeping transfer included, which would hide the stale read.
    device.k[LAYERS - 1].index_select(0, rows)
    torch.cuda._sleep(1)  # type: ignore[no-untyped-call]
    with DeviceHostPipeline(device, host, DeviceTransferConfig(io_backend="torch")) as warm:
        assert warm.load([5], tokens_of([11])).wait().ok  # device page 11 is not read below
    before = [t.cpu() for t in tensors(device)]
    want = expected_load(host.kv_buffer, before, g, pairs)
    with slow_pipeline(device, host) as pipe:
        load = pipe.load([h for h, _ in pairs], tokens_of([d for _, d in pairs]))
        assert not load.done()
        assert load.state is DeviceTransferState.IN_FLIGHT
        assert host.stats().pinned_bytes == 2 * g.page_bytes  # pinned while in flight
        assert pipe.poll() == []
        # Without a wait, compute reads the old rows: the copy is still sleeping.
        stale = device.k[LAYERS - 1].index_select(0, rows)
        pipe.layer_counter.set_consumer(load)
        seen = []
        for layer in range(LAYERS):
            pipe.layer_counter.wait(layer)  # the current stream waits; the host does not
            seen.append(device.k[layer].index_select(0, rows))
        result = load.wait()
        assert result.ok
        assert result.latency_s > 0.01  # device time, sleeps included
        assert load.done()
        assert host.stats().pinned_bytes == 2 * g.page_bytes  # until the owner collects it
        assert pipe.poll() == [result]
        assert host.stats().pinned_bytes == 0
    assert same_bits(stale, before[LAYERS - 1][rows.cpu()])
    for layer in range(LAYERS):
        assert same_bits(seen[layer], want[layer][rows.cpu()])


def test_offload_waits_for_compute_queued_before_it() -> None:
    g = make_geometry(MLA, KVLayout.PAGE_FIRST_DIRECT, torch.bfloat16)
    device, host = make_device(g, 14), make_host(g, Pinning.ALWAYS, 15)
    rows = slice(4 * PAGE, 5 * PAGE)
    with DeviceHostPipeline(device, host, DeviceTransferConfig(io_backend="torch")) as pipe:
        assert pipe.offload([7], tokens_of([3])).wait().ok  # warm: nothing below allocates
        device_sleep()  # compute is busy...
        for tensor in device.k:
            tensor[rows].view(torch.uint8).fill_(0x5A)  # ...then writes the page
        handle = pipe.offload([6], tokens_of([4]))
        assert not handle.done()  # submitting did not wait for compute: the stream does
        assert handle.wait().ok
    for layer in range(LAYERS):
        assert bool((host.layer(layer).k[6].view(torch.uint8) == 0x5A).all())


def test_fence_keeps_compute_from_overwriting_pages_being_offloaded() -> None:
    g = make_geometry(MHA, KVLayout.LAYER_FIRST, torch.float8_e4m3fn)
    device, host = make_device(g, 16), make_host(g, Pinning.ALWAYS, 17)
    want = expected_offload(host.kv_buffer, [t.cpu() for t in tensors(device)], g, [(1, 2)])
    with slow_pipeline(device, host) as pipe:
        handle = pipe.offload([1], tokens_of([2]))
        handle.fence()
        for tensor in tensors(device):
            tensor[2 * PAGE : 3 * PAGE].view(torch.uint8).fill_(0)  # after the fence
        assert handle.wait().ok
    assert same_bits(host.kv_buffer, want)


def test_loads_in_flight_together_and_drain() -> None:
    g = make_geometry(MHA, KVLayout.PAGE_HEAD, torch.bfloat16)
    device, host = make_device(g, 18), make_host(g, Pinning.ALWAYS, 19)
    with slow_pipeline(device, host) as pipe:
        first = pipe.load([0], tokens_of([0]))
        second = pipe.load([1], tokens_of([1]))
        offload = pipe.offload([2], tokens_of([5]))
        assert pipe.in_flight == 3
        pipe.layer_counter.set_consumer(second)
        pipe.layer_counter.wait(LAYERS - 1)
        results = pipe.drain()
        assert [r.transfer_id for r in results] == [
            first.transfer_id,
            second.transfer_id,
            offload.transfer_id,
        ]
        assert all(r.ok for r in results)
        assert pipe.metrics().load.transfers == 2
        assert host.stats().pinned_bytes == 0


def test_trusted_cuda_tokens_are_submitted_without_waiting_for_the_gpu() -> None:
    g = make_geometry(MHA, KVLayout.PAGE_FIRST, torch.bfloat16)
    device, host = make_device(g, 20), make_host(g, Pinning.ALWAYS, 21)
    before = [t.cpu() for t in tensors(device)]
    config = DeviceTransferConfig(io_backend="torch", check_device_tokens=False)
    out_tokens = torch.tensor(tokens_of([2, 7]), device="cuda")
    in_tokens = torch.tensor(tokens_of([11, 13]), device="cuda")
    with DeviceHostPipeline(device, host, config) as pipe:
        warm = torch.tensor(tokens_of([1]), device="cuda")
        assert pipe.offload([0], warm).wait().ok  # nothing below allocates for the first time
        device_sleep()  # compute is busy for about 50 ms
        started = time.perf_counter()
        offload = pipe.offload([3, 4], out_tokens)
        load = pipe.load([3, 4], in_tokens)  # reads what the offload writes (crossing)
        submitted = time.perf_counter() - started
        assert submitted < 0.025, f"submitting took {submitted:.3f} s: it waited for the GPU"
        assert not offload.done()
        assert offload.wait().ok
        assert load.wait().ok
    src, dst = torch.tensor(tokens_of([2, 7])), torch.tensor(tokens_of([11, 13]))
    for old, new in zip(before, tensors(device), strict=True):
        assert same_bits(new.cpu()[dst], old[src])
