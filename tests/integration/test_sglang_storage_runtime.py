"""One storage runtime per SGLang process: every adapter shares its budget, backend and
KV namespace rule.

Everything SGLang builds here is real and on CPU: the runtime config
(``override_server_args``, with ``get_parallel().override`` for the rank coordinates), the
device KV pool, allocator, ``ReqToTokenPool`` and tree cache of the decode side, ``Req``
objects, a one-rank gloo group, SGLang's own host pool and ``StorageBackendFactory`` for the
HiCache backend (SGLang's ``dynamic`` seam). The decode adapter is installed through SGLang's
``HookRegistry`` and built through the name the scheduler uses; the embedding controller is
built over the store the factory hook hands out, as ``MMEncoder.__init__`` does.

- A capped ``file`` root serves KV, decode and embedding at once (every manager on, the
  flags' default) and never holds more than its cap, though together they write more.
- With PP=2 and attention-CP=2 the decode adapter and the HiCache backend put a rank's KV
  pages in the same namespace; with decode-CP=2 the decode side's derivation (the decode
  adapter itself refuses DCP at build, see ``device_checks``) gives the HiCache one.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_hooks import hooks_installed
from support.sglang_pools import build_sglang_host_pool

from sglang_storage.managers.runtime import kv_page_namespace

pytestmark = pytest.mark.sglang

PAGE = 4
DEVICE_TOKENS = 256
LAYERS, HEADS, DIM = 2, 2, 8
LORA, ROPE = 16, 8  # MLA: 24-wide latent rows
MODEL = "test/one-runtime"
CAP = 256 << 10
EMBED_DIM = 1024
WAIT_S = 10.0


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def _extra(root: Path, **options: object) -> dict[str, object]:
    from sglang_storage_adapters.flags import AVAILABLE_MANAGERS

    return {
        "backend_name": "sglang_storage",
        "module_path": "sglang_storage_adapters.hicache_storage",
        "class_name": "HiCacheBackend",
        "interface_v1": 1,
        "storage_backend": "file",
        "storage_options": {"root": str(root), **options},
        "storage_managers": list(AVAILABLE_MANAGERS),  # the flags' default: every one
    }


@pytest.fixture
def publish() -> Iterator[Callable[..., Any]]:
    """Publish SGLang's runtime config for one test (restored afterwards)."""
    from sglang.srt.runtime_context import get_context

    installed: list[Any] = []

    def install(extra: dict[str, object], **fields: object) -> Any:
        override = get_context().override_server_args(
            page_size=PAGE,
            served_model_name=MODEL,
            model_path=MODEL,
            hicache_mem_layout="page_first",
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
            **fields,
        )
        server_args = override.install()
        installed.append(override)
        return server_args

    yield install
    for override in reversed(installed):
        override.restore()


@pytest.fixture
def decode_class() -> Iterator[Any]:
    """SGLang's decode offload class as the scheduler names it, our adapter installed."""
    import sglang.srt.disaggregation.decode_kvcache_offload_manager as origin
    import sglang.srt.managers.scheduler as scheduler
    from sglang_storage_adapters import decode

    with hooks_installed(origin.DecodeKVCacheOffloadManager, decode.install, decode):
        yield scheduler.DecodeKVCacheOffloadManager


class DecodeRig:
    """SGLang's decode-side MHA pool, allocator, request rows and tree cache on CPU."""

    def __init__(self) -> None:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

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

    def kwargs(self, tp_group: Any) -> dict[str, Any]:
        return {
            "req_to_token_pool": self.req_to_token,
            "token_to_kv_pool_allocator": self.allocator,
            "tp_group": tp_group,
            "tree_cache": self.tree,
        }

    def admit(self, rid: str, prompt: list[int], capacity: int) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=capacity))
        assert self.req_to_token.alloc([req]) is not None
        slots = self.allocator.alloc(capacity)
        assert slots is not None
        self.req_to_token.write((req.kv.req_pool_idx, slice(0, capacity)), slots.to(torch.int32))
        req.kv.kv_allocated_len = capacity
        return req


