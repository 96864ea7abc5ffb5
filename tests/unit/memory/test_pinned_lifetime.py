"""The life of a page-locked buffer's CUDA registration, checked against a fake runtime.

No CUDA runs on the CI machines, so :class:`FakeCudaRuntime` stands in for the runtime's
host-registration calls. It keeps the registered ranges the way the real runtime does:
registering a range that overlaps a live one fails with 712, unregistering an address that
starts no registration fails with 713, and each failure stays latched as the "last error"
until ``cudaGetLastError`` reads it (which is what made torch raise it later, elsewhere).
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from sglang_storage.core import DataKind
from sglang_storage.errors import BackendIOError, BackendUnavailableError, ConfigError, StateError
from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    CudaRuntime,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    MemoryFacts,
    PinnedAllocator,
    RecordPool,
    RecordPoolConfig,
)
from sglang_storage.memory.records import _cuda_device

SUCCESS = 0
MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered

FACTS = MemoryFacts(physical=64 << 30, available=64 << 30)


class FakeCudaRuntime:
    """A fake of the CUDA runtime's host-registration calls (no CUDA runs on these machines).

    Models what the real runtime tracks: the live registrations (start -> size), the
    thread's latched last error, and every call made, so tests can count them.
    """

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.last_error = SUCCESS
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.failures: list[int] = []
        self.refuse_registers_with: int | None = None
        """When set, every register fails with this code (as an exhausted driver would)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        if self.refuse_registers_with is not None:
            return self._fail(self.refuse_registers_with)
        if any(ptr < start + length and start < ptr + size for start, length in self.live.items()):
            return self._fail(ALREADY_REGISTERED)
        self.live[ptr] = size
        self.registered.append(ptr)
        return SUCCESS

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        if self.live.pop(ptr, None) is None:
            return self._fail(NOT_REGISTERED)
        self.unregistered.append(ptr)
        return SUCCESS

    def cudaGetLastError(self) -> int:  # noqa: N802
        error, self.last_error = self.last_error, SUCCESS
        return error

    def _fail(self, code: int) -> int:
        self.failures.append(code)
        self.last_error = code
        return code


def fake_memory(fake: FakeCudaRuntime, total: int = 64 << 20) -> HostMemory:
    """A HostMemory whose page-locked allocator calls ``fake``."""
    budget = HostMemoryBudget(BudgetConfig(total=total, headroom=0), facts=FACTS)
    return HostMemory(budget, allocator=PinnedAllocator(fake))


GEOMETRY = KVGeometry(
    attention=Attention.MHA,
    layout=KVLayout.LAYER_FIRST,
    dtype=torch.bfloat16,
    layer_num=2,
    page_size=16,
    num_pages=32,
    head_num=4,
    head_dim=64,
)  # 1 MiB: large enough for malloc to hand the same pages back after a free


def test_fake_is_a_cuda_runtime() -> None:
    runtime: CudaRuntime = FakeCudaRuntime()
    assert int(runtime.cudaGetLastError()) == SUCCESS


def test_fake_models_overlap_and_unknown_addresses() -> None:
    fake = FakeCudaRuntime()
    assert fake.cudaHostRegister(4096, 8192, 3) == SUCCESS
    assert fake.cudaHostRegister(8192, 4096, 3) == ALREADY_REGISTERED
    assert fake.cudaGetLastError() == ALREADY_REGISTERED
    assert fake.cudaGetLastError() == SUCCESS
    assert fake.cudaHostUnregister(8192) == NOT_REGISTERED
    assert fake.cudaHostUnregister(4096) == SUCCESS
    assert fake.cudaHostRegister(8192, 4096, 3) == SUCCESS


def test_allocate_release_pairs_unregister_exactly_once() -> None:
    fake = FakeCudaRuntime()
    allocator = PinnedAllocator(fake)
    assert allocator.page_locked is True
    buffers = [allocator.allocate(5000 + i, label=f"b{i}") for i in range(4)]
    assert all(b.page_locked for b in buffers)
    assert sorted(fake.live) == sorted(b.address for b in buffers)
    assert all(fake.live[b.address] == b.nbytes for b in buffers)
    addresses = [b.address for b in buffers]
    for buffer in buffers:
        allocator.release(buffer)
    assert fake.live == {}
    assert sorted(fake.unregistered) == sorted(addresses)
    del buffers, buffer
    gc.collect()  # the finalizers were spent by release: nothing is unregistered twice
    assert sorted(fake.unregistered) == sorted(addresses)
    assert fake.failures == []


def test_buffer_collected_without_release_is_unregistered() -> None:
    fake = FakeCudaRuntime()
    allocator = PinnedAllocator(fake)
    buffer = allocator.allocate(1 << 20, label="dropped")
    address = buffer.address
    assert address in fake.live
    del buffer
    gc.collect()
    assert fake.live == {}
    assert fake.unregistered == [address]
    assert fake.failures == []


