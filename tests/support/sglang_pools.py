"""SGLang 0.5.23's own HiCache host KV pools, built on CPU, for byte comparisons.

:func:`build_sglang_host_pool` builds a real ``MHATokenToKVPoolHost`` or
``MLATokenToKVPoolHost`` (``sglang.srt.mem_cache.pool_host``) the way SGLang's pool
assembler does (``build_kv_host_pool`` in
``srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py``): a tiny device pool
(``MHATokenToKVPool`` / ``MLATokenToKVPool`` on device ``"cpu"``) describes its buffers
(``get_device_pool_infos()[0].buffer_info``, an ``MHABufferInfo`` / ``MLABufferInfo``), and
the host pool class is constructed from that description with the assembler's arguments.
The host pool allocates its buffer with its real ``init_kv_buffer``.

Only the arguments that would come from SGLang's runtime context are supplied directly
(``allocator_type="default"``, the layout, the capacity) and ``pin_memory=False`` (the
default ``True`` calls ``cudaHostRegister``). No server args, parallel state or
environment variable is set. The one piece of global state touched is SGLang's own
host-memory budget (a ``ContextVar``), set through its ``host_memory_budget_scope`` for
the duration of the host pool's construction only and restored on exit; it replaces the
machine-wide check (free RAM minus a 10 GiB reserve) that would refuse even a tiny pool
on a small CI machine.

This module imports without SGLang: SGLang is imported inside
:func:`build_sglang_host_pool`. Tests that call it carry ``@pytest.mark.sglang``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch

Attention = Literal["mha", "mla"]

MHA_LAYOUTS: tuple[str, ...] = (
    "layer_first",
    "page_first",
    "page_first_direct",
    "page_head",
    "page_unified",
)
"""The host layouts ``MHATokenToKVPoolHost`` builds on CPU."""

MLA_LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct", "page_unified")
"""The host layouts ``MLATokenToKVPoolHost`` builds on CPU."""

PAGE_API_LAYOUTS: frozenset[str] = frozenset(
    {"layer_first", "page_first", "page_first_direct", "page_head"}
)
"""Layouts whose flat page API works in SGLang (``page_unified``'s raises ``ValueError``)."""

FP8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
"""Model dtypes SGLang's device pools store as ``torch.uint8`` (and so the host pool too)."""

HOST_MEMORY_BUDGET_BYTES = 1 << 30
"""Host-memory budget a helper-built pool is checked against (1 GiB; test pools are tiny)."""


@attrs.frozen(kw_only=True, eq=False)
class SGLangHostPool:
    """One SGLang host KV pool and the facts a test needs about it.

    Attributes:
        pool: The SGLang host pool object (``MHATokenToKVPoolHost`` or
            ``MLATokenToKVPoolHost``). Untyped; prefer the typed methods below.
        device_pool: The tiny SGLang device pool the host pool was described from. The
            host pool keeps references to its buffers (SGLang's transfer pointer tables).
        attention: ``"mha"`` or ``"mla"``.
        layout: The host layout (``--hicache-mem-layout``), e.g. ``"page_first"``.
        dtype: The model KV dtype asked for.
        store_dtype: The dtype SGLang stores: ``dtype``, except ``torch.uint8`` for fp8
            (SGLang's device pools store fp8 KV as bytes, and the host pool copies the
            device pool's storage dtype).
        kv_buffer: The host tensor (``pool.kv_buffer``); its shape depends on ``layout``.
        layer_num: Layers in the pool.
        page_size: Tokens per page.
        page_num: Pages in the pool, every one usable (no padding page).
        size: Tokens in the pool, ``page_num * page_size``.
    """

    pool: Any
    device_pool: Any
    attention: Attention
    layout: str
    dtype: torch.dtype
    store_dtype: torch.dtype
    kv_buffer: torch.Tensor
    layer_num: int
    page_size: int
    page_num: int
    size: int

    def get_data_page(self, token_index: int) -> torch.Tensor:
        """Return the page starting at token ``token_index`` as one flat tensor.

        SGLang's ``get_data_page(index, flat=True)``. It may be a view into ``kv_buffer``
        (MLA ``page_first``/``page_first_direct``) or a copy (where the page is not one
        contiguous run, e.g. MHA's K and V halves), so do not write through it. Raises
        ``ValueError`` for ``page_unified``.
        """
        page = self.pool.get_data_page(token_index, flat=True)
        assert isinstance(page, torch.Tensor)
        return page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """Return SGLang's zero page: the flat shape ``get_data_page`` returns."""
        page = self.pool.get_dummy_flat_data_page()
        assert isinstance(page, torch.Tensor)
        return page

    def set_from_flat_data_page(self, token_index: int, data_page: torch.Tensor) -> None:
        """Write one flat page (``store_dtype``) at token ``token_index``.

        Raises ``ValueError`` for ``page_unified``.
        """
        self.pool.set_from_flat_data_page(token_index, data_page)

    def get_page_buffer_meta(
        self, token_indices: torch.Tensor | Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Return SGLang's zero-copy ``(pointers, byte sizes)`` for whole pages.

        ``token_indices`` lists every token of the pages (a multiple of ``page_size``);
        SGLang reads the first token of each page. Raises ``ValueError`` for
        ``page_unified``.
        """
        indices = torch.as_tensor(token_indices, dtype=torch.int64)
        ptrs, sizes = self.pool.get_page_buffer_meta(indices)
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    def alloc(self, need_tokens: int) -> torch.Tensor | None:
        """Allocate ``need_tokens`` host slots (a multiple of ``page_size``), or ``None``."""
        indices = self.pool.alloc(need_tokens)
        assert indices is None or isinstance(indices, torch.Tensor)
        return indices

    def free(self, indices: torch.Tensor) -> int:
        """Free host slots from :meth:`alloc`; return how many were freed."""
        return int(self.pool.free(indices))

    def available_size(self) -> int:
        """Return the free host slots (tokens)."""
        return int(self.pool.available_size())


def build_sglang_host_pool(
    *,
    attention: Attention,
    layout: str,
    dtype: torch.dtype,
    layer_num: int,
    page_size: int,
    num_pages: int,
    head_num: int = 2,
    head_dim: int = 16,
    kv_lora_rank: int = 32,
    qk_rope_head_dim: int = 16,
) -> SGLangHostPool:
    """Build SGLang's own host KV pool on CPU.

    Size: the host pool is built with ``host_token_capacity=num_pages * page_size``, so
    ``size == num_pages * page_size`` and ``page_num == num_pages``, every page usable
    (``alloc`` hands out token slots ``0 .. size - 1``). This is unlike sizing from
    ``--hicache-ratio``/``--hicache-size``, where ``HostKVCache.__init__`` adds one padding
    page (``page_num = size // page_size + 1``).

    The device pool it is described from holds one page (``size=page_size``; SGLang
    adds its padding page, so two pages per layer) and exists only to produce the
    buffer info.

    Args:
        attention: ``"mha"`` (``MHATokenToKVPoolHost``) or ``"mla"``
            (``MLATokenToKVPoolHost``).
        layout: Host layout; one of :data:`MHA_LAYOUTS` or :data:`MLA_LAYOUTS`. Others
            are passed to SGLang, which raises ``ValueError``.
        dtype: Model KV dtype: ``torch.bfloat16``, ``torch.float16``, ``torch.float32``,
            ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (fp8 is stored as
            ``torch.uint8``, see :attr:`SGLangHostPool.store_dtype`).
        layer_num: Layers.
        page_size: Tokens per page.
        num_pages: Host pages.
        head_num: MHA KV heads (ignored for MLA).
        head_dim: MHA head dim, K and V alike (ignored for MLA).
        kv_lora_rank: MLA latent width (ignored for MHA).
        qk_rope_head_dim: MLA RoPE width (ignored for MHA); the row width
            ``kv_cache_dim`` is ``kv_lora_rank + qk_rope_head_dim``.

    Raises:
        ValueError: A bad argument, or SGLang refused the geometry (e.g. ``page_unified``
            needs one head group's token row to be a multiple of 16 bytes).
    """
    if attention not in ("mha", "mla"):
        raise ValueError(f"attention must be 'mha' or 'mla', got {attention!r}")
    for name, value in (("layer_num", layer_num), ("page_size", page_size)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_pages <= 0:
        raise ValueError(f"num_pages must be positive, got {num_pages}")

    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    device_pool: Any
    host_cls: Any
    buffer_info: Any
    kwargs: dict[str, Any]
    if attention == "mha":
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

        device_pool = MHATokenToKVPool(
            size=page_size,
            page_size=page_size,
            dtype=dtype,
            head_num=head_num,
            head_dim=head_dim,
            layer_num=layer_num,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
            # SGLang's default device layout, named so SGLANG_USE_HND_KVCACHE cannot change it.
            kv_cache_layout="nhd",
        )
        buffer_info = device_pool.get_device_pool_infos()[0].buffer_info
        host_cls = get_mha_host_pool_cls(buffer_info)
        kwargs = {
            # The assembler's _mha_host_inputs.
            "device_capacity_tokens": device_pool.size,
            "start_layer": device_pool.start_layer,
            "end_layer": device_pool.end_layer,
            "draft_buffer_infos": (),
            "write_back_staging": device_pool.hicache_write_back_staging,
        }
    else:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        device_pool = MLATokenToKVPool(
            size=page_size,
            page_size=page_size,
            dtype=dtype,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            layer_num=layer_num,
            device="cpu",
            enable_memory_saver=False,
        )
        buffer_info = device_pool.get_device_pool_infos()[0].buffer_info
        host_cls = MLATokenToKVPoolHost
        kwargs = {
            # The assembler's MLA branch of build_kv_host_pool.
            "override_kv_cache_dim": device_pool.kv_cache_dim,
            "device_capacity_tokens": device_pool.size,
            "start_layer": device_pool.start_layer,
            "end_layer": device_pool.end_layer,
            "draft_buffer_infos": (),
            "layer_shard_enabled": device_pool.layer_shard_enabled,
            "target_layer_num": device_pool.layer_num,
        }

    with host_memory_budget_scope(HOST_MEMORY_BUDGET_BYTES):
        pool = host_cls(
            buffer_info,
            2.0,  # host_to_device_ratio: unused with host_token_capacity
            0,  # host_size (GB): unused with host_token_capacity
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            allocator_type="default",
            pool_label="kv",
            host_token_capacity=num_pages * page_size,
            **kwargs,
        )

    kv_buffer = pool.kv_buffer
    assert isinstance(kv_buffer, torch.Tensor)
    size, pool_page_num = int(pool.size), int(pool.page_num)
    assert (size, pool_page_num) == (num_pages * page_size, num_pages), (size, pool_page_num)
    return SGLangHostPool(
        pool=pool,
        device_pool=device_pool,
        attention=attention,
        layout=layout,
        dtype=dtype,
        store_dtype=kv_buffer.dtype,
        kv_buffer=kv_buffer,
        layer_num=int(pool.layer_num),
        page_size=int(pool.page_size),
        page_num=pool_page_num,
        size=size,
    )


def build_hicache_file(
    directory: str | os.PathLike[str],
    *,
    mla: bool = False,
    page_first: bool = True,
    model_name: str = "sglang-storage-test",
) -> Any:
    """SGLang's own ``HiCacheFile`` on ``directory``, as its factory builds it for TP rank 0 of 1.

    Every ``SGLANG_HICACHE_FILE_BACKEND_*`` variable is removed from the environment first
    (they set its directory, metadata cache and evictor), so it runs with its defaults.
    Imports SGLang.
    """
    for name in list(os.environ):
        if name.startswith("SGLANG_HICACHE_FILE_BACKEND_"):
            del os.environ[name]
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=page_first,
        model_name=model_name,
        extra_config=None,
    )
    return HiCacheFile(config, file_path=str(directory))
