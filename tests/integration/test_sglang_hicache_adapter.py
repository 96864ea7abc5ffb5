"""Our backends serve inside SGLang 0.5.23 as a ``HiCacheStorage`` (``dynamic`` backend).

Every adapter here is built the way SGLang's ``HiCacheController`` builds a storage backend:
``StorageBackendFactory.create_backend("dynamic", storage_config, host_pool)`` with the
extra config the server flags produce, then ``register_mem_pool_host(anchor)``,
``register_mem_host_pool_v2(pool, name)`` for every pool (as the hybrid controller does),
then ``on_host_pools_registered()``. Host pools are SGLang's own, built on CPU
(``tests/support/sglang_pools.py``). Pages move through the three interfaces exactly as
SGLang's controllers call them: v0 (``batch_set`` of ``get_data_page`` tensors,
``batch_get`` into ``get_dummy_flat_data_page`` tensors then ``set_from_flat_data_page``),
v1 (``batch_set_v1``/``batch_get_v1`` on host indices) and v2 (``batch_*_v2`` with
``PoolTransfer``).

Cross-reading with SGLang's ``HiCacheFile`` (a deliberate difference): each of our objects
is a 512-byte header (format, dtype/shape/layout, model fingerprint, checksums) followed by
exactly the bytes ``HiCacheFile`` writes for the same page, in its own directory layout
(``objects/<model>/kv/<shard>/...``). So neither side finds the other's pages (a miss,
never wrong bytes), and a raw ``HiCacheFile`` page put where our object would be is
rejected by the header check.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from support.mooncake import MooncakeMaster
from support.sglang_pools import SGLangHostPool, build_hicache_file, build_sglang_host_pool

from sglang_storage.errors import ConfigError
from sglang_storage.storage import FileBackend, backend_names
from sglang_storage.storage.format import HEADER_SIZE
from sglang_storage.storage.keys import page_hashes

pytestmark = pytest.mark.sglang

LAYERS, PAGE, PAGES, HEADS, HEAD_DIM = 2, 4, 8, 2, 16
CASES = [
    ("mha", "layer_first"),
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mha", "page_head"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
    ("mla", "page_first_direct"),
]
ADAPTER = {
    "backend_name": "sglang_storage",
    "module_path": "sglang_storage_adapters.hicache_storage",
    "class_name": "HiCacheBackend",
    "interface_v1": 1,
}


# ---------------------------------------------------------------------- helpers


_OPEN: list[Any] = []
_CLOSING: list[threading.Thread] = []


@pytest.fixture(autouse=True)
def _close_adapters() -> Iterator[None]:
    """Close every adapter a test attached; Mooncake clients close in the background.

    A Mooncake client takes about two seconds to shut down; the module's master fixture
    waits for those closes before it stops the master.
    """
    yield
    while _OPEN:
        adapter = _OPEN.pop()
        if adapter.settings.storage_backend == "mooncake":
            closing = threading.Thread(target=adapter.close, daemon=True)
            closing.start()
            _CLOSING.append(closing)
        else:
            adapter.close()


@pytest.fixture(autouse=True)
def _no_failure_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    # SGLang's factory wraps backends in a random-failure injector when these are set.
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    if "mooncake" not in backend_names():
        pytest.skip("mooncake backend not registered yet")
    with MooncakeMaster(tmp_path_factory.mktemp("mooncake")) as master:
        yield master
        for closing in _CLOSING:
            closing.join(timeout=60)
        _CLOSING.clear()


@pytest.fixture(
    params=["file", pytest.param("mooncake", marks=pytest.mark.mooncake)],
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    """The extra-config part that picks one of our backends (shared by every adapter)."""
    if request.param == "file":
        return {"storage_backend": "file", "storage_options": {"root": str(tmp_path / "l3")}}
    master: MooncakeMaster = request.getfixturevalue("mooncake_master")
    return {
        "storage_backend": "mooncake",
        "storage_options": {
            "master_address": master.master_address,
            "metadata_server": master.metadata_url,
            "global_segment_size": "64MiB",
            "local_buffer_size": "16MiB",
            "protocol": "tcp",
        },
    }


@pytest.fixture
def file_store(tmp_path: Path) -> dict[str, object]:
    return {"storage_backend": "file", "storage_options": {"root": str(tmp_path / "l3")}}


def pool(
    attention: str = "mha",
    layout: str = "page_first",
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int | None = 0,
    pages: int = PAGES,
) -> SGLangHostPool:
    """An SGLang host pool; filled with random bytes from ``seed`` (zeros for None)."""
    built = build_sglang_host_pool(
        attention=attention,  # type: ignore[arg-type]
        layout=layout,
        dtype=dtype,
        layer_num=LAYERS,
        page_size=PAGE,
        num_pages=pages,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
    )
    raw = built.kv_buffer.view(-1).view(torch.uint8)
    if seed is None:
        raw.zero_()
    else:
        gen = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))
    return built


def storage_config(
    store: Mapping[str, object],
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "org/test-model",
    metrics: bool = False,
    **extra: object,
) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=True,
        model_name=model,
        extra_config={**ADAPTER, **store, **extra},
    )


def attach(
    anchor: SGLangHostPool, config: Any, sidecars: Mapping[str, SGLangHostPool] | None = None
) -> Any:
    """Build and attach the adapter exactly as SGLang's (hybrid) cache controller does."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang_storage_adapters.hicache_storage import HiCacheBackend

    backend = StorageBackendFactory.create_backend("dynamic", config, anchor.pool)
    assert isinstance(backend, HiCacheBackend)
    backend.register_mem_pool_host(anchor.pool)
    backend.register_mem_host_pool_v2(anchor.pool, PoolName.KV)
    for name, side in (sidecars or {}).items():
        backend.register_mem_host_pool_v2(side.pool, PoolName(name))
    backend.on_host_pools_registered()
    _OPEN.append(backend)
    return backend


