"""The decode offload adapter driven the way SGLang 0.5.23's scheduler drives its own class.

Everything SGLang builds here is real and on CPU: the device KV pool (``MHATokenToKVPool``),
its paged allocator, the ``ReqToTokenPool``, the tree cache (``UnifiedRadixCache``,
disabled, as a decode instance without radix cache has it), ``Req`` objects, the runtime
config (``override_server_args``) and a one-rank gloo TP group. The adapter is installed
through SGLang's ``HookRegistry`` and built through the name the scheduler uses
(``scheduler.DecodeKVCacheOffloadManager``), with the scheduler's arguments. Pages go to
the ``file`` backend.

The call sequence is the scheduler's (map section 3): ``offload_kv_cache(req)`` after every
decode step of an unfinished request (``batch_result_processor.py:1433``),
``check_offload_progress()`` every loop (``decode.py:3463``), at finish
``offload_kv_cache`` then ``finalize_release_on_finish`` when it returns False (``:1455``),
``drain_before_retraction()`` before retracting, ``has_inflight_device_transfer()`` (the
unified-memory gate), ``len(ongoing_offload)`` (the idle check), and
``release_host_resources()`` at shutdown.

What was stored is read back twice and compared bit for bit with the device KV: through
our backend into a fresh device pool, and through SGLang's own HiCache path (our
``dynamic`` HiCache backend into SGLang's ``MHATokenToKVPoolHost``), the way a prefill
instance running HiCache on sglang_storage finds the decode side's pages.

Without sglang_storage settings naming ``decode``, the replacement builds SGLang's own
class: on this CPU machine that class stops where SGLang pins its host pool with
``cudaHostRegister`` (``pool_host/common.py:147``), which is checked here; the GPU test
checks it builds.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_hooks import hooks_installed

from sglang_storage.core import GetRequest
from sglang_storage.memory import BudgetConfig, HostMemory, HostMemoryBudget, KVHostPool
from sglang_storage.storage import create_backend
from sglang_storage.storage.keys import namespace_seed, page_hashes
from sglang_storage.transfer import DeviceHostPipeline, DeviceKV

pytestmark = pytest.mark.sglang

PAGE = 4
DEVICE_TOKENS = 256
LAYERS, HEADS, DIM = 2, 2, 8
MODEL = "test/decode-offload"
WAIT_S = 10.0


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


def _extra(root: Path, managers: list[str]) -> str:
    return json.dumps(
        {
            "backend_name": "sglang_storage",
            "module_path": "sglang_storage_adapters.hicache_storage",
            "class_name": "HiCacheBackend",
            "interface_v1": 1,
            "storage_backend": "file",
            "storage_options": {"root": str(root)},
            "storage_managers": managers,
        }
    )


@pytest.fixture
def server_args() -> Iterator[Callable[..., None]]:
    """Publish SGLang's runtime config for one test (restored afterwards)."""
    from sglang.srt.runtime_context import get_context

    installed: list[Any] = []

    def publish(**fields: object) -> None:
        override = get_context().override_server_args(
            **{
                "page_size": PAGE,
                "served_model_name": MODEL,
                "hicache_mem_layout": "page_first",
                **fields,
            }
        )
        override.install()
        installed.append(override)

    yield publish
    for override in reversed(installed):
        override.restore()


@pytest.fixture
def installed() -> Iterator[Any]:
    """``install()`` through SGLang's HookRegistry; every rebinding is undone afterwards."""
    import sglang.srt.disaggregation.decode_kvcache_offload_manager as origin
    import sglang.srt.managers.scheduler as scheduler
    from sglang_storage_adapters import decode

    with hooks_installed(origin.DecodeKVCacheOffloadManager, decode.install, decode):
        yield scheduler


