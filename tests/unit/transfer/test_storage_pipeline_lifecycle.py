"""The host<->storage pipeline under failure and load: failure isolation, back-pressure,
shutdown with work in flight, thread leaks, completions and metrics.

Stores are :class:`DictPageStore` (real bytes) and the test doubles of
``support.pagestores``: :class:`GatedPageStore` holds workers on an Event and
:class:`FaultyPageStore` raises or reports errors on demand. Every wait is bounded.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from support.pagestores import (
    PAGE_BYTES,
    WAIT_S,
    DictPageStore,
    FaultyPageStore,
    GatedPageStore,
    get_requests,
    key,
    put_requests,
)

from sglang_storage.core import GetOutcome, PutOutcome
from sglang_storage.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    OperationCancelledError,
    OperationTimeoutError,
    StateError,
    StorageError,
)
from sglang_storage.transfer.handles import ExistsHandle, OpState, Priority
from sglang_storage.transfer.metrics import LATENCY_BOUNDS_S, LatencyHistogram, LatencySnapshot
from sglang_storage.transfer.pipeline import (
    THREAD_NAME_PREFIX,
    BackpressureMode,
    StoragePipeline,
    StoragePipelineConfig,
)

_EARLIER: set[threading.Thread] = set()
"""Pipeline threads alive before the running test (another test's pipelines in this worker,
e.g. those of a process's storage runtime); only the test's own are counted."""


def pipeline_threads() -> list[threading.Thread]:
    """The running test's pipeline threads that are alive."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(THREAD_NAME_PREFIX) and t not in _EARLIER
    ]


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX))
    yield
    leaked = pipeline_threads()
    assert not leaked, f"pipeline threads left running: {leaked}"


def one_worker(**options: Any) -> StoragePipelineConfig:
    return StoragePipelineConfig(workers=1, **options)


# ------------------------------------------------------------------ failure isolation


def test_backend_storage_error_fails_the_operation_and_the_worker_serves_the_next() -> None:
    store = FaultyPageStore()
    cause = BackendUnavailableError(backend="faulty", reason="injected outage")
    store.raise_next = [cause]
    with StoragePipeline(store, one_worker()) as pipeline:
        failed = pipeline.submit_put(put_requests(range(3)))
        assert failed.wait(WAIT_S)
        assert failed.state is OpState.FAILED
        assert failed.error is cause
        with pytest.raises(BackendUnavailableError) as caught:
            failed.result(0)
        assert caught.value is cause
        assert [r.error for r in failed.partial()] == [cause] * 3
        assert all(r.ok for r in pipeline.submit_put(put_requests(range(3))).result(WAIT_S))
        metrics = pipeline.metrics().put
        assert (metrics.failed, metrics.done, metrics.backend_errors) == (1, 1, 1)
        assert len(pipeline_threads()) >= 1


def test_unexpected_exception_is_wrapped_logged_and_the_worker_lives_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FaultyPageStore()
    bug = RuntimeError("backend bug")
    store.raise_next = [bug]
    with (
        caplog.at_level(logging.ERROR, logger="sglang_storage.transfer.pipeline"),
        StoragePipeline(store, one_worker()) as pipeline,
    ):
        failed = pipeline.submit_exists([key(0)])
        assert failed.wait(WAIT_S)
        assert type(failed.error) is StorageError
        assert failed.error.__cause__ is bug
        assert "RuntimeError: backend bug" in str(failed.error)
        assert pipeline.submit_exists([key(0)]).result(WAIT_S) == [False]
    records = [r for r in caplog.records if r.exc_info and r.exc_info[1] is bug]
    assert records, "the unexpected exception was not logged with its traceback"


