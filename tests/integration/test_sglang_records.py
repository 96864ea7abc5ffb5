"""SGLang 0.5.23's RL top-k capture on sglang_storage: the host mirror and the payload.

The adapter replaces ``BaseHostCache`` and wraps the scheduler's collect methods through
SGLang's HookRegistry; the tests build SGLang's real ``RoutedExpertsCapturer`` (its own
constructor reads the published runtime context) and call SGLang's real
``SchedulerBatchResultProcessor._maybe_collect_routed_experts`` on a real ``Req`` and
``ReqToTokenPool``. What travels is encoded with SGLang's own msgpack (``msgpack_encode``
of a ``BatchTokenIDOutput``) and base64 (``DetokenizerManager._b64_encode_per_request``);
the client reads the record in another process from a real ``file`` backend (and a real
Mooncake cluster where ``mooncake_master`` is installed). The forward batch is a stand-in
holding the two fields the capturer reads (``out_cache_loc``, ``out_cache_loc_virtual``):
the CPU tensors stand for the GPU ones.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
import time
import types
import typing
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_hooks import records_installed

pytestmark = pytest.mark.sglang

LAYERS, TOPK, SLOTS = 4, 3, 64
FORWARD_TOKENS = 16  # the most one forward takes here (SGLang sizes it from chunked prefill)


def publish(
    root: Path,
    *,
    managers: list[str] | None = None,
    host_memory: int | None = None,
    transport: str | None = None,
    backend: str = "file",
    options: dict[str, object] | None = None,
    staging: int | None = None,
) -> Any:
    """ServerArgs as ``--storage-backend`` leaves them, published for this process."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang_storage_adapters.flags import StorageFlags, hicache_settings

    flags = StorageFlags(
        backend=backend,
        backend_options=options if options is not None else {"root": str(root)},
        records_transport=transport,
        records_staging_bytes=staging,
    )
    settings = hicache_settings(flags)
    extra = json.loads(str(settings.pop("hicache_storage_backend_extra_config")))
    extra["storage_managers"] = managers if managers is not None else ["kv", "records"]
    if host_memory is not None:
        extra["host_memory"] = host_memory
    args = ServerArgs(
        model_path="dummy", hicache_storage_backend_extra_config=json.dumps(extra), **settings
    )
    args.chunked_prefill_size = 16  # what the capturer sizes its device buffer from
    set_global_server_args_for_scheduler(args)
    return args


@pytest.fixture
def installed() -> Iterator[Any]:
    """The adapter installed as SGLang's plug-in loader would; SGLang's names restored after."""
    with records_installed() as records:
        yield records


def capturer(device: str = "cpu", slots: int = SLOTS) -> Any:
    """SGLang's routed-experts capturer, as ``ModelRunner`` builds it."""
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

    config = types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(num_experts_per_tok=TOPK, num_hidden_layers=LAYERS)
    )
    return RoutedExpertsCapturer(
        config,
        num_tokens=slots,
        max_running_requests=4,
        num_fused_shared_experts=0,
        device=device,
    )


def used() -> int:
    from sglang.srt.runtime_context import get_server_args
    from sglang_storage_adapters.runtime import process_runtime, runtime_settings

    settings = runtime_settings(get_server_args())
    assert settings is not None
    return process_runtime(settings).used("records")


def forward(cap: Any, slots: torch.Tensor, seed: int, device: str = "cpu") -> torch.Tensor:
    """One forward over ``slots``: every layer captures; returns what was captured.

    SGLang's overlap path: the capture output is copied to host by the result-copy step
    (non-blocking into page-locked memory on CUDA), then finalized into the mirror.
    """
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (slots.numel(), LAYERS, TOPK), generator=g, dtype=torch.int32)
    for start in range(0, slots.numel(), FORWARD_TOKENS):  # the capturer's batch at most
        part = slice(start, start + FORWARD_TOKENS)
        on_device = rows[part].to(device)
        for layer in range(LAYERS):
            cap.capture(layer, on_device[:, layer, :])
        batch = types.SimpleNamespace(
            out_cache_loc=slots[part].to(device), out_cache_loc_virtual=None
        )
        output = cap.on_forward_end(batch, False, None, no_copy_to_cpu=True)
        output.map_device_tensors(lambda t: t.to("cpu", non_blocking=True))
        if device != "cpu":
            torch.cuda.synchronize()  # SGLang's copy_done.synchronize()
        output.finalize()
    return rows


