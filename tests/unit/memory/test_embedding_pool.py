from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_storage.core import DataKind
from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.memory import (
    EmbeddingPool,
    EmbeddingPoolConfig,
    HostMemory,
    PoolStats,
)

MemoryFactory = Callable[[int], HostMemory]

DIM = 16
ROWS_PER_PAGE = 4
PAGES = 64


def config(
    *, dtype: torch.dtype = torch.float32, pages: int = PAGES, label: str = "embedding pool"
) -> EmbeddingPoolConfig:
    row_bytes = DIM * dtype.itemsize
    return EmbeddingPoolConfig(
        dim=DIM,
        dtype=dtype,
        capacity=pages * ROWS_PER_PAGE * row_bytes,
        rows_per_page=ROWS_PER_PAGE,
        label=label,
    )


def rows(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((n, DIM), generator=generator).to(dtype)


@pytest.fixture
def pool(memory: HostMemory) -> EmbeddingPool:
    return EmbeddingPool(config(), memory)


PAGE_BYTES = ROWS_PER_PAGE * DIM * 4


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 17, 64])
def test_put_get_round_trip(memory: HostMemory, dtype: torch.dtype, n: int) -> None:
    pool = EmbeddingPool(config(dtype=dtype), memory)
    data = rows(n, seed=n, dtype=dtype)
    entry = pool.put("image-1", data)
    assert entry.key == "image-1"
    assert entry.num_rows == n
    assert sum(run.length for run in entry.runs) == pool.pages_for(n)
    got = pool.get("image-1")
    assert got is not None
    assert got.dtype == dtype
    assert torch.equal(got, data)
    assert "image-1" in pool
    assert len(pool) == 1
    assert list(pool.keys()) == ["image-1"]
    assert pool.entry("image-1") == entry


@settings(max_examples=60)
@given(data=st.data())
def test_puts_and_removes_keep_every_entry_intact(
    make_memory: MemoryFactory, data: st.DataObject
) -> None:
    pool = EmbeddingPool(config(pages=16), make_memory(1 << 20))
    stored: dict[str, torch.Tensor] = {}
    for step in range(data.draw(st.integers(min_value=1, max_value=25))):
        if len(stored) > 0 and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(stored)))
            pool.remove(key)
            del stored[key]
        else:
            n = data.draw(st.integers(min_value=1, max_value=40))
            key = f"k{step}"
            value = rows(n, seed=step)
            pages_free = pool.stats().free_bytes // PAGE_BYTES
            if pool.pages_for(n) > pages_free:
                assert not pool.can_fit(n)
                with pytest.raises(CapacityError):
                    pool.put(key, value)
                assert key not in pool
            else:
                assert pool.can_fit(n)
                pool.put(key, value)
                stored[key] = value
        used_pages = sum(pool.pages_for(v.shape[0]) for v in stored.values())
        assert pool.stats().used_bytes == used_pages * PAGE_BYTES
        assert len(pool) == len(stored)
        for key, value in stored.items():
            got = pool.get(key)
            assert got is not None
            assert torch.equal(got, value), key