def _hicache(extra: dict[str, object], *, mla: bool = False, **ranks: Any) -> tuple[Any, Any]:
    """Our HiCache backend built by SGLang's factory and attached to SGLang's host pool."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = build_sglang_host_pool(
        attention="mla" if mla else "mha",
        layout="page_first",
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=8,
        head_num=HEADS,
        head_dim=DIM,
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
    )
    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        **ranks,
    }
    config = HiCacheStorageConfig(
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=MODEL,
        extra_config=json.loads(json.dumps(extra)),
        **fields,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool.pool)
    backend.register_mem_pool_host(pool.pool)
    backend.on_host_pools_registered()
    return backend, pool


def _sglang_storage_config_ranks(page_size: int) -> dict[str, Any]:
    """What SGLang's ``_generate_storage_config`` takes from the parallel state (no DP
    attention): TP, PP, attention CP (its attn-CP group's rank and size) and DCP."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    dcp_size = int(parallel.attn_dcp_size)
    return {
        "tp_rank": int(parallel.tp_rank),
        "tp_size": int(parallel.tp_size),
        "pp_rank": int(parallel.pp_rank),
        "pp_size": int(parallel.pp_size),
        "attn_cp_rank": int(parallel.attn_cp_rank),
        "attn_cp_size": int(parallel.attn_cp_size),
        "dcp_size": dcp_size,
        "dcp_rank": int(parallel.attn_dcp_rank) if dcp_size > 1 else 0,
        "logical_page_size": page_size if dcp_size > 1 else None,
    }


def _disk_bytes(root: Path) -> int:
    objects = root / "objects"
    return sum(path.stat().st_size for path in objects.rglob("*") if path.is_file())


# ---------------------------------------------------------------------- one capped root


def test_kv_decode_and_embedding_share_one_capped_backend(
    tmp_path: Path, publish: Callable[..., Any], decode_class: Any, tp_group: Any
) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Modality
    from sglang.srt.runtime_context import get_memory, get_parallel
    from sglang_storage_adapters.embedding import (
        StorageEmbeddingCacheController,
        StorageEmbeddingStore,
        embedding_settings,
    )

    root = tmp_path / "capped"
    extra = _extra(root, capacity_bytes=CAP)
    publish(extra)
    written = 0

    # KV: SGLang's HiCache controller writes through our dynamic backend (v1 zero copy).
    hicache, pool = _hicache(extra)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))
    page_bytes = pool.get_data_page(0).numel() * pool.get_data_page(0).element_size()
    host_indices = torch.arange(8 * PAGE, dtype=torch.int64)
    for batch in range(18):  # 144 pages: more than half the cap
        keys = [f"kv-{batch}-{i}" for i in range(8)]
        assert hicache.batch_set_v1(keys, host_indices) == [True] * 8
        written += 8 * page_bytes
    backend = hicache.backend
    assert backend.stats().capacity_bytes == CAP
    assert backend.stats().bytes <= CAP

    # Decode: it starts (it failed on a capped backend before) and writes a request.
    rig = DecodeRig()
    decode = decode_class(**rig.kwargs(tp_group))
    assert decode.backend is backend  # one instance for both: one cap
    req = rig.admit("r1", list(range(100, 108)), capacity=40)
    for token in range(1, 30):
        req.output_ids.append(token)
        decode.offload_kv_cache(req)
        decode.check_offload_progress()
    req.finished_reason = FINISH_LENGTH(length=29)
    if not decode.offload_kv_cache(req):
        decode.finalize_release_on_finish(req)
    end = time.monotonic() + WAIT_S
    while decode.ongoing_offload or decode.ongoing_backup:
        assert time.monotonic() < end, "the decode offload adapter did not settle"
        decode.check_offload_progress()
        time.sleep(0.02)
    assert backend.stats().bytes <= CAP

    # Embedding: the store the factory hook hands out, and SGLang's encoder controller.
    with get_parallel().override(tp_size=1, tp_rank=0):
        # The published config's memory namespace carries the ServerArgs fields the
        # encoder's factory hook reads (override_server_args leaves the struct's unset).
        settings = embedding_settings(get_memory())
        assert settings is not None
        store = StorageEmbeddingStore(settings)
        assert store.backend is backend
        controller = StorageEmbeddingCacheController(
            embedding_store=store,
            max_pool_size_gb=8 * (256 << 10) / 0.8 / 1024**3,
            hidden_dims={Modality.IMAGE: EMBED_DIM, Modality.AUDIO: EMBED_DIM},
            dtype=torch.bfloat16,
        )
        hashes = [f"{i:016x}" for i in (0xA1, 0xB2, 0xC3)]
        # 64 KiB each: all three can be in flight at once under the 256 KiB cap (two
        # 128 KiB writes could not: the second would be refused while the first runs).
        embeddings = [torch.ones((32, EMBED_DIM), dtype=torch.bfloat16) * i for i in (1, 2, 3)]
        staged = controller.store_to_pool_async(hashes, embeddings, Modality.IMAGE)
        controller.wait_store_to_pool(staged)
        controller.insert_batch(hashes, Modality.IMAGE)
        written += sum(e.numel() * e.element_size() for e in embeddings)
        end = time.monotonic() + WAIT_S
        while not store.batch_is_exist(hashes)[-1]:
            assert time.monotonic() < end, "the last embedding was not stored"
            controller.insert_batch(hashes, Modality.IMAGE)
            time.sleep(0.01)

    assert written > CAP  # together they wrote more than the cap ...
    stats = backend.stats()
    assert stats.bytes <= CAP  # ... and the one backend holds at most the cap
    assert _disk_bytes(root) <= CAP  # headers included, on the medium itself
    assert hicache.batch_exists([f"kv-0-{i}" for i in range(8)]) == 0  # the oldest went

    controller.close()
    store.close()
    decode.release_host_resources()
    assert backend.stats().objects > 0  # still open: the HiCache backend holds it
    hicache.close()


