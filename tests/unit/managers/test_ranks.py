"""Rank agreement: MIN over ranks within a bound, and None on every rank otherwise.

The store-backed tests use a real ``torch.distributed.TCPStore`` on loopback; the last one
runs each rank in its own process, one of them late and one op it never joins.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch._C._distributed_c10d import TCPStore

from sglang_storage.errors import ConfigError
from sglang_storage.managers.ranks import ABANDONED, RankSync, SingleRank, StoreRankSync

ROOT = Path(__file__).resolve().parents[3]


def make_store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def client(store: TCPStore) -> TCPStore:
    """Another connection to ``store``'s server, as another rank's process would have."""
    return TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=10))


def leftovers(store: TCPStore, base: str, world: int) -> list[str]:
    """The keys of the op at ``base`` still in the store."""
    names = [*(f"v{r}" for r in range(world)), "n", "done", "outcome"]
    return [name for name in names if store.check([f"{base}/{name}"])]


def test_single_rank_returns_its_value_and_checks_arguments() -> None:
    sync = SingleRank()
    assert isinstance(sync, RankSync)
    assert sync.agree_min("hits", 7, timeout_s=0.1) == 7
    with pytest.raises(ConfigError, match="value"):
        sync.agree_min("hits", -1, timeout_s=0.1)
    with pytest.raises(ConfigError, match="op"):
        sync.agree_min("no spaces", 1, timeout_s=0.1)
    with pytest.raises(ConfigError, match="timeout_s"):
        sync.agree_min("hits", 1, timeout_s=float("nan"))


def test_store_rank_sync_rejects_bad_ranks() -> None:
    store = make_store()
    with pytest.raises(ConfigError, match="rank"):
        StoreRankSync(store, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="world_size"):
        StoreRankSync(store, rank=0, world_size=0)


def test_threads_agree_on_the_minimum_and_clean_up() -> None:
    store = make_store()
    syncs = [StoreRankSync(client(store), rank=r, world_size=3) for r in range(3)]
    results: dict[int, list[int | None]] = {}

    def run(rank: int) -> None:
        results[rank] = [
            syncs[rank].agree_min("hits", v, timeout_s=5.0) for v in (4 + rank, 9 - rank)
        ]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == {r: [4, 7] for r in range(3)}
    assert leftovers(store, "ranksync/hits/1", 3) == leftovers(store, "ranksync/hits/2", 3) == []


def test_missing_rank_makes_none_within_the_bound_and_late_rank_gets_none() -> None:
    store = make_store()
    early, late = (StoreRankSync(client(store), rank=r, world_size=2) for r in range(2))
    started = time.monotonic()
    assert early.agree_min("hits", 3, timeout_s=0.3) is None
    assert 0.3 <= time.monotonic() - started < 2.0
    assert store.get("ranksync/hits/1/outcome").decode() == ABANDONED
    # The late rank arrives after the first gave up: None too, not its own value.
    assert late.agree_min("hits", 1, timeout_s=5.0) is None
    assert leftovers(store, "ranksync/hits/1", 2) == []
    # The next op of the same name agrees again.
    done: list[int | None] = []
    thread = threading.Thread(target=lambda: done.append(late.agree_min("hits", 2, timeout_s=5)))
    thread.start()
    assert early.agree_min("hits", 6, timeout_s=5.0) == 2
    thread.join(10)
    assert done == [2]


class BrokenStore:
    """A store whose server is gone: every call raises as TCPStore does."""

    def __getattr__(self, name: str) -> object:
        def fail(*args: object) -> object:
            raise RuntimeError("Connection reset by peer")

        return fail


def test_store_failure_is_none() -> None:
    sync = StoreRankSync(BrokenStore(), rank=0, world_size=2)  # type: ignore[arg-type]
    assert sync.agree_min("hits", 1, timeout_s=1.0) is None


CHILD = textwrap.dedent(
    """
    import json, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from sglang_storage.managers.ranks import StoreRankSync

    port, rank, plan = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=20))
    sync = StoreRankSync(store, rank=rank, world_size=3)
    out = []
    for op, value, delay, timeout in plan:
        time.sleep(delay)
        start = time.monotonic()
        out.append([op, sync.agree_min(op, value, timeout_s=timeout), time.monotonic() - start])
    print(json.dumps(out))
    """
)


def test_processes_agree_and_a_late_or_absent_rank_is_a_miss_on_all() -> None:
    store = make_store()
    # op, value, delay before the call, bound
    plans = {
        0: [["a", 5, 0, 30], ["b", 1, 0, 0.5], ["a", 8, 0, 30], ["c", 1, 0, 0.4]],
        1: [["a", 3, 0, 30], ["b", 2, 0, 0.5], ["a", 6, 0, 30], ["c", 1, 0, 0.4]],
        2: [["a", 7, 0, 30], ["b", 0, 2.0, 0.5], ["a", 9, 0, 30]],  # late to b, never joins c
    }
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(store.port), str(rank), json.dumps(plan)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for rank, plan in plans.items()
    ]
    outputs = [json.loads(child.communicate(timeout=120)[0]) for child in children]
    answers = [[(op, result) for op, result, _ in out] for out in outputs]
    assert answers[0] == answers[1] == [("a", 3), ("b", None), ("a", 6), ("c", None)]
    assert answers[2] == [("a", 3), ("b", None), ("a", 6)]
    for rank in (0, 1):
        b_elapsed, c_elapsed = outputs[rank][1][2], outputs[rank][3][2]
        assert b_elapsed < 0.5 + 1.0
        assert c_elapsed < 0.4 + 1.0
    assert outputs[2][1][2] < 0.5  # the late rank reads the outcome at once
    # a, b and the second a were cleaned up; c keeps its marker for the rank that never came.
    assert not store.check(["ranksync/a/1/outcome", "ranksync/b/1/outcome"])
    assert store.get("ranksync/c/1/outcome").decode() == ABANDONED