def tokens_of(pages: Sequence[int]) -> torch.Tensor:
    """SGLang host indices: every token of each page, in page order."""
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def keys_for(seed: int, n: int = PAGES) -> list[str]:
    rng = random.Random(seed)
    return page_hashes([rng.randrange(2**31) for _ in range(n * PAGE)], PAGE)


def page_bytes(p: SGLangHostPool, page: int) -> bytes:
    return bytes(p.get_data_page(page * PAGE).contiguous().view(torch.uint8).numpy().tobytes())


def transfer(name: str, keys: Sequence[str], pages: Sequence[int], **kw: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return PoolTransfer(name=PoolName(name), host_indices=tokens_of(pages), keys=list(keys), **kw)


# ---------------------------------------------------------------------- round trips


def _write(
    interface: str, adapter: Any, src: SGLangHostPool, keys: list[str], pages: list[int]
) -> None:
    if interface == "v0":  # HiCacheController._generic_page_set
        assert adapter.batch_set(keys, [src.get_data_page(p * PAGE) for p in pages]) is True
    elif interface == "v1":  # HiCacheController._page_set_zero_copy
        assert adapter.batch_set_v1(keys, tokens_of(pages)) == [True] * len(keys)
    else:
        result = adapter.batch_set_v2([transfer("kv", keys, pages)])
        assert list(result.values()) == [[True] * len(keys)]


def _read(
    interface: str, adapter: Any, dst: SGLangHostPool, keys: list[str], pages: list[int]
) -> list[bool]:
    if interface == "v0":  # HiCacheController._generic_page_get
        got = adapter.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
        for page, data in zip(pages, got, strict=True):
            if data is not None:
                dst.set_from_flat_data_page(page * PAGE, data)
        return [data is not None for data in got]
    if interface == "v1":
        flags: list[bool] = adapter.batch_get_v1(keys, tokens_of(pages))
        return flags
    (flags,) = adapter.batch_get_v2([transfer("kv", keys, pages)]).values()
    return list(flags)


INTERFACES = ("v0", "v1", "v2")


def _zero(p: SGLangHostPool, pages: Sequence[int]) -> None:
    for page in pages:
        p.set_from_flat_data_page(page * PAGE, torch.zeros_like(p.get_dummy_flat_data_page()))


@pytest.mark.parametrize(("attention", "layout"), CASES, ids=[f"{a}-{x}" for a, x in CASES])
def test_round_trip_is_byte_exact(store: dict[str, object], attention: str, layout: str) -> None:
    """Each interface writes pages out; every interface reads them back into other pages.

    One adapter per case (a Mooncake client takes seconds to close); reading through
    another adapter instance is covered below and by the rank tests.
    """
    mla = attention == "mla"
    src = pool(attention, layout, seed=1)
    adapter = attach(src, storage_config(store, mla=mla))
    src_pages, dst_pages = [5, 2, 7], [0, 6, 3]
    expected = [page_bytes(src, p) for p in src_pages]
    for n, writer_if in enumerate(INTERFACES):
        keys = keys_for(1 + n, 3)
        _write(writer_if, adapter, src, keys, src_pages)
        assert adapter.batch_exists(keys) == 3
        for reader_if in INTERFACES:
            _zero(src, dst_pages)
            assert _read(reader_if, adapter, src, keys, dst_pages) == [True] * 3, reader_if
            assert [page_bytes(src, d) for d in dst_pages] == expected, (writer_if, reader_if)
        if isinstance(adapter.backend, FileBackend):
            # The payload is SGLang's flat data page, after our header.
            for key, page in zip(keys, expected, strict=True):
                stored = adapter.backend.path_of(adapter.object_key(key)).read_bytes()
                assert stored[HEADER_SIZE:] == page


@pytest.mark.parametrize(("attention", "layout"), [("mha", "layer_first"), ("mla", "page_first")])
def test_interfaces_read_each_others_pages(
    file_store: dict[str, object], attention: str, layout: str
) -> None:
    mla = attention == "mla"
    src = pool(attention, layout, seed=2)
    adapter = attach(src, storage_config(file_store, mla=mla))
    for n, writer_if in enumerate(["v0", "v1", "v2"]):
        keys = keys_for(10 + n, 2)
        _write(writer_if, adapter, src, keys, [1, 4])
        for reader_if in ["v0", "v1", "v2"]:
            dst = pool(attention, layout, seed=None)
            reader = attach(dst, storage_config(file_store, mla=mla))
            assert _read(reader_if, reader, dst, keys, [0, 1]) == [True, True]
            assert page_bytes(dst, 0) == page_bytes(src, 1)
            assert page_bytes(dst, 1) == page_bytes(src, 4)


def test_zero_copy_views_alias_the_host_pool(file_store: dict[str, object]) -> None:
    from sglang_storage_adapters._sglang_pools import PoolPages

    for attention, layout in CASES:
        p = pool(attention, layout, seed=3)
        pages = PoolPages.describe("kv", p.pool)
        assert pages.zero_copy
        views = pages.views(5 * PAGE)
        assert b"".join(bytes(v) for v in views) == page_bytes(p, 5)
        views[0][0] ^= 0xFF  # writing through the view writes the pool itself
        assert page_bytes(p, 5)[0] == bytes(views[0])[0]
        expected_runs = 2 * LAYERS if (layout, attention) == ("layer_first", "mha") else None
        if expected_runs is not None:
            assert len(views) == expected_runs


# ---------------------------------------------------------------------- existence


def test_batch_exists_counts_the_leading_run(store: dict[str, object]) -> None:
    src = pool(seed=4)
    adapter = attach(src, storage_config(store))
    keys = keys_for(4, 5)
    assert adapter.batch_exists(keys) == 0
    present = [0, 1, 3]
    assert adapter.batch_set_v1([keys[i] for i in present], tokens_of(present)) == [True] * 3
    assert adapter.batch_exists(keys) == 2
    assert adapter.batch_exists(keys[3:]) == 1
    assert adapter.batch_exists([]) == 0
    assert [adapter.exists(k) for k in keys] == [True, True, False, True, False]
    # v1 reads report per key; SGLang takes the leading run.
    assert adapter.batch_get_v1(keys[:4], tokens_of([4, 5, 6, 7])) == [True, True, False, True]


# ---------------------------------------------------------------------- ranks


def test_mla_non_writer_skips_writes_and_reads_the_shared_pages(store: dict[str, object]) -> None:
    src0, src1 = pool("mla", seed=5), pool("mla", seed=6)
    rank0 = attach(src0, storage_config(store, mla=True, tp_rank=0, tp_size=2))
    rank1 = attach(src1, storage_config(store, mla=True, tp_rank=1, tp_size=2))
    keys = keys_for(5, 3)
    # Rank 1 is not the MLA storage writer: success reported, nothing stored.
    assert rank1.batch_set_v1(keys, tokens_of([0, 1, 2])) == [True] * 3
    assert rank1.batch_set(keys, [src1.get_data_page(0)] * 3) is True
    result = rank1.batch_set_v2([transfer("kv", keys, [0, 1, 2])])
    assert list(result.values()) == [[True] * 3]
    assert rank0.batch_exists(keys) == 0
    # Rank 0 writes; rank 1 reads the same objects (MLA drops the TP coordinates).
    assert rank0.batch_set_v1(keys, tokens_of([3, 4, 5])) == [True] * 3
    assert rank0.namespace() == rank1.namespace()
    assert rank1.batch_exists(keys) == 3
    assert rank1.batch_get_v1(keys, tokens_of([7, 6, 5])) == [True] * 3
    assert [page_bytes(src1, p) for p in (7, 6, 5)] == [page_bytes(src0, p) for p in (3, 4, 5)]


def test_mla_non_writer_still_writes_tp_sharded_mamba_state(
    file_store: dict[str, object],
) -> None:
    anchor, state = pool("mla", seed=7), pool("mla", seed=8)
    rank1 = attach(
        anchor, storage_config(file_store, mla=True, tp_rank=1, tp_size=2), {"mamba": state}
    )
    keys = keys_for(7, 2)
    result = rank1.batch_set_v2([transfer("kv", keys, [0, 1]), transfer("mamba", keys, [2, 3])])
    assert list(result.values()) == [[True, True], [True, True]]
    backend = rank1.backend
    assert backend.exists([rank1.object_key(k) for k in keys]) == [False, False]
    assert backend.exists([rank1.object_key(k, "mamba") for k in keys]) == [True, True]
    assert rank1.namespace("mamba").shard.tp_size == 2
    assert rank1.namespace("kv").shard.tp_size == 1


def test_mha_tp_ranks_are_isolated(store: dict[str, object]) -> None:
    src0, src1 = pool(seed=9), pool(seed=10)
    rank0 = attach(src0, storage_config(store, tp_rank=0, tp_size=2))
    rank1 = attach(src1, storage_config(store, tp_rank=1, tp_size=2))
    keys = keys_for(9, 2)
    assert rank0.batch_set_v1(keys, tokens_of([0, 1])) == [True, True]
    assert rank1.batch_exists(keys) == 0
    assert rank0.namespace() != rank1.namespace()
    assert rank1.batch_set_v1(keys, tokens_of([0, 1])) == [True, True]
    assert rank0.batch_get_v1(keys, tokens_of([2, 3])) == [True, True]
    assert rank1.batch_get_v1(keys, tokens_of([2, 3])) == [True, True]
    assert page_bytes(src0, 2) == page_bytes(src0, 0) != page_bytes(src1, 2)
    assert page_bytes(src1, 3) == page_bytes(src1, 1)


@pytest.mark.parametrize(
    "change",
    [
        {"layout": "page_first_direct"},
        {"dtype": torch.float16},
        {"model": "org/other-model"},
        {"attention": "mla"},
    ],
    ids=["layout", "dtype", "model", "attention"],
)
def test_a_differently_configured_reader_misses(
    file_store: dict[str, object], change: dict[str, Any]
) -> None:
    src = pool(seed=11)
    writer = attach(src, storage_config(file_store))
    keys = keys_for(11, 2)
    assert writer.batch_set_v1(keys, tokens_of([0, 1])) == [True, True]
    attention = change.get("attention", "mha")
    other = pool(
        attention, change.get("layout", "page_first"), dtype=change.get("dtype", torch.bfloat16)
    )
    config = storage_config(
        file_store, mla=attention == "mla", model=change.get("model", "org/test-model")
    )
    reader = attach(other, config)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, tokens_of([0, 1])) == [False, False]


