"""One completion model for both pipelines: the owner collects, handles only observe.

- Device<->host: a transfer's host pages stay pinned until the pipeline's ``poll()``,
  ``drain()`` or ``close()`` collects it; each of those returns the results of what it
  collected, each transfer exactly once. ``done()``, ``state``, ``error`` and ``wait()``
  on the handle change nothing. A failed copy is reported on its own handle and result and
  raised by no call.
- Host<->storage: ``completions()`` reports each terminal handle once; querying or
  waiting on a handle changes nothing; a failed operation is on its own handle.

On CPU a device transfer has finished when ``offload()`` / ``load()`` returns. A transfer
still in flight is held there by a named fake of ``torch.cuda.Event`` (no CUDA on these
machines), on a :class:`TransferLedger` of its own: the pipeline's ``poll()`` and
``drain()`` are that ledger's ``collect()``.
"""

from __future__ import annotations

import pytest
import torch
from support.pagestores import WAIT_S, FaultyPageStore, GatedPageStore, get_requests, put_requests

from sglang_storage.errors import StateError, StorageError
from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    MemoryFacts,
)
from sglang_storage.transfer.device import (
    CopyDirection,
    DeviceHostPipeline,
    DeviceTransferState,
)
from sglang_storage.transfer.device_handles import (
    DeviceTransferHandle,
    TransferEvents,
    TransferLedger,
)
from sglang_storage.transfer.device_kv import DeviceKV
from sglang_storage.transfer.handles import OpState
from sglang_storage.transfer.io import CopyPlan, IOBackend, TorchIOBackend
from sglang_storage.transfer.pipeline import StoragePipeline, StoragePipelineConfig

PAGES = 8
GEOMETRY = KVGeometry(
    attention=Attention.MHA,
    layout=KVLayout.PAGE_FIRST,
    dtype=torch.bfloat16,
    layer_num=2,
    page_size=4,
    num_pages=PAGES,
    head_num=2,
    head_dim=8,
)
PAGE_BYTES = GEOMETRY.page_bytes


def tokens_of(pages: list[int]) -> list[int]:
    ps = GEOMETRY.page_size
    return [p * ps + i for p in pages for i in range(ps)]


def pinned_pages(host: KVHostPool) -> int:
    return host.stats().pinned_bytes // PAGE_BYTES


@pytest.fixture
def host() -> KVHostPool:
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    memory = HostMemory(HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0), facts=facts))
    pool = KVHostPool(GEOMETRY, memory)
    pool.alloc(PAGES)
    return pool


@pytest.fixture
def device() -> DeviceKV:
    return DeviceKV.allocate(GEOMETRY, PAGES * GEOMETRY.page_size, "cpu")


