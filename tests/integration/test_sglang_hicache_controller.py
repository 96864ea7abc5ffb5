"""SGLang 0.5.23's own UnifiedRadixCache drives our HiCache controller and KV host pool.

A real ``UnifiedRadixCache`` (Python tree core, one FULL component) with SGLang's CPU
device pool and paged allocator runs ``init_hicache`` with the ``--storage-*`` settings
(SGLang's ``dynamic`` backend naming our file backend). The plug-in's stack strategy then
builds our host pool and controller, and every step below is the tree's own call sequence:
insert (write-through backup, ack through ``writing_check``), ``write_backup_storage`` and
the storage ack drain, device eviction, ``load_back`` / ``ready_to_load_host_cache`` /
``loading_check``, ``evict_host``, ``query_storage_hit_length``, ``prefetch_from_storage``
with each stop policy and ``check_prefetch_progress``, and the admin ``detach`` / ``attach``
of the storage backend. KV read back (from host, and from storage into a fresh tree) must
be byte-identical to what was written.

SGLang's own controller cannot run these steps on CPU (its host pool registers memory
with CUDA and its copies need ``sgl_kernel``); ours copies with the ``torch`` I/O backend.
The CUDA variant (``gpu``) runs the same round trip with the device pool on CUDA, where
our pipeline copies on its own streams and the acknowledgements are CUDA events.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.sglang_tree import LIVE, PAGE, SEQ, TOKENS, Tree, drain, prefetch, server_args

pytestmark = pytest.mark.sglang


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


def test_plugin_builds_our_stack_behind_sglangs_contract(tmp_path: Path, single_rank: None) -> None:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang_storage_adapters.hicache_controller import (
        PipelineTransferEngine,
        StorageCacheController,
        StorageMHAHostPool,
    )
    from sglang_storage_adapters.hicache_storage import HiCacheBackend

    from sglang_storage.memory import KVHostPool

    tree = Tree(server_args(tmp_path))
    controller = tree.cache.cache_controller
    assert type(controller) is StorageCacheController
    assert isinstance(controller, HybridCacheController)  # every isinstance check holds
    host = controller.mem_pool_host.anchor_entry.host_pool
    assert isinstance(host, StorageMHAHostPool)
    assert isinstance(host.storage_pool, KVHostPool)
    assert host.kv_buffer.data_ptr() == host.storage_pool.kv_buffer.data_ptr()
    assert isinstance(controller.l2_transfer_engine, PipelineTransferEngine)
    assert controller.device_pipeline.io_backend == "torch"
    assert isinstance(controller.storage_backend, HiCacheBackend)
    assert controller.enable_storage
    # The surface UnifiedRadixCache and the scheduler use (map section 2.4).
    for name in (
        "write", "start_writing", "load", "start_loading", "write_storage", "submit_prefetch",
        "get_prefetch_submission", "terminate_prefetch", "prefetch_rate_limited",
        "append_host_mem_release", "register_host_pool_entry", "reset", "release_pp_prefetch",
        "is_pp_prefetch_ready", "take_ready_pp_prefetch", "trim_prefetch_full_head",
        "allocate_host_transfers", "_storage_hit_query", "_move_write_operation",
        "_move_op_indices", "_l2_transfers", "_l2_load_transfers", "_resolve_device_transfers",
        "mem_pool_host", "write_policy", "prefetch_tokens_occupied", "layer_done_counter",
        "transfer_layer_id_max", "host_write_staged_tokens_fn", "ack_write_queue",
        "ack_load_queue", "prefetch_hit_queue", "ack_prefetch_queue", "ack_backup_queue",
        "host_mem_release_queue", "extra_host_mem_release_queues", "pp_prefetch_decisions",
    ):  # fmt: skip
        assert hasattr(controller, name), name


@pytest.mark.parametrize(
    ("layout", "mla"),
    [("page_first", False), ("layer_first", False), ("page_first_direct", True)],
    ids=["mha-page_first", "mha-layer_first", "mla-page_first_direct"],
)
def test_backup_evict_load_back_and_host_release(
    tmp_path: Path, single_rank: None, layout: str, mla: bool
) -> None:
    tree = Tree(server_args(tmp_path, layout=layout), mla=mla)
    full = tree.host_available()
    want = tree.insert_random(SEQ, seed=1)
    tree.backup_to_storage(SEQ)
    assert tree.host_available() == full - TOKENS
    # The storage backup ran on our pipeline, not SGLang's backup thread.
    core = tree.cache.cache_controller.storage_core
    assert core is not None
    assert core.page_io is not None
    assert core.in_flight == 0
    puts = core.page_io.pipeline.metrics().put
    assert puts.pages >= TOKENS // PAGE  # the tree's own write-through and ours
    assert puts.failed == 0

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    assert tree.cache.evict(EvictParams(num_tokens=TOKENS)).num_tokens_evicted == TOKENS
    match = tree.match(SEQ)
    assert match.device_prefix_len == 0
    assert match.host_hit_length == TOKENS
    assert torch.equal(tree.load_back(SEQ), want)  # host -> device, byte-identical
    assert tree.match(SEQ).device_prefix_len == TOKENS

    # Host release: once off the device again, the host copy (stored below) is dropped
    # and its pages go back to our host pool.
    assert tree.cache.evict(EvictParams(num_tokens=TOKENS)).num_tokens_evicted == TOKENS
    assert tree.cache.evict_host(TOKENS) == TOKENS
    assert tree.host_available() == full
    assert tree.match(SEQ).host_hit_length == 0


@pytest.mark.parametrize("policy", ["wait_complete", "timeout", "best_effort"])
def test_storage_hit_and_prefetch_under_each_stop_policy(
    tmp_path: Path, single_rank: None, policy: str
) -> None:
    producer = Tree(server_args(tmp_path))
    want = producer.insert_random(SEQ, seed=2)
    producer.backup_to_storage(SEQ)

    consumer = Tree(server_args(tmp_path, policy=policy))  # a fresh tree, same storage
    full = consumer.host_available()
    assert consumer.cache.prefetch_stop_policy == policy
    root = consumer.cache.root_node_handle()
    assert consumer.cache.query_storage_hit_length(root, array("q", SEQ)) == TOKENS
    loaded = prefetch(consumer, f"req-{policy}")
    # The prefetch read ran on our pipeline (SGLang's I/O thread waited on it).
    core = consumer.cache.cache_controller.storage_core
    assert core is not None
    assert core.page_io is not None
    gets = core.page_io.pipeline.metrics().get
    assert gets.pages * PAGE >= loaded
    assert gets.failed == 0
    if policy == "best_effort":
        # Stops at the first progress check: whatever whole pages landed by then.
        assert 0 <= loaded <= TOKENS
        assert loaded % PAGE == 0
    else:
        assert loaded == TOKENS
    assert consumer.match(SEQ).host_hit_length == loaded
    # Host pages of the prefetch not delivered came back through host_mem_release_queue.
    drain(consumer.cache, lambda: consumer.host_available() == full - loaded)
    if loaded:
        got = consumer.load_back(SEQ)
        assert torch.equal(got, want[:, :, :loaded])  # storage -> host -> device


@pytest.mark.parametrize("fault", ["bit_flip_rate", "error_rate", "vanish_rate"])
def test_storage_faults_are_misses_not_wrong_bytes(
    tmp_path: Path, single_rank: None, fault: str
) -> None:
    producer = Tree(server_args(tmp_path))
    producer.insert_random(SEQ, seed=5)
    producer.backup_to_storage(SEQ)

    # Every read of the stored pages is corrupt, fails, or finds the page gone.
    consumer = Tree(server_args(tmp_path, faults={fault: 1.0}))
    full = consumer.host_available()
    assert prefetch(consumer, f"req-{fault}") == 0
    match = consumer.match(SEQ)
    assert match.host_hit_length == 0
    assert match.device_prefix_len == 0
    # The prefetch's host pages come back through host_mem_release_queue, which the
    # scheduler's next event rounds drain (not necessarily the round the prefetch ended in).
    drain(consumer.cache, lambda: consumer.host_available() == full)


def test_storage_detach_and_attach(tmp_path: Path, single_rank: None) -> None:
    args = server_args(tmp_path)
    tree = Tree(args)
    tree.insert_random(SEQ, seed=3)
    tree.backup_to_storage(SEQ)
    cache, root = tree.cache, tree.cache.root_node_handle()

    ok, message = cache.detach_storage_backend()
    assert ok, message
    assert not cache.cache_controller.enable_storage
    assert cache.cache_controller.storage_backend is None
    assert cache.query_storage_hit_length(root, array("q", SEQ)) == 0

    ok, message = cache.attach_storage_backend(
        "dynamic", storage_backend_extra_config_json=args.hicache_storage_backend_extra_config
    )
    assert ok, message
    assert cache.cache_controller.enable_storage
    # The pages stored before the detach are found again through the new backend.
    assert cache.query_storage_hit_length(root, array("q", SEQ)) == TOKENS


@pytest.mark.gpu
def test_round_trip_with_cuda_device_pool(tmp_path: Path, single_rank: None) -> None:
    # Needs CUDA at: the device pool on CUDA, our pipeline's CUDA copies (its streams and
    # events) behind write/load, and the ack events the tree polls.
    tree = Tree(server_args(tmp_path), device="cuda")
    assert tree.cache.cache_controller.device_pipeline.device.type == "cuda"
    want = tree.insert_random(SEQ, seed=4)
    tree.backup_to_storage(SEQ)

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tree.cache.evict(EvictParams(num_tokens=TOKENS))
    torch.cuda.synchronize()
    assert torch.equal(tree.load_back(SEQ), want)
    consumer = Tree(server_args(tmp_path), device="cuda")
    assert prefetch(consumer, "req-gpu") == TOKENS
    assert torch.equal(consumer.load_back(SEQ), want)


def test_host_pool_refuses_bad_frees(tmp_path: Path, single_rank: None) -> None:
    from sglang_storage.errors import ConfigError, StateError

    tree = Tree(server_args(tmp_path))
    host = tree.cache.cache_controller.mem_pool_host.anchor_entry.host_pool
    tokens = host.alloc(2 * PAGE)
    assert tokens is not None
    rows = tokens.view(-1, PAGE)  # whole pages: PAGE consecutive token slots each
    assert torch.equal(rows, rows[:, :1] + torch.arange(PAGE))
    assert bool((rows[:, 0] % PAGE == 0).all())
    with pytest.raises(ConfigError, match="whole pages"):
        host.free(tokens[1 : PAGE + 1])  # not page aligned
    assert host.free(tokens) == 2 * PAGE
    with pytest.raises(StateError):
        host.free(tokens)  # double free
    assert host.alloc(host.available_size() + PAGE) is None  # short: None, as SGLang's


def test_reset_frees_the_host_pool_and_keeps_storage_working(
    tmp_path: Path, single_rank: None
) -> None:
    tree = Tree(server_args(tmp_path))
    full = tree.host_available()
    tree.insert_random(SEQ, seed=6)
    tree.backup_to_storage(SEQ)
    tree.cache.reset()  # the scheduler's flush_cache
    assert tree.host_available() == full
    assert tree.match(SEQ).host_hit_length == 0
    # Storage survives the reset, and the controller keeps serving the tree.
    root = tree.cache.root_node_handle()
    assert tree.cache.query_storage_hit_length(root, array("q", SEQ)) == TOKENS
    assert prefetch(tree, "req-after-reset") == TOKENS


@pytest.mark.parametrize("policy", ["timeout", "wait_complete"])
def test_slow_storage_timeout_gives_up_and_wait_complete_waits(
    tmp_path: Path, single_rank: None, policy: str
) -> None:
    producer = Tree(server_args(tmp_path))
    want = producer.insert_random(SEQ, seed=7)
    producer.backup_to_storage(SEQ)

    # Every storage call takes 0.3 s; the timeout policy's deadline is 0.05 s.
    slow = {"latency_rate": 1.0, "latency_s": 0.3}
    args = server_args(tmp_path, policy=policy, faults=slow, timeout_base_s=0.05)
    consumer = Tree(args)
    full = consumer.host_available()
    loaded = prefetch(consumer, f"req-slow-{policy}")
    if policy == "timeout":
        assert loaded < TOKENS
    else:
        assert loaded == TOKENS
    assert consumer.match(SEQ).host_hit_length == loaded
    drain(consumer.cache, lambda: consumer.host_available() == full - loaded)
    if loaded:
        assert torch.equal(consumer.load_back(SEQ), want[:, :, :loaded])


SGLANG_STORAGE_THREADS = (
    "prefetch_thread_func",
    "prefetch_io_aux_func",
    "prefetch_sync_thread_func",
    "backup_thread_func",
    "pp_prefetch_command_thread_func",
)
"""The targets of SGLang's storage threads (Python names a thread after its target)."""