def finished_request(
    cap: Any, prompt: int, generated: int, rid: str, slots: int = SLOTS
) -> tuple[Any, Any, Any]:
    """A real Req and ReqToTokenPool whose KV slots the capturer filled; returns
    ``(req, processor, expected rows)`` (``processor`` holds what the collect reads)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = ReqToTokenPool(size=4, max_context_len=slots, device="cpu", enable_memory_saver=False)
    req = Req(
        rid,
        "",
        array("q", range(prompt)),
        SamplingParams(max_new_tokens=generated),
        return_routed_experts=True,
    )
    assert pool.alloc([req]) is not None
    seqlen = prompt + generated
    taken = torch.randperm(slots, generator=torch.Generator().manual_seed(1))[:seqlen]
    pool.write((req.kv.req_pool_idx, slice(0, seqlen)), taken.to(torch.int32))
    rows = forward(cap, taken, seed=2)
    req.output_ids = array("q", range(generated))
    req.finished_reason = FINISH_LENGTH(length=generated)
    return req, types.SimpleNamespace(req_to_token_pool=pool), rows[: seqlen - 1]


def collect(req: Any, processor: Any, cap: Any) -> None:
    """SGLang's finish-time collect, through the name the scheduler calls."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

    set_global_experts_capturer(cap)
    SchedulerBatchResultProcessor._maybe_collect_routed_experts(processor, req)


def meta_info(tensor: torch.Tensor) -> dict[str, Any]:
    """What the client's ``meta_info`` holds for ``tensor``: SGLang's wire, both hops."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    received = msgpack_roundtrip(tensor)
    (encoded,) = DetokenizerManager._b64_encode_per_request([received])
    return {"routed_experts": encoded}


def token_output(tensor: torch.Tensor) -> Any:
    """A one-request ``BatchTokenIDOutput`` carrying ``tensor`` as its routed experts."""
    import msgspec
    from sglang.srt.managers.io_struct import BatchTokenIDOutput

    fields: dict[str, Any] = {}
    for field in msgspec.structs.fields(BatchTokenIDOutput):
        if field.required:  # the lists a one-request batch holds; None where allowed
            nullable = type(None) in typing.get_args(field.type)
            fields[field.name] = None if nullable else []
    fields.update(
        rids=["r"],
        finished_reasons=[{"type": "length", "length": 1}],
        decoded_texts=[""],
        read_offsets=[0],
        skip_special_tokens=[True],
        spaces_between_special_tokens=[True],
        no_stop_trim=[False],
        prompt_tokens=[1],
        reasoning_tokens=[0],
        completion_tokens=[1],
        cached_tokens=[0],
        routed_experts=[tensor],
    )
    return BatchTokenIDOutput(**fields)


def wire_bytes(tensor: torch.Tensor) -> int:
    from sglang.srt.managers.io_struct import msgpack_encode

    return len(msgpack_encode(token_output(tensor)))


def msgpack_roundtrip(tensor: torch.Tensor) -> torch.Tensor:
    from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

    decoded = msgpack_decode(msgpack_encode(token_output(tensor)))
    value = decoded.routed_experts[0]
    assert isinstance(value, torch.Tensor)
    return value


READER = """
import json, sys, torch
from sglang_storage.managers.records import RecordHandle, read_record
meta = json.loads(sys.argv[1])
rows = read_record(RecordHandle.from_base64(meta["routed_experts"]), timeout_s=20.0)
torch.save(rows, sys.argv[2])
assert "sglang" not in sys.modules  # a trainer reads without importing SGLang
"""


def read_in_child(meta: dict[str, Any], out: Path) -> torch.Tensor:
    """The client: another process (no SGLang) reads the record from the handle in ``meta``."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(READER), json.dumps(meta), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = torch.load(out)
    assert isinstance(rows, torch.Tensor)
    return rows


def stored_objects(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "records" in str(p).lower()]


# ---------------------------------------------------------------------- host mirror


