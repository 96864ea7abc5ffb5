"""The device<->host pipeline on CPU: byte-exact copies for every layout, handles, metrics.

The expected bytes are computed independently of the code under test: plain Python loops
over pages, layers, planes and tokens that index the host buffer with SGLang's layout
formulas (``init_kv_buffer`` dims in ``pool_host/mha.py`` / ``mla.py``), one ``(H, D)``
row at a time, and compare every bit of both pools (element bits, so fp8 NaN patterns
compare too).
"""

from __future__ import annotations

import importlib.util
import logging
import random
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_storage.config import build_config
from sglang_storage.errors import BackendUnavailableError, ConfigError, StateError, StorageError
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
from sglang_storage.memory.layouts import bits_dtype
from sglang_storage.transfer.device import (
    CopyDirection,
    CopyMetrics,
    DeviceHostPipeline,
    DeviceLoadHandle,
    DeviceTransferConfig,
    DeviceTransferResult,
    DeviceTransferState,
)
from sglang_storage.transfer.device_kv import DeviceKV
from sglang_storage.transfer.io import (
    CopyPlan,
    IOBackend,
    IOBackendChoice,
    TorchIOBackend,
    open_io_backend,
)

MHA, MLA = Attention.MHA, Attention.MLA
COMBOS = [
    (MHA, KVLayout.LAYER_FIRST),
    (MHA, KVLayout.PAGE_FIRST),
    (MHA, KVLayout.PAGE_FIRST_DIRECT),
    (MHA, KVLayout.PAGE_HEAD),
    (MLA, KVLayout.LAYER_FIRST),
    (MLA, KVLayout.PAGE_FIRST),
    (MLA, KVLayout.PAGE_FIRST_DIRECT),
]
COMBO_IDS = [f"{a.value}-{layout.value}" for a, layout in COMBOS]
DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float32]
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]

# Distinct sizes, so a swapped axis cannot go unnoticed.
LAYERS, PAGE, HOST_PAGES, DEVICE_PAGES, HEADS, DIM, MLA_DIM = 3, 4, 7, 9, 2, 8, 12


def make_memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0), facts=facts))


def make_geometry(
    attention: Attention = MHA,
    layout: KVLayout = KVLayout.PAGE_FIRST,
    dtype: torch.dtype = torch.bfloat16,
) -> KVGeometry:
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


def randomize(tensor: torch.Tensor, generator: torch.Generator) -> None:
    raw = tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def make_device(geometry: KVGeometry, seed: int) -> DeviceKV:
    device = DeviceKV.allocate(geometry, DEVICE_PAGES * PAGE + 3)  # a trailing partial page
    generator = torch.Generator().manual_seed(seed)
    for tensor in all_device_tensors(device):
        randomize(tensor, generator)
    return device


def make_host(geometry: KVGeometry, seed: int) -> KVHostPool:
    host = KVHostPool(geometry, make_memory())
    randomize(host.kv_buffer, torch.Generator().manual_seed(seed))
    host.alloc(geometry.num_pages)
    return host


def all_device_tensors(device: DeviceKV) -> list[torch.Tensor]:
    return [*device.k, *(device.v or ())]


def host_row(
    kv: torch.Tensor, geometry: KVGeometry, plane: int, layer: int, page: int, j: int
) -> torch.Tensor:
    """The ``(H, D)`` row of token ``j`` of host page ``page``, by SGLang's buffer dims."""
    buffer = kv if geometry.is_mla else kv[plane]
    token = page * geometry.page_size + j
    layout = geometry.layout
    if layout is KVLayout.LAYER_FIRST:  # (L, size, H, D)
        return buffer[layer, token]
    if layout is KVLayout.PAGE_FIRST:  # (size, L, H, D)
        return buffer[token, layer]
    if layout is KVLayout.PAGE_FIRST_DIRECT:  # (pages, L, page, H, D)
        return buffer[page, layer, j]
    return buffer[page, :, j, layer]  # page_head: (pages, H, page, L, D)


