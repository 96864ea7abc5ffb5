from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_storage.errors import ConfigError
from sglang_storage.memory import KV_DTYPES, Attention, KVGeometry, KVLayout

MHA, MLA = Attention.MHA, Attention.MLA
LAYER_FIRST = KVLayout.LAYER_FIRST
PAGE_FIRST = KVLayout.PAGE_FIRST
DIRECT = KVLayout.PAGE_FIRST_DIRECT
PAGE_HEAD = KVLayout.PAGE_HEAD

# Distinct sizes, so a swapped axis cannot go unnoticed.
L, PAGE, PAGES, H, D = 3, 4, 5, 2, 8
SIZE = PAGES * PAGE

# The table in layouts.py's docstring, written out independently.
BUFFER_SHAPES: dict[tuple[Attention, KVLayout], tuple[int, ...]] = {
    (MHA, LAYER_FIRST): (2, L, SIZE, H, D),
    (MHA, PAGE_FIRST): (2, SIZE, L, H, D),
    (MHA, DIRECT): (2, PAGES, L, PAGE, H, D),
    (MHA, PAGE_HEAD): (2, PAGES, H, PAGE, L, D),
    (MLA, LAYER_FIRST): (L, SIZE, 1, D),
    (MLA, PAGE_FIRST): (SIZE, L, 1, D),
    (MLA, DIRECT): (PAGES, L, PAGE, 1, D),
}
# get_data_page(flat=False): the buffer sliced at one page.
PAGE_SHAPES: dict[tuple[Attention, KVLayout], tuple[int, ...]] = {
    (MHA, LAYER_FIRST): (2, L, PAGE, H, D),
    (MHA, PAGE_FIRST): (2, PAGE, L, H, D),
    (MHA, DIRECT): (2, 1, L, PAGE, H, D),
    (MHA, PAGE_HEAD): (2, 1, H, PAGE, L, D),
    (MLA, LAYER_FIRST): (L, PAGE, 1, D),
    (MLA, PAGE_FIRST): (PAGE, L, 1, D),
    (MLA, DIRECT): (1, L, PAGE, 1, D),
}
COMBOS = list(BUFFER_SHAPES)
COMBO_IDS = [f"{a.value}-{layout.value}" for a, layout in COMBOS]


def geometry(
    attention: Attention = MHA,
    layout: KVLayout = PAGE_FIRST,
    dtype: torch.dtype = torch.bfloat16,
    **sizes: Any,
) -> KVGeometry:
    values: dict[str, Any] = {
        "layer_num": L,
        "page_size": PAGE,
        "num_pages": PAGES,
        "head_num": 1 if attention is MLA else H,
        "head_dim": D,
    }
    values.update(sizes)
    return KVGeometry(attention=attention, layout=layout, dtype=dtype, **values)


def reference_page(buffer: torch.Tensor, attention: Attention, layout: KVLayout, p: int) -> Any:
    """SGLang's get_data_page(p * page_size, flat=False) on a tensor of buffer_shape."""
    tokens = slice(p * PAGE, (p + 1) * PAGE)
    if layout is LAYER_FIRST:
        return buffer[:, tokens] if attention is MLA else buffer[:, :, tokens]
    if layout is PAGE_FIRST:
        return buffer[tokens] if attention is MLA else buffer[:, tokens]
    return buffer[p : p + 1] if attention is MLA else buffer[:, p : p + 1]


@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
def test_buffer_and_page_shapes_follow_the_table(attention: Attention, layout: KVLayout) -> None:
    g = geometry(attention, layout)
    assert g.buffer_shape == BUFFER_SHAPES[attention, layout]
    assert g.page_shape == PAGE_SHAPES[attention, layout]
    buffer = torch.empty(g.buffer_shape, dtype=torch.uint8)
    assert tuple(reference_page(buffer, attention, layout, 2).shape) == g.page_shape
    assert math.prod(g.page_shape) == g.page_numel
    assert math.prod(g.buffer_shape) == g.num_pages * g.page_numel


