from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_storage.config import build_config
from sglang_storage.core import DataKind
from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.memory import (
    BudgetConfig,
    HostMemoryBudget,
    KindUsage,
    Lease,
    MemoryFacts,
    read_memory_facts,
)

GiB = 1 << 30
PLENTY = MemoryFacts(physical=64 * GiB, available=64 * GiB)
KV, EMB, REC, WEIGHT = DataKind.KV, DataKind.EMBEDDING, DataKind.RECORD, DataKind.WEIGHT


def budget(total: int = 1000, *, facts: MemoryFacts = PLENTY, **reserved: int) -> HostMemoryBudget:
    return HostMemoryBudget(BudgetConfig(total=total, headroom=0, **reserved), facts=facts)


def usage(b: HostMemoryBudget, kind: DataKind) -> KindUsage:
    return b.stats().kinds[kind]


def released(lease: Lease) -> bool:
    return lease.released


# ---------------------------------------------------------------- BudgetConfig


def test_reservations_must_fit_in_total() -> None:
    with pytest.raises(ConfigError) as caught:
        BudgetConfig(total=100, kv=60, embedding=41)
    assert "kv" in caught.value.field
    config = BudgetConfig(total=100, kv=60, embedding=40)
    assert dict(config.reservations()) == {KV: 60, EMB: 40, REC: 0, WEIGHT: 0}


@pytest.mark.parametrize("field", ["total", "kv", "embedding", "record", "weight", "headroom"])
@pytest.mark.parametrize("value", [-1, 1.5, True, "1GiB"])
def test_sizes_must_be_non_negative_ints(field: str, value: object) -> None:
    values: dict[str, Any] = {"total": 10, field: value}
    with pytest.raises(ConfigError) as caught:
        BudgetConfig(**values)
    assert caught.value.field == field


def test_build_config_takes_size_strings() -> None:
    config = build_config(
        BudgetConfig,
        {"total": "1GiB", "kv": "512MiB", "embedding": "256 MiB", "headroom": "4GiB"},
    )
    assert config.total == GiB
    assert config.kv == 512 << 20
    assert config.embedding == 256 << 20
    assert config.record == 0
    assert config.headroom == 4 * GiB


def test_build_config_checks_the_reservations_too() -> None:
    with pytest.raises(ConfigError):
        build_config(BudgetConfig, {"total": "1GiB", "kv": "2GiB"})


def test_default_headroom_is_two_gib() -> None:
    assert BudgetConfig(total=0).headroom == 2 * GiB


# ---------------------------------------------------------------- what the machine holds


def test_budget_beyond_usable_memory_is_refused_with_the_numbers() -> None:
    facts = MemoryFacts(physical=16 * GiB, available=8 * GiB)
    with pytest.raises(CapacityError) as caught:
        HostMemoryBudget(BudgetConfig(total=7 * GiB, headroom=2 * GiB), facts=facts)
    error = caught.value
    assert error.requested == 7 * GiB
    assert error.available == 6 * GiB
    message = str(error)
    assert str(7 * GiB) in message
    assert str(6 * GiB) in message
    assert "16 GiB" in message  # physical
    assert "8 GiB" in message  # available


def test_budget_that_fits_with_headroom_is_accepted() -> None:
    facts = MemoryFacts(physical=16 * GiB, available=8 * GiB)
    b = HostMemoryBudget(BudgetConfig(total=6 * GiB, headroom=2 * GiB), facts=facts)
    assert b.facts == facts
    assert b.config.total == 6 * GiB


def test_usable_is_bounded_by_the_cgroup() -> None:
    facts = MemoryFacts(
        physical=64 * GiB, available=60 * GiB, cgroup_limit=8 * GiB, cgroup_usage=2 * GiB
    )
    assert facts.usable == 6 * GiB
    assert "cgroup limit 8 GiB" in facts.describe()
    assert budget(total=6 * GiB, facts=facts).config.total == 6 * GiB
    with pytest.raises(CapacityError) as caught:
        budget(total=6 * GiB + 1, facts=facts)
    assert caught.value.available == 6 * GiB
    assert "cgroup" in str(caught.value)


def test_usable_without_cgroup_is_available_memory() -> None:
    assert MemoryFacts(physical=10, available=7).usable == 7


