"""SGLang 0.5.23's Engram host tables on our memory and storage, built through SGLang itself.

The adapter replaces ``_HostTable`` and wraps ``EngramEmbedding._load_rows`` through
SGLang's HookRegistry; every table here is built by SGLang's own ``EngramEmbedding`` (its
``_init_host_table`` path under ``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1``) and loaded by
SGLang's own safetensors iterator and weight loader from a real checkpoint file. The byte
layout is checked against SGLang's device-table path, whose lookup runs on CPU.

Named fakes, for what needs CUDA: :class:`FakeCudart` (host registration),
``fake_current_device`` and ``fake_sorted_host_reads`` (SGLang's ATS query on the device).
The GPU lookup through the host pointer is ``tests/gpu/test_engram_host_table.py``.
The TP group is :class:`PipeGroup`, a CPU stand-in with SGLang's ``GroupCoordinator``
calls (``rank_in_group``, ``world_size``, ``broadcast_object``, ``barrier``) over a pipe.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_hooks import hooks_installed

pytestmark = pytest.mark.sglang

ROWS, DIM, BLOCK = 16384, 256, 32
COLUMNS = (0, ROWS // 2, ROWS)  # two hash columns: one per rank at TP 2
W_BYTES, S_BYTES = ROWS * DIM, ROWS * DIM // BLOCK
LAYER = 3
NAMES = {"weight": "layers.3.engram.embed.weight", "scale": "layers.3.engram.embed.scale"}


class FakeCudart:
    """A fake of the CUDA runtime's host registration (no CUDA runs here)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0 if self.live.pop(ptr, None) is not None else 713

    def cudaGetLastError(self) -> int:  # noqa: N802
        return 0


def fake_current_device() -> int:
    """A fake of ``torch.cuda.current_device`` (SGLang asks it for the ATS query)."""
    return 0


def fake_sorted_host_reads(device: int) -> bool:
    """A fake of SGLang's ``_sorted_host_reads`` (a CUDA driver attribute query)."""
    return False


class PipeGroup:
    """A CPU stand-in for SGLang's TP ``GroupCoordinator`` between two processes."""

    def __init__(self, rank: int, conn: Connection, barrier: Any) -> None:
        self.rank_in_group = rank
        self.world_size = 2
        self._conn = conn
        self._barrier = barrier

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        if self.rank_in_group == src:
            self._conn.send(obj)
            return obj
        return self._conn.recv()

    def barrier(self) -> None:
        self._barrier.wait(60)


class SoloGroup:
    """SGLang's TP group at TP 1 (``broadcast_object`` returns its input, as SGLang's)."""

    rank_in_group = 0
    world_size = 1

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


# ------------------------------------------------------------------------ set-up


def checkpoint(directory: Path) -> Path:
    """A checkpoint file holding one Engram table: fp8 rows and e8m0 block scales."""
    import safetensors.torch

    g = torch.Generator().manual_seed(11)
    weight = (torch.randn(ROWS, DIM, generator=g) * 4).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 135, (ROWS, DIM // BLOCK), generator=g, dtype=torch.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model-00001-of-00001.safetensors"
    scale = exponents.view(torch.float8_e8m0fnu)
    safetensors.torch.save_file({NAMES["weight"]: weight, NAMES["scale"]: scale}, path)
    return path


def publish(store: Path, model: Path, *, managers: list[str] | None = None) -> None:
    """ServerArgs as ``--storage-backend file`` leaves them, with ``model`` as model path."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang_storage_adapters.flags import StorageFlags, hicache_settings

    settings = hicache_settings(StorageFlags(backend="file", backend_options={"root": str(store)}))
    extra = json.loads(str(settings.pop("hicache_storage_backend_extra_config")))
    extra["storage_managers"] = managers or ["kv", "engram"]
    args = ServerArgs(
        model_path="dummy", hicache_storage_backend_extra_config=json.dumps(extra), **settings
    )
    set_global_server_args_for_scheduler(args)
    get_context().override("test", model_path=str(model))  # SGLang's own override


@pytest.fixture
def engram(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """SGLang's engram module with our adapter installed, host tables on, CUDA faked."""
    from sglang.srt.layers import engram as origin
    from sglang.srt.runtime_context import reset_context
    from sglang_storage_adapters import engram as adapter

    monkeypatch.setenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "1")
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", "shared")  # restored after
    monkeypatch.setattr(torch.cuda, "current_device", fake_current_device)
    monkeypatch.setattr(origin, "_sorted_host_reads", fake_sorted_host_reads)
    loader = origin.EngramEmbedding._load_rows
    adapter.use_cuda_runtime(FakeCudart())
    with hooks_installed(origin._HostTable, adapter.install, adapter):
        try:
            yield origin
        finally:
            origin.EngramEmbedding._load_rows = loader
            adapter.shutdown()
            adapter.use_cuda_runtime(None)
    reset_context()


def parallel(rank: int, size: int, group: Any) -> Any:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(
        tp_size=size,
        tp_rank=rank,
        tp_group=group,
        attn_tp_size=size,
        attn_tp_rank=rank,
        attn_tp_group=group,
        moe_tp_size=size,
    )


