"""Agreement between ranks that never hangs: the MIN of one integer over every rank, or None.

SGLang's HiCache all-reduces MIN over its TP/PP/CP groups (storage hit counts, prefetch
progress) and a rank that never joins a collective hangs every other rank (anchors section 3
item 6). Managers here agree through :class:`RankSync` instead. Contract:

- ``agree_min(op, value, timeout_s=...)`` - every rank calls it with the same ``op`` name,
  in the same order per name (as for a collective); it returns the minimum of the values
  of all ranks, or ``None`` when not every rank answered within ``timeout_s``. The answer
  is the same on every rank: ``None`` on one rank means ``None`` on all, including a rank
  that arrives after the others gave up. A caller treats ``None`` as a miss.
- :class:`SingleRank` - one rank: the value itself.
- :class:`StoreRankSync` - ranks of several processes over a ``torch.distributed`` store
  (``TCPStore`` on loopback or the cluster network); no process group, no collective.
- ``propose(op, value, timeout_s=...)`` (:class:`ProposingRankSync`) - the same agreement
  without waiting: it returns a :class:`Proposal` whose ``poll()`` is ``None`` while the
  other ranks have not answered and the bound has not passed, then an :class:`Agreement`
  (the MIN, or ``value=None`` when abandoned), the same on every rank. A scheduler thread
  drives agreements this way and never blocks on another rank.

How :class:`StoreRankSync` decides, for the ``n``-th call of ``op`` (its key prefix):
every rank writes its value and counts itself in; the rank that completes the count writes
the minimum into the op's single ``outcome`` key, the others wait for that key (inside the
store, no polling), and a rank whose bound passes writes ``abandoned`` there instead. Both
writes are compare-and-set on an absent key, so the first one wins and every rank (a late one
too) returns what the ``outcome`` key holds. The last rank to read the outcome deletes the
op's keys; an abandoned op whose missing rank never arrives keeps its few small keys, so that
rank still reads ``abandoned`` if it comes later. One store client per rank: a client blocked
in ``wait`` serves no other caller.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Final, Protocol, runtime_checkable

import attrs

from sglang_storage.config import require_int
from sglang_storage.errors import ConfigError

__all__ = [
    "ABANDONED",
    "Agreement",
    "KeyValueStore",
    "Proposal",
    "ProposingRankSync",
    "RankSync",
    "SingleRank",
    "StoreRankSync",
]

ABANDONED: Final = "abandoned"
"""What the outcome key of an op holds when some rank did not answer in time."""

_OP = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@runtime_checkable
class RankSync(Protocol):
    """Bounded agreement of the ranks that share one cache (TP, PP and CP ranks)."""

    @property
    def rank(self) -> int:
        """This rank's number, ``0 .. world_size - 1``."""
        ...

    @property
    def world_size(self) -> int:
        """How many ranks take part."""
        ...

    def agree_min(self, op: str, value: int, *, timeout_s: float) -> int | None:
        """The minimum of ``value`` over every rank, or None when some rank did not answer.

        Args:
            op: The operation's name (``"storage_hit"``); calls are matched across ranks
                by name and by their order among calls with that name.
            value: This rank's value (an int >= 0).
            timeout_s: How long to wait for the other ranks.
        """
        ...


@attrs.frozen
class Agreement:
    """What the ranks agreed for one proposal: the MIN, or None when some rank was late."""

    value: int | None


class Proposal(Protocol):
    """One rank's value in an agreement that is still being decided."""

    def poll(self) -> Agreement | None:
        """The agreement once decided (the same on every rank), else None; never blocks."""
        ...


@runtime_checkable
class ProposingRankSync(RankSync, Protocol):
    """A :class:`RankSync` that also agrees without blocking the caller."""

    def propose(self, op: str, value: int, *, timeout_s: float) -> Proposal:
        """Offer ``value`` for the next agreement named ``op``; decided by ``poll()``.

        Calls are matched across ranks by ``op`` and their order, as for ``agree_min``
        (the two share neither names nor order: use distinct op names for each).
        """
        ...


@attrs.frozen
class _Decided:
    agreement: Agreement

    def poll(self) -> Agreement | None:
        return self.agreement


def _check(op: object, value: object, timeout_s: object, owner: str) -> None:
    if not isinstance(op, str) or not _OP.fullmatch(op):
        raise ConfigError(
            owner=owner,
            field="op",
            value=op,
            reason="is not an op name",
            allowed="1-64 of A-Z a-z 0-9 _ . : -",
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(owner=owner, field="value", value=value, reason="must be an int >= 0")
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s < 0
    ):
        raise ConfigError(
            owner=owner, field="timeout_s", value=timeout_s, reason="must be a finite number >= 0"
        )


class KeyValueStore(Protocol):
    """What :class:`StoreRankSync` uses of a ``torch.distributed.Store`` (``TCPStore``)."""

    def set(self, key: str, value: str) -> None:
        """Store ``value`` under ``key``."""

    def get(self, key: str) -> bytes:
        """The value of an existing ``key``."""
        ...

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (created at 0); return the new value."""
        ...

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` exists."""
        ...

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        """Set ``key`` when it holds ``expected_value`` (``""``: when absent); return its value."""
        ...

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Block until every one of ``keys`` exists; raise ``RuntimeError`` after ``timeout``."""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of existing ``keys``."""
        ...

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        ...


