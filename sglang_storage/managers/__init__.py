"""One manager per data kind, each a short composition of the layers below.

A manager names its pool, its pipeline, its backend and its policy, and owns no threads
or queues of its own (``tests/unit/managers/test_managers_own_no_threads.py`` checks
it): asynchrony comes from the pipelines' handles, and each manager's ``poll()`` returns
what finished as typed values. Imports only the layers below it; never SGLang.

- :class:`KVCacheManager` (:mod:`.kv`) - HiCache's job: device -> host per the write
  policy, host -> storage backup, layer-wise loads, storage hit queries and prefetch under
  a stop policy, agreed across ranks; hybrid side data restored as one unit with the KV.
- :class:`RankSync` (:mod:`.ranks`) - min over ranks with a bound; no answer in time is a
  miss on every rank (:class:`SingleRank`, :class:`StoreRankSync` over a TCPStore).
- :class:`DecodeOffloadManager` (:mod:`.decode`) - a decoding request's KV offloaded in
  strides, backed up on finish, host pages freed on the acknowledgement.
- :class:`SparseKVManager` (:mod:`.sparse`) - token-level offload and top-k prefetch for
  sparse attention, with hit detection.
- :class:`EmbeddingCacheManager` (:mod:`.embedding`) - encoder outputs by content hash.
- :class:`RecordStore` (:mod:`.records`) - write-once / read-once keyed records.
- :class:`WeightBackupManager` (:mod:`.weights`) - expert weight shards backed up and
  restored on demand.
- :class:`HostTableManager` (:mod:`.tables`) - large host tables read in place (Engram) in
  mapped regions, persisted under a fingerprint and restored on restart.
- :class:`StorageRuntime` (:mod:`.runtime`) - what every manager of a process shares: the
  host memory budget, one instance per backend, the pipelines, and
  :func:`kv_page_namespace`, where a rank's KV pages live.

Each module's events and results are imported from the module itself (several managers
have a ``BackupDone``, for instance).
"""

from sglang_storage.managers.decode import DecodeOffloadConfig, DecodeOffloadManager
from sglang_storage.managers.embedding import (
    EmbeddingCacheConfig,
    EmbeddingCacheManager,
    content_hash,
)
from sglang_storage.managers.kv import KVCacheConfig, KVCacheManager, SidePool
from sglang_storage.managers.ranks import RankSync, SingleRank, StoreRankSync
from sglang_storage.managers.records import RecordStore, RecordStoreConfig
from sglang_storage.managers.runtime import (
    BackendLease,
    RankLayout,
    RuntimeConfig,
    StorageRuntime,
    kv_page_namespace,
)
from sglang_storage.managers.sparse import SparseKVConfig, SparseKVManager
from sglang_storage.managers.tables import HostTableConfig, HostTableManager
from sglang_storage.managers.weights import WeightBackupConfig, WeightBackupManager

__all__ = [
    "BackendLease",
    "DecodeOffloadConfig",
    "DecodeOffloadManager",
    "EmbeddingCacheConfig",
    "EmbeddingCacheManager",
    "HostTableConfig",
    "HostTableManager",
    "KVCacheConfig",
    "KVCacheManager",
    "RankLayout",
    "RankSync",
    "RecordStore",
    "RecordStoreConfig",
    "RuntimeConfig",
    "SidePool",
    "SingleRank",
    "SparseKVConfig",
    "SparseKVManager",
    "StorageRuntime",
    "StoreRankSync",
    "WeightBackupConfig",
    "WeightBackupManager",
    "content_hash",
    "kv_page_namespace",
]
