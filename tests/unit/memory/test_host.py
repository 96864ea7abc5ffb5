from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from sglang_storage.core import DataKind
from sglang_storage.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    StateError,
    StorageError,
)
from sglang_storage.memory import (
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    MemoryFacts,
    PinnedAllocator,
    Pinning,
    PlainAllocator,
    cuda_available,
    make_allocator,
)

MemoryFactory = Callable[[int], HostMemory]
no_cuda = pytest.mark.skipif(cuda_available(), reason="checks behaviour where CUDA is absent")


@pytest.mark.parametrize("nbytes", [1, 100, 4095, 4096, 4097, 1 << 20])
def test_buffers_are_aligned_and_exact(memory: HostMemory, nbytes: int) -> None:
    buffer = memory.allocate(DataKind.KV, nbytes, label="pages")
    assert buffer.nbytes == nbytes
    assert buffer.tensor.dtype == torch.uint8
    assert buffer.tensor.dim() == 1
    assert buffer.tensor.is_contiguous()
    assert buffer.address == buffer.tensor.data_ptr()
    assert buffer.address % 4096 == 0
    assert buffer.label == "pages"
    assert buffer.page_locked == memory.page_locked
    buffer.tensor.fill_(7)  # the memory is really there
    assert int(buffer.tensor.sum()) == 7 * nbytes


@pytest.mark.parametrize("kind", list(DataKind), ids=lambda k: k.value)
def test_allocation_is_charged_to_its_kind(memory: HostMemory, kind: DataKind) -> None:
    buffer = memory.allocate(kind, 12345, label="x")
    stats = memory.budget.stats()
    for other in DataKind:
        assert stats.kinds[other].used == (12345 if other is kind else 0)
    memory.release(buffer)
    assert memory.budget.stats().used == 0


def test_buffers_do_not_overlap(memory: HostMemory) -> None:
    buffers = [memory.allocate(DataKind.RECORD, 5000, label=f"b{i}") for i in range(4)]
    spans = sorted((b.address, b.address + b.nbytes) for b in buffers)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


def test_release_twice_or_foreign_buffer_is_refused(make_memory: MemoryFactory) -> None:
    memory = make_memory(1 << 20)
    other = make_memory(1 << 20)
    buffer = memory.allocate(DataKind.KV, 1000, label="pages")
    foreign = other.allocate(DataKind.KV, 1000, label="elsewhere")
    with pytest.raises(StateError):
        memory.release(foreign)
    assert other.budget.stats().used == 1000
    assert memory.budget.stats().used == 1000
    memory.release(buffer)
    assert memory.budget.stats().used == 0
    with pytest.raises(StateError):
        memory.release(buffer)
    assert memory.budget.stats().used == 0
    stray = PlainAllocator().allocate(10, label="stray")
    with pytest.raises(StateError):
        memory.release(stray)
    other.release(foreign)
    assert other.budget.stats().used == 0


def test_budget_refusal_allocates_nothing(make_memory: MemoryFactory) -> None:
    memory = make_memory(10_000)
    kept = memory.allocate(DataKind.KV, 6000, label="kept")
    with pytest.raises(CapacityError) as caught:
        memory.allocate(DataKind.EMBEDDING, 5000, label="too much")
    assert caught.value.requested == 5000
    assert caught.value.available == 4000
    assert memory.budget.stats().used == 6000
    # The refused allocation holds nothing: the rest is still there.
    rest = memory.allocate(DataKind.EMBEDDING, 4000, label="rest")
    memory.release(rest)
    memory.release(kept)
    assert memory.budget.stats().used == 0


@pytest.mark.parametrize("nbytes", [0, -1, True, 1.5])
def test_bad_sizes_are_refused_before_charging(memory: HostMemory, nbytes: object) -> None:
    with pytest.raises(ConfigError):
        memory.allocate(DataKind.KV, nbytes, label="x")  # type: ignore[arg-type]
    assert memory.budget.stats().used == 0


