"""Moving bytes: the device<->host pipeline and the host<->storage pipeline.

Every transfer returns a typed handle (done, failed or cancelled; bytes; latency) and the
owner of a pipeline collects finished work as values, each once: ``DeviceHostPipeline.poll()``
returns results, ``StoragePipeline.completions()`` terminal handles; no caller drains a
queue. Querying or waiting on a handle changes nothing, and a failure is reported on its
own handle, never raised from another call. The
storage side talks to :class:`PageStore`, a ``Protocol`` declared here that the backends in
:mod:`sglang_storage.storage` satisfy; this layer never imports them. Imports only
:mod:`sglang_storage.memory` and the shared base.

- :class:`DeviceHostPipeline` (:mod:`.device`) - asynchronous offload (D2H, all layers)
  and layer-wise load (H2D) of KV pages between a :class:`DeviceKV` and a
  :class:`~sglang_storage.memory.KVHostPool`, with a :class:`LayerDoneCounter` the forward
  pass waits on; I/O through the ``torch`` or ``kernel`` (sgl_kernel) backend (:mod:`.io`).
- :class:`StoragePipeline` (:mod:`.pipeline`) - get/put/exists of page batches on a small
  worker pool: bounded per-priority queues with back-pressure, batching, deadlines,
  cancellation, failure isolation, bounded shutdown, and :class:`PipelineMetrics`.

The device side (:mod:`.device`, :mod:`.device_kv`, :mod:`.io`, :mod:`.io_kernel`) needs
torch and is imported on first use of one of its names, so the storage side (and every
backend, through :class:`PageStore`) is importable without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from sglang_storage.transfer.handles import (
    AnyHandle,
    CloseReport,
    ExistsHandle,
    GetHandle,
    OpKind,
    OpState,
    Priority,
    PutHandle,
    TransferHandle,
)
from sglang_storage.transfer.metrics import (
    LATENCY_BOUNDS_S,
    KindMetrics,
    LatencySnapshot,
    PipelineMetrics,
)
from sglang_storage.transfer.pipeline import (
    BackpressureMode,
    StoragePipeline,
    StoragePipelineConfig,
)
from sglang_storage.transfer.store import PageStore

if TYPE_CHECKING:
    from sglang_storage.transfer.device import (
        CopyDirection,
        CopyMetrics,
        DeviceHostPipeline,
        DeviceLoadHandle,
        DeviceTransferConfig,
        DeviceTransferHandle,
        DeviceTransferMetrics,
        DeviceTransferResult,
        DeviceTransferState,
        LayerDoneCounter,
    )
    from sglang_storage.transfer.device_kv import DeviceKV
    from sglang_storage.transfer.io import (
        CopyPlan,
        IOBackend,
        IOBackendChoice,
        TorchIOBackend,
        open_io_backend,
    )
    from sglang_storage.transfer.io_kernel import KernelIOBackend, kernel_unavailable_reason

_LAZY = {
    "CopyDirection": "device",
    "CopyMetrics": "device",
    "DeviceHostPipeline": "device",
    "DeviceLoadHandle": "device",
    "DeviceTransferConfig": "device",
    "DeviceTransferHandle": "device",
    "DeviceTransferMetrics": "device",
    "DeviceTransferResult": "device",
    "DeviceTransferState": "device",
    "LayerDoneCounter": "device",
    "DeviceKV": "device_kv",
    "CopyPlan": "io",
    "IOBackend": "io",
    "IOBackendChoice": "io",
    "TorchIOBackend": "io",
    "open_io_backend": "io",
    "KernelIOBackend": "io_kernel",
    "kernel_unavailable_reason": "io_kernel",
}


def __getattr__(name: str) -> object:
    """The device-side names, imported (with torch) when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "LATENCY_BOUNDS_S",
    "AnyHandle",
    "BackpressureMode",
    "CloseReport",
    "CopyDirection",
    "CopyMetrics",
    "CopyPlan",
    "DeviceHostPipeline",
    "DeviceKV",
    "DeviceLoadHandle",
    "DeviceTransferConfig",
    "DeviceTransferHandle",
    "DeviceTransferMetrics",
    "DeviceTransferResult",
    "DeviceTransferState",
    "ExistsHandle",
    "GetHandle",
    "IOBackend",
    "IOBackendChoice",
    "KernelIOBackend",
    "KindMetrics",
    "LatencySnapshot",
    "LayerDoneCounter",
    "OpKind",
    "OpState",
    "PageStore",
    "PipelineMetrics",
    "Priority",
    "PutHandle",
    "StoragePipeline",
    "StoragePipelineConfig",
    "TorchIOBackend",
    "TransferHandle",
    "kernel_unavailable_reason",
    "open_io_backend",
]
