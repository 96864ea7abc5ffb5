"""One host memory budget for the whole process, reserved per data kind.

Contract, one line per primitive:

- :func:`read_memory_facts` - the machine's physical and available memory, bounded by the
  cgroup (v2 or v1) limit the process runs under.
- :class:`HostMemoryBudget` - built from a :class:`BudgetConfig`; refuses at construction,
  with the numbers, a budget the machine cannot hold.
- ``acquire(kind, nbytes, label)`` - take bytes for ``kind``: from its reservation first,
  then by borrowing unreserved space; :class:`CapacityError` (with the numbers) when
  neither has room. Returns a :class:`Lease`.
- ``Lease.release()`` - give the bytes back (once; a second release is a StateError).
- ``stats()`` - :class:`BudgetStats`: per kind reserved, used and borrowed bytes.

A kind never borrows another kind's reservation, so a reservation is a guarantee: the KV
pool cannot starve the embedding cache of the space it was promised, and vice versa.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Final, Self

import attrs

from sglang_storage.config import (
    BYTES,
    instance_of,
    non_empty_str,
    non_negative_int,
    optional,
    positive_int,
    require_int,
)
from sglang_storage.core import DataKind
from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.units import format_bytes

__all__ = [
    "BudgetConfig",
    "BudgetStats",
    "HostMemoryBudget",
    "KindUsage",
    "Lease",
    "MemoryFacts",
    "read_memory_facts",
]

_MEMINFO: Final = Path("/proc/meminfo")
_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
_NO_LIMIT: Final = 1 << 62  # cgroup v1 reports "no limit" as a huge page-rounded number


@attrs.frozen(kw_only=True)
class MemoryFacts:
    """What the machine offers this process, in bytes."""

    physical: int = attrs.field(validator=non_negative_int)
    """Installed memory (MemTotal)."""
    available: int = attrs.field(validator=non_negative_int)
    """Memory that can be allocated now without swapping (MemAvailable)."""
    cgroup_limit: int | None = attrs.field(default=None, validator=optional(non_negative_int))
    """The cgroup's memory limit, or None when the process runs without one."""
    cgroup_usage: int = attrs.field(default=0, validator=non_negative_int)
    """What the cgroup already uses (counts against ``cgroup_limit``)."""

    @property
    def usable(self) -> int:
        """Bytes this process may still take: available memory, within the cgroup limit."""
        if self.cgroup_limit is None:
            return self.available
        return max(0, min(self.available, self.cgroup_limit - self.cgroup_usage))

    def describe(self) -> str:
        """The facts as one line for error messages."""
        text = f"physical {format_bytes(self.physical)}, available {format_bytes(self.available)}"
        if self.cgroup_limit is not None:
            text += (
                f", cgroup limit {format_bytes(self.cgroup_limit)}"
                f" of which {format_bytes(self.cgroup_usage)} in use"
            )
        return text


def _meminfo_bytes(text: str, field: str) -> int:
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            number, _, unit = rest.strip().partition(" ")
            return int(number) * (1024 if unit.strip() == "kB" else 1)
    raise OSError(f"{field} is missing from {_MEMINFO}")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    return int(text)