@pytest.mark.parametrize(("attention", "layout"), COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_sizes_are_consistent(attention: Attention, layout: KVLayout, dtype: torch.dtype) -> None:
    g = geometry(attention, layout, dtype)
    planes = 1 if attention is MLA else 2
    heads = 1 if attention is MLA else H
    assert g.is_mla is (attention is MLA)
    assert g.kv_planes == planes
    assert g.size == SIZE
    assert g.itemsize == dtype.itemsize
    assert g.row_bytes == heads * D * dtype.itemsize
    assert g.token_bytes == planes * L * heads * D * dtype.itemsize
    assert g.page_bytes == g.token_bytes * PAGE
    assert g.page_bytes == g.page_numel * dtype.itemsize
    assert g.total_bytes == g.page_bytes * PAGES
    assert g.total_bytes == math.prod(g.buffer_shape) * dtype.itemsize
    assert g.pages_contiguous is (layout is not LAYER_FIRST)


def test_mla_page_head_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        geometry(MLA, PAGE_HEAD)
    assert caught.value.field == "layout"
    assert caught.value.allowed is not None
    assert "page_head" not in caught.value.allowed


@pytest.mark.parametrize("layout", [LAYER_FIRST, PAGE_FIRST, DIRECT])
@pytest.mark.parametrize("heads", [2, 8])
def test_mla_needs_one_head(layout: KVLayout, heads: int) -> None:
    with pytest.raises(ConfigError) as caught:
        geometry(MLA, layout, head_num=heads)
    assert caught.value.field == "head_num"


@pytest.mark.parametrize(
    "dtype", [torch.complex64, torch.int64, torch.float64, torch.int32, torch.bool], ids=str
)
def test_dtype_outside_kv_dtypes_is_refused_listing_allowed(dtype: torch.dtype) -> None:
    with pytest.raises(ConfigError) as caught:
        geometry(dtype=dtype)
    assert caught.value.field == "dtype"
    allowed = caught.value.allowed or ""
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8"):
        assert name in allowed


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_every_kv_dtype_is_accepted(dtype: torch.dtype) -> None:
    assert geometry(dtype=dtype).dtype == dtype


@pytest.mark.parametrize("field", ["layer_num", "page_size", "num_pages", "head_num", "head_dim"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_sizes_must_be_positive_ints(field: str, value: object) -> None:
    sizes: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError) as caught:
        geometry(**sizes)
    assert caught.value.field == field


def test_attention_and_layout_must_be_enums() -> None:
    with pytest.raises(ConfigError):
        KVGeometry(
            attention="mha",  # type: ignore[arg-type]
            layout=PAGE_FIRST,
            dtype=torch.bfloat16,
            layer_num=1,
            page_size=1,
            num_pages=1,
            head_num=1,
            head_dim=1,
        )
    with pytest.raises(ConfigError):
        KVGeometry(
            attention=MHA,
            layout="page_first",  # type: ignore[arg-type]
            dtype=torch.bfloat16,
            layer_num=1,
            page_size=1,
            num_pages=1,
            head_num=1,
            head_dim=1,
        )


def test_token_indices_are_each_pages_tokens_in_order() -> None:
    g = geometry(page_size=4)
    got = g.token_indices(torch.tensor([2, 0], dtype=torch.int32))
    assert got.dtype == torch.int64
    assert got.tolist() == [8, 9, 10, 11, 0, 1, 2, 3]


@settings(max_examples=80)
@given(
    page_size=st.integers(min_value=1, max_value=16),
    pages=st.lists(st.integers(min_value=0, max_value=999), max_size=20),
)
def test_pages_of_tokens_inverts_token_indices(page_size: int, pages: list[int]) -> None:
    g = geometry(page_size=page_size, num_pages=1000)
    page_tensor = torch.tensor(pages, dtype=torch.int64)
    tokens = g.token_indices(page_tensor)
    assert tuple(tokens.shape) == (len(pages) * page_size,)
    # Every page's tokens are consecutive and start at a multiple of page_size.
    assert tokens.view(-1, page_size).tolist() == [
        list(range(p * page_size, (p + 1) * page_size)) for p in pages
    ]
    starts = tokens[::page_size]
    assert g.pages_of_tokens(starts).tolist() == pages


@settings(max_examples=80)
@given(
    page_size=st.integers(min_value=2, max_value=16),
    page=st.integers(min_value=0, max_value=100),
    offset=st.integers(min_value=1, max_value=15),
    others=st.lists(st.integers(min_value=0, max_value=100), max_size=5),
)
def test_misaligned_token_is_refused(
    page_size: int, page: int, offset: int, others: list[int]
) -> None:
    g = geometry(page_size=page_size)
    bad = page * page_size + offset % (page_size - 1) + 1  # 1 .. page_size-1 past a start
    tokens = torch.tensor([o * page_size for o in others] + [bad], dtype=torch.int64)
    with pytest.raises(ConfigError) as caught:
        g.pages_of_tokens(tokens)
    assert caught.value.field == "tokens"
    assert bad in caught.value.value  # type: ignore[operator]
