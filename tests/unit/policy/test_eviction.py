from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sglang_storage.config import build_config
from sglang_storage.core import EvictionPolicy
from sglang_storage.errors import ConfigError, StateError
from sglang_storage.policy import (
    EVICTION_POLICY_NAMES,
    EvictionConfig,
    LRUPolicy,
    S3FIFOPolicy,
    make_eviction_policy,
)

Policy = LRUPolicy[int] | S3FIFOPolicy[int]
MAKERS: dict[str, Callable[[], Policy]] = {"lru": LRUPolicy[int], "s3fifo": S3FIFOPolicy[int]}


def state(policy: object) -> dict[str, Any]:
    """Everything a policy holds, for 'a refused call changes nothing'."""
    return copy.deepcopy(vars(policy))


def filled(kind: str) -> Policy:
    """A policy with some history: weights, a pin, hits, an eviction (and a ghost)."""
    policy = MAKERS[kind]()
    for key in range(1, 9):
        policy.insert(key, key % 3 + 1)
    policy.pin(2)
    policy.access(3)
    policy.evict(2)
    return policy


# ----------------------------------------------------------------------------- typing


def test_policies_are_eviction_policies_for_mypy() -> None:
    lru: EvictionPolicy[int] = LRUPolicy[int]()
    s3fifo: EvictionPolicy[str] = S3FIFOPolicy[str]()
    made: EvictionPolicy[tuple[int, int]] = make_eviction_policy(EvictionConfig(name="s3fifo"))
    assert (lru.name, s3fifo.name, made.name) == ("lru", "s3fifo", "s3fifo")
    assert isinstance(made, S3FIFOPolicy)


# ----------------------------------------------------------------------------- config


def test_build_config_selects_by_name() -> None:
    assert build_config(EvictionConfig, {"name": "lru"}) == EvictionConfig(name="lru")
    config = build_config(EvictionConfig, {"name": "s3fifo", "small_ratio": 0.25})
    assert config == EvictionConfig(name="s3fifo", small_ratio=0.25)
    assert EvictionConfig() == EvictionConfig(name="lru", small_ratio=0.1)


