"""The host<->storage pipeline's wake-ups: waiters on a handle, a waiting ``completions()``,
idle workers, and ``close()`` waking each of them.

The pipeline wakes each waiting thread through a lock of its own (a handle's gate, a
completions waiter, an idle worker), released after the pipeline's lock where it can;
these tests hold the workers in :class:`GatedPageStore` and check that every kind of
waiter wakes, times out and is woken by ``close()`` as the contract says. Every wait is
bounded by ``WAIT_S``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.pagestores import WAIT_S, DictPageStore, GatedPageStore, key

from sglang_storage.transfer.handles import OpState
from sglang_storage.transfer.pipeline import (
    THREAD_NAME_PREFIX,
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