# ---------------------------------------------------------------------- v2 hit policies


SIDECARS = {"swa": ("mha", "page_first"), "indexer": ("mla", "page_first_direct")}


def _sidecars(seed: int) -> dict[str, SGLangHostPool]:
    return {name: pool(a, x, seed=seed + i) for i, (name, (a, x)) in enumerate(SIDECARS.items())}


def test_all_pages_and_trailing_pages_match_hicache_file(
    tmp_path: Path, file_store: dict[str, object]
) -> None:
    """Random presence patterns: our verdicts equal SGLang's own HiCacheFile's."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    anchor, sides = pool(seed=12), _sidecars(13)
    ours = attach(anchor, storage_config(file_store), sides)
    theirs = build_hicache_file(tmp_path / "hicache", model_name="org/test-model")
    theirs.register_mem_pool_host(anchor.pool)
    theirs.register_mem_host_pool_v2(anchor.pool, PoolName.KV)
    for name, side in sides.items():
        theirs.register_mem_host_pool_v2(side.pool, PoolName(name))

    rng = random.Random(12)
    n = 6
    for case in range(30):
        keys = keys_for(100 + case, n)
        writes = []
        for name in ("kv", "swa", "indexer"):
            chosen = [i for i in range(n) if rng.random() < (0.85 if name == "kv" else 0.7)]
            if chosen:
                writes.append(transfer(name, [keys[i] for i in chosen], chosen))
        for backend in (ours, theirs):
            for result in backend.batch_set_v2(writes).values():
                assert all(result)
        trailing = rng.choice([1, 2, 3])
        order = [
            transfer(
                "swa", keys[:trailing], range(trailing), hit_policy=PoolHitPolicy.TRAILING_PAGES
            ),
            transfer("indexer", keys, range(n), hit_policy=PoolHitPolicy.ALL_PAGES),
        ]
        if rng.random() < 0.5:
            order.reverse()
        got = ours.batch_exists_v2(keys, order)
        want = theirs.batch_exists_v2(keys, order)
        assert (got.kv_hit_pages, got.extra_pool_hit_pages, got.restorable_prefix_pages) == (
            want.kv_hit_pages,
            want.extra_pool_hit_pages,
            want.restorable_prefix_pages,
        ), f"case {case}"


def test_block_groups_report_whole_groups_and_never_gate_the_kv_hit(
    file_store: dict[str, object],
) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    anchor, blocks = pool(seed=14), pool("mla", seed=15)
    adapter = attach(anchor, storage_config(file_store), {"deepseek_v4_c4": blocks})
    keys, block_keys = keys_for(14, 6), keys_for(15, 3)
    c4 = PoolName.DEEPSEEK_V4_C4
    assert all(adapter.batch_set_v1(keys, tokens_of(range(6))))
    adapter.batch_set_v2([transfer("deepseek_v4_c4", block_keys[:2], [0, 1])])

    def probe(pool_keys: list[str] | None, block: int, group: int, kv: list[str]) -> Any:
        t = transfer(
            "deepseek_v4_c4",
            pool_keys or [],
            range(len(pool_keys or [])),
            hit_policy=PoolHitPolicy.BLOCK_GROUPS,
            block_pages=block,
            group_pages=group,
        )
        if pool_keys is None:
            t.keys = None
        return adapter.batch_exists_v2(kv, [t])

    # One key per block of 2 FULL pages; blocks 0 and 1 stored, block 2 missing.
    r = probe(block_keys, 2, 1, keys)
    assert (r.kv_hit_pages, r.extra_pool_hit_pages[c4]) == (6, 4)
    assert r.restorable_prefix_pages == [1, 2, 3, 4, 5, 6]
    # Only blocks inside the KV prefix count: 3 KV pages hold one whole block.
    r = probe(block_keys, 2, 1, keys[:3])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages[c4]) == (3, 2)
    # First group missing: no verdict, KV hit unchanged.
    r = probe(block_keys[2:] + block_keys[:2], 2, 1, keys)
    assert (r.kv_hit_pages, c4 in r.extra_pool_hit_pages) == (6, False)
    # Groups of 2 of the KV keys themselves (transfer.keys None): pages 0-3 stored in the pool.
    adapter.batch_set_v2([transfer("deepseek_v4_c4", keys[:4] + keys[5:], [0, 1, 2, 3, 5])])
    r = probe(None, 2, 2, keys)
    assert (r.kv_hit_pages, r.extra_pool_hit_pages[c4]) == (6, 4)
    # Bad geometry: the pool gets no verdict; the KV hit stands.
    r = probe(block_keys, 0, 1, keys)
    assert (r.kv_hit_pages, c4 in r.extra_pool_hit_pages) == (6, False)


def test_v2_sidecar_round_trip_and_unregistered_pool(store: dict[str, object]) -> None:
    anchor, sides = pool(seed=16), _sidecars(17)
    adapter = attach(anchor, storage_config(store), sides)
    keys = keys_for(16, 3)
    expected = {n: [page_bytes(p, q) for q in (1, 2, 3)] for n, p in sides.items()}
    writes = [transfer(n, keys, [1, 2, 3]) for n in ("kv", "swa", "indexer")]
    assert list(adapter.batch_set_v2(writes).values()) == [[True] * 3] * 3
    for side in sides.values():
        _zero(side, [4, 5, 6])
    reads = [transfer(n, keys, [4, 5, 6]) for n in ("kv", "swa", "indexer")]
    assert list(adapter.batch_get_v2(reads).values()) == [[True] * 3] * 3
    for name, side in sides.items():
        assert [page_bytes(side, p) for p in (4, 5, 6)] == expected[name]
    reader = adapter
    # A pool that was never registered fails alone, without raising.
    mixed = reader.batch_get_v2([transfer("mamba", keys, [0, 1, 2]), reads[0]])
    assert list(mixed.values()) == [[False] * 3, [True] * 3]
    # Wrong index count for one transfer: that transfer fails alone.
    bad = reader.batch_get_v2([transfer("swa", keys, [0, 1]), reads[0]])
    assert list(bad.values()) == [[False] * 3, [True] * 3]


# ---------------------------------------------------------------------- faults


def test_a_corrupt_object_is_a_miss(file_store: dict[str, object]) -> None:
    src = pool(seed=18)
    writer = attach(src, storage_config(file_store))
    keys = keys_for(18, 3)
    assert writer.batch_set_v1(keys, tokens_of([0, 1, 2])) == [True] * 3
    path = writer.backend.path_of(writer.object_key(keys[1]))
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 7] ^= 0x5A
    path.write_bytes(bytes(data))

    dst = pool(seed=None)
    reader = attach(dst, storage_config(file_store))
    assert reader.batch_get_v1(keys, tokens_of([3, 4, 5])) == [True, False, True]
    assert page_bytes(dst, 3) == page_bytes(src, 0)
    assert page_bytes(dst, 5) == page_bytes(src, 2)
    assert page_bytes(dst, 4) != page_bytes(src, 1)
    # Quarantined: it is gone for every interface now.
    assert reader.batch_exists(keys) == 1
    assert reader.get(keys[1], dst.get_dummy_flat_data_page()) is None


def test_a_closed_backend_reports_misses_not_exceptions(store: dict[str, object]) -> None:
    src = pool(seed=19)
    adapter = attach(src, storage_config(store))
    keys = keys_for(19, 2)
    assert adapter.batch_set_v1(keys, tokens_of([0, 1])) == [True, True]
    adapter.close()
    adapter.close()  # closing twice is a no-op
    assert adapter.batch_get_v1(keys, tokens_of([2, 3])) == [False, False]
    assert adapter.batch_set_v1(keys, tokens_of([2, 3])) == [False, False]
    assert adapter.batch_exists(keys) == 0
    assert adapter.exists(keys[0]) is False
    assert adapter.get(keys[0]) is None
    assert adapter.batch_get(keys) == [None, None]
    assert adapter.set(keys[0], src.get_data_page(0)) is False
    assert list(adapter.batch_get_v2([transfer("kv", keys, [2, 3])]).values()) == [[False, False]]
    assert list(adapter.batch_set_v2([transfer("kv", keys, [2, 3])]).values()) == [[False, False]]
    result = adapter.batch_exists_v2(keys, [])
    assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (0, {})


# ---------------------------------------------------------------------- config


def _create(config: Any) -> Any:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    return StorageBackendFactory.create_backend("dynamic", config, None)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        ({}, ["storage_backend", "is required", "file", "memory"]),
        ({"storage_backend": "nope"}, ["storage_backend", "not a known backend", "file"]),
        ({"storage_backend": 3}, ["storage_backend", "file"]),
        ({"storage_backend": "file"}, ["root"]),
        (
            {"storage_backend": "file", "storage_options": {"root": "/tmp/x", "bogus": 1}},
            ["bogus", "unknown option", "capacity_bytes"],
        ),
        ({"storage_backend": "file", "storage_options": ["root"]}, ["storage_options", "mapping"]),
        (
            {"storage_backend": "memory", "eviction": {"name": "fifo"}},
            ["eviction", "fifo", "lru", "s3fifo"],
        ),
        (
            {"storage_backend": "memory", "typo_key": 1},
            ["typo_key", "unknown key", "storage_options"],
        ),
    ],
    ids=[
        "missing",
        "unknown",
        "not-str",
        "no-root",
        "bad-option",
        "options-list",
        "eviction",
        "key",
    ],
)
def test_bad_config_is_a_config_error_saying_what_is_allowed(
    extra: dict[str, object], needles: list[str]
) -> None:
    config = storage_config({})
    config.extra_config = {**ADAPTER, **extra}
    with pytest.raises(ConfigError) as caught:
        _create(config)
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


def test_file_storage_path_is_the_default_root(tmp_path: Path) -> None:
    config = storage_config(
        {"storage_backend": "file"}, file_storage_path=str(tmp_path / "from-flag")
    )
    adapter = attach(pool(seed=20), config)
    assert adapter.batch_set_v1(keys_for(20, 1), tokens_of([0])) == [True]
    assert (tmp_path / "from-flag" / "objects").is_dir()


def test_capped_backend_gets_an_eviction_policy() -> None:
    config = storage_config(
        {"storage_backend": "memory", "storage_options": {"capacity_bytes": "1MiB"}},
        eviction={"name": "s3fifo"},
    )
    adapter = attach(pool(seed=21), config)
    assert adapter.backend_stats().capacity_bytes == 1 << 20
    assert adapter.batch_set_v1(keys_for(21, 2), tokens_of([0, 1])) == [True, True]


def test_a_layout_without_page_api_is_refused_at_attach(file_store: dict[str, object]) -> None:
    unified = pool("mha", "page_unified", seed=None)
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    adapter = StorageBackendFactory.create_backend("dynamic", storage_config(file_store), None)
    _OPEN.append(adapter)
    with pytest.raises(ConfigError, match="page_unified"):
        adapter.register_mem_pool_host(unified.pool)
    adapter.close()


# ---------------------------------------------------------------------- metrics, clear


def test_get_stats_returns_sglang_storage_metrics(file_store: dict[str, object]) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    adapter = attach(pool(seed=22), storage_config(file_store, metrics=True))
    keys = keys_for(22, 3)
    assert all(adapter.batch_set_v1(keys, tokens_of([0, 1, 2])))
    assert all(adapter.batch_get_v1(keys, tokens_of([3, 4, 5])))
    stats = adapter.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert (stats.prefetch_pgs, stats.backup_pgs) == ([3], [3])
    assert stats.prefetch_bandwidth[0] > 0
    assert stats.backup_bandwidth[0] > 0
    assert adapter.get_stats().prefetch_pgs == []  # drained, as SGLang's backends do


def test_clear_removes_this_ranks_pages(store: dict[str, object]) -> None:
    adapter = attach(pool(seed=23), storage_config(store))
    keys = keys_for(23, 2)
    assert adapter.batch_set_v1(keys, tokens_of([0, 1])) == [True, True]
    adapter.clear()
    assert adapter.batch_exists(keys) == 0


# ---------------------------------------------------------------------- HiCacheFile


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_cross_reading_with_hicache_file(tmp_path: Path, mla: bool) -> None:
    """Same payload bytes; each side misses the other's pages instead of misreading them."""
    from sglang.srt.mem_cache.utils import get_hash_str

    src = pool("mla" if mla else "mha", "page_first", seed=24)
    rng = random.Random(24)
    tokens = [rng.randrange(2**31) for _ in range(3 * PAGE)]
    keys: list[str] = get_hash_str(tokens, page_size=PAGE)
    assert keys == page_hashes(tokens, PAGE)
    their_dir, our_root = tmp_path / "hicache", tmp_path / "ours"
    theirs = build_hicache_file(their_dir, mla=mla, model_name="org/test-model")
    assert theirs.batch_set(keys, [src.get_data_page(p * PAGE) for p in range(3)])
    ours = attach(
        src,
        storage_config(
            {"storage_backend": "file", "storage_options": {"root": str(our_root)}}, mla=mla
        ),
    )
    assert ours.batch_set_v1(keys, tokens_of([0, 1, 2])) == [True] * 3

    # The payloads are the same bytes; ours adds the header.
    files = {f.name: f.read_bytes() for f in their_dir.iterdir()}
    for page, key in enumerate(keys):
        (theirs_page,) = [data for name, data in files.items() if name.startswith(key)]
        ours_object = ours.backend.path_of(ours.object_key(key)).read_bytes()
        assert ours_object[HEADER_SIZE:] == theirs_page == page_bytes(src, page)

    # Neither reads the other's store: a miss, not wrong bytes. (Their directory holds no
    # store marker, so our backend takes it only when told to adopt it.)
    on_their_dir = attach(
        pool("mla" if mla else "mha", "page_first", seed=None),
        storage_config(
            {"storage_backend": "file", "storage_options": {"root": str(their_dir), "adopt": True}},
            mla=mla,
        ),
    )
    assert on_their_dir.batch_exists(keys) == 0
    theirs_on_ours = build_hicache_file(our_root, mla=mla, model_name="org/test-model")
    assert theirs_on_ours.batch_exists(keys) == 0

    # A raw HiCacheFile page where our object belongs fails the header check: a miss.
    target = on_their_dir.backend.path_of(on_their_dir.object_key(keys[0]))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(files[next(n for n in files if n.startswith(keys[0]))])
    assert on_their_dir.batch_get_v1(keys[:1], tokens_of([0])) == [False]


