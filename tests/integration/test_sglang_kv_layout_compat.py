"""Our KV host pool and SGLang 0.5.23's own host pools hold the same bytes in the same places.

For every layout both attention kinds support on CPU, and several element types, SGLang's
real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` is built next to a
:class:`KVHostPool` of the same geometry, and:

- the whole buffers have the same shape, and the same bytes give the same pages;
- a page written by SGLang (``set_from_flat_data_page``) reads back through ours, and a
  page we write reads back through SGLang's ``get_data_page``, byte for byte;
- the zero-copy regions (``page_regions`` vs ``get_page_buffer_meta``) are at the same
  offsets with the same sizes.
"""

from __future__ import annotations

import pytest
import torch
from support.sglang_pools import SGLangHostPool, build_sglang_host_pool

from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    MemoryFacts,
)

pytestmark = pytest.mark.sglang

LAYERS, PAGE, PAGES, HEADS, HEAD_DIM = 3, 4, 6, 2, 16
MLA_WIDTH = 48  # kv_lora_rank 32 + qk_rope_head_dim 16
CASES = [
    (attention, layout)
    for attention in Attention
    for layout in KVLayout
    if not (attention is Attention.MLA and layout is KVLayout.PAGE_HEAD)
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _ids(case: tuple[Attention, KVLayout]) -> str:
    return f"{case[0].value}-{case[1].value}"


def _memory() -> HostMemory:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=1 << 30), facts=facts))


def _pair(
    attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> tuple[SGLangHostPool, KVHostPool]:
    theirs = build_sglang_host_pool(
        attention=attention.value,
        layout=layout.value,
        dtype=dtype,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=PAGES,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
    )
    mla = attention is Attention.MLA
    geometry = KVGeometry(
        attention=attention,
        layout=layout,
        # SGLang keeps fp8 KV as uint8; ours stores the same bytes under the store dtype.
        dtype=theirs.store_dtype,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=PAGES,
        head_num=1 if mla else HEADS,
        head_dim=MLA_WIDTH if mla else HEAD_DIM,
    )
    return theirs, KVHostPool(geometry, _memory())


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _randomise(tensor: torch.Tensor, seed: int) -> None:
    assert tensor.is_contiguous()
    raw = tensor.view(-1).view(torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=generator))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_same_buffer_bytes_give_the_same_pages(
    case: tuple[Attention, KVLayout], dtype: torch.dtype
) -> None:
    theirs, ours = _pair(*case, dtype)
    with ours:
        assert tuple(theirs.kv_buffer.shape) == ours.geometry.buffer_shape
        assert theirs.kv_buffer.dtype == ours.kv_buffer.dtype
        _randomise(theirs.kv_buffer, seed=1)
        ours.kv_buffer.copy_(theirs.kv_buffer)
        rows = ours.read_pages(list(range(PAGES)))
        for page in range(PAGES):
            expected = _bytes(theirs.get_data_page(page * PAGE))
            assert torch.equal(_bytes(rows[page]), expected), f"page {page}"
            assert torch.equal(_bytes(ours.read_page(page)), expected)
            assert tuple(ours.page(page).shape) == tuple(
                theirs.pool.get_data_page(page * PAGE, flat=False).shape
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_pages_cross_between_implementations(
    case: tuple[Attention, KVLayout], dtype: torch.dtype
) -> None:
    theirs, ours = _pair(*case, dtype)
    with ours:
        _randomise(theirs.kv_buffer, seed=2)
        _randomise(ours.kv_buffer, seed=3)
        # SGLang -> storage page -> ours, into a different slot.
        for src, dst in [(0, 5), (3, 1), (5, 2)]:
            ours.write_page(dst, theirs.get_data_page(src * PAGE).clone())
            assert torch.equal(
                _bytes(ours.read_page(dst)), _bytes(theirs.get_data_page(src * PAGE))
            )
        # Ours -> storage page -> SGLang.
        for src, dst in [(1, 4), (2, 0)]:
            theirs.set_from_flat_data_page(dst * PAGE, ours.read_page(src))
            assert torch.equal(
                _bytes(theirs.get_data_page(dst * PAGE)), _bytes(ours.read_page(src))
            )
        # After the same writes on both sides, the whole buffers agree.
        ours.kv_buffer.copy_(theirs.kv_buffer)
        batch = [4, 0, 3]
        for page, raw in zip(batch, ours.read_pages(batch), strict=True):
            theirs.set_from_flat_data_page(page * PAGE, raw)
        assert torch.equal(_bytes(ours.kv_buffer), _bytes(theirs.kv_buffer))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_zero_copy_regions_match_sglang_page_buffer_meta(case: tuple[Attention, KVLayout]) -> None:
    theirs, ours = _pair(*case, torch.bfloat16)
    with ours:
        pages = [4, 0, 2]
        token_indices = ours.geometry.token_indices(torch.tensor(pages))
        their_ptrs, their_sizes = theirs.get_page_buffer_meta(token_indices)
        their_base = theirs.kv_buffer.data_ptr()
        regions = ours.page_regions(pages)
        our_base = ours.kv_buffer.data_ptr()
        assert [address - our_base for address, _ in regions] == [
            ptr - their_base for ptr in their_ptrs
        ]
        assert [size for _, size in regions] == their_sizes
        assert sum(their_sizes) == len(pages) * ours.geometry.page_bytes


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_sizes_match_sglang(case: tuple[Attention, KVLayout]) -> None:
    theirs, ours = _pair(*case, torch.bfloat16)
    with ours:
        assert ours.geometry.token_bytes == theirs.pool.size_per_token
        assert ours.geometry.page_numel == theirs.get_dummy_flat_data_page().numel()
        assert ours.geometry.size == theirs.size