class Rig:
    """SGLang's decode-side pools and tree cache on CPU, random KV in every device slot."""

    def __init__(self, *, mla: bool = False) -> None:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import (
            MHATokenToKVPool,
            MLATokenToKVPool,
            ReqToTokenPool,
        )
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.kv: Any
        if mla:
            self.kv = MLATokenToKVPool(
                size=DEVICE_TOKENS,
                page_size=PAGE,
                dtype=torch.bfloat16,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                layer_num=LAYERS,
                device="cpu",
                enable_memory_saver=False,
            )
            self.planes = list(self.kv.kv_buffer)
        else:
            self.kv = MHATokenToKVPool(
                size=DEVICE_TOKENS,
                page_size=PAGE,
                dtype=torch.bfloat16,
                head_num=HEADS,
                head_dim=DIM,
                layer_num=LAYERS,
                device="cpu",
                enable_memory_saver=False,
                enable_alt_stream=False,
                kv_cache_layout="nhd",
            )
            self.planes = [*self.kv.k_buffer, *self.kv.v_buffer]
        self.allocator = PagedTokenToKVPoolAllocator(
            DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", self.kv, need_sort=False
        )
        self.req_to_token = ReqToTokenPool(
            size=4, max_context_len=128, device="cpu", enable_memory_saver=False
        )
        self.tree = UnifiedRadixCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=self.req_to_token,
                token_to_kv_pool_allocator=self.allocator,
                page_size=PAGE,
                tree_components=(ComponentType.FULL,),
            )
        )
        gen = torch.Generator().manual_seed(11)
        for plane in self.planes:
            bits = torch.randint(-(2**15), 2**15, plane.shape, generator=gen, dtype=torch.int16)
            plane.view(torch.int16).copy_(bits)

    def kwargs(self, tp_group: Any) -> dict[str, Any]:
        """The scheduler's constructor arguments (``scheduler.py:643``)."""
        return {
            "req_to_token_pool": self.req_to_token,
            "token_to_kv_pool_allocator": self.allocator,
            "tp_group": tp_group,
            "tree_cache": self.tree,
        }

    def admit(self, rid: str, prompt: list[int], capacity: int, **kw: Any) -> Any:
        """A request with a row and ``capacity`` tokens of device KV, as prealloc leaves it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=capacity), **kw)
        assert self.req_to_token.alloc([req]) is not None
        slots = self.allocator.alloc(capacity)
        assert slots is not None
        self.req_to_token.write((req.kv.req_pool_idx, slice(0, capacity)), slots.to(torch.int32))
        req.kv.kv_allocated_len = capacity
        return req

    def rows(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [p[slots].view(torch.int16).clone() for p in self.planes]


def decode_step(manager: Any, req: Any, token: int) -> None:
    """One decode step of an unfinished request, as the scheduler runs it."""
    req.output_ids.append(token)
    manager.offload_kv_cache(req)
    manager.check_offload_progress()


def finish(manager: Any, req: Any, reason: Any) -> bool:
    """The finish path of ``process_batch_result_decode`` (``batch_result_processor.py:1455``)."""
    req.finished_reason = reason
    submitted = bool(manager.offload_kv_cache(req))
    if not submitted:
        manager.finalize_release_on_finish(req)
    return submitted


def settle(manager: Any) -> None:
    """The decode loop's polling until the manager is idle (bounded)."""
    import time

    for _ in range(int(WAIT_S / 0.02)):
        manager.check_offload_progress()
        if not manager.ongoing_offload and not manager.ongoing_backup:
            return
        time.sleep(0.02)
    raise AssertionError("the decode offload adapter did not settle")


