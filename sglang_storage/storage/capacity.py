"""Byte accounting and capacity-driven eviction shared by the bounded backends.

A backend keeps one :class:`CapacityIndex` of the objects it holds (key to stored size)
and asks it for room before each write: :meth:`CapacityIndex.reserve` returns the victims
the eviction policy chose, already untracked, which the backend then deletes from its
medium. The policy is handed in by whoever builds the backend (the policy layer sits above
storage); an unbounded index needs none.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Sequence
from typing import Final, Generic, TypeVar

from sglang_storage.core import EvictionPolicy, Namespace, ObjectKey
from sglang_storage.errors import CapacityError, ConfigError

__all__ = ["CapacityIndex", "KeySlots"]

K = TypeVar("K", bound=Hashable)


class CapacityIndex(Generic[K]):
    """Thread-safe key-to-size index with an optional byte cap enforced by eviction.

    Args:
        capacity_bytes: The most bytes held at once, or ``None`` for no cap.
        eviction: Chooses victims when a write needs room; required with a cap.
        owner: Names the backend in errors ("file backend at /data/kv").
    """

    def __init__(
        self,
        capacity_bytes: int | None,
        eviction: EvictionPolicy[K] | None,
        *,
        owner: str,
    ) -> None:
        if capacity_bytes is not None and eviction is None:
            raise ConfigError(
                owner=owner,
                field="eviction",
                reason="a capacity_bytes cap needs an eviction policy to choose victims",
                allowed="an EvictionPolicy, e.g. make_eviction_policy(EvictionConfig(name='lru'))",
            )
        self._capacity = capacity_bytes
        self._policy = eviction
        self._owner = owner
        self._sizes: dict[K, int] = {}
        self._bytes = 0
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int | None:
        """The cap, or ``None``."""
        return self._capacity

    @property
    def bounded(self) -> bool:
        """Whether a cap is enforced."""
        return self._capacity is not None

    def totals(self) -> tuple[int, int]:
        """``(objects, bytes)`` currently indexed."""
        with self._lock:
            return len(self._sizes), self._bytes

    def __contains__(self, key: object) -> bool:
        # One dict lookup is atomic: no lock on the hot path of ``exists``.
        return key in self._sizes

    def size_of(self, key: K) -> int | None:
        """The indexed size of ``key``, or ``None``."""
        with self._lock:
            return self._sizes.get(key)

    def keys(self) -> list[K]:
        """A snapshot of the indexed keys."""
        with self._lock:
            return list(self._sizes)

    def reserve(self, size: int) -> list[K]:
        """Make room for ``size`` more bytes; return the evicted keys (no longer indexed).

        The reservation holds until :meth:`commit` or :meth:`release`.

        Raises:
            CapacityError: ``size`` exceeds the cap, or writes in flight (or objects
                pinned in the policy) leave too little room; nothing was evicted and the
                policy's state (hit counts, order) is as it was.
        """
        with self._lock:
            if self._capacity is None or self._policy is None:
                self._pending += size
                return []
            used = self._bytes + self._pending
            need = used + size - self._capacity
            if size > self._capacity:
                raise CapacityError(
                    resource=f"{self._owner} capacity",
                    requested=size,
                    available=self._capacity,
                    hint="the object is larger than the whole cap; raise capacity_bytes",
                )
            victims: list[K] = []
            if need > 0:
                if need > self._bytes:
                    # Refused before the policy is asked: evicting and putting victims
                    # back would reinsert them as new, wiping their hit history.
                    raise CapacityError(
                        resource=f"{self._owner} capacity",
                        requested=size,
                        available=max(0, self._capacity - self._pending),
                        hint="the rest is reserved by writes in flight",
                    )
                victims = self._evict_locked(need, size)
            self._pending += size
            return victims

    def _evict_locked(self, need: int, size: int) -> list[K]:
        """Untrack victims until ``need`` bytes are freed (``need`` <= indexed bytes).

        The policy weighs an entry by the size it was inserted with, which a replacement
        may have changed, so it is asked again until the indexed sizes cover ``need``.

        Raises:
            CapacityError: entries pinned in the policy leave too little to evict; the
                victims are indexed again (as new entries) and nothing is evicted.
        """
        assert self._policy is not None
        assert self._capacity is not None
        evicted: dict[K, int] = {}
        freed = 0
        while freed < need:
            batch = self._policy.evict(need - freed)
            if not batch:
                break
            for victim in batch:
                evicted[victim] = self._sizes.pop(victim)
                freed += evicted[victim]
        self._bytes -= freed
        if freed < need:
            # Only entries pinned through the policy itself get here (the index pins none).
            for victim, victim_size in evicted.items():
                self._add_locked(victim, victim_size)
            raise CapacityError(
                resource=f"{self._owner} capacity",
                requested=size,
                available=max(0, self._capacity - self._bytes - self._pending),
                hint="the rest is pinned or reserved by writes in flight",
            )
        return list(evicted)

    def release(self, size: int) -> None:
        """Give back a reservation whose write failed."""
        with self._lock:
            self._pending -= size

    def commit(self, key: K, size: int) -> None:
        """Turn a reservation into an indexed object (replacing ``key``'s old size)."""
        with self._lock:
            self._pending -= size
            self._add_locked(key, size)

    def add(self, key: K, size: int) -> None:
        """Index an object found on the medium (no reservation; may exceed the cap)."""
        with self._lock:
            self._add_locked(key, size)

    def add_many(self, items: Iterable[tuple[K, int]]) -> None:
        """:meth:`add` each ``(key, size)``, in order."""
        with self._lock:
            if self._policy is not None:
                for key, size in items:
                    self._add_locked(key, size)
                return
            # As add() in order: the last size of a key counts; in C, not per key here.
            new = dict(items)
            sizes = self._sizes
            replaced = sum(sizes[key] for key in sizes.keys() & new.keys()) if sizes else 0
            sizes.update(new)
            self._bytes += sum(new.values()) - replaced

    def _add_locked(self, key: K, size: int) -> None:
        old = self._sizes.get(key)
        self._sizes[key] = size
        self._bytes += size - (old or 0)
        if self._policy is not None:
            if old is None:
                self._policy.insert(key, max(size, 1))
            else:
                self._policy.access(key)

    def access(self, key: K) -> None:
        """Record a hit on ``key`` for the eviction policy."""
        if self._policy is None:
            return
        with self._lock:
            if key in self._sizes:
                self._policy.access(key)

    def touch(self, key: K, size: int | None) -> None:
        """Record a hit on ``key``; index it with ``size`` if it was not indexed.

        An unindexed key is an object another process stored; ``size=None`` only records
        the hit.
        """
        if self._policy is None and key in self._sizes:
            return  # nothing to record; a dict read needs no lock
        with self._lock:
            if key in self._sizes:
                if self._policy is not None:
                    self._policy.access(key)
            elif size is not None:
                self._add_locked(key, size)

    def remove(self, key: K) -> bool:
        """Stop indexing ``key``; returns whether it was indexed."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is None:
                return False
            self._bytes -= size
            if self._policy is not None:
                self._policy.remove(key)
            return True

    def over_capacity(self) -> list[K]:
        """Evict until within the cap (after indexing a medium larger than it)."""
        with self._lock:
            if self._capacity is None or self._policy is None:
                return []
            need = self._bytes - self._capacity
            if need <= 0:
                return []
            victims = self._policy.evict(need)
            self._bytes -= sum(self._sizes.pop(v) for v in victims)
            return victims


_TEXT: Final = 1 << 31
"""Set in a slot's namespace number when the name is stored as UTF-8, not as hex digits."""
_NAMESPACES_MAX: Final = _TEXT - 1


class KeySlots:
    """Each :class:`~sglang_storage.core.ObjectKey` as one compact ``bytes``, and back.

    A slot is a 4-byte number of the key's namespace (numbered on first sight, per
    instance) followed by the name: its bytes when the name is lowercase hex digits (a
    page hash: 32 bytes for 64 digits), else its UTF-8 with a flag in the number. Distinct
    keys have distinct slots, and :meth:`key` rebuilds the key from its slot. Thread-safe.
    """

    def __init__(self) -> None:
        self._prefixes: dict[str, tuple[bytes, bytes]] = {}
        self._namespaces: list[Namespace] = []
        self._lock = threading.Lock()

    def slot(self, key: ObjectKey) -> bytes:
        """The slot of ``key``."""
        prefixes = self._prefixes.get(key.namespace.path)
        if prefixes is None:
            prefixes = self._number(key.namespace)
        name = key.name
        try:
            raw = bytes.fromhex(name)
        except ValueError:
            return prefixes[1] + name.encode()
        # fromhex also takes uppercase digits (and whitespace, which no name holds).
        return prefixes[0] + raw if raw.hex() == name else prefixes[1] + name.encode()

    def name_slots(self, namespace: Namespace, names: Sequence[str]) -> list[bytes]:
        """``[slot(namespace.key(name)) for name in names]`` for names already checked."""
        prefixes = self._prefixes.get(namespace.path)
        if prefixes is None:
            prefixes = self._number(namespace)
        digits, text = prefixes
        fromhex = bytes.fromhex
        out = []
        for name in names:
            try:
                raw = fromhex(name)
            except ValueError:
                out.append(text + name.encode())
                continue
            out.append(digits + raw if raw.hex() == name else text + name.encode())
        return out

    def key(self, slot: bytes) -> ObjectKey:
        """The key whose slot ``slot`` is.

        Raises:
            KeyError: ``slot`` is no slot of this instance.
        """
        number = int.from_bytes(slot[:4], "big")
        try:
            namespace = self._namespaces[number & ~_TEXT]
        except IndexError:
            raise KeyError(slot) from None
        name = slot[4:].decode() if number & _TEXT else slot[4:].hex()
        return ObjectKey(namespace=namespace, name=name)

    def prefixes(self, namespace: Namespace) -> tuple[bytes, bytes] | None:
        """How every slot of ``namespace`` starts (hex names, other names); None if unseen."""
        return self._prefixes.get(namespace.path)

    def _number(self, namespace: Namespace) -> tuple[bytes, bytes]:
        with self._lock:
            prefixes = self._prefixes.get(namespace.path)
            if prefixes is None:
                number = len(self._namespaces)
                if number > _NAMESPACES_MAX:
                    raise CapacityError(
                        resource="namespaces of one key index",
                        requested=number + 1,
                        available=_NAMESPACES_MAX,
                        hint="reopen the backend",
                    )
                self._namespaces.append(namespace)
                prefixes = (number.to_bytes(4, "big"), (number | _TEXT).to_bytes(4, "big"))
                self._prefixes[namespace.path] = prefixes
            return prefixes
