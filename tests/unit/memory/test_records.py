from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_storage.core import DataKind
from sglang_storage.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    StateError,
)
from sglang_storage.memory import (
    BlobPool,
    BlobPoolConfig,
    HostMemory,
    Pinning,
    PoolStats,
    RecordPool,
    RecordPoolConfig,
    cuda_available,
)

MemoryFactory = Callable[[int], HostMemory]
no_cuda = pytest.mark.skipif(cuda_available(), reason="checks behaviour where CUDA is absent")
BLOCK = 4096


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values of any dtype, made from random bytes."""
    numel = 1
    for dim in shape:
        numel *= dim
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    data = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return data.view(dtype).view(shape)


def record_config(
    shape: tuple[int, ...] = (4, 2),
    dtype: torch.dtype = torch.int32,
    capacity: int = 16,
    **extra: Any,
) -> RecordPoolConfig:
    return RecordPoolConfig(shape=shape, dtype=dtype, capacity=capacity, **extra)


# ================================================================ RecordPool


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((4, 2), torch.int32),
        ((8,), torch.int64),
        ((3,), torch.float32),
        ((2, 2, 2), torch.bfloat16),
        ((5,), torch.bool),
        ((1,), torch.float64),
        ((6,), torch.float8_e4m3fn),
    ],
    ids=lambda v: str(v),
)
def test_record_round_trip(memory: HostMemory, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    pool = RecordPool(record_config(shape, dtype), memory)
    slots = pool.alloc(5)
    data = random_tensor((5, *shape), dtype, seed=1)
    pool.write(slots, data)
    got = pool.read(slots)
    assert got.dtype == dtype
    assert tuple(got.shape) == (5, *shape)
    assert raw_bytes(got) == raw_bytes(data)
    # Another order of the same slots reads the records in that order.
    order = [3, 0, 4]
    assert raw_bytes(pool.read(slots[order])) == raw_bytes(data[order])
    assert raw_bytes(pool.records[slots]) == raw_bytes(data)


def test_records_property_is_the_pool_memory(memory: HostMemory) -> None:
    pool = RecordPool(record_config(), memory)
    assert tuple(pool.records.shape) == (16, 4, 2)
    assert pool.records.dtype == torch.int32
    slots = pool.alloc(2)
    pool.records[slots[1]] = 77
    assert torch.equal(pool.read(slots[1:]), torch.full((1, 4, 2), 77, dtype=torch.int32))
    assert pool.config.capacity == 16


def test_write_to_a_free_slot_is_refused_and_writes_nothing(memory: HostMemory) -> None:
    pool = RecordPool(record_config(), memory)
    slots = pool.alloc(2)
    pool.write(slots, torch.zeros(2, 4, 2, dtype=torch.int32))
    before = pool.records.clone()
    with pytest.raises(StateError):
        pool.write([int(slots[0]), 5], torch.ones(2, 4, 2, dtype=torch.int32))
    assert torch.equal(pool.records, before)
    with pytest.raises(StateError):
        pool.read([5])
    pool.free(slots[:1])
    with pytest.raises(StateError):
        pool.write(slots[:1], torch.ones(1, 4, 2, dtype=torch.int32))
    assert torch.equal(pool.records, before)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(torch.zeros(2, 4, 2, dtype=torch.int64), id="dtype"),
        pytest.param(torch.zeros(2, 2, 4, dtype=torch.int32), id="shape"),
        pytest.param(torch.zeros(3, 4, 2, dtype=torch.int32), id="count"),
        pytest.param(torch.zeros(16, dtype=torch.int32), id="flat"),
    ],
)
def test_write_with_wrong_shape_or_dtype_is_refused(memory: HostMemory, data: torch.Tensor) -> None:
    pool = RecordPool(record_config(), memory)
    slots = pool.alloc(2)
    with pytest.raises(ConfigError):
        pool.write(slots, data)


def test_out_of_range_slots_are_refused(memory: HostMemory) -> None:
    pool = RecordPool(record_config(), memory)
    pool.alloc(16)
    with pytest.raises(ConfigError):
        pool.write([16], torch.zeros(1, 4, 2, dtype=torch.int32))
    with pytest.raises(ConfigError):
        pool.read([-1])


def test_record_pins_and_stats(memory: HostMemory) -> None:
    pool = RecordPool(record_config(label="top-k"), memory)
    size = 4 * 2 * 4
    slots = pool.alloc(3)
    pool.pin(slots[:2])
    assert pool.stats() == PoolStats(
        kind=DataKind.RECORD,
        label="top-k",
        capacity_bytes=16 * size,
        used_bytes=3 * size,
        free_bytes=13 * size,
        pinned_bytes=2 * size,
        page_locked=memory.page_locked,
    )
    with pytest.raises(StateError):
        pool.free(slots)
    with pytest.raises(StateError):
        pool.close()
    pool.unpin(slots[:2])
    with pool.pinned(slots[2:]):
        assert pool.stats().pinned_bytes == size
    pool.free(slots)
    assert pool.stats().used_bytes == 0


def test_record_pool_budget_and_close(memory: HostMemory) -> None:
    pool = RecordPool(record_config(kind=DataKind.KV), memory)
    assert memory.budget.stats().kinds[DataKind.KV].used == 16 * 4 * 2 * 4
    assert pool.stats().kind is DataKind.KV
    pool.close()
    assert memory.budget.stats().used == 0
    pool.close()
    with pytest.raises(StateError):
        pool.alloc(1)
    with pytest.raises(StateError):
        _ = pool.records
    with pytest.raises(StateError):
        pool.read([])


def test_record_config_validation() -> None:
    assert record_config().record_numel == 8
    assert record_config().record_bytes == 32
    assert record_config().kind is DataKind.RECORD
    for bad in (
        {"shape": (0, 2)},
        {"shape": [4, 2]},
        {"shape": (4, -1)},
        {"dtype": "int32"},
        {"capacity": 0},
        {"label": ""},
        {"kind": "record"},
    ):
        values: dict[str, Any] = {"shape": (4, 2), "dtype": torch.int32, "capacity": 4, **bad}
        with pytest.raises(ConfigError):
            RecordPoolConfig(**values)


@no_cuda
def test_device_view_without_cuda_is_backend_unavailable(memory: HostMemory) -> None:
    pool = RecordPool(record_config(), memory)
    with pytest.raises(BackendUnavailableError):
        pool.device_view()


@pytest.mark.gpu
def test_device_view_reads_host_records_in_place(make_memory: MemoryFactory) -> None:
    memory = HostMemory(make_memory(1 << 20).budget, pinning=Pinning.ALWAYS)
    pool = RecordPool(record_config(dtype=torch.float32), memory)
    slots = pool.alloc(4)
    data = torch.randn(4, 4, 2)
    pool.write(slots, data)
    view = pool.device_view()
    assert view.device.type == "cuda"
    assert tuple(view.shape) == (16, 4, 2)
    assert torch.equal(view[slots.cuda()].cpu(), data)
    # Zero copy: a later host write shows through the same view.
    pool.write(slots[:1], torch.full((1, 4, 2), 5.0))
    torch.cuda.synchronize()
    assert torch.equal(view[int(slots[0])].cpu(), torch.full((4, 2), 5.0))


@pytest.mark.gpu
def test_device_view_needs_page_locked_memory(make_memory: MemoryFactory) -> None:
    memory = HostMemory(make_memory(1 << 20).budget, pinning=Pinning.NEVER)
    pool = RecordPool(record_config(), memory)
    with pytest.raises(ConfigError):
        pool.device_view()


@pytest.mark.gpu
def test_device_view_needs_an_interface_dtype(make_memory: MemoryFactory) -> None:
    memory = HostMemory(make_memory(1 << 20).budget, pinning=Pinning.ALWAYS)
    pool = RecordPool(record_config(dtype=torch.bfloat16), memory)
    with pytest.raises(ConfigError):
        pool.device_view()


# ================================================================ BlobPool


@pytest.fixture
def blobs(memory: HostMemory) -> BlobPool:
    return BlobPool(BlobPoolConfig(capacity=16 * BLOCK), memory)


BLOB_CASES = [
    pytest.param(random_tensor((3, 5), torch.float32), id="float32-2d"),
    pytest.param(random_tensor((7,), torch.int64), id="int64"),
    pytest.param(random_tensor((2, 3, 4), torch.bfloat16), id="bfloat16-3d"),
    pytest.param(random_tensor((9,), torch.bool), id="bool"),
    pytest.param(torch.tensor(3.5, dtype=torch.float64), id="scalar"),
    pytest.param(random_tensor((4,), torch.complex64), id="complex64"),
    pytest.param(random_tensor((10,), torch.float8_e5m2), id="float8"),
    pytest.param(random_tensor((5, 3), torch.float32).t(), id="non-contiguous"),
    pytest.param(random_tensor((3 * BLOCK + 5,), torch.uint8), id="multi-block"),
]


@pytest.mark.parametrize("data", BLOB_CASES)
def test_blob_round_trip_is_zero_copy(blobs: BlobPool, data: torch.Tensor) -> None:
    blob = blobs.put("w", data)
    nbytes = data.numel() * data.element_size()
    assert blob.key == "w"
    assert blob.nbytes == nbytes
    assert blob.run.length == -(-nbytes // BLOCK)
    flat = blobs.view("w")
    assert flat is not None
    assert flat.dtype == torch.uint8
    assert flat.numel() == nbytes
    assert flat.numpy().tobytes() == raw_bytes(data)
    typed = blobs.view("w", data.dtype, tuple(data.shape))
    assert typed is not None
    assert typed.dtype == data.dtype
    assert typed.shape == data.shape
    assert raw_bytes(typed) == raw_bytes(data)
    buffer = storage_range(flat)
    assert flat.data_ptr() % BLOCK == 0
    assert buffer[0] <= flat.data_ptr()
    assert flat.data_ptr() + nbytes <= buffer[1]
    assert typed.data_ptr() == flat.data_ptr()


def storage_range(view: torch.Tensor) -> tuple[int, int]:
    """The memory range of the storage under ``view`` (BlobPool does not expose its buffer)."""
    storage = view.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def test_blobs_do_not_overlap_and_are_block_aligned(blobs: BlobPool) -> None:
    sizes = [1, BLOCK, BLOCK + 1, 100, 2 * BLOCK]
    views = []
    for i, size in enumerate(sizes):
        blobs.put(f"b{i}", random_tensor((size,), torch.uint8, seed=i))
        view = blobs.view(f"b{i}")
        assert view is not None
        views.append(view)
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel()) for v in views)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
        assert start % BLOCK == 0
    for i, size in enumerate(sizes):
        assert raw_bytes(views[i]) == raw_bytes(random_tensor((size,), torch.uint8, seed=i))


def test_blob_remove_and_pins(blobs: BlobPool) -> None:
    blobs.put("w", random_tensor((BLOCK,), torch.uint8))
    assert "w" in blobs
    assert len(blobs) == 1
    blobs.pin("w")
    blobs.pin("w")
    assert blobs.stats().pinned_bytes == BLOCK
    with pytest.raises(StateError):
        blobs.remove("w")
    blobs.unpin("w")
    with pytest.raises(StateError):
        blobs.remove("w")
    blobs.unpin("w")
    with pytest.raises(StateError):
        blobs.unpin("w")
    blobs.remove("w")
    assert "w" not in blobs
    assert blobs.view("w") is None
    assert blobs.stats().used_bytes == 0


def test_blob_unknown_and_existing_keys(blobs: BlobPool) -> None:
    assert blobs.view("nope") is None
    for call in (blobs.remove, blobs.pin, blobs.unpin):
        with pytest.raises(StateError):
            call("nope")
    first = random_tensor((10,), torch.uint8, seed=1)
    blobs.put("w", first)
    with pytest.raises(StateError):
        blobs.put("w", random_tensor((10,), torch.uint8, seed=2))
    view = blobs.view("w")
    assert view is not None
    assert raw_bytes(view) == raw_bytes(first)
    assert blobs.stats().used_bytes == BLOCK


def test_blob_fragmentation_is_a_capacity_error_naming_contiguous(blobs: BlobPool) -> None:
    for i in range(16):
        blobs.put(f"b{i}", random_tensor((BLOCK,), torch.uint8, seed=i))
    for i in range(0, 16, 2):
        blobs.remove(f"b{i}")
    assert blobs.stats().free_bytes == 8 * BLOCK
    with pytest.raises(CapacityError) as caught:
        blobs.put("big", random_tensor((BLOCK + 1,), torch.uint8))
    assert "contiguous" in str(caught.value)
    assert caught.value.requested == 2
    assert caught.value.available == 1
    assert "big" not in blobs
    assert blobs.stats().free_bytes == 8 * BLOCK
    blobs.put("small", random_tensor((BLOCK,), torch.uint8))


def test_blob_larger_than_the_pool_is_capacity_error(blobs: BlobPool) -> None:
    with pytest.raises(CapacityError):
        blobs.put("huge", torch.zeros(16 * BLOCK + 1, dtype=torch.uint8))
    assert len(blobs) == 0


def test_empty_blob_is_refused(blobs: BlobPool) -> None:
    with pytest.raises(ConfigError):
        blobs.put("empty", torch.zeros(0))
    assert len(blobs) == 0


def test_blob_stats(blobs: BlobPool, memory: HostMemory) -> None:
    blobs.put("a", torch.zeros(100, dtype=torch.uint8))
    blobs.put("b", torch.zeros(BLOCK + 1, dtype=torch.uint8))
    blobs.pin("b")
    assert blobs.stats() == PoolStats(
        kind=DataKind.WEIGHT,
        label="blob pool",
        capacity_bytes=16 * BLOCK,
        used_bytes=3 * BLOCK,
        free_bytes=13 * BLOCK,
        pinned_bytes=2 * BLOCK,
        page_locked=memory.page_locked,
    )


def test_blob_config_rounds_down_and_validates(memory: HostMemory) -> None:
    pool = BlobPool(BlobPoolConfig(capacity=3 * BLOCK - 1, kind=DataKind.RECORD), memory)
    assert memory.budget.stats().kinds[DataKind.RECORD].used == 2 * BLOCK
    assert pool.stats().capacity_bytes == 2 * BLOCK
    assert pool.config.kind is DataKind.RECORD
    for bad in ({"capacity": BLOCK - 1}, {"capacity": 0}, {"label": ""}, {"kind": "weight"}):
        values: dict[str, Any] = {"capacity": BLOCK, **bad}
        with pytest.raises(ConfigError):
            BlobPoolConfig(**values)


def test_blob_pool_close(blobs: BlobPool, memory: HostMemory) -> None:
    blobs.put("w", torch.ones(10))
    blobs.pin("w")
    with pytest.raises(StateError):
        blobs.close()
    blobs.unpin("w")
    blobs.close()
    assert memory.budget.stats().used == 0
    blobs.close()
    with pytest.raises(StateError):
        blobs.view("w")
    with pytest.raises(StateError):
        blobs.put("x", torch.ones(10))


@pytest.mark.parametrize("dtype", [torch.complex128, torch.uint16, torch.float8_e8m0fnu])
def test_record_dtype_outside_the_element_types_is_config_error(dtype: torch.dtype) -> None:
    # A 16-byte element has no same-sized integer to move its bits; others are not listed.
    with pytest.raises(ConfigError, match="element type"):
        RecordPoolConfig(shape=(2,), dtype=dtype, capacity=4)
