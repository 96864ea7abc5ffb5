from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.memory import ExtentAllocator, Run


def free_runs_of(capacity: int, used: set[int]) -> list[Run]:
    """The maximal runs of free units, by start: what a fully coalesced allocator holds."""
    runs: list[Run] = []
    start: int | None = None
    for unit in range(capacity + 1):
        free = unit < capacity and unit not in used
        if free and start is None:
            start = unit
        elif not free and start is not None:
            runs.append(Run(start=start, length=unit - start))
            start = None
    return runs


def units(run: Run) -> set[int]:
    return set(range(run.start, run.end))


class ExtentMachine(RuleBasedStateMachine):
    """ExtentAllocator against a model: the set of runs handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.extents = ExtentAllocator(1)
        self.allocated: dict[int, int] = {}  # start -> length
        self.retired: list[Run] = []  # runs freed earlier (candidates for a double free)

    @initialize(capacity=st.integers(min_value=1, max_value=40))
    def start(self, capacity: int) -> None:
        self.extents = ExtentAllocator(capacity, name="test units")
        self.allocated = {}
        self.retired = []

    # ------------------------------------------------------------ model helpers

    @property
    def capacity(self) -> int:
        return self.extents.capacity

    def used(self) -> set[int]:
        return {u for start, length in self.allocated.items() for u in range(start, start + length)}

    def free_runs(self) -> list[Run]:
        return free_runs_of(self.capacity, self.used())

    def held(self) -> list[Run]:
        return [Run(start=s, length=n) for s, n in sorted(self.allocated.items())]

    def snapshot(self) -> tuple[int, int, int]:
        return (self.extents.free_units, self.extents.free_runs, self.extents.largest_free_run)

    def take(self, runs: tuple[Run, ...] | list[Run], free_before: list[Run]) -> None:
        """Check that ``runs`` lie in free space, do not overlap, and record them."""
        free_units = {u for run in free_before for u in units(run)}
        seen: set[int] = set()
        for run in runs:
            assert run.length >= 1
            assert units(run) <= free_units, f"{run} overlaps allocated units"
            assert not units(run) & seen, f"{run} overlaps another run of the same call"
            seen |= units(run)
            self.allocated[run.start] = run.length

    # ------------------------------------------------------------ rules

    @rule(n=st.integers(min_value=1, max_value=44))
    def allocate(self, n: int) -> None:
        free = self.free_runs()
        total_free = sum(run.length for run in free)
        if n > total_free:
            before = self.snapshot()
            with pytest.raises(CapacityError) as caught:
                self.extents.allocate(n)
            assert caught.value.requested == n
            assert caught.value.available == total_free
            assert self.snapshot() == before
            return
        got = self.extents.allocate(n)
        assert sum(run.length for run in got) == n
        assert list(got) == sorted(got, key=lambda run: run.start)
        fits = [run for run in free if run.length >= n]
        if fits:
            # Best fit: the smallest free run that holds n (the lowest start among equals).
            best = min(fits, key=lambda run: (run.length, run.start))
            assert got == (Run(start=best.start, length=n),)
        else:
            # The fewest runs that can hold n: as many as the largest free runs need.
            lengths = sorted((run.length for run in free), reverse=True)
            fewest = next(k for k in range(1, len(lengths) + 1) if sum(lengths[:k]) >= n)
            assert len(got) == fewest
        self.take(got, free)

    @rule(n=st.integers(min_value=1, max_value=44))
    def allocate_contiguous(self, n: int) -> None:
        free = self.free_runs()
        fits = [run for run in free if run.length >= n]
        if not fits:
            before = self.snapshot()
            with pytest.raises(CapacityError) as caught:
                self.extents.allocate_contiguous(n)
            assert caught.value.requested == n
            assert caught.value.available == max((run.length for run in free), default=0)
            assert "contiguous" in str(caught.value)
            assert self.snapshot() == before
            return
        got = self.extents.allocate_contiguous(n)
        best = min(fits, key=lambda run: (run.length, run.start))
        assert got == Run(start=best.start, length=n)
        self.take([got], free)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = self.held()
        chosen = data.draw(st.lists(st.sampled_from(held), unique=True)) if held else []
        self.extents.free(chosen)
        for run in chosen:
            del self.allocated[run.start]
            self.retired.append(run)

    @precondition(lambda self: bool(self.allocated))
    @rule()
    def free_everything_then_take_it_back(self) -> None:
        # Freeing every run leaves one free run of everything; re-allocating the exact same
        # runs with allocate_contiguous is not possible in general, so check and restore by
        # allocating the whole space and freeing it again.
        held = self.held()
        self.extents.free(held)
        assert self.extents.free_runs == 1
        assert self.extents.free_units == self.capacity
        whole = self.extents.allocate_contiguous(self.capacity)
        assert whole == Run(start=0, length=self.capacity)
        self.extents.free([whole])
        self.retired += held
        self.allocated = {}

    @rule(data=st.data(), kind=st.sampled_from(["stale", "sub", "in-free", "twice", "outside"]))
    def bad_free_is_refused_and_changes_nothing(self, data: st.DataObject, kind: str) -> None:
        held = self.held()
        used = self.used()
        bad: list[Run] = []
        if kind == "stale":
            bad = [r for r in self.retired if self.allocated.get(r.start) != r.length][:1]
        elif kind == "sub":
            bad = [Run(start=r.start, length=r.length - 1) for r in held if r.length > 1][:1]
            bad += [Run(start=r.start + 1, length=r.length - 1) for r in held if r.length > 1][:1]
        elif kind == "in-free":
            bad = [Run(start=u, length=1) for u in range(self.capacity) if u not in used][:1]
        elif kind == "twice" and held:
            twice = data.draw(st.sampled_from(held))
            held.remove(twice)
            bad = [twice, twice]
        elif kind == "outside":
            bad = [Run(start=self.capacity, length=1), Run(start=-1, length=1)]
        if not bad:
            return
        good = data.draw(st.lists(st.sampled_from(held), unique=True)) if held else []
        chosen = data.draw(st.permutations(good + bad))
        before = self.snapshot()
        with pytest.raises(StateError):
            self.extents.free(chosen)
        assert self.snapshot() == before

    # ------------------------------------------------------------ invariants

    @invariant()
    def free_space_matches_the_model(self) -> None:
        free = self.free_runs()
        assert self.extents.free_units == self.capacity - len(self.used())
        assert self.extents.free_units == sum(run.length for run in free)
        # Fully coalesced: exactly as many free runs as maximal free stretches.
        assert self.extents.free_runs == len(free)
        assert self.extents.largest_free_run == max((run.length for run in free), default=0)


def test_extent_allocator_matches_model() -> None:
    run_state_machine_as_test(
        ExtentMachine, settings=settings(max_examples=60, stateful_step_count=40)
    )


# ---------------------------------------------------------------- plain tests


def test_fresh_allocator_hands_out_runs_from_the_start() -> None:
    extents = ExtentAllocator(10)
    assert extents.allocate(3) == (Run(start=0, length=3),)
    assert extents.allocate_contiguous(2) == Run(start=3, length=2)
    assert extents.free_units == 5
    assert extents.free_runs == 1
    assert extents.largest_free_run == 5


def test_best_fit_takes_the_smallest_free_run_that_fits() -> None:
    extents = ExtentAllocator(20)
    a, b, c, d, e = (extents.allocate_contiguous(n) for n in (5, 3, 2, 4, 6))
    extents.free([b, d])  # free runs: 5+3 and 10+4
    assert extents.free_runs == 2
    assert extents.allocate(3) == (Run(start=5, length=3),)
    assert extents.allocate_contiguous(4) == Run(start=10, length=4)
    assert extents.free_units == 0
    assert extents.largest_free_run == 0
    assert extents.free_runs == 0
    extents.free([a, c, e])


def test_fragmented_space_fails_contiguous_but_not_allocate() -> None:
    extents = ExtentAllocator(10, name="embedding pool pages")
    singles = [extents.allocate_contiguous(1) for _ in range(10)]
    extents.free(singles[::2])
    assert extents.free_runs == 5
    with pytest.raises(CapacityError) as caught:
        extents.allocate_contiguous(2)
    assert caught.value.requested == 2
    assert caught.value.available == 1
    assert "contiguous" in str(caught.value)
    assert extents.free_units == 5
    got = extents.allocate(3)
    assert len(got) == 3
    assert sum(run.length for run in got) == 3
    assert extents.free_units == 2


def test_freed_neighbours_coalesce() -> None:
    extents = ExtentAllocator(9)
    a, b, c = (extents.allocate_contiguous(3) for _ in range(3))
    extents.free([a, c])
    assert extents.free_runs == 2
    extents.free([b])
    assert extents.free_runs == 1
    assert extents.largest_free_run == 9
    assert extents.allocate_contiguous(9) == Run(start=0, length=9)


def test_allocate_more_than_free_is_capacity_error() -> None:
    extents = ExtentAllocator(4)
    extents.allocate(3)
    with pytest.raises(CapacityError) as caught:
        extents.allocate(2)
    assert (caught.value.requested, caught.value.available) == (2, 1)
    assert extents.free_units == 1


@pytest.mark.parametrize("n", [0, -1, True, 1.5])
def test_counts_must_be_positive_ints(n: object) -> None:
    extents = ExtentAllocator(4)
    with pytest.raises(ConfigError):
        extents.allocate(n)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        extents.allocate_contiguous(n)  # type: ignore[arg-type]
    assert extents.free_units == 4


@pytest.mark.parametrize("capacity", [0, -1, True, 2.0])
def test_capacity_must_be_positive_int(capacity: object) -> None:
    with pytest.raises(ConfigError):
        ExtentAllocator(capacity)  # type: ignore[arg-type]


def test_double_free_is_refused_as_a_whole() -> None:
    extents = ExtentAllocator(6)
    a = extents.allocate_contiguous(2)
    b = extents.allocate_contiguous(2)
    extents.free([a])
    with pytest.raises(StateError):
        extents.free([b, a])
    assert extents.free_units == 4
    with pytest.raises(StateError):
        extents.free([b, b])
    extents.free([b])
    assert extents.free_units == 6


def test_free_of_a_run_not_handed_out_is_refused() -> None:
    extents = ExtentAllocator(6)
    run = extents.allocate_contiguous(4)
    for foreign in (Run(start=0, length=2), Run(start=1, length=3), Run(start=4, length=2)):
        with pytest.raises(StateError):
            extents.free([foreign])
    assert extents.free_units == 2
    extents.free([run])


def test_run_end() -> None:
    assert Run(start=3, length=4).end == 7
