"""WeightBackupManager: expert shards backed up to host and storage, restored byte for byte."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.faults import FaultyBackend, PipelineCloser

from sglang_storage.core import GetOutcome
from sglang_storage.errors import CapacityError, ConfigError, StateError
from sglang_storage.managers.weights import (
    ExpertBackedUp,
    ExpertRestored,
    RestoreState,
    WeightBackupConfig,
    WeightBackupManager,
    WeightEvent,
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
from sglang_storage.storage import Backend, FileBackend, FileBackendConfig, MemoryBackend
from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig

HIDDEN, INTER = 32, 48
EXPERT_BYTES = (2 * INTER * HIDDEN + HIDDEN * INTER) * 2  # 9216 bytes: 3 blocks of 4 KiB
WAIT_S = 10.0


_PIPELINES = PipelineCloser()
_close_pipelines = _PIPELINES.autouse_fixture()


def _expert(expert_id: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(expert_id)
    return {
        "w13_weight": torch.randn((2 * INTER, HIDDEN), generator=g).to(torch.bfloat16),
        "w2_weight": torch.randn((HIDDEN, INTER), generator=g).to(torch.bfloat16),
    }


def _into(count: int) -> dict[str, torch.Tensor]:
    """Stacked destinations as an MoE layer holds them, filled with a sentinel."""
    return {
        "w13_weight": torch.full((count, 2 * INTER, HIDDEN), 7.0, dtype=torch.bfloat16),
        "w2_weight": torch.full((count, HIDDEN, INTER), 7.0, dtype=torch.bfloat16),
    }


def _holds(into: dict[str, torch.Tensor], k: int, expert_id: int) -> bool:
    return all(
        torch.equal(into[name][k].view(torch.int16), value.view(torch.int16))
        for name, value in _expert(expert_id).items()
    )


def _untouched(into: dict[str, torch.Tensor]) -> bool:
    return all(bool((t == 7.0).all()) for t in into.values())


def _manager(
    store: Backend | FaultyBackend | None, *, experts: int = 8
) -> tuple[WeightBackupManager, BlobPool, StoragePipeline | None]:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0), facts=facts))
    pool = BlobPool(BlobPoolConfig(capacity=experts * 3 * 4096), memory)
    pipeline = None
    if store is not None:
        pipeline = StoragePipeline(store, StoragePipelineConfig(workers=1))
        _PIPELINES.track(pipeline)
    config = WeightBackupConfig(model="test-model")
    return WeightBackupManager(config, pool, LRUPolicy(), pipeline), pool, pipeline


def _events(manager: WeightBackupManager, count: int) -> list[WeightEvent]:
    events: list[WeightEvent] = []
    end = time.monotonic() + WAIT_S
    while len(events) < count and time.monotonic() < end:
        events += manager.poll(timeout_s=0.2)
    assert len(events) == count, events
    return events


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    store: Backend
    if request.param == "memory":
        store = MemoryBackend()
    else:
        store = FileBackend(FileBackendConfig(root=tmp_path / "store"))
    yield store
    _PIPELINES.close_all()  # before the store: no worker may still be calling it
    store.close()


# ---------------------------------------------------------------- life cycle


def test_host_backup_restores_byte_identical_in_any_order() -> None:
    manager, _, _ = _manager(None)
    for expert_id in (3, 5, 9):
        manager.backup(expert_id, _expert(expert_id))
    into = _into(4)
    states = manager.restore([9, 3, 11, 5], into)
    assert states == [
        RestoreState.RESTORED,
        RestoreState.RESTORED,
        RestoreState.MISSING,
        RestoreState.RESTORED,
    ]
    assert _holds(into, 0, 9)
    assert _holds(into, 1, 3)
    assert _holds(into, 3, 5)
    assert bool((into["w2_weight"][2] == 7.0).all())  # the missing expert's row is untouched
    assert manager.release_host(1 << 30) == 0  # nothing is stored: nothing may be dropped
    assert manager.poll() == []
    with pytest.raises(StateError):
        manager.backup(3, _expert(3))


def test_stored_experts_are_dropped_from_host_and_restored_from_storage(backend: Backend) -> None:
    manager, pool, _ = _manager(backend)
    for expert_id in range(3):
        manager.backup(expert_id, _expert(expert_id))
    events = _events(manager, 3)
    assert all(isinstance(e, ExpertBackedUp) and e.ok for e in events)
    assert manager.release_host(1 << 30) == 3 * 3 * 4096
    assert not any(manager.on_host(e) for e in range(3))
    assert pool.stats().used_bytes == 0
    into = _into(3)
    assert manager.restore([2, 0, 1], into) == [RestoreState.PENDING] * 3
    restored = _events(manager, 3)
    assert all(isinstance(e, ExpertRestored) and e.outcome is GetOutcome.HIT for e in restored)
    assert _holds(into, 0, 2)
    assert _holds(into, 1, 0)
    assert _holds(into, 2, 1)

    restarted, _, _ = _manager(backend)  # a new process: nothing on host, all in storage
    into = _into(1)
    assert restarted.restore([1], into) == [RestoreState.PENDING]
    _events(restarted, 1)
    assert _holds(into, 0, 1)


def test_memory_pressure_drops_only_acknowledged_experts(backend: Backend) -> None:
    manager, _, _ = _manager(backend, experts=2)
    manager.backup(0, _expert(0))
    manager.backup(1, _expert(1))
    with pytest.raises(CapacityError):
        manager.backup(2, _expert(2))  # puts may still be in flight: nothing droppable yet
    _events(manager, 2)
    manager.restore([0], _into(1))  # expert 0 is now the most recently used
    manager.backup(2, _expert(2))
    assert manager.on_host(0)
    assert not manager.on_host(1)
    assert manager.on_host(2)
    into = _into(1)
    assert manager.restore([1], into) == [RestoreState.PENDING]
    _events(manager, 2)  # expert 2's put and expert 1's restore
    assert _holds(into, 0, 1)


# ---------------------------------------------------------------- faults


def test_an_expert_whose_put_failed_stays_on_host(backend: Backend) -> None:
    faulty = FaultyBackend(backend)
    manager, _, _ = _manager(faulty)
    faulty.fail_puts = True
    manager.backup(0, _expert(0))
    events = _events(manager, 1)
    faulty.fail_puts = False
    faulty.error_keys = {"expert1.w2_weight"}
    manager.backup(1, _expert(1))
    events += _events(manager, 1)
    assert all(isinstance(e, ExpertBackedUp) and not e.ok and e.error for e in events)
    assert manager.release_host(1 << 30) == 0
    into = _into(2)
    assert manager.restore([0, 1], into) == [RestoreState.RESTORED] * 2
    assert _holds(into, 0, 0)
    assert _holds(into, 1, 1)


@pytest.mark.parametrize("fault", ["call", "key", "spec", "absent"])
def test_failed_restores_leave_the_destination_untouched(backend: Backend, fault: str) -> None:
    faulty = FaultyBackend(backend)
    manager, _, _ = _manager(faulty)
    manager.backup(0, _expert(0))
    _events(manager, 1)
    manager.release_host(1)
    faulty.fail_gets = fault == "call"
    if fault == "key":
        faulty.error_keys = {"expert0.w2_weight"}
    into = _into(1)
    if fault == "spec":  # same bytes, other shape: the stored header refuses it
        into["w2_weight"] = into["w2_weight"].view(1, INTER, HIDDEN)
    expert = 4 if fault == "absent" else 0
    assert manager.restore([expert], into) == [RestoreState.PENDING]
    (event,) = _events(manager, 1)
    expected = {"call": GetOutcome.ERROR, "key": GetOutcome.ERROR}
    expected.update({"spec": GetOutcome.CORRUPT, "absent": GetOutcome.MISS})
    assert isinstance(event, ExpertRestored)
    assert event.outcome is expected[fault]
    assert _untouched(into)


def test_a_closed_pipeline_reports_errors_not_exceptions(backend: Backend) -> None:
    manager, _, pipeline = _manager(backend)
    assert pipeline is not None
    pipeline.close()
    manager.backup(0, _expert(0))
    assert manager.restore([1], _into(1)) == [RestoreState.PENDING]
    events = manager.poll()
    assert [type(e) for e in events] == [ExpertBackedUp, ExpertRestored]
    assert manager.on_host(0)


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="model"):
        WeightBackupConfig(model="a b")
    manager, pool, _ = _manager(None)
    manager.backup(0, _expert(0))
    with pytest.raises(ConfigError, match="one row per expert"):
        manager.restore([0, 1], _into(1))
    wrong = _into(1)
    wrong["w2_weight"] = wrong["w2_weight"].float()
    with pytest.raises(ConfigError, match="must match"):
        manager.restore([0], wrong)
    manager.backup(5, {**_expert(5), "w2_weight": _expert(5)["w2_weight"].float()})
    into = _into(2)
    with pytest.raises(ConfigError, match="expert 5"):
        manager.restore([0, 5], into)
    assert _untouched(into)  # expert 0 fits, but nothing is copied when one does not
    with pytest.raises(ConfigError):
        manager.backup(-1, _expert(1))
    with pytest.raises(ConfigError):
        manager.backup(1, {"bad name": torch.ones(2)})
    used = pool.stats().used_bytes
    with pytest.raises(ConfigError):
        manager.backup(2, {"a": torch.ones(2), "b": torch.ones(0)})  # empty: rolled back
    assert pool.stats().used_bytes == used
    assert not manager.on_host(2)