def test_per_key_errors_are_results_and_the_operation_is_done() -> None:
    store = FaultyPageStore()
    store.error_keys = {key(1)}
    with StoragePipeline(store, one_worker()) as pipeline:
        put = pipeline.submit_put(put_requests(range(3)))
        assert [r.outcome for r in put.result(WAIT_S)] == [
            PutOutcome.STORED,
            PutOutcome.ERROR,
            PutOutcome.STORED,
        ]
        store.error_keys = {key(2)}
        get = pipeline.submit_get(get_requests(range(3)))
        outcomes = [r.outcome for r in get.result(WAIT_S)]
        assert outcomes == [GetOutcome.HIT, GetOutcome.HIT, GetOutcome.ERROR]
        assert put.state is get.state is OpState.DONE
        metrics = pipeline.metrics()
        assert metrics.put.page_outcomes == {"stored": 2, "error": 1}
        assert metrics.get.page_outcomes == {"hit": 2, "error": 1}


def test_a_store_returning_too_few_results_fails_the_operation() -> None:
    store = FaultyPageStore()
    store.short_results = True
    with StoragePipeline(store, one_worker()) as pipeline:
        handle = pipeline.submit_get(get_requests(range(4)))
        assert handle.wait(WAIT_S)
        assert handle.state is OpState.FAILED
        assert "PageStore contract" in str(handle.error)
        store.short_results = False
        assert len(pipeline.submit_get(get_requests(range(4))).result(WAIT_S)) == 4


def test_a_failed_call_stops_the_rest_of_its_operation() -> None:
    store = FaultyPageStore()
    cause = StorageError("second call fails")
    store.raise_next = [None, cause]
    with StoragePipeline(store, one_worker(batch_pages=2)) as pipeline:
        handle = pipeline.submit_put(put_requests(range(6)))
        assert handle.wait(WAIT_S)
        assert handle.error is cause
        partial = handle.partial()
        assert [r.outcome for r in partial] == [PutOutcome.STORED] * 2 + [PutOutcome.ERROR] * 4
        assert pipeline.metrics().put.page_outcomes == {"stored": 2, "skipped": 4}
    assert store.call_sizes() == [2, 2]
    assert key(0) in store
    assert key(2) not in store