def test_sglangs_capturer_runs_on_our_mirror_byte_exact(tmp_path: Path, installed: Any) -> None:
    publish(tmp_path)
    cap = capturer()
    host = cap.host_cache
    assert isinstance(host, installed.StorageHostCache)
    assert host.pool is not None
    assert host.buffer.shape == (SLOTS, LAYERS, TOPK)
    assert host.buffer.dtype == torch.int32
    assert host.buffer.data_ptr() == host.pool.records.data_ptr()  # the pool's memory
    assert int(host.buffer.abs().sum()) == 0  # zeroed as SGLang does
    assert host.get_buffer_size_bytes() == SLOTS * LAYERS * TOPK * 4
    assert used() == host.get_buffer_size_bytes()

    req, processor, expected = finished_request(cap, prompt=7, generated=5, rid="r-mirror")
    rows = cap.get_topk(req.kv.req_pool_idx, 12, processor.req_to_token_pool)
    assert rows.numpy().tobytes() == expected.numpy().tobytes()
    tail = cap.get_topk(req.kv.req_pool_idx, 12, processor.req_to_token_pool, start_len=4)
    assert torch.equal(tail, expected[4:])

    cap.destroy()
    assert host.buffer is None
    assert used() == 0
    cap.destroy()  # a second destroy does nothing


@pytest.mark.gpu
def test_on_cuda_the_mirror_is_page_locked_and_the_overlap_copy_lands_exact(
    tmp_path: Path, installed: Any
) -> None:
    publish(tmp_path)
    cap = capturer("cuda")
    host = cap.host_cache
    assert isinstance(host, installed.StorageHostCache)
    assert host.pool is not None
    assert host.pool.page_locked
    assert host.buffer.is_pinned()
    slots = torch.randperm(SLOTS)[:20]
    rows = forward(cap, slots, seed=3, device="cuda")
    assert torch.equal(host.buffer[slots], rows)
    cap.destroy()
    assert used() == 0


def test_a_mirror_the_budget_cannot_hold_is_refused(tmp_path: Path, installed: Any) -> None:
    from sglang_storage.errors import CapacityError

    publish(tmp_path, host_memory=SLOTS * LAYERS * TOPK * 4 - 1)
    with pytest.raises(CapacityError):
        capturer()
    assert used() == 0


def test_without_records_the_host_cache_is_sglangs(tmp_path: Path, installed: Any) -> None:
    from sglang.srt.state_capturer import base

    publish(tmp_path, managers=["kv"])
    assert base.BaseHostCache is installed.StorageHostCache  # ours, falling back
    if torch.cuda.is_available():
        host = base.BaseHostCache(SLOTS, LAYERS, TOPK, name="routed_experts", device="cuda")
        assert not isinstance(host, installed.StorageHostCache)
        host.destroy()
    else:  # SGLang's own host cache registers its memory with the CUDA driver
        with pytest.raises(RuntimeError, match="NVIDIA driver"):
            base.BaseHostCache(SLOTS, LAYERS, TOPK, name="routed_experts", device="cpu")
    assert used() == 0


# ---------------------------------------------------------------------- payload


def test_a_finished_request_travels_as_a_handle_and_another_process_reads_it(
    tmp_path: Path, installed: Any
) -> None:
    root = tmp_path / "store"
    publish(root)
    cap = capturer()
    req, processor, expected = finished_request(cap, prompt=9, generated=6, rid="rollout-1")
    collect(req, processor, cap)

    handle_tensor = req.routed_experts
    assert handle_tensor.dtype == torch.uint8
    assert handle_tensor.numel() < 600  # a handle, not 14 rows x 4 layers x top-3
    meta = meta_info(handle_tensor)
    handle = installed.record_handle(meta, "routed_experts")
    assert handle.shape == (14, LAYERS, TOPK)
    assert handle.backend == "file"

    rows = read_in_child(meta, tmp_path / "rows.pt")
    assert rows.numpy().tobytes() == expected.numpy().tobytes()

    publisher = installed._publishers[0]
    deadline = time.monotonic() + 10
    while publisher._store_pending() and time.monotonic() < deadline:
        publisher.drain()
        time.sleep(0.02)
    assert not publisher._store_pending()  # the host copy went back once stored
    assert publisher.failed_writes == 0
    from sglang_storage.errors import StorageError

    with pytest.raises(StorageError, match="miss"):  # taken: deleted from storage
        installed.fetch_record(meta, timeout_s=0.1)


