"""Eviction policies: which entries of a bounded cache to give up, by key and weight only.

Both policies implement :class:`~sglang_storage.core.EvictionPolicy` (its docstring is the
contract) and are chosen by name through :class:`EvictionConfig` and
:func:`make_eviction_policy`:

- ``"lru"`` - :class:`LRUPolicy`: least recently used first. SGLang's default device policy
  (``--radix-eviction-policy lru``) and ``LRUFileEvictor``'s rule for its file backend.
- ``"s3fifo"`` - :class:`S3FIFOPolicy`: S3-FIFO (Yang et al., "FIFO queues are all you need
  for cache eviction", SOSP 2023), the scan-resistant choice.

Why S3-FIFO rather than ARC or SLRU: a one-time scan (a long prompt read once, a batch of
one-off requests, a cold restart warming the file backend) is exactly what flushes an LRU
host pool of its hot shared prefixes. S3-FIFO filters such one-hit entries through a small
FIFO (10% of the weight) so they never reach the main FIFO that holds the reused ones, and
a ghost queue gives a key that comes back soon after being filtered out a direct place in
main. It is as good as or better than ARC and SLRU on the published traces, has no tuning
beyond the small-queue share, and is O(1) per operation with no list reordering on a hit
(a hit only bumps a 2-bit counter). ARC needs four lists and adaptive resizing; SLRU needs
a protected-segment size and still moves entries on every hit.

Common rules: weights are positive ints; ``evict(amount)`` frees a batch of victims whose
weights sum to at least ``amount`` (all evictable ones when they weigh less); pinned entries
are skipped, stay tracked and keep their place; a refused call (``StateError`` for a state
rule, ``ConfigError`` for a bad argument) changes nothing. Every operation is O(1)
amortised, except that ``evict`` also steps over the pinned entries it meets. Policies are
not thread-safe: the owner of the cache serialises calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final, Generic, Literal, TypeVar

import attrs

from sglang_storage.config import number_in_range, one_of, require_int
from sglang_storage.core import EvictionPolicy
from sglang_storage.errors import ConfigError, StateError

__all__ = [
    "EVICTION_POLICY_NAMES",
    "EvictionConfig",
    "EvictionPolicyName",
    "LRUPolicy",
    "S3FIFOPolicy",
    "make_eviction_policy",
]

K = TypeVar("K", bound=Hashable)

EvictionPolicyName = Literal["lru", "s3fifo"]
"""The registered eviction policy names."""

_MAX_FREQ: Final = 3  # S3-FIFO's 2-bit access counter
_MOVE_TO_MAIN_AT: Final = 1  # libCacheSim's move-to-main-threshold: accessed at least once


def _not_tracked(subject: str, key: object) -> StateError:
    return StateError(subject=subject, reason=f"key {key!r} is not tracked")


@attrs.define(slots=True)
class _LRUEntry:
    weight: int
    pins: int = 0


class LRUPolicy(Generic[K]):
    """Least recently used first: ``insert`` and ``access`` make a key the most recent.

    Entries sit in one ordered map, least recent first, so every operation is O(1) and
    ``evict`` walks from the cold end, stepping over pinned entries (they keep their place).
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[K, _LRUEntry] = OrderedDict()
        self._total_weight = 0
        self._pinned_weight = 0
        self._pinned_count = 0

    @property
    def name(self) -> str:
        """The registered name, ``"lru"``."""
        return "lru"

    @property
    def total_weight(self) -> int:
        """The summed weight of every tracked entry."""
        return self._total_weight

    @property
    def evictable_weight(self) -> int:
        """The summed weight of the unpinned entries: the most one ``evict`` can free."""
        return self._total_weight - self._pinned_weight

    @property
    def pinned_count(self) -> int:
        """How many tracked entries have at least one pin."""
        return self._pinned_count

    def keys(self) -> list[K]:
        """Return the tracked keys, least recently used first (O(n); for inspection)."""
        return list(self._entries)

    def pin_count(self, key: K) -> int:
        """Return how many pins ``key`` holds; StateError when it is not tracked."""
        return self._entry(key, "LRUPolicy.pin_count").pins

    def insert(self, key: K, weight: int = 1) -> None:
        """Start tracking ``key`` as the most recently used entry, unpinned."""
        require_int(weight, owner="LRUPolicy.insert", field="weight", low=1)
        if key in self._entries:
            raise StateError(subject="LRUPolicy.insert", reason=f"key {key!r} is already tracked")
        self._entries[key] = _LRUEntry(weight=weight)
        self._total_weight += weight

    def access(self, key: K) -> None:
        """Make ``key`` the most recently used entry."""
        self._entry(key, "LRUPolicy.access")
        self._entries.move_to_end(key)

    def remove(self, key: K) -> None:
        """Stop tracking ``key`` (pinned or not), which the owner dropped itself."""
        entry = self._entry(key, "LRUPolicy.remove")
        del self._entries[key]
        self._total_weight -= entry.weight
        if entry.pins:
            self._pinned_weight -= entry.weight
            self._pinned_count -= 1

    def pin(self, key: K) -> None:
        """Add one pin to ``key``; its recency is unchanged."""
        entry = self._entry(key, "LRUPolicy.pin")
        entry.pins += 1
        if entry.pins == 1:
            self._pinned_weight += entry.weight
            self._pinned_count += 1

    def unpin(self, key: K) -> None:
        """Drop one pin from ``key``; StateError when it holds none."""
        entry = self._entry(key, "LRUPolicy.unpin")
        if not entry.pins:
            raise StateError(subject="LRUPolicy.unpin", reason=f"key {key!r} is not pinned")
        entry.pins -= 1
        if not entry.pins:
            self._pinned_weight -= entry.weight
            self._pinned_count -= 1

    def evict(self, amount: int) -> list[K]:
        """Stop tracking the least recently used unpinned entries until ``amount`` is freed.

        Returns:
            The victims, least recent first; their weights sum to at least ``amount``, or
            they are every unpinned entry when those weigh less.
        """
        require_int(amount, owner="LRUPolicy.evict", field="amount", low=1)
        victims: list[K] = []
        freed = 0
        if self.evictable_weight:
            for key, entry in self._entries.items():
                if entry.pins:
                    continue
                victims.append(key)
                freed += entry.weight
                if freed >= amount:
                    break
        for key in victims:
            del self._entries[key]
        self._total_weight -= freed
        return victims

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._entries
        except TypeError:  # an unhashable key is never tracked
            return False

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"LRUPolicy(entries={len(self)}, weight={self._total_weight}, "
            f"pinned={self._pinned_count})"
        )

    def _entry(self, key: K, subject: str) -> _LRUEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise _not_tracked(subject, key)
        return entry


