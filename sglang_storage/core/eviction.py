"""The eviction interface: what a bounded cache needs from an eviction policy.

Declared here, below every layer that owns a cache (host pools, the file backend's
capacity cap, the embedding cache); implemented in :mod:`sglang_storage.policy`; whoever
builds a cache hands it one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, TypeVar

__all__ = ["EvictionPolicy"]


K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol[K]):
    """Chooses which entries of a bounded cache to give up, by key only.

    The owner of the cache tells the policy what happens to its entries; the policy never
    sees the stored data. Every entry has a positive integer weight (1 for a slot, a byte
    count for a file), and a pin count: an entry with pins is never chosen as a victim.

    Contract, one line per primitive:

    - ``insert(key, weight)`` - start tracking a new, unpinned entry.
    - ``access(key)`` - the entry was used (a hit); it informs future choices.
    - ``remove(key)`` - the owner dropped the entry itself; stop tracking it.
    - ``pin(key)`` / ``unpin(key)`` - add / drop one pin; pinned entries are never evicted.
    - ``evict(amount)`` - choose victims, in eviction order, whose weights sum to at least
      ``amount`` (all evictable entries when they weigh less); they are no longer tracked.
    - ``__contains__`` / ``__len__`` - whether a key is tracked / how many are.

    Mutations return ``None`` and raise :class:`~sglang_storage.errors.StateError` when
    the state forbids them (inserting a tracked key; touching, removing or pinning an
    untracked one; unpinning an unpinned one) and :class:`~sglang_storage.errors.ConfigError`
    for a bad argument (a weight or amount that is not a positive int). A refused call
    changes nothing. Policies are not thread-safe: the owner serialises calls.
    """

    @property
    def name(self) -> str:
        """The policy's registered name ("lru", "s3fifo", ...)."""
        ...

    def insert(self, key: K, weight: int = 1) -> None:
        """Start tracking ``key`` with ``weight``; it is unpinned and may be evicted."""
        ...

    def access(self, key: K) -> None:
        """Record a use of ``key``."""
        ...

    def remove(self, key: K) -> None:
        """Stop tracking ``key``, which the owner dropped on its own."""
        ...

    def pin(self, key: K) -> None:
        """Add one pin to ``key``: it cannot be evicted until every pin is dropped."""
        ...

    def unpin(self, key: K) -> None:
        """Drop one pin from ``key``."""
        ...

    def evict(self, amount: int) -> list[K]:
        """Choose and stop tracking victims whose weights sum to at least ``amount``.

        Returns fewer (possibly none) when the unpinned entries weigh less than ``amount``.
        """
        ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...
