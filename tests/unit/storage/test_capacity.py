"""The capacity index bounded backends share: a refused reservation changes nothing."""

from __future__ import annotations

import pytest

from sglang_storage.errors import CapacityError
from sglang_storage.policy import LRUPolicy, S3FIFOPolicy
from sglang_storage.storage.capacity import CapacityIndex

OBJECT = 100
CAP = 10 * OBJECT


def _store(index: CapacityIndex[str], *keys: str) -> None:
    for key in keys:
        index.reserve(OBJECT)
        index.commit(key, OBJECT)


def _hot_s3fifo_index() -> tuple[CapacityIndex[str], S3FIFOPolicy[str], list[str]]:
    """A full index whose four hot objects sit in S3-FIFO's main queue with three hits."""
    policy: S3FIFOPolicy[str] = S3FIFOPolicy()
    index = CapacityIndex(CAP, policy, owner="test backend")
    hot = [f"hot{i}" for i in range(4)]
    _store(index, *hot, *(f"cold{i}" for i in range(6)))
    for key in hot * 3:
        index.access(key)
    # Room for two more: the hot heads move to main, two cold objects go.
    assert index.reserve(2 * OBJECT) == ["cold0", "cold1"]
    index.commit("new0", OBJECT)
    index.commit("new1", OBJECT)
    for key in hot * 3:
        index.access(key)
    assert all(policy.in_main(key) for key in hot)
    return index, policy, hot


def test_a_refused_reservation_keeps_s3fifo_hit_history() -> None:
    index, policy, hot = _hot_s3fifo_index()
    # A large write in flight: the small queue's six objects make way for it.
    assert len(index.reserve(6 * OBJECT)) == 6
    assert index.totals() == (4, 4 * OBJECT)
    # Only 400 bytes are indexed, so 700 more cannot be made room for: refused.
    with pytest.raises(CapacityError) as refused:
        index.reserve(7 * OBJECT)
    assert "reserved by writes in flight" in str(refused.value)
    assert index.totals() == (4, 4 * OBJECT)
    assert all(policy.in_main(key) for key in hot)  # not reinserted as new entries

    # The write in flight lands as six one-off objects; the next victims are those.
    for i in range(6):
        index.commit(f"scan{i}", OBJECT)
    victims = index.reserve(4 * OBJECT)
    assert victims == ["scan0", "scan1", "scan2", "scan3"]
    assert all(key in index for key in hot)


def test_a_refused_reservation_keeps_lru_order() -> None:
    policy: LRUPolicy[str] = LRUPolicy()
    index = CapacityIndex(CAP, policy, owner="test backend")
    _store(index, *(f"k{i}" for i in range(10)))
    index.access("k0")  # k0 is now the most recent
    assert index.reserve(5 * OBJECT) == ["k1", "k2", "k3", "k4", "k5"]
    with pytest.raises(CapacityError):
        index.reserve(6 * OBJECT)  # 5 indexed objects, 5 reserved: refused
    index.release(5 * OBJECT)
    _store(index, "x0", "x1", "x2", "x3", "x4")
    assert index.reserve(5 * OBJECT) == ["k6", "k7", "k8", "k9", "k0"]


def test_an_object_replaced_by_a_smaller_one_does_not_make_a_write_fail() -> None:
    # The policy still weighs "big" at its first size (500); the index holds 10 bytes.
    index = CapacityIndex(CAP, LRUPolicy[str](), owner="test backend")
    index.reserve(500)
    index.commit("big", 500)
    index.reserve(10)
    index.commit("big", 10)
    _store(index, *(f"k{i}" for i in range(9)))
    assert index.totals() == (10, 910)
    # 410 bytes must go: evicting "big" frees only 10, so the policy is asked again.
    assert index.reserve(500) == ["big", "k0", "k1", "k2", "k3"]
    assert index.totals() == (5, 500)


def test_key_slots_are_distinct_compact_and_give_their_keys_back() -> None:
    from sglang_storage.core import DataKind, Namespace, Shard
    from sglang_storage.storage.capacity import KeySlots

    slots = KeySlots()
    kv = Namespace(model="m", kind=DataKind.KV)
    other = Namespace(model="m", kind=DataKind.KV, shard=Shard(tp_rank=1, tp_size=2))
    page = "0123456789abcdef" * 4
    names = [page, page.upper(), "ab", "AB", "12", "a_b.c-d", "abc", "0" * 64]
    keys = [ns.key(name) for ns in (kv, other) for name in names]
    made = [slots.slot(key) for key in keys]
    assert len(set(made)) == len(keys)  # upper- and lowercase hex never meet
    assert [slots.key(slot) for slot in made] == keys
    assert len(slots.slot(kv.key(page))) == 4 + 32  # 64 lowercase hex digits as 32 bytes
    assert slots.slot(kv.key(page)) == made[0]  # the same slot for an equal key
    hex_prefix, text_prefix = slots.prefixes(kv) or (b"", b"")
    assert made[0].startswith(hex_prefix)
    assert made[1].startswith(text_prefix)
    assert slots.prefixes(Namespace(model="unseen", kind=DataKind.KV)) is None
    with pytest.raises(KeyError):
        KeySlots().key(made[0])


def test_name_slots_are_the_slots_of_the_names_keys() -> None:
    from sglang_storage.core import DataKind, Namespace
    from sglang_storage.storage.capacity import KeySlots

    page = "0123456789abcdef" * 4
    names = [page, page.upper(), "ab", "AB", "12", "a_b.c-d", "abc", "0" * 64, "a"]
    kv = Namespace(model="m", kind=DataKind.KV)
    fresh, reference = KeySlots(), KeySlots()
    assert fresh.name_slots(kv, names) == [reference.slot(kv.key(n)) for n in names]
    assert [fresh.key(s) for s in fresh.name_slots(kv, names)] == [kv.key(n) for n in names]


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "lru"])
def test_add_many_indexes_like_add_one_by_one(bounded: bool) -> None:
    def index() -> CapacityIndex[str]:
        if bounded:
            return CapacityIndex(1000, LRUPolicy(), owner="test")
        return CapacityIndex(None, None, owner="test")

    pairs = [("a", 10), ("b", 20), ("a", 5), ("c", 0), ("d", 40)]
    one, many = index(), index()
    for key, size in pairs:
        one.add(key, size)
    many.add_many(pairs)
    assert many.totals() == one.totals() == (4, 65)
    assert [many.size_of(k) for k in "abcd"] == [one.size_of(k) for k in "abcd"]
    if bounded:  # the same eviction order: "a" was re-added after "b"
        assert many.reserve(980) == one.reserve(980)