def test_keep_leaves_the_record_for_a_retry_until_discarded(tmp_path: Path, installed: Any) -> None:
    from sglang_storage.errors import StorageError

    capped: dict[str, object] = {"root": str(tmp_path / "store"), "capacity_bytes": "64MiB"}
    publish(tmp_path, options=capped)
    cap = capturer()
    req, processor, expected = finished_request(cap, prompt=5, generated=3, rid="retry")
    collect(req, processor, cap)
    meta = meta_info(req.routed_experts)
    assert installed.record_handle({"meta_info": meta}, "routed_experts") == (
        installed.record_handle(meta, "routed_experts")
    )  # a whole response, or its meta_info
    first = installed.fetch_record(meta, timeout_s=10.0, keep=True)
    again = installed.fetch_record(meta, timeout_s=1.0, keep=True)
    assert torch.equal(first, expected)
    assert torch.equal(again, expected)
    installed.discard_record(meta)
    with pytest.raises(StorageError, match="miss"):
        installed.fetch_record(meta, timeout_s=0.1)


def test_installed_twice_the_rows_are_published_once(
    tmp_path: Path, installed: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A second ``install()`` stacks a second collect hook; the outer one sees the handle
    the inner one left and leaves it alone, so the client reads the rows, not the handle."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_storage.errors import ConfigError

    installed.install()
    HookRegistry.reset()  # forget what was patched; the next apply wraps the wrapped method
    installed.install()
    HookRegistry.apply_hooks()
    publish(tmp_path / "store")
    cap = capturer()
    req, processor, expected = finished_request(cap, prompt=7, generated=5, rid="twice")
    with caplog.at_level("WARNING", logger="sglang_storage_adapters.records"):
        collect(req, processor, cap)
    ours = [r.getMessage() for r in caplog.records if r.name == "sglang_storage_adapters.records"]
    assert not ours  # published once, not tried again with the handle
    assert req.routed_experts.dtype == torch.uint8
    meta = meta_info(req.routed_experts)
    assert torch.equal(installed.fetch_record(meta, timeout_s=10.0), expected)
    publisher = installed._publishers[0]
    with pytest.raises(ConfigError, match=r"top_k\] \(got \"torch.uint8 of shape"):
        publisher.publish("routed_experts", "handle", req.routed_experts)


def test_the_sglang_transport_keeps_sglangs_rows(tmp_path: Path, installed: Any) -> None:
    from sglang_storage.errors import ConfigError

    root = tmp_path / "store"
    publish(root, transport="sglang")
    cap = capturer()
    req, processor, expected = finished_request(cap, prompt=6, generated=4, rid="kept")
    collect(req, processor, cap)
    assert torch.equal(req.routed_experts, expected)  # SGLang's tensor, untouched
    assert installed._publishers == {}
    meta = meta_info(req.routed_experts)
    with pytest.raises(ConfigError, match="not a sglang_storage record handle"):
        installed.fetch_record(meta)
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    flat = extract_routed_experts_from_meta_info({"meta_info": meta})
    assert flat.tobytes() == expected.numpy().tobytes()


def test_an_aborted_request_leaves_nothing_behind(tmp_path: Path, installed: Any) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    root = tmp_path / "store"
    publish(root)
    cap = capturer()
    req, processor, _ = finished_request(cap, prompt=6, generated=4, rid="aborted")
    req.finished_reason = FINISH_ABORT("client disconnected")
    collect(req, processor, cap)
    assert req.routed_experts is None
    assert installed.fetch_record({"meta_info_without": 1}) is None
    assert stored_objects(root) == []
    publisher = installed._publishers.get(0)
    assert publisher is None or not publisher._store_pending()


def test_indexer_rows_are_stored_only_for_requests_that_ask(tmp_path: Path, installed: Any) -> None:
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )
    from sglang.srt.state_capturer.indexer_topk import (
        IndexerTopkCapturer,
        set_global_indexer_capturer,
    )

    root = tmp_path / "store"
    publish(root)
    cap = IndexerTopkCapturer(
        num_tokens=SLOTS,
        num_indexer_layers=LAYERS,
        index_topk=TOPK,
        max_running_requests=4,
        device="cpu",
    )
    assert isinstance(cap.host_cache, installed.StorageHostCache)
    set_global_indexer_capturer(cap)
    req, processor, expected = finished_request(cap, prompt=6, generated=3, rid="idx")
    SchedulerBatchResultProcessor._maybe_collect_indexer_topk(processor, req)
    assert torch.equal(req.indexer_topk, expected)  # not asked: SGLang's (never sent)
    assert installed._publishers == {}

    req.return_indexer_topk = True
    SchedulerBatchResultProcessor._maybe_collect_indexer_topk(processor, req)
    handle = installed.record_handle(req.indexer_topk, "indexer_topk")
    assert handle is not None
    assert handle.tag == "indexer_topk"
    rows = installed.fetch_record(handle, "indexer_topk", timeout_s=10.0)
    assert rows is not None
    assert rows.numpy().tobytes() == expected.numpy().tobytes()
    set_global_indexer_capturer(None)
    cap.destroy()


