from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch
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
from sglang_storage.memory import SlotAllocator, SlotStats

SlotArg = torch.Tensor | list[int]


class TransferFailedError(Exception):
    """Raised inside a pinned block, standing in for a failed transfer."""


FORMS = st.sampled_from(["list", "int32", "int64"])


def as_arg(slots: Sequence[int], form: str) -> SlotArg:
    """The same slots as a list, an int32 tensor or an int64 tensor."""
    if form == "list":
        return list(slots)
    dtype = torch.int32 if form == "int32" else torch.int64
    return torch.tensor(list(slots), dtype=dtype)


def subsets(items: Sequence[int], *, min_size: int = 0) -> st.SearchStrategy[list[int]]:
    """Distinct elements of ``items`` in any order."""
    if not items:
        return st.just([])
    return st.lists(st.sampled_from(list(items)), unique=True, min_size=min_size)


class SlotMachine(RuleBasedStateMachine):
    """SlotAllocator against a plain model: allocated slot -> pin count."""

    def __init__(self) -> None:
        super().__init__()
        self.slots = SlotAllocator(1)
        self.pins: dict[int, int] = {}

    @initialize(capacity=st.integers(min_value=1, max_value=12))
    def start(self, capacity: int) -> None:
        self.slots = SlotAllocator(capacity, name="test slots")
        self.pins = {}

    # ------------------------------------------------------------ model helpers

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    def free_slots(self) -> list[int]:
        return sorted(set(range(self.capacity)) - set(self.pins))

    def unpinned(self) -> list[int]:
        return sorted(s for s, count in self.pins.items() if count == 0)

    def pinned_slots(self) -> list[int]:
        return sorted(s for s, count in self.pins.items() if count > 0)

    def snapshot(self) -> tuple[list[bool], list[int], SlotStats]:
        everything = list(range(self.capacity))
        return (
            self.slots.is_allocated(everything).tolist(),
            self.slots.pin_counts(everything).tolist(),
            self.slots.stats(),
        )

    # ------------------------------------------------------------ valid operations

    @rule(n=st.integers(min_value=0, max_value=14))
    def alloc(self, n: int) -> None:
        free = self.capacity - len(self.pins)
        if n > free:
            before = self.snapshot()
            with pytest.raises(CapacityError) as caught:
                self.slots.alloc(n)
            assert caught.value.requested == n
            assert caught.value.available == free
            assert caught.value.unit == "slots"
            assert self.snapshot() == before
            return
        got = self.slots.alloc(n)
        assert got.dtype == torch.int64
        assert tuple(got.shape) == (n,)
        values = got.tolist()
        assert len(set(values)) == n
        assert all(0 <= v < self.capacity for v in values)
        # No slot is handed out twice while it is allocated.
        assert not set(values) & set(self.pins)
        for v in values:
            self.pins[v] = 0

    @rule(data=st.data(), form=FORMS)
    def free(self, data: st.DataObject, form: str) -> None:
        chosen = data.draw(subsets(self.unpinned()))
        self.slots.free(as_arg(chosen, form))
        for s in chosen:
            del self.pins[s]

    @rule(data=st.data(), form=FORMS)
    def pin(self, data: st.DataObject, form: str) -> None:
        chosen = data.draw(subsets(sorted(self.pins)))
        self.slots.pin(as_arg(chosen, form))
        for s in chosen:
            self.pins[s] += 1

    @rule(data=st.data(), form=FORMS)
    def unpin(self, data: st.DataObject, form: str) -> None:
        chosen = data.draw(subsets(self.pinned_slots()))
        self.slots.unpin(as_arg(chosen, form))
        for s in chosen:
            self.pins[s] -= 1

    @rule(data=st.data())
    def pinned_block_unpins_on_exception(self, data: st.DataObject) -> None:
        chosen = data.draw(subsets(sorted(self.pins)))
        before = self.snapshot()

        def transfer() -> None:
            with self.slots.pinned(chosen) as held:
                assert held.tolist() == chosen
                counts = self.slots.pin_counts(chosen).tolist()
                assert counts == [self.pins[s] + 1 for s in chosen]
                raise TransferFailedError

        with pytest.raises(TransferFailedError):
            transfer()
        assert self.snapshot() == before

    @rule()
    def alloc_everything_free_then_return_it(self) -> None:
        # The free list is exactly the model's free set (nothing leaked, nothing duplicated).
        expected = self.free_slots()
        got = self.slots.alloc(len(expected))
        assert sorted(got.tolist()) == expected
        assert self.slots.free_count == 0
        self.slots.free(got)

    @rule()
    def reset(self) -> None:
        if self.pinned_slots():
            before = self.snapshot()
            with pytest.raises(StateError):
                self.slots.reset()
            assert self.snapshot() == before
            return
        self.slots.reset()
        self.pins = {}

    # ------------------------------------------------------------ refused operations

    @precondition(lambda self: any(count > 0 for count in self.pins.values()))
    @rule(data=st.data(), form=FORMS)
    def free_pinned_is_refused(self, data: st.DataObject, form: str) -> None:
        bad = data.draw(subsets(self.pinned_slots(), min_size=1))
        good = data.draw(subsets(self.unpinned()))
        chosen = data.draw(st.permutations(bad + good))
        before = self.snapshot()
        with pytest.raises(StateError):
            self.slots.free(as_arg(chosen, form))
        assert self.snapshot() == before

    @precondition(lambda self: len(self.pins) < self.capacity)
    @rule(data=st.data(), form=FORMS)
    def double_free_is_refused(self, data: st.DataObject, form: str) -> None:
        bad = data.draw(subsets(self.free_slots(), min_size=1))
        good = data.draw(subsets(self.unpinned()))
        chosen = data.draw(st.permutations(bad + good))
        before = self.snapshot()
        with pytest.raises(StateError):
            self.slots.free(as_arg(chosen, form))
        assert self.snapshot() == before

    @precondition(lambda self: len(self.pins) < self.capacity)
    @rule(data=st.data(), form=FORMS)
    def pin_of_free_slot_is_refused(self, data: st.DataObject, form: str) -> None:
        bad = data.draw(subsets(self.free_slots(), min_size=1))
        good = data.draw(subsets(sorted(self.pins)))
        chosen = data.draw(st.permutations(bad + good))
        before = self.snapshot()
        with pytest.raises(StateError):
            self.slots.pin(as_arg(chosen, form))
        assert self.snapshot() == before

    @precondition(lambda self: len(self.pinned_slots()) < self.capacity)
    @rule(data=st.data(), form=FORMS)
    def unpin_of_unpinned_slot_is_refused(self, data: st.DataObject, form: str) -> None:
        not_pinned = sorted(set(range(self.capacity)) - set(self.pinned_slots()))
        bad = data.draw(subsets(not_pinned, min_size=1))
        good = data.draw(subsets(self.pinned_slots()))
        chosen = data.draw(st.permutations(bad + good))
        before = self.snapshot()
        with pytest.raises(StateError):
            self.slots.unpin(as_arg(chosen, form))
        assert self.snapshot() == before

    @rule(
        data=st.data(),
        form=FORMS,
        op=st.sampled_from(["free", "pin", "unpin", "is_allocated", "pin_counts"]),
        offset=st.sampled_from([-1, 0, 7]),
    )
    def out_of_range_is_refused(self, data: st.DataObject, form: str, op: str, offset: int) -> None:
        bad = offset if offset < 0 else self.capacity + offset
        good = data.draw(subsets(range(self.capacity)))
        chosen = data.draw(st.permutations([bad, *good]))
        before = self.snapshot()
        with pytest.raises(ConfigError):
            getattr(self.slots, op)(as_arg(chosen, form))
        assert self.snapshot() == before

    @precondition(lambda self: self.capacity >= 2)
    @rule(data=st.data(), form=FORMS, op=st.sampled_from(["free", "pin", "unpin"]))
    def repeated_slot_is_refused(self, data: st.DataObject, form: str, op: str) -> None:
        # Whatever state the slot is in, a repeat is a bad argument, checked first.
        pool = {"free": self.unpinned(), "pin": sorted(self.pins), "unpin": self.pinned_slots()}
        good = data.draw(subsets(pool[op]))
        twice = data.draw(st.integers(min_value=0, max_value=self.capacity - 1))
        others = [s for s in good if s != twice]
        # Calls naming more slots than the capacity are covered by
        # test_repeats_naming_more_slots_than_capacity_are_config_errors; kept apart so this
        # machine keeps checking everything else.
        others = others[: self.capacity - 2]
        chosen = data.draw(st.permutations([twice, twice, *others]))
        before = self.snapshot()
        with pytest.raises(ConfigError):
            getattr(self.slots, op)(as_arg(chosen, form))
        assert self.snapshot() == before

    # ------------------------------------------------------------ invariants

    @invariant()
    def counts_match_the_model(self) -> None:
        used = len(self.pins)
        pinned = len(self.pinned_slots())
        assert self.slots.stats() == SlotStats(
            capacity=self.capacity, used=used, free=self.capacity - used, pinned=pinned
        )
        assert self.slots.free_count + self.slots.used_count == self.capacity
        assert self.slots.used_count == used

    @invariant()
    def per_slot_state_matches_the_model(self) -> None:
        everything = list(range(self.capacity))
        allocated = self.slots.is_allocated(everything)
        assert allocated.dtype == torch.bool
        assert allocated.tolist() == [s in self.pins for s in everything]
        assert self.slots.pin_counts(everything).tolist() == [
            self.pins.get(s, 0) for s in everything
        ]


