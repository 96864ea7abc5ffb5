"""Device indices our adapters would copy wrongly are refused when the adapter is built.

Everything here is SGLang 0.5.23's own, on CPU: device pools, allocators, host pools,
``UnifiedRadixCache`` driving our HiCache controller through the plug-in's stack
strategy (as in ``test_sglang_hicache_controller.py``), the decode offload adapter with
the scheduler's arguments, and SGLang's own ``HiCacheController`` page functions and
``HiCacheFile``.

- A token-granular allocator (``TokenToKVPoolAllocator``) under a tree with pages of 4
  hands out slots ``1 .. n``; the controller, which names each device page by its first
  token, copied them as ``0 .. n-1`` with no error. Building that combination is now a
  ``ConfigError`` naming the allocator and the page size, while the per-call check
  (``check_device_tokens=True``) still catches such indices for other callers.
- The configurations that work keep their byte-exact round trips (device -> host ->
  storage -> a fresh tree's host -> device): page size 1 with either allocator, page
  size 4 with the paged allocator.
- Decode context parallelism (DCP): SGLang's DCP allocator widens its page to
  ``page_size * dcp_size`` slots of a widened index space, and host pools hold the
  physical page. Our controller and decode adapter do not translate widened slots, so
  they refuse DCP (published, or recognised from the allocator's widened page or a DCP
  host pool). Our storage adapter, which SGLang's controller does not reach under DCP
  (it refuses ``dynamic`` backends there), is byte-exact on SGLang's DCP MLA host pool
  and stores the same payload as ``HiCacheFile``.
"""

from __future__ import annotations

import atexit
import json
import os
import random
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_storage.errors import ConfigError
from sglang_storage.storage.format import HEADER_SIZE
from sglang_storage.storage.keys import page_hashes

pytestmark = pytest.mark.sglang

LAYERS, TOKENS, DEVICE_TOKENS = 2, 16, 64
SEQ = list(range(100, 100 + TOKENS))
DCP = 2
ADAPTER = {
    "backend_name": "sglang_storage",
    "module_path": "sglang_storage_adapters.hicache_storage",
    "class_name": "HiCacheBackend",
    "interface_v1": 1,
}
LIVE: list[Tree] = []
"""Trees built by the running test."""

MakeAllocator = Callable[[Any], Any]
"""Builds an SGLang allocator over a device KV pool."""


# ---------------------------------------------------------------------- SGLang's pieces


@pytest.fixture(scope="module")
def single_rank() -> Iterator[None]:
    """SGLang's one-rank topology, and our plug-in installed (as ``load_plugins`` does)."""
    from sglang.srt.runtime_context import get_parallel, reset_context
    from sglang_storage_adapters import plugin

    plugin.register()
    override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    override.__enter__()
    yield
    override.__exit__(None, None, None)
    reset_context()  # unpublish the server args for whatever this worker runs next


@pytest.fixture(autouse=True)
def detach_trees() -> Iterator[None]:
    """Detach every tree's storage after the test (stops SGLang's threads and our pipeline)."""
    yield
    while LIVE:
        cache = LIVE.pop().cache
        if cache.cache_controller is not None and cache.cache_controller.enable_storage:
            ok, message = cache.detach_storage_backend()
            assert ok, message


@pytest.fixture
def dcp_published() -> Iterator[None]:
    """SGLang's parallel state with decode context parallelism of :data:`DCP` ranks."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=DCP, attn_dcp_rank=0, dcp_enabled=True):
        yield


def server_args(root: Path, *, page: int) -> Any:
    """ServerArgs as ``--storage-backend file`` leaves them, with pages of ``page``."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang_storage_adapters.flags import StorageFlags, hicache_settings

    settings = hicache_settings(StorageFlags(backend="file", backend_options={"root": str(root)}))
    extra = json.loads(str(settings.pop("hicache_storage_backend_extra_config")))
    extra["prefetch_threshold"] = page
    args = ServerArgs(
        model_path="dummy",
        page_size=page,
        hicache_mem_layout="page_first",
        hicache_write_policy="write_through",
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_backend_extra_config=json.dumps(extra),
        **settings,
    )
    set_global_server_args_for_scheduler(args)
    return args


