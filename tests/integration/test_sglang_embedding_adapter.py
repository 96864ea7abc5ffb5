"""The encoder embedding caches of SGLang 0.5.23 on our embedding manager (adapters in
``sglang_storage_adapters.embedding``), driven the way SGLang's callers drive them.

``EmbeddingCacheController``: the calls of ``MMEncoder._compute_global_cache_embedding``
(``srt/disaggregation/encoder/server.py:1363-1706``) for TP rank 0 on its CPU output path,
in its order: ``batch_is_exist`` (awaited), ``prefetch``, ``check_prefetch_progress`` polled
every 5 ms, ``has_local_embedding``, ``store_to_pool_async``, then in a background task
``wait_store_to_pool`` and ``insert_batch`` on ``asyncio.to_thread`` workers, and the
assembly's ``get_embedding_dim``/``get_pool_views``/``release_pool_views`` (or
``load_to_device_async``/``wait_load_to_device``). SGLang's own methods need CUDA for the
assembly (``torch.empty(pin_memory=True)`` and ``torch.cuda.current_stream().synchronize()``
in ``_assemble_global_cache_cpu``), so on CPU :func:`compute_global_cache_embedding` below
repeats that sequence; the ``gpu`` test runs SGLang's own method on the adapter instead.

``MultiModalStaticCache``: the calls of ``srt/managers/mm_schedule.py``
(``get_single``/``set``/``get_single`` then the token-count check and ``free``;
``combine_hashes``/``get``/``set`` for the combined path).

Storage is the file backend; "another encoder rank" is a second controller over the same
directory in this process, and a second process that installs the adapters through SGLang's
own ``load_plugins()`` (our entry point, HookRegistry) and constructs the store and the
controller exactly as ``MMEncoder.__init__`` does.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult
from sglang.srt.multimodal.evs.evs_module import EVSEmbeddingResult
from sglang.srt.runtime_context import get_parallel
from sglang_storage_adapters.embedding import (
    EmbeddingSettings,
    StorageEmbeddingCacheController,
    StorageEmbeddingStore,
    StorageMultiModalCache,
    object_name,
)
from sglang_storage_adapters.patching import (
    apply_patches,
    load_patches,
    locate_sglang,
    pristine_copy,
    revert_patches,
)

from sglang_storage.errors import StateError
from sglang_storage.storage import FileBackend

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]
DIM, AUDIO_DIM = 1024, 512  # bf16: 128 and 256 rows per 256 KiB page (SGLang's page rule)
DTYPE = torch.bfloat16
VISION_PAGES = 6
POOL_GB = VISION_PAGES * (256 << 10) / 0.8 / 1024**3  # vision gets 80% (6 pages), audio 1
WAIT_S = 10.0


# ---------------------------------------------------------------------- helpers


def rows(mm_hash: str, n: int, dim: int = DIM) -> torch.Tensor:
    """The ViT output of one item: deterministic per hash."""
    seed = int(mm_hash, 16) % (2**31) if all(c in "0123456789abcdef" for c in mm_hash) else 7
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((n, dim), generator=generator).to(DTYPE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.int16), b.view(torch.int16))
    )


@pytest.fixture(autouse=True)
def single_rank() -> Iterator[None]:
    """What ``MMEncoder.__init__`` publishes for a one-rank encoder (tp_size 1, rank 0)."""
    with get_parallel().override(tp_size=1, tp_rank=0):
        yield


@pytest.fixture
def settings(tmp_path: Path) -> EmbeddingSettings:
    return EmbeddingSettings(
        backend="file", backend_options={"root": str(tmp_path / "store")}, model="org/vlm-7b"
    )


Closer = Callable[[Any], Any]


@pytest.fixture
def build(settings: EmbeddingSettings) -> Iterator[Callable[..., StorageEmbeddingCacheController]]:
    """Controllers built as ``MMEncoder.__init__`` builds them (server.py:663-677)."""
    made: list[tuple[StorageEmbeddingCacheController, StorageEmbeddingStore]] = []

    def make(**options: Any) -> StorageEmbeddingCacheController:
        store = StorageEmbeddingStore(settings)  # what the factory hook hands out
        controller = StorageEmbeddingCacheController(
            embedding_store=store,
            max_pool_size_gb=options.pop("max_pool_size_gb", POOL_GB),
            hidden_dims={Modality.IMAGE: DIM, Modality.VIDEO: DIM, Modality.AUDIO: AUDIO_DIM},
            all_rank_get=False,
            dtype=DTYPE,
            **options,
        )
        made.append((controller, store))
        return controller

    yield make
    for controller, store in made:
        controller.close()
        store.close()


class ViT:
    """The encoder forward of the missing items; counts what it had to encode."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def __call__(self, hashes: Sequence[str], tokens: Sequence[int]) -> list[torch.Tensor]:
        self.encoded += hashes
        return [rows(h, n) for h, n in zip(hashes, tokens, strict=True)]


