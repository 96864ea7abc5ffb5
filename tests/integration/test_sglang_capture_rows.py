"""Captured top-k rows come back with the KV of a prefix HiCache restores (SGLang #26975).

SGLang 0.5.23's own ``RoutedExpertsCapturer`` / ``IndexerTopkCapturer`` (their host mirror
on our records pool) and its own ``UnifiedRadixCache`` with our HiCache stack: a request's
rows are read with SGLang's ``get_topk`` through the device slots the tree hands out. After
a prefix is evicted from the device, its slots reused by another forward, and the prefix
loaded back from host (or read from storage by a fresh cache), the rows must be the ones
captured when the prefix was computed. With the rows part switched off (what SGLang's
controller does: nothing in ``mem_cache`` touches the capturers) the same steps return the
reused slots' rows; that variant shows the test can fail.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_hooks import records_installed
from support.sglang_tree import LIVE, PAGE, SEQ, TOKENS, Tree, prefetch, server_args

pytestmark = pytest.mark.sglang

LAYERS, TOPK, SLOTS = 3, 4, 128


@pytest.fixture
def installed() -> Iterator[Any]:
    """Our plug-in (HiCache stack) and the records adapter, one rank, SGLang restored after."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.state_capturer.indexer_topk import set_global_indexer_capturer
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer
    from sglang_storage_adapters import hicache_controller

    hicache_controller.install()  # the stack strategy (the records adapter's hooks below)
    one_rank = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    with records_installed() as records, one_rank:
        try:
            yield records
        finally:
            while LIVE:
                cache = LIVE.pop().cache
                if cache.cache_controller is not None and cache.cache_controller.enable_storage:
                    ok, message = cache.detach_storage_backend()
                    assert ok, message
                # The process's budget outlives the test: give the pools (and rows) back.
                cache.cache_controller.l2_transfer_engine.poll()  # unpins collected copies
                cache.cache_controller.mem_pool_host.anchor_entry.host_pool.destroy()
            set_global_experts_capturer(None)
            set_global_indexer_capturer(None)


def publish(root: Path) -> Any:
    """The ``--storage-backend file`` ServerArgs, with what the capturers size from."""
    return server_args(root, chunked_prefill_size=16)


def experts_capturer(device: str = "cpu") -> Any:
    """SGLang's routed-experts capturer, as ``ModelRunner`` builds it; set as the global one."""
    from sglang.srt.state_capturer.routed_experts import (
        RoutedExpertsCapturer,
        set_global_experts_capturer,
    )

    config = types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(num_experts_per_tok=TOPK, num_hidden_layers=LAYERS)
    )
    cap = RoutedExpertsCapturer(
        config, num_tokens=SLOTS, max_running_requests=4, num_fused_shared_experts=0, device=device
    )
    set_global_experts_capturer(cap)
    return cap


def indexer_capturer() -> Any:
    """SGLang's DSA indexer top-k capturer; set as the global one."""
    from sglang.srt.state_capturer.indexer_topk import (
        IndexerTopkCapturer,
        set_global_indexer_capturer,
    )

    cap = IndexerTopkCapturer(
        num_tokens=SLOTS,
        num_indexer_layers=LAYERS,
        index_topk=2 * TOPK,
        max_running_requests=4,
        device="cpu",
    )
    set_global_indexer_capturer(cap)
    return cap


def forward(cap: Any, slots: torch.Tensor, seed: int) -> torch.Tensor:
    """One forward computing ``slots``: every layer captures, then SGLang's overlap path
    (the capture copied to host non-blocking, ``copy_done`` synchronised, ``finalize``)."""
    width = int(cap.host_cache.buffer.shape[2])
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 1 << 16, (slots.numel(), LAYERS, width), generator=g)
    rows = rows.to(torch.int32)
    on_device = rows.to(slots.device)
    for layer in range(LAYERS):
        cap.capture(layer, on_device[:, layer, :])
    batch = types.SimpleNamespace(out_cache_loc=slots, out_cache_loc_virtual=None)
    output = cap.on_forward_end(batch, False, None, no_copy_to_cpu=True)
    output.map_device_tensors(lambda t: t.to("cpu", non_blocking=True))
    if slots.device.type == "cuda":
        torch.cuda.synchronize()
    output.finalize()
    return rows