def device_pool(page: int, *, mla: bool = False, tokens: int = DEVICE_TOKENS) -> Any:
    """SGLang's CPU device KV pool with pages of ``page`` tokens."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if mla:
        return MLATokenToKVPool(
            size=tokens,
            page_size=page,
            dtype=torch.bfloat16,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
    return MHATokenToKVPool(
        size=tokens,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        kv_cache_layout="nhd",
    )


def paged(widen: int = 1) -> MakeAllocator:
    """SGLang's paged allocator over a pool; ``widen`` > 1 as its DCP configurator builds it
    (``size * dcp_size`` slots in pages of ``page_size * dcp_size``)."""

    def make(kv: Any) -> Any:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

        return PagedTokenToKVPoolAllocator(
            size=kv.size * widen,
            page_size=kv.page_size * widen,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=kv,
            need_sort=False,
        )

    return make


def token(kv: Any) -> Any:
    """SGLang's token-granular allocator over a pool (what it builds at page size 1)."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    return TokenToKVPoolAllocator(kv.size, torch.bfloat16, "cpu", kv, need_sort=False)


class Tree:
    """One UnifiedRadixCache with HiCache over an SGLang device pool and allocator.

    ``tree_page`` is the tree's page (the controller's): the device pool's page unless
    given (SGLang gives the DCP allocator's widened page).
    """

    def __init__(
        self,
        args: Any,
        *,
        page: int,
        allocator: MakeAllocator,
        tree_page: int | None = None,
        mla: bool = False,
    ) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.kv = device_pool(page, mla=mla)
        self.planes = [self.kv.kv_buffer] if mla else [self.kv.k_buffer, self.kv.v_buffer]
        self.alloc = allocator(self.kv)
        req_pool = ReqToTokenPool(
            size=4, max_context_len=128, device="cpu", enable_memory_saver=False
        )
        params = CacheInitParams(
            req_to_token_pool=req_pool,
            token_to_kv_pool_allocator=self.alloc,
            page_size=page if tree_page is None else tree_page,
            disable=False,
            tree_components=(ComponentType.FULL,),
        )
        self.cache = UnifiedRadixCache(params=params)
        try:
            self.cache.init_hicache(args, params)
        finally:
            atexit.unregister(self.cache.shutdown)
        LIVE.append(self)

    def key(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", tokens))

    def match(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=self.key(tokens)))

    def snapshot(self, indices: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V rows at ``indices``, as raw bits."""
        rows = [
            torch.stack([plane[layer][indices] for plane in self.planes]) for layer in range(LAYERS)
        ]
        return torch.stack(rows).view(torch.int16)

    def insert_random(self, tokens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Insert ``tokens`` with random KV; return their device slots and KV bits."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        value = self.alloc.alloc(len(tokens))
        assert value is not None
        generator = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            for buffer in (plane[layer] for plane in self.planes):
                buffer[value] = torch.randn(buffer[value].shape, generator=generator).to(
                    buffer.dtype
                )
        want = self.snapshot(value)
        self.cache.insert(InsertParams(key=self.key(tokens), value=value.to(torch.int64)))
        return value, want

    def backup_to_storage(self, tokens: list[int]) -> None:
        """Host copy acknowledged, then backed up to storage and the storage ack drained."""
        leaf = self.match(tokens).last_device_node
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


def drain(cache: Any, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
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
    drain(cache, lambda: bool(cache.check_prefetch_progress(request)))
    return int(cache.pop_prefetch_loaded_tokens(request))


# ---------------------------------------------------------------------- page alignment


def test_token_allocator_under_pages_of_4_is_refused_when_the_tree_builds_its_stack(
    tmp_path: Path, single_rank: None
) -> None:
    """The combination that returned wrong KV for the last token is a ConfigError now."""
    with pytest.raises(ConfigError) as caught:
        Tree(server_args(tmp_path, page=4), page=4, allocator=token)
    error = caught.value
    assert error.owner == "sglang_storage HiCache controller"
    assert error.field == "token_to_kv_pool_allocator"
    assert error.value == "TokenToKVPoolAllocator at page_size=4"
    assert error.allowed is not None
    assert "PagedTokenToKVPoolAllocator" in error.allowed


def test_the_per_call_check_still_refuses_token_allocator_indices(
    tmp_path: Path, single_rank: None
) -> None:
    """``check_device_tokens=True`` looks at the values the build-time check vouches for."""
    from sglang_storage_adapters.hicache_controller import device_kv

    from sglang_storage.transfer import DeviceHostPipeline, DeviceTransferConfig

    tree = Tree(server_args(tmp_path, page=4), page=4, allocator=paged())
    host = tree.cache.cache_controller.mem_pool_host.anchor_entry.host_pool.storage_pool
    slots = token(tree.kv).alloc(4)  # what the token allocator hands a page of 4: 1 .. 4
    assert slots.tolist() == [1, 2, 3, 4]
    pages = host.alloc(1)
    checked = DeviceHostPipeline(
        device_kv(tree.kv, host), host, DeviceTransferConfig(io_backend="torch")
    )
    try:
        with pytest.raises(ConfigError, match="whole pages") as caught:
            checked.offload(pages, slots)
        assert caught.value.field == "device_tokens"
        assert checked.offload(pages, torch.arange(4, 8)).wait().error is None  # page 1
    finally:
        checked.close()
        host.free(pages)


@pytest.mark.parametrize(
    ("page", "allocator"),
    [(1, token), (1, paged()), (4, paged())],
    ids=["page1-token", "page1-paged", "page4-paged"],
)
def test_accepted_configurations_round_trip_byte_exact(
    tmp_path: Path, single_rank: None, page: int, allocator: MakeAllocator
) -> None:
    """device -> host -> device, and storage -> a fresh tree's host -> device."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    args = server_args(tmp_path, page=page)
    producer = Tree(args, page=page, allocator=allocator)
    slots, want = producer.insert_random(SEQ, seed=27)
    if page == 1 and allocator is token:
        assert slots.tolist() == list(range(1, TOKENS + 1))  # not page-aligned beyond 1
    producer.backup_to_storage(SEQ)
    evicted = producer.cache.evict(EvictParams(num_tokens=TOKENS)).num_tokens_evicted
    assert evicted == TOKENS
    assert torch.equal(producer.load_back(SEQ), want)

    consumer = Tree(args, page=page, allocator=allocator)
    assert prefetch(consumer, f"req-{page}") == TOKENS
    assert torch.equal(consumer.load_back(SEQ), want)


def _allocator_case(name: str) -> tuple[Any, int]:
    """One of SGLang's allocators over a CPU device pool, and the page size to check it at."""
    from sglang.srt.hardware_backend.npu.allocator_npu import NPUPagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    class ReorderedPagedAllocator(PagedTokenToKVPoolAllocator):  # type: ignore[misc]
        """A subclass that hands out its pages' tokens in reverse (not whole pages)."""

        def alloc(self, need_size: int) -> Any:
            out = super().alloc(need_size)
            return None if out is None else out.flip(0)

    kv = device_pool(4)
    common: dict[str, Any] = {"dtype": torch.bfloat16, "device": "cpu", "kvcache": kv}
    if name == "interleave":
        return PageInterleavePoolAllocator(
            DEVICE_TOKENS, 4, 2, need_sort=False, **common
        ), 4  # fmt: skip
    if name == "npu":
        return NPUPagedTokenToKVPoolAllocator(DEVICE_TOKENS, 4, need_sort=False, **common), 4
    if name == "subclass":
        return ReorderedPagedAllocator(DEVICE_TOKENS, 4, need_sort=False, **common), 4
    if name == "paged-at-8":
        return paged()(kv), 8
    kind, at = name.split("@")
    return (token(kv) if kind == "token" else paged()(kv)), int(at)


@pytest.mark.parametrize(
    ("name", "refused_field"),
    [
        ("paged@4", None),
        ("paged@1", None),
        ("token@1", None),
        ("npu", None),
        ("token@4", "token_to_kv_pool_allocator"),
        ("interleave", "token_to_kv_pool_allocator"),
        ("subclass", "token_to_kv_pool_allocator"),
        ("paged-at-8", "token_to_kv_pool_allocator.page_size"),
    ],
)
def test_only_allocators_that_hand_out_whole_pages_are_accepted(
    name: str, refused_field: str | None
) -> None:
    from sglang_storage_adapters.device_checks import check_page_aligned_allocator

    allocator, page_size = _allocator_case(name)
    if refused_field is None:
        check_page_aligned_allocator(allocator, page_size)
        return
    with pytest.raises(ConfigError) as caught:
        check_page_aligned_allocator(allocator, page_size, owner="test")
    assert caught.value.field == refused_field
    assert type(allocator).__name__ in str(caught.value)


def test_a_page_size_below_one_is_refused() -> None:
    from sglang_storage_adapters.device_checks import check_page_aligned_allocator

    with pytest.raises(ConfigError, match="at least 1"):
        check_page_aligned_allocator(paged()(device_pool(4)), 0)


# ---------------------------------------------------------------------- DCP: controller


def test_dcp_geometry_is_refused_when_the_tree_builds_its_stack(
    tmp_path: Path, single_rank: None
) -> None:
    """SGLang's DCP allocator (pages of 8 slots over device pages of 4), DCP unpublished."""
    with pytest.raises(ConfigError, match="decode context parallelism") as caught:
        Tree(
            server_args(tmp_path, page=4),
            page=4,
            allocator=paged(widen=DCP),
            tree_page=4 * DCP,
            mla=True,
        )
    assert caught.value.field == "token_to_kv_pool_allocator.page_size"
    assert caught.value.value == 4 * DCP


def test_published_dcp_is_refused_by_the_strategy_and_the_controller(
    tmp_path: Path, single_rank: None
) -> None:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.runtime_context import get_parallel
    from sglang_storage_adapters.hicache_controller import StorageStackStrategy

    args = server_args(tmp_path, page=4)
    kv = device_pool(4, mla=True)
    params = CacheInitParams(
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=128, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=paged()(kv),
        page_size=4,
        disable=False,
        tree_components=(ComponentType.FULL,),
    )
    strategy = StorageStackStrategy()
    assert strategy.matches(kv, {ComponentType.FULL})  # control: the same pool without DCP
    with get_parallel().override(attn_dcp_size=DCP, attn_dcp_rank=0, dcp_enabled=True):
        assert not strategy.matches(kv, {ComponentType.FULL})
        # Built anyway (not through the strategy's match): the controller refuses.
        with pytest.raises(ConfigError, match="decode context parallelism") as caught:
            strategy.build(
                cache=None,
                kvcache=kv,
                params=params,
                server_args=args,
                load_cache_event=None,
            )
    assert caught.value.field == "dcp_size"
    assert caught.value.value == DCP


def dcp_host_pool(dcp_rank: int, *, pages: int = 8, seed: int | None = 0) -> Any:
    """SGLang's MLA host pool of one DCP rank, as its assembler builds it under DCP.

    It is given the widened page (``4 * DCP``) and holds pages of 4 physical rows;
    ``logical_page_size`` is the widened page. Filled with random bytes from ``seed``.
    """
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kv = device_pool(4, mla=True, tokens=4)
    with host_memory_budget_scope(1 << 30):
        pool = MLATokenToKVPoolHost(
            kv.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            4 * DCP,
            "page_first",
            pin_memory=False,
            device="cpu",
            allocator_type="default",
            override_kv_cache_dim=kv.kv_cache_dim,
            dcp_size=DCP,
            dcp_rank=dcp_rank,
            device_capacity_tokens=kv.size,
            start_layer=kv.start_layer,
            end_layer=kv.end_layer,
            target_layer_num=kv.layer_num,
            host_token_capacity=pages * 4,
        )
    assert (pool.page_size, pool.logical_page_size, pool.page_num) == (4, 4 * DCP, pages)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    if seed is None:
        raw.zero_()
    else:
        gen = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))
    return pool