@pytest.mark.parametrize("name", ["arc", "LRU", "", "slru"])
def test_unknown_name_lists_the_allowed_names(name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(EvictionConfig, {"name": name})
    error = caught.value
    assert (error.owner, error.field, error.value) == ("EvictionConfig", "name", name)
    assert error.allowed == "'lru', 's3fifo'"
    assert EVICTION_POLICY_NAMES == ("lru", "s3fifo")


@pytest.mark.parametrize("ratio", [0, 0.0, 0.51, 1, -0.1, True, float("nan")])
def test_small_ratio_out_of_range_is_refused(ratio: object) -> None:
    with pytest.raises(ConfigError) as caught:
        EvictionConfig(name="s3fifo", small_ratio=ratio)  # type: ignore[arg-type]
    assert caught.value.field == "small_ratio"
    with pytest.raises(ConfigError):
        S3FIFOPolicy[int](small_ratio=ratio)  # type: ignore[arg-type]


def test_make_eviction_policy_builds_each_name() -> None:
    for name in EVICTION_POLICY_NAMES:
        policy: EvictionPolicy[int] = make_eviction_policy(EvictionConfig(name=name))  # type: ignore[arg-type]
        assert policy.name == name
        assert len(policy) == 0
    s3fifo: EvictionPolicy[int] = make_eviction_policy(
        EvictionConfig(name="s3fifo", small_ratio=0.3)
    )
    assert isinstance(s3fifo, S3FIFOPolicy)
    assert s3fifo.small_ratio == 0.3


# ----------------------------------------------------------------------------- refusals


REFUSED_STATE: list[tuple[str, Callable[[Policy], object]]] = [
    ("insert tracked", lambda p: p.insert(2)),
    ("access untracked", lambda p: p.access(99)),
    ("remove untracked", lambda p: p.remove(99)),
    ("pin untracked", lambda p: p.pin(99)),
    ("unpin untracked", lambda p: p.unpin(99)),
    ("unpin unpinned", lambda p: p.unpin(3)),
    ("pin_count untracked", lambda p: p.pin_count(99)),
]
REFUSED_ARGUMENT: list[tuple[str, Callable[[Policy], object]]] = [
    ("weight 0", lambda p: p.insert(50, 0)),
    ("weight -1", lambda p: p.insert(50, -1)),
    ("weight bool", lambda p: p.insert(50, True)),
    ("weight float", lambda p: p.insert(50, 1.0)),  # type: ignore[arg-type]
    ("amount 0", lambda p: p.evict(0)),
    ("amount -3", lambda p: p.evict(-3)),
    ("amount bool", lambda p: p.evict(True)),
    ("amount float", lambda p: p.evict(2.0)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize(("what", "call"), REFUSED_STATE, ids=[r[0] for r in REFUSED_STATE])
def test_state_rule_refusals_change_nothing(
    kind: str, what: str, call: Callable[[Policy], object]
) -> None:
    policy = filled(kind)
    before = state(policy)
    with pytest.raises(StateError) as caught:
        call(policy)
    assert caught.value.subject.startswith(type(policy).__name__)
    assert state(policy) == before


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize(("what", "call"), REFUSED_ARGUMENT, ids=[r[0] for r in REFUSED_ARGUMENT])
def test_bad_argument_refusals_change_nothing(
    kind: str, what: str, call: Callable[[Policy], object]
) -> None:
    policy = filled(kind)
    before = state(policy)
    with pytest.raises(ConfigError) as caught:
        call(policy)
    assert caught.value.field in ("weight", "amount")
    assert state(policy) == before


@pytest.mark.parametrize("kind", MAKERS)
def test_membership_and_sizes(kind: str) -> None:
    policy = MAKERS[kind]()
    policy.insert(1, 5)
    policy.insert(2, 7)
    policy.pin(2)
    policy.pin(2)
    assert 1 in policy
    assert 3 not in policy
    assert [] not in policy  # unhashable: never tracked, no TypeError
    assert len(policy) == 2
    assert (policy.total_weight, policy.evictable_weight, policy.pinned_count) == (12, 5, 1)
    assert policy.pin_count(2) == 2
    policy.remove(2)  # pinned entries may be removed by their owner
    assert (policy.total_weight, policy.evictable_weight, policy.pinned_count) == (5, 5, 0)


@pytest.mark.parametrize("kind", MAKERS)
def test_pinned_entries_are_never_evicted(kind: str) -> None:
    policy = MAKERS[kind]()
    for key in range(10):
        policy.insert(key)
    for key in (0, 4, 9):
        policy.pin(key)
    victims = policy.evict(100)
    assert sorted(victims) == [1, 2, 3, 5, 6, 7, 8]
    assert sorted(policy.keys()) == [0, 4, 9]
    assert policy.evict(1) == []
    policy.unpin(4)
    assert policy.evict(1) == [4]


@pytest.mark.parametrize("kind", MAKERS)
def test_eviction_is_one_batch_that_stops_at_the_amount(kind: str) -> None:
    policy = MAKERS[kind]()
    for key, weight in enumerate([4, 1, 3, 2, 5]):
        policy.insert(key, weight)
    victims = policy.evict(5)
    freed = [w for k, w in enumerate([4, 1, 3, 2, 5]) if k in victims]
    assert sum(freed) >= 5
    assert sum(freed) - freed[-1] < 5 or len(victims) == 1
    assert len(policy) == 5 - len(victims)


# ----------------------------------------------------------------------------- LRU


def test_lru_evicts_least_recently_used_first() -> None:
    policy = LRUPolicy[str]()
    for key in "abcd":
        policy.insert(key)
    policy.access("a")
    policy.access("c")
    assert policy.keys() == ["b", "d", "a", "c"]
    assert policy.evict(1) == ["b"]
    assert policy.evict(2) == ["d", "a"]
    assert policy.keys() == ["c"]


def test_lru_counts_weights_and_keeps_pinned_in_place() -> None:
    policy = LRUPolicy[str]()
    for key, weight in [("a", 3), ("b", 2), ("c", 4), ("d", 1)]:
        policy.insert(key, weight)
    policy.pin("a")
    assert policy.evict(4) == ["b", "c"]
    policy.unpin("a")
    # 'a' kept its place as the least recent entry while it was pinned.
    assert policy.keys() == ["a", "d"]
    assert policy.evict(1) == ["a"]


# ----------------------------------------------------------------------------- S3-FIFO


def test_s3fifo_filters_one_hit_entries_and_promotes_reused_ones() -> None:
    policy = S3FIFOPolicy[int]()
    for key in range(10):
        policy.insert(key)
    for key in range(5):
        policy.access(key)
    assert policy.capacity_estimate == 10
    # Small holds everything (>= 10% of 10): accessed heads move to main, the rest go.
    assert policy.evict(5) == [5, 6, 7, 8, 9]
    assert all(policy.in_main(key) for key in range(5))
    assert policy.ghost_keys() == [5, 6, 7, 8, 9]
    # A key the ghost remembers comes back straight into main.
    policy.insert(5)
    assert policy.in_main(5)
    assert 5 not in policy.ghost_keys()
    policy.insert(20)
    assert not policy.in_main(20)


def test_s3fifo_main_queue_gives_accessed_entries_another_round() -> None:
    policy = S3FIFOPolicy[int]()
    for key in range(4):
        policy.insert(key)
        policy.access(key)
    policy.evict(1)  # all four move to main (counters cleared), then main evicts 0
    assert policy.keys() == [1, 2, 3]
    policy.access(1)
    policy.access(1)
    # 1 has counter 2: it is reinserted with 1, and 2 (counter 0) goes first.
    assert policy.evict(1) == [2]
    assert policy.evict(1) == [3]
    assert policy.evict(1) == [1]  # its counter ran down on the way


def test_s3fifo_counter_is_capped_at_three() -> None:
    policy = S3FIFOPolicy[int]()
    for key in range(3):
        policy.insert(key)
        policy.access(key)
    policy.evict(1)  # 0 evicted from main after all three moved there
    for _ in range(10):
        policy.access(1)
    # 1 survives three passes over main (counter 3 -> 0), not ten.
    assert policy.evict(1) == [2]
    policy.insert(7)
    policy.insert(8)
    assert policy.evict(2) == [7, 8]
    assert policy.evict(1) == [1]


def test_s3fifo_passes_over_a_pinned_small_head() -> None:
    policy = S3FIFOPolicy[int]()
    for key in range(5):
        policy.insert(key)
    policy.pin(0)
    assert policy.evict(2) == [1, 2]
    assert 0 in policy
    assert policy.pin_count(0) == 1


def test_s3fifo_passes_over_a_pinned_main_head() -> None:
    policy = S3FIFOPolicy[int]()
    for key in range(4):
        policy.insert(key)
        policy.access(key)
    assert policy.evict(1) == [0]  # 0..3 moved to main, then 0 evicted from there
    policy.pin(1)
    assert policy.evict(1) == [2]
    assert policy.evict(5) == [3]
    assert policy.keys() == [1]
    policy.remove(1)
    assert (len(policy), policy.total_weight, policy.pinned_count) == (0, 0, 0)


@pytest.mark.parametrize("kind", MAKERS)
def test_repr_names_the_policy_and_its_size(kind: str) -> None:
    policy = filled(kind)
    assert repr(policy).startswith(type(policy).__name__ + "(")
    assert f"pinned={policy.pinned_count}" in repr(policy)


def test_s3fifo_ghost_is_bounded_by_main_share_of_capacity() -> None:
    policy = S3FIFOPolicy[int](small_ratio=0.1)
    for key in range(10):
        policy.insert(key)
    for key in range(10, 200):
        policy.evict(1)
        policy.insert(key)
    assert len(policy.ghost_keys()) <= 9
    assert policy.ghost_keys() == list(range(181, 190))


# ----------------------------------------------------------------------------- stateful


class EvictionMachine(RuleBasedStateMachine):
    """A policy against a reference model of what it must track.

    Conservation: every inserted key is tracked until removed by the owner or returned
    by exactly one evict; pinned keys are never returned; weights add up; refused calls
    change nothing. For LRU the model also fixes the exact victims.
    """

    kind = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.policy: Policy = MAKERS[self.kind]()
        self.weights: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.recency: list[int] = []  # LRU model, least recent first

    def refused(self, error: type[Exception], call: Callable[[], object]) -> None:
        before = state(self.policy)
        with pytest.raises(error):
            call()
        assert state(self.policy) == before

    @rule(key=st.integers(0, 12), weight=st.integers(1, 5))
    def insert(self, key: int, weight: int) -> None:
        if key in self.weights:
            self.refused(StateError, lambda: self.policy.insert(key, weight))
            return
        self.policy.insert(key, weight)
        self.weights[key] = weight
        self.pins[key] = 0
        self.recency.append(key)

    @rule(key=st.integers(0, 12))
    def access(self, key: int) -> None:
        if key not in self.weights:
            self.refused(StateError, lambda: self.policy.access(key))
            return
        self.policy.access(key)
        self.recency.remove(key)
        self.recency.append(key)

    @rule(key=st.integers(0, 12))
    def remove(self, key: int) -> None:
        if key not in self.weights:
            self.refused(StateError, lambda: self.policy.remove(key))
            return
        self.policy.remove(key)
        self.forget([key])

    @rule(key=st.integers(0, 12))
    def pin(self, key: int) -> None:
        if key not in self.weights:
            self.refused(StateError, lambda: self.policy.pin(key))
            return
        self.policy.pin(key)
        self.pins[key] += 1

    @rule(key=st.integers(0, 12))
    def unpin(self, key: int) -> None:
        if not self.pins.get(key):
            self.refused(StateError, lambda: self.policy.unpin(key))
            return
        self.policy.unpin(key)
        self.pins[key] -= 1

    @rule(amount=st.integers(-1, 25))
    def evict(self, amount: int) -> None:
        if amount < 1:
            self.refused(ConfigError, lambda: self.policy.evict(amount))
            return
        unpinned = [k for k in self.recency if not self.pins[k]]
        victims = self.policy.evict(amount)
        assert len(set(victims)) == len(victims), "a key returned twice"
        assert all(k in self.weights and not self.pins[k] for k in victims)
        weights = [self.weights[k] for k in victims]
        if sum(weights) < amount:
            assert sorted(victims) == sorted(unpinned), "stopped before the amount"
        else:
            assert sum(weights[:-1]) < amount, "evicted more than one batch needed"
        if self.kind == "lru":
            expected: list[int] = []
            for key in unpinned:
                if sum(self.weights[k] for k in expected) >= amount:
                    break
                expected.append(key)
            assert victims == expected
        self.forget(victims)

    def forget(self, keys: Iterable[int]) -> None:
        for key in keys:
            del self.weights[key]
            del self.pins[key]
            self.recency.remove(key)

    @invariant()
    def matches_model(self) -> None:
        policy = self.policy
        assert len(policy) == len(self.weights)
        assert sorted(policy.keys()) == sorted(self.weights)
        assert policy.total_weight == sum(self.weights.values())
        unpinned = sum(w for k, w in self.weights.items() if not self.pins[k])
        assert policy.evictable_weight == unpinned
        assert policy.pinned_count == sum(1 for p in self.pins.values() if p)
        assert all(policy.pin_count(k) == p for k, p in self.pins.items())
        if isinstance(policy, LRUPolicy):
            assert policy.keys() == self.recency
        else:
            ghosts = policy.ghost_keys()
            assert not set(ghosts) & set(self.weights)
            assert len(ghosts) <= policy.capacity_estimate


class S3FIFOMachine(EvictionMachine):
    kind = "s3fifo"


STATEFUL = settings(max_examples=150, stateful_step_count=50)
TestLRUStateful = EvictionMachine.TestCase
TestLRUStateful.settings = STATEFUL
TestS3FIFOStateful = S3FIFOMachine.TestCase
TestS3FIFOStateful.settings = STATEFUL


# ----------------------------------------------------------------------------- traces


def hit_ratio(policy: EvictionPolicy[int], trace: Iterable[int], capacity: int) -> float:
    """Replay ``trace`` through a cache of ``capacity`` unit-weight entries."""
    hits = requests = 0
    for key in trace:
        requests += 1
        if key in policy:
            hits += 1
            policy.access(key)
            continue
        if len(policy) >= capacity:
            policy.evict(1)
        policy.insert(key)
    return hits / requests


def scan_plus_hot_set(*, hot: int, scan_per_round: int, rounds: int, seed: int) -> list[int]:
    """Rounds of one pass over a hot set (shuffled) followed by never-repeated scan keys."""
    rng = random.Random(seed)
    hot_keys = list(range(hot))
    trace: list[int] = []
    next_scan = hot
    for _ in range(rounds):
        rng.shuffle(hot_keys)
        trace.extend(hot_keys)
        trace.extend(range(next_scan, next_scan + scan_per_round))
        next_scan += scan_per_round
    return trace


def test_s3fifo_beats_lru_on_scan_plus_hot_set() -> None:
    # 50 hot keys and 80 one-time scan keys per round in a 100-entry cache: the hot set
    # fits, but hot set + one round of scan does not. LRU lets each scan flush the hot
    # set; S3-FIFO's small queue absorbs the scan. Measured (seed 7): LRU 0.036,
    # S3-FIFO 0.361; the hot share of the trace is 50/130 = 0.385 and the first round
    # always misses, so 0.372 is the most any policy can reach.
    trace = scan_plus_hot_set(hot=50, scan_per_round=80, rounds=30, seed=7)
    lru = hit_ratio(LRUPolicy[int](), trace, capacity=100)
    s3fifo = hit_ratio(S3FIFOPolicy[int](), trace, capacity=100)
    assert lru < 0.1
    assert s3fifo > 0.3
    assert s3fifo - lru > 0.25


def test_both_policies_keep_a_hot_set_that_fits_without_a_scan() -> None:
    trace = scan_plus_hot_set(hot=50, scan_per_round=0, rounds=20, seed=3)
    for make in MAKERS.values():
        assert hit_ratio(make(), trace, capacity=100) == pytest.approx(19 / 20)