def test_a_failed_merged_call_fails_each_operation_in_it_only() -> None:
    store = FaultyPageStore()
    store.gate.clear()
    cause = StorageError("merged call fails")
    with (
        StoragePipeline(store, one_worker(batch_pages=8)) as pipeline,
        store.released_on_exit(),
    ):
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        store.raise_next = [None, cause]
        merged = [pipeline.submit_put(put_requests([i])) for i in (1, 2, 3)]
        other = pipeline.submit_get(get_requests([1]))
        store.gate.set()
        assert all(h.wait(WAIT_S) and h.error is cause for h in merged)
        assert other.result(WAIT_S)[0].outcome is GetOutcome.MISS
    assert store.call_sizes() == [1, 3, 1]


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt/SystemExit raised inside a backend call."""


def test_a_worker_killed_by_a_base_exception_fails_its_work_and_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    died: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    store = FaultyPageStore()
    store.gate.clear()
    store.raise_next = [Interrupt()]
    with StoragePipeline(store, one_worker()) as pipeline, store.released_on_exit():
        running = pipeline.submit_get(get_requests([0]))
        assert store.wait_entered(1)
        queued = pipeline.submit_get(get_requests([1]))
        store.gate.set()
        assert running.wait(WAIT_S)
        assert queued.wait(WAIT_S)
        assert "interrupted by Interrupt" in str(running.error)
        assert "no worker thread is left" in str(queued.error)
        with pytest.raises(StateError, match="no worker thread"):
            pipeline.submit_get(get_requests([2]))
    assert [type(args.exc_value) for args in died] == [Interrupt]


# ------------------------------------------------------------------ back-pressure


def test_reject_mode_raises_capacity_error_naming_the_queue_depth() -> None:
    store = GatedPageStore()
    with (
        StoragePipeline(store, one_worker(queue_depth=2)) as pipeline,
        store.released_on_exit(),
    ):
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)  # dispatched: no longer queued
        queued = [pipeline.submit_exists([key(i)]) for i in (1, 2)]
        started = time.monotonic()
        with pytest.raises(CapacityError) as caught:
            pipeline.submit_exists([key(3)])
        assert time.monotonic() - started < 1.0
        assert "queue_depth=2" in str(caught.value)
        assert "NORMAL" in caught.value.resource
        urgent = pipeline.submit_exists([key(4)], priority=Priority.URGENT)  # own queue
        metrics = pipeline.metrics()
        assert (metrics.exists.rejected, metrics.exists.queue_depth) == (1, 3)
        assert metrics.queued[Priority.NORMAL] == 2
        store.gate.set()
        assert all(h.wait(WAIT_S) for h in (*queued, urgent))


def test_wait_mode_times_out_with_operation_timeout_error() -> None:
    store = GatedPageStore()
    config = one_worker(queue_depth=1, backpressure=BackpressureMode.WAIT, submit_timeout_s=0.2)
    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        pipeline.submit_exists([key(1)])
        started = time.monotonic()
        with pytest.raises(OperationTimeoutError) as caught:
            pipeline.submit_exists([key(2)])
        assert 0.15 <= time.monotonic() - started < WAIT_S
        assert caught.value.timeout_s == 0.2
        assert "queue_depth=1" in str(caught.value)
        assert pipeline.metrics().exists.rejected == 1


def test_wait_mode_submission_proceeds_when_room_frees() -> None:
    store = GatedPageStore()
    config = one_worker(queue_depth=1, backpressure=BackpressureMode.WAIT, submit_timeout_s=WAIT_S)
    got: list[ExistsHandle] = []
    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        pipeline.submit_exists([key(1)])
        submitter = threading.Thread(target=lambda: got.append(pipeline.submit_exists([key(2)])))
        submitter.start()
        submitter.join(0.05)
        assert submitter.is_alive(), "the submission should wait for room"
        store.gate.set()
        submitter.join(WAIT_S)
        assert not submitter.is_alive()
        assert len(got) == 1
        assert got[0].result(WAIT_S) == [False]


def test_close_wakes_a_submission_waiting_for_room() -> None:
    store = GatedPageStore()
    config = one_worker(queue_depth=1, backpressure=BackpressureMode.WAIT, submit_timeout_s=WAIT_S)
    errors: list[BaseException] = []

    def submit(pipeline: StoragePipeline) -> None:
        try:
            pipeline.submit_exists([key(2)])
        except StateError as error:
            errors.append(error)

    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        pipeline.submit_exists([key(1)])
        submitter = threading.Thread(target=submit, args=(pipeline,))
        submitter.start()
        report = pipeline.close(drain=False, timeout_s=0.0)
        submitter.join(WAIT_S)
        assert len(errors) == 1
        assert "closed" in str(errors[0])
        assert len(report.cancelled) == 1


# ------------------------------------------------------------------ shutdown


def test_close_with_drain_finishes_queued_work() -> None:
    store = GatedPageStore()
    pipeline = StoragePipeline(store, StoragePipelineConfig(workers=2, batch_pages=2))
    with store.released_on_exit():
        handles = [pipeline.submit_put(put_requests(range(i, i + 3))) for i in range(0, 30, 3)]
        assert store.wait_entered(2)
        closer = threading.Thread(target=lambda: reports.append(pipeline.close(drain=True)))
        reports: list[Any] = []
        closer.start()
        store.gate.set()
        closer.join(WAIT_S)
    assert len(reports) == 1
    assert reports[0].clean
    assert reports[0].cancelled == ()
    assert all(h.state is OpState.DONE for h in handles)
    assert not pipeline_threads()
    with pytest.raises(StateError, match="closed"):
        pipeline.submit_put(put_requests([0]))


def test_close_without_drain_cancels_queued_work_at_once() -> None:
    store = GatedPageStore()
    store.preload(put_requests(range(4)))
    pipeline = StoragePipeline(store, one_worker(batch_pages=2))
    with store.released_on_exit():
        running = pipeline.submit_get(get_requests(range(4)))
        assert store.wait_entered(1)
        queued = [pipeline.submit_put(put_requests([i])) for i in (10, 11)]
        reports: list[Any] = []
        closer = threading.Thread(target=lambda: reports.append(pipeline.close(drain=False)))
        closer.start()
        assert all(h.wait(WAIT_S) for h in queued)  # while the worker is still held
        assert all(h.state is OpState.CANCELLED for h in queued)
        assert "without draining" in str(queued[0].error)
        assert not running.done()
        store.gate.set()
        closer.join(WAIT_S)
    (report,) = reports
    assert report.clean
    assert set(report.cancelled) == {running, *queued}
    assert running.state is OpState.CANCELLED
    assert [r.hit for r in running.partial()] == [True, True, False, False]
    assert not pipeline_threads()


def test_close_timeout_reports_stuck_calls_and_a_second_close_joins_them() -> None:
    store = GatedPageStore()
    pipeline = StoragePipeline(store, one_worker())
    with store.released_on_exit():
        stuck = pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        queued = pipeline.submit_exists([key(1)])
        report = pipeline.close(drain=True, timeout_s=0.2)
        assert report.cancelled == (queued,)
        assert report.unfinished == (stuck,)
        assert report.threads_alive == 1
        assert not report.clean
        assert isinstance(queued.error, OperationCancelledError)
        assert "did not drain within 0.2 s" in str(queued.error)
        store.gate.set()
        assert stuck.result(WAIT_S) == [False]
    again = pipeline.close(timeout_s=WAIT_S)
    assert again.clean
    assert again.cancelled == ()


def test_context_manager_drains_on_success_and_cancels_on_error() -> None:
    store = DictPageStore()
    with StoragePipeline(store) as pipeline:
        handles = [pipeline.submit_put(put_requests([i])) for i in range(20)]
    assert pipeline.closed
    assert all(h.state is OpState.DONE for h in handles)

    gated = GatedPageStore()
    queued: list[ExistsHandle] = []

    def fail_inside_the_block() -> None:
        with (
            gated.released_on_exit(),
            # Leaving the block cancels the queued op at once, then waits 0.2 s for the
            # held worker; the gate opens only after that (the outer context).
            StoragePipeline(gated, one_worker(close_timeout_s=0.2)) as pipeline,
        ):
            pipeline.submit_exists([key(0)])
            assert gated.wait_entered(1)
            queued.append(pipeline.submit_exists([key(1)]))
            raise KeyError("caller failed")

    with pytest.raises(KeyError):
        fail_inside_the_block()
    assert queued[0].state is OpState.CANCELLED
    for thread in pipeline_threads():
        thread.join(WAIT_S)  # the held worker, released when the block ended
    assert not pipeline_threads()


def test_threads_return_to_baseline_after_many_pipelines() -> None:
    baseline = {t for t in threading.enumerate() if t.is_alive()}
    for round_ in range(10):
        store = DictPageStore()
        pipeline = StoragePipeline(store, StoragePipelineConfig(workers=3, batch_pages=4))
        assert len(pipeline_threads()) == 3
        pipeline.submit_put(put_requests(range(10)))
        pipeline.submit_get(get_requests(range(10)), priority=Priority.URGENT)
        report = pipeline.close(drain=round_ % 2 == 0, timeout_s=WAIT_S)
        assert report.clean
    # Threads of other tests may end meanwhile; none of this test's may remain.
    assert set(threading.enumerate()) <= baseline


# ------------------------------------------------------------------ completions


def test_completions_report_each_handle_once_in_finish_order() -> None:
    store = GatedPageStore()
    with StoragePipeline(store, one_worker(merge_ops=False)) as pipeline, store.released_on_exit():
        first = pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        second = pipeline.submit_exists([key(1)], priority=Priority.BACKGROUND)
        third = pipeline.submit_exists([key(2)], priority=Priority.URGENT)
        assert pipeline.completions() == []
        store.gate.set()
        finished: list[Any] = []
        while len(finished) < 3:
            batch = pipeline.completions(timeout_s=WAIT_S)
            assert batch, "no completion arrived within the bound"
            finished += batch
        assert finished == [first, third, second]
        assert pipeline.completions() == []
    assert pipeline.completions(timeout_s=None) == []  # closed and idle: returns at once


def test_completions_can_be_turned_off() -> None:
    with StoragePipeline(DictPageStore(), StoragePipelineConfig(track_completions=False)) as p:
        p.submit_exists([key(0)]).result(WAIT_S)
        with pytest.raises(StateError, match="track_completions"):
            p.completions()


# ------------------------------------------------------------------ metrics


def test_metrics_count_operations_pages_bytes_calls_and_queue_depth() -> None:
    store = GatedPageStore()
    config = one_worker(batch_pages=4, merge_ops=False)
    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        pipeline.submit_exists([key(99)])
        assert store.wait_entered(1)
        puts = [pipeline.submit_put(put_requests(range(i, i + 5))) for i in (0, 5, 10)]
        assert pipeline.metrics().put.queue_depth == 3
        store.gate.set()
        assert all(h.wait(WAIT_S) for h in puts)
        pipeline.submit_get(get_requests(range(12, 18))).result(WAIT_S)
        metrics = pipeline.metrics()
    assert metrics.store == "gated"
    assert metrics.workers == 1
    assert metrics.in_flight == 0
    put = metrics.put
    assert (put.submitted, put.done, put.failed, put.cancelled, put.rejected) == (3, 3, 0, 0, 0)
    assert (put.pages, put.bytes, put.backend_calls) == (15, 15 * PAGE_BYTES, 6)
    assert (put.queue_depth, put.queue_depth_max) == (0, 3)
    assert put.latency.count == 3
    assert put.call_latency.count == 6
    get = metrics.get
    assert get.page_outcomes == {"hit": 3, "miss": 3}
    assert (get.pages, get.bytes, get.backend_calls) == (6, 3 * PAGE_BYTES, 2)
    assert metrics.exists.page_outcomes == {"absent": 1}
    p50, p99 = put.latency.p50_s, put.latency.p99_s
    assert p50 is not None
    assert p99 is not None
    assert put.latency.min_s <= p50 <= p99 <= put.latency.max_s
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        metrics.put = get  # type: ignore[misc]
    with pytest.raises(TypeError):
        put.page_outcomes["stored"] = 0  # type: ignore[index]
    assert metrics.of(put.kind) is put


def test_latency_buckets_are_log_spaced_from_1us_to_100s() -> None:
    assert LATENCY_BOUNDS_S[0] == pytest.approx(1e-6)
    assert LATENCY_BOUNDS_S[-1] == pytest.approx(100)
    ratios = {round(b / a, 9) for a, b in itertools.pairwise(LATENCY_BOUNDS_S)}
    assert ratios == {round(10**0.25, 9)}


def test_latency_quantiles_are_estimated_within_their_bucket() -> None:
    empty = LatencyHistogram().snapshot()
    assert empty == LatencySnapshot()
    assert empty.p50_s is None
    assert empty.mean_s is None
    histogram = LatencyHistogram()
    for _ in range(98):
        histogram.observe(0.001)
    histogram.observe(0.5)
    histogram.observe(2.0)
    histogram.observe(-1.0)  # clock skew counts as 0
    snapshot = histogram.snapshot()
    assert snapshot.count == 101
    assert sum(snapshot.counts) == 101
    assert (snapshot.min_s, snapshot.max_s) == (0.0, 2.0)
    p50 = snapshot.p50_s
    assert p50 is not None
    assert 0.001 / 10**0.25 <= p50 <= 0.001
    p99 = snapshot.p99_s
    assert p99 is not None
    assert 0.5 / 10**0.25 <= p99 <= 0.5 * 10**0.25
    assert snapshot.quantile(1.0) == 2.0
    assert snapshot.quantile(0.0) == 0.0
    assert snapshot.mean_s == pytest.approx((0.098 + 2.5) / 101)
    with pytest.raises(ValueError, match="quantile"):
        snapshot.quantile(1.5)
    histogram.observe(1e4)  # beyond the last bound: the overflow bucket
    assert histogram.snapshot().counts[-1] == 1
    assert histogram.snapshot().quantile(1.0) == 1e4


def test_close_rejects_a_bad_timeout() -> None:
    with StoragePipeline(DictPageStore()) as pipeline, pytest.raises(ConfigError):
        pipeline.close(timeout_s=-1)