def test_a_dcp_host_pool_is_refused() -> None:
    from sglang_storage_adapters.device_checks import check_dcp, check_device_pools

    allocator = paged()(device_pool(4, mla=True))
    check_dcp(allocator)  # control: the same allocator without a DCP host pool
    with pytest.raises(ConfigError, match="decode context parallelism") as caught:
        check_device_pools(allocator, 4, host_pool=dcp_host_pool(1))
    assert caught.value.field == "host pool dcp_size"
    assert caught.value.value == DCP


# ---------------------------------------------------------------------- DCP: decode adapter


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A one-rank gloo group, as ``scheduler.dp_tp_cpu_group`` is on a one-GPU decode node."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


@pytest.fixture
def decode_server_args(tmp_path: Path) -> Iterator[None]:
    """SGLang's runtime config with sglang_storage serving ``decode``, pages of 4."""
    from sglang.srt.runtime_context import get_context

    extra = {
        **ADAPTER,
        "storage_backend": "file",
        "storage_options": {"root": str(tmp_path / "l3")},
        "storage_managers": ["kv", "decode"],
    }
    override = get_context().override_server_args(
        page_size=4,
        served_model_name="test/device-checks",
        hicache_mem_layout="page_first",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )
    override.install()
    yield
    override.restore()


@pytest.mark.parametrize(
    ("allocator", "dcp", "refused_field"),
    [
        (paged(), False, None),
        (token, False, "token_to_kv_pool_allocator"),
        (paged(widen=DCP), False, "token_to_kv_pool_allocator.page_size"),
        (paged(), True, "dcp_size"),
    ],
    ids=["paged", "token", "dcp-allocator", "dcp-published"],
)
def test_decode_adapter_refuses_unaligned_and_dcp_device_indices(
    tp_group: Any,
    decode_server_args: None,
    request: pytest.FixtureRequest,
    allocator: MakeAllocator,
    dcp: bool,
    refused_field: str | None,
) -> None:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang_storage_adapters.decode import DecodeOffloadAdapter

    if dcp:
        request.getfixturevalue("dcp_published")
    kwargs = {
        "req_to_token_pool": ReqToTokenPool(
            size=4, max_context_len=128, device="cpu", enable_memory_saver=False
        ),
        "token_to_kv_pool_allocator": allocator(device_pool(4)),
        "tp_group": tp_group,
        "tree_cache": None,  # the adapter only keeps it; it is refused (or built) first
    }
    if refused_field is None:
        adapter = DecodeOffloadAdapter(**kwargs)
        assert isinstance(adapter, DecodeOffloadAdapter)
        adapter.release_host_resources()
        return
    with pytest.raises(ConfigError) as caught:
        DecodeOffloadAdapter(**kwargs)
    assert caught.value.owner == "sglang_storage decode offload adapter"
    assert caught.value.field == refused_field


