"""Pure decisions: eviction, prefetch stop, write policy and the load-vs-recompute cost model.

Policies see keys and numbers, never a backend or a buffer; they do no I/O, start no
threads and take an injectable clock, so each is tested exhaustively. Imports only the
layers below it. Every family is chosen by name from a frozen config, and an unknown name
is a :class:`~sglang_storage.errors.ConfigError` that lists the known ones. Contract, one
line per primitive:

Eviction (:mod:`.eviction`; implements :class:`~sglang_storage.core.EvictionPolicy`):

- :class:`LRUPolicy` - least recently used unpinned entries are evicted first.
- :class:`S3FIFOPolicy` - scan-resistant S3-FIFO: small FIFO filter, main FIFO with 2-bit
  counters, ghost queue; O(1), a hit moves nothing.
- :func:`make_eviction_policy` - a new policy from :class:`EvictionConfig` (``"lru"``,
  ``"s3fifo"``).

Prefetch (:mod:`.prefetch`; SGLang 0.5.23's ``--hicache-storage-prefetch-policy``):

- :meth:`PrefetchStopPolicy.decide` - may a waiting prefetch be terminated now: a
  :class:`PrefetchStopDecision` with a :class:`PrefetchStopReason`.
- :meth:`PrefetchStopPolicy.timeout_s` - the ``timeout`` deadline,
  ``base + (tokens // page_size) * page_size / 1024 * per_ki_token`` (optionally capped).
- :meth:`PrefetchStopPolicy.admits` - is a hit at least ``max(threshold, page_size)`` tokens.
- :func:`make_prefetch_stop_policy` - from :class:`PrefetchStopConfig` (``"best_effort"``,
  ``"wait_complete"``, ``"timeout"``).

Write (:mod:`.write`; SGLang's ``--hicache-write-policy``):

- :meth:`WritePolicy.on_hit` - does this hit start a write: a :class:`HitDecision` with a
  :class:`WriteReason` and the node's new hit count.
- :meth:`WritePolicy.on_evict` - demote, write back first, or drop: an :class:`EvictAction`.
- :func:`make_write_policy` - from :class:`WritePolicyConfig` (``"write_through"``,
  ``"write_through_selective"``, ``"write_back"``).

Cost (:mod:`.cost`):

- :meth:`CostModel.observe` / :meth:`CostModel.observe_prefill` - feed a finished transfer
  or prefill into the moving averages.
- :meth:`CostModel.decide` - load or recompute a hit of ``n`` tokens on a tier: a
  :class:`LoadDecision` carrying every input it used.
- :meth:`CostModel.stats` - the current estimates and decision counts
  (:class:`CostModelStats`).
"""

from __future__ import annotations

from sglang_storage.policy.cost import (
    DEFAULT_TIER_PRIORS,
    CostModel,
    CostModelConfig,
    CostModelStats,
    EstimateSource,
    LoadDecision,
    LoadOutcome,
    Tier,
    TierPrior,
    TierStats,
)
from sglang_storage.policy.eviction import (
    EVICTION_POLICY_NAMES,
    EvictionConfig,
    EvictionPolicyName,
    LRUPolicy,
    S3FIFOPolicy,
    make_eviction_policy,
)
from sglang_storage.policy.prefetch import (
    PREFETCH_STOP_POLICY_NAMES,
    SGLANG_PREFETCH_THRESHOLD_TOKENS,
    SGLANG_PREFETCH_TIMEOUT_BASE_S,
    SGLANG_PREFETCH_TIMEOUT_PER_KI_TOKEN_S,
    PrefetchStopConfig,
    PrefetchStopDecision,
    PrefetchStopPolicy,
    PrefetchStopPolicyName,
    PrefetchStopReason,
    make_prefetch_stop_policy,
)
from sglang_storage.policy.write import (
    SGLANG_SELECTIVE_WRITE_THRESHOLD,
    WRITE_POLICY_NAMES,
    EvictAction,
    HitDecision,
    WritePolicy,
    WritePolicyConfig,
    WritePolicyName,
    WriteReason,
    make_write_policy,
)

__all__ = [
    "DEFAULT_TIER_PRIORS",
    "EVICTION_POLICY_NAMES",
    "PREFETCH_STOP_POLICY_NAMES",
    "SGLANG_PREFETCH_THRESHOLD_TOKENS",
    "SGLANG_PREFETCH_TIMEOUT_BASE_S",
    "SGLANG_PREFETCH_TIMEOUT_PER_KI_TOKEN_S",
    "SGLANG_SELECTIVE_WRITE_THRESHOLD",
    "WRITE_POLICY_NAMES",
    "CostModel",
    "CostModelConfig",
    "CostModelStats",
    "EstimateSource",
    "EvictAction",
    "EvictionConfig",
    "EvictionPolicyName",
    "HitDecision",
    "LRUPolicy",
    "LoadDecision",
    "LoadOutcome",
    "PrefetchStopConfig",
    "PrefetchStopDecision",
    "PrefetchStopPolicy",
    "PrefetchStopPolicyName",
    "PrefetchStopReason",
    "S3FIFOPolicy",
    "Tier",
    "TierPrior",
    "TierStats",
    "WritePolicy",
    "WritePolicyConfig",
    "WritePolicyName",
    "WriteReason",
    "make_eviction_policy",
    "make_prefetch_stop_policy",
    "make_write_policy",
]