async def compute_global_cache_embedding(
    cache: StorageEmbeddingCacheController,
    req_id: str,
    hashes: list[str],
    tokens: list[int],
    vit: ViT,
    *,
    modality: Modality = Modality.IMAGE,
    via_device_load: bool = False,
) -> torch.Tensor:
    """``MMEncoder._compute_global_cache_embedding`` for rank 0, TP 1 (server.py:1628-1706)."""
    background: set[asyncio.Task[None]] = set()
    # _lookup_global_cache (1363): rank 0 asks, a failure is all misses.
    try:
        exist_mask = await cache.batch_is_exist(hashes)
    except Exception:  # noqa: BLE001 - SGLang's own fallback
        exist_mask = [False] * len(hashes)
    missing = [i for i, e in enumerate(exist_mask) if not e]
    hits = [i for i, e in enumerate(exist_mask) if e]
    # _prefetch_global_cache_hits (1392)
    hit_hashes = [hashes[i] for i in hits]
    if hits:
        cache.prefetch(req_id, hit_hashes, [tokens[i] for i in hits], modality)
    new_slices = vit([hashes[i] for i in missing], [tokens[i] for i in missing])

    def stage(indices: list[int], slices: list[torch.Tensor]) -> tuple[list[str], list[Any]]:
        # _stage_global_cache_slices (1461)
        if not slices:
            return [], []
        staged = [hashes[i] for i in indices]
        return staged, cache.store_to_pool_async(staged, slices, modality)

    miss_hashes, miss_handles = stage(missing, new_slices)
    # _wait_global_cache_prefetch (1414): poll every 5 ms, 60 s timeout, then local check.
    fallback: list[int] = []
    if hits:

        async def wait() -> None:
            while not cache.check_prefetch_progress(req_id):
                await asyncio.sleep(0.005)

        await asyncio.wait_for(wait(), timeout=60.0)
        fallback = [
            idx for i, idx in enumerate(hits) if not cache.has_local_embedding(hit_hashes[i])
        ]
    fallback_slices = vit([hashes[i] for i in fallback], [tokens[i] for i in fallback])
    fb_hashes, fb_handles = stage(fallback, fallback_slices)
    # _assemble_global_cache_cpu (1516) / _assemble_global_cache_gpu (1585)
    dim = cache.get_embedding_dim(modality)
    out = torch.empty((sum(tokens), dim), dtype=DTYPE)
    served = [hashes[i] for i in hits if i not in fallback]
    views: dict[str, list[torch.Tensor]] = {}
    handles: list[Any] = []
    try:
        if served and not via_device_load:
            for h, slices in zip(served, cache.get_pool_views(served), strict=True):
                assert slices is not None, f"cached embedding {h} not available"
                views[h] = slices
        offset = 0
        fresh = dict(zip(missing + fallback, new_slices + fallback_slices, strict=True))
        for idx, n in enumerate(tokens):
            if idx in fresh:
                out[offset : offset + n].copy_(fresh[idx])
            elif via_device_load:
                handle = cache.load_to_device_async(hashes[idx], out, offset)
                assert handle is not None, f"cached embedding {hashes[idx]} disappeared"
                handles.append(handle)
            else:
                copied = 0
                for view in views[hashes[idx]]:
                    out[offset + copied : offset + copied + view.shape[0]].copy_(view)
                    copied += view.shape[0]
            offset += n
        if via_device_load:
            cache.wait_load_to_device(handles)
    finally:
        if served and not via_device_load:
            cache.release_pool_views(served)

    # _launch_global_cache_insert (1481): a background task on worker threads.
    async def insert(staged: list[str], staged_handles: list[Any]) -> None:
        await asyncio.to_thread(cache.wait_store_to_pool, staged_handles)
        await asyncio.to_thread(cache.insert_batch, staged, modality)

    if miss_hashes + fb_hashes:
        task = asyncio.create_task(insert(miss_hashes + fb_hashes, miss_handles + fb_handles))
        background.add(task)
    await asyncio.gather(*background)
    return out


