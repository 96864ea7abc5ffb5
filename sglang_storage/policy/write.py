"""Write policies: when a page or node is copied down to the next tier, with SGLang's rules.

The policy sees counts and flags, never the node: the owner keeps each node's hit count
and whether it is backed up (a copy below exists or is being written), asks the policy on
each hit and on each eviction, and acts on the typed answer.

- ``write_through`` (SGLang's default) - write on the first hit.
- ``write_through_selective`` - write once a node has ``selective_threshold`` hits
  (SGLang: 2), so pages used once are never written.
- ``write_back`` - hits never write and are not counted; a node is written only when it is
  evicted without a backup.

At eviction a backed-up node is demoted (the upper copy is freed, the lower one stays)
under every policy; a node without a backup is written first under ``write_back`` and
dropped under the two write-through policies (its data is lost to both tiers).

What SGLang 0.5.23 does (``sglang/srt/mem_cache``):

- ``write_through_threshold = 1 if policy == "write_through" else 2`` and
  ``is_write_back = policy == "write_back"`` (``unified_radix_cache.py:558-564``,
  ``unified_cache/storage_attachment.py:401-404``); ``--hicache-write-policy`` defaults to
  ``write_through`` (``srt/arg_groups/fields/memory.py:121-127``).
- ``UnifiedTreeCore._inc_hit_count_and_check`` (``unified_cache/unified_tree_core.py:1104-1122``):
  no-op for an evicted node; under write-back returns False without counting; otherwise
  ``hit_count += 1`` and back up when ``not node.backuped and hit_count >= threshold``. A
  hit is an insert that covers the node; creating it counts as its first (``:1373``, ``:1438``).
- ``UnifiedTreeCore.evict_device_leaf`` (``unified_tree_core.py:1788-1823``): backed up ->
  demote; not backed up and write-back -> build a backup, then demote; otherwise delete
  the node ("write_through_unbacked_eviction" in SGLang's dropped-token metric).
"""

from __future__ import annotations

import enum
from typing import Final, Literal

import attrs

from sglang_storage.config import one_of, positive_int, require_int

__all__ = [
    "SGLANG_SELECTIVE_WRITE_THRESHOLD",
    "WRITE_POLICY_NAMES",
    "EvictAction",
    "HitDecision",
    "WritePolicy",
    "WritePolicyConfig",
    "WritePolicyName",
    "WriteReason",
    "make_write_policy",
]

WritePolicyName = Literal["write_through", "write_through_selective", "write_back"]
"""The registered write policy names (SGLang's ``--hicache-write-policy``)."""

WRITE_POLICY_NAMES: Final[tuple[str, ...]] = (
    "write_through",
    "write_through_selective",
    "write_back",
)
"""Every name :class:`WritePolicyConfig` accepts."""

SGLANG_SELECTIVE_WRITE_THRESHOLD: Final = 2
"""SGLang 0.5.23's hit threshold for ``write_through_selective``."""


@attrs.frozen(kw_only=True)
class WritePolicyConfig:
    """Which write policy to use.

    Attributes:
        name: ``"write_through"`` (default, as SGLang), ``"write_through_selective"`` or
            ``"write_back"``.
        selective_threshold: Hits before ``write_through_selective`` writes (>= 1;
            default 2, SGLang's). Ignored by the other policies.
    """

    name: WritePolicyName = attrs.field(
        default="write_through", validator=one_of(*WRITE_POLICY_NAMES)
    )
    selective_threshold: int = attrs.field(
        default=SGLANG_SELECTIVE_WRITE_THRESHOLD, validator=positive_int
    )


class WriteReason(enum.Enum):
    """Why a hit does, or does not, start a write."""

    THRESHOLD_REACHED = "threshold_reached"
    """Not backed up and the hit count reached the threshold: write now."""
    BELOW_THRESHOLD = "below_threshold"
    """Not backed up, but too few hits yet."""
    ALREADY_BACKED_UP = "already_backed_up"
    """A copy below exists or is being written."""
    DEFERRED_TO_EVICTION = "deferred_to_eviction"
    """``write_back``: hits never write; eviction does."""


@attrs.frozen(kw_only=True)
class HitDecision:
    """A write policy's answer to one hit on a node."""

    reason: WriteReason
    """Why; :attr:`write` follows from it."""
    hit_count: int
    """The node's hit count to store: one more than before, or unchanged under write_back."""

    @property
    def write(self) -> bool:
        """Whether to start writing the node to the next tier now."""
        return self.reason is WriteReason.THRESHOLD_REACHED


class EvictAction(enum.Enum):
    """What to do with a node that is being evicted from the upper tier."""

    DEMOTE = "demote"
    """It is backed up: free the upper copy; the lower copy stays."""
    WRITE_BACK = "write_back"
    """``write_back`` and not backed up: write it to the next tier, then demote."""
    DROP = "drop"
    """A write-through policy and not backed up: delete it; its data is lost."""


class WritePolicy:
    """Answers, per hit and per eviction of a node, whether to write it down now.

    Pure: the owner stores each node's hit count (from :attr:`HitDecision.hit_count`) and
    whether it is backed up; the policy keeps no per-node state. Report hits only on nodes
    that are resident in the upper tier (SGLang ignores hits on evicted nodes).

    Args:
        config: The policy name and threshold.
    """

    def __init__(self, config: WritePolicyConfig) -> None:
        self._config = config
        self._threshold: int | None
        if config.name == "write_through":
            self._threshold = 1
        elif config.name == "write_through_selective":
            self._threshold = config.selective_threshold
        else:
            self._threshold = None

    @property
    def name(self) -> WritePolicyName:
        """The policy's registered name."""
        return self._config.name

    @property
    def config(self) -> WritePolicyConfig:
        """The configuration the policy was built from."""
        return self._config

    @property
    def threshold(self) -> int | None:
        """Hits before a write: 1, ``selective_threshold``, or ``None`` for write_back."""
        return self._threshold

    def on_hit(self, hits_before: int, *, backed_up: bool) -> HitDecision:
        """Return whether this hit on a node starts a write, and its new hit count.

        Args:
            hits_before: The node's hit count before this hit (0 for a new node).
            backed_up: Whether a copy below exists or is being written.

        Raises:
            ConfigError: ``hits_before`` is not an int >= 0.
        """
        require_int(hits_before, owner="WritePolicy.on_hit", field="hits_before")
        if self._threshold is None:
            return HitDecision(reason=WriteReason.DEFERRED_TO_EVICTION, hit_count=hits_before)
        count = hits_before + 1
        if backed_up:
            reason = WriteReason.ALREADY_BACKED_UP
        elif count >= self._threshold:
            reason = WriteReason.THRESHOLD_REACHED
        else:
            reason = WriteReason.BELOW_THRESHOLD
        return HitDecision(reason=reason, hit_count=count)

    def on_evict(self, *, backed_up: bool) -> EvictAction:
        """Return what to do with a node evicted from the upper tier.

        Args:
            backed_up: Whether a copy below exists (a write still in flight does not count:
                the owner must wait for it or treat the node as not backed up).
        """
        if backed_up:
            return EvictAction.DEMOTE
        return EvictAction.WRITE_BACK if self._threshold is None else EvictAction.DROP


def make_write_policy(config: WritePolicyConfig) -> WritePolicy:
    """Return the write policy ``config`` names."""
    return WritePolicy(config)