def test_usable_is_available_when_the_cgroup_is_roomier() -> None:
    facts = MemoryFacts(physical=64, available=5, cgroup_limit=32, cgroup_usage=1)
    assert facts.usable == 5


def test_usable_is_zero_when_the_cgroup_is_over_its_limit() -> None:
    facts = MemoryFacts(physical=64, available=50, cgroup_limit=8, cgroup_usage=9)
    assert facts.usable == 0
    with pytest.raises(CapacityError):
        budget(total=1, facts=facts)
    assert budget(total=0, facts=facts).stats().total == 0


def test_ranks_on_one_host_share_usable_memory() -> None:
    facts = MemoryFacts(physical=64 * GiB, available=40 * GiB)
    config = BudgetConfig(total=10 * GiB, headroom=0, ranks_per_host=4)
    assert HostMemoryBudget(config, facts=facts).config.ranks_per_host == 4
    with pytest.raises(CapacityError) as caught:
        HostMemoryBudget(
            BudgetConfig(total=10 * GiB + 1, headroom=0, ranks_per_host=4), facts=facts
        )
    assert caught.value.available == 10 * GiB


def test_read_memory_facts_on_this_machine() -> None:
    facts = read_memory_facts()
    assert facts.physical >= facts.available > 0
    if facts.cgroup_limit is not None:
        assert 0 < facts.cgroup_limit < facts.physical
        assert facts.cgroup_usage >= 0
    assert 0 <= facts.usable <= facts.available


# ---------------------------------------------------------------- acquire and release


def test_acquire_uses_the_reservation_then_borrows() -> None:
    b = budget(total=1000, kv=400, embedding=300)
    stats = b.stats()
    assert (stats.total, stats.unreserved, stats.unreserved_free) == (1000, 300, 300)
    first = b.acquire(KV, 300, label="KV host pool")
    assert first.borrowed == 0
    assert usage(b, KV) == KindUsage(reserved=400, used=300, borrowed=0)
    second = b.acquire(KV, 200, label="KV host pool 2")
    assert second.borrowed == 100
    assert usage(b, KV) == KindUsage(reserved=400, used=500, borrowed=100)
    assert b.stats().unreserved_free == 200
    assert b.stats().used == 500
    assert b.available(KV) == 200
    assert b.available(EMB) == 500
    assert b.available(REC) == 200


def test_a_kind_never_takes_another_kinds_reservation() -> None:
    b = budget(total=1000, kv=400, embedding=300)
    with pytest.raises(CapacityError) as caught:
        b.acquire(KV, 701, label="KV host pool")
    assert caught.value.requested == 701
    assert caught.value.available == 700
    assert "kv" in str(caught.value)
    assert b.stats().used == 0
    b.acquire(KV, 700, label="KV host pool")
    # Embedding's 300 are still there for embedding, and only for it.
    with pytest.raises(CapacityError):
        b.acquire(REC, 1, label="records")
    assert b.acquire(EMB, 300, label="embeddings").borrowed == 0
    with pytest.raises(CapacityError):
        b.acquire(EMB, 1, label="embeddings")


def test_release_returns_bytes_and_double_release_is_refused() -> None:
    b = budget(total=1000, kv=100)
    lease = b.acquire(KV, 600, label="KV host pool")
    assert isinstance(lease, Lease)
    assert (lease.kind, lease.nbytes, lease.label, lease.borrowed) == (KV, 600, "KV host pool", 500)
    assert not released(lease)
    lease.release()
    assert released(lease)
    assert usage(b, KV) == KindUsage(reserved=100, used=0, borrowed=0)
    assert b.stats().unreserved_free == 900
    with pytest.raises(StateError):
        lease.release()
    assert b.stats().used == 0


def test_releasing_in_another_order_keeps_borrowing_right() -> None:
    b = budget(total=1000, kv=100)
    own = b.acquire(KV, 100, label="a")
    borrowing = b.acquire(KV, 300, label="b")
    assert (own.borrowed, borrowing.borrowed) == (0, 300)
    own.release()
    # 300 used against a 100 reservation: 200 borrowed now.
    assert usage(b, KV) == KindUsage(reserved=100, used=300, borrowed=200)
    assert b.stats().unreserved_free == 700
    borrowing.release()
    assert usage(b, KV).borrowed == 0


def test_zero_byte_lease() -> None:
    b = budget(total=0)
    with b.acquire(WEIGHT, 0, label="empty") as lease:
        assert lease.nbytes == 0
    assert lease.released