# ---------------------------------------------------------------------- DCP: storage adapter


def dcp_storage_config(root: Path, dcp_rank: int, *, ours: bool = True) -> Any:
    """SGLang's storage config of DCP rank ``dcp_rank`` (TP rank ``dcp_rank`` of ``DCP``)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    store = {"storage_backend": "file", "storage_options": {"root": str(root)}}
    return HiCacheStorageConfig(
        tp_rank=dcp_rank,
        tp_size=DCP,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="org/test-model",
        extra_config={**ADAPTER, **store} if ours else None,
        dcp_size=DCP,
        dcp_rank=dcp_rank,
        logical_page_size=4 * DCP,
    )


def attach(pool: Any, config: Any) -> Any:
    """Our backend, built and attached as SGLang's cache controller does."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang_storage_adapters.hicache_storage import HiCacheBackend

    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(backend, HiCacheBackend)
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, PoolName.KV)
    backend.on_host_pools_registered()
    return backend


def page_functions(backend: Any, pool: Any) -> Any:
    """SGLang's ``HiCacheController`` with only what its page functions read, under DCP.

    Its ``page_size`` is the tree's, the widened DCP page (``CacheInitParams``).
    """
    from sglang.srt.managers.cache_controller import HiCacheController

    controller = object.__new__(HiCacheController)
    controller.storage_backend = backend
    controller.storage_host_pool = pool
    controller.page_size = pool.logical_page_size
    return controller