def test_offload_finish_and_backup_store_byte_identical_pages(
    tp_group: Any, server_args: Callable[..., None], installed: Any, tmp_path: Path
) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.utils import storage_namespace_seed
    from sglang_storage_adapters.decode import DecodeOffloadAdapter

    server_args(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=_extra(tmp_path, ["kv", "decode"]),
    )
    rig = Rig()
    manager = installed.DecodeKVCacheOffloadManager(**rig.kwargs(tp_group))
    assert isinstance(manager, DecodeOffloadAdapter)
    free_before = rig.allocator.available_size()

    prompt = list(range(1000, 1010))  # 10 tokens: the prefill stored 2 whole pages
    req = rig.admit("r1", prompt, capacity=32, extra_key="lora-a")
    row = rig.req_to_token.req_to_token[req.kv.req_pool_idx, :32].to(torch.int64).clone()
    req.output_ids.append(1)  # the first token, from the prefill
    assert not manager.offload_kv_cache(req)  # 10 tokens on the device: no decode page yet
    submitted_at = []
    for step in range(2, 21):
        req.output_ids.append(step)
        if manager.offload_kv_cache(req):
            submitted_at.append(len(prompt) + len(req.output_ids) - 1)
            assert manager.has_inflight_device_transfer()  # the unified-memory move gate
            assert len(manager.ongoing_offload) == 1  # the scheduler's idle check
        manager.check_offload_progress()
        assert not manager.has_inflight_device_transfer()
    assert submitted_at == [12, 16, 20, 24, 28]  # one stride (a page) as each page fills
    manager.drain_before_retraction()  # nothing in flight: no raise

    assert not finish(manager, req, FINISH_LENGTH(length=20))  # 29 tokens: no new page
    assert req.kv.req_pool_idx is not None  # freed by check_offload_progress, not yet
    settle(manager)
    assert req.kv.req_pool_idx is None  # SGLang's release: row freed, KV slots given back
    assert rig.allocator.available_size() == free_before
    assert manager.manager.stats().host_pages == 0  # host pages freed on the backup ack

    tokens = [*prompt, *range(1, 20)]  # origin_input_ids + output_ids[:-1]
    seed = namespace_seed("lora-a", None)
    assert seed == storage_namespace_seed("lora-a", None)
    keys = page_hashes(tokens[:28], PAGE, seed)[2:]  # the 5 pages the decode side wrote
    manager.release_host_resources()

    # 1. Our backend (reopened on the same root) -> a fresh host pool -> a fresh device.
    backend = create_backend("file", {"root": str(tmp_path)})
    g = manager.host_pool.geometry
    host = KVHostPool(g, HostMemory(HostMemoryBudget(BudgetConfig(total=g.total_bytes))))
    pages = host.alloc(len(keys))
    hits = backend.get_into(
        [
            GetRequest(
                key=manager.namespace.key(k), spec=host.page_spec, buffers=host.page_views(p)
            )
            for k, p in zip(keys, pages.tolist(), strict=True)
        ]
    )
    assert [h.hit for h in hits] == [True] * len(keys)
    fresh = DeviceKV.allocate(g, DEVICE_TOKENS + PAGE)
    decoded = row[8:28]
    DeviceHostPipeline(fresh, host).load(pages, decoded)
    want = rig.rows(decoded)
    got = [p[decoded].view(torch.int16) for layer in range(LAYERS) for p in fresh.planes(layer)]
    got = [got[0], got[2], got[1], got[3]]  # planes() is per layer (k, v); rows() is K then V
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    backend.close()

    # 2. SGLang's own HiCache read path (a prefill instance on sglang_storage).
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from support.sglang_pools import build_sglang_host_pool

    sg = build_sglang_host_pool(
        attention="mha",
        layout="page_first",
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=8,
        head_num=HEADS,
        head_dim=DIM,
    )
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=MODEL,
        extra_config=json.loads(_extra(tmp_path, ["kv"])),
    )
    hicache = StorageBackendFactory.create_backend("dynamic", config, sg.pool)
    hicache.register_mem_pool_host(sg.pool)
    hicache.on_host_pools_registered()
    try:
        host_indices = torch.arange(len(keys) * PAGE, dtype=torch.int64)
        assert hicache.batch_get_v1(keys, host_indices) == [True] * len(keys)
        for i in range(len(keys)):
            slots = decoded[i * PAGE : (i + 1) * PAGE]
            k = torch.stack([rig.kv.k_buffer[layer][slots] for layer in range(LAYERS)], dim=1)
            v = torch.stack([rig.kv.v_buffer[layer][slots] for layer in range(LAYERS)], dim=1)
            expected = torch.cat([k.flatten(), v.flatten()]).view(torch.int16)
            page = sg.get_data_page(i * PAGE).view(torch.int16)
            assert torch.equal(page, expected)
    finally:
        hicache.close()


def test_mla_pages_round_trip(
    tp_group: Any, server_args: Callable[..., None], installed: Any, tmp_path: Path
) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN

    server_args(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=_extra(tmp_path, ["kv", "decode"]),
        hicache_mem_layout="layer_first",
    )
    rig = Rig(mla=True)
    manager = installed.DecodeKVCacheOffloadManager(**rig.kwargs(tp_group))
    req = rig.admit("mla", [7, 8, 9, 10, 11], capacity=16, cache_salt="salt")
    row = rig.req_to_token.req_to_token[req.kv.req_pool_idx, :16].to(torch.int64).clone()
    for step in range(1, 10):
        decode_step(manager, req, step)
    finish(manager, req, FINISH_MATCHED_TOKEN(matched=9))
    settle(manager)
    tokens = [7, 8, 9, 10, 11, *range(1, 9)]  # 13 tokens: pages 1 and 2 are the decode's
    keys = page_hashes(tokens[:12], PAGE, namespace_seed(None, "salt"))[1:]
    g = manager.host_pool.geometry
    host = KVHostPool(g, HostMemory(HostMemoryBudget(BudgetConfig(total=g.total_bytes))))
    pages = host.alloc(len(keys))
    hits = manager.backend.get_into(
        [
            GetRequest(
                key=manager.namespace.key(k), spec=host.page_spec, buffers=host.page_views(p)
            )
            for k, p in zip(keys, pages.tolist(), strict=True)
        ]
    )
    assert [h.hit for h in hits] == [True, True]
    fresh = DeviceKV.allocate(g, DEVICE_TOKENS + PAGE)
    DeviceHostPipeline(fresh, host).load(pages, row[4:12])
    got = [fresh.planes(layer)[0][row[4:12]].view(torch.int16) for layer in range(LAYERS)]
    assert all(torch.equal(a, b) for a, b in zip(got, rig.rows(row[4:12]), strict=True))
    manager.release_host_resources()