# ---------------------------------------------------------------------- SGLang's callers


@pytest.mark.parametrize(("attention", "layout"), [("mha", "layer_first"), ("mla", "page_first")])
def test_sglang_controller_page_functions_drive_the_adapter(
    file_store: dict[str, object], attention: str, layout: str
) -> None:
    """SGLang's own HiCacheController page functions (v0 and v1) against the adapter."""
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController

    src = pool(attention, layout, seed=25)
    adapter = attach(src, storage_config(file_store, mla=attention == "mla"))
    controller = object.__new__(HiCacheController)  # only the fields the page functions read
    controller.storage_backend = adapter
    controller.storage_host_pool = src.pool
    controller.page_size = PAGE
    operation = SimpleNamespace(request_id="req", is_terminated=lambda: False)
    expected = [page_bytes(src, p) for p in (1, 2)]
    for n, (set_page, get_page) in enumerate(
        [
            (controller._generic_page_set, controller._generic_page_get),
            (controller._page_set_zero_copy, controller._page_get_zero_copy),
        ]
    ):
        keys = keys_for(25 + n, 2)
        assert set_page(keys, tokens_of([1, 2])) is True
        _zero(src, [5, 6])
        assert get_page(operation, keys, tokens_of([5, 6])) == 2
        assert [page_bytes(src, p) for p in (5, 6)] == expected
        # A missing page ends the run, as SGLang counts it.
        assert get_page(operation, [keys[0], "f" * 64, keys[1]], tokens_of([5, 6, 7])) == 1