@pytest.mark.parametrize("nbytes", [-1, 1.0, True, "1"])
def test_acquire_rejects_bad_sizes(nbytes: object) -> None:
    b = budget()
    with pytest.raises(ConfigError):
        b.acquire(KV, nbytes, label="x")  # type: ignore[arg-type]
    assert b.stats().used == 0


@pytest.mark.parametrize("kind", ["kv", None, 0])
def test_acquire_rejects_non_kinds(kind: object) -> None:
    b = budget()
    with pytest.raises(ConfigError):
        b.acquire(kind, 1, label="x")  # type: ignore[arg-type]
    assert b.stats().used == 0


@pytest.mark.parametrize("label", ["", "   "])
def test_acquire_with_a_bad_label_takes_nothing(label: str) -> None:
    # "ConfigError ... nothing was taken": a refused call must not keep the bytes.
    b = budget()
    with pytest.raises(ConfigError):
        b.acquire(KV, 100, label=label)
    assert b.stats().used == 0
    assert b.available(KV) == 1000


def test_leased_context_manager() -> None:
    b = budget(total=100)
    with b.leased(EMB, 60, label="scratch") as lease:
        assert usage(b, EMB).used == 60
        assert lease.nbytes == 60
    assert lease.released
    assert b.stats().used == 0
    with pytest.raises(RuntimeError), b.leased(EMB, 60, label="scratch"):
        raise RuntimeError("body failed")
    assert b.stats().used == 0
    with b.leased(EMB, 60, label="scratch") as early:
        early.release()  # releasing inside the block is fine; exit does not release again
    assert b.stats().used == 0
    with pytest.raises(CapacityError), b.leased(EMB, 101, label="too much"):
        pytest.fail("the block must not run")
    assert b.stats().used == 0


def test_concurrent_acquire_and_release_balance() -> None:
    b = budget(total=10_000, kv=1000)

    def worker() -> None:
        for _ in range(300):
            b.acquire(KV, 7, label="worker").release()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert b.stats().used == 0
    assert usage(b, KV).borrowed == 0


# ---------------------------------------------------------------- accounting property

reservations = st.fixed_dictionaries(
    {name: st.integers(min_value=0, max_value=300) for name in ("kv", "embedding", "record")}
)


@settings(max_examples=80)
@given(
    reserved=reservations,
    extra=st.integers(min_value=0, max_value=300),
    data=st.data(),
)
def test_borrowing_accounting_under_any_sequence(
    reserved: dict[str, int], extra: int, data: st.DataObject
) -> None:
    total = sum(reserved.values()) + extra
    b = HostMemoryBudget(BudgetConfig(total=total, headroom=0, **reserved), facts=PLENTY)
    own = dict(b.config.reservations())
    used = dict.fromkeys(DataKind, 0)
    leases: list[Lease] = []
    for _ in range(data.draw(st.integers(min_value=1, max_value=30))):
        if len(leases) > 0 and data.draw(st.booleans()):
            lease = leases.pop(data.draw(st.integers(min_value=0, max_value=len(leases) - 1)))
            lease.release()
            used[lease.kind] -= lease.nbytes
        else:
            kind = data.draw(st.sampled_from(list(DataKind)))
            nbytes = data.draw(st.integers(min_value=0, max_value=total + 10))
            borrowed = {k: max(0, used[k] - own[k]) for k in DataKind}
            room = max(0, own[kind] - used[kind]) + extra - sum(borrowed.values())
            assert b.available(kind) == room
            if nbytes > room:
                with pytest.raises(CapacityError) as caught:
                    b.acquire(kind, nbytes, label="prop")
                assert caught.value.available == room
            else:
                lease = b.acquire(kind, nbytes, label="prop")
                assert lease.borrowed == max(0, nbytes - max(0, own[kind] - used[kind]))
                leases.append(lease)
                used[kind] += nbytes
        stats = b.stats()
        for kind in DataKind:
            assert stats.kinds[kind] == KindUsage(
                reserved=own[kind], used=used[kind], borrowed=max(0, used[kind] - own[kind])
            )
        assert stats.unreserved == extra
        assert stats.unreserved_free == extra - sum(u.borrowed for u in stats.kinds.values())
        assert stats.unreserved_free >= 0
        assert stats.used == sum(used.values()) <= total
