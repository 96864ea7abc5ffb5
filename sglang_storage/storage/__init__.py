"""Key-value storage backends behind one typed protocol.

Owns the backend protocol and its declared capabilities, the self-checking object format,
SGLang-compatible keys, the registry, and the backends themselves (``file`` as the embedded
default, ``memory``, ``mooncake``, ``hf3fs``). Backend-specific errors are
translated into :mod:`sglang_storage.errors` here. Imports only the layers below it.

- :class:`Backend` (:mod:`.backend`) - the protocol: ``exists``, ``prefix_hits``,
  zero-copy ``get_into`` / ``put_from`` with typed per-key results, ``delete``,
  ``clear(namespace)``, ``stats``, ``close`` and declared :class:`Capabilities`.
- :mod:`.format` - the 512-byte header (format version, kind, dtype/shape/layout, model,
  checksums) every object carries and every read verifies.
- :mod:`.keys` - SGLang 0.5.23's page hash chain (``page_hashes``), bit-identical, and
  the namespaces of stored pages (``model_fingerprint``, ``kv_namespace``; MLA shared
  across TP ranks).
- :class:`FileBackend` (:mod:`.file`), :class:`MemoryBackend` (:mod:`.dram`) and
  :class:`MooncakeBackend` (:mod:`.mooncake`, a Mooncake Store cluster; its client is
  imported only when one is opened) and :class:`Hf3fsBackend` (:mod:`.hf3fs`, fixed-size
  slots in large preallocated files on a 3FS mount, through the usrbio client or POSIX).
- :class:`FaultInjectingBackend` (:mod:`.faults`) - any backend with seeded injected
  faults (errors, latency, timeouts, partial batches, vanished objects, torn writes, bit
  flips); registered as ``faulty``.
- :mod:`.fsck` - checking a backend that declares ``Capabilities.scannable``
  (:class:`Scannable`): per-object :class:`ObjectReport` s by :class:`ObjectState`,
  :class:`RepairResult` s, and a :class:`ScanSummary` by state, data kind and namespace.
- :func:`create_backend` and friends (:mod:`.registry`) - backends by name, plug-ins
  through the ``sglang_storage.backends`` entry point group.
"""

from sglang_storage.storage.backend import (
    Backend,
    BackendStats,
    Capabilities,
    MemoryRegistrar,
    Scannable,
)
from sglang_storage.storage.dram import MemoryBackend, MemoryBackendConfig
from sglang_storage.storage.faults import (
    FaultInjectingBackend,
    FaultKind,
    FaultSchedule,
    FaultStats,
    FaultyBackendConfig,
)
from sglang_storage.storage.file import Durability, FileBackend, FileBackendConfig
from sglang_storage.storage.fsck import (
    ObjectReport,
    ObjectState,
    RepairAction,
    RepairResult,
    ScanSummary,
    summarize,
)
from sglang_storage.storage.hf3fs import Hf3fsBackend, Hf3fsBackendConfig
from sglang_storage.storage.mooncake import (
    MooncakeBackend,
    MooncakeBackendConfig,
    MooncakeProtocol,
    MooncakeTransfer,
)
from sglang_storage.storage.registry import (
    ENTRY_POINT_GROUP,
    BackendContext,
    BackendEntry,
    backend_entry,
    backend_names,
    create_backend,
    register_backend,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendContext",
    "BackendEntry",
    "BackendStats",
    "Capabilities",
    "Durability",
    "FaultInjectingBackend",
    "FaultKind",
    "FaultSchedule",
    "FaultStats",
    "FaultyBackendConfig",
    "FileBackend",
    "FileBackendConfig",
    "Hf3fsBackend",
    "Hf3fsBackendConfig",
    "MemoryBackend",
    "MemoryBackendConfig",
    "MemoryRegistrar",
    "MooncakeBackend",
    "MooncakeBackendConfig",
    "MooncakeProtocol",
    "MooncakeTransfer",
    "ObjectReport",
    "ObjectState",
    "RepairAction",
    "RepairResult",
    "ScanSummary",
    "Scannable",
    "backend_entry",
    "backend_names",
    "create_backend",
    "register_backend",
    "summarize",
]
