"""The fault-injecting wrapper: seeded determinism, every fault kind observable, config errors.

The wrapper runs around the real ``memory``, ``file`` and ``hf3fs`` (POSIX, under
``tmp_path``) backends; media faults damage the stored objects themselves, so what these
tests see is the wrapped backend's own verification at work.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.pagestores import PAGE_BYTES, get_requests, key, payload, put_requests

from sglang_storage.core import GetOutcome, PutOutcome
from sglang_storage.errors import BackendIOError, ConfigError, OperationTimeoutError
from sglang_storage.storage import (
    Backend,
    FaultInjectingBackend,
    FaultKind,
    FaultSchedule,
    FaultyBackendConfig,
    FileBackend,
    FileBackendConfig,
    Hf3fsBackend,
    Hf3fsBackendConfig,
    MemoryBackend,
    create_backend,
)
from sglang_storage.storage.faults import MEDIA_FAULTS

KEYS = 24


def _make(kind: str, root: Path) -> Backend:
    if kind == "memory":
        return MemoryBackend()
    if kind == "file":
        return FileBackend(FileBackendConfig(root=root / "file"))
    (root / "hf3fs").mkdir()
    return Hf3fsBackend(
        Hf3fsBackendConfig(
            root=root / "hf3fs",
            allow_non_3fs=True,
            data_file_size=1 << 20,
            data_files=2,
            io_threads=1,
        )
    )


@pytest.fixture(params=["memory", "file", "hf3fs"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend = _make(request.param, tmp_path)
    yield backend
    backend.close()


@pytest.fixture
def memory() -> Iterator[MemoryBackend]:
    backend = MemoryBackend()
    yield backend
    backend.close()


def _wrap(inner: Backend, **rates: float) -> FaultInjectingBackend:
    return FaultInjectingBackend(inner, FaultSchedule(seed=7, **rates))


def _read_all(store: Backend, n: int = KEYS) -> tuple[list[GetOutcome], int]:
    """Outcomes of reading pages 0..n-1, and the number of wrong bytes delivered by hits."""
    requests = get_requests(range(n))
    results = store.get_into(requests)
    wrong = 0
    for i, (request, result) in enumerate(zip(requests, results, strict=True)):
        got = bytes(request.buffers[0])
        expected = payload(i) if result.hit else bytes(PAGE_BYTES)
        wrong += sum(a != b for a, b in zip(got, expected, strict=True))
    return [r.outcome for r in results], wrong


# ---------------------------------------------------------------- determinism


def _run(seed: int) -> tuple[list[object], dict[str, int]]:
    store = FaultInjectingBackend(
        MemoryBackend(),
        FaultSchedule(
            seed=seed,
            error_rate=0.1,
            partial_batch_rate=0.3,
            vanish_rate=0.1,
            bit_flip_rate=0.1,
            torn_write_rate=0.1,
        ),
    )
    seen: list[object] = []
    for batch in range(10):
        indices = range(batch * 4, batch * 4 + 4)
        try:
            seen.append([r.outcome for r in store.put_from(put_requests(indices))])
        except BackendIOError:
            seen.append("put raised")
        try:
            seen.append([r.outcome for r in store.get_into(get_requests(indices))])
        except BackendIOError:
            seen.append("get raised")
    return seen, store.fault_stats().by_kind


def test_the_same_seed_repeats_the_schedule_and_another_seed_does_not() -> None:
    first, stats = _run(1)
    assert _run(1) == (first, stats)
    assert sum(stats.values()) > 5
    assert _run(2)[0] != first


def test_decisions_do_not_depend_on_the_order_of_other_keys(memory: MemoryBackend) -> None:
    # Per-key faults are a function of the seed, the key and its own history.
    a = _wrap(memory, vanish_rate=0.5)
    a.put_from(put_requests(range(KEYS)))
    forward = [r.outcome for r in a.get_into(get_requests(range(KEYS)))]
    b = _wrap(MemoryBackend(), vanish_rate=0.5)
    b.put_from(put_requests(range(KEYS)))
    backward = [r.outcome for r in b.get_into(get_requests(range(KEYS - 1, -1, -1)))]
    assert forward == backward[::-1]
    assert GetOutcome.MISS in forward
    assert GetOutcome.HIT in forward


# ---------------------------------------------------------------- each kind


def test_call_errors_raise_and_are_counted(memory: MemoryBackend) -> None:
    store = _wrap(memory, error_rate=1.0)
    with pytest.raises(BackendIOError, match="injected"):
        store.put_from(put_requests(range(2)))
    with pytest.raises(BackendIOError):
        store.get_into(get_requests(range(2)))
    with pytest.raises(BackendIOError):
        store.exists([key(0)])
    with pytest.raises(BackendIOError):
        store.delete([key(0)])
    assert store.fault_stats().by_kind == {"error": 4}
    assert store.fault_stats().calls == 4
    assert memory.exists([key(0), key(1)]) == [False, False]


def test_partial_batches_fail_some_keys_and_deliver_the_rest_correctly(
    memory: MemoryBackend,
) -> None:
    store = _wrap(memory, partial_batch_rate=1.0)
    written = store.put_from(put_requests(range(KEYS)))
    failed_puts = {r.key for r in written if r.outcome is PutOutcome.ERROR}
    assert 0 < len(failed_puts) < KEYS
    assert all(isinstance(r.error, BackendIOError) for r in written if not r.ok)
    assert memory.exists([key(i) for i in range(KEYS)]) == [
        key(i) not in failed_puts for i in range(KEYS)
    ]
    store.pause()
    store.put_from(put_requests(range(KEYS)))
    store.resume()
    outcomes, wrong = _read_all(store)
    assert wrong == 0  # failed keys' buffers are zeroed, hits are exact
    assert GetOutcome.ERROR in outcomes
    assert GetOutcome.HIT in outcomes
    present = store.exists([key(i) for i in range(KEYS)])
    assert not all(present)  # reported absent: a miss, never a false hit
    assert store.fault_stats().count(FaultKind.PARTIAL_BATCH) == 3


def test_latency_delays_and_timeouts_stall_then_raise(memory: MemoryBackend) -> None:
    slow = _wrap(memory, latency_rate=1.0, latency_s=0.05)
    start = time.monotonic()
    assert [r.ok for r in slow.put_from(put_requests(range(2)))] == [True, True]
    assert time.monotonic() - start >= 0.05
    stuck = _wrap(memory, timeout_rate=1.0, timeout_s=0.05)
    start = time.monotonic()
    with pytest.raises(OperationTimeoutError):
        stuck.get_into(get_requests(range(2)))
    assert time.monotonic() - start >= 0.05
    with pytest.raises(OperationTimeoutError):
        stuck.put_from(put_requests(range(2, 4)))
    assert memory.exists([key(2), key(3)]) == [True, True]  # landed; the answer was lost
    assert slow.fault_stats().by_kind == {"latency": 1}
    assert stuck.fault_stats().by_kind == {"timeout": 2}


def test_vanished_objects_are_misses_and_named_as_damaged(inner: Backend) -> None:
    store = _wrap(inner, vanish_rate=1.0)
    assert all(r.ok for r in store.put_from(put_requests(range(4))))
    assert store.exists([key(i) for i in range(4)]) == [True] * 4
    outcomes, wrong = _read_all(store, 4)
    assert outcomes == [GetOutcome.MISS] * 4
    assert wrong == 0
    assert store.damaged_keys() == {key(i) for i in range(4)}
    assert inner.exists([key(i) for i in range(4)]) == [False] * 4


def test_torn_writes_are_errors_and_read_back_as_corrupt(inner: Backend) -> None:
    store = _wrap(inner, torn_write_rate=1.0)
    written = store.put_from(put_requests(range(KEYS)))
    assert all(r.outcome is PutOutcome.ERROR for r in written)
    assert all("torn" in str(r.error) for r in written)
    outcomes, wrong = _read_all(inner)
    assert wrong == 0
    assert set(outcomes) <= {GetOutcome.CORRUPT, GetOutcome.MISS}
    assert GetOutcome.CORRUPT in outcomes
    assert store.fault_stats().by_kind == {"torn_write": KEYS}
    assert store.damaged_keys() == {key(i) for i in range(KEYS)}


def test_bit_flips_under_verification_are_corrupt_never_delivered(inner: Backend) -> None:
    store = _wrap(inner, bit_flip_rate=1.0)
    assert all(r.ok for r in store.put_from(put_requests(range(KEYS))))
    outcomes, wrong = _read_all(store)
    assert outcomes == [GetOutcome.CORRUPT] * KEYS
    assert wrong == 0
    assert inner.stats().corrupt == KEYS
    store.pause()
    outcomes, wrong = _read_all(store)  # quarantined or dropped: misses now
    assert set(outcomes) == {GetOutcome.MISS}
    assert store.fault_stats().by_kind == {"bit_flip": KEYS}


def test_paused_wrappers_pass_everything_through(memory: MemoryBackend) -> None:
    store = _wrap(memory, error_rate=1.0, bit_flip_rate=1.0)
    store.pause()
    assert all(r.ok for r in store.put_from(put_requests(range(KEYS))))
    outcomes, wrong = _read_all(store)
    assert (outcomes, wrong) == ([GetOutcome.HIT] * KEYS, 0)
    assert store.fault_stats().total == 0
    store.resume()
    with pytest.raises(BackendIOError):
        store.exists([key(0)])


# ---------------------------------------------------------------- declared, configured


def test_media_faults_are_declared_per_backend(memory: MemoryBackend) -> None:
    assert _wrap(memory).media_faults == MEDIA_FAULTS
    protocol_only = _wrap(_wrap(memory))  # no medium for a wrapper: protocol faults only
    assert protocol_only.media_faults == frozenset()
    with pytest.raises(ConfigError, match="media faults"):
        _wrap(_wrap(memory), bit_flip_rate=0.1)
    assert not _wrap(memory).capabilities.registers_memory
    assert memory.capabilities.scannable
    assert not _wrap(memory).capabilities.scannable  # fsck checks the inner backend


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"error_rate": 1.5}, "error_rate"),
        ({"bit_flip_rate": -0.1}, "bit_flip_rate"),
        ({"latency_s": 61.0}, "latency_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"seed": -1}, "seed"),
        ({"vanish_rate": True}, "vanish_rate"),
    ],
)
def test_bad_schedules_are_config_errors(options: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        FaultSchedule(**options)  # type: ignore[arg-type]


def test_the_faulty_registry_entry_wraps_a_backend_by_name(tmp_path: Path) -> None:
    options = {
        "inner": "file",
        "inner_options": {"root": str(tmp_path / "s")},
        "seed": 3,
        "error_rate": 0.25,
        "bit_flip_rate": 0.5,
    }
    store = create_backend("faulty", options)
    try:
        assert isinstance(store, FaultInjectingBackend)
        assert isinstance(store.inner, FileBackend)
        assert store.schedule == FaultSchedule(seed=3, error_rate=0.25, bit_flip_rate=0.5)
        assert store.capabilities.durable
    finally:
        store.close()
    with pytest.raises(ConfigError, match="not a known backend"):
        create_backend("faulty", {"inner": "nope"})
    with pytest.raises(ConfigError, match="inner"):
        create_backend("faulty", {"error_rate": 0.1})
    with pytest.raises(ConfigError, match="inner_options"):
        FaultyBackendConfig(inner="memory", inner_options=[1, 2])
    with pytest.raises(ConfigError, match="capacity_bytes"):
        create_backend("faulty", {"inner": "memory", "inner_options": {"capacity_bytes": 0}})
