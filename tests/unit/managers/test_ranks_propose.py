"""Non-blocking rank agreement: ``StoreRankSync.propose`` over a real ``TCPStore``.

Each rank has its own store client (as each rank's process would) on a loopback
``torch.distributed.TCPStore`` server on a free port; ranks run as threads or are driven
in turn from the test. Checked: the MIN on every rank, ``Agreement(None)`` on every rank
(a late one too) when a rank stays away past the bound, ``poll()`` returning at once while
undecided, matching by op name and order, and the op's keys removed once every rank polled.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import TCPStore

from sglang_storage.errors import ConfigError
from sglang_storage.managers.ranks import (
    ABANDONED,
    Agreement,
    Proposal,
    ProposingRankSync,
    SingleRank,
    StoreRankSync,
)

WAIT_S = 10.0


def make_store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def syncs(store: TCPStore, world: int) -> list[StoreRankSync]:
    """One sync per rank, each over its own client connection to ``store``'s server."""
    return [
        StoreRankSync(
            TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=10)),
            rank=r,
            world_size=world,
        )
        for r in range(world)
    ]


def leftovers(store: TCPStore, base: str, world: int) -> list[str]:
    names = [*(f"v{r}" for r in range(world)), "n", "done", "outcome"]
    return [name for name in names if store.check([f"{base}/{name}"])]


def settle(proposal: Proposal, timeout_s: float = WAIT_S) -> Agreement:
    """Poll until decided (a bounded loop: a proposal that never decides fails the test)."""
    deadline = time.monotonic() + timeout_s
    while (agreement := proposal.poll()) is None:
        assert time.monotonic() < deadline, "the proposal never decided"
        time.sleep(0.002)
    return agreement


def test_store_and_single_rank_sync_are_proposing() -> None:
    store = make_store()
    assert isinstance(syncs(store, 1)[0], ProposingRankSync)
    assert isinstance(SingleRank(), ProposingRankSync)
    assert SingleRank().propose("hit", 5, timeout_s=0.1).poll() == Agreement(5)
    sync = syncs(store, 2)[0]
    with pytest.raises(ConfigError, match="value"):
        sync.propose("hit", -1, timeout_s=1.0)
    with pytest.raises(ConfigError, match="op"):
        sync.propose("a b", 1, timeout_s=1.0)
    with pytest.raises(ConfigError, match="timeout_s"):
        sync.propose("hit", 1, timeout_s=float("inf"))


def test_three_threads_agree_on_the_minimum_and_clean_up() -> None:
    store = make_store()
    ranks = syncs(store, 3)
    values = {0: [7, 1, 4], 1: [3, 8, 4], 2: [5, 6, 0]}
    results: dict[int, list[Agreement]] = {}
    start = threading.Barrier(3)

    def run(rank: int) -> None:
        start.wait(WAIT_S)
        results[rank] = [
            settle(ranks[rank].propose("hit", value, timeout_s=5.0)) for value in values[rank]
        ]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert not any(thread.is_alive() for thread in threads)
    expected = [Agreement(3), Agreement(1), Agreement(0)]
    assert results == {0: expected, 1: expected, 2: expected}
    for n in (1, 2, 3):
        assert leftovers(store, f"ranksync/hit/{n}", 3) == []


def test_a_rank_that_never_proposes_is_none_on_all_after_the_bound() -> None:
    store = make_store()
    a, b, late = syncs(store, 3)
    started = time.monotonic()
    pa = a.propose("hit", 4, timeout_s=0.3)
    pb = b.propose("hit", 2, timeout_s=0.3)
    assert pa.poll() is None
    assert pb.poll() is None
    assert settle(pa) == Agreement(None)
    elapsed = time.monotonic() - started
    assert settle(pb) == Agreement(None)
    assert 0.3 <= elapsed < 0.3 + 1.5
    assert store.get("ranksync/hit/1/outcome").decode() == ABANDONED
    # The missing rank arrives long after: its own value is not the answer, None is, at once.
    pl = late.propose("hit", 0, timeout_s=5.0)
    began = time.monotonic()
    assert pl.poll() == Agreement(None)
    assert time.monotonic() - began < 0.5
    assert leftovers(store, "ranksync/hit/1", 3) == []  # every rank polled: cleaned up
    # The next op of that name agrees again, on every rank.
    proposals = [s.propose("hit", v, timeout_s=5.0) for s, v in ((a, 9), (b, 6), (late, 8))]
    assert [settle(p) for p in proposals] == [Agreement(6)] * 3


