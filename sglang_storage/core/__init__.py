"""Value types and protocols that every layer shares.

Part of the shared base below :mod:`sglang_storage.memory`: standard library and attrs only.
Lower layers declare here what they need from higher ones, and higher layers implement it
(DESIGN.md section 3):

- :class:`DataKind` and :data:`Clock` (:mod:`.kinds`) - the kinds of data the subsystem
  stores (the host memory budget reserves per kind; stored objects are namespaced by
  kind), and an injectable source of monotonic seconds.
- :class:`EvictionPolicy` (:mod:`.eviction`) - chooses victims for a bounded cache (host
  pools, the file backend's capacity cap, the embedding cache). Implemented in
  :mod:`sglang_storage.policy`; whoever owns a cache is handed one.
- Stored objects as values (:mod:`.objects`): :class:`Namespace`, :class:`ObjectKey`,
  :class:`ObjectSpec`, the zero-copy :class:`GetRequest` / :class:`PutRequest`, and the
  typed per-key :class:`GetResult` / :class:`PutResult` that the transfer pipelines and the
  storage backends exchange.
"""

from sglang_storage.core.eviction import EvictionPolicy
from sglang_storage.core.kinds import Clock, DataKind
from sglang_storage.core.objects import (
    DTYPE_SIZES,
    GetOutcome,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
    PutResult,
    Shard,
    as_byte_view,
    keys_of,
    valid_names,
)

__all__ = [
    "DTYPE_SIZES",
    "Clock",
    "DataKind",
    "EvictionPolicy",
    "GetOutcome",
    "GetRequest",
    "GetResult",
    "Namespace",
    "ObjectKey",
    "ObjectSpec",
    "PutOutcome",
    "PutRequest",
    "PutResult",
    "Shard",
    "as_byte_view",
    "keys_of",
    "valid_names",
]