def expected(hashes: Sequence[str], tokens: Sequence[int], dim: int = DIM) -> torch.Tensor:
    return torch.cat([rows(h, n, dim) for h, n in zip(hashes, tokens, strict=True)])


def wait_stored(store: StorageEmbeddingStore, hashes: list[str]) -> None:
    """Until every hash is in storage (the puts finish on the pipeline's workers)."""
    end = time.monotonic() + WAIT_S
    while not all(store.batch_is_exist(hashes)):
        assert time.monotonic() < end, f"not stored after {WAIT_S}s: {hashes}"
        time.sleep(0.01)


H = [f"{i:016x}" for i in (0xA1, 0xB2, 0xC3, 0xD4, 0xE5)]


# ---------------------------------------------------------------------- the controller


def test_misses_are_encoded_stored_and_another_rank_reads_them_byte_identical(
    build: Callable[..., StorageEmbeddingCacheController],
) -> None:
    first, second = build(), build()
    vit = ViT()
    hashes, tokens = H[:3], [200, 130, 64]
    out = asyncio.run(compute_global_cache_embedding(first, "r1", hashes, tokens, vit))
    assert vit.encoded == hashes
    assert same_bytes(out, expected(hashes, tokens))
    assert all(first.has_local_embedding(h) for h in hashes)  # READY in rank A's pool
    wait_stored(first.embedding_store, hashes)

    # Another encoder (fresh pools, same storage): global hits, prefetched, no ViT.
    vit_b = ViT()
    again = asyncio.run(compute_global_cache_embedding(second, "r2", hashes, tokens, vit_b))
    assert vit_b.encoded == []
    assert same_bytes(again, out)
    stats = second.get_stats()
    assert stats["num_cached"] == 3
    assert stats["allocation_failures"] == 0
    # A local hit now: the same answer through the device-load path, still no ViT.
    third = asyncio.run(
        compute_global_cache_embedding(second, "r3", hashes, tokens, vit_b, via_device_load=True)
    )
    assert vit_b.encoded == []
    assert same_bytes(third, out)


def test_mixed_request_and_audio_pool(
    build: Callable[..., StorageEmbeddingCacheController],
) -> None:
    cache = build()
    vit = ViT()
    asyncio.run(compute_global_cache_embedding(cache, "r1", H[:1], [100], vit))
    hashes, tokens = [H[0], H[1]], [100, 50]
    out = asyncio.run(compute_global_cache_embedding(cache, "r2", hashes, tokens, vit))
    assert vit.encoded == [H[0], H[1]]  # H[0] was a local hit the second time
    assert same_bytes(out, expected(hashes, tokens))
    # Audio has its own pool and width.
    assert cache.get_embedding_dim(Modality.AUDIO) == AUDIO_DIM
    audio = [rows(H[4], 40, AUDIO_DIM)]
    staged = cache.store_to_pool_async([H[4]], audio, Modality.AUDIO)
    cache.wait_store_to_pool(staged)
    cache.insert_batch([H[4]], Modality.AUDIO)
    views = cache.get_pool_views([H[4]])
    assert views[0] is not None
    assert same_bytes(torch.cat(views[0]), audio[0])
    # A wrong width is skipped (SGLang's rule), an unknown modality has no pool.
    assert cache.store_to_pool_async([H[3]], [rows(H[3], 8, DIM + 1)], Modality.IMAGE) == []
    assert cache.store_to_pool_async([H[3]], [rows(H[3], 8)], None) == []
    assert not cache.has_local_embedding(H[3])