def test_wire_bytes_of_a_32k_token_rollout(tmp_path: Path, installed: Any) -> None:
    """32K tokens x 61 layers x top-8: what crosses ZMQ (msgpack) and reaches the client."""
    publish(tmp_path / "store")
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    rows = torch.randint(0, 256, (32767, 61, 8), dtype=torch.int32)
    start = time.perf_counter()
    writer = installed.RecordPublisher(
        installed._settings(), model="dummy-moe", staging_bytes=80 << 20
    )
    try:
        handle = writer.publish("routed_experts", "rollout-32k", rows)
        assert handle is not None
        publish_s = time.perf_counter() - start
        sent = installed._handle_tensor(handle)  # what replaces the rows in the Req
        ours, sglangs = wire_bytes(sent), wire_bytes(rows)
        (b64_ours,) = DetokenizerManager._b64_encode_per_request([sent])
        (b64_sglang,) = DetokenizerManager._b64_encode_per_request([rows])
        start = time.perf_counter()
        back = installed.fetch_record(handle, timeout_s=30.0)
        fetch_s = time.perf_counter() - start
    finally:
        writer.close()
    assert back is not None
    assert back.numpy().tobytes() == rows.numpy().tobytes()
    print(
        f"\n32767 x 61 x 8 int32 ({rows.numel() * 4} B raw): scheduler->detokenizer msgpack "
        f"{sglangs} B (SGLang) vs {ours} B (handle); detokenizer->tokenizer/HTTP base64 "
        f"{len(b64_sglang)} B vs {len(b64_ours)} B; publish {publish_s * 1e3:.1f} ms, "
        f"file-backend fetch {fetch_s * 1e3:.1f} ms"
    )
    assert sglangs > 63_000_000
    assert ours < 1024
    assert len(b64_sglang) > 85_000_000


@pytest.mark.mooncake
def test_a_record_round_trips_through_a_real_mooncake_cluster(
    tmp_path: Path, installed: Any
) -> None:
    from support.mooncake import MooncakeCluster, mooncake_master_path

    from sglang_storage.errors import StorageError
    from sglang_storage.managers.records import close_readers

    if mooncake_master_path() is None:
        pytest.skip("mooncake_master is not installed")
    with MooncakeCluster(tmp_path) as cluster:
        publish(tmp_path, backend="mooncake", options=cluster.options())
        cap = capturer()
        req, processor, expected = finished_request(cap, prompt=8, generated=4, rid="mc-1")
        collect(req, processor, cap)
        meta = meta_info(req.routed_experts)
        assert installed.record_handle(meta, "routed_experts").backend == "mooncake"
        # In this process (the file test reads from another one), with a client of its own.
        try:
            rows = installed.fetch_record(meta, timeout_s=20.0)
            assert rows is not None
            assert rows.numpy().tobytes() == expected.numpy().tobytes()
            with pytest.raises(StorageError, match="miss"):  # taken: deleted from the cluster
                installed.fetch_record(meta, timeout_s=0.1)
        finally:
            close_readers()
            for publisher in installed._publishers.values():
                publisher.close()
            installed._publishers.clear()
            cap.destroy()