def build(engram: Any, layout: str, *, rank: int = 0, size: int = 1, group: Any = None) -> Any:
    os.environ["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] = layout
    with parallel(rank, size, group or SoloGroup()):
        return engram.EngramEmbedding(ROWS, DIM, LAYER, COLUMNS)


def load(embed: Any, path: Path) -> dict[str, int]:
    """SGLang's iterator and weight loader; the kB of each checkpoint tensor mapped while
    loading, as a share of the tensor's own kB (100: every page of it was read)."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    from sglang_storage.memory import read_backing

    resident = {}
    params = {NAMES["weight"]: embed.weight, NAMES["scale"]: embed.scale}
    for name, tensor in safetensors_weights_iterator([str(path)]):
        param = params[name]
        param.weight_loader(param, tensor)
        report = read_backing(tensor.data_ptr(), tensor.nbytes, huge_pages_asked=False)
        resident[name] = 100 * report.mapped_kb // max(1, tensor.nbytes // 1024)
    embed.finish_load(label=f"layer {LAYER}")
    return resident


def table_bytes(embed: Any) -> bytes:
    return bytes(embed.host_table.bytes.numpy())


def checkpoint_bytes(path: Path) -> bytes:
    import safetensors.torch

    tensors = safetensors.torch.load_file(str(path))
    w, s = (tensors[NAMES[k]].view(torch.uint8).numpy().tobytes() for k in ("weight", "scale"))
    return w + s


def used() -> int:
    from sglang.srt.runtime_context import get_server_args
    from sglang_storage_adapters.runtime import process_runtime, runtime_settings

    settings = runtime_settings(get_server_args())
    assert settings is not None
    return process_runtime(settings).used("engram")


def sglang_lookup(engram: Any, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """SGLang's own lookup of every row on CPU (its device-table torch path)."""
    os.environ.pop("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE")
    try:
        with parallel(0, 1, SoloGroup()):
            device = engram.EngramEmbedding(ROWS, DIM, LAYER, COLUMNS)
            device.weight.data.copy_(weight)
            device.scale.data.copy_(scale)
            ids = torch.arange(ROWS).reshape(-1, 8)
            values: torch.Tensor = device(ids)
            return values
    finally:
        os.environ["SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"] = "1"


# ------------------------------------------------------------------------ tests


@pytest.mark.parametrize("layout", ["per_rank", "shared"])
def test_sglang_builds_our_table_in_the_budget_and_its_lookup_reads_sglangs_layout(
    tmp_path: Path, engram: Any, layout: str
) -> None:
    from sglang_storage_adapters.engram import StorageHostTable, wait_persisted

    from sglang_storage.memory import Registration

    path = checkpoint(tmp_path / "model")
    publish(tmp_path / "store", tmp_path / "model")
    before = used()
    embed = build(engram, layout)
    table = embed.host_table
    assert type(table) is StorageHostTable
    assert table.nbytes == W_BYTES + S_BYTES
    assert used() - before == W_BYTES + S_BYTES  # charged to the one budget, component engram
    state = table.region.state()
    assert state.registration is Registration.REGISTERED  # through the fake runtime
    assert table.device_ptr == table.region.address == table.bytes.data_ptr()
    assert embed._host_table_ptrs == (table.device_ptr, table.device_ptr + W_BYTES)
    assert embed.weight.data_ptr() == table.device_ptr  # SGLang's views are our region

    resident = load(embed, path)
    # The copy into the table read every page of the checkpoint's table.
    assert min(resident.values()) >= 100, resident
    assert table_bytes(embed) == checkpoint_bytes(path)  # SGLang's byte layout, byte for byte
    report = table.region.backing()
    assert report.mapped_kb >= (W_BYTES + S_BYTES) // 1024
    if layout == "per_rank" and report.thp_enabled in ("madvise", "always"):
        assert report.anon_huge_kb > 0, report.describe()

    # SGLang's lookup over our table's rows equals its lookup over the checkpoint's.
    import safetensors.torch

    tensors = safetensors.torch.load_file(str(path))
    ours = sglang_lookup(engram, embed.weight.data, embed.scale.data)
    theirs = sglang_lookup(engram, tensors[NAMES["weight"]], tensors[NAMES["scale"]])
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    assert ours.dtype == torch.bfloat16
    assert ours.abs().sum() > 0

    (persisted,) = wait_persisted(60)
    assert persisted.complete
    assert persisted.nbytes == W_BYTES + S_BYTES
    del embed, table
    gc.collect()
    assert used() == before  # a dropped table gives its memory back


def test_a_restart_restores_from_the_file_backend_and_the_loader_reads_no_checkpoint_rows(
    tmp_path: Path, engram: Any
) -> None:
    from sglang_storage_adapters.engram import shutdown, wait_persisted

    from sglang_storage.managers.tables import RestoreOutcome

    path = checkpoint(tmp_path / "model")
    publish(tmp_path / "store", tmp_path / "model")
    first = build(engram, "per_rank")
    load(first, path)
    assert wait_persisted(60)[0].complete
    shutdown()  # the next start: a new manager, a new backend instance reading the store

    restarted = build(engram, "per_rank")
    resident = load(restarted, path)
    result = restarted.host_table.restore_result
    assert result is not None
    assert result.outcome is RestoreOutcome.RESTORED
    assert table_bytes(restarted) == checkpoint_bytes(path)
    # The table's checkpoint tensors were never copied: of the 4 MiB weight only what the
    # iterator itself touches (a 64 KiB fault-around window or so) is resident.
    assert resident[NAMES["weight"]] <= 10, resident
    assert wait_persisted(1) == []  # nothing to persist: the stored copy is this one
    del first
    shutdown()

    # A damaged chunk: the next start misses and loads the checkpoint, bytes still right.
    chunks = sorted((tmp_path / "store").rglob("*-s0-c*"), key=lambda p: p.stat().st_size)
    assert chunks
    raw = bytearray(chunks[-1].read_bytes())
    raw[-10] ^= 0x01
    chunks[-1].write_bytes(bytes(raw))
    again = build(engram, "per_rank")
    resident = load(again, path)
    result = again.host_table.restore_result
    assert result is not None
    assert result.outcome is RestoreOutcome.MISS
    assert "corrupt" in result.reason
    assert min(resident.values()) >= 100, resident  # loaded from the checkpoint
    assert table_bytes(again) == checkpoint_bytes(path)


def test_a_changed_checkpoint_is_not_restored(tmp_path: Path, engram: Any) -> None:
    from sglang_storage_adapters.engram import shutdown, wait_persisted

    from sglang_storage.managers.tables import RestoreOutcome

    path = checkpoint(tmp_path / "model")
    publish(tmp_path / "store", tmp_path / "model")
    load(build(engram, "per_rank"), path)
    assert wait_persisted(60)[0].complete
    shutdown()
    os.utime(path, ns=(1, 1))  # the same bytes, another file: the fingerprint differs
    embed = build(engram, "per_rank")
    load(embed, path)
    result = embed.host_table.restore_result
    assert result is not None
    assert result.outcome is RestoreOutcome.MISS
    assert table_bytes(embed) == checkpoint_bytes(path)


def _rank_one(engram: Any, path: Path, conn: Connection, barrier: Any, report: Connection) -> None:
    """TP rank 1 in a forked process: attach, load its rows, finish, report."""
    # The parent's OpenMP pool did not survive the fork: keep torch on this thread.
    torch.set_num_threads(1)
    try:
        start = used()
        embed = build(engram, "shared", rank=1, size=2, group=PipeGroup(1, conn, barrier))
        state = embed.host_table.region.state()
        with parallel(1, 2, PipeGroup(1, conn, barrier)):
            load(embed, path)
        report.send((state.charged_bytes, state.shared_from, used() - start, embed.row_start))
    except BaseException:
        report.send(traceback.format_exc())
        raise


def test_the_shared_layout_is_one_memfd_for_two_processes_charged_once(
    tmp_path: Path, engram: Any
) -> None:
    path = checkpoint(tmp_path / "ckpt")
    (tmp_path / "model").mkdir()  # no checkpoint at the model path: no storage involved
    publish(tmp_path / "store", tmp_path / "model")
    before = used()
    context = multiprocessing.get_context("fork")  # the child shares the imported SGLang
    mine, theirs = context.Pipe()
    report_in, report_out = context.Pipe()
    barrier = context.Barrier(2)
    child = context.Process(target=_rank_one, args=(engram, path, theirs, barrier, report_out))
    child.start()
    try:
        group = PipeGroup(0, mine, barrier)
        embed = build(engram, "shared", rank=0, size=2, group=group)
        with parallel(0, 2, group):
            load(embed, path)  # rank 0's rows; finish_load meets rank 1 at the barrier
        assert report_in.poll(120), "rank 1 did not report"
        got = report_in.recv()
        assert not isinstance(got, str), got
        charged, shared_from, child_used, child_start = got
    finally:
        child.join(60)
    assert child.exitcode == 0
    assert (charged, shared_from, child_start) == (0, os.getpid(), ROWS // 2)
    assert child_used == 0  # the attaching rank charged nothing
    assert used() - before == W_BYTES + S_BYTES  # the creator charged the table once
    # Both ranks' rows, written by two processes into one mapping, read here.
    assert table_bytes(embed) == checkpoint_bytes(path)


def test_without_engram_in_the_managers_sglang_builds_its_own_table(
    tmp_path: Path, engram: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_storage_adapters.engram import StorageHostTable

    path = checkpoint(tmp_path / "model")
    publish(tmp_path / "store", tmp_path / "model", managers=["kv"])
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)  # SGLang registers through it
    embed = build(engram, "per_rank")
    assert type(embed.host_table) is StorageHostTable.__bases__[0]  # SGLang's own class
    assert fake.live == {embed.host_table.bytes.data_ptr(): W_BYTES + S_BYTES}
    load(embed, path)  # the loader hook passes SGLang's table through
    assert table_bytes(embed) == checkpoint_bytes(path)