def test_eviction_under_the_pool_budget_and_reload_from_storage(
    build: Callable[..., StorageEmbeddingCacheController],
) -> None:
    cache = build()
    vit = ViT()
    # 6 vision pages: three 2-page items fill it; a fourth evicts the least recently used.
    for i in range(3):
        asyncio.run(compute_global_cache_embedding(cache, f"r{i}", [H[i]], [256], vit))
    assert cache.get_stats()["vision_free_pages"] == 0
    asyncio.run(compute_global_cache_embedding(cache, "touch", [H[1], H[2]], [256, 256], vit))
    assert vit.encoded == H[:3]
    wait_stored(cache.embedding_store, H[:3])
    asyncio.run(compute_global_cache_embedding(cache, "r3", [H[3]], [256], vit))
    assert not cache.has_local_embedding(H[0])  # the LRU victim
    assert all(cache.has_local_embedding(h) for h in H[1:4])
    # The victim is still a global hit: prefetched back byte-identical, not re-encoded.
    out = asyncio.run(compute_global_cache_embedding(cache, "r4", [H[0]], [256], vit))
    assert vit.encoded == H[:4]
    assert same_bytes(out, rows(H[0], 256))
    assert cache.has_local_embedding(H[0])

    # enable_eviction=False: a full pool refuses, counts a failure, the request still works.
    strict = build(enable_eviction=False)
    for i in range(3):
        staged = strict.store_to_pool_async([H[i]], [rows(H[i], 256)], Modality.IMAGE)
        strict.wait_store_to_pool(staged)
    assert strict.store_to_pool_async([H[3]], [rows(H[3], 256)], Modality.IMAGE) == []
    assert strict.get_stats()["allocation_failures"] == 1
    assert all(strict.has_local_embedding(h) for h in H[:3])
    assert not strict.has_local_embedding(H[3])


def test_storage_misses_and_corrupt_objects_fall_back_to_the_encoder(
    build: Callable[..., StorageEmbeddingCacheController],
) -> None:
    writer = build()
    vit = ViT()
    asyncio.run(compute_global_cache_embedding(writer, "w", H[:2], [100, 100], vit))
    wait_stored(writer.embedding_store, H[:2])
    assert isinstance(writer.embedding_store.backend, FileBackend)
    root = Path(str(writer.embedding_store.settings.backend_options["root"]))
    (victim,) = [p for p in root.rglob("*") if p.is_file() and object_name(H[1]) in p.name]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))

    reader = build()
    # batch_is_exist says hit for both (a hint); the corrupt one fails its check on read.
    vit_r = ViT()
    out = asyncio.run(compute_global_cache_embedding(reader, "r", H[:2], [100, 100], vit_r))
    assert vit_r.encoded == [H[1]]  # the fallback re-encoded only the corrupt one
    assert same_bytes(out, expected(H[:2], [100, 100]))
    # A prefetch of a hash never stored ends as a miss, not a hang.
    reader.prefetch("gone", [H[4]], [10], Modality.IMAGE)
    end = time.monotonic() + WAIT_S
    while not reader.check_prefetch_progress("gone"):
        assert time.monotonic() < end
        time.sleep(0.005)
    assert not reader.has_local_embedding(H[4])
    assert reader.get_pool_views([H[4]]) == [None]
    assert reader.load_to_device_async(H[4], torch.empty((10, DIM), dtype=DTYPE), 0) is None


def test_the_store_refuses_sglang_s_pointer_interface(settings: EmbeddingSettings) -> None:
    store = StorageEmbeddingStore(settings)
    try:
        with pytest.raises(StateError, match="0003"):
            store.batch_get_into_multi_buffers(["a"], [[0]], [[1]])
        assert store.batch_is_exist(["a"]) == [False]  # no pool registered a namespace
    finally:
        store.close()


def test_unsafe_hashes_get_digest_names() -> None:
    assert object_name(12345) == "12345"
    assert object_name("abc_1.2") == "abc_1.2"
    negative = object_name(-5)
    assert negative.startswith("sha256-")
    assert negative == object_name("-5")
    assert object_name("../x") != object_name("..-x")


# ---------------------------------------------------------------------- the static cache


