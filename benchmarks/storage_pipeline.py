"""The host<->storage pipeline's overhead over calling the same store directly.

Run: ``.venv/bin/python benchmarks/storage_pipeline.py`` (``--pages``, ``--page-kib``,
``--batches``, ``--repeats``, ``--workers``). Moves ``batches`` batches of ``pages`` pages
of ``page-kib`` KiB to and from one store, three ways, in one process:

- ``direct``: ``store.put_from`` / ``store.get_into`` per batch, in a loop;
- ``one-by-one``: ``StoragePipeline.submit_*`` per batch, waiting for each result before
  the next submission (the pipeline's full per-operation cost, no overlap);
- ``pipelined``: every batch submitted at once, then all results awaited (workers overlap).

Each pipeline run is timed right next to a direct run of the same size (order alternating),
so both see the same machine load; rows print the median throughputs, the median of the
paired ratios pipeline / direct (> 1 means the pipeline is faster), the median paired
overhead per page in microseconds (negative: faster) and as a percentage, with the spread:
the lowest and highest paired ratio and the overhead range they give. A last line
gives the pipeline's fixed cost per operation, measured with ``exists`` (no data moved).
The first round warms up and is not counted. The store is the ``memory`` backend when it
is importable, else a dict store defined here; the first line says which. The goal is
under 10% overhead one-by-one at 64 pages x 256 KiB; the last line says whether the worst
row meets it. Progress (one line per round, with the time elapsed) goes to stderr.

Puts into the ``memory`` backend allocate a fresh buffer per page. With glibc's default
settings the main thread's arena gives freed memory back to the OS while worker threads'
arenas keep it, so direct puts (main thread) pay page faults that pipeline puts (worker
threads) do not, and put rows would mostly measure that. By default (``--malloc steady``)
the benchmark therefore sets ``mallopt`` so that no arena trims or maps large blocks
separately; ``--malloc default`` leaves glibc as it is.

This is a benchmark, not a test: machines are shared and noisy, so read the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from sglang_storage.cli.bench_report import Progress, goal_verdict
from sglang_storage.core import (
    DataKind,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutRequest,
    PutResult,
)
from sglang_storage.transfer.pipeline import StoragePipeline, StoragePipelineConfig
from sglang_storage.transfer.store import PageStore


class BenchStore(PageStore, Protocol):
    """A page store that can also drop a namespace (to rewrite the same keys)."""

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace``."""
        ...