def test_slot_allocator_matches_model() -> None:
    run_state_machine_as_test(
        SlotMachine, settings=settings(max_examples=60, stateful_step_count=40)
    )


# ---------------------------------------------------------------- plain tests


def test_alloc_hands_out_slots_in_order_from_zero() -> None:
    slots = SlotAllocator(10)
    assert slots.alloc(4).tolist() == [0, 1, 2, 3]
    assert slots.alloc(3).tolist() == [4, 5, 6]
    assert slots.stats() == SlotStats(capacity=10, used=7, free=3, pinned=0)


def test_alloc_more_than_free_is_capacity_error_and_allocates_nothing() -> None:
    slots = SlotAllocator(5, name="KV host pool pages")
    slots.alloc(3)
    with pytest.raises(CapacityError) as caught:
        slots.alloc(3)
    assert caught.value.requested == 3
    assert caught.value.available == 2
    assert caught.value.unit == "slots"
    assert caught.value.resource == "KV host pool pages"
    assert slots.free_count == 2
    assert slots.alloc(2).tolist() == [3, 4]


def test_alloc_zero_returns_empty_int64_tensor() -> None:
    slots = SlotAllocator(3)
    got = slots.alloc(0)
    assert got.dtype == torch.int64
    assert tuple(got.shape) == (0,)
    assert slots.used_count == 0


