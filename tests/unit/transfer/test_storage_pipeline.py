"""The host<->storage pipeline: results, handle states, ordering, batching, cancellation,
deadlines, configuration, and the wake-ups of waiting threads.

Stores are the dict-backed :class:`DictPageStore` (real bytes) and the test doubles of
``support.pagestores``: :class:`GatedPageStore` holds the workers on an Event so a test
decides when calls proceed, and :class:`FakeClock` moves time for deadlines. Every wait is
bounded by ``WAIT_S``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.pagestores import (
    PAGE_BYTES,
    WAIT_S,
    DictPageStore,
    FakeClock,
    GatedPageStore,
    get_requests,
    key,
    payload,
    put_requests,
)

from sglang_storage.config import build_config
from sglang_storage.core import GetOutcome, PutOutcome
from sglang_storage.errors import (
    ConfigError,
    OperationCancelledError,
    OperationTimeoutError,
    StateError,
)
from sglang_storage.transfer.handles import OpKind, OpState, Priority
from sglang_storage.transfer.pipeline import (
    THREAD_NAME_PREFIX,
    BackpressureMode,
    StoragePipeline,
    StoragePipelineConfig,
)


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leaked = [
        t for t in set(threading.enumerate()) - before if t.name.startswith(THREAD_NAME_PREFIX)
    ]
    assert not leaked, f"pipeline threads left running: {leaked}"


def one_worker(**options: Any) -> StoragePipelineConfig:
    return StoragePipelineConfig(workers=1, **options)


# ------------------------------------------------------------------ results


def test_put_get_exists_round_trip_bytes_in_order() -> None:
    store = DictPageStore()
    with StoragePipeline(store, StoragePipelineConfig(workers=2, batch_pages=8)) as pipeline:
        put = pipeline.submit_put(put_requests(range(50)))
        assert [r.outcome for r in put.result(WAIT_S)] == [PutOutcome.STORED] * 50
        requests = get_requests(range(55))
        got = pipeline.submit_get(requests).result(WAIT_S)
        assert [r.key for r in got] == [r.key for r in requests]
        assert [r.outcome for r in got] == [GetOutcome.HIT] * 50 + [GetOutcome.MISS] * 5
        for index, request in enumerate(requests[:50]):
            assert bytes(request.buffers[0]) == payload(index)
        assert bytes(requests[50].buffers[0]) == bytes(PAGE_BYTES)
        present = pipeline.submit_exists([key(i) for i in range(48, 53)]).result(WAIT_S)
        assert present == [True, True, False, False, False]
        again = pipeline.submit_put(put_requests([0])).result(WAIT_S)
        assert again[0].outcome is PutOutcome.PRESENT


def test_handle_reports_bytes_kind_and_latency() -> None:
    with StoragePipeline(DictPageStore()) as pipeline:
        put = pipeline.submit_put(put_requests(range(3)), priority=Priority.BACKGROUND)
        put.result(WAIT_S)
        assert (put.kind, put.priority, put.pages) == (OpKind.PUT, Priority.BACKGROUND, 3)
        assert put.nbytes == put.transferred_bytes == 3 * PAGE_BYTES
        assert put.latency_s is not None
        assert put.latency_s >= 0
        assert put.error is None
        assert not put.late
        get = pipeline.submit_get(get_requests(range(5)))
        get.result(WAIT_S)
        assert (get.nbytes, get.transferred_bytes) == (5 * PAGE_BYTES, 3 * PAGE_BYTES)
        exists = pipeline.submit_exists([key(0)])
        exists.result(WAIT_S)
        assert exists.nbytes == exists.transferred_bytes == 0


def test_empty_submission_is_done_at_once() -> None:
    with StoragePipeline(GatedPageStore()) as pipeline:
        handle = pipeline.submit_get([])
        assert handle.state is OpState.DONE
        assert handle.result(0) == []
        assert pipeline.completions() == [handle]


def test_handle_states_pending_running_done() -> None:
    store = GatedPageStore()
    with StoragePipeline(store, one_worker()) as pipeline, store.released_on_exit():
        first = pipeline.submit_put(put_requests([0]))
        assert store.wait_entered(1)
        second = pipeline.submit_put(put_requests([1]))
        assert (first.state, second.state) == (OpState.RUNNING, OpState.PENDING)
        assert not first.done()
        assert not second.wait(0)
        assert first.latency_s is None
        with pytest.raises(OperationTimeoutError):
            second.result(timeout_s=0.01)
        with pytest.raises(StateError, match="still pending"):
            second.partial()
        store.gate.set()
        assert second.wait(WAIT_S)
        assert first.wait(WAIT_S)
        assert first.state is second.state is OpState.DONE
        assert second.partial() == second.result(0)
        assert "done" in repr(second)


# ------------------------------------------------------------------ ordering


def test_urgent_runs_before_normal_before_background_fifo_within_each() -> None:
    store = GatedPageStore()
    config = one_worker(merge_ops=False)
    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        pipeline.submit_exists([key(0)])  # holds the only worker
        assert store.wait_entered(1)
        submitted = [
            (Priority.BACKGROUND, "bg1"),
            (Priority.NORMAL, "n1"),
            (Priority.URGENT, "u1"),
            (Priority.BACKGROUND, "bg2"),
            (Priority.URGENT, "u2"),
            (Priority.NORMAL, "n2"),
        ]
        handles = [
            pipeline.submit_get(get_requests([0], prefix=name), priority=priority)
            for priority, name in submitted
        ]
        store.gate.set()
        assert all(h.wait(WAIT_S) for h in handles)
    order = [keys[0].name for _, keys in store.calls[1:]]
    assert order == ["u10", "u20", "n10", "n20", "bg10", "bg20"]


def test_urgent_work_overtakes_a_split_background_operation() -> None:
    store = GatedPageStore()
    with StoragePipeline(store, one_worker(batch_pages=2)) as pipeline, store.released_on_exit():
        background = pipeline.submit_put(put_requests(range(6)), priority=Priority.BACKGROUND)
        assert store.wait_entered(1)
        urgent = pipeline.submit_get(get_requests([0]), priority=Priority.URGENT)
        store.gate.set()
        assert background.wait(WAIT_S)
        assert urgent.wait(WAIT_S)
    assert [(method, len(keys)) for method, keys in store.calls] == [
        ("put_from", 2),
        ("get_into", 1),
        ("put_from", 2),
        ("put_from", 2),
    ]


# ------------------------------------------------------------------ batching


def test_large_operation_is_split_into_calls_of_batch_pages() -> None:
    store = DictPageStore()
    with StoragePipeline(store, one_worker(batch_pages=4)) as pipeline:
        pipeline.submit_put(put_requests(range(10))).result(WAIT_S)
        requests = get_requests(range(10))
        assert all(r.hit for r in pipeline.submit_get(requests).result(WAIT_S))
    assert store.call_sizes("put_from") == [4, 4, 2]
    assert store.call_sizes("get_into") == [4, 4, 2]
    assert all(bytes(r.buffers[0]) == payload(i) for i, r in enumerate(requests))


def test_split_operation_uses_several_workers_and_keeps_order() -> None:
    store = DictPageStore()
    with StoragePipeline(store, StoragePipelineConfig(workers=3, batch_pages=3)) as pipeline:
        pipeline.submit_put(put_requests(range(100))).result(WAIT_S)
        requests = get_requests(range(100))
        results = pipeline.submit_get(requests).result(WAIT_S)
    assert [r.key for r in results] == [r.key for r in requests]
    assert all(
        r.hit and bytes(q.buffers[0]) == payload(i)
        for i, (r, q) in enumerate(zip(results, requests, strict=True))
    )


def test_small_operations_of_one_kind_and_priority_share_a_call() -> None:
    store = GatedPageStore()
    with StoragePipeline(store, one_worker(batch_pages=8)) as pipeline, store.released_on_exit():
        pipeline.submit_exists([key(99)])
        assert store.wait_entered(1)
        puts = [pipeline.submit_put(put_requests(range(i, i + 2))) for i in (0, 2, 4)]
        get = pipeline.submit_get(get_requests([0, 1]))
        late_put = pipeline.submit_put(put_requests([6, 7]))
        background = pipeline.submit_put(put_requests([8]), priority=Priority.BACKGROUND)
        store.gate.set()
        for handle in (*puts, late_put, background):
            assert [r.outcome for r in handle.result(WAIT_S)] == [PutOutcome.STORED] * handle.pages
        assert all(r.hit for r in get.result(WAIT_S))
    assert [(method, len(keys)) for method, keys in store.calls] == [
        ("exists", 1),
        ("put_from", 6),
        ("get_into", 2),
        ("put_from", 2),
        ("put_from", 1),
    ]


def test_merging_fills_a_call_up_to_batch_pages_and_can_be_turned_off() -> None:
    for merge, expected in ((True, [1, 4, 2]), (False, [1, 3, 3])):
        store = GatedPageStore()
        config = one_worker(batch_pages=4, merge_ops=merge)
        with StoragePipeline(store, config) as pipeline, store.released_on_exit():
            pipeline.submit_put(put_requests([100]))
            assert store.wait_entered(1)
            first = pipeline.submit_put(put_requests(range(3)))
            second = pipeline.submit_put(put_requests(range(3, 6)))
            store.gate.set()
            assert first.wait(WAIT_S)
            assert second.wait(WAIT_S)
            assert first.state is second.state is OpState.DONE
        assert store.call_sizes() == expected, merge


# ------------------------------------------------------------------ cancellation


def test_cancelling_a_queued_operation_is_immediate_and_skips_the_backend() -> None:
    store = GatedPageStore()
    with StoragePipeline(store, one_worker()) as pipeline, store.released_on_exit():
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        queued = pipeline.submit_get(get_requests([1, 2]))
        assert queued.cancel()
        assert queued.state is OpState.CANCELLED
        assert queued.done()
        assert isinstance(queued.error, OperationCancelledError)
        with pytest.raises(OperationCancelledError, match="requested by the caller"):
            queued.result(0)
        assert [r.outcome for r in queued.partial()] == [GetOutcome.ERROR] * 2
        assert all(r.error is queued.error for r in queued.partial())
        assert not queued.cancel()
        store.gate.set()
    assert {key(1), key(2)}.isdisjoint(store.called_keys())


def test_cancelling_a_running_operation_finishes_the_current_call_then_stops() -> None:
    store = GatedPageStore()
    store.preload(put_requests(range(6)))
    with StoragePipeline(store, one_worker(batch_pages=2)) as pipeline, store.released_on_exit():
        requests = get_requests(range(6))
        handle = pipeline.submit_get(requests)
        assert store.wait_entered(1)
        assert handle.cancel()
        assert (handle.state, handle.done()) == (OpState.RUNNING, False)  # its call is in the store
        store.gate.set()
        assert handle.wait(WAIT_S)
        assert handle.state is OpState.CANCELLED
        outcomes = [r.outcome for r in handle.partial()]
        assert outcomes == [GetOutcome.HIT] * 2 + [GetOutcome.ERROR] * 4
        assert bytes(requests[1].buffers[0]) == payload(1)
        assert handle.transferred_bytes == 2 * PAGE_BYTES
    assert store.call_sizes() == [2]


def test_cancel_is_refused_when_no_call_is_left_to_skip() -> None:
    store = GatedPageStore()
    with StoragePipeline(store, one_worker()) as pipeline, store.released_on_exit():
        handle = pipeline.submit_put(put_requests(range(3)))
        assert store.wait_entered(1)
        assert not handle.cancel()  # its only call is running
        store.gate.set()
        assert handle.result(WAIT_S)[0].ok
        assert handle.state is OpState.DONE
        assert not handle.cancel()


# ------------------------------------------------------------------ deadlines


def test_operation_not_started_by_its_deadline_fails_without_a_backend_call() -> None:
    store, clock = GatedPageStore(), FakeClock()
    with (
        StoragePipeline(store, one_worker(), clock=clock) as pipeline,
        store.released_on_exit(),
    ):
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        handle = pipeline.submit_get(get_requests([1]), deadline_s=5.0)
        clock.advance(6.0)
        store.gate.set()
        assert handle.wait(WAIT_S)
        assert handle.state is OpState.FAILED
        assert isinstance(handle.error, OperationTimeoutError)
        assert handle.error.timeout_s == 5.0
        with pytest.raises(OperationTimeoutError, match="did not start in time"):
            handle.result(0)
        assert pipeline.metrics().get.timed_out == 1
    assert key(1) not in store.called_keys()


def test_expired_queued_operation_is_reported_while_workers_are_busy() -> None:
    store, clock = GatedPageStore(), FakeClock()
    with (
        StoragePipeline(store, one_worker(), clock=clock) as pipeline,
        store.released_on_exit(),
    ):
        blocker = pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        handle = pipeline.submit_put(put_requests([1]), deadline_s=1.0)
        clock.advance(2.0)
        assert pipeline.completions() == [handle]  # the worker is still held
        assert handle.state is OpState.FAILED
        assert not blocker.done()


def test_default_deadline_comes_from_the_config() -> None:
    store, clock = GatedPageStore(), FakeClock()
    config = one_worker(default_deadline_s=3.0)
    with StoragePipeline(store, config, clock=clock) as pipeline, store.released_on_exit():
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        handle = pipeline.submit_exists([key(1)])
        assert handle.deadline_s == 3.0
        clock.advance(3.0)
        store.gate.set()
        assert handle.wait(WAIT_S)
        assert isinstance(handle.error, OperationTimeoutError)


def test_operation_that_finishes_after_its_deadline_is_done_and_marked_late() -> None:
    store, clock = GatedPageStore(), FakeClock()
    store.preload(put_requests([0]))
    with (
        StoragePipeline(store, one_worker(), clock=clock) as pipeline,
        store.released_on_exit(),
    ):
        handle = pipeline.submit_get(get_requests([0]), deadline_s=5.0)
        assert store.wait_entered(1)
        clock.advance(10.0)
        store.gate.set()
        assert handle.result(WAIT_S)[0].hit
        assert handle.state is OpState.DONE
        assert handle.late
        assert handle.latency_s == pytest.approx(10.0)
        metrics = pipeline.metrics().get
        assert (metrics.done, metrics.late, metrics.timed_out) == (1, 1, 0)


def test_deadline_passing_between_calls_stops_the_operation_and_keeps_results() -> None:
    store, clock = GatedPageStore(), FakeClock()
    store.preload(put_requests(range(6)))
    config = one_worker(batch_pages=2)
    with StoragePipeline(store, config, clock=clock) as pipeline, store.released_on_exit():
        handle = pipeline.submit_get(get_requests(range(6)), deadline_s=5.0)
        assert store.wait_entered(1)
        clock.advance(10.0)
        store.gate.set()
        assert handle.wait(WAIT_S)
        assert handle.state is OpState.FAILED
        assert isinstance(handle.error, OperationTimeoutError)
        partial = handle.partial()
        assert [r.outcome for r in partial] == [GetOutcome.HIT] * 2 + [GetOutcome.ERROR] * 4
        assert partial[5].error is handle.error
    assert store.call_sizes() == [2]


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("workers", 0),
        ("workers", 65),
        ("workers", True),
        ("queue_depth", 0),
        ("batch_pages", 0),
        ("batch_pages", 1.5),
        ("merge_ops", 1),
        ("backpressure", "wait"),
        ("submit_timeout_s", 0),
        ("submit_timeout_s", float("inf")),
        ("default_deadline_s", 0.0),
        ("default_deadline_s", -1),
        ("close_timeout_s", -1.0),
        ("track_completions", None),
    ],
)
def test_bad_config_is_refused(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        StoragePipelineConfig(**{field: value})
    assert caught.value.owner == "StoragePipelineConfig"
    assert caught.value.field == field


def test_config_builds_from_a_mapping() -> None:
    config = build_config(
        StoragePipelineConfig,
        {"workers": 3, "backpressure": "wait", "submit_timeout_s": 2, "default_deadline_s": 5},
    )
    assert config.backpressure is BackpressureMode.WAIT
    assert (config.workers, config.submit_timeout_s, config.default_deadline_s) == (3, 2.0, 5.0)
    with pytest.raises(ConfigError, match="unknown option"):
        build_config(StoragePipelineConfig, {"threads": 2})


def test_bad_submission_arguments_are_refused() -> None:
    with StoragePipeline(DictPageStore()) as pipeline:
        with pytest.raises(ConfigError, match="must be a Priority"):
            pipeline.submit_exists([key(0)], priority=0)  # type: ignore[arg-type]
        for deadline in (0, -1.0, float("nan"), True):
            with pytest.raises(ConfigError) as caught:
                pipeline.submit_exists([key(0)], deadline_s=deadline)
            assert caught.value.field == "deadline_s"
        with pytest.raises(ConfigError) as caught:
            pipeline.submit_get([*get_requests([0]), key(1)])  # type: ignore[list-item]
        assert caught.value.field == "requests[1]"
        with pytest.raises(ConfigError):
            pipeline.submit_put(get_requests([0]))  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            StoragePipeline(DictPageStore(), {"workers": 1})  # type: ignore[arg-type]
        assert pipeline.metrics().exists.submitted == 0


def test_deadlines_still_expire_after_many_operations_finished_in_time() -> None:
    store, clock = GatedPageStore(), FakeClock()
    store.gate.set()
    with StoragePipeline(store, one_worker(), clock=clock) as pipeline:
        finished = [pipeline.submit_exists([key(i)], deadline_s=100.0) for i in range(300)]
        assert all(h.wait(WAIT_S) and h.state is OpState.DONE for h in finished)
        store.gate.clear()
        calls = len(store.calls)
        pipeline.submit_exists([key(0)])
        assert store.wait_entered(calls + 1)
        late = pipeline.submit_exists([key(1)], deadline_s=1.0)
        clock.advance(2.0)
        assert pipeline.completions()[-1] is late
        assert isinstance(late.error, OperationTimeoutError)
        store.gate.set()


# ------------------------------------------------------------------ concurrency


def test_concurrent_submitters_and_cancels_leave_every_handle_terminal() -> None:
    store = DictPageStore()
    config = StoragePipelineConfig(workers=3, batch_pages=3, queue_depth=10_000)
    handles: list[Any] = []
    lock = threading.Lock()

    def submitter(seed: int) -> None:
        rng = random.Random(seed)
        for n in range(60):
            priority = rng.choice(list(Priority))
            pages = range(seed * 1000 + n * 10, seed * 1000 + n * 10 + rng.randint(0, 7))
            kind = rng.choice(("put", "get", "exists"))
            if kind == "put":
                handle: Any = pipeline.submit_put(put_requests(pages), priority=priority)
            elif kind == "get":
                handle = pipeline.submit_get(get_requests(pages), priority=priority)
            else:
                handle = pipeline.submit_exists([key(i) for i in pages], priority=priority)
            if rng.random() < 0.2:
                handle.cancel()
            with lock:
                handles.append(handle)

    with StoragePipeline(store, config) as pipeline:
        threads = [threading.Thread(target=submitter, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert all(h.wait(WAIT_S) for h in handles)
        reported: list[Any] = []
        while len(reported) < len(handles):
            batch = pipeline.completions(timeout_s=WAIT_S)
            assert batch
            reported += batch
        metrics = pipeline.metrics()
    assert len(handles) == 240
    assert {id(h) for h in reported} == {id(h) for h in handles}
    for kind in (metrics.get, metrics.put, metrics.exists):
        assert kind.submitted == kind.done + kind.failed + kind.cancelled
        assert kind.queue_depth == 0
        assert kind.failed == 0
    for handle in handles:
        if handle.state is OpState.DONE:
            assert len(handle.result(0)) == handle.pages
        else:
            assert handle.state is OpState.CANCELLED
            assert len(handle.partial()) == handle.pages


# ---------------------------------------------------------------------- wake-ups
# The pipeline wakes each waiting thread through a lock of its own (a handle's gate, a
# completions() waiter, an idle worker), released after the pipeline's lock where it can:
# every kind of waiter must wake, time out and be woken by close() as the contract says.


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``target`` on a new thread; its return value lands in the list."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(target()), daemon=True)
    thread.start()
    return thread, out


def test_every_waiter_on_a_handle_wakes_when_it_finishes() -> None:
    store = GatedPageStore()
    config = StoragePipelineConfig(workers=1)
    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        handle = pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        waiters = [in_thread(lambda: handle.wait(WAIT_S)) for _ in range(3)]
        waiters += [in_thread(lambda: handle.result(WAIT_S))]
        waiters += [in_thread(lambda: handle.wait(None))]
        assert not handle.wait(0.01)  # times out while the call is held
        assert not handle.wait(0)
        assert not handle.wait(-1.0)
        store.gate.set()
        for thread, _ in waiters:
            thread.join(WAIT_S)
        assert [out for _, out in waiters] == [[True]] * 3 + [[[False]]] + [[True]]
        assert handle.wait(0)
        assert handle.wait(-1.0)
        assert handle.state is OpState.DONE


def test_a_wait_longer_than_the_platform_allows_still_waits() -> None:
    store = GatedPageStore()
    config = StoragePipelineConfig(workers=1)
    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        handle = pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        opener = threading.Timer(0.05, store.gate.set)
        opener.start()
        assert handle.wait(float("inf"))
        assert handle.result(1e300) == [False]
        opener.join()


def test_a_waiting_completions_wakes_on_a_completion() -> None:
    store = GatedPageStore()
    config = StoragePipelineConfig(workers=2)
    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        handle = pipeline.submit_exists([key(0)])
        assert store.wait_entered(1)
        started = time.monotonic()
        assert pipeline.completions(timeout_s=0.05) == []
        assert time.monotonic() - started >= 0.04
        opener = threading.Timer(0.05, store.gate.set)
        opener.start()
        assert pipeline.completions(timeout_s=WAIT_S) == [handle]
        opener.join()


def test_a_waiting_completions_without_timeout_wakes_on_close() -> None:
    pipeline = StoragePipeline(DictPageStore(), StoragePipelineConfig(workers=2))
    waiter, out = in_thread(lambda: pipeline.completions(timeout_s=None))
    time.sleep(0.05)
    assert waiter.is_alive()  # nothing submitted: it waits until the pipeline closes
    assert pipeline.close(timeout_s=WAIT_S).clean
    waiter.join(WAIT_S)
    assert out == [[]]


def test_idle_workers_serve_every_submission_and_all_stop_on_close() -> None:
    store = DictPageStore()
    pipeline = StoragePipeline(store, StoragePipelineConfig(workers=3, batch_pages=1))
    for round_ in range(20):
        keys = [key(i) for i in range(round_ % 5)]
        assert pipeline.submit_exists(keys).result(WAIT_S) == [False] * len(keys)
        if round_ % 4 == 0:
            time.sleep(0.005)  # let every worker go idle
    split = pipeline.submit_exists([key(i) for i in range(12)])  # wakes the other workers
    assert split.result(WAIT_S) == [False] * 12
    report = pipeline.close(timeout_s=WAIT_S)
    assert report.clean
    assert report.threads_alive == 0
