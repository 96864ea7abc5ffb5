"""Which in-flight transfers a new one must wait for: the other direction, on shared host pages.

On CUDA an offload and a load run on different streams, so a load of a host page that an
offload still writes must start after it (and the reverse). The pipeline asks its ledger
for those transfers (``TransferLedger.crossing``) and makes its stream wait for each. That
choice is plain bookkeeping and is tested here on CPU, with handles held in flight by a
named fake of ``torch.cuda.Event`` (no CUDA runs on these machines); the stream waits
themselves are checked on a GPU by ``tests/gpu/test_transfer_matrix.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    Pinning,
)
from sglang_storage.transfer.device import CopyDirection, DeviceHostPipeline
from sglang_storage.transfer.device_handles import (
    DeviceTransferHandle,
    TransferEvents,
    TransferLedger,
)
from sglang_storage.transfer.device_kv import DeviceKV

OFFLOAD, LOAD = CopyDirection.OFFLOAD, CopyDirection.LOAD


class FakeCudaEvent:
    """A fake of ``torch.cuda.Event`` (no CUDA here): complete when the test says so."""

    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True

    def elapsed_time(self, other: FakeCudaEvent) -> float:
        return 0.0


@pytest.fixture
def parts() -> Iterator[tuple[KVHostPool, DeviceHostPipeline, TransferLedger]]:
    g = KVGeometry(
        attention=Attention.MHA,
        layout=KVLayout.PAGE_FIRST,
        dtype=torch.bfloat16,
        layer_num=2,
        page_size=4,
        num_pages=12,
        head_num=2,
        head_dim=8,
    )
    memory = HostMemory(
        HostMemoryBudget(BudgetConfig(total=16 << 20, headroom=0)), pinning=Pinning.NEVER
    )
    host = KVHostPool(g, memory)
    host.alloc(12)
    ledger = TransferLedger(host)
    with DeviceHostPipeline(DeviceKV.allocate(g, 12 * 4, "cpu"), host) as pipe:
        yield host, pipe, ledger
    ledger.collect(block=True)  # the fake events complete; the ledger unpins the pages
    host.close()


def in_flight(
    parts: tuple[KVHostPool, DeviceHostPipeline, TransferLedger],
    direction: CopyDirection,
    pages: list[int],
    transfer_id: int,
) -> tuple[DeviceTransferHandle, FakeCudaEvent]:
    host, pipe, ledger = parts
    index = torch.tensor(pages, dtype=torch.int64)
    host.pin(index)  # as the pipeline does at submission; the ledger unpins at the end
    finish = FakeCudaEvent()
    events = TransferEvents(start=FakeCudaEvent(), finish=finish, layers=())  # type: ignore[arg-type]
    handle = DeviceTransferHandle(
        pipeline=pipe,
        ledger=ledger,
        transfer_id=transfer_id,
        direction=direction,
        host_pages=index,
        nbytes=0,
        events=events,
        plan=None,
        error=None,
        wall_s=0.0,
    )
    return handle, finish


def ids(handles: list[DeviceTransferHandle]) -> list[int]:
    return [h.transfer_id for h in handles]


def test_only_the_other_direction_on_shared_pages_is_waited_for(
    parts: tuple[KVHostPool, DeviceHostPipeline, TransferLedger],
) -> None:
    ledger = parts[2]
    in_flight(parts, OFFLOAD, [1, 2], 1)
    in_flight(parts, LOAD, [5], 2)
    in_flight(parts, OFFLOAD, [2, 7], 3)
    pages = torch.tensor
    assert ids(ledger.crossing(LOAD, pages([2, 3]))) == [1, 3]  # both offloads write page 2
    assert ids(ledger.crossing(LOAD, pages([7]))) == [3]
    assert ids(ledger.crossing(LOAD, pages([5]))) == []  # same direction: same stream, ordered
    assert ids(ledger.crossing(OFFLOAD, pages([9, 5]))) == [2]  # an offload over a page being read
    assert ids(ledger.crossing(OFFLOAD, pages([1, 2]))) == []
    assert ids(ledger.crossing(LOAD, pages([0, 4, 11]))) == []  # disjoint pages


def test_a_finished_transfer_is_no_longer_waited_for(
    parts: tuple[KVHostPool, DeviceHostPipeline, TransferLedger],
) -> None:
    host, _, ledger = parts
    handle, finish = in_flight(parts, OFFLOAD, [4], 1)
    assert ids(ledger.crossing(LOAD, torch.tensor([4]))) == [1]
    assert host.stats().pinned_bytes == host.geometry.page_bytes
    finish.complete = True
    assert handle.done()
    assert ledger.crossing(LOAD, torch.tensor([4])) == []
    assert host.stats().pinned_bytes == host.geometry.page_bytes  # until collected
    assert [r.transfer_id for r in ledger.collect()] == [1]
    assert host.stats().pinned_bytes == 0