def _cgroup_paths() -> list[Path]:
    """Directories of this process's cgroup, v2 first, then v1's memory controller."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[Path] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            found += [_CGROUP_ROOT / relative, _CGROUP_ROOT]
        elif "memory" in controllers.split(","):
            found += [_CGROUP_ROOT / "memory" / relative, _CGROUP_ROOT / "memory"]
    return found


def read_memory_facts() -> MemoryFacts:
    """Read the machine's memory and this process's cgroup limit (v2, then v1)."""
    text = _MEMINFO.read_text()
    physical = _meminfo_bytes(text, "MemTotal")
    available = _meminfo_bytes(text, "MemAvailable")
    for directory in _cgroup_paths():
        for limit_name, usage_name in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            limit = _read_int(directory / limit_name)
            if limit is not None and limit < _NO_LIMIT and limit < physical:
                usage = _read_int(directory / usage_name) or 0
                return MemoryFacts(
                    physical=physical, available=available, cgroup_limit=limit, cgroup_usage=usage
                )
    return MemoryFacts(physical=physical, available=available)


@attrs.frozen(kw_only=True)
class BudgetConfig:
    """The process's host memory budget and how it is reserved per data kind.

    The reservations must fit in ``total``; what they leave is unreserved space that any
    kind may borrow once its own reservation is used up.
    """

    total: int = attrs.field(metadata=BYTES, validator=non_negative_int)
    """Bytes of host memory the whole process may use for pools."""
    kv: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for KV cache pages."""
    embedding: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for encoder embeddings."""
    record: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for fixed-shape records."""
    weight: int = attrs.field(default=0, metadata=BYTES, validator=non_negative_int)
    """Bytes reserved for weight blobs."""
    headroom: int = attrs.field(default=2 << 30, metadata=BYTES, validator=non_negative_int)
    """Bytes that must stay available to the rest of the process and the system."""
    ranks_per_host: int = attrs.field(default=1, validator=positive_int)
    """Processes on this host that each take a budget of this size (TP ranks); the
    start-up check makes sure the host holds all of them."""

    def __attrs_post_init__(self) -> None:
        reserved = sum(self.reservations().values())
        if reserved > self.total:
            raise ConfigError(
                owner=type(self).__name__,
                field="kv, embedding, record, weight",
                value=f"{format_bytes(reserved)} reserved in all",
                reason=f"the reservations must fit in total ({format_bytes(self.total)})",
            )

    def reservations(self) -> Mapping[DataKind, int]:
        """Reserved bytes per data kind."""
        return MappingProxyType(
            {
                DataKind.KV: self.kv,
                DataKind.EMBEDDING: self.embedding,
                DataKind.RECORD: self.record,
                DataKind.WEIGHT: self.weight,
            }
        )


@attrs.frozen(kw_only=True)
class KindUsage:
    """One data kind's share of the budget, in bytes."""

    reserved: int
    """Bytes set aside for this kind."""
    used: int
    """Bytes this kind holds now, from its reservation and borrowed."""
    borrowed: int
    """The part of ``used`` taken from unreserved space."""


@attrs.frozen(kw_only=True)
class BudgetStats:
    """A snapshot of the budget."""

    total: int
    """The budget, in bytes."""
    unreserved: int
    """Bytes not reserved for any kind."""
    unreserved_free: int
    """Unreserved bytes nobody has borrowed."""
    kinds: Mapping[DataKind, KindUsage]
    """Usage per kind."""

    @property
    def used(self) -> int:
        """Bytes held across all kinds."""
        return sum(usage.used for usage in self.kinds.values())