def test_a_rank_late_past_the_bound_before_anyone_polled_still_gets_none() -> None:
    store = make_store()
    early, late = syncs(store, 2)
    pe = early.propose("read", 5, timeout_s=0.2)
    time.sleep(0.3)
    assert pe.poll() == Agreement(None)  # the bound passed: abandoned
    pl = late.propose("read", 1, timeout_s=5.0)  # would complete the count: too late
    assert pl.poll() == Agreement(None)
    assert leftovers(store, "ranksync/read/1", 2) == []


def test_decided_before_the_bound_wins_even_when_polled_after_it() -> None:
    store = make_store()
    slow, fast = syncs(store, 2)
    ps = slow.propose("hit", 5, timeout_s=0.2)
    pf = fast.propose("hit", 3, timeout_s=0.2)  # completes the count: decides 3 now
    time.sleep(0.4)  # both bounds pass before anyone polls
    assert ps.poll() == Agreement(3)
    assert pf.poll() == Agreement(3)


def test_poll_never_blocks_while_undecided() -> None:
    store = make_store()
    mine, _absent = syncs(store, 2)
    proposal = mine.propose("hit", 3, timeout_s=5.0)
    slowest = 0.0
    for _ in range(50):
        began = time.monotonic()
        assert proposal.poll() is None
        slowest = max(slowest, time.monotonic() - began)
    # A store round trip on loopback: far below any bound; the bound itself is 5 s.
    assert slowest < 0.25, f"poll took {slowest:.3f} s while undecided"
    assert not store.check(["ranksync/hit/1/outcome"])


def test_proposals_match_by_op_name_and_order() -> None:
    store = make_store()
    r0, r1 = syncs(store, 2)
    # Interleaved differently on each rank; a and b count separately.
    p0 = [r0.propose("a", 5, timeout_s=5.0), r0.propose("b", 1, timeout_s=5.0)]
    p0.append(r0.propose("a", 7, timeout_s=5.0))
    p1 = [r1.propose("b", 3, timeout_s=5.0), r1.propose("a", 2, timeout_s=5.0)]
    p1.append(r1.propose("a", 9, timeout_s=5.0))
    assert [settle(p) for p in p0] == [Agreement(2), Agreement(1), Agreement(7)]
    assert [settle(p) for p in p1] == [Agreement(1), Agreement(2), Agreement(7)]
    for base in ("ranksync/a/1", "ranksync/a/2", "ranksync/b/1"):
        assert leftovers(store, base, 2) == []


def test_keys_stay_until_every_rank_polled_and_repeated_polls_count_once() -> None:
    store = make_store()
    ranks = syncs(store, 3)
    proposals = [s.propose("hit", v, timeout_s=5.0) for s, v in zip(ranks, (4, 6, 5), strict=True)]
    base = "ranksync/hit/1"
    assert store.get(f"{base}/outcome").decode() == "4"
    for _ in range(3):  # a rank polling again must not count itself out again
        assert proposals[0].poll() == Agreement(4)
    assert proposals[1].poll() == Agreement(4)
    assert "outcome" in leftovers(store, base, 3)  # rank 2 has not read it yet
    assert proposals[2].poll() == Agreement(4)
    assert leftovers(store, base, 3) == []


def test_distinct_prefixes_keep_agreements_apart() -> None:
    store = make_store()
    clients = [
        TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=10)) for _ in range(2)
    ]
    x = [StoreRankSync(c, rank=r, world_size=2, prefix="x") for r, c in enumerate(clients)]
    y = [StoreRankSync(c, rank=r, world_size=2, prefix="y") for r, c in enumerate(clients)]
    px = [x[0].propose("hit", 1, timeout_s=5.0), x[1].propose("hit", 2, timeout_s=5.0)]
    py = y[0].propose("hit", 8, timeout_s=0.2)  # y's rank 1 never comes
    assert [settle(p) for p in px] == [Agreement(1)] * 2
    assert settle(py) == Agreement(None)


class BrokenStore:
    """A store whose server is gone: every call raises as TCPStore does."""

    def __getattr__(self, name: str) -> object:
        def fail(*args: object) -> object:
            raise RuntimeError("Connection reset by peer")

        return fail


def test_a_store_failure_is_none_at_once() -> None:
    sync = StoreRankSync(BrokenStore(), rank=0, world_size=2)  # type: ignore[arg-type]
    began = time.monotonic()
    assert sync.propose("hit", 1, timeout_s=5.0).poll() == Agreement(None)
    assert time.monotonic() - began < 1.0