def test_static_cache_keeps_device_evictions_on_host(settings: EmbeddingSettings) -> None:
    one = rows(H[0], 64).element_size() * 64 * DIM  # bytes of one 64-row item
    # Two items on the "device" tier, eight pages (of 128 rows) on the host tier.
    cache = StorageMultiModalCache(2 * one, settings=settings, host_bytes=8 * (256 << 10))
    try:
        items = {int(h, 16): rows(h, 64) for h in H[:3]}
        for mm_hash, emb in items.items():
            # mm_schedule._get_chunked_embedding_by_item: get_single miss, encode, set, re-get.
            assert cache.get_single(mm_hash) is None
            assert cache.set(mm_hash, EmbeddingResult(embedding=emb))
            assert same_bytes(cache.get_single(mm_hash).embedding, emb)
        first = int(H[0], 16)
        assert first not in cache.mm_cache  # SGLang's own LRU evicted it...
        assert cache.has(first)
        back = cache.get_single(first)  # ...and the host tier gives it back
        assert type(back) is EmbeddingResult
        assert same_bytes(back.embedding, items[first])
        assert first in cache.mm_cache  # re-admitted on the device tier

        # The combined path (mm_schedule._get_chunked_embedding_full).
        hashes = [int(h, 16) for h in H[3:5]]
        combined = StorageMultiModalCache.combine_hashes(hashes)
        both = torch.cat([rows(H[3], 32), rows(H[4], 32)])
        assert cache.get(hashes) is None
        cache.set(combined, EmbeddingResult(embedding=both))
        cache.mm_cache.clear()  # a device-tier flush: only the host tier holds it now
        cache.current_size = 0
        assert same_bytes(cache.get(hashes).embedding, both)

        # A token-count mismatch frees the entry: it must not come back from the host tier.
        assert cache.free(first, None)
        assert cache.get_single(first) is None
        assert not cache.has(first)
        cache.set(first, EmbeddingResult(embedding=rows(H[1], 64)))  # new content, same hash
        cache.mm_cache.clear()
        cache.current_size = 0
        assert cache.get_single(first) is None  # the stale host copy stays withdrawn

        # EVS results keep their extra fields only on the device tier.
        evs = EVSEmbeddingResult(embedding=rows(H[2], 16), num_tokens_per_frame=[8, 8])
        assert cache.set(99, evs)
        assert cache.get_single(99) is evs
        cache.mm_cache.clear()
        cache.current_size = 0
        assert cache.get_single(99) is None
        cache.clear()
        assert len(cache) == 0
        assert cache.get_single(int(H[1], 16)) is None
    finally:
        cache.close()


# ------------------------------------------------------------ install; SGLang unchanged

