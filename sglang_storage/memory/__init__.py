"""Host memory as one budgeted resource shared by every data kind.

Owns the process-wide host memory budget with per-kind reservations, pinned (CUDA) and
plain (CPU-only) allocators behind one API, the page/slot allocator with pin counts, and
the typed host pools. Imports only the shared base (:mod:`sglang_storage.errors`,
``units``, ``config``, ``core``). The pieces, lowest first:

- :class:`HostMemoryBudget` (:mod:`.budget`) - one budget, reservations per
  :class:`~sglang_storage.core.DataKind`, borrowing of unreserved space, refusal at start-up
  of a budget the machine cannot hold.
- :class:`HostMemory` (:mod:`.host`) - the budget plus a plain or page-locked allocator;
  every pool takes its buffer from here.
- :class:`SlotAllocator` (:mod:`.slots`) and :class:`ExtentAllocator` (:mod:`.extents`) -
  fixed slots with pin counts, and best-fit runs with coalescing.
- :class:`HostPool` / :class:`SlotPool` (:mod:`.base`) - the life cycle every pool shares:
  one budgeted buffer, closed-state checks, ``close()`` refused while transfers pin data.
- Pools: :class:`KVHostPool` (SGLang's KV layouts, :mod:`.layouts`), :class:`EmbeddingPool`,
  :class:`RecordPool`, :class:`BlobPool`; each reports :class:`PoolStats`.
- :class:`MappedRegion` (:mod:`.mapped`) - a mapped host region (anonymous, memfd shared by
  a host's processes, or file-backed) with huge pages, a verified backing report and CUDA
  registration, charged to the budget once however many processes map it.
- :func:`tensor_bytes`, :func:`tensor_spec` (:mod:`.tensors`) - host tensors as byte views
  and stored-object specs.
"""

from sglang_storage.memory.base import HostPool, SlotPool
from sglang_storage.memory.budget import (
    BudgetConfig,
    BudgetStats,
    HostMemoryBudget,
    KindUsage,
    Lease,
    MemoryFacts,
    read_memory_facts,
)
from sglang_storage.memory.embedding import EmbeddingEntry, EmbeddingPool, EmbeddingPoolConfig
from sglang_storage.memory.extents import ExtentAllocator, Run
from sglang_storage.memory.host import (
    CudaRuntime,
    HostAllocator,
    HostBuffer,
    HostMemory,
    PinnedAllocator,
    Pinning,
    PlainAllocator,
    cuda_available,
    make_allocator,
)
from sglang_storage.memory.kv import KVHostPool, KVLayerView
from sglang_storage.memory.layouts import KV_DTYPES, Attention, KVGeometry, KVLayout
from sglang_storage.memory.mapped import (
    BackingReport,
    BudgetCharge,
    MappedRegion,
    MappedRegionConfig,
    MappingMode,
    RegionState,
    Registration,
    SharedHandle,
    read_backing,
    thp_mode,
)
from sglang_storage.memory.records import (
    Blob,
    BlobPool,
    BlobPoolConfig,
    RecordPool,
    RecordPoolConfig,
)
from sglang_storage.memory.slots import SlotAllocator, SlotStats
from sglang_storage.memory.stats import PoolStats
from sglang_storage.memory.tensors import dtype_name, tensor_bytes, tensor_spec

__all__ = [
    "KV_DTYPES",
    "Attention",
    "BackingReport",
    "Blob",
    "BlobPool",
    "BlobPoolConfig",
    "BudgetCharge",
    "BudgetConfig",
    "BudgetStats",
    "CudaRuntime",
    "EmbeddingEntry",
    "EmbeddingPool",
    "EmbeddingPoolConfig",
    "ExtentAllocator",
    "HostAllocator",
    "HostBuffer",
    "HostMemory",
    "HostMemoryBudget",
    "HostPool",
    "KVGeometry",
    "KVHostPool",
    "KVLayerView",
    "KVLayout",
    "KindUsage",
    "Lease",
    "MappedRegion",
    "MappedRegionConfig",
    "MappingMode",
    "MemoryFacts",
    "PinnedAllocator",
    "Pinning",
    "PlainAllocator",
    "PoolStats",
    "RecordPool",
    "RecordPoolConfig",
    "RegionState",
    "Registration",
    "Run",
    "SharedHandle",
    "SlotAllocator",
    "SlotPool",
    "SlotStats",
    "cuda_available",
    "dtype_name",
    "make_allocator",
    "read_backing",
    "read_memory_facts",
    "tensor_bytes",
    "tensor_spec",
    "thp_mode",
]