@pytest.mark.parametrize("n", [-1, True, 1.0, "2"])
def test_alloc_rejects_bad_counts(n: object) -> None:
    slots = SlotAllocator(3)
    with pytest.raises(ConfigError):
        slots.alloc(n)  # type: ignore[arg-type]
    assert slots.used_count == 0


@pytest.mark.parametrize("capacity", [0, -3, True, 2.0])
def test_capacity_must_be_positive_int(capacity: object) -> None:
    with pytest.raises(ConfigError):
        SlotAllocator(capacity)  # type: ignore[arg-type]


def test_alloc_result_is_independent_of_the_allocator() -> None:
    slots = SlotAllocator(4)
    got = slots.alloc(2)
    got.fill_(3)
    assert slots.alloc(2).tolist() == [2, 3]
    assert slots.is_allocated([0, 1, 2, 3]).tolist() == [True] * 4


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda v: torch.tensor(v, dtype=torch.int32), id="int32"),
        pytest.param(lambda v: torch.tensor(v, dtype=torch.int64), id="int64"),
        pytest.param(lambda v: torch.tensor(v, dtype=torch.int16), id="int16"),
        pytest.param(lambda v: torch.tensor(v, dtype=torch.uint8), id="uint8"),
        pytest.param(list, id="list"),
        pytest.param(tuple, id="tuple"),
    ],
)
def test_accepts_integer_tensors_and_sequences(
    make: Callable[[list[int]], torch.Tensor | Sequence[int]],
) -> None:
    slots = SlotAllocator(8)
    slots.alloc(8)
    slots.pin(make([1, 5]))
    assert slots.pin_counts(make([1, 5, 6])).tolist() == [1, 1, 0]
    slots.unpin(make([1, 5]))
    slots.free(make([1, 5, 7]))
    assert slots.is_allocated(make([0, 1, 5, 7])).tolist() == [True, False, False, False]
    assert slots.stats().free == 3


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(torch.tensor([0.0, 1.0]), id="float32"),
        pytest.param(torch.tensor([0.0], dtype=torch.float16), id="float16"),
        pytest.param(torch.tensor([True, False]), id="bool"),
        pytest.param(torch.tensor([0j]), id="complex"),
        pytest.param(torch.tensor([[0, 1]]), id="2-D"),
        pytest.param(torch.tensor(1), id="0-D"),
        pytest.param([0, True], id="list-with-bool"),
        pytest.param([0, 1.0], id="list-with-float"),
    ],
)
@pytest.mark.parametrize("op", ["free", "pin", "unpin", "is_allocated", "pin_counts"])
def test_rejects_non_integer_and_multi_dimensional_slots(bad: object, op: str) -> None:
    slots = SlotAllocator(4)
    slots.alloc(4)
    with pytest.raises(ConfigError):
        getattr(slots, op)(bad)
    assert slots.stats() == SlotStats(capacity=4, used=4, free=0, pinned=0)


def test_empty_batches_are_no_ops() -> None:
    slots = SlotAllocator(2)
    slots.alloc(1)
    for op in (slots.free, slots.pin, slots.unpin):
        op([])
        op(torch.empty(0, dtype=torch.int64))
    assert slots.stats() == SlotStats(capacity=2, used=1, free=1, pinned=0)