SECOND_PROCESS = textwrap.dedent(
    """
    import asyncio, json, sys, traceback, types
    import torch
    from sglang.srt.runtime_context import get_context, get_parallel, reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.mem_cache import embedding_cache_controller as ecc, multimodal_cache as mmc
    from sglang.srt.mem_cache.embedding_store import EmbeddingStore, EmbeddingStoreFactory
    from sglang.srt.managers import mm_schedule
    import sglang_storage_adapters.embedding as adapter

    root = sys.argv[1]
    flags, hashes, tokens = (json.loads(a) for a in sys.argv[2:5])
    out = {}
    original = (ecc.EmbeddingCacheController, mmc.MultiModalStaticCache,
                mm_schedule.MultiModalStaticCache)

    # 1. Published ServerArgs without --storage-* flags: install() hooks nothing.
    ctx = get_context()
    ctx.set_server_args(ServerArgs(model_path="org/vlm-7b"))
    out["installed_without_flags"] = adapter.install()
    out["untouched"] = (ecc.EmbeddingCacheController, mmc.MultiModalStaticCache,
                        mm_schedule.MultiModalStaticCache) == original
    reset_context()

    # 2. SGLang's load_plugins() at process start (nothing published): our entry point's
    #    installer hooks, deciding at construction time.
    from sglang.srt.plugins import load_plugins
    from sglang_storage_adapters import plugin
    load_plugins()
    out["installed_at_start"] = "sglang_storage_adapters.embedding:install" in plugin.installed()
    out["rebound"] = (ecc.EmbeddingCacheController is adapter.StorageEmbeddingCacheController
                      and mm_schedule.MultiModalStaticCache is adapter.StorageMultiModalCache)
    class Dummy(EmbeddingStore):
        batch_get = batch_put = batch_get_into_multi_buffers = None
        batch_put_from_multi_buffers = batch_is_exist = None
    Dummy.__abstractmethods__ = frozenset()
    sys.modules["__main__"].Dummy = Dummy
    EmbeddingStoreFactory.register_backend("dummy", "__main__", "Dummy")
    ctx.set_server_args(ServerArgs(model_path="org/vlm-7b"))
    store = EmbeddingStoreFactory.create_backend("dummy")
    out["store_without_flags"] = type(store).__name__
    mm_schedule.init_mm_embedding_cache(1 << 20)
    out["static_without_flags"] = type(mm_schedule.embedding_cache) is original[1]
    # SGLang's own controller: it reads the TP group, then allocates pinned pools.
    try:
        with get_parallel().override(tp_size=1, tp_rank=0,
                                     tp_group=types.SimpleNamespace(cpu_group=None)):
            controller = ecc.EmbeddingCacheController(
                embedding_store=store, hidden_dims={Modality.IMAGE: 64}, all_rank_get=False,
                max_pool_size_gb=0.001)
        out["controller_without_flags"] = type(controller) is original[0]
        controller.stop_event.set()
    except RuntimeError as error:  # CPU only: pin_memory needs CUDA
        frames = [f.name for f in traceback.extract_tb(error.__traceback__)]
        out["controller_without_flags"] = ("create" in frames and "_create_pools" in frames
                                           and not any("adapter" in f for f in frames))
        out["sglang_needs_cuda"] = str(error)[:80]

    # 3. The --storage-* flags name the embedding manager: ours, reading rank A's objects.
    ctx.set_server_args(ServerArgs(model_path="org/vlm-7b", **flags))
    store = EmbeddingStoreFactory.create_backend("mooncake")
    out["store_with_flags"] = type(store).__name__
    with get_parallel().override(tp_size=1, tp_rank=0):
        cache = ecc.EmbeddingCacheController(
            embedding_store=store, hidden_dims={Modality.IMAGE: %(dim)d}, all_rank_get=False,
            dtype=torch.bfloat16, max_pool_size_gb=%(gb)r)
        out["controller_with_flags"] = type(cache).__name__
        mask = asyncio.run(cache.batch_is_exist(hashes))
        cache.prefetch("req", hashes, tokens, Modality.IMAGE)
        while not cache.check_prefetch_progress("req"):
            pass
        views = cache.get_pool_views(hashes)
        cache.release_pool_views(hashes)
    out["mask"] = mask
    torch.save([torch.cat(v) for v in views], root + "/read.pt")
    mm_schedule.init_mm_embedding_cache(1 << 20)
    out["static_with_flags"] = type(mm_schedule.embedding_cache).__name__
    cache.close(); mm_schedule.embedding_cache.close()
    print(json.dumps(out))
    """
)


def test_install_switches_only_with_the_flags_and_a_second_process_reads(
    build: Callable[..., StorageEmbeddingCacheController],
    settings: EmbeddingSettings,
    tmp_path: Path,
) -> None:
    writer = build()
    hashes, tokens = H[:2], [150, 40]
    staged = writer.store_to_pool_async(
        hashes, [rows(h, n) for h, n in zip(hashes, tokens, strict=True)], Modality.IMAGE
    )
    writer.wait_store_to_pool(staged)
    writer.insert_batch(hashes, Modality.IMAGE)
    wait_stored(writer.embedding_store, hashes)

    extra = {
        "backend_name": "sglang_storage",
        "storage_backend": "file",
        "storage_options": dict(settings.backend_options),
        "storage_managers": ["kv", "embedding"],
    }
    flags = {
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps(extra),
    }
    script = SECOND_PROCESS % {"dim": DIM, "gb": POOL_GB}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(tmp_path),
            json.dumps(flags),
            json.dumps(hashes),
            json.dumps(tokens),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["installed_without_flags"] is False
    assert out["untouched"] is True
    assert out["installed_at_start"] is True
    assert out["rebound"] is True  # HookRegistry re-bound mm_schedule's `from` import
    assert out["store_without_flags"] == "Dummy"
    assert out["static_without_flags"] is True
    assert out["controller_without_flags"] is True, out.get("sglang_needs_cuda")
    assert out["store_with_flags"] == "StorageEmbeddingStore"
    assert out["controller_with_flags"] == "StorageEmbeddingCacheController"
    assert out["static_with_flags"] == "StorageMultiModalCache"
    assert out["mask"] == [True, True]
    read = torch.load(tmp_path / "read.pt")
    assert all(same_bytes(r, rows(h, n)) for r, h, n in zip(read, hashes, tokens, strict=True))


