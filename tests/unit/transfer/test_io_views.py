"""``copy_views``: the word-wide rows the torch I/O backend copies, for every host layout.

The backend copies each layer with ``index_select`` / ``index_copy_`` over these views, so
they must alias the pools' memory (no copies), cover exactly the same bytes as the element
views, and be as wide as the layout allows: the widest word is what makes a GPU reading
page-locked host memory in place issue large transactions.
"""

from __future__ import annotations

import pytest
import torch

from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    Pinning,
)
from sglang_storage.transfer.device_kv import DeviceKV
from sglang_storage.transfer.io import copy_views

PAGES, PAGE, LAYERS = 5, 4, 3


def pools(
    layout: KVLayout, dtype: torch.dtype, heads: int, dim: int
) -> tuple[KVHostPool, DeviceKV]:
    g = KVGeometry(
        attention=Attention.MHA,
        layout=layout,
        dtype=dtype,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=PAGES,
        head_num=heads,
        head_dim=dim,
    )
    memory = HostMemory(
        HostMemoryBudget(BudgetConfig(total=64 << 20, headroom=0)), pinning=Pinning.NEVER
    )
    host = KVHostPool(g, memory)
    host.kv_buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
    device = DeviceKV.allocate(g, 7 * PAGE, "cpu")
    return host, device


def device_layer(device: DeviceKV, layer: int, heads: int, dim: int) -> torch.Tensor:
    return device.planes(layer)[0].view(-1, PAGE, heads, dim)


@pytest.mark.parametrize(
    ("layout", "shape", "word"),
    [
        # layer_first: a page of one layer is one contiguous run: everything after the page merges.
        (KVLayout.LAYER_FIRST, (PAGES, PAGE * 4 * 64 * 2 // 8), torch.int64),
        # page_first: tokens of one layer are strided by the other layers: heads x dim merge.
        (KVLayout.PAGE_FIRST, (PAGES, PAGE, 4 * 64 * 2 // 8), torch.int64),
        (KVLayout.PAGE_FIRST_DIRECT, (PAGES, PAGE * 4 * 64 * 2 // 8), torch.int64),
        # page_head: heads are outermost in the host page: only dim is contiguous.
        (KVLayout.PAGE_HEAD, (PAGES, PAGE, 4, 64 * 2 // 8), torch.int64),
    ],
    ids=lambda v: getattr(v, "value", None),
)
def test_each_layout_merges_what_is_contiguous_and_reads_int64_words(
    layout: KVLayout, shape: tuple[int, ...], word: torch.dtype
) -> None:
    host, device = pools(layout, torch.bfloat16, 4, 64)
    elements = host.layer(1).k
    h, d = copy_views(elements, device_layer(device, 1, 4, 64))
    assert tuple(h.shape) == shape
    assert h.dtype == d.dtype == word
    assert tuple(d.shape[1:]) == shape[1:]
    assert h.data_ptr() == elements.data_ptr()  # a view of the pool, not a copy
    # The same bytes, page by page.
    for page in range(PAGES):
        want = elements[page].contiguous().view(torch.uint8).flatten()
        assert h[page].contiguous().view(torch.uint8).flatten().equal(want)


@pytest.mark.parametrize(
    ("dtype", "dim", "word"),
    [
        (torch.float32, 3, torch.int32),  # 12-byte rows in a strided layout: 4-byte words
        (torch.bfloat16, 3, torch.int16),  # 6-byte rows: 2-byte words
        (torch.float8_e4m3fn, 5, torch.uint8),  # 5-byte rows: bytes
        (torch.float8_e4m3fn, 16, torch.int64),  # 16-byte rows: 8-byte words
    ],
    ids=["f32-d3", "bf16-d3", "fp8-d5", "fp8-d16"],
)
def test_the_word_divides_every_row_and_stride(
    dtype: torch.dtype, dim: int, word: torch.dtype
) -> None:
    host, device = pools(KVLayout.PAGE_FIRST, dtype, 1, dim)
    elements = host.layer(2).k
    h, d = copy_views(elements, device_layer(device, 2, 1, dim))
    assert h.dtype == d.dtype == word
    assert h.element_size() * h.shape[-1] == dim * dtype.itemsize  # one token row per run
    assert (
        h.reshape(PAGES, -1).view(torch.uint8).equal(elements.reshape(PAGES, -1).view(torch.uint8))
    )


def test_a_misaligned_start_gets_a_narrower_word() -> None:
    buffer = torch.zeros(4 * 8 * 16 + 1, dtype=torch.int16)
    host = buffer[1:].view(4, 8, 16)  # starts 2 bytes in: no 4- or 8-byte words
    device = torch.zeros(6, 8, 16, dtype=torch.int16)
    h, d = copy_views(host, device)
    assert h.dtype == d.dtype == torch.int16
    assert tuple(h.shape) == (4, 128)
    assert tuple(d.shape) == (6, 128)


def test_rows_the_device_cannot_merge_stay_split_on_both_sides() -> None:
    host = torch.zeros(4, 8, 16, dtype=torch.int16)  # contiguous
    device = torch.zeros(6, 16, 8, dtype=torch.int16).transpose(1, 2)  # (6, 8, 16), strided
    h, d = copy_views(host, device)
    assert tuple(h.shape[1:]) == tuple(d.shape[1:]) == (8, 16)
    assert h.dtype == torch.int16  # the device's last dimension is not contiguous