def device_row(
    tensors: list[torch.Tensor], geometry: KVGeometry, plane: int, layer: int, token: int
) -> torch.Tensor:
    return tensors[plane * geometry.layer_num + layer][token]


def expected_offload(
    host: KVHostPool, device: DeviceKV, pairs: list[tuple[int, int]]
) -> torch.Tensor:
    g = host.geometry
    kv = host.kv_buffer.clone()
    tensors = all_device_tensors(device)
    for host_page, device_page in pairs:
        for layer in range(g.layer_num):
            for plane in range(g.kv_planes):
                for j in range(g.page_size):
                    source = device_row(tensors, g, plane, layer, device_page * g.page_size + j)
                    host_row(kv, g, plane, layer, host_page, j).copy_(source)
    return kv


def expected_load(
    host: KVHostPool, device: DeviceKV, pairs: list[tuple[int, int]]
) -> list[torch.Tensor]:
    g = host.geometry
    tensors = [t.clone() for t in all_device_tensors(device)]
    for host_page, device_page in pairs:
        for layer in range(g.layer_num):
            for plane in range(g.kv_planes):
                for j in range(g.page_size):
                    source = host_row(host.kv_buffer, g, plane, layer, host_page, j)
                    device_row(tensors, g, plane, layer, device_page * g.page_size + j).copy_(
                        source
                    )
    return tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = bits_dtype(a.dtype)
    return a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


def tokens_of(pages: list[int]) -> list[int]:
    return [p * PAGE + j for p in pages for j in range(PAGE)]


def random_pairs(seed: int, n: int = 4) -> list[tuple[int, int]]:
    """``n`` (host page, device page) pairs: distinct, unordered, not contiguous in general."""
    rng = random.Random(seed)
    return list(
        zip(rng.sample(range(HOST_PAGES), n), rng.sample(range(DEVICE_PAGES), n), strict=True)
    )


def pipeline(device: DeviceKV, host: KVHostPool) -> DeviceHostPipeline:
    return DeviceHostPipeline(device, host, DeviceTransferConfig(io_backend=IOBackendChoice.TORCH))


