"""SGLang 0.5.23's UnifiedRadixCache with HiCache on CPU, as the integration tests build it.

``server_args`` publishes the ServerArgs ``--storage-backend file`` leaves; :class:`Tree` is
one radix cache with SGLang's own device pool, allocator and ``init_hicache`` (the plug-in's
stack strategy builds our host pool and controller); ``drain`` and ``prefetch`` run the
scheduler's event rounds. Trees built are listed in :data:`LIVE` so a fixture can detach
their storage after each test.
"""

from __future__ import annotations

import atexit
import json
from array import array
from pathlib import Path
from typing import Any

import torch

PAGE, LAYERS, TOKENS = 4, 2, 16
SEQ = list(range(100, 100 + TOKENS))
LIVE: list[Tree] = []
"""Trees built by the running test."""


def server_args(
    root: Path,
    *,
    policy: str = "wait_complete",
    layout: str = "page_first",
    faults: dict[str, float] | None = None,
    timeout_base_s: float | None = None,
    load_policy: str | None = None,
    chunked_prefill_size: int | None = None,
    log_level: str | None = None,
) -> Any:
    """ServerArgs as ``--storage-backend file`` leaves them (flags.hicache_settings).

    With ``faults``, the backend is ``faulty`` (our fault injector) around that file
    backend, with that fault schedule.
    """
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang_storage_adapters.flags import StorageFlags, hicache_settings

    options: dict[str, object] = {"root": str(root)}
    if faults is None:
        backend, backend_options = "file", options
    else:
        backend = "faulty"
        backend_options = {"inner": "file", "inner_options": options, "seed": 7, **faults}
    flags = StorageFlags(
        backend=backend,
        backend_options=backend_options,
        load_policy=load_policy,
        log_level=log_level,
    )
    settings = hicache_settings(flags)
    extra = json.loads(str(settings.pop("hicache_storage_backend_extra_config")))
    extra["prefetch_threshold"] = PAGE
    if timeout_base_s is not None:  # the timeout policy's deadline: base + 0 per 1K tokens
        extra.update(prefetch_timeout_base=timeout_base_s, prefetch_timeout_per_ki_token=0.0)
    args = ServerArgs(
        model_path="dummy",
        page_size=PAGE,
        hicache_mem_layout=layout,
        hicache_write_policy="write_through",
        hicache_storage_prefetch_policy=policy,
        hicache_storage_backend_extra_config=json.dumps(extra),
        chunked_prefill_size=chunked_prefill_size,
        **settings,
    )
    set_global_server_args_for_scheduler(args)
    return args


class Tree:
    """One UnifiedRadixCache with HiCache, its device pool and allocator."""

    def __init__(
        self, args: Any, device: str = "cpu", *, mla: bool = False, enable_metrics: bool = False
    ) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import (
            MHATokenToKVPool,
            MLATokenToKVPool,
            ReqToTokenPool,
        )
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.kv: Any
        if mla:
            self.kv = MLATokenToKVPool(
                size=64,
                page_size=PAGE,
                dtype=torch.bfloat16,
                kv_lora_rank=32,
                qk_rope_head_dim=16,
                layer_num=LAYERS,
                device=device,
                enable_memory_saver=False,
            )
        else:
            self.kv = MHATokenToKVPool(
                size=64,
                page_size=PAGE,
                dtype=torch.bfloat16,
                head_num=2,
                head_dim=16,
                layer_num=LAYERS,
                device=device,
                enable_memory_saver=False,
                kv_cache_layout="nhd",
            )
        self.planes = [self.kv.kv_buffer] if mla else [self.kv.k_buffer, self.kv.v_buffer]
        self.alloc = PagedTokenToKVPoolAllocator(
            size=64,
            page_size=PAGE,
            dtype=torch.bfloat16,
            device=device,
            kvcache=self.kv,
            need_sort=False,
        )
        req_pool = ReqToTokenPool(
            size=4, max_context_len=128, device=device, enable_memory_saver=False
        )
        params = CacheInitParams(
            req_to_token_pool=req_pool,
            token_to_kv_pool_allocator=self.alloc,
            page_size=PAGE,
            disable=False,
            tree_components=(ComponentType.FULL,),
            enable_metrics=enable_metrics,
        )
        self.cache = UnifiedRadixCache(params=params)
        self.cache.init_hicache(args, params)
        atexit.unregister(self.cache.shutdown)
        LIVE.append(self)

    def key(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", tokens))

    def match(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=self.key(tokens)))

    def snapshot(self, indices: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V rows at ``indices``, as raw bits on the CPU."""
        rows = [
            torch.stack([plane[layer][indices] for plane in self.planes]) for layer in range(LAYERS)
        ]
        return torch.stack(rows).view(torch.int16).cpu()

    def insert_random(self, tokens: list[int], seed: int) -> torch.Tensor:
        """Insert ``tokens`` with random KV on device; return their KV bits."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        value = self.alloc.alloc(len(tokens))
        assert value is not None
        generator = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            for buffer in (plane[layer] for plane in self.planes):
                shape = buffer[value].shape
                data = torch.randn(shape, generator=generator).to(buffer.dtype)
                buffer[value] = data.to(buffer.device)
        want = self.snapshot(value)
        self.cache.insert(InsertParams(key=self.key(tokens), value=value.to(torch.int64)))
        return want

    def backup_to_storage(self, tokens: list[int]) -> None:
        """Host copy acknowledged, then backed up to storage and the storage ack drained."""
        leaf = self.match(tokens).last_device_node
        # write_through: the insert wrote the node to host; the ack lands on writing_check.
        self.cache.writing_check(write_back=True)
        assert self.cache.tree_core.is_backuped(leaf)
        self.cache.write_backup_storage(leaf)
        drain(self.cache, lambda: not self.cache.ongoing_backup)

    def load_back(self, tokens: list[int]) -> torch.Tensor:
        """Load the host part of ``tokens``' match to device; return the loaded KV bits."""
        node = self.match(tokens).last_host_node
        assert self.cache.load_back(node)
        assert self.cache.ready_to_load_host_cache() != -1
        self.cache.loading_check()
        match = self.match(tokens)
        return self.snapshot(self.cache.path_device_indices(match.last_device_node))

    def host_available(self) -> int:
        return int(self.cache.cache_controller.mem_pool_host.available_size())


def drain(cache: Any, done: Any, timeout_s: float = 10.0) -> None:
    """Run the scheduler's event round until ``done()`` (bounded)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "HiCache did not finish in time"
        cache.check_hicache_events()
        cache.drain_storage_control_queues()
        time.sleep(0.005)


def prefetch(tree: Tree, rid: str) -> int:
    """Prefetch SEQ from storage the way the scheduler does; return tokens now on host."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    cache = tree.cache
    request = CacheRequestHandle(rid, 0)
    cache.prefetch_from_storage(request, cache.root_node_handle(), array("q", SEQ), None, None)
    drain(cache, lambda: cache.check_prefetch_progress(request))
    return int(cache.pop_prefetch_loaded_tokens(request))
