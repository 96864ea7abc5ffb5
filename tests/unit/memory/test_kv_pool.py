from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest
import torch

from sglang_storage.core import DataKind
from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.memory import (
    Attention,
    HostMemory,
    KVGeometry,
    KVHostPool,
    KVLayout,
    PoolStats,
)

MHA, MLA = Attention.MHA, Attention.MLA
LAYER_FIRST = KVLayout.LAYER_FIRST
PAGE_FIRST = KVLayout.PAGE_FIRST
DIRECT = KVLayout.PAGE_FIRST_DIRECT
PAGE_HEAD = KVLayout.PAGE_HEAD

COMBOS = [
    (MHA, LAYER_FIRST),
    (MHA, PAGE_FIRST),
    (MHA, DIRECT),
    (MHA, PAGE_HEAD),
    (MLA, LAYER_FIRST),
    (MLA, PAGE_FIRST),
    (MLA, DIRECT),
]
COMBO_IDS = [f"{a.value}-{layout.value}" for a, layout in COMBOS]
DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
]
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]

# Distinct sizes, so a swapped axis cannot go unnoticed.
LAYERS, PAGE, PAGES, HEADS, DIM = 3, 4, 6, 2, 8

PoolFactory = Callable[..., KVHostPool]


def make_geometry(
    attention: Attention, layout: KVLayout, dtype: torch.dtype, *, num_pages: int = PAGES
) -> KVGeometry:
    return KVGeometry(
        attention=attention,
        layout=layout,
        dtype=dtype,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=num_pages,
        head_num=1 if attention is MLA else HEADS,
        head_dim=DIM,
    )


@pytest.fixture
def make_pool(memory: HostMemory) -> PoolFactory:
    def make(
        attention: Attention = MHA,
        layout: KVLayout = PAGE_FIRST,
        dtype: torch.dtype = torch.bfloat16,
        *,
        num_pages: int = PAGES,
        label: str = "KV host pool",
    ) -> KVHostPool:
        return KVHostPool(
            make_geometry(attention, layout, dtype, num_pages=num_pages), memory, label=label
        )

    return make


# ---------------------------------------------------------------- independent reference


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in its logical (row-major) order, as a 1-D uint8 tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def raw_bytes(t: torch.Tensor) -> bytes:
    return raw(t).numpy().tobytes()


def reference_page(pool: KVHostPool, p: int) -> torch.Tensor:
    """SGLang's get_data_page(p * page_size, flat=False), written from the layout table."""
    kv, g = pool.kv_buffer, pool.geometry
    tokens = slice(p * g.page_size, (p + 1) * g.page_size)
    if g.layout is LAYER_FIRST:
        return kv[:, tokens] if g.is_mla else kv[:, :, tokens]
    if g.layout is PAGE_FIRST:
        return kv[tokens] if g.is_mla else kv[:, tokens]
    return kv[p : p + 1] if g.is_mla else kv[:, p : p + 1]


def token_row(
    tensor: torch.Tensor, g: KVGeometry, plane: int, layer: int, p: int, t: int
) -> torch.Tensor:
    """The (H, D) row of token ``t`` of page ``p`` in ``layer`` and ``plane`` (0=K, 1=V).

    ``tensor`` has the geometry's buffer shape (the pool's kv_buffer or a copy).
    """
    token = p * g.page_size + t
    where: tuple[int | slice, ...]
    if g.layout is LAYER_FIRST:
        where = (layer, token)
    elif g.layout is PAGE_FIRST:
        where = (token, layer)
    elif g.layout is DIRECT:
        where = (p, layer, t)
    else:
        where = (p, slice(None), t, layer)
    return tensor[where] if g.is_mla else tensor[(plane, *where)]


def fill_random(pool: KVHostPool, seed: int = 0) -> None:
    buffer = pool.buffer.tensor
    generator = torch.Generator().manual_seed(seed)
    buffer.copy_(torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8, generator=generator))


def random_rows(g: KVGeometry, n: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n * g.page_bytes,), dtype=torch.uint8, generator=generator)
    return data.view(g.dtype).view(n, g.page_numel)