def test_fragmented_free_space_still_takes_an_entry(pool: EmbeddingPool) -> None:
    # Fill every page with entries of 1, 2 and 3 pages, then free every other entry.
    stored: dict[str, torch.Tensor] = {}
    sizes = [1, 2, 3]
    i = 0
    while pool.stats().free_bytes:
        pages = min(sizes[i % 3], pool.stats().free_bytes // PAGE_BYTES)
        key = f"e{i}"
        stored[key] = rows(pages * ROWS_PER_PAGE, seed=i)
        pool.put(key, stored[key])
        i += 1
    for key in list(stored)[::2]:
        pool.remove(key)
        del stored[key]
    free_pages = pool.stats().free_bytes // PAGE_BYTES
    largest_run = 3
    # More pages than any free run holds, fewer than are free in all.
    want = largest_run + 2
    assert largest_run < want <= free_pages
    big = rows(want * ROWS_PER_PAGE - 1, seed=999)
    entry = pool.put("big", big)
    assert len(entry.runs) > 1
    got = pool.get("big")
    assert got is not None
    assert torch.equal(got, big)
    for key, value in stored.items():
        kept = pool.get(key)
        assert kept is not None
        assert torch.equal(kept, value)


def test_more_rows_than_free_pages_is_capacity_error(pool: EmbeddingPool) -> None:
    pool.put("a", rows(ROWS_PER_PAGE * (PAGES - 2), seed=1))
    with pytest.raises(CapacityError) as caught:
        pool.put("b", rows(ROWS_PER_PAGE * 2 + 1, seed=2))
    assert caught.value.requested == 3
    assert caught.value.available == 2
    assert "b" not in pool
    assert pool.stats().free_bytes == 2 * PAGE_BYTES
    pool.put("c", rows(ROWS_PER_PAGE * 2, seed=3))


# ---------------------------------------------------------------- keys and pins


def test_remove_of_pinned_key_is_refused(pool: EmbeddingPool) -> None:
    data = rows(5, seed=1)
    pool.put("a", data)
    pool.pin("a")
    pool.pin("a")
    with pytest.raises(StateError):
        pool.remove("a")
    pool.unpin("a")
    with pytest.raises(StateError):
        pool.remove("a")
    got = pool.get("a")
    assert got is not None
    assert torch.equal(got, data)
    pool.unpin("a")
    with pytest.raises(StateError):
        pool.unpin("a")
    pool.remove("a")
    assert "a" not in pool
    assert pool.stats().used_bytes == 0


def test_unknown_key(pool: EmbeddingPool) -> None:
    assert pool.get("nope") is None
    assert pool.entry("nope") is None
    assert "nope" not in pool
    for call in (pool.remove, pool.pin, pool.unpin, pool.segments):
        with pytest.raises(StateError):
            call("nope")
    with pytest.raises(StateError):
        pool.read_into("nope", torch.empty(1, DIM))


def test_put_of_a_stored_key_is_refused_and_keeps_the_rows(pool: EmbeddingPool) -> None:
    first = rows(3, seed=1)
    pool.put("a", first)
    used = pool.stats().used_bytes
    with pytest.raises(StateError):
        pool.put("a", rows(9, seed=2))
    assert pool.stats().used_bytes == used
    got = pool.get("a")
    assert got is not None
    assert torch.equal(got, first)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(torch.zeros(DIM), id="1-D"),
        pytest.param(torch.zeros(2, DIM + 1), id="wrong-dim"),
        pytest.param(torch.zeros(0, DIM), id="no-rows"),
        pytest.param(torch.zeros(2, DIM, 1), id="3-D"),
        pytest.param(torch.zeros(2, DIM, dtype=torch.float16), id="float16"),
        pytest.param(torch.zeros(2, DIM, dtype=torch.int32), id="int32"),
    ],
)
def test_wrong_shape_or_dtype_is_refused(pool: EmbeddingPool, bad: torch.Tensor) -> None:
    with pytest.raises(ConfigError):
        pool.put("a", bad)
    assert "a" not in pool
    assert pool.stats().used_bytes == 0


def test_non_str_key_is_refused_without_keeping_pages(pool: EmbeddingPool) -> None:
    # SGLang's multimodal hashes are ints; a caller passing one must get an error that
    # leaves the pool as it was ("a refused call changes nothing").
    with pytest.raises(ConfigError):
        pool.put(cast(Any, 1234), rows(3, seed=1))
    assert len(pool) == 0
    assert pool.stats().used_bytes == 0


def test_stats_count_pinned_pages_once(pool: EmbeddingPool, memory: HostMemory) -> None:
    pool.put("a", rows(5, seed=1))  # 2 pages
    pool.put("b", rows(4, seed=2))  # 1 page
    pool.pin("a")
    pool.pin("a")
    assert pool.stats() == PoolStats(
        kind=DataKind.EMBEDDING,
        label="embedding pool",
        capacity_bytes=PAGES * PAGE_BYTES,
        used_bytes=3 * PAGE_BYTES,
        free_bytes=(PAGES - 3) * PAGE_BYTES,
        pinned_bytes=2 * PAGE_BYTES,
        page_locked=memory.page_locked,
    )
    pool.pin("b")
    assert pool.stats().pinned_bytes == 3 * PAGE_BYTES
    pool.unpin("a")
    assert pool.stats().pinned_bytes == 3 * PAGE_BYTES
    pool.unpin("a")
    pool.unpin("b")
    assert pool.stats().pinned_bytes == 0