# ---------------------------------------------------------------------- layouts


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_offload_matches_reference(
    attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> None:
    g = make_geometry(attention, layout, dtype)
    device, host = make_device(g, 1), make_host(g, 2)
    pairs = random_pairs(3)
    expected = expected_offload(host, device, pairs)
    before = [t.clone() for t in all_device_tensors(device)]
    with pipeline(device, host) as pipe:
        handle = pipe.offload([h for h, _ in pairs], tokens_of([d for _, d in pairs]))
        result = handle.wait()
    assert result.ok
    assert same_bits(host.kv_buffer, expected)
    # The source is untouched.
    assert all(same_bits(a, b) for a, b in zip(before, all_device_tensors(device), strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_load_matches_reference(attention: Attention, layout: KVLayout, dtype: torch.dtype) -> None:
    g = make_geometry(attention, layout, dtype)
    device, host = make_device(g, 4), make_host(g, 5)
    pairs = random_pairs(6)
    expected = expected_load(host, device, pairs)
    host_before = host.kv_buffer.clone()
    with pipeline(device, host) as pipe:
        load = pipe.load(
            torch.tensor([h for h, _ in pairs]), torch.tensor(tokens_of([d for _, d in pairs]))
        )
        pipe.layer_counter.set_consumer(load)
        for layer in range(LAYERS):
            pipe.layer_counter.wait(layer)
        assert load.wait().ok
    assert all(same_bits(a, b) for a, b in zip(expected, all_device_tensors(device), strict=True))
    assert same_bits(host.kv_buffer, host_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_round_trip(attention: Attention, layout: KVLayout, dtype: torch.dtype) -> None:
    g = make_geometry(attention, layout, dtype)
    source, target, host = make_device(g, 7), make_device(g, 8), make_host(g, 9)
    rng = random.Random(10)
    host_pages = rng.sample(range(HOST_PAGES), 5)
    from_pages = rng.sample(range(DEVICE_PAGES), 5)
    to_pages = rng.sample(range(DEVICE_PAGES), 5)
    # What target should hold: its own bytes, with source's pages copied in.
    expected = [t.clone() for t in all_device_tensors(target)]
    for a, b in zip(from_pages, to_pages, strict=True):
        for src, dst in zip(all_device_tensors(source), expected, strict=True):
            dst[b * PAGE : (b + 1) * PAGE] = src[a * PAGE : (a + 1) * PAGE]
    with pipeline(source, host) as out, pipeline(target, host) as back:
        assert out.offload(host_pages, tokens_of(from_pages)).wait().ok
        assert back.load(host_pages, tokens_of(to_pages)).wait().ok
    assert all(same_bits(a, b) for a, b in zip(expected, all_device_tensors(target), strict=True))


@settings(max_examples=25)
@given(
    combo=st.sampled_from(COMBOS),
    dtype=st.sampled_from([torch.float16, torch.float8_e5m2, torch.uint8]),
    data=st.data(),
)
def test_round_trip_property(
    combo: tuple[Attention, KVLayout], dtype: torch.dtype, data: st.DataObject
) -> None:
    g = make_geometry(*combo, dtype)
    n = data.draw(st.integers(0, HOST_PAGES), label="pages")
    host_pages = data.draw(st.permutations(range(HOST_PAGES)), label="host")[:n]
    device_pages = data.draw(st.permutations(range(DEVICE_PAGES)), label="device")[:n]
    device, host = make_device(g, 11), make_host(g, 12)
    offloaded = expected_offload(host, device, list(zip(host_pages, device_pages, strict=True)))
    original = [t.clone() for t in all_device_tensors(device)]
    with pipeline(device, host) as pipe:
        assert pipe.offload(host_pages, tokens_of(device_pages)).wait().ok
        assert same_bits(host.kv_buffer, offloaded)
        for tensor in all_device_tensors(device):
            tensor.view(torch.uint8).fill_(0)
        assert pipe.load(host_pages, tokens_of(device_pages)).wait().ok
    for before, after in zip(original, all_device_tensors(device), strict=True):
        for page in device_pages:
            rows = slice(page * PAGE, (page + 1) * PAGE)
            assert same_bits(before[rows], after[rows])
    assert host.stats().pinned_bytes == 0


def test_offload_may_read_a_device_page_twice() -> None:
    g = make_geometry()
    device, host = make_device(g, 13), make_host(g, 14)
    pairs = [(0, 2), (5, 2)]
    expected = expected_offload(host, device, pairs)
    with pipeline(device, host) as pipe:
        assert pipe.offload([0, 5], tokens_of([2, 2])).wait().ok
    assert same_bits(host.kv_buffer, expected)


def test_empty_transfers_finish_at_once() -> None:
    g = make_geometry()
    device, host = make_device(g, 15), make_host(g, 16)
    with pipeline(device, host) as pipe:
        offload = pipe.offload([], [])
        load = pipe.load(torch.empty(0, dtype=torch.int64), [])
        pipe.layer_counter.set_consumer(load)
        pipe.layer_counter.wait(LAYERS - 1)
        results = pipe.poll()
    assert [(r.direction, r.state, r.pages, r.nbytes) for r in results] == [
        (CopyDirection.OFFLOAD, DeviceTransferState.DONE, 0, 0),
        (CopyDirection.LOAD, DeviceTransferState.DONE, 0, 0),
    ]
    assert offload.done()
    assert load.done()


# ---------------------------------------------------------------------- handles, metrics


def test_handle_reports_state_bytes_and_latency() -> None:
    g = make_geometry(MHA, KVLayout.PAGE_HEAD, torch.float32)
    device, host = make_device(g, 17), make_host(g, 18)
    with pipeline(device, host) as pipe:
        handle = pipe.offload([3, 1], tokens_of([4, 0]))
        assert handle.direction is CopyDirection.OFFLOAD
        assert handle.pages == 2
        assert handle.nbytes == 2 * g.page_bytes == 2 * 2 * LAYERS * PAGE * HEADS * DIM * 4
        assert handle.host_pages.tolist() == [3, 1]
        assert handle.done()
        assert handle.state is DeviceTransferState.DONE
        result = handle.wait()
        assert result == handle.wait()  # the same value every time
        assert result.transfer_id == handle.transfer_id
        assert (result.pages, result.nbytes, result.error) == (2, handle.nbytes, None)
        assert result.latency_s >= 0.0
        assert "offload" in repr(handle)


def test_each_result_is_returned_once() -> None:
    g = make_geometry()
    device, host = make_device(g, 19), make_host(g, 20)
    with pipeline(device, host) as pipe:
        first = pipe.offload([0], tokens_of([0]))
        second = pipe.load([1], tokens_of([1]))
        third = pipe.offload([2], tokens_of([2]))
        waited = second.wait()  # observes: poll still returns it, once
        polled = pipe.poll()
        assert [r.transfer_id for r in polled] == [
            first.transfer_id,
            second.transfer_id,
            third.transfer_id,
        ]
        assert polled[1] == waited
        assert pipe.poll() == []
        fourth = pipe.load([3], tokens_of([3]))
        assert [r.transfer_id for r in pipe.drain()] == [fourth.transfer_id]
        assert pipe.drain() == []
        assert pipe.in_flight == 0
        fifth = pipe.offload([4], tokens_of([4]))
        assert [r.transfer_id for r in pipe.close()] == [fifth.transfer_id]
        assert pipe.close() == []


def test_metrics_per_direction() -> None:
    g = make_geometry(MLA, KVLayout.PAGE_FIRST, torch.bfloat16)
    device, host = make_device(g, 21), make_host(g, 22)
    with pipeline(device, host) as pipe:
        assert pipe.metrics().offload == CopyMetrics()
        pipe.offload([0, 1, 2], tokens_of([5, 6, 7]))
        pipe.offload([3], tokens_of([1]))
        pipe.load([0, 1], tokens_of([2, 3]))
        results = pipe.poll()
        metrics = pipe.metrics()
    offload, load = metrics.offload, metrics.load
    assert metrics.of(CopyDirection.OFFLOAD) is offload
    assert metrics.of(CopyDirection.LOAD) is load
    assert (offload.transfers, offload.failed, offload.pages, offload.nbytes) == (
        2,
        0,
        4,
        4 * g.page_bytes,
    )
    assert (load.transfers, load.failed, load.pages, load.nbytes) == (1, 0, 2, 2 * g.page_bytes)
    assert offload.latency_s == pytest.approx(sum(r.latency_s for r in results[:2]))
    assert offload.max_latency_s == max(r.latency_s for r in results[:2])
    assert offload.mean_latency_s == pytest.approx(offload.latency_s / 2)
    assert metrics.in_flight == 0
    if offload.latency_s > 0:
        assert offload.bytes_per_s == pytest.approx(offload.nbytes / offload.latency_s)
    assert CopyMetrics().mean_latency_s == 0.0
    assert CopyMetrics().bytes_per_s == 0.0


# ---------------------------------------------------------------------- layer counter


def test_layer_counter_waits_on_the_consumer_only() -> None:
    g = make_geometry(MHA, KVLayout.LAYER_FIRST)
    device, host = make_device(g, 23), make_host(g, 24)
    with pipeline(device, host) as pipe:
        counter = pipe.layer_counter
        assert counter.layer_num == LAYERS
        counter.wait(0)  # no consumer: returns at once
        with pytest.raises(ConfigError, match="out of range"):
            counter.wait(LAYERS)
        first = pipe.load([0], tokens_of([0]))
        second = pipe.load([1], tokens_of([1]))
        assert isinstance(first, DeviceLoadHandle)
        counter.set_consumer(first)
        assert list(counter.consumer) == [first]
        counter.set_consumer([first, second])
        assert list(counter.consumer) == [first, second]
        for layer in range(LAYERS):
            counter.wait(layer)
            second.wait_layer(layer)
        with pytest.raises(ConfigError, match="out of range"):
            counter.wait(LAYERS)
        with pytest.raises(ConfigError):
            first.wait_layer(-1)
        counter.reset()
        assert counter.consumer == ()
        counter.set_consumer(None)
        counter.wait(LAYERS - 1)


def test_layer_counter_refuses_loads_of_another_pipeline() -> None:
    g = make_geometry()
    host = make_host(g, 25)
    with pipeline(make_device(g, 26), host) as one, pipeline(make_device(g, 27), host) as two:
        load = one.load([0], tokens_of([0]))
        with pytest.raises(ConfigError, match="this counter's pipeline"):
            two.layer_counter.set_consumer(load)
        with pytest.raises(ConfigError, match="this counter's pipeline"):
            one.layer_counter.set_consumer(["not a load"])  # type: ignore[list-item]


# ---------------------------------------------------------------------- failures, pins


class FlakyBackend(IOBackend):
    """Wraps the torch backend; fails (RuntimeError, as torch does) where told, and checks
    that the host pages are pinned while the copies run."""

    def __init__(
        self,
        inner: IOBackend,
        host: KVHostPool,
        *,
        fail_layer: int | None = None,
        fail_offload: bool = False,
        error: type[BaseException] = RuntimeError,
    ) -> None:
        self.inner, self.host = inner, host
        self.fail_layer, self.fail_offload, self.error = fail_layer, fail_offload, error
        self.pinned_during: list[list[int]] = []

    @property
    def name(self) -> str:
        return "flaky"

    def plan(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> CopyPlan:
        self.pinned_during.append(self.host.slots.pin_counts(host_pages).tolist())
        return FlakyPlan(self, self.inner.plan(host_pages, device_pages))


class FlakyPlan(CopyPlan):
    def __init__(self, backend: FlakyBackend, inner: CopyPlan) -> None:
        self.backend, self.inner = backend, inner

    def load_layer(self, layer: int) -> None:
        if layer == self.backend.fail_layer:
            raise self.backend.error(f"injected failure at layer {layer}")
        self.inner.load_layer(layer)

    def offload(self) -> None:
        if self.backend.fail_offload:
            raise self.backend.error("injected offload failure")
        self.inner.offload()


def flaky_pipeline(
    device: DeviceKV, host: KVHostPool, **kwargs: object
) -> tuple[DeviceHostPipeline, FlakyBackend]:
    backend = FlakyBackend(TorchIOBackend(device, host), host, **kwargs)  # type: ignore[arg-type]
    return DeviceHostPipeline(device, host, io_backend=backend), backend


def test_pages_are_pinned_during_the_copy_and_released_after() -> None:
    g = make_geometry()
    device, host = make_device(g, 28), make_host(g, 29)
    pipe, backend = flaky_pipeline(device, host)
    with pipe:
        assert pipe.io_backend == "flaky"
        pipe.offload([4, 2], tokens_of([1, 3]))
        pipe.load([6], tokens_of([0]))
        assert backend.pinned_during == [[1, 1], [1]]
        assert host.stats().pinned_bytes == 3 * g.page_bytes  # finished, not yet collected
        assert len(pipe.poll()) == 2
        assert host.stats().pinned_bytes == 0
        host.free([4, 2, 6])  # nothing holds them any more


def test_failed_offload_is_a_failed_result_and_unpins() -> None:
    g = make_geometry()
    device, host = make_device(g, 30), make_host(g, 31)
    pipe, _ = flaky_pipeline(device, host, fail_offload=True)
    with pipe:
        handle = pipe.offload([1, 2], tokens_of([0, 5]))
        result = handle.wait()
        assert handle.state is DeviceTransferState.FAILED
        assert not result.ok
        assert result.state is DeviceTransferState.FAILED
        assert isinstance(result.error, StorageError)
        assert isinstance(result.error.__cause__, RuntimeError)
        assert "offload of 2 pages" in str(result.error)
        assert "injected" in str(result.error)
        assert handle.error is result.error
        assert pipe.poll() == [result]
        assert host.stats().pinned_bytes == 0
        metrics = pipe.metrics().offload
        assert (metrics.transfers, metrics.failed, metrics.pages, metrics.nbytes) == (1, 1, 0, 0)
        assert pipe.offload([1], tokens_of([0])).wait().state is DeviceTransferState.FAILED


def test_failed_load_refuses_layer_waits() -> None:
    g = make_geometry(MHA, KVLayout.PAGE_FIRST_DIRECT)
    device, host = make_device(g, 32), make_host(g, 33)
    expected_first_layer = expected_load(host, device, [(3, 4)])
    pipe, _ = flaky_pipeline(device, host, fail_layer=1)
    with pipe:
        load = pipe.load([3], tokens_of([4]))
        assert load.wait().state is DeviceTransferState.FAILED
        pipe.layer_counter.set_consumer(load)
        with pytest.raises(StateError, match="failed"):
            pipe.layer_counter.wait(0)
        assert [r.state for r in pipe.poll()] == [DeviceTransferState.FAILED]
        assert host.stats().pinned_bytes == 0
        assert pipe.metrics().load.failed == 1
    # Layer 0 landed before the failure (K is tensor 0, V is tensor LAYERS).
    for index in (0, LAYERS):
        assert same_bits(all_device_tensors(device)[index], expected_first_layer[index])


def test_unexpected_exception_propagates_and_unpins() -> None:
    g = make_geometry()
    device, host = make_device(g, 34), make_host(g, 35)
    pipe, _ = flaky_pipeline(device, host, fail_offload=True, error=KeyError)
    with pipe:
        with pytest.raises(KeyError):
            pipe.offload([1], tokens_of([0]))
        assert host.stats().pinned_bytes == 0
        assert pipe.in_flight == 0
        assert pipe.poll() == []


def test_free_host_page_is_refused_and_nothing_is_pinned() -> None:
    g = make_geometry()
    device = make_device(g, 36)
    host = KVHostPool(g, make_memory())
    allocated = host.alloc(2).tolist()
    free = next(p for p in range(HOST_PAGES) if p not in allocated)
    with pipeline(device, host) as pipe:
        with pytest.raises(StateError, match="free"):
            pipe.offload([allocated[0], free], tokens_of([0, 1]))
        assert host.stats().pinned_bytes == 0
        assert pipe.metrics().offload.transfers == 0


def test_closed_pipeline_refuses_work() -> None:
    g = make_geometry()
    device, host = make_device(g, 37), make_host(g, 38)
    pipe = pipeline(device, host)
    pipe.offload([0], tokens_of([0]))
    assert len(pipe.close()) == 1
    assert pipe.close() == []  # twice is fine
    with pytest.raises(StateError, match="closed"):
        pipe.load([0], tokens_of([0]))
    assert pipe.metrics().offload.transfers == 1


# ---------------------------------------------------------------------- bad input


@pytest.fixture
def device_pipe() -> Iterator[DeviceHostPipeline]:
    g = make_geometry()
    with pipeline(make_device(g, 39), make_host(g, 40)) as pipe:
        yield pipe


@pytest.mark.parametrize(
    ("host_pages", "device_tokens", "match"),
    [
        ([HOST_PAGES], tokens_of([0]), "host_pages.*out of range"),
        ([-1], tokens_of([0]), "host_pages.*out of range"),
        ([0], tokens_of([DEVICE_PAGES]), "outside the device pool"),
        ([0], list(range(PAGE - 1)), "multiple of page_size"),
        ([0], list(range(1, PAGE + 1)), "whole pages"),
        ([0], [0, 1, 3, 2], "whole pages"),
        ([0, 1], tokens_of([0]), "one device page per host page"),
        ([1, 1], tokens_of([0, 1]), "host_pages.*repeated"),
        (torch.tensor([0.0]), tokens_of([0]), "integer tensor"),
        (torch.tensor([[0]]), tokens_of([0]), "1-D"),
        ([0], torch.tensor(tokens_of([0]), dtype=torch.float32), "integer tensor"),
        ([True], tokens_of([0]), "sequence of ints"),
    ],
)
def test_bad_indices_are_config_errors(
    device_pipe: DeviceHostPipeline, host_pages: object, device_tokens: object, match: str
) -> None:
    for submit in (device_pipe.offload, device_pipe.load):
        with pytest.raises(ConfigError, match=match):
            submit(host_pages, device_tokens)  # type: ignore[arg-type]
    assert device_pipe.metrics().in_flight == 0


def test_load_refuses_repeated_device_pages(device_pipe: DeviceHostPipeline) -> None:
    with pytest.raises(ConfigError, match=r"device_tokens.*repeated"):
        device_pipe.load([0, 1], tokens_of([3, 3]))


def test_error_names_the_field_and_the_rule(device_pipe: DeviceHostPipeline) -> None:
    with pytest.raises(ConfigError) as caught:
        device_pipe.offload([0], tokens_of([DEVICE_PAGES + 2]))
    assert caught.value.field == "device_tokens"
    assert caught.value.owner == "DeviceHostPipeline.offload"
    assert caught.value.allowed == f"tokens 0 .. {DEVICE_PAGES * PAGE - 1}"


# ---------------------------------------------------------------------- backends, config


def test_kernel_on_cpu_is_unavailable_with_the_reasons() -> None:
    g = make_geometry()
    device, host = make_device(g, 41), make_host(g, 42)
    with pytest.raises(BackendUnavailableError) as caught:
        DeviceHostPipeline(device, host, DeviceTransferConfig(io_backend="kernel"))
    reason = caught.value.reason
    assert caught.value.backend == "kernel"
    assert "not a CUDA device" in reason
    assert "not page-locked" in reason
    if not torch.cuda.is_available():
        assert "CUDA is not available" in reason
    if importlib.util.find_spec("sgl_kernel") is None:
        assert "sgl_kernel.kvcacheio" in reason


def test_auto_picks_torch_on_cpu_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    g = make_geometry()
    device, host = make_device(g, 43), make_host(g, 44)
    with caplog.at_level(logging.INFO, logger="sglang_storage.transfer"):
        pipe = DeviceHostPipeline(device, host)
    assert pipe.config.io_backend is IOBackendChoice.AUTO
    assert pipe.io_backend == "torch"
    assert "on CPU" in pipe.io_detail
    assert any(
        "'auto' chose torch" in r.getMessage() and "kernel unavailable" in r.getMessage()
        for r in caplog.records
    )
    backend = open_io_backend(IOBackendChoice.TORCH, device, host)
    assert isinstance(backend, TorchIOBackend)
    assert backend.mode == "cpu"


def test_config_validation() -> None:
    assert DeviceTransferConfig().io_backend is IOBackendChoice.AUTO
    assert DeviceTransferConfig(io_backend="torch").io_backend is IOBackendChoice.TORCH
    assert (
        build_config(DeviceTransferConfig, {"io_backend": "kernel"}).io_backend
        is IOBackendChoice.KERNEL
    )
    with pytest.raises(ConfigError, match="allowed: auto, torch, kernel"):
        DeviceTransferConfig(io_backend="direct")
    with pytest.raises(ConfigError):
        DeviceHostPipeline(
            make_device(make_geometry(), 45),
            make_host(make_geometry(), 46),
            config="torch",  # type: ignore[arg-type]
        )


def test_results_are_frozen_values() -> None:
    result = DeviceTransferResult(
        transfer_id=1,
        direction=CopyDirection.LOAD,
        state=DeviceTransferState.DONE,
        pages=1,
        nbytes=8,
        latency_s=0.5,
    )
    assert result.ok
    with pytest.raises(AttributeError):
        result.pages = 2  # type: ignore[misc]
    added = CopyMetrics().add(result)
    assert (added.transfers, added.pages, added.nbytes, added.latency_s) == (1, 1, 8, 0.5)