def _huge_memory() -> HostMemory:
    # A budget that allows far more than any machine can map: the allocator itself fails.
    facts = MemoryFacts(physical=1 << 62, available=1 << 62)
    budget = HostMemoryBudget(BudgetConfig(total=1 << 61, headroom=0), facts=facts)
    return HostMemory(budget, pinning=Pinning.NEVER)


def test_allocator_failure_returns_the_bytes_to_the_budget() -> None:
    memory = _huge_memory()
    with pytest.raises((RuntimeError, StorageError)):
        memory.allocate(DataKind.WEIGHT, 1 << 60, label="impossible")
    assert memory.budget.stats().used == 0


def test_allocator_failure_is_reported_as_a_storage_error() -> None:
    # errors.py: lower-level exceptions are translated at the layer that meets them; an
    # allocation the machine cannot back is a CapacityError, not torch's RuntimeError.
    memory = _huge_memory()
    with pytest.raises(CapacityError):
        memory.allocate(DataKind.WEIGHT, 1 << 60, label="impossible")


def test_plain_allocator() -> None:
    allocator = PlainAllocator()
    assert allocator.page_locked is False
    buffer = allocator.allocate(8192, label="plain")
    assert buffer.nbytes == 8192
    assert buffer.address % 4096 == 0
    assert buffer.page_locked is False
    allocator.release(buffer)


def test_pinning_never_is_plain(make_memory: MemoryFactory) -> None:
    assert isinstance(make_allocator(Pinning.NEVER), PlainAllocator)
    memory = HostMemory(make_memory(1 << 20).budget, pinning=Pinning.NEVER)
    assert memory.page_locked is False
    assert memory.allocate(DataKind.KV, 10, label="x").page_locked is False


@no_cuda
def test_pinning_auto_without_cuda_is_plain(memory: HostMemory) -> None:
    assert isinstance(make_allocator(Pinning.AUTO), PlainAllocator)
    assert memory.page_locked is False


@no_cuda
def test_pinning_always_without_cuda_is_backend_unavailable(make_memory: MemoryFactory) -> None:
    budget = make_memory(1 << 20).budget
    with pytest.raises(BackendUnavailableError) as caught:
        HostMemory(budget, pinning=Pinning.ALWAYS)
    assert "CUDA" in caught.value.reason
    with pytest.raises(BackendUnavailableError):
        make_allocator(Pinning.ALWAYS)
    with pytest.raises(BackendUnavailableError):
        PinnedAllocator()
    assert budget.stats().used == 0


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_pinned_allocator_registers_the_buffer_with_cuda() -> None:
    allocator = PinnedAllocator()
    assert allocator.page_locked is True
    buffer = allocator.allocate(1 << 20, label="pinned")
    assert buffer.page_locked is True
    assert buffer.address % 4096 == 0
    assert buffer.tensor.is_pinned()
    allocator.release(buffer)
    assert not buffer.tensor.is_pinned()


@pytest.mark.gpu
def test_pinned_buffer_takes_non_blocking_copies(make_memory: MemoryFactory) -> None:
    memory = HostMemory(make_memory(1 << 24).budget, pinning=Pinning.ALWAYS)
    assert memory.page_locked is True
    buffer = memory.allocate(DataKind.KV, 1 << 20, label="pinned")
    assert buffer.page_locked is True
    source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    buffer.tensor.copy_(source)
    device = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    device.copy_(buffer.tensor, non_blocking=True)
    back = torch.empty_like(buffer.tensor)
    back.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)
    memory.release(buffer)
    assert memory.budget.stats().used == 0


@pytest.mark.gpu
def test_pinning_auto_with_cuda_is_page_locked(memory: HostMemory) -> None:
    assert memory.page_locked is True
    assert isinstance(make_allocator(Pinning.AUTO), PinnedAllocator)