def topk_of(cap: Any, slots: torch.Tensor) -> torch.Tensor:
    """What SGLang's ``get_topk`` returns for a request whose KV is at ``slots``."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=1, max_context_len=64, device="cpu", enable_memory_saver=False)
    pool.req_to_token[0, : slots.numel()] = slots.to("cpu", torch.int32)
    pool.req_to_token[0, slots.numel()] = 0  # the token being generated: not returned
    return cap.get_topk(0, slots.numel() + 1, pool)  # type: ignore[no-any-return]


def insert_computed(tree: Tree, caps: list[Any], seed: int) -> list[torch.Tensor]:
    """Insert SEQ as a forward computed it (KV and every capturer's rows); return the rows."""
    tree.insert_random(SEQ, seed=seed)
    slots = tree.cache.path_device_indices(tree.match(SEQ).last_device_node)
    return [forward(cap, slots, seed + n) for n, cap in enumerate(caps)]


def evict_and_reuse(tree: Tree, caps: list[Any]) -> None:
    """Evict SEQ from the device; another forward then computes (and frees) its slots."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    assert tree.cache.evict(EvictParams(num_tokens=TOKENS)).num_tokens_evicted == TOKENS
    slots = tree.alloc.alloc(TOKENS)
    assert slots is not None
    for n, cap in enumerate(caps):
        forward(cap, slots, 1000 + n)
    tree.alloc.free(slots)


def loaded_rows(tree: Tree, caps: list[Any]) -> list[torch.Tensor]:
    """Load SEQ back to the device; each capturer's rows for it, read as SGLang reads them."""
    tree.load_back(SEQ)
    if tree.kv.device != "cpu":
        torch.cuda.synchronize()  # as the forward that reads the prefix would have waited
    slots = tree.cache.path_device_indices(tree.match(SEQ).last_device_node)
    assert slots.numel() == TOKENS
    return [topk_of(cap, slots) for cap in caps]


@pytest.mark.parametrize("restore", [True, False], ids=["ours", "rows-off"])
def test_rows_of_a_prefix_loaded_back_from_host_are_the_captured_ones(
    tmp_path: Path, installed: Any, restore: bool
) -> None:
    publish(tmp_path / "store")
    cap = experts_capturer()
    tree = Tree(publish(tmp_path / "store"))
    engine = tree.cache.cache_controller.l2_transfer_engine
    assert [rows.name for rows in engine.rows] == ["routed_experts"]
    if not restore:
        engine.rows = ()  # what SGLang's controller does with the capturers: nothing
    captured = insert_computed(tree, [cap], seed=1)
    tree.cache.writing_check(write_back=True)  # the host copy acknowledged
    evict_and_reuse(tree, [cap])
    (rows,) = loaded_rows(tree, [cap])
    if restore:
        assert torch.equal(rows, captured[0])
    else:
        assert not torch.equal(rows, captured[0])  # stale: SGLang #26975


def test_rows_come_back_from_storage_into_a_fresh_cache(tmp_path: Path, installed: Any) -> None:
    publish(tmp_path / "store")
    caps = [experts_capturer(), indexer_capturer()]
    producer = Tree(publish(tmp_path / "store"))
    captured = insert_computed(producer, caps, seed=2)
    producer.backup_to_storage(SEQ)
    for cap in caps:
        cap.host_cache.buffer.fill_(-1)  # a new process: nothing captured yet
    consumer = Tree(publish(tmp_path / "store"))
    core = consumer.cache.cache_controller.storage_core
    assert core is not None
    assert core.page_io is not None
    assert len(core.page_io.parts) == 3  # KV, routed experts, indexer top-k
    assert prefetch(consumer, "fresh") == TOKENS
    rows = loaded_rows(consumer, caps)
    for got, want in zip(rows, captured, strict=True):
        assert torch.equal(got, want)


def test_pages_stored_without_capture_are_misses_where_capture_is_on(
    tmp_path: Path, installed: Any
) -> None:
    root = tmp_path / "store"
    publish(root)
    plain = Tree(publish(root))  # no capturer: capture off
    assert plain.cache.cache_controller.l2_transfer_engine.rows == ()
    plain.insert_random(SEQ, seed=3)
    plain.backup_to_storage(SEQ)
    experts_capturer()
    capturing = Tree(publish(root))
    assert prefetch(capturing, "no-rows") == 0  # KV alone would give stale rows: a miss


def test_pages_stored_with_rows_are_hits_where_capture_is_off(
    tmp_path: Path, installed: Any
) -> None:
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

    root = tmp_path / "store"
    publish(root)
    cap = experts_capturer()
    producer = Tree(publish(root))
    want = producer.insert_random(SEQ, seed=4)
    forward(cap, producer.cache.path_device_indices(producer.match(SEQ).last_device_node), 4)
    producer.backup_to_storage(SEQ)
    set_global_experts_capturer(None)
    consumer = Tree(publish(root))
    assert prefetch(consumer, "kv-only") == TOKENS  # the KV part is the same object
    assert torch.equal(consumer.load_back(SEQ), want)


def test_the_rows_are_charged_to_the_process_budget(tmp_path: Path, installed: Any) -> None:
    from sglang.srt.runtime_context import get_server_args
    from sglang_storage_adapters.runtime import process_runtime, runtime_settings

    publish(tmp_path / "store")
    settings = runtime_settings(get_server_args())
    assert settings is not None
    runtime = process_runtime(settings)
    cap = experts_capturer()
    before = runtime.used("records")
    tree = Tree(publish(tmp_path / "store"))
    (rows,) = tree.cache.cache_controller.l2_transfer_engine.rows
    host_pages = tree.cache.cache_controller.mem_pool_host.anchor_entry.host_pool.page_num
    assert rows.nbytes == host_pages * PAGE * LAYERS * TOPK * 4
    assert runtime.used("records") == before + rows.nbytes
    assert cap.host_cache.buffer.shape == (SLOTS, LAYERS, TOPK)


@pytest.mark.gpu
def test_on_cuda_the_rows_move_on_the_transfer_streams(tmp_path: Path, installed: Any) -> None:
    # Needs CUDA at: the capturer's device buffer and its overlap copy, the device pool,
    # the rows copied through the page-locked mirror's and side pool's device views on
    # our transfer streams, ordered with the KV copies the tree acknowledges.
    root = tmp_path / "store"
    publish(root)
    cap = experts_capturer("cuda")
    tree = Tree(publish(root), device="cuda")
    captured = insert_computed(tree, [cap], seed=6)
    tree.backup_to_storage(SEQ)
    evict_and_reuse(tree, [cap])
    torch.cuda.synchronize()
    (rows,) = loaded_rows(tree, [cap])
    assert torch.equal(rows, captured[0])
    cap.host_cache.buffer.fill_(-1)
    consumer = Tree(publish(root), device="cuda")
    assert prefetch(consumer, "gpu") == TOKENS
    (rows,) = loaded_rows(consumer, [cap])
    assert torch.equal(rows, captured[0])


def test_a_mirror_smaller_than_the_device_pool_is_refused(tmp_path: Path, installed: Any) -> None:
    from sglang.srt.state_capturer.routed_experts import (
        RoutedExpertsCapturer,
        set_global_experts_capturer,
    )

    from sglang_storage.errors import ConfigError

    publish(tmp_path / "store")
    config = types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(num_experts_per_tok=TOPK, num_hidden_layers=LAYERS)
    )
    small = RoutedExpertsCapturer(
        config, num_tokens=16, max_running_requests=4, num_fused_shared_experts=0, device="cpu"
    )
    set_global_experts_capturer(small)
    with pytest.raises(ConfigError, match="does not cover the device KV pool"):
        Tree(publish(tmp_path / "store"))
