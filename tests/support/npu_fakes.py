"""Named fakes of the NPU pieces SGLang 0.5.23's sparse KV manager needs, for CPU tests only.

SGLang's ``SparseKVCacheManager`` (``srt/hardware_backend/npu/sparsity_driven_kv_offload/
manager.py``) imports three kernels from ``sgl_kernel_npu`` at module level and uses
``torch.npu`` streams and events. Neither exists here, so :func:`npu_fakes_installed` puts
fakes of exactly these into ``sys.modules`` (and ``torch.npu``) for one test and removes
them, and the NPU manager module imported under them, afterwards:

- ``FakeNpuKernels.unidex_copy_inplace(src, dst, src_index, dst_index, mask, src_dims,
  dst_dims, ...)``: rows of ``src`` (its first ``src_dims`` dimensions flattened) go to rows
  of ``dst`` (first ``dst_dims`` flattened) where ``mask`` holds, as read from its call
  sites;
- ``FakeNpuKernels.slot_map_lookup(slot_map, req_indices, topk)``: whether
  ``slot_map[req, token]`` holds a device slot, and the slot;
- ``FakeNpuKernels.create_shm_tensor(shape, dtype, device_id, name)``: a zeroed host tensor
  and its address twice (host and device pointer);
- ``FakeTorchNpu``: ``Stream`` / ``Event`` / ``stream()`` / ``current_stream()`` /
  ``current_device()`` / ``synchronize()`` that do nothing (CPU work is synchronous), and
  ``is_available()`` False.

These model the kernels' semantics as their callers use them; the real kernels were never
run here. Install them after SGLang is imported: a ``torch.npu`` present while
``sglang.srt.platforms`` loads makes SGLang take this for an NPU host.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["NPU_MANAGER_MODULE", "FakeNpuKernels", "FakeTorchNpu", "npu_fakes_installed"]

NPU_MANAGER_MODULE = "sglang.srt.hardware_backend.npu.sparsity_driven_kv_offload.manager"
_KERNEL_MODULE = "sgl_kernel_npu.sparsity_driven_kv_offload"


class FakeNpuKernels:
    """Fakes of ``sgl_kernel_npu.sparsity_driven_kv_offload``'s three kernels; counts calls."""

    def __init__(self) -> None:
        self.copies = 0
        self.lookups = 0
        self.shm_tensors: list[torch.Tensor] = []

    def unidex_copy_inplace(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_index: torch.Tensor,
        dst_index: torch.Tensor,
        mask: torch.Tensor,
        src_dims: int,
        dst_dims: int,
        *,
        block_dim: int = 0,
        src_ptr: int | None = None,
        dst_ptr: int | None = None,
    ) -> None:
        del block_dim, src_ptr, dst_ptr
        self.copies += 1
        rows = src.reshape(-1, *src.shape[src_dims:])
        target = dst.view(-1, *dst.shape[dst_dims:])
        keep = mask.to(torch.bool)
        target[dst_index.to(torch.long)[keep]] = rows[src_index.to(torch.long)[keep]]

    def slot_map_lookup(
        self, slot_map: torch.Tensor, req_indices: torch.Tensor, topk: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.lookups += 1
        tokens = topk.to(torch.long).clamp(0, slot_map.shape[1] - 1)
        slots = slot_map[req_indices.to(torch.long).unsqueeze(1), tokens]
        return (slots >= 0).to(torch.int32), slots.clamp(min=0)

    def create_shm_tensor(
        self, shape: tuple[int, ...], dtype: torch.dtype, device_id: int, name: str
    ) -> tuple[torch.Tensor, int, int]:
        del device_id, name
        tensor = torch.zeros(shape, dtype=dtype)
        self.shm_tensors.append(tensor)
        return tensor, tensor.data_ptr(), tensor.data_ptr()

    def module(self) -> types.ModuleType:
        kernels = types.ModuleType(_KERNEL_MODULE)
        kernels.unidex_copy_inplace = self.unidex_copy_inplace  # type: ignore[attr-defined]
        kernels.slot_map_lookup = self.slot_map_lookup  # type: ignore[attr-defined]
        kernels.create_shm_tensor = self.create_shm_tensor  # type: ignore[attr-defined]
        return kernels


class _FakeStream:
    def record_event(self, event: _FakeEvent | None = None) -> _FakeEvent:
        event = event or _FakeEvent()
        event.recorded += 1
        return event

    def wait_event(self, event: _FakeEvent) -> None:
        event.waited += 1

    def synchronize(self) -> None:
        """Nothing queued: CPU work is synchronous."""


class _FakeEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = 0
        self.waited = 0

    def record(self, stream: _FakeStream | None = None) -> None:
        self.recorded += 1

    def wait(self, stream: _FakeStream | None = None) -> None:
        self.waited += 1

    def synchronize(self) -> None:
        """Nothing queued: CPU work is synchronous."""


class FakeTorchNpu(types.ModuleType):
    """A fake ``torch.npu``: streams and events that do nothing, device 0."""

    Stream = _FakeStream
    Event = _FakeEvent

    def __init__(self) -> None:
        super().__init__("torch.npu")
        self._current = _FakeStream()

    def stream(self, stream: object) -> contextlib.AbstractContextManager[None]:
        del stream
        return contextlib.nullcontext()

    def current_stream(self, device: object = None) -> _FakeStream:
        del device
        return self._current

    def current_device(self) -> int:
        return 0

    def is_available(self) -> bool:
        """No NPU is here: SGLang code that asks takes its non-NPU path."""
        return False

    def synchronize(self, device: object = None) -> None:
        del device


@contextlib.contextmanager
def npu_fakes_installed() -> Iterator[FakeNpuKernels]:
    """Install the fakes for the duration; yield the kernels (to count calls).

    On exit ``sys.modules`` and ``torch`` are as before, and the NPU manager module
    (imported under the fakes) is forgotten, so a later import fails as it should here.
    """
    kernels = FakeNpuKernels()
    names = ("sgl_kernel_npu", _KERNEL_MODULE, "torch.npu", NPU_MANAGER_MODULE)
    saved = {name: sys.modules.get(name) for name in names}
    had_npu = hasattr(torch, "npu")
    saved_npu = getattr(torch, "npu", None)
    package = types.ModuleType("sgl_kernel_npu")
    package.__path__ = []
    kernel_module = kernels.module()
    package.sparsity_driven_kv_offload = kernel_module  # type: ignore[attr-defined]
    fake_npu = FakeTorchNpu()
    sys.modules.update(
        {"sgl_kernel_npu": package, _KERNEL_MODULE: kernel_module, "torch.npu": fake_npu}
    )
    sys.modules.pop(NPU_MANAGER_MODULE, None)
    torch.npu = fake_npu  # type: ignore[attr-defined]
    try:
        yield kernels
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if had_npu:
            torch.npu = saved_npu  # type: ignore[attr-defined]
        else:
            del torch.npu  # type: ignore[attr-defined]
        parent = sys.modules.get(NPU_MANAGER_MODULE.rpartition(".")[0])
        if parent is not None and saved[NPU_MANAGER_MODULE] is None:
            vars(parent).pop("manager", None)
