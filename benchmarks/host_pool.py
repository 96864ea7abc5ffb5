"""Our host pools against SGLang 0.5.23's, side by side in one process.

Run: ``.venv/bin/python benchmarks/host_pool.py`` (``--quick`` for a short run). Prints,
for each row, the median rate of ours and SGLang's over several repetitions and the ratio
ours/theirs (> 1 means ours is faster); progress (one line per group of rows, with the
time elapsed) goes to stderr. Rows:

- ``alloc+free N pages``: ``KVHostPool.alloc(N)`` + ``free`` vs ``HostKVCache.alloc(N *
  page_size)`` + ``free`` on the same geometry, after the pool has been churned so that
  SGLang's lazily merged free list is in its steady state.
- ``gather N pages, <layout>``: pages copied into one contiguous staging tensor, the way a
  storage backend reads a batch out of the pool: ours with ``read_pages`` (one vectorised
  gather), SGLang's with ``get_data_page(flat=True)`` per page, as its backends call it.
- ``embedding alloc/free``: our best-fit ``ExtentAllocator`` vs SGLang's first-fit
  ``RangePageAllocator`` on the same seeded workload of mixed sizes; also the mean number
  of runs per allocation (fragmentation; fewer is better).

This is a benchmark, not a test: machines are shared and noisy, so read the ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.sglang_pools import SGLangHostPool, build_sglang_host_pool  # noqa: E402

from sglang_storage.cli.bench_report import Progress  # noqa: E402
from sglang_storage.memory import (  # noqa: E402
    Attention,
    BudgetConfig,
    ExtentAllocator,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
)

LAYERS, PAGE_SIZE, HEADS, HEAD_DIM = 8, 16, 4, 64  # 128 KiB pages in bf16
NUM_PAGES = 2048


def _median_rate(run: Callable[[], int], repeats: int) -> float:
    """Median of ``repeats`` runs of (operations done / seconds taken), after one warm-up."""
    run()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        ops = run()
        rates.append(ops / (time.perf_counter() - start))
    return statistics.median(rates)


def _row(name: str, ours: float, theirs: float, unit: str) -> None:
    print(f"{name:<40} {ours:>14,.0f} {theirs:>14,.0f} {unit:<9} {ours / theirs:>7.2f}x")  # noqa: T201


def bench_alloc_free(memory: HostMemory, sizes: list[int], loops: int, repeats: int) -> None:
    """Rows ``alloc+free N pages``: page allocation round trips on a half-full pool."""
    geometry = KVGeometry(
        attention=Attention.MHA,
        layout=KVLayout.PAGE_FIRST,
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        head_num=HEADS,
        head_dim=HEAD_DIM,
    )
    theirs = build_sglang_host_pool(
        attention="mha",
        layout="page_first",
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        head_num=HEADS,
        head_dim=HEAD_DIM,
    )
    with KVHostPool(geometry, memory) as ours:
        for n in sizes:
            # Hold half the pool in scattered allocations, as a running server does.
            held_ours = [ours.alloc(1) for _ in range(NUM_PAGES // 2)]
            held_theirs = [theirs.alloc(PAGE_SIZE) for _ in range(NUM_PAGES // 2)]
            for index in range(0, len(held_ours), 2):
                ours.free(held_ours[index])
                theirs.free(held_theirs[index])  # type: ignore[arg-type]

            def run_ours(n: int = n) -> int:
                for _ in range(loops):
                    ours.free(ours.alloc(n))
                return loops

            def run_theirs(n: int = n) -> int:
                for _ in range(loops):
                    theirs.free(theirs.alloc(n * PAGE_SIZE))  # type: ignore[arg-type]
                return loops

            _row(
                f"alloc+free {n} pages",
                _median_rate(run_ours, repeats),
                _median_rate(run_theirs, repeats),
                "ops/s",
            )
            for index in range(1, len(held_ours), 2):
                ours.free(held_ours[index])
                theirs.free(held_theirs[index])  # type: ignore[arg-type]


def bench_gather(memory: HostMemory, sizes: list[int], repeats: int) -> None:
    """Rows ``gather N pages``: random pages into a staging tensor, for every MHA layout."""
    generator = torch.Generator().manual_seed(0)
    for layout in KVLayout:
        geometry = KVGeometry(
            attention=Attention.MHA,
            layout=layout,
            dtype=torch.bfloat16,
            layer_num=LAYERS,
            page_size=PAGE_SIZE,
            num_pages=NUM_PAGES,
            head_num=HEADS,
            head_dim=HEAD_DIM,
        )
        theirs = build_sglang_host_pool(
            attention="mha",
            layout=layout.value,
            dtype=torch.bfloat16,
            layer_num=LAYERS,
            page_size=PAGE_SIZE,
            num_pages=NUM_PAGES,
            head_num=HEADS,
            head_dim=HEAD_DIM,
        )
        with KVHostPool(geometry, memory) as ours:
            ours.kv_buffer.view(torch.uint8).reshape(-1).fill_(1)
            theirs.kv_buffer.view(torch.uint8).reshape(-1).fill_(1)
            for n in sizes:
                pages = torch.randperm(NUM_PAGES, generator=generator)[:n]
                page_list = pages.tolist()
                staging_ours = torch.empty((n, geometry.page_numel), dtype=torch.bfloat16)
                staging_theirs = torch.empty((n, geometry.page_numel), dtype=torch.bfloat16)

                # Enough batches per sample that one sample is not a single short copy.
                loops = max(1, 512 // n)

                def run_ours(
                    pages: torch.Tensor = pages,
                    out: torch.Tensor = staging_ours,
                    loops: int = loops,
                ) -> int:
                    for _ in range(loops):
                        ours.read_pages(pages, out=out)
                    return loops * out.shape[0]

                def run_theirs(
                    page_list: list[int] = page_list,
                    out: torch.Tensor = staging_theirs,
                    pool: SGLangHostPool = theirs,
                    loops: int = loops,
                ) -> int:
                    for _ in range(loops):
                        for row, page in enumerate(page_list):
                            out[row].copy_(pool.get_data_page(page * PAGE_SIZE))
                    return loops * len(page_list)

                _row(
                    f"gather {n} pages, {layout.value}",
                    _median_rate(run_ours, repeats),
                    _median_rate(run_theirs, repeats),
                    "pages/s",
                )
                assert torch.equal(staging_ours, staging_theirs)


def _workload(seed: int, steps: int, capacity: int) -> list[tuple[str, int]]:
    """Seeded alloc/free operations (sizes in pages) that keep the pool 75-95% full."""
    rng = random.Random(seed)
    live: dict[int, int] = {}
    ops: list[tuple[str, int]] = []
    held = 0
    for op_id in range(steps):
        if live and (held > capacity * 0.95 or (held > capacity * 0.75 and rng.random() < 0.5)):
            victim = rng.choice(list(live))
            held -= live.pop(victim)
            ops.append(("free", victim))
        else:
            # Mixed encoder outputs: small images, large images, video clips (in pages).
            size = rng.choice([1, 1, 2, 3, 5, 8, 13, 40])
            live[op_id] = size
            held += size
            ops.append(("alloc", size))
    return ops


def bench_extents(capacity: int, steps: int, repeats: int) -> None:
    """Row ``embedding alloc/free``: best fit with coalescing vs SGLang's first fit."""
    from sglang.srt.mem_cache.embedding_cache_controller import RangePageAllocator

    ops = _workload(seed=7, steps=steps, capacity=capacity)

    def run(
        make: Callable[[], Any], alloc: Callable[[Any, int], Any], free: Callable[..., None]
    ) -> Callable[[], tuple[int, float]]:
        def go() -> tuple[int, float]:
            allocator = make()
            live: dict[int, Any] = {}
            runs = allocations = 0
            for op_id, (op, value) in enumerate(ops):
                if op == "alloc":
                    got = alloc(allocator, value)
                    if got is not None:
                        live[op_id] = got
                        runs += len(got)
                        allocations += 1
                else:
                    item = live.pop(value, None)
                    if item is not None:
                        free(allocator, item)
            return len(ops), runs / max(allocations, 1)

        return go

    def ours_alloc(allocator: ExtentAllocator, n: int) -> Any:
        if allocator.free_units < n:
            return None
        return allocator.allocate(n)

    ours = run(lambda: ExtentAllocator(capacity), ours_alloc, lambda a, r: a.free(r))
    theirs = run(
        lambda: RangePageAllocator(capacity),
        lambda a, n: a.allocate(n, 1),
        lambda a, r: a.free(r),
    )
    fragmentation: dict[str, float] = {}

    def timed(name: str, go: Callable[[], tuple[int, float]]) -> Callable[[], int]:
        def once() -> int:
            count, runs_per_alloc = go()
            fragmentation[name] = runs_per_alloc
            return count

        return once

    _row(
        "embedding alloc/free (mixed sizes)",
        _median_rate(timed("ours", ours), repeats),
        _median_rate(timed("theirs", theirs), repeats),
        "ops/s",
    )
    print(  # noqa: T201
        f"{'  runs per allocation (fewer is better)':<40} {fragmentation['ours']:>14.3f}"
        f" {fragmentation['theirs']:>14.3f}"
    )


def main() -> None:
    """Run every row and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    sizes = [1, 16, 256] if args.quick else [1, 4, 16, 64, 256, 1024]
    torch.set_num_threads(1)
    budget = HostMemoryBudget(BudgetConfig(total=2 << 30, headroom=1 << 30))
    memory = HostMemory(budget)
    print(f"{'row':<40} {'ours':>14} {'sglang':>14} {'unit':<9} {'ratio':>8}")  # noqa: T201
    with Progress(3, "host_pool.py") as progress:
        progress.step("alloc+free")
        bench_alloc_free(memory, sizes, loops=200 if args.quick else 1000, repeats=repeats)
        progress.step("gather, every layout")
        bench_gather(memory, sizes, repeats)
        progress.step("embedding alloc/free")
        bench_extents(capacity=4096, steps=20_000 if args.quick else 100_000, repeats=repeats)


if __name__ == "__main__":
    main()