# ---------------------------------------------------------------------- patch 0003


def test_patch_0003_wires_install_into_every_mm_encoder(tmp_path: Path) -> None:
    patch = next(
        p for p in load_patches(ROOT / "patches" / "sglang-0.5.23") if p.name.startswith("0003-")
    )
    target = "srt/disaggregation/encoder/server.py"
    assert [section.path for section in patch.files] == [target]
    assert patch.hunk_count == 1
    added = [
        line.decode().strip()
        for section in patch.files
        for hunk in section.hunks
        for line in hunk.new_lines
        if line not in hunk.old_lines
    ]
    assert [a for a in added if a and not a.startswith("#")] == [
        "from sglang_storage_adapters.embedding import install",
        "install()",
    ]
    package = tmp_path / "sglang"
    # As the wheel ships it, also after `make apply-patches` patched the venv's copy.
    names = ("__init__.py", "_version.py", "version.py", target)
    tree = pristine_copy(locate_sglang(), package, [patch], names)
    pristine = (package / target).read_bytes()
    apply_patches(tree, [patch])
    text = (package / target).read_text()
    compile(text, target, "exec")
    # In MMEncoder.__init__, before both caches are built (mm_cache, then mm_global_cache).
    init = text.index("class MMEncoder")
    call = text.index("        install()\n", init)
    assert call < text.index("self.mm_cache = MultiModalStaticCache(", init)
    assert call < text.index("self.mm_global_cache = EmbeddingCacheController(", init)
    revert_patches(tree, [patch])
    assert (package / target).read_bytes() == pristine


# ---------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_sglang_s_own_encoder_method_on_the_adapter(
    build: Callable[..., StorageEmbeddingCacheController],
) -> None:
    """SGLang's ``MMEncoder._compute_global_cache_embedding`` itself, both output paths.

    Needs CUDA: its assembly pins memory and synchronises the CUDA stream, and its
    ``store_to_pool_async`` inputs are CUDA tensors (ViT output).
    """
    from types import SimpleNamespace

    from sglang.srt.disaggregation.encoder.server import EncodeContext, MMEncoder

    cache = build()
    encoder = object.__new__(MMEncoder)  # only the fields the method reads
    encoder.rank = 0
    encoder.mm_global_cache = cache
    encoder._embedding_dtype = DTYPE
    encoder.device = torch.device("cuda")
    encoder.background_tasks = set()
    encoded: list[int] = []

    def encode_missing(feature: Any, pre: Any, indices: list[int], modality: Any, fn: Any) -> Any:
        encoded.extend(indices)
        return [rows(H[i], pre.token_counts[i]).cuda() for i in indices]

    encoder._encode_missing = encode_missing
    tokens = [200, 64]

    def context(req_id: str) -> Any:
        return EncodeContext(
            req_id=req_id,
            modality=Modality.IMAGE,
            preprocess_result=SimpleNamespace(token_counts=tokens),
            get_feature_fn=None,
            mm_feature=None,
            num_items=2,
            items_per_req=[2],
            aux_data={},
            str_mm_hashes=H[:2],
            use_global_cache=True,
            is_health_check=False,
        )

    async def run(req_id: str, keep_on_gpu: bool) -> torch.Tensor:
        out: torch.Tensor = await encoder._compute_global_cache_embedding(
            context(req_id), keep_on_gpu=keep_on_gpu
        )
        await asyncio.gather(*encoder.background_tasks)
        return out

    first = asyncio.run(run("a", False))  # misses: CUDA slices staged into the host pool
    assert encoded == [0, 1]
    second = asyncio.run(run("b", True))  # local hits: load_to_device_async into CUDA
    assert encoded == [0, 1]
    want = expected(H[:2], tokens)
    assert same_bytes(first.cpu(), want)
    assert same_bytes(second.cpu(), want)