class FailingOffloads(IOBackend):
    """The torch backend, except that every offload fails as torch fails (RuntimeError)."""

    def __init__(self, inner: IOBackend) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return "failing-offloads"

    def plan(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> CopyPlan:
        return _FailingOffloadPlan(self.inner.plan(host_pages, device_pages))


class _FailingOffloadPlan(CopyPlan):
    def __init__(self, inner: CopyPlan) -> None:
        self.inner = inner

    def offload(self) -> None:
        raise RuntimeError("injected offload failure")

    def load_layer(self, layer: int) -> None:
        self.inner.load_layer(layer)


# ---------------------------------------------------------------------- device<->host, CPU


def test_querying_a_finished_transfer_leaves_its_pages_pinned_until_poll(
    host: KVHostPool, device: DeviceKV
) -> None:
    with DeviceHostPipeline(device, host) as pipe:
        handle = pipe.offload([1, 2], tokens_of([0, 3]))
        for _ in range(3):  # however often it is asked
            assert handle.done()
            assert handle.state is DeviceTransferState.DONE
            assert handle.wait().ok
            assert "done" in repr(handle)
        assert pinned_pages(host) == 2
        assert pipe.in_flight == 1
        assert handle.error is None
        assert pipe.metrics().offload.transfers == 0
        with pytest.raises(StateError, match="pinned"):
            host.free([1])  # the owner has not collected the transfer yet
        assert pipe.poll() == [handle.wait()]
        assert pinned_pages(host) == 0
        assert pipe.in_flight == 0
        assert pipe.metrics().offload.transfers == 1
        host.free([1, 2])


def test_poll_returns_every_result_once_whether_or_not_its_handle_was_waited_on(
    host: KVHostPool, device: DeviceKV
) -> None:
    with DeviceHostPipeline(device, host) as pipe:
        first = pipe.offload([0], tokens_of([0]))
        second = pipe.load([1], tokens_of([1]))
        waited = second.wait()
        third = pipe.offload([2], tokens_of([2]))
        polled = pipe.poll()
        assert [r.transfer_id for r in polled] == [
            first.transfer_id,
            second.transfer_id,
            third.transfer_id,
        ]
        assert polled[1] == waited
        assert pipe.poll() == []
        assert pipe.drain() == []
        # A collected handle still answers, with the same value.
        assert second.wait() == waited
        assert second.state is DeviceTransferState.DONE


def test_close_collects_everything_it_has_not_returned_yet(
    host: KVHostPool, device: DeviceKV
) -> None:
    pipe = DeviceHostPipeline(device, host)
    polled = pipe.offload([0], tokens_of([0]))
    assert [r.transfer_id for r in pipe.poll()] == [polled.transfer_id]
    later = [pipe.offload([3], tokens_of([1])), pipe.load([4, 5], tokens_of([6, 7]))]
    later[0].wait()
    assert [r.transfer_id for r in pipe.close()] == [h.transfer_id for h in later]
    assert pinned_pages(host) == 0
    assert pipe.close() == []
    host.close()  # refused while any page is pinned


def test_a_failed_copy_is_on_its_own_handle_and_raised_by_no_call(
    host: KVHostPool, device: DeviceKV
) -> None:
    pipe = DeviceHostPipeline(
        device, host, io_backend=FailingOffloads(TorchIOBackend(device, host))
    )
    with pipe:
        bad = pipe.offload([3], tokens_of([2]))  # the failure is not raised here
        good = pipe.load([1], tokens_of([5]))
        assert bad.state is DeviceTransferState.FAILED
        assert isinstance(bad.error, StorageError)
        assert isinstance(bad.error.__cause__, RuntimeError)
        assert good.state is DeviceTransferState.DONE
        assert good.error is None
        host.free([6])  # an unrelated page is freed as ever
        results = pipe.poll()  # reports, does not raise
        assert [(r.transfer_id, r.state) for r in results] == [
            (bad.transfer_id, DeviceTransferState.FAILED),
            (good.transfer_id, DeviceTransferState.DONE),
        ]
        assert results[0].error is bad.error
        assert results[0] == bad.wait()
        host.free([3, 1])  # collected, failed or not: nothing pins them
        assert pipe.metrics().offload.failed == 1
        assert pipe.close() == []


# ---------------------------------------------------------------------- in flight (fake CUDA)


class FakeCudaEvent:
    """A fake of ``torch.cuda.Event`` (no CUDA here): complete when the test says so."""

    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True

    def elapsed_time(self, other: FakeCudaEvent) -> float:
        return 2.0


def in_flight(
    host: KVHostPool,
    pipe: DeviceHostPipeline,
    ledger: TransferLedger,
    pages: list[int],
    transfer_id: int,
    error: StorageError | None = None,
) -> tuple[DeviceTransferHandle, FakeCudaEvent]:
    index = torch.tensor(pages, dtype=torch.int64)
    host.pin(index)  # as the pipeline does at submission
    finish = FakeCudaEvent()
    events = TransferEvents(start=FakeCudaEvent(), finish=finish, layers=())  # type: ignore[arg-type]
    handle = DeviceTransferHandle(
        pipeline=pipe,
        ledger=ledger,
        transfer_id=transfer_id,
        direction=CopyDirection.OFFLOAD,
        host_pages=index,
        nbytes=len(pages) * PAGE_BYTES,
        events=events,
        plan=None,
        error=error,
        wall_s=0.0,
    )
    return handle, finish


def state_of(handle: DeviceTransferHandle) -> DeviceTransferState:
    return handle.state  # read through a call: the state changes between two reads


def error_of(handle: DeviceTransferHandle) -> StorageError | None:
    return handle.error  # likewise


def test_a_transfer_is_collected_once_after_it_finishes_never_by_a_query(
    host: KVHostPool, device: DeviceKV
) -> None:
    ledger = TransferLedger(host)
    with DeviceHostPipeline(device, host) as pipe:
        handle, finish = in_flight(host, pipe, ledger, [4, 5], 1)
        assert not handle.done()
        assert state_of(handle) is DeviceTransferState.IN_FLIGHT
        assert "in_flight" in repr(handle)
        finish.complete = True
        assert handle.done()
        assert handle.state is DeviceTransferState.DONE
        assert pinned_pages(host) == 2  # seen finished, still pinned
        assert ledger.metrics().offload.transfers == 0
        assert ledger.in_flight() == [handle]
        [result] = ledger.collect()
        assert (result.transfer_id, result.latency_s) == (1, 0.002)
        assert pinned_pages(host) == 0
        assert ledger.metrics().offload.transfers == 1
        assert ledger.collect() == []


def test_draining_waits_for_transfers_in_flight(host: KVHostPool, device: DeviceKV) -> None:
    ledger = TransferLedger(host)
    with DeviceHostPipeline(device, host) as pipe:
        first, _ = in_flight(host, pipe, ledger, [0], 1)
        second, _ = in_flight(host, pipe, ledger, [1], 2)
        assert ledger.collect() == []  # not finished: nothing to collect
        assert pinned_pages(host) == 2
        assert [r.transfer_id for r in ledger.collect(block=True)] == [1, 2]
        assert first.done()
        assert second.done()
        assert pinned_pages(host) == 0
        assert ledger.in_flight() == []


def test_a_failed_cuda_copy_is_failed_on_its_handle_when_its_event_fires(
    host: KVHostPool, device: DeviceKV
) -> None:
    ledger = TransferLedger(host)
    failure = StorageError("injected: the copy could not be enqueued")
    with DeviceHostPipeline(device, host) as pipe:
        handle, finish = in_flight(host, pipe, ledger, [2], 1, error=failure)
        assert state_of(handle) is DeviceTransferState.IN_FLIGHT  # partial copies still run
        assert error_of(handle) is None
        assert ledger.collect() == []
        finish.complete = True
        assert handle.state is DeviceTransferState.FAILED
        assert handle.error is failure
        [result] = ledger.collect()  # reported, not raised
        assert (result.state, result.error) == (DeviceTransferState.FAILED, failure)
        assert pinned_pages(host) == 0
        assert ledger.metrics().offload.failed == 1


# ---------------------------------------------------------------------- host<->storage


def test_querying_a_storage_handle_changes_nothing() -> None:
    store = GatedPageStore()
    config = StoragePipelineConfig(workers=1)
    with StoragePipeline(store, config) as pipeline, store.released_on_exit():
        handle = pipeline.submit_put(put_requests([0, 1]))
        assert store.wait_entered(1)
        for _ in range(3):
            assert handle.state is OpState.RUNNING
            assert not handle.done()
            assert not handle.wait(0)
            assert (handle.error, handle.latency_s) == (None, None)
        assert pipeline.completions() == []
        store.gate.set()
        assert handle.wait(WAIT_S)
        for _ in range(3):
            assert handle.state is OpState.DONE
            assert handle.done()
            assert [r.ok for r in handle.result()] == [True, True]
            assert handle.partial() == handle.result()
        assert pipeline.completions() == [handle]  # waited on and read: reported once all the same
        assert pipeline.completions() == []
        assert handle.state is OpState.DONE


def test_a_failed_storage_operation_is_on_its_own_handle_and_raised_by_no_call() -> None:
    store = FaultyPageStore()
    store.raise_next = [StorageError("injected backend failure"), None]
    config = StoragePipelineConfig(workers=1, merge_ops=False)
    with StoragePipeline(store, config) as pipeline:
        bad = pipeline.submit_put(put_requests([0]))
        good = pipeline.submit_get(get_requests([5]))
        assert bad.wait(WAIT_S)
        assert good.wait(WAIT_S)
        assert bad.state is OpState.FAILED
        assert isinstance(bad.error, StorageError)
        assert "injected" in str(bad.error)
        assert good.state is OpState.DONE
        assert pipeline.completions() == [bad, good]  # reports, does not raise
        assert [r.hit for r in good.result()] == [False]
        with pytest.raises(StorageError, match="injected"):
            bad.result()  # its own handle raises it when asked for results