def _check_small_ratio(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 0.5:
        raise ConfigError(
            owner="S3FIFOPolicy", field="small_ratio", value=value, reason="must be > 0 and <= 0.5"
        )
    return float(value)


@attrs.define(slots=True)
class _S3Entry:
    weight: int
    pins: int = 0
    freq: int = 0
    in_main: bool = False


class S3FIFOPolicy(Generic[K]):
    """S3-FIFO: a small FIFO filters one-hit entries, a main FIFO keeps reused ones.

    - A new key enters the small queue, or the main queue when the ghost queue still
      remembers it (it was filtered out of small recently). A hit bumps a counter capped
      at 3; nothing moves.
    - Eviction takes from the small queue while it holds at least ``small_ratio`` of the
      capacity, else from main. From small: a head accessed at least once since it was
      inserted moves to main's tail with its counter cleared; otherwise it is evicted and
      its key remembered in the ghost queue. From main: a head with a non-zero counter is
      reinserted at the tail with the counter decremented; otherwise it is evicted.
    - A pinned head is passed over: moved to its queue's tail, counter untouched.
    - The capacity is the highest total weight tracked so far (the owner evicts to stay
      under its cap, so the peak is the cap). The ghost queue remembers keys up to
      ``1 - small_ratio`` of it, by weight, oldest forgotten first (libCacheSim's defaults).

    Args:
        small_ratio: The small queue's share of the capacity, in (0, 0.5].
    """

    def __init__(self, *, small_ratio: float = 0.1) -> None:
        self._small_ratio = _check_small_ratio(small_ratio)
        self._entries: dict[K, _S3Entry] = {}
        # Both queues hold keys, head (next candidate) first; the value is unused.
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._ghost: OrderedDict[K, int] = OrderedDict()  # key -> weight, oldest first
        self._small_weight = 0
        self._main_weight = 0
        self._ghost_weight = 0
        self._small_unpinned = 0
        self._main_unpinned = 0
        self._pinned_weight = 0
        self._pinned_count = 0
        self._peak_weight = 0

    @property
    def name(self) -> str:
        """The registered name, ``"s3fifo"``."""
        return "s3fifo"

    @property
    def small_ratio(self) -> float:
        """The small queue's share of the capacity."""
        return self._small_ratio

    @property
    def total_weight(self) -> int:
        """The summed weight of every tracked entry."""
        return self._small_weight + self._main_weight

    @property
    def evictable_weight(self) -> int:
        """The summed weight of the unpinned entries: the most one ``evict`` can free."""
        return self.total_weight - self._pinned_weight

    @property
    def pinned_count(self) -> int:
        """How many tracked entries have at least one pin."""
        return self._pinned_count

    @property
    def capacity_estimate(self) -> int:
        """The highest total weight tracked so far, taken as the cache's capacity."""
        return self._peak_weight

    def keys(self) -> list[K]:
        """Return the tracked keys: the small queue, then main, heads first (O(n))."""
        return [*self._small, *self._main]

    def ghost_keys(self) -> list[K]:
        """Return the keys the ghost queue remembers, oldest first (O(n))."""
        return list(self._ghost)

    def in_main(self, key: K) -> bool:
        """Return whether ``key`` is in the main queue; StateError when it is not tracked."""
        return self._entry(key, "S3FIFOPolicy.in_main").in_main

    def pin_count(self, key: K) -> int:
        """Return how many pins ``key`` holds; StateError when it is not tracked."""
        return self._entry(key, "S3FIFOPolicy.pin_count").pins

    def insert(self, key: K, weight: int = 1) -> None:
        """Start tracking ``key``: in main when the ghost queue remembers it, else in small."""
        require_int(weight, owner="S3FIFOPolicy.insert", field="weight", low=1)
        if key in self._entries:
            raise StateError(
                subject="S3FIFOPolicy.insert", reason=f"key {key!r} is already tracked"
            )
        ghost_weight = self._ghost.pop(key, None)
        entry = _S3Entry(weight=weight, in_main=ghost_weight is not None)
        if ghost_weight is not None:
            self._ghost_weight -= ghost_weight
        self._entries[key] = entry
        self._enqueue(key, entry)
        self._peak_weight = max(self._peak_weight, self.total_weight)

    def access(self, key: K) -> None:
        """Bump ``key``'s access counter (capped at 3); nothing moves."""
        entry = self._entry(key, "S3FIFOPolicy.access")
        entry.freq = min(entry.freq + 1, _MAX_FREQ)

    def remove(self, key: K) -> None:
        """Stop tracking ``key`` (pinned or not); the ghost queue does not remember it."""
        entry = self._entry(key, "S3FIFOPolicy.remove")
        self._dequeue(key, entry)
        del self._entries[key]
        if entry.pins:
            self._pinned_weight -= entry.weight
            self._pinned_count -= 1

    def pin(self, key: K) -> None:
        """Add one pin to ``key``; its place and counter are unchanged."""
        entry = self._entry(key, "S3FIFOPolicy.pin")
        entry.pins += 1
        if entry.pins == 1:
            self._pinned_weight += entry.weight
            self._pinned_count += 1
            self._count_unpinned(entry, -1)

    def unpin(self, key: K) -> None:
        """Drop one pin from ``key``; StateError when it holds none."""
        entry = self._entry(key, "S3FIFOPolicy.unpin")
        if not entry.pins:
            raise StateError(subject="S3FIFOPolicy.unpin", reason=f"key {key!r} is not pinned")
        entry.pins -= 1
        if not entry.pins:
            self._pinned_weight -= entry.weight
            self._pinned_count -= 1
            self._count_unpinned(entry, +1)

    def evict(self, amount: int) -> list[K]:
        """Run S3-FIFO eviction until ``amount`` is freed or nothing evictable is left.

        Returns:
            The victims in the order they were chosen; their weights sum to at least
            ``amount``, or they are every unpinned entry when those weigh less.
        """
        require_int(amount, owner="S3FIFOPolicy.evict", field="amount", low=1)
        victims: list[K] = []
        freed = 0
        small_target = self._small_ratio * self._peak_weight
        # Terminates: each step evicts, promotes (small -> main), decrements a counter, or
        # passes over a pinned head; a queue is only stepped while it holds an unpinned
        # entry, so pinned heads are passed at most once per sweep of that queue.
        while freed < amount and self._small_unpinned + self._main_unpinned:
            use_small = self._small_unpinned and (
                self._small_weight >= small_target or not self._main_unpinned
            )
            if use_small:
                key, _ = self._small.popitem(last=False)
                entry = self._entries[key]
                if entry.pins:
                    self._small[key] = None
                elif entry.freq >= _MOVE_TO_MAIN_AT:
                    self._small_weight -= entry.weight
                    self._small_unpinned -= 1
                    entry.in_main = True
                    entry.freq = 0
                    self._enqueue(key, entry)
                else:
                    self._small_weight -= entry.weight
                    self._small_unpinned -= 1
                    del self._entries[key]
                    self._remember(key, entry.weight)
                    victims.append(key)
                    freed += entry.weight
            else:
                key, _ = self._main.popitem(last=False)
                entry = self._entries[key]
                if entry.pins:
                    self._main[key] = None
                elif entry.freq:
                    entry.freq -= 1
                    self._main[key] = None
                else:
                    self._main_weight -= entry.weight
                    self._main_unpinned -= 1
                    del self._entries[key]
                    victims.append(key)
                    freed += entry.weight
        return victims

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._entries
        except TypeError:  # an unhashable key is never tracked
            return False

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"S3FIFOPolicy(small={len(self._small)}, main={len(self._main)}, "
            f"ghost={len(self._ghost)}, weight={self.total_weight}, pinned={self._pinned_count})"
        )

    def _entry(self, key: K, subject: str) -> _S3Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise _not_tracked(subject, key)
        return entry

    def _count_unpinned(self, entry: _S3Entry, delta: int) -> None:
        if entry.in_main:
            self._main_unpinned += delta
        else:
            self._small_unpinned += delta

    def _enqueue(self, key: K, entry: _S3Entry) -> None:
        if entry.in_main:
            self._main[key] = None
            self._main_weight += entry.weight
        else:
            self._small[key] = None
            self._small_weight += entry.weight
        if not entry.pins:
            self._count_unpinned(entry, +1)

    def _dequeue(self, key: K, entry: _S3Entry) -> None:
        if entry.in_main:
            del self._main[key]
            self._main_weight -= entry.weight
        else:
            del self._small[key]
            self._small_weight -= entry.weight
        if not entry.pins:
            self._count_unpinned(entry, -1)

    def _remember(self, key: K, weight: int) -> None:
        self._ghost[key] = weight
        self._ghost_weight += weight
        limit = (1.0 - self._small_ratio) * self._peak_weight
        while self._ghost_weight > limit:
            _, forgotten = self._ghost.popitem(last=False)
            self._ghost_weight -= forgotten