def test_each_adapter_budget_is_the_process_budget(
    tmp_path: Path, publish: Callable[..., Any], decode_class: Any, tp_group: Any
) -> None:
    from sglang.srt.runtime_context import get_memory
    from sglang_storage_adapters.runtime import process_runtime, runtime_settings

    from sglang_storage.core import DataKind

    publish(_extra(tmp_path / "l3"))
    settings = runtime_settings(get_memory())  # what the decode adapter reads
    assert settings is not None
    runtime = process_runtime(settings)
    before = runtime.budget.stats().kinds[DataKind.KV].used
    rig = DecodeRig()
    decode = decode_class(**rig.kwargs(tp_group))
    assert decode.runtime is runtime
    pool_bytes = decode.host_pool.geometry.total_bytes
    assert runtime.used("decode") >= pool_bytes
    assert runtime.budget.stats().kinds[DataKind.KV].used == before + pool_bytes
    decode.release_host_resources()
    assert runtime.budget.stats().kinds[DataKind.KV].used == before


# ---------------------------------------------------------------------- one namespace


def _mla_page_spec() -> Any:
    """The page spec of the decode adapter's MLA host pool (``host_pool_geometry``)."""
    from sglang_storage.memory import Attention, KVGeometry, KVLayout, tensor_spec

    g = KVGeometry(
        attention=Attention.MLA,
        layout=KVLayout.PAGE_FIRST,
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=8,
        head_num=1,
        head_dim=LORA + ROPE,
    )
    return tensor_spec(g.dtype, g.page_shape, g.layout.value)


RANKS = [(pp, cp) for pp in (0, 1) for cp in (0, 1)]


def test_decode_and_hicache_derive_one_namespace_with_pp_and_attention_cp(
    tmp_path: Path, publish: Callable[..., Any], decode_class: Any, tp_group: Any
) -> None:
    from sglang.srt.runtime_context import get_parallel

    extra = _extra(tmp_path / "l3")
    publish(extra, tp_size=2, pp_size=2, attn_cp_size=2)
    found = {}
    for pp_rank, cp_rank in RANKS:
        # attention TP is 1 wide here, so the TP rank is the attention-CP rank.
        ranks = {"tp_rank": cp_rank, "attn_tp_rank": 0, "attn_dp_rank": 0}
        with get_parallel().override(pp_rank=pp_rank, attn_cp_rank=cp_rank, **ranks):
            decode = decode_class(**DecodeRig().kwargs(tp_group))
            hicache, _ = _hicache(extra, **_sglang_storage_config_ranks(PAGE))
        try:
            assert decode.namespace == hicache.namespace(), (pp_rank, cp_rank)
            assert hicache.object_key("k").namespace == decode.namespace
            found[pp_rank, cp_rank] = decode.namespace
        finally:
            decode.release_host_resources()
            hicache.close()
    assert len(set(found.values())) == len(RANKS)  # every rank its own pages


def test_the_decode_derivation_matches_hicache_with_decode_cp(
    tmp_path: Path, publish: Callable[..., Any]
) -> None:
    from sglang.srt.runtime_context import get_parallel
    from sglang_storage_adapters.runtime import process_rank_layout

    extra = _extra(tmp_path / "l3")
    publish(extra, tp_size=2, pp_size=2, dcp_size=2)
    spec = _mla_page_spec()
    found = []
    for dcp_rank in (0, 1):
        ranks = {"tp_rank": dcp_rank, "attn_tp_rank": dcp_rank, "attn_dp_rank": 0}
        with get_parallel().override(pp_rank=1, attn_cp_rank=0, attn_dcp_rank=dcp_rank, **ranks):
            hicache, _ = _hicache(extra, mla=True, **_sglang_storage_config_ranks(PAGE))
            # The decode adapter's own derivation (decode.py), for this rank.
            ours = kv_page_namespace(
                MODEL,
                pool="kv",
                mla=True,
                shared=True,
                dtype=spec.dtype,
                shape=spec.shape,
                layout=spec.layout,
                page_size=PAGE,
                ranks=process_rank_layout(page_size=PAGE, tp_rank=0, tp_size=1),
            )
        try:
            assert ours == hicache.namespace(), dcp_rank
            found.append(ours)
        finally:
            hicache.close()
    assert found[0] != found[1]  # each DCP shard its own pages