def sglang_storage_threads() -> list[str]:
    import threading

    return [
        t.name
        for t in threading.enumerate()
        if any(target in t.name for target in SGLANG_STORAGE_THREADS)
    ]


def test_no_sglang_storage_thread_runs(tmp_path: Path, single_rank: None) -> None:
    before = sglang_storage_threads()
    producer = Tree(server_args(tmp_path))
    assert producer.cache.cache_controller.enable_storage
    want = producer.insert_random(SEQ, seed=8)
    producer.backup_to_storage(SEQ)
    consumer = Tree(server_args(tmp_path))
    assert prefetch(consumer, "req-threads") == TOKENS
    assert torch.equal(consumer.load_back(SEQ), want)
    consumer.cache.reset()
    # Built, attached, backed up, prefetched and reset: none of SGLang's storage threads.
    assert sglang_storage_threads() == before
    assert consumer.cache.cache_controller.storage_core is not None


@pytest.mark.parametrize("load_policy", ["cost", "always"])
def test_cost_policy_skips_a_storage_hit_slower_than_recompute(
    tmp_path: Path, single_rank: None, load_policy: str
) -> None:
    first, second = SEQ, list(range(300, 300 + TOKENS))
    producer = Tree(server_args(tmp_path))
    producer.insert_random(first, seed=9)
    producer.backup_to_storage(first)
    want = producer.insert_random(second, seed=10)
    producer.backup_to_storage(second)

    # Every storage call takes 50 ms: 16 tokens load far slower than prefill recomputes
    # them (1.6 ms at the model's prior 10k tokens/s).
    slow = {"latency_rate": 1.0, "latency_s": 0.05}
    consumer = Tree(server_args(tmp_path, faults=slow, load_policy=load_policy))
    core = consumer.cache.cache_controller.storage_core
    assert core is not None
    assert core.config.load_policy.value == load_policy
    # Before any read the cost model has only its priors (storage at 1 GiB/s): it loads.
    assert prefetch(consumer, "req-first") == TOKENS
    assert core.stats().cost_skipped_queries == 0

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    cache, request = consumer.cache, CacheRequestHandle("req-second", 0)
    cache.prefetch_from_storage(request, cache.root_node_handle(), array("q", second), None, None)
    drain(cache, lambda: cache.check_prefetch_progress(request))
    loaded = int(cache.pop_prefetch_loaded_tokens(request))
    stats = core.stats()
    if load_policy == "cost":
        # The measured read (50 ms for 4 KiB) says recompute: the hit is not prefetched.
        assert loaded == 0
        assert stats.cost_skipped_queries == 1
        assert stats.cost_skipped_pages == TOKENS // PAGE
        assert consumer.match(second).host_hit_length == 0
    else:
        assert loaded == TOKENS
        assert stats.cost_skipped_queries == 0
        assert torch.equal(consumer.load_back(second), want)