class DictStore:
    """Fallback store: a dict of byte copies (used only when ``MemoryBackend`` is missing)."""

    name = "dict"

    def __init__(self) -> None:
        self._objects: dict[ObjectKey, bytes] = {}
        self._lock = threading.Lock()

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored."""
        with self._lock:
            return [k in self._objects for k in keys]

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Copy each stored object into its buffers."""
        results = []
        for r in requests:
            with self._lock:
                data = self._objects.get(r.key)
            if data is None:
                results.append(GetResult.miss_of(r.key))
                continue
            offset = 0
            for buffer in r.buffers:
                buffer[:] = data[offset : offset + buffer.nbytes]
                offset += buffer.nbytes
            results.append(GetResult.hit_of(r))
        return results

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Store a copy of each request's buffers; existing keys are kept."""
        results = []
        for r in requests:
            data = b"".join(r.buffers)
            with self._lock:
                if r.key in self._objects:
                    results.append(PutResult.present_of(r.key))
                    continue
                self._objects[r.key] = data
            results.append(PutResult.stored_of(r))
        return results

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace``."""
        with self._lock:
            for k in [k for k in self._objects if k.namespace == namespace]:
                del self._objects[k]


def steady_malloc() -> str:
    """Stop glibc from trimming arenas and from mmap-ing large blocks; say what was done."""
    name = ctypes.util.find_library("c")
    if name is None:
        return "default (no C library found to configure)"
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return "default (not glibc)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_trim_threshold, 2**31 - 1) and libc.mallopt(m_mmap_threshold, 32 << 20)
    if not ok:
        return "default (mallopt refused)"
    return "steady (mallopt: no trimming, blocks up to 32 MiB from the arenas)"


def make_store() -> tuple[BenchStore, str]:
    """The ``memory`` backend if it is importable, else :class:`DictStore`; and a label."""
    try:
        from sglang_storage.storage import MemoryBackend, MemoryBackendConfig
    except ImportError as error:
        return DictStore(), f"dict (fallback: sglang_storage.storage.MemoryBackend: {error})"
    return MemoryBackend(MemoryBackendConfig()), "memory (sglang_storage.storage.MemoryBackend)"


def _requests(
    namespace: Namespace, batches: int, pages: int, page_bytes: int
) -> tuple[list[list[PutRequest]], list[list[GetRequest]]]:
    spec = ObjectSpec.raw(page_bytes)
    source = os.urandom(page_bytes)
    puts, gets = [], []
    for b in range(batches):
        keys = [namespace.key(f"b{b}p{p}") for p in range(pages)]
        puts.append([PutRequest(key=k, spec=spec, buffers=[bytearray(source)]) for k in keys])
        gets.append([GetRequest(key=k, spec=spec, buffers=[bytearray(page_bytes)]) for k in keys])
    return puts, gets


def _check(results: Sequence[GetResult] | Sequence[PutResult]) -> None:
    for r in results:
        if r.outcome.value not in ("hit", "stored"):
            raise SystemExit(f"benchmark store misbehaved: {r}")


def _ignore(value: object) -> None:
    del value


def _pair(first: Callable[[], None], second: Callable[[], None], swap: bool) -> tuple[float, float]:
    """Seconds of ``first`` and ``second`` run back to back, in swapped order if ``swap``."""
    order = (second, first) if swap else (first, second)
    times = []
    for run in order:
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return (times[1], times[0]) if swap else (times[0], times[1])


@attrs.frozen
class Row:
    """Paired timings of one row: each direct run next to its pipeline run."""

    pages: int
    pairs: tuple[tuple[float, float], ...]

    @property
    def direct_s(self) -> float:
        """Median direct seconds."""
        return statistics.median(d for d, _ in self.pairs)

    @property
    def pipeline_s(self) -> float:
        """Median pipeline seconds."""
        return statistics.median(p for _, p in self.pairs)

    @property
    def ratio(self) -> float:
        """Median of paired throughput ratios pipeline / direct."""
        return statistics.median(d / p for d, p in self.pairs)

    @property
    def spread(self) -> tuple[float, float]:
        """Lowest and highest paired throughput ratio pipeline / direct."""
        ratios = [d / p for d, p in self.pairs]
        return min(ratios), max(ratios)

    @property
    def overhead_us_per_page(self) -> float:
        """Median of paired time differences, per page, in microseconds."""
        return statistics.median(p - d for d, p in self.pairs) / self.pages * 1e6


def bench(
    store: BenchStore, args: argparse.Namespace, progress: Progress
) -> tuple[dict[tuple[str, str], Row], Row]:
    """Rows by (op, mode), and the no-I/O exists row; one progress step per round."""
    ours = Namespace(model="bench-pipeline", kind=DataKind.KV)
    theirs = Namespace(model="bench-direct", kind=DataKind.KV)
    page_bytes = args.page_kib << 10
    pipe_puts, pipe_gets = _requests(ours, args.batches, args.pages, page_bytes)
    direct_puts, direct_gets = _requests(theirs, args.batches, args.pages, page_bytes)
    keys = [r.key for r in pipe_puts[0]]
    config = StoragePipelineConfig(
        workers=args.workers, batch_pages=args.pages, queue_depth=max(16, args.batches)
    )
    pairs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    exists_pairs: list[tuple[float, float]] = []

    def clear() -> None:
        store.clear(ours)
        store.clear(theirs)

    with StoragePipeline(store, config) as pipeline:

        def serial(op: str, b: int) -> tuple[Callable[[], None], Callable[[], None]]:
            if op == "put":
                return (
                    lambda: _check(store.put_from(direct_puts[b])),
                    lambda: _check(pipeline.submit_put(pipe_puts[b]).result()),
                )
            return (
                lambda: _check(store.get_into(direct_gets[b])),
                lambda: _check(pipeline.submit_get(pipe_gets[b]).result()),
            )

        def overlapped(op: str) -> tuple[Callable[[], None], Callable[[], None]]:
            def direct() -> None:
                for b in range(args.batches):
                    serial(op, b)[0]()

            def piped() -> None:
                handles: list[Any] = (
                    [pipeline.submit_put(batch) for batch in pipe_puts]
                    if op == "put"
                    else [pipeline.submit_get(batch) for batch in pipe_gets]
                )
                for handle in handles:
                    _check(handle.result())

            return direct, piped

        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            progress.step(f"round {repeat} of {args.repeats}" if repeat else "warm-up round")
            rounds: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for op in ("put", "get"):
                for b in range(args.batches):
                    rounds.setdefault((op, "one-by-one"), []).append(
                        _pair(*serial(op, b), swap=(repeat + b) % 2 == 1)
                    )
                if op == "put":
                    clear()
                rounds[(op, "pipelined")] = [_pair(*overlapped(op), swap=repeat % 2 == 1)]
                exists_pairs.append(
                    _pair(
                        lambda: _ignore(store.exists(keys)),
                        lambda: _ignore(pipeline.submit_exists(keys).result()),
                        swap=repeat % 2 == 1,
                    )
                )
            clear()
            if repeat:
                for row, measured in rounds.items():
                    pairs.setdefault(row, []).extend(measured)
            else:
                exists_pairs.clear()
    rows = {
        (op, mode): Row(
            pages=args.pages * (args.batches if mode == "pipelined" else 1), pairs=tuple(measured)
        )
        for (op, mode), measured in pairs.items()
    }
    return rows, Row(pages=1, pairs=tuple(exists_pairs))


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64, help="pages per batch (one submission)")
    parser.add_argument("--page-kib", type=int, default=256, help="page size in KiB")
    parser.add_argument("--batches", type=int, default=4, help="batches per measurement")
    parser.add_argument("--repeats", type=int, default=7, help="measurements (median taken)")
    parser.add_argument("--workers", type=int, default=2, help="pipeline worker threads")
    parser.add_argument(
        "--malloc",
        choices=("steady", "default"),
        default="steady",
        help="steady: same allocator behaviour on every thread (see the module docstring)",
    )
    args = parser.parse_args()
    malloc = steady_malloc() if args.malloc == "steady" else "default (glibc as configured)"
    store, label = make_store()
    total_pages = args.pages * args.batches
    total_mib = total_pages * args.page_kib / 1024
    print(f"store: {label}")  # noqa: T201
    print(f"malloc: {malloc}")  # noqa: T201
    print(  # noqa: T201
        f"{args.batches} batches x {args.pages} pages x {args.page_kib} KiB"
        f" ({total_mib:.0f} MiB per round), {args.workers} workers,"
        f" median of {args.repeats}"
    )
    print(  # noqa: T201
        f"{'op':<4} {'mode':<11} {'direct MiB/s':>13} {'pipeline MiB/s':>15}"
        f" {'ratio':>7} {'spread':>13} {'overhead us/page':>17} {'overhead %':>11}"
        f" {'overhead % range':>17}"
    )
    with Progress(args.repeats + 1, "storage_pipeline.py") as progress:
        rows, exists = bench(store, args, progress)
    for (op, mode), row in sorted(rows.items()):
        mib = row.pages * args.page_kib / 1024
        overhead = (1 / row.ratio - 1) * 100
        low, high = row.spread
        spread = f"{low:.2f}-{high:.2f}x"
        overheads = f"{(1 / high - 1) * 100:.1f} to {(1 / low - 1) * 100:.1f}%"
        print(  # noqa: T201
            f"{op:<4} {mode:<11} {mib / row.direct_s:>13,.0f} {mib / row.pipeline_s:>15,.0f}"
            f" {row.ratio:>6.2f}x {spread:>13} {row.overhead_us_per_page:>17.1f}"
            f" {overhead:>10.1f}% {overheads:>17}"
        )
    print(  # noqa: T201
        f"fixed cost per operation (exists of {args.pages} keys, no I/O):"
        f" {exists.overhead_us_per_page:.1f} us"
        f" (direct {exists.direct_s * 1e6:.1f} us, pipeline {exists.pipeline_s * 1e6:.1f} us)"
    )
    serial_rows = [row for (_, mode), row in rows.items() if mode == "one-by-one"]
    worst = max((1 / row.ratio - 1) * 100 for row in serial_rows)
    print(  # noqa: T201
        goal_verdict(
            "one-by-one overhead < 10% at this size", f"worst row {worst:.1f}%", worst < 10
        )
    )


if __name__ == "__main__":
    main()
