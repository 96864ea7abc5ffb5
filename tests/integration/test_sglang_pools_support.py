"""support.sglang_pools builds SGLang's own host KV pools on CPU, with the documented shapes.

Each buildable (attention, layout, dtype) gets the buffer shape SGLang's
``init_kv_buffer`` documents and exactly ``num_pages`` usable pages; the flat page API
round-trips random bytes for every layout but ``page_unified`` (where SGLang raises).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.sglang_pools import (
    FP8_DTYPES,
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE_API_LAYOUTS,
    Attention,
    SGLangHostPool,
    build_sglang_host_pool,
)

pytestmark = pytest.mark.sglang

TESTS = Path(__file__).resolve().parents[1]

# Distinct sizes, so a swapped axis shows in the shape.
LAYERS, PAGE, PAGES, HEADS, HEAD_DIM = 3, 4, 5, 2, 8
KV_LORA_RANK, ROPE_DIM = 16, 16
MLA_DIM = KV_LORA_RANK + ROPE_DIM
SIZE = PAGE * PAGES

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
DTYPE_PARAMS = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in DTYPES]

COMBOS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]
PAGE_API_COMBOS = [c for c in COMBOS if c[1] in PAGE_API_LAYOUTS]

EXPECTED_SHAPES: dict[tuple[str, str], tuple[int, ...]] = {
    ("mha", "layer_first"): (2, LAYERS, SIZE, HEADS, HEAD_DIM),
    ("mha", "page_first"): (2, SIZE, LAYERS, HEADS, HEAD_DIM),
    ("mha", "page_first_direct"): (2, PAGES, LAYERS, PAGE, HEADS, HEAD_DIM),
    ("mha", "page_head"): (2, PAGES, HEADS, PAGE, LAYERS, HEAD_DIM),
    # (page, head_group, layer, K/V, page_size, head_in_group, head_dim); one head group.
    ("mha", "page_unified"): (PAGES, 1, LAYERS, 2, PAGE, HEADS, HEAD_DIM),
    ("mla", "layer_first"): (LAYERS, SIZE, 1, MLA_DIM),
    ("mla", "page_first"): (SIZE, LAYERS, 1, MLA_DIM),
    ("mla", "page_first_direct"): (PAGES, LAYERS, PAGE, 1, MLA_DIM),
    ("mla", "page_unified"): (PAGES, LAYERS, PAGE, MLA_DIM),
}


def build(attention: Attention, layout: str, dtype: torch.dtype) -> SGLangHostPool:
    return build_sglang_host_pool(
        attention=attention,
        layout=layout,
        dtype=dtype,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=PAGES,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
    )


def page_bytes(attention: str) -> int:
    """Bytes of one flat page, per store-dtype byte."""
    row = 2 * HEADS * HEAD_DIM if attention == "mha" else MLA_DIM
    return LAYERS * PAGE * row


def random_page(pool: SGLangHostPool, seed: int) -> torch.Tensor:
    nbytes = page_bytes(pool.attention) * pool.store_dtype.itemsize
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(pool.store_dtype)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize(("attention", "layout"), COMBOS)
def test_buffer_has_the_documented_shape_and_exact_page_count(
    attention: Attention, layout: str, dtype: torch.dtype
) -> None:
    pool = build(attention, layout, dtype)

    expected_store = torch.uint8 if dtype in FP8_DTYPES else dtype
    assert pool.store_dtype == expected_store
    assert pool.kv_buffer.dtype == expected_store
    assert pool.kv_buffer is pool.pool.kv_buffer
    assert tuple(pool.kv_buffer.shape) == EXPECTED_SHAPES[(attention, layout)]
    assert pool.kv_buffer.is_contiguous()
    assert not pool.kv_buffer.is_pinned()
    assert (pool.size, pool.page_num, pool.page_size) == (SIZE, PAGES, PAGE)
    assert pool.layer_num == LAYERS
    assert pool.kv_buffer.numel() == SIZE * page_bytes(attention) // PAGE
    assert pool.available_size() == SIZE


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize(("attention", "layout"), PAGE_API_COMBOS)
def test_flat_page_round_trips_random_bytes(
    attention: Attention, layout: str, dtype: torch.dtype
) -> None:
    pool = build(attention, layout, dtype)
    target = 2 * PAGE
    others = [p * PAGE for p in range(PAGES) if p * PAGE != target]
    before = {index: as_bytes(pool.get_data_page(index)) for index in others}

    data = random_page(pool, seed=target)
    assert pool.get_dummy_flat_data_page().shape == data.shape
    assert pool.get_data_page(target).shape == data.shape
    pool.set_from_flat_data_page(target, data)

    assert as_bytes(pool.get_data_page(target)) == as_bytes(data)
    for index in others:
        assert as_bytes(pool.get_data_page(index)) == before[index], index


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize(("attention", "layout"), PAGE_API_COMBOS)
def test_page_buffer_meta_points_at_the_page_bytes(
    attention: Attention, layout: str, dtype: torch.dtype
) -> None:
    pool = build(attention, layout, dtype)
    target = 3 * PAGE
    data = random_page(pool, seed=7)
    pool.set_from_flat_data_page(target, data)

    ptrs, sizes = pool.get_page_buffer_meta(list(range(target, target + PAGE)))

    assert len(ptrs) == len(sizes)
    assert sum(sizes) == data.numel() * data.element_size()
    base = pool.kv_buffer.data_ptr()
    end = base + pool.kv_buffer.numel() * pool.kv_buffer.element_size()
    for ptr, size in zip(ptrs, sizes, strict=True):
        assert base <= ptr
        assert ptr + size <= end
    read = b"".join(ctypes.string_at(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True))
    if layout == "layer_first":
        # One run per layer (MHA: K then V of that layer), not the flat page order.
        buf = pool.kv_buffer
        page = slice(target, target + PAGE)
        runs = (
            [buf[kv, layer, page] for layer in range(LAYERS) for kv in (0, 1)]
            if attention == "mha"
            else [buf[layer, page] for layer in range(LAYERS)]
        )
        assert read == b"".join(as_bytes(run) for run in runs)
    else:
        assert read == as_bytes(data)


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_page_unified_builds_but_has_no_flat_page_api(attention: Attention) -> None:
    pool = build(attention, "page_unified", torch.bfloat16)
    with pytest.raises(ValueError, match="page_unified"):
        pool.get_data_page(0)
    with pytest.raises(ValueError, match="page_unified"):
        pool.set_from_flat_data_page(0, random_page(pool, seed=0))
    with pytest.raises(ValueError, match="page_unified"):
        pool.get_page_buffer_meta(list(range(PAGE)))


def test_page_unified_rejects_rows_that_are_not_16_byte_multiples() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        build_sglang_host_pool(
            attention="mla",
            layout="page_unified",
            dtype=torch.float8_e4m3fn,
            layer_num=1,
            page_size=PAGE,
            num_pages=1,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
        )


def test_alloc_hands_out_every_slot_once_and_free_returns_them() -> None:
    pool = build("mha", "page_first", torch.bfloat16)

    first = pool.alloc(2 * PAGE)
    rest = pool.alloc(SIZE - 2 * PAGE)
    assert first is not None
    assert rest is not None
    assert sorted(torch.cat([first, rest]).tolist()) == list(range(SIZE))
    assert pool.alloc(PAGE) is None
    assert pool.available_size() == 0

    assert pool.free(first) == 2 * PAGE
    assert pool.available_size() == 2 * PAGE
    again = pool.alloc(2 * PAGE)
    assert again is not None
    assert sorted(again.tolist()) == sorted(first.tolist())


def test_bad_arguments_are_refused_before_sglang_sees_them() -> None:
    with pytest.raises(ValueError, match="attention"):
        build_sglang_host_pool(
            attention="gqa",  # type: ignore[arg-type]
            layout="page_first",
            dtype=torch.bfloat16,
            layer_num=1,
            page_size=PAGE,
            num_pages=1,
        )
    with pytest.raises(ValueError, match="num_pages"):
        build_sglang_host_pool(
            attention="mha",
            layout="page_first",
            dtype=torch.bfloat16,
            layer_num=1,
            page_size=PAGE,
            num_pages=0,
        )


def test_build_leaves_no_host_memory_budget_behind() -> None:
    from sglang.srt.mem_cache.pool_host.base import _host_memory_budget

    assert _host_memory_budget.get() is None
    build("mla", "page_first", torch.bfloat16)
    assert _host_memory_budget.get() is None


def test_helper_module_imports_without_importing_sglang() -> None:
    code = (
        "import sys\n"
        "import support.sglang_pools\n"
        "loaded = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=TESTS, timeout=60)