# ---------------------------------------------------------------- reading


def test_read_into_a_caller_tensor(pool: EmbeddingPool) -> None:
    data = rows(7, seed=3)
    pool.put("a", data)
    out = torch.full((7, DIM), -1.0)
    pool.read_into("a", out)
    assert torch.equal(out, data)
    wider = torch.zeros(10, DIM)
    pool.read_into("a", wider[2:9])
    assert torch.equal(wider[2:9], data)
    for bad in (torch.zeros(6, DIM), torch.zeros(7, DIM + 1), torch.zeros(7 * DIM)):
        with pytest.raises(ConfigError):
            pool.read_into("a", bad)


def test_segments_are_views_of_the_pool(pool: EmbeddingPool) -> None:
    # Fragment the pool so "a" spans several runs.
    for i in range(PAGES):
        pool.put(f"p{i}", rows(ROWS_PER_PAGE, seed=i))
    for i in range(0, 8, 2):
        pool.remove(f"p{i}")
    data = rows(3 * ROWS_PER_PAGE + 1, seed=50)
    entry = pool.put("a", data)
    segments = pool.segments("a")
    assert len(segments) == len(entry.runs) == 4
    assert sum(s.shape[0] for s in segments) == data.shape[0]
    assert torch.equal(torch.cat(segments), data)
    low = pool.buffer.address
    high = low + pool.buffer.nbytes
    for segment in segments:
        assert low <= segment.data_ptr() < high
    segments[-1].fill_(42.0)
    got = pool.get("a")
    assert got is not None
    assert torch.equal(got[-1], torch.full((DIM,), 42.0))
    assert torch.equal(got[:-1], data[:-1])


# ---------------------------------------------------------------- config and life cycle


def test_config_defaults_and_validation() -> None:
    default = EmbeddingPoolConfig(dim=1024, dtype=torch.bfloat16, capacity=1 << 20)
    assert default.page_rows == (256 * 1024) // (1024 * 2)
    assert default.row_bytes == 2048
    assert default.num_pages == 4
    assert default.label == "embedding pool"
    huge_rows = EmbeddingPoolConfig(dim=1 << 20, dtype=torch.float32, capacity=8 << 20)
    assert huge_rows.page_rows == 1
    with pytest.raises(ConfigError):
        EmbeddingPoolConfig(dim=DIM, dtype=torch.float32, capacity=100, rows_per_page=4)
    with pytest.raises(ConfigError):
        EmbeddingPoolConfig(dim=DIM, dtype=torch.int32, capacity=1 << 20)
    with pytest.raises(ConfigError):
        EmbeddingPoolConfig(dim=0, dtype=torch.float32, capacity=1 << 20)
    with pytest.raises(ConfigError):
        EmbeddingPoolConfig(dim=DIM, dtype=torch.float32, capacity=1 << 20, label=" ")


def test_pool_is_charged_to_the_embedding_budget_and_closes(memory: HostMemory) -> None:
    pool = EmbeddingPool(config(), memory)
    assert memory.budget.stats().kinds[DataKind.EMBEDDING].used == PAGES * PAGE_BYTES
    assert pool.rows.shape == (PAGES * ROWS_PER_PAGE, DIM)
    pool.put("a", rows(2, seed=1))
    pool.pin("a")
    with pytest.raises(StateError):
        pool.close()
    pool.unpin("a")
    pool.close()
    assert memory.budget.stats().used == 0
    pool.close()
    with pytest.raises(StateError):
        pool.get("a")
    with pytest.raises(StateError):
        pool.put("b", rows(1, seed=2))
    with pytest.raises(StateError):
        _ = pool.rows


def test_pool_beyond_the_budget_is_capacity_error(make_memory: MemoryFactory) -> None:
    memory = make_memory(PAGES * PAGE_BYTES - 1)
    with pytest.raises(CapacityError):
        EmbeddingPool(config(), memory)
    assert memory.budget.stats().used == 0
