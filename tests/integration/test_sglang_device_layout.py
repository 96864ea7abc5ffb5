"""Our device<->host copies put bytes where SGLang 0.5.23's own pools expect them.

SGLang's real device pool (``MHATokenToKVPool`` / ``MLATokenToKVPool`` on CPU) is wrapped
as a :class:`DeviceKV` without copying (its ``k_buffer`` / ``v_buffer`` / ``kv_buffer``
lists), and SGLang's real host pool is built next to ours (``support.sglang_pools``). SGLang's
own device<->host copies need CUDA kernels, so the expected host bytes come from SGLang's
page accessors instead: after our offload, SGLang's ``get_data_page(index, flat=False)``
(on a host pool holding our buffer's bytes) must show, for every layer, plane and token of
the page, the device pool's row; and after SGLang writes pages with
``set_from_flat_data_page``, our load must put them into the device pool the same way.
``get_data_page`` returns the page in the axis order of SGLang's ``init_kv_buffer`` dims,
which :func:`canonical` reorders to ``(planes, layers, page, heads, dim)``.
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
from sglang_storage.transfer.device import DeviceHostPipeline, DeviceTransferConfig
from sglang_storage.transfer.device_kv import DeviceKV

pytestmark = pytest.mark.sglang

LAYERS, PAGE, PAGES, HEADS, HEAD_DIM = 3, 4, 6, 2, 16
MLA_WIDTH = 48  # kv_lora_rank 32 + qk_rope_head_dim 16
CASES = [
    (attention, layout)
    for attention in Attention
    for layout in KVLayout
    if not (attention is Attention.MLA and layout is KVLayout.PAGE_HEAD)
]
DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
# (host page, device page): SGLang's tiny device pool holds two pages.
PAIRS = [(4, 1), (1, 0)]


def _ids(case: tuple[Attention, KVLayout]) -> str:
    return f"{case[0].value}-{case[1].value}"


def canonical(page: torch.Tensor, attention: Attention, layout: KVLayout) -> torch.Tensor:
    """SGLang's ``get_data_page(flat=False)`` reordered to ``(planes, L, page, H, D)``."""
    if attention is Attention.MLA:
        page = page.unsqueeze(0)  # one plane
    if layout is KVLayout.LAYER_FIRST:  # (P, L, page, H, D)
        return page
    if layout is KVLayout.PAGE_FIRST:  # (P, page, L, H, D)
        return page.permute(0, 2, 1, 3, 4)
    if layout is KVLayout.PAGE_FIRST_DIRECT:  # (P, 1, L, page, H, D)
        return page[:, 0]
    return page[:, 0].permute(0, 3, 2, 1, 4)  # page_head: (P, 1, H, page, L, D)


def device_page(device: DeviceKV, page: int) -> torch.Tensor:
    """Device page ``page`` as ``(planes, L, page, H, D)``."""
    rows = slice(page * PAGE, (page + 1) * PAGE)
    planes = [device.k] if device.v is None else [device.k, device.v]
    return torch.stack([torch.stack([t[rows] for t in plane]) for plane in planes])


def _setup(
    attention: Attention, layout: KVLayout, dtype: torch.dtype
) -> tuple[SGLangHostPool, KVHostPool, DeviceKV]:
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
        dtype=theirs.store_dtype,  # SGLang keeps fp8 KV as uint8 on the device and host
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=PAGES,
        head_num=1 if mla else HEADS,
        head_dim=MLA_WIDTH if mla else HEAD_DIM,
    )
    pool = theirs.device_pool
    device = (
        DeviceKV(geometry=geometry, k=pool.kv_buffer)
        if mla
        else DeviceKV(geometry=geometry, k=pool.k_buffer, v=pool.v_buffer)
    )
    assert device.k[0] is (pool.kv_buffer if mla else pool.k_buffer)[0]  # wrapped, not copied
    generator = torch.Generator().manual_seed(7)
    for tensor in [*device.k, *(device.v or ())]:
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=1 << 30), facts=facts))
    ours = KVHostPool(geometry, memory)
    ours.alloc(PAGES)
    assert tuple(ours.kv_buffer.shape) == tuple(theirs.kv_buffer.shape)
    return theirs, ours, device


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_offload_lands_where_sglang_reads_pages(
    case: tuple[Attention, KVLayout], dtype: torch.dtype
) -> None:
    attention, layout = case
    theirs, ours, device = _setup(attention, layout, dtype)
    config = DeviceTransferConfig(io_backend="torch")
    with DeviceHostPipeline(device, ours, config) as pipeline:
        tokens = [d * PAGE + j for _, d in PAIRS for j in range(PAGE)]
        assert pipeline.offload([h for h, _ in PAIRS], tokens).wait().ok
    theirs.kv_buffer.copy_(ours.kv_buffer)
    for host_page, dev_page in PAIRS:
        page = theirs.pool.get_data_page(host_page * PAGE, flat=False)
        got = canonical(page, attention, layout)
        assert torch.equal(_bits(got), _bits(device_page(device, dev_page)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_load_reads_pages_sglang_wrote(
    case: tuple[Attention, KVLayout], dtype: torch.dtype
) -> None:
    attention, layout = case
    theirs, ours, device = _setup(attention, layout, dtype)
    generator = torch.Generator().manual_seed(11)
    dummy = theirs.get_dummy_flat_data_page()
    for host_page, _ in PAIRS:
        data = torch.randint(
            0, 256, (dummy.numel() * dummy.element_size(),), dtype=torch.uint8, generator=generator
        )
        theirs.set_from_flat_data_page(host_page * PAGE, data.view(dummy.dtype))
    ours.kv_buffer.copy_(theirs.kv_buffer)
    config = DeviceTransferConfig(io_backend="torch")
    with DeviceHostPipeline(device, ours, config) as pipeline:
        tokens = [d * PAGE + j for _, d in PAIRS for j in range(PAGE)]
        assert pipeline.load([h for h, _ in PAIRS], tokens).wait().ok
    for host_page, dev_page in PAIRS:
        page = theirs.pool.get_data_page(host_page * PAGE, flat=False)
        want = canonical(page, attention, layout)
        assert torch.equal(_bits(device_page(device, dev_page)), _bits(want))
