"""``IOThreads.map_parts``: parts in order whatever the split, and a split that learns.

The split gives the caller's part more work by what the caller does while a pool thread
starts (learned from past batches), and runs a batch the pool cannot help on the caller's
thread alone. These tests fix the learned values where a test is about the split, and
run real threads where it is about the results.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator

import pytest

from sglang_storage.errors import BackendUnavailableError
from sglang_storage.storage.posix import IOThreads


@pytest.fixture
def threads() -> Iterator[IOThreads]:
    pool = IOThreads(2, "test")
    yield pool
    pool.close()


def _learned(pool: IOThreads, *, lag_s: float, pace: float, key: tuple[str, int]) -> None:
    pool._lags.clear()
    pool._lags.extend([lag_s] * 16)
    pool._lag_s = lag_s
    pool._pace[key] = pace


def test_without_estimates_the_parts_are_even_as_before() -> None:
    pool = IOThreads(2, "test")
    assert pool._cuts([1] * 32, None) == [0, 16, 32]
    assert pool._cuts([1] * 5, None) == [0, 3, 5]
    assert IOThreads(3, "test")._cuts([1] * 9, None) == [0, 3, 6, 9]
    # By weight, not by count: one heavy item is a part of its own.
    assert pool._cuts([8, 1, 1, 1, 1, 1, 1, 1, 1], None) == [0, 1, 9]


def test_the_callers_part_is_ahead_by_what_it_does_while_the_pool_starts() -> None:
    pool = IOThreads(2, "test")
    _learned(pool, lag_s=40e-6, pace=10e-6, key=("read", 17))  # 4 items' time, 5 with margin
    assert pool._cuts([1] * 32, 10e-6) == [0, 19, 32]  # 18.5 against 13.5: ties to the caller
    pool3 = IOThreads(3, "test")
    _learned(pool3, lag_s=40e-6, pace=10e-6, key=("read", 17))
    cuts = pool3._cuts([1] * 33, 10e-6)
    assert (cuts[0], cuts[-1]) == (0, 33)
    caller, *others = (b - a for a, b in itertools.pairwise(cuts))
    assert caller - max(others) >= 4
    assert max(others) - min(others) <= 1


def test_a_batch_the_pool_cannot_help_runs_on_the_callers_thread(threads: IOThreads) -> None:
    key = ("read", (100).bit_length())
    _learned(threads, lag_s=1e-3, pace=1e-6, key=key)  # 1 ms to start, 0.1 ms per item
    assert threads._cuts([100] * 4, 1e-6) == [0, 4]
    seen: list[str] = []

    def work(part: list[int]) -> list[int]:
        seen.append(threading.current_thread().name)
        return part

    for _ in range(16):
        parts = threads.map_parts(work, [1, 2, 3, 4], sizes=[100] * 4, kind="read")
        assert parts == [[1, 2, 3, 4]]
    assert set(seen) == {threading.current_thread().name}
    assert threads._alone == 16
    # Now and then the pool runs anyway, so a delay that passed is seen to have passed.
    seen.clear()
    parts = threads.map_parts(work, [1, 2, 3, 4], sizes=[100] * 4, kind="read")
    assert parts == [[1, 2], [3, 4]]
    assert len(set(seen)) == 2
    assert threads._lags[-1] < 1e-3, "the probe's delay joined the last 16"
    assert threads._lag_s == 1e-3, "a median that one quick start does not move"
    assert threads._alone == 0


def test_parts_come_back_in_order_and_whole_whatever_the_split(threads: IOThreads) -> None:
    rng = random.Random(7)

    def work(part: list[int]) -> list[int]:
        time.sleep(rng.random() * 1e-4)
        return [x * 2 for x in part]

    for count in (2, 3, 5, 17, 64, 129):
        for _ in range(6):
            items = list(range(count))
            sizes = [rng.choice((1, 4096, 65536, 1 << 20)) for _ in items]
            parts = threads.map_parts(work, items, sizes=sizes, kind="mixed")
            assert 1 <= len(parts) <= 2
            assert all(parts), "no part is empty"
            assert [x for part in parts for x in part] == [x * 2 for x in items]
    assert threads._pace, "the caller's pace was learned"
    assert threads._lags, "the pool's start delay was learned"


def test_a_failing_part_raises_to_the_caller(threads: IOThreads) -> None:
    def work(part: list[int]) -> list[int]:
        if 9 in part:
            raise ValueError("part with 9")
        return part

    with pytest.raises(ValueError, match="part with 9"):
        threads.map_parts(work, list(range(10)))
    threads.close()
    with pytest.raises(BackendUnavailableError):
        threads.map_parts(work, list(range(4)))
