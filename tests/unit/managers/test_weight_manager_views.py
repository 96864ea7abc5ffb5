"""WeightBackupManager for elastic EP: (layer, expert) shards restored into per-replica views.

A holder manager backs experts up (host pool, storage); a rank's manager with no pool
tracks them and restores from the holder (a ``PeerShards`` reading the holder's host
copies in this process) or from storage, byte for byte, into every replica's view.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from support.faults import PipelineCloser

from sglang_storage.errors import BackendIOError, ConfigError, StateError
from sglang_storage.managers.weights import (
    ExpertBackedUp,
    ExpertId,
    ExpertKey,
    PeerRead,
    RestoreState,
    WeightBackupConfig,
    WeightBackupManager,
    WeightEvent,
    shard_name,
)
from sglang_storage.memory import (
    BlobPool,
    BlobPoolConfig,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    MemoryFacts,
)
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage import MemoryBackend
from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig

HIDDEN, INTER, SLOTS = 16, 8, 3
WAIT_S = 10.0
SHARDS = {"gate_proj.weight": (INTER, HIDDEN), "up_proj.weight": (INTER, HIDDEN)}

_PIPELINES = PipelineCloser()
_close_pipelines = _PIPELINES.autouse_fixture()


def _expert(key: ExpertKey) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * key.layer + key.expert)
    return {s: torch.randn(shape, generator=g).to(torch.bfloat16) for s, shape in SHARDS.items()}


class HolderPeers:
    """Reads a holder manager's host copies (another process's memory in production)."""

    def __init__(self, holder: WeightBackupManager, *, fail: bool = False) -> None:
        self.holder, self.fail, self.reads = holder, fail, 0

    def holds(self, expert_id: ExpertId, shard: str) -> bool:
        return self.holder.host_view(expert_id, shard) is not None

    def read(self, reads: Sequence[PeerRead]) -> None:
        self.reads += len(reads)
        if self.fail:
            raise BackendIOError(backend="peer", operation="read", reason="node down")
        for read in reads:
            source = self.holder.host_view(read.expert_id, read.shard)
            assert source is not None
            read.into.view(torch.uint8).reshape(-1).copy_(source)


@pytest.fixture
def backend() -> Iterator[MemoryBackend]:
    store = MemoryBackend()
    yield store
    _PIPELINES.close_all()
    store.close()


def _events(manager: WeightBackupManager, count: int) -> list[WeightEvent]:
    events: list[WeightEvent] = []
    end = time.monotonic() + WAIT_S
    while len(events) < count and time.monotonic() < end:
        events += manager.poll(timeout_s=0.2)
    return events


def _pipeline(store: MemoryBackend) -> StoragePipeline:
    pipeline = StoragePipeline(store, StoragePipelineConfig(workers=1))
    _PIPELINES.track(pipeline)
    return pipeline


def _holder(store: MemoryBackend | None, keys: Sequence[ExpertKey]) -> WeightBackupManager:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0), facts=facts))
    pool = BlobPool(BlobPoolConfig(capacity=len(keys) * 2 * 4096), memory)
    pipeline = None if store is None else _pipeline(store)
    manager = WeightBackupManager(WeightBackupConfig(model="m"), pool, LRUPolicy(), pipeline)
    for key in keys:
        manager.backup(key, _expert(key))
    if pipeline is not None:
        acked = _events(manager, len(keys))
        assert all(isinstance(e, ExpertBackedUp) and e.ok for e in acked)
        assert len(acked) == len(keys)
    return manager


def _rank(
    holder: WeightBackupManager, store: MemoryBackend | None, peers: HolderPeers | None
) -> WeightBackupManager:
    """A rank's manager: no pool, the holder's experts tracked."""
    pipeline = None if store is None else _pipeline(store)
    manager = WeightBackupManager(
        WeightBackupConfig(model="m"), None, LRUPolicy(), pipeline, peers=peers
    )
    for key in holder.experts():
        specs = holder.specs(key)
        assert specs is not None
        manager.track(key, specs)
    return manager


def _w13() -> torch.Tensor:
    """SGLang's fused ``w13`` parameter of one layer: gate rows then up rows per slot."""
    return torch.full((SLOTS, 2 * INTER, HIDDEN), 7.0, dtype=torch.bfloat16)


def _replicas(w13: torch.Tensor, slots: Sequence[int]) -> dict[str, list[torch.Tensor]]:
    return {
        "gate_proj.weight": [w13[s].narrow(0, 0, INTER) for s in slots],
        "up_proj.weight": [w13[s].narrow(0, INTER, INTER) for s in slots],
    }


def _holds(w13: torch.Tensor, slot: int, key: ExpertKey) -> bool:
    expected = torch.cat(list(_expert(key).values()))
    return torch.equal(w13[slot].view(torch.int16), expected.view(torch.int16))