def page_bytes_snapshot(pool: KVHostPool) -> list[bytes]:
    return [raw_bytes(reference_page(pool, p)) for p in range(pool.geometry.num_pages)]


# ---------------------------------------------------------------- read and write


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_read_pages_matches_sglang_page_order(
    make_pool: PoolFactory, attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> None:
    pool = make_pool(attention, layout, dtype)
    g = pool.geometry
    assert tuple(pool.kv_buffer.shape) == g.buffer_shape
    assert pool.kv_buffer.dtype == dtype
    fill_random(pool)
    pages = [3, 0, 5]
    rows = pool.read_pages(pages)
    assert rows.dtype == dtype
    assert tuple(rows.shape) == (3, g.page_numel)
    for row, p in zip(rows, pages, strict=True):
        assert raw_bytes(row) == raw_bytes(reference_page(pool, p))
    assert raw_bytes(pool.read_page(4)) == raw_bytes(reference_page(pool, 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_write_pages_then_read_back(
    make_pool: PoolFactory, attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> None:
    pool = make_pool(attention, layout, dtype)
    g = pool.geometry
    fill_random(pool)
    before = page_bytes_snapshot(pool)
    pages = [4, 1]
    data = random_rows(g, 2)
    pool.write_pages(torch.tensor(pages), data)
    assert raw_bytes(pool.read_pages(pages)) == raw_bytes(data)
    after = page_bytes_snapshot(pool)
    for p in range(g.num_pages):
        if p in pages:
            assert after[p] == raw_bytes(data[pages.index(p)])
        else:
            assert after[p] == before[p], f"page {p} was not written but changed"


@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("shape", ["flat", "rows"])
def test_write_pages_accepts_raw_bytes(
    make_pool: PoolFactory, attention: Attention, layout: KVLayout, shape: str
) -> None:
    pool = make_pool(attention, layout, torch.bfloat16)
    g = pool.geometry
    data = raw(random_rows(g, 3, seed=7))
    if shape == "rows":
        data = data.view(3, g.page_bytes)
    pool.write_pages([2, 5, 0], data)
    assert raw_bytes(pool.read_pages([2, 5, 0])) == data.numpy().tobytes()
    assert raw_bytes(reference_page(pool, 5)) == raw_bytes(
        data.reshape(-1)[g.page_bytes :][: g.page_bytes]
    )


@pytest.mark.parametrize(
    "carve",
    [
        pytest.param(lambda buf, n: buf[1 : 1 + n], id="odd-offset"),
        pytest.param(lambda buf, n: buf[:n].view(n, 1), id="column"),
    ],
)
def test_write_pages_accepts_raw_bytes_in_any_uint8_tensor(
    make_pool: PoolFactory, carve: Callable[[torch.Tensor, int], torch.Tensor]
) -> None:
    # The contract: "a uint8 tensor of n * page_bytes elements". A payload that sits after
    # an odd-sized header in a larger byte buffer, or has another shape, is such a tensor.
    pool = make_pool(MHA, PAGE_FIRST, torch.bfloat16)
    g = pool.geometry
    n = 2
    backing = torch.randint(0, 256, (n * g.page_bytes + 1,), dtype=torch.uint8)
    data = carve(backing, n * g.page_bytes)
    pool.write_pages([0, 3], data)
    assert raw_bytes(pool.read_pages([0, 3])) == data.contiguous().numpy().tobytes()


def test_write_page_and_read_page(make_pool: PoolFactory) -> None:
    pool = make_pool(MHA, DIRECT, torch.float16)
    data = random_rows(pool.geometry, 1)[0]
    pool.write_page(2, data)
    assert raw_bytes(pool.read_page(2)) == raw_bytes(data)


@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_read_pages_fills_the_given_out_tensor(
    make_pool: PoolFactory, attention: Attention, layout: KVLayout
) -> None:
    pool = make_pool(attention, layout, torch.float32)
    g = pool.geometry
    fill_random(pool, seed=3)
    out = torch.zeros((2, g.page_numel), dtype=torch.float32)
    got = pool.read_pages([5, 1], out=out)
    assert got.data_ptr() == out.data_ptr()
    assert raw_bytes(out[0]) == raw_bytes(reference_page(pool, 5))
    assert raw_bytes(out[1]) == raw_bytes(reference_page(pool, 1))


@pytest.mark.parametrize(
    "out",
    [
        pytest.param(torch.zeros((2, 1), dtype=torch.float32), id="shape"),
        pytest.param(torch.zeros((3, LAYERS * 2 * PAGE * HEADS * DIM)), id="rows"),
        pytest.param(
            torch.zeros((2, 2 * LAYERS * PAGE * HEADS * DIM), dtype=torch.bfloat16), id="dtype"
        ),
        pytest.param(torch.zeros((2 * LAYERS * PAGE * HEADS * DIM, 2)).t(), id="non-contiguous"),
    ],
)
def test_read_pages_rejects_a_wrong_out_tensor(make_pool: PoolFactory, out: torch.Tensor) -> None:
    pool = make_pool(MHA, PAGE_FIRST, torch.float32)
    with pytest.raises(ConfigError):
        pool.read_pages([0, 1], out=out)


def test_index_forms_are_accepted(make_pool: PoolFactory) -> None:
    pool = make_pool(MHA, PAGE_HEAD, torch.bfloat16)
    fill_random(pool)
    expected = raw_bytes(pool.read_pages([1, 3, 5]))
    assert raw_bytes(pool.read_pages(torch.tensor([1, 3, 5], dtype=torch.int32))) == expected
    assert raw_bytes(pool.read_pages((1, 3, 5))) == expected
    strided = torch.arange(6, dtype=torch.int64)[1::2]
    assert raw_bytes(pool.read_pages(strided)) == expected


def test_empty_batches(make_pool: PoolFactory) -> None:
    pool = make_pool(MLA, LAYER_FIRST, torch.bfloat16)
    g = pool.geometry
    assert tuple(pool.read_pages([]).shape) == (0, g.page_numel)
    pool.write_pages([], torch.empty((0, g.page_numel), dtype=torch.bfloat16))
    assert pool.page_regions([]) == []


def test_large_batches_read_and_check_ranges(make_pool: PoolFactory) -> None:
    # Batches above a few dozen pages take another range-check path.
    pool = make_pool(MHA, LAYER_FIRST, torch.uint8, num_pages=80)
    fill_random(pool, seed=5)
    pages = list(range(79, 19, -1))
    rows = pool.read_pages(pages)
    for row, p in zip(rows, pages, strict=True):
        assert raw_bytes(row) == raw_bytes(reference_page(pool, p))
    data = random_rows(pool.geometry, len(pages), seed=9)
    pool.write_pages(pages, data)
    assert raw_bytes(pool.read_pages(pages)) == raw_bytes(data)
    with pytest.raises(ConfigError):
        pool.read_pages([*pages, 80])
    with pytest.raises(ConfigError):
        pool.write_pages([*pages[1:], pages[0], pages[0]], random_rows(pool.geometry, 61))


# ---------------------------------------------------------------- refused writes


def test_write_with_wrong_size_or_dtype_is_refused(make_pool: PoolFactory) -> None:
    pool = make_pool(MHA, PAGE_FIRST, torch.bfloat16)
    g = pool.geometry
    fill_random(pool)
    before = page_bytes_snapshot(pool)
    bad = [
        random_rows(g, 1),  # one page of data for two pages
        random_rows(g, 3),  # three
        random_rows(g, 2).float(),  # wrong element type
        random_rows(g, 2).view(torch.int16),  # same size, wrong element type
        raw(random_rows(g, 2))[:-2],  # raw bytes, two short
        torch.cat([raw(random_rows(g, 2)), torch.zeros(2, dtype=torch.uint8)]),  # two long
    ]
    for data in bad:
        with pytest.raises(ConfigError):
            pool.write_pages([0, 1], data)
    assert page_bytes_snapshot(pool) == before


def test_write_with_repeated_pages_is_refused_and_writes_nothing(make_pool: PoolFactory) -> None:
    pool = make_pool(MHA, LAYER_FIRST, torch.float32)
    fill_random(pool)
    before = page_bytes_snapshot(pool)
    with pytest.raises(ConfigError):
        pool.write_pages([1, 2, 1], random_rows(pool.geometry, 3))
    assert page_bytes_snapshot(pool) == before


@pytest.mark.parametrize("bad", [-1, PAGES, PAGES + 10])
def test_out_of_range_pages_are_refused(make_pool: PoolFactory, bad: int) -> None:
    pool = make_pool(MLA, PAGE_FIRST, torch.bfloat16)
    fill_random(pool)
    before = page_bytes_snapshot(pool)
    with pytest.raises(ConfigError):
        pool.read_pages([0, bad])
    with pytest.raises(ConfigError):
        pool.write_pages([bad, 0], random_rows(pool.geometry, 2))
    with pytest.raises(ConfigError):
        pool.page_regions([bad])
    with pytest.raises(ConfigError):
        pool.page(bad)
    with pytest.raises(ConfigError):
        pool.free([bad])
    assert page_bytes_snapshot(pool) == before


@pytest.mark.parametrize("bad", [torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]]), [0, True]])
def test_non_integer_page_indices_are_refused(make_pool: PoolFactory, bad: object) -> None:
    pool = make_pool()
    with pytest.raises(ConfigError):
        pool.read_pages(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- views


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_page_view_is_the_page_and_writes_through(
    make_pool: PoolFactory, attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> None:
    pool = make_pool(attention, layout, dtype)
    g = pool.geometry
    fill_random(pool)
    for p in range(g.num_pages):
        view = pool.page(p)
        assert tuple(view.shape) == g.page_shape
        assert raw_bytes(view) == raw_bytes(reference_page(pool, p))
    before = page_bytes_snapshot(pool)
    view = pool.page(2)
    new = random_rows(g, 1, seed=11)[0]
    view.view(torch.uint8).copy_(raw(new).view(view.view(torch.uint8).shape))
    assert raw_bytes(pool.read_page(2)) == raw_bytes(new)
    after = page_bytes_snapshot(pool)
    assert [after[p] == before[p] for p in range(g.num_pages)] == [
        p != 2 for p in range(g.num_pages)
    ]


@pytest.mark.parametrize("bad", [-1, PAGES, True, 1.0])
def test_page_rejects_bad_page_numbers(make_pool: PoolFactory, bad: object) -> None:
    pool = make_pool()
    with pytest.raises(ConfigError):
        pool.page(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8], ids=str)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_layer_views_address_exactly_the_layout_rows(
    make_pool: PoolFactory, attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> None:
    pool = make_pool(attention, layout, dtype)
    g = pool.geometry
    kv = pool.kv_buffer
    heads = g.head_num
    for layer in range(g.layer_num):
        view = pool.layer(layer)
        assert tuple(view.k.shape) == (g.num_pages, g.page_size, heads, g.head_dim)
        if g.is_mla:
            assert view.v is None
        else:
            assert view.v is not None
            assert tuple(view.v.shape) == tuple(view.k.shape)
        for p, t in ((0, 0), (5, 3), (2, 1)):
            planes = [view.k] if view.v is None else [view.k, view.v]
            for plane, tensor in enumerate(planes):
                kv.zero_()
                marker = torch.arange(1, heads * g.head_dim + 1).view(heads, g.head_dim)
                tensor[p, t] = marker.to(dtype)
                expected = torch.zeros_like(kv)
                token_row(expected, g, plane, layer, p, t).copy_(marker.to(dtype))
                assert torch.equal(kv, expected), (layer, p, t, plane)


@pytest.mark.parametrize("bad", [-1, LAYERS, True, 0.0])
def test_layer_rejects_bad_layer_ids(make_pool: PoolFactory, bad: object) -> None:
    pool = make_pool()
    with pytest.raises(ConfigError):
        pool.layer(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- zero-copy regions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_page_regions_cover_each_page(
    make_pool: PoolFactory, attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> None:
    pool = make_pool(attention, layout, dtype)
    g = pool.geometry
    fill_random(pool, seed=4)
    pages = [5, 0, 3]
    regions = pool.page_regions(torch.tensor(pages))
    per_page = g.kv_planes * (g.layer_num if layout is LAYER_FIRST else 1)
    assert len(regions) == len(pages) * per_page
    low, high = pool.buffer.address, pool.buffer.address + pool.buffer.nbytes
    for address, nbytes in regions:
        assert low <= address
        assert address + nbytes <= high
    for i, p in enumerate(pages):
        mine = regions[i * per_page : (i + 1) * per_page]
        assert sum(nbytes for _, nbytes in mine) == g.page_bytes
        chunks = [ctypes.string_at(address, nbytes) for address, nbytes in mine]
        # Regions come K, V per layer (layer_first) or K, V per page; SGLang's flat page is
        # all of K, then all of V.
        ordered = chunks if g.is_mla else chunks[0::2] + chunks[1::2]
        assert b"".join(ordered) == raw_bytes(reference_page(pool, p))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_page_views_concatenate_to_the_flat_page(
    make_pool: PoolFactory, attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> None:
    pool = make_pool(attention, layout, dtype)
    g = pool.geometry
    fill_random(pool, seed=5)
    for p in range(g.num_pages):
        views = pool.page_views(p)
        per_page = g.kv_planes * (g.layer_num if layout is LAYER_FIRST else 1)
        assert len(views) == per_page
        assert all(not v.readonly and v.c_contiguous for v in views)
        assert b"".join(bytes(v) for v in views) == raw_bytes(reference_page(pool, p))
    spec = pool.page_spec
    assert spec.nbytes == g.page_bytes
    assert spec.shape == g.page_shape
    assert spec.layout == layout.value
    assert spec.dtype == str(dtype).removeprefix("torch.")


def test_page_views_write_through_to_the_pool(make_pool: PoolFactory) -> None:
    pool = make_pool(MHA, LAYER_FIRST, torch.bfloat16)
    g = pool.geometry
    data = bytes(range(256)) * (g.page_bytes // 256 + 1)
    offset = 0
    for view in pool.page_views(2):
        view[:] = data[offset : offset + view.nbytes]
        offset += view.nbytes
    assert raw_bytes(reference_page(pool, 2)) == data[: g.page_bytes]
    with pytest.raises(ConfigError):
        pool.page_views(g.num_pages)


# ---------------------------------------------------------------- allocation, stats, life cycle


def test_pins_guard_pages_against_free(make_pool: PoolFactory) -> None:
    pool = make_pool(MHA, PAGE_FIRST, torch.float16)
    page = pool.geometry.page_bytes
    pages = pool.alloc(4)
    assert pages.tolist() == [0, 1, 2, 3]
    pool.pin(pages[:2])
    assert pool.stats().pinned_bytes == 2 * page
    with pytest.raises(StateError):
        pool.free(pages)
    assert pool.stats().used_bytes == 4 * page
    pool.free(pages[2:])
    pool.unpin(pages[:2])
    with pytest.raises(StateError):
        pool.unpin(pages[:1])
    with pool.pinned(pages[:1]) as held:
        assert held.tolist() == [0]
        assert pool.slots.pin_counts([0]).tolist() == [1]
        with pytest.raises(StateError):
            pool.free([0])
    pool.free(pages[:2])
    assert pool.stats().used_bytes == 0


def test_stats_report_bytes(make_pool: PoolFactory, memory: HostMemory) -> None:
    pool = make_pool(MLA, DIRECT, torch.bfloat16, label="decode KV")
    page = pool.geometry.page_bytes
    pages = pool.alloc(3)
    pool.pin(pages[:1])
    assert pool.stats() == PoolStats(
        kind=DataKind.KV,
        label="decode KV",
        capacity_bytes=PAGES * page,
        used_bytes=3 * page,
        free_bytes=(PAGES - 3) * page,
        pinned_bytes=page,
        page_locked=memory.page_locked,
    )
    assert pool.label == "decode KV"
    with pytest.raises(CapacityError):
        pool.alloc(PAGES)


def test_pool_memory_is_charged_to_kv_and_returned_on_close(
    make_pool: PoolFactory, memory: HostMemory
) -> None:
    pool = make_pool(MHA, PAGE_HEAD, torch.float32)
    g = pool.geometry
    usage = memory.budget.stats().kinds[DataKind.KV]
    assert usage.used == g.total_bytes
    assert pool.buffer.nbytes == g.total_bytes
    assert pool.buffer.address % 4096 == 0
    assert pool.kv_buffer.data_ptr() == pool.buffer.address
    pool.close()
    assert memory.budget.stats().used == 0
    pool.close()  # a second close is a no-op
    assert memory.budget.stats().used == 0


def test_context_manager_closes(memory: HostMemory) -> None:
    g = make_geometry(MHA, PAGE_FIRST, torch.bfloat16)
    with KVHostPool(g, memory) as pool:
        assert memory.budget.stats().used == g.total_bytes
        pool.alloc(1)
    assert memory.budget.stats().used == 0


def test_pool_larger_than_budget_is_capacity_error(
    make_memory: Callable[[int], HostMemory],
) -> None:
    memory = make_memory(16 << 10)
    g = make_geometry(MHA, PAGE_FIRST, torch.float32, num_pages=64)
    assert g.total_bytes > 16 << 10
    with pytest.raises(CapacityError):
        KVHostPool(g, memory)
    assert memory.budget.stats().used == 0


def test_close_is_refused_while_pages_are_pinned(
    make_pool: PoolFactory, memory: HostMemory
) -> None:
    pool = make_pool()
    pages = pool.alloc(2)
    pool.pin(pages[1:])
    with pytest.raises(StateError):
        pool.close()
    assert memory.budget.stats().used == pool.geometry.total_bytes
    fill_random(pool)
    assert raw_bytes(pool.read_page(0)) == raw_bytes(reference_page(pool, 0))
    pool.unpin(pages[1:])
    pool.close()
    assert memory.budget.stats().used == 0


CLOSED_CALLS: list[tuple[str, Callable[[KVHostPool], object]]] = [
    ("alloc", lambda pool: pool.alloc(1)),
    ("read_pages", lambda pool: pool.read_pages([0])),
    ("write_pages", lambda pool: pool.write_pages([0], torch.zeros(0, dtype=torch.uint8))),
    ("read_page", lambda pool: pool.read_page(0)),
    ("write_page", lambda pool: pool.write_page(0, torch.zeros(1, dtype=torch.bfloat16))),
    ("page", lambda pool: pool.page(0)),
    ("layer", lambda pool: pool.layer(0)),
    ("page_regions", lambda pool: pool.page_regions([0])),
    ("kv_buffer", lambda pool: pool.kv_buffer),
    ("buffer", lambda pool: pool.buffer),
]


@pytest.mark.parametrize("call", [c for _, c in CLOSED_CALLS], ids=[n for n, _ in CLOSED_CALLS])
def test_calls_after_close_raise_state_error(
    make_pool: PoolFactory, call: Callable[[KVHostPool], object]
) -> None:
    pool = make_pool()
    pool.close()
    with pytest.raises(StateError):
        call(pool)


def test_pinning_pages_after_close_raises_state_error(make_pool: PoolFactory) -> None:
    # "The pool cannot be used afterwards": pinning pages of a closed pool would let a
    # transfer start on memory that went back to the budget (and, if pinned, to CUDA).
    pool = make_pool()
    pool.alloc(1)
    pool.close()
    with pytest.raises(StateError):
        pool.pin([0])
    with pytest.raises(StateError), pool.pinned([0]):
        pass


def test_token_indices_address_the_same_page(make_pool: PoolFactory) -> None:
    pool = make_pool(MHA, PAGE_FIRST, torch.float32)
    fill_random(pool)
    tokens = pool.geometry.token_indices(torch.tensor([3]))
    assert raw_bytes(pool.kv_buffer[:, tokens]) == raw_bytes(pool.page(3))
    assert pool.geometry.pages_of_tokens(tokens[:: pool.geometry.page_size]).tolist() == [3]