def test_pool_dropped_without_close_unregisters_its_memory() -> None:
    fake = FakeCudaRuntime()
    pool = KVHostPool(GEOMETRY, fake_memory(fake))
    pool.kv_buffer.fill_(1)
    assert list(fake.live.values()) == [GEOMETRY.total_bytes]
    del pool  # and with it its HostMemory: nobody calls close()
    gc.collect()
    assert fake.live == {}
    assert len(fake.unregistered) == 1
    assert fake.failures == []


def test_rounds_of_dropped_pools_never_find_memory_still_registered() -> None:
    fake = FakeCudaRuntime()
    rounds = 50
    for _ in range(rounds):
        pool = KVHostPool(GEOMETRY, fake_memory(fake))
        pool.kv_buffer[:1].fill_(1)
        del pool
        gc.collect()
    assert fake.failures == []
    assert fake.last_error == SUCCESS
    assert fake.live == {}
    assert len(fake.registered) == len(fake.unregistered) == rounds
    # The test means something only if malloc handed the same memory back.
    assert len(set(fake.registered)) < rounds


def test_release_twice_is_a_state_error_and_unregisters_once() -> None:
    fake = FakeCudaRuntime()
    memory = fake_memory(fake)
    buffer = memory.allocate(DataKind.KV, 1 << 16, label="twice")
    memory.release(buffer)
    with pytest.raises(StateError):
        memory.release(buffer)
    assert fake.unregistered == [buffer.address]
    assert memory.budget.stats().used == 0

    allocator = PinnedAllocator(fake)
    direct = allocator.allocate(4096, label="direct")
    allocator.release(direct)
    with pytest.raises(StateError):
        allocator.release(direct)
    assert fake.unregistered.count(direct.address) == 1


def test_release_of_a_foreign_buffer_is_a_state_error() -> None:
    fake = FakeCudaRuntime()
    other = PinnedAllocator(fake).allocate(4096, label="other")
    with pytest.raises(StateError):
        PinnedAllocator(fake).release(other)
    assert other.address in fake.live


def test_failed_register_raises_and_clears_the_latched_error() -> None:
    fake = FakeCudaRuntime()
    memory = fake_memory(fake)
    fake.refuse_registers_with = MEMORY_ALLOCATION
    with pytest.raises(BackendUnavailableError) as caught:
        memory.allocate(DataKind.KV, 1 << 16, label="refused")
    assert str(MEMORY_ALLOCATION) in caught.value.reason
    assert fake.failures == [MEMORY_ALLOCATION]
    assert fake.last_error == SUCCESS
    assert memory.budget.stats().used == 0


def test_overlapping_register_is_refused_and_cleared() -> None:
    fake = FakeCudaRuntime()
    allocator = PinnedAllocator(fake)
    buffer = allocator.allocate(1 << 16, label="live")
    # Someone else registered memory the next allocation will get (here: everything).
    fake.live[0] = 1 << 62
    with pytest.raises(BackendUnavailableError) as caught:
        allocator.allocate(1 << 16, label="overlapping")
    assert str(ALREADY_REGISTERED) in caught.value.reason
    assert fake.last_error == SUCCESS
    del fake.live[0]
    allocator.release(buffer)


def test_failed_unregister_on_release_is_a_backend_io_error() -> None:
    fake = FakeCudaRuntime()
    memory = fake_memory(fake)
    buffer = memory.allocate(DataKind.KV, 1 << 16, label="unregistered behind its back")
    assert fake.cudaHostUnregister(buffer.address) == SUCCESS
    with pytest.raises(BackendIOError) as caught:
        memory.release(buffer)
    assert caught.value.code == NOT_REGISTERED
    assert "unregistered behind its back" in caught.value.operation
    assert fake.last_error == SUCCESS
    assert memory.budget.stats().used == 0  # the bytes go back to the budget all the same
    with pytest.raises(StateError):
        memory.release(buffer)


def test_failed_unregister_of_a_collected_buffer_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeCudaRuntime()
    buffer = PinnedAllocator(fake).allocate(1 << 16, label="collected")
    assert fake.cudaHostUnregister(buffer.address) == SUCCESS
    with caplog.at_level(logging.WARNING, logger="sglang_storage.memory.host"):
        del buffer
        gc.collect()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "collected" in caplog.records[0].getMessage()
    assert str(NOT_REGISTERED) in caplog.records[0].getMessage()
    assert fake.last_error == SUCCESS


def test_injected_runtime_needs_no_cuda() -> None:
    fake = FakeCudaRuntime()
    memory = fake_memory(fake)
    assert memory.page_locked is True
    pool = RecordPool(RecordPoolConfig(shape=(4,), dtype=torch.int32, capacity=8), memory)
    assert pool.page_locked is True
    pool.close()
    assert fake.live == {}


@pytest.mark.parametrize("device", ["cpu", "meta", "not a device", torch.device("cpu")])
def test_device_view_device_must_be_cuda(device: torch.device | str) -> None:
    with pytest.raises(ConfigError) as caught:
        _cuda_device(device, "records.device_view")
    assert caught.value.field == "device"
    assert caught.value.allowed == "cuda, cuda:N"


def test_device_view_keeps_an_explicit_cuda_index() -> None:
    assert _cuda_device("cuda:3", "records.device_view") == torch.device("cuda", 3)