def _untouched(w13: torch.Tensor, slot: int) -> bool:
    return bool((w13[slot] == 7.0).all())


A, B = ExpertKey(0, 1), ExpertKey(1, 3)


def test_shard_names_keep_layer_and_expert_apart() -> None:
    assert shard_name(ExpertKey(1, 23), "w") != shard_name(ExpertKey(12, 3), "w")
    assert shard_name(ExpertKey(1, 2), "gate_proj.weight") == "layer1.expert2.gate_proj.weight"
    assert shard_name(5, "w2") == "expert5.w2"  # the int ids keep their names
    with pytest.raises(ConfigError):
        ExpertKey(-1, 0)


def test_host_copies_go_into_every_replica_view_byte_for_byte() -> None:
    holder = _holder(None, [A, B])
    w13 = _w13()
    states = holder.restore_to({A: _replicas(w13, [0, 2])})
    assert states == {A: RestoreState.RESTORED}
    assert _holds(w13, 0, A)
    assert _holds(w13, 2, A)
    assert _untouched(w13, 1)
    # Views of another dtype of the same byte size receive the same bytes.
    raw = torch.zeros(INTER * HIDDEN // 2, dtype=torch.float32)
    holder.restore_to({B: {"gate_proj.weight": [raw]}})
    assert torch.equal(raw.view(torch.bfloat16).view(INTER, HIDDEN), _expert(B)["gate_proj.weight"])


def test_a_bad_view_or_shard_is_refused_before_anything_is_copied() -> None:
    holder = _holder(None, [A, B])
    w13 = _w13()
    short = {"gate_proj.weight": [w13[1].narrow(0, 0, INTER - 1)]}
    with pytest.raises(ConfigError, match="must hold the shard's"):
        holder.restore_to({A: _replicas(w13, [0]), B: short})
    with pytest.raises(ConfigError, match="is not a shard"):
        holder.restore_to({A: _replicas(w13, [0]), B: {"down_proj.weight": [w13[1]]}})
    assert _untouched(w13, 0)


def test_restore_sync_refuses_an_expert_with_no_copy_before_copying_any() -> None:
    holder = _holder(None, [A])
    w13 = _w13()
    assert holder.restore_to({B: _replicas(w13, [1])}) == {B: RestoreState.MISSING}
    with pytest.raises(StateError, match="no copy of expert"):
        holder.restore_sync({A: _replicas(w13, [0]), B: _replicas(w13, [1])}, timeout_s=1.0)
    assert _untouched(w13, 0)


def test_a_rank_reads_from_the_holder_then_from_storage_when_the_holder_fails(
    backend: MemoryBackend,
) -> None:
    holder = _holder(backend, [A, B])
    peers = HolderPeers(holder)
    rank = _rank(holder, backend, peers)
    w13 = _w13()
    assert rank.restore_sync({A: _replicas(w13, [0, 2])}, timeout_s=WAIT_S) == {
        A: RestoreState.PEER
    }
    assert _holds(w13, 0, A)
    assert _holds(w13, 2, A)
    assert peers.reads == 4  # two shards into two replicas
    peers.fail = True  # the holder's node is gone
    states = rank.restore_sync({B: _replicas(w13, [1])}, timeout_s=WAIT_S)
    assert states == {B: RestoreState.PENDING}  # came from storage
    assert _holds(w13, 1, B)
    assert rank.poll() == []


def test_without_storage_a_failed_holder_read_raises_its_error(backend: MemoryBackend) -> None:
    holder = _holder(None, [A])
    rank = _rank(holder, None, HolderPeers(holder, fail=True))
    with pytest.raises(BackendIOError, match="node down"):
        rank.restore_sync({A: _replicas(_w13(), [0])}, timeout_s=WAIT_S)


def test_restore_sync_leaves_other_work_for_poll(backend: MemoryBackend) -> None:
    holder = _holder(backend, [A])
    rank = _rank(holder, backend, None)
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0), facts=facts))
    both = WeightBackupManager(
        WeightBackupConfig(model="m"),
        BlobPool(BlobPoolConfig(capacity=4 * 4096), memory),
        LRUPolicy(),
        _pipeline(backend),
    )
    both.track(A, rank.specs(A) or {})
    both.backup(B, _expert(B))  # its acknowledgement may arrive during the restore
    w13 = _w13()
    assert both.restore_sync({A: _replicas(w13, [2])}, timeout_s=WAIT_S) == {
        A: RestoreState.PENDING
    }
    assert _holds(w13, 2, A)
    assert _events(both, 1) == [ExpertBackedUp(expert_id=B, ok=True)]