_FACTORIES: Final[Mapping[str, Callable[[EvictionConfig], EvictionPolicy[Any]]]] = {
    "lru": lambda config: LRUPolicy(),
    "s3fifo": lambda config: S3FIFOPolicy(small_ratio=config.small_ratio),
}

EVICTION_POLICY_NAMES: Final[tuple[str, ...]] = tuple(_FACTORIES)
"""Every name :func:`make_eviction_policy` accepts."""


@attrs.frozen(kw_only=True)
class EvictionConfig:
    """Which eviction policy a cache uses, and its knobs.

    Attributes:
        name: ``"lru"`` (the default, as SGLang's ``--radix-eviction-policy``) or
            ``"s3fifo"``; any other name is a ConfigError listing these.
        small_ratio: S3-FIFO's small-queue share of the capacity, in (0, 0.5]; default 0.1,
            the paper's. Ignored by ``"lru"``.
    """

    name: EvictionPolicyName = attrs.field(default="lru", validator=one_of(*_FACTORIES))
    small_ratio: float = attrs.field(
        default=0.1, validator=number_in_range(0, 0.5, low_exclusive=True)
    )


def make_eviction_policy(config: EvictionConfig) -> EvictionPolicy[K]:
    """Return a new, empty eviction policy of the kind ``config`` names.

    The key type is the caller's: ``policy: EvictionPolicy[str] = make_eviction_policy(c)``.
    """
    return _FACTORIES[config.name](config)