def test_errors_name_the_offending_slots() -> None:
    slots = SlotAllocator(4, name="record slots")
    slots.alloc(2)
    with pytest.raises(StateError) as caught:
        slots.free([0, 3])
    assert "[3]" in caught.value.reason
    assert "record slots" in caught.value.subject
    with pytest.raises(ConfigError) as bad:
        slots.free([9])
    assert bad.value.allowed == "0 .. 3"


def test_multiple_pins_need_as_many_unpins() -> None:
    slots = SlotAllocator(2)
    slots.alloc(1)
    slots.pin([0])
    slots.pin([0])
    assert slots.stats().pinned == 1
    slots.unpin([0])
    with pytest.raises(StateError):
        slots.free([0])
    slots.unpin([0])
    assert slots.stats().pinned == 0
    slots.free([0])


def test_pinned_context_manager_pins_and_unpins_on_exception() -> None:
    slots = SlotAllocator(4)
    slots.alloc(3)

    def transfer() -> None:
        with slots.pinned([0, 2]) as held:
            assert held.tolist() == [0, 2]
            assert slots.pin_counts([0, 1, 2]).tolist() == [1, 0, 1]
            with pytest.raises(StateError):
                slots.free([2])
            raise TransferFailedError

    with pytest.raises(TransferFailedError):
        transfer()
    assert slots.pin_counts([0, 1, 2]).tolist() == [0, 0, 0]
    assert slots.stats().pinned == 0
    slots.free([0, 2])


def test_pinned_context_manager_refuses_free_slots_without_pinning_any() -> None:
    slots = SlotAllocator(4)
    slots.alloc(1)
    with pytest.raises(StateError), slots.pinned([0, 1]):
        pytest.fail("the block must not run")
    assert slots.pin_counts([0]).tolist() == [0]


def test_reset_frees_everything_unless_pinned() -> None:
    slots = SlotAllocator(5)
    got = slots.alloc(5)
    slots.pin(got[:1])
    with pytest.raises(StateError):
        slots.reset()
    assert slots.used_count == 5
    slots.unpin(got[:1])
    slots.reset()
    assert slots.stats() == SlotStats(capacity=5, used=0, free=5, pinned=0)
    assert slots.alloc(5).tolist() == [0, 1, 2, 3, 4]


def test_freed_slots_are_handed_out_again() -> None:
    slots = SlotAllocator(3)
    slots.alloc(3)
    slots.free([1])
    assert slots.alloc(1).tolist() == [1]
    with pytest.raises(CapacityError):
        slots.alloc(1)


# ---------------------------------------------------------------- cost


def _cycle_seconds(capacity: int, cycles: int) -> float:
    slots = SlotAllocator(capacity)
    slots.alloc(capacity // 2)  # a half-full allocator, not a fresh one
    start = time.perf_counter()
    for _ in range(cycles):
        slots.free(slots.alloc(8))
    return time.perf_counter() - start


def test_alloc_and_free_cost_does_not_grow_with_capacity() -> None:
    cycles = 2000
    small: list[float] = []
    large: list[float] = []
    _cycle_seconds(1_000, 200)  # warm up torch's dispatch paths
    for _ in range(3):
        small.append(_cycle_seconds(1_000, cycles))
        large.append(_cycle_seconds(1_000_000, cycles))
    ratio = statistics.median(large) / statistics.median(small)
    assert ratio < 5, f"alloc+free got {ratio:.1f}x slower at 1000x the capacity"


@pytest.mark.parametrize(
    ("op", "capacity", "chosen"),
    [("free", 1, [0, 0]), ("pin", 1, [0, 0]), ("unpin", 1, [0, 0]), ("free", 2, [0, 0, 1])],
)
def test_repeats_naming_more_slots_than_capacity_are_config_errors(
    op: str, capacity: int, chosen: list[int]
) -> None:
    # A call can name more slots than there are only by repeating some; that is still a
    # repeat (ConfigError) and must leave the allocator as it was.
    slots = SlotAllocator(capacity)
    slots.alloc(capacity)
    if op == "unpin":
        slots.pin(list(range(capacity)))
    before = (slots.stats(), slots.pin_counts(list(range(capacity))).tolist())
    with pytest.raises(ConfigError):
        getattr(slots, op)(chosen)
    assert (slots.stats(), slots.pin_counts(list(range(capacity))).tolist()) == before


def test_threads_never_share_a_slot() -> None:
    slots = SlotAllocator(64)
    held: set[int] = set()
    guard = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        for _ in range(300):
            got = slots.alloc(5).tolist()
            with guard:
                if held & set(got):
                    errors.append(f"handed out while held: {sorted(held & set(got))}")
                held.update(got)
            with guard:
                held.difference_update(got)
            slots.free(got)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert slots.stats() == SlotStats(capacity=64, used=0, free=64, pinned=0)