def test_abort_stores_nothing_more_and_frees_the_device(
    tp_group: Any, server_args: Callable[..., None], installed: Any, tmp_path: Path
) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    server_args(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=_extra(tmp_path, ["kv", "decode"]),
    )
    rig = Rig()
    manager = installed.DecodeKVCacheOffloadManager(**rig.kwargs(tp_group))
    free_before = rig.allocator.available_size()
    prompt = list(range(50, 58))  # 8 tokens: 2 prefill pages
    req = rig.admit("gone", prompt, capacity=24)
    other = rig.admit("kept", list(range(70, 74)), capacity=16)
    for step in range(1, 11):
        req.output_ids.append(step)
        other.output_ids.append(step)
        assert manager.offload_kv_cache(req) == (step in (5, 9))  # pages 2 and 3 due
        manager.offload_kv_cache(other)
    # Copies submitted at this step are not collected yet: the request still copies.
    assert manager.has_inflight_device_transfer()
    finish(manager, req, FINISH_ABORT(message="client went away"))
    assert req.kv.req_pool_idx is not None  # its copy has not been collected yet
    manager.check_offload_progress()
    assert req.kv.req_pool_idx is None  # copies landed: device KV freed
    assert other.kv.req_pool_idx is not None  # the other request decodes on
    # A sampling-mask abort: finalize_release_on_finish without offload_kv_cache first.
    manager.finalize_release_on_finish(other)
    settle(manager)
    assert other.kv.req_pool_idx is None
    assert rig.allocator.available_size() == free_before
    assert manager.manager.stats().host_pages == 0
    assert manager.backend.stats().objects == 0  # aborted requests store nothing
    manager.release_host_resources()


def test_a_request_without_offload_is_released_at_once(
    tp_group: Any, server_args: Callable[..., None], installed: Any, tmp_path: Path
) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    server_args(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=_extra(tmp_path, ["kv", "decode"]),
    )
    rig = Rig()
    manager = installed.DecodeKVCacheOffloadManager(**rig.kwargs(tp_group))
    req = rig.admit("short", [1, 2, 3], capacity=4)
    assert not finish(manager, req, FINISH_LENGTH(length=0))  # no output: nothing tracked
    assert req.kv.req_pool_idx is None
    manager.release_host_resources()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-only check; with CUDA the gpu test builds SGLang's class"
)
def test_without_decode_in_storage_managers_sglang_builds_its_own_class(
    tp_group: Any, server_args: Callable[..., None], installed: Any, tmp_path: Path
) -> None:
    import sglang.srt.disaggregation.decode_kvcache_offload_manager as origin

    server_args(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=_extra(tmp_path, ["kv"]),
    )
    rig = Rig()
    # SGLang's own constructor runs; on CPU it stops where SGLang pins its host pool.
    with pytest.raises(RuntimeError, match="NVIDIA driver") as error:
        installed.DecodeKVCacheOffloadManager(**rig.kwargs(tp_group))
    frames = [str(frame.path) for frame in error.traceback]
    assert origin.__file__ in frames  # SGLang's DecodeKVCacheOffloadManager.__init__ ran
    assert any(f.endswith("pool_host/common.py") for f in frames)


@pytest.mark.gpu
def test_without_flags_the_replacement_is_sglangs_class_on_gpu(
    tp_group: Any, server_args: Callable[..., None], installed: Any
) -> None:
    # Needs CUDA: SGLang's own host pool pins memory with cudaHostRegister.
    from sglang_storage_adapters.decode import DecodeOffloadAdapter

    server_args()  # no sglang_storage settings (and no L3 backend: no storage threads)
    manager = installed.DecodeKVCacheOffloadManager(**Rig().kwargs(tp_group))
    assert type(manager) is DecodeOffloadAdapter.__mro__[1]  # SGLang's own class
    manager.release_host_resources()