def logical_tokens(pages: Sequence[int]) -> torch.Tensor:
    """The tree's host indices of widened pages ``pages`` (every slot of each)."""
    widened = 4 * DCP
    return torch.tensor([p * widened + t for p in pages for t in range(widened)], dtype=torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    """The flat data page SGLang's storage backends store for widened page ``page``."""
    data = pool.get_data_page(page * pool.logical_page_size, flat=True).contiguous()
    return bytes(data.view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("dcp_rank", [0, 1])
def test_storage_adapter_on_a_dcp_mla_host_pool_is_byte_exact_and_matches_hicache_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dcp_rank: int
) -> None:
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer

    for name in list(os.environ):  # SGLang's failure injector and HiCacheFile's settings
        if name.startswith(("SGLANG_TEST_HICACHE_BACKEND_", "SGLANG_HICACHE_FILE_BACKEND_")):
            monkeypatch.delenv(name)
    src = dcp_host_pool(dcp_rank, seed=27 + dcp_rank)
    ours = attach(src, dcp_storage_config(tmp_path / "ours", dcp_rank))
    rng = random.Random(dcp_rank)
    keys = page_hashes([rng.randrange(2**31) for _ in range(4 * 4 * DCP)], 4 * DCP)
    try:
        controller = page_functions(ours, src)
        operation = SimpleNamespace(request_id="req", is_terminated=lambda: False)
        want = [page_bytes(src, p) for p in (1, 2)]
        zero = torch.zeros_like(src.get_dummy_flat_data_page())
        functions = [
            (controller._generic_page_set, controller._generic_page_get),
            (controller._page_set_zero_copy, controller._page_get_zero_copy),
        ]
        for n, (set_page, get_page) in enumerate(functions):
            batch = keys[2 * n : 2 * n + 2]
            assert set_page(batch, logical_tokens([1, 2])) is True
            for page in (5, 6):
                src.set_from_flat_data_page(page * 4 * DCP, zero)
            assert get_page(operation, batch, logical_tokens([5, 6])) == 2
            assert [page_bytes(src, p) for p in (5, 6)] == want

        # v2 steps by the same widened page and reads what v1 wrote.
        for page in (5, 6):
            src.set_from_flat_data_page(page * 4 * DCP, zero)
        transfer = PoolTransfer(
            name=PoolName.KV, host_indices=logical_tokens([5, 6]), keys=keys[2:4]
        )
        assert ours.batch_get_v2([transfer]) == {PoolName.KV: [True, True]}
        assert [page_bytes(src, p) for p in (5, 6)] == want

        # HiCacheFile under the same DCP config stores the same payload for each page.
        theirs_dir = tmp_path / "theirs"
        theirs_dir.mkdir()  # HiCacheFile creates it on TP rank 0 only
        config = dcp_storage_config(theirs_dir, dcp_rank, ours=False)
        theirs = HiCacheFile(config, file_path=str(theirs_dir))
        assert page_functions(theirs, src)._generic_page_set(keys[:2], logical_tokens([1, 2]))
        files = {f.name: f.read_bytes() for f in theirs_dir.iterdir() if f.suffix == ".bin"}
        for key, expected in zip(keys[:2], want, strict=True):
            (payload,) = [data for name, data in files.items() if name.startswith(key)]
            stored = ours.backend.path_of(ours.object_key(key)).read_bytes()
            assert stored[HEADER_SIZE:] == payload == expected

        # The other DCP rank holds the other rows of the same pages: it misses these.
        other_rank = 1 - dcp_rank
        other = attach(
            dcp_host_pool(other_rank, seed=None),
            dcp_storage_config(tmp_path / "ours", other_rank),
        )
        try:
            assert other.batch_exists(keys[:4]) == 0
            assert ours.batch_exists(keys[:4]) == 4
        finally:
            other.close()
    finally:
        ours.close()


def test_sglang_does_not_attach_our_storage_adapter_under_dcp(dcp_published: None) -> None:
    """SGLang 0.5.23's controller allows only ``file`` and ``mooncake`` storage under DCP."""
    from sglang.srt.managers.cache_controller import HiCacheController

    controller = object.__new__(HiCacheController)  # only what attach reads before refusing
    controller.enable_storage = False
    controller.host_memory_mode = "cache"
    with pytest.raises(NotImplementedError, match="file or Mooncake"):
        controller.attach_storage_backend("dynamic")