def test_handles_reject_what_is_not_one() -> None:
    from sglang_storage_adapters.records import record_handle, record_key

    from sglang_storage.errors import ConfigError

    rows = {"routed_experts": base64.b64encode(b"\0" * 12).decode()}
    with pytest.raises(ConfigError, match="extract_routed_experts_from_meta_info"):
        record_handle(rows, "routed_experts")
    with pytest.raises(ConfigError, match="base64 string"):
        record_handle({"routed_experts": [1, 2]}, "routed_experts")
    assert record_handle({"meta_info": {}}, "indexer_topk") is None
    with pytest.raises(ConfigError, match="kind"):
        record_handle({}, "logprobs")
    with pytest.raises(ConfigError, match="kind"):
        record_key("logprobs", "r")
    assert record_key("routed_experts", "a/b c") != record_key("indexer_topk", "a/b c")


def test_the_staging_flag_sizes_the_pool_and_a_record_too_big_goes_sglangs_way(
    tmp_path: Path, installed: Any, caplog: pytest.LogCaptureFixture
) -> None:
    slots = 256
    publish(tmp_path / "store", staging=4096)  # the least: one block
    cap = capturer(slots=slots)
    req, processor, expected = finished_request(cap, 100, 20, rid="roomy", slots=slots)
    assert expected.numel() * 4 > 4096  # 119 rows x 4 layers x top-3, int32
    with caplog.at_level("WARNING", logger="sglang_storage_adapters.records"):
        collect(req, processor, cap)
    assert torch.equal(req.routed_experts, expected)  # SGLang's rows, sent its way
    assert "do not fit the staging pool" in caplog.text
    publisher = installed._publishers[0]
    assert publisher.staging_bytes == 4096
    small, processor, small_rows = finished_request(cap, 10, 5, rid="fits", slots=slots)
    collect(small, processor, cap)
    assert small.routed_experts.dtype == torch.uint8  # a handle: 14 rows fit
    assert torch.equal(installed.fetch_record(meta_info(small.routed_experts)), small_rows)


def test_the_staging_flag_reaches_the_settings_every_process_reads(tmp_path: Path) -> None:
    import argparse

    from sglang_storage_adapters.flags import (
        StorageFlags,
        add_storage_cli_args,
        extra_config,
        parse_records_staging,
        storage_flags_from_args,
    )
    from sglang_storage_adapters.runtime import parse_settings

    from sglang_storage.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_storage_cli_args(parser)
    args = parser.parse_args(["--storage-backend", "memory", "--storage-records-staging", "1GiB"])
    flags = storage_flags_from_args(args)
    assert flags is not None
    assert parse_settings(extra_config(flags)).records_staging == 1 << 30
    config = tmp_path / "storage.json"
    config.write_text(json.dumps({"backend": "memory", "records-staging": "8MiB"}))
    from_file = storage_flags_from_args(parser.parse_args(["--storage-config", str(config)]))
    assert from_file is not None
    assert from_file.records_staging_bytes == 8 << 20
    assert parse_settings(extra_config(StorageFlags(backend="memory"))).records_staging is None
    given = {"storage_backend": "memory", "storage_records_staging": "64MiB"}
    assert parse_settings(given).records_staging == 64 << 20
    from sglang_storage.cli.settings import RECORDS_STAGING_MIN
    from sglang_storage.memory.records import BLOB_ALIGNMENT

    assert RECORDS_STAGING_MIN == BLOB_ALIGNMENT  # the least pool the flag may ask for
    with pytest.raises(ConfigError, match="at least 4KiB"):
        parse_records_staging("4095")
    with pytest.raises(ConfigError, match="records_staging"):
        StorageFlags(backend="memory", records_staging_bytes=0)
    with pytest.raises(ConfigError, match="storage_records_staging"):
        parse_settings({"storage_backend": "memory", "storage_records_staging": [1]})


def test_the_transport_flag_reaches_the_settings_every_process_reads() -> None:
    from sglang_storage_adapters.flags import StorageFlags, extra_config
    from sglang_storage_adapters.runtime import parse_settings

    from sglang_storage.errors import ConfigError

    kept = StorageFlags(backend="memory", records_transport="sglang")
    assert parse_settings(extra_config(kept)).records_transport == "sglang"
    default = extra_config(StorageFlags(backend="memory"))
    assert "storage_records_transport" not in default
    assert parse_settings(default).records_transport == "store"
    assert parse_settings(default).enabled("records")  # served: on by default
    with pytest.raises(ConfigError, match="records_transport"):
        StorageFlags(backend="memory", records_transport="zmq")
    with pytest.raises(ConfigError, match="records_transport"):
        parse_settings({"storage_backend": "memory", "storage_records_transport": "zmq"})