@attrs.define(eq=False)
class Lease:
    """Bytes taken from a :class:`HostMemoryBudget`; give them back with :meth:`release`."""

    kind: DataKind = attrs.field(validator=instance_of(DataKind))
    nbytes: int = attrs.field(validator=non_negative_int)
    label: str = attrs.field(validator=non_empty_str)
    borrowed: int = attrs.field(validator=non_negative_int)
    _give_back: Callable[[Lease], None] = attrs.field(repr=False)
    released: bool = attrs.field(default=False, init=False)

    def release(self) -> None:
        """Give the bytes back to the budget.

        Raises:
            StateError: the lease was already released.
        """
        self._give_back(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.released:
            self.release()


class HostMemoryBudget:
    """The process-wide host memory budget, with per-kind reservations and borrowing.

    Args:
        config: The budget and its reservations.
        facts: The machine's memory; read from the system when omitted.

    Raises:
        CapacityError: ``config.total`` exceeds this process's share of the memory the
            host can give (available memory within the cgroup limit, less the headroom,
            divided by ``ranks_per_host``).
    """

    def __init__(self, config: BudgetConfig, *, facts: MemoryFacts | None = None) -> None:
        self._config = config
        self._facts = facts if facts is not None else read_memory_facts()
        usable = self._facts.usable
        ranks = config.ranks_per_host
        per_rank = max(0, usable - config.headroom) // ranks
        if config.total > per_rank:
            shared = f", shared by {ranks} ranks on this host" if ranks > 1 else ""
            raise CapacityError(
                resource="host memory budget",
                requested=config.total,
                available=per_rank,
                hint=(
                    f"the machine has {self._facts.describe()}; with "
                    f"{format_bytes(config.headroom)} kept as headroom at most "
                    f"{format_bytes(per_rank)} can be budgeted per process{shared}. "
                    "Lower the budget (or --hicache-ratio/--hicache-size) or the headroom"
                ),
            )
        self._reserved = dict(config.reservations())
        self._unreserved = config.total - sum(self._reserved.values())
        self._used = dict.fromkeys(DataKind, 0)
        self._borrowed = dict.fromkeys(DataKind, 0)
        self._lock = threading.Lock()

    @property
    def config(self) -> BudgetConfig:
        """The configuration the budget was built from."""
        return self._config

    @property
    def facts(self) -> MemoryFacts:
        """The machine's memory as read at construction."""
        return self._facts

    def available(self, kind: DataKind) -> int:
        """Bytes ``kind`` can acquire now: what is left of its reservation plus free unreserved."""
        with self._lock:
            return self._available(kind)

    def acquire(self, kind: DataKind, nbytes: int, *, label: str) -> Lease:
        """Take ``nbytes`` for ``kind``, from its reservation first, then unreserved space.

        Args:
            kind: The data kind the bytes are for.
            nbytes: How many bytes (>= 0).
            label: What they are for, shown in errors and stats ("KV host pool").

        Raises:
            ConfigError: ``nbytes`` is not an int >= 0, or ``kind`` is not a DataKind.
            CapacityError: ``kind`` cannot get that many bytes; nothing was taken.
        """
        if not isinstance(kind, DataKind):
            raise ConfigError(
                owner="HostMemoryBudget.acquire",
                field="kind",
                value=kind,
                reason="must be a DataKind",
                allowed=", ".join(k.value for k in DataKind),
            )
        require_int(nbytes, owner="HostMemoryBudget.acquire", field="nbytes")
        if not label.strip():
            raise ConfigError(
                owner="HostMemoryBudget.acquire",
                field="label",
                value=label,
                reason="must be a non-empty str",
            )
        with self._lock:
            available = self._available(kind)
            if nbytes > available:
                raise CapacityError(
                    resource=f"host memory budget for {kind.value} ({label})",
                    requested=nbytes,
                    available=available,
                    hint=self._shortage_hint(kind),
                )
            own_left = max(0, self._reserved[kind] - self._used[kind])
            borrowed = max(0, nbytes - own_left)
            self._used[kind] += nbytes
            self._borrowed[kind] = max(0, self._used[kind] - self._reserved[kind])
        return Lease(
            kind=kind, nbytes=nbytes, label=label, borrowed=borrowed, give_back=self._release
        )

    @contextmanager
    def leased(self, kind: DataKind, nbytes: int, *, label: str) -> Iterator[Lease]:
        """Acquire for the duration of a ``with`` block."""
        lease = self.acquire(kind, nbytes, label=label)
        with lease:
            yield lease

    def stats(self) -> BudgetStats:
        """A snapshot of reservations and use per kind."""
        with self._lock:
            kinds = {
                kind: KindUsage(
                    reserved=self._reserved[kind],
                    used=self._used[kind],
                    borrowed=self._borrowed[kind],
                )
                for kind in DataKind
            }
            return BudgetStats(
                total=self._config.total,
                unreserved=self._unreserved,
                unreserved_free=self._unreserved - sum(self._borrowed.values()),
                kinds=MappingProxyType(kinds),
            )

    def _available(self, kind: DataKind) -> int:
        own_left = max(0, self._reserved[kind] - self._used[kind])
        return own_left + self._unreserved - sum(self._borrowed.values())

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease.released:
                raise StateError(
                    subject=f"host memory lease {lease.label!r}", reason="was already released"
                )
            lease.released = True
            self._used[lease.kind] -= lease.nbytes
            # A kind's use beyond its reservation is what it borrows.
            self._borrowed[lease.kind] = max(0, self._used[lease.kind] - self._reserved[lease.kind])

    def _shortage_hint(self, kind: DataKind) -> str:
        reserved = self._reserved[kind]
        used = self._used[kind]
        free_shared = self._unreserved - sum(self._borrowed.values())
        return (
            f"{kind.value} has used {format_bytes(used)} of its {format_bytes(reserved)} "
            f"reservation and {format_bytes(free_shared)} of {format_bytes(self._unreserved)} "
            "unreserved space is free; raise the budget or this kind's reservation"
        )
