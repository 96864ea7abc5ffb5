"""Captured rows move between a capturer's page-locked mirror and the side pool on CUDA.

Marked ``gpu``: skipped with a reason where CUDA is absent. No SGLang here: the mirror is
page-locked host memory as SGLang's capturers make it (``cudaHostRegister`` with flags 0)
or as our records pool makes it, and the copies run through their device views on the
current stream, without the host waiting. The SGLang-driven CPU twin is
``tests/integration/test_sglang_capture_rows.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from sglang_storage_adapters.capture_rows import CaptureRows
from support.gpu_kv import host_memory

from sglang_storage.memory import (
    Pinning,
    RecordPool,
    RecordPoolConfig,
)

pytestmark = pytest.mark.gpu

PAGE, LAYERS, TOPK, SLOTS, HOST_PAGES = 4, 5, 8, 64, 12
SLEEP_CYCLES = 50_000_000  # about 25 ms at 2 GHz


@pytest.fixture(params=["sglang-registered", "records-pool"])
def mirror(request: pytest.FixtureRequest) -> Iterator[torch.Tensor]:
    """A capturer's host mirror ``[slots, layers, top_k]`` int32, random, page-locked."""
    g = torch.Generator().manual_seed(5)
    values = torch.randint(0, 1 << 20, (SLOTS, LAYERS, TOPK), generator=g, dtype=torch.int32)
    if request.param == "records-pool":
        pool = RecordPool(
            RecordPoolConfig(shape=(LAYERS, TOPK), dtype=torch.int32, capacity=SLOTS),
            host_memory(64 << 20),
        )
        pool.alloc(SLOTS)
        pool.records.copy_(values)
        yield pool.records
        pool.close()
        return
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    tensor = values.clone()
    assert int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * 4, 0)) == 0
    yield tensor
    assert int(cudart.cudaHostUnregister(tensor.data_ptr())) == 0


def tokens(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)], device="cuda")


def test_rows_are_saved_and_restored_on_the_stream_without_the_host_waiting(
    mirror: torch.Tensor,
) -> None:
    rows = CaptureRows(
        "routed_experts",
        mirror,
        page_size=PAGE,
        host_pages=HOST_PAGES,
        memory=host_memory(64 << 20),
    )
    original = mirror.clone()
    host_pages = torch.tensor([3, 0])
    written, restored = tokens([5, 2]), tokens([7, 9])
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        # Warm: the first launch of a kernel can wait for the whole device.
        rows.save(torch.tensor([11]), tokens([15]))
        rows.restore(torch.tensor([11]), tokens([15]))
    stream.synchronize()

    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        rows.save(host_pages, written)
    assert not stream.query()  # queued behind the sleep: the host did not wait
    stream.synchronize()
    want = original[written.cpu()].view(2, PAGE, LAYERS, TOPK)
    assert torch.equal(rows.pool.records[host_pages], want)

    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        rows.restore(host_pages, restored)
    assert not stream.query()
    assert torch.equal(mirror[restored.cpu()], original[restored.cpu()])  # not yet
    stream.synchronize()
    assert torch.equal(mirror[restored.cpu()], original[written.cpu()])
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[restored.cpu()] = False
    assert torch.equal(mirror[untouched], original[untouched])  # nothing else written
    rows.close()


def test_a_side_pool_that_is_not_page_locked_still_gets_the_rows(mirror: torch.Tensor) -> None:
    pageable = host_memory(64 << 20, Pinning.NEVER)
    rows = CaptureRows(
        "indexer_topk", mirror, page_size=PAGE, host_pages=HOST_PAGES, memory=pageable
    )
    assert not rows.pool.page_locked
    original = mirror.clone()
    host_pages = torch.tensor([4, 1])
    written, restored = tokens([3, 6]), tokens([10, 12])
    rows.save(host_pages, written)  # the host waits for the device indices
    assert torch.equal(
        rows.pool.records[host_pages], original[written.cpu()].view(2, PAGE, LAYERS, TOPK)
    )
    rows.restore(host_pages, restored)
    assert torch.equal(mirror[restored.cpu()], original[written.cpu()])
    rows.close()
