"""Page-locked host memory on CUDA: registrations end with their buffers, UVA views are views.

Marked ``gpu``: skipped with a reason where CUDA is absent. The CPU twin of the lifetime
checks, against a fake runtime, is ``tests/unit/memory/test_pinned_lifetime.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from support.gpu_kv import host_memory

from sglang_storage.core import DataKind
from sglang_storage.errors import ConfigError, StateError
from sglang_storage.memory import (
    Attention,
    KVGeometry,
    KVHostPool,
    KVLayout,
    RecordPool,
    RecordPoolConfig,
)
from sglang_storage.memory.host import TorchCudaRuntime, _clear_latched_error

pytestmark = pytest.mark.gpu

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered

GEOMETRY = KVGeometry(
    attention=Attention.MHA,
    layout=KVLayout.LAYER_FIRST,
    dtype=torch.bfloat16,
    layer_num=4,
    page_size=16,
    num_pages=256,
    head_num=8,
    head_dim=128,
)  # 64 MiB


def registered(tensor: torch.Tensor) -> bool:
    """Whether CUDA holds ``tensor``'s memory registered (page-locked).

    Asked of the runtime itself: registering the range again fails with
    ``cudaErrorHostMemoryAlreadyRegistered`` exactly when it is registered (a registration
    that succeeds is undone). ``Tensor.is_pinned()`` cannot tell: torch 2.11 answered False
    for memory registered with ``cudaHostRegister`` on an H200 (2026-12-04).
    """
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    nbytes = tensor.numel() * tensor.element_size()
    status = int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0))
    if status == 0:
        assert int(cudart.cudaHostUnregister(tensor.data_ptr())) == 0
        return False
    _clear_latched_error(TorchCudaRuntime())
    assert status == ALREADY_REGISTERED, f"cudaHostRegister probe failed with code {status}"
    return True


def kernel_runs_clean() -> None:
    """A kernel launch and a sync: raises if a CUDA error is latched."""
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()


def test_geometry_is_64_mib() -> None:
    assert GEOMETRY.total_bytes == 64 << 20


def test_dropped_pools_unregister_and_leave_no_error_behind() -> None:
    device = torch.empty(GEOMETRY.total_bytes, dtype=torch.uint8, device="cuda")
    for round_ in range(30):
        pool = KVHostPool(GEOMETRY, host_memory(128 << 20))
        raw = pool.buffer.tensor
        assert registered(raw), f"round {round_}"
        raw[:4096].fill_(round_)
        device.copy_(raw, non_blocking=True)
        torch.cuda.synchronize()
        assert int(device[0]) == round_
        del pool, raw  # no close(): the registration must end with the buffer
        gc.collect()
        kernel_runs_clean()


def test_a_collected_buffer_is_no_longer_registered() -> None:
    memory = host_memory(1 << 24)
    buffer = memory.allocate(DataKind.KV, 1 << 20, label="collected")
    tensor = buffer.tensor
    assert registered(tensor)
    memory.release(buffer)
    assert not registered(tensor)

    pool = KVHostPool(GEOMETRY, host_memory(128 << 20))
    kept = pool.buffer.tensor  # outlives the pool and its buffer
    assert registered(kept)
    del pool
    gc.collect()
    assert not registered(kept)
    kernel_runs_clean()


def test_a_failed_register_leaves_no_latched_error() -> None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    tensor = torch.empty(1 << 20, dtype=torch.uint8)
    assert int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)) == 0
    try:
        status = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
        assert int(status) == ALREADY_REGISTERED
        _clear_latched_error(TorchCudaRuntime())
        kernel_runs_clean()
    finally:
        assert int(cudart.cudaHostUnregister(tensor.data_ptr())) == 0


def record_pool() -> RecordPool:
    config = RecordPoolConfig(shape=(4, 2), dtype=torch.float32, capacity=16)
    return RecordPool(config, host_memory(1 << 20))


def test_device_view_sees_writes_made_after_it() -> None:
    pool = record_pool()
    slots = pool.alloc(4)
    view = pool.device_view()
    assert view.device == torch.device("cuda", torch.cuda.current_device())
    assert view.data_ptr() == pool.buffer.address
    assert tuple(view.shape) == (16, 4, 2)
    data = torch.randn(4, 4, 2)
    pool.write(slots, data)  # after the view was made
    torch.cuda.synchronize()
    on_device = view[slots.cuda()] * 1  # read by a kernel, through the view
    assert torch.equal(on_device.cpu(), data)
    assert torch.equal(pool.read(slots), data)


def test_device_view_on_an_explicit_index_is_the_same_memory() -> None:
    pool = record_pool()
    index = torch.cuda.current_device()
    view = pool.device_view(f"cuda:{index}")
    assert view.device == torch.device("cuda", index)
    assert view.data_ptr() == pool.buffer.address


def test_device_view_on_another_device_is_refused() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices to ask for a view on the other one")
    pool = record_pool()
    other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
    with pytest.raises(ConfigError) as caught:
        pool.device_view(f"cuda:{other}")
    assert caught.value.field == "device"


def test_close_is_refused_while_a_device_view_is_alive() -> None:
    pool = record_pool()
    slots = pool.alloc(16)
    view = pool.device_view()
    part = view[2:5]  # shares the view's storage, so it keeps the memory too
    del view
    gc.collect()
    with pytest.raises(StateError) as caught:
        pool.close()
    assert "device views" in caught.value.reason
    pool.write(slots, torch.full((16, 4, 2), 7.0))
    torch.cuda.synchronize()
    assert float(part.sum()) == 7.0 * 3 * 4 * 2  # the memory is alive and still the pool's
    pool.free(slots)
    del part
    gc.collect()
    pool.close()
    kernel_runs_clean()