class SingleRank:
    """The only rank: every agreement is the rank's own value."""

    rank = 0
    world_size = 1

    def agree_min(self, op: str, value: int, *, timeout_s: float) -> int | None:
        """Return ``value`` (after checking the arguments as every rank sync does)."""
        _check(op, value, timeout_s, "SingleRank.agree_min")
        return value

    def propose(self, op: str, value: int, *, timeout_s: float) -> Proposal:
        """An agreement decided at once: ``value`` itself."""
        _check(op, value, timeout_s, "SingleRank.propose")
        return _Decided(Agreement(value))


class StoreRankSync:
    """Agreement over a ``torch.distributed`` key-value store; see the module docstring.

    Args:
        store: A store every rank reaches: a ``torch.distributed.TCPStore`` (or a
            ``PrefixStore`` over one).
        rank: This rank, ``0 .. world_size - 1``.
        world_size: The number of ranks.
        prefix: Keeps these keys apart from other users of the same store.

    A store call that fails (the store's server is gone) makes that call's answer None on
    this rank; the other ranks then see this rank as not answering.
    """

    def __init__(
        self, store: KeyValueStore, *, rank: int, world_size: int, prefix: str = "ranksync"
    ) -> None:
        require_int(world_size, owner="StoreRankSync", field="world_size", low=1)
        if require_int(rank, owner="StoreRankSync", field="rank") >= world_size:
            raise ConfigError(
                owner="StoreRankSync",
                field="rank",
                value=rank,
                reason="is out of range",
                allowed=f"0 .. {world_size - 1}",
            )
        self._store = store
        self._rank = rank
        self._world = world_size
        self._prefix = prefix
        self._calls: Counter[str] = Counter()

    @property
    def rank(self) -> int:
        """This rank's number."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many ranks take part."""
        return self._world

    def agree_min(self, op: str, value: int, *, timeout_s: float) -> int | None:
        """The minimum of ``value`` over every rank within ``timeout_s``, else None on all."""
        _check(op, value, timeout_s, "StoreRankSync.agree_min")
        self._calls[op] += 1
        base = f"{self._prefix}/{op}/{self._calls[op]}"
        try:
            outcome = self._decide(base, value, time.monotonic() + timeout_s)
            self._finish(base)
        except (RuntimeError, OSError, ValueError):
            # DistStoreError / DistNetworkError derive from RuntimeError.
            return None
        return None if outcome == ABANDONED else int(outcome)

    def propose(self, op: str, value: int, *, timeout_s: float) -> Proposal:
        """Offer ``value`` for the next ``op`` agreement; ``poll()`` the result (no waiting).

        The rank that completes the count decides at once; the others learn the outcome
        when they poll, or abandon it when they poll after the bound.
        """
        _check(op, value, timeout_s, "StoreRankSync.propose")
        self._calls[op] += 1
        base = f"{self._prefix}/{op}/{self._calls[op]}"
        proposal = _StoreProposal(self._store, self._finish, base, time.monotonic() + timeout_s)
        try:
            store, outcome_key = self._store, f"{base}/outcome"
            if not store.check([outcome_key]):
                store.set(f"{base}/v{self._rank}", str(value))
                if store.add(f"{base}/n", 1) == self._world:
                    values = store.multi_get([f"{base}/v{r}" for r in range(self._world)])
                    store.compare_set(outcome_key, "", str(min(int(v) for v in values)))
        except (RuntimeError, OSError, ValueError):
            proposal.settle(None)
        return proposal

    def _decide(self, base: str, value: int, deadline: float) -> str:
        store, outcome_key = self._store, f"{base}/outcome"
        if store.check([outcome_key]):  # late: the others decided (or gave up) already
            return store.get(outcome_key).decode()
        store.set(f"{base}/v{self._rank}", str(value))
        if store.add(f"{base}/n", 1) == self._world:  # the last to count in decides
            values = store.multi_get([f"{base}/v{r}" for r in range(self._world)])
            return store.compare_set(outcome_key, "", str(min(int(v) for v in values))).decode()
        remaining = deadline - time.monotonic()
        if remaining > 0:
            try:  # blocks in the store's server, no polling; raises at the bound
                store.wait([outcome_key], timedelta(seconds=remaining))
                return store.get(outcome_key).decode()
            except RuntimeError:
                pass
        return store.compare_set(outcome_key, "", ABANDONED).decode()

    def _finish(self, base: str) -> None:
        """Count this rank out; the last of all ranks deletes the op's keys."""
        if self._store.add(f"{base}/done", 1) < self._world:
            return
        for key in (*(f"{base}/v{r}" for r in range(self._world)), f"{base}/n", f"{base}/done"):
            self._store.delete_key(key)
        self._store.delete_key(f"{base}/outcome")


class _StoreProposal:
    """A :meth:`StoreRankSync.propose` in progress."""

    def __init__(
        self, store: KeyValueStore, finish: Callable[[str], None], base: str, deadline: float
    ) -> None:
        self._store = store
        self._finish = finish
        self._base = base
        self._deadline = deadline
        self._agreement: Agreement | None = None

    def settle(self, value: int | None) -> None:
        self._agreement = Agreement(value)

    def poll(self) -> Agreement | None:
        if self._agreement is not None:
            return self._agreement
        store, outcome_key = self._store, f"{self._base}/outcome"
        try:
            if store.check([outcome_key]):
                outcome = store.get(outcome_key).decode()
            elif time.monotonic() >= self._deadline:
                outcome = store.compare_set(outcome_key, "", ABANDONED).decode()
            else:
                return None
            self._finish(self._base)
        except (RuntimeError, OSError, ValueError):
            outcome = ABANDONED
        self.settle(None if outcome == ABANDONED else int(outcome))
        return self._agreement
