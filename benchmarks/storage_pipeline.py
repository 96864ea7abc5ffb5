"""The host<->storage pipeline's overhead over calling the same store directly.

Run: ``.venv/bin/python benchmarks/storage_pipeline.py`` (``--pages``, ``--page-kib``,
``--batches``, ``--repeats``, ``--exists-pairs``, ``--workers``). Moves ``batches`` batches
of ``pages`` pages of ``page-kib`` KiB to and from one store, three ways, in one process:

- ``direct``: ``store.put_from`` / ``store.get_into`` per batch, in a loop;
- ``one-by-one``: ``StoragePipeline.submit_*`` per batch, waiting for each result before
  the next submission (the pipeline's full per-operation cost, no overlap);
- ``pipelined``: every batch submitted at once, then all results awaited (workers overlap);
- ``thread-only``: not the pipeline: the same direct calls made on a plain thread of their
  own and timed there (no hand-off counted), paired with direct calls on the main thread.
  It shows what running the store's work on another thread than the caller's costs by
  itself (its "pipeline" columns are that thread's), which the pipeline's rows include.

Each pipeline run is timed right next to a direct run of the same size (order alternating),
so both see the same machine load, and both move the same bytes: the two puts of a page
read one source buffer (into keys of their own), and both gets read the same stored
objects into the same destination buffers. A round makes ``batches`` one-by-one pairs and one
pipelined pair per op; ``repeats`` rounds are counted (the first round warms up and is not),
so a one-by-one row has ``repeats x batches`` pairs. Rows print the number of pairs, the
median throughputs, the median of the paired ratios pipeline / direct (> 1 means the
pipeline is faster), the spread of those ratios (10th to 90th percentile; lowest to highest
under 10 pairs), the median paired overhead per page in microseconds (negative: faster) and
as a percentage, and an approximate 95% confidence interval of that median percentage
(from the order statistics of the paired ratios). Single samples here are short (a few
milliseconds) and swing widely on a shared machine; the medians over many pairs do not.
The interval covers the sampling noise within one run only: what differs from one run to
the next (where the allocator placed the memory a put fills, the machine's load) can move
a row by more.

The fixed cost per operation is measured with ``exists`` (no data moved): the median paired
difference over ``exists-pairs`` back-to-back pairs (spread across the rounds), with its
10th to 90th percentile. The next line gives the one-by-one rows' median paired overhead
per operation, for comparison: it also holds what a backend call of that size costs the
pipeline's threads beyond the fixed cost (waking after a longer wait, bookkeeping on caches
the copies evicted). The store is the ``memory`` backend when it is importable, else a
dict store defined here; the first line says which. The goal is under 10% overhead
one-by-one at 64 pages x 256 KiB; the last line says whether the worst row's median meets
it. Progress (one line per round, with the time elapsed) goes to stderr.

Puts into the ``memory`` backend allocate a fresh buffer per page, on the thread that
calls the store: the main thread for direct puts, a worker for the pipeline's. With
glibc's default settings the main thread's arena gives freed memory back to the OS while
worker threads' arenas keep it, so direct puts would pay page faults that pipeline puts do
not; and each thread allocates from an arena of its own, whose memory fills at a speed of
its own: on the 2-core machine this project is measured on, the pipeline's put rows moved
by tens of percent from one process to the next while its get rows, which allocate
nothing, held steady, and with one arena for all threads put and get cost the pipeline
the same per operation (the README has the numbers). Put rows would then measure the
allocator, not the pipeline. By default (``--malloc one-arena``) the benchmark therefore
sets ``mallopt`` so that no arena trims or maps large blocks separately and every thread
allocates from the main arena (``M_ARENA_MAX=1``), so both sides fill the same memory;
``--malloc steady`` keeps an arena per thread (no trimming), ``--malloc default`` leaves
glibc as it is. The ``malloc:`` line says which setting ran. The ``thread-only`` rows time
the same calls on a plain thread under the same setting.

Placement (``--placement``): by default the benchmark runs twice, first with the process
(the caller and the pipeline's workers) pinned to one CPU, then free to use every CPU it
may. On one CPU a hand-off between the caller and a worker is a switch on that CPU, and
both sides of a pair see the same CPU; across CPUs each hand-off wakes a thread on another
CPU (on a virtual machine an inter-processor interrupt through the hypervisor), and the
two sides may run on CPUs that another tenant slows by different amounts at that moment.
The difference between the two fixed-cost lines is what the cross-CPU wake-ups cost here.
Each placement prints its own rows and goal line.

This is a benchmark, not a test: machines are shared and noisy, so read the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import math
import os
import queue
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


def steady_malloc(*, one_arena: bool = False) -> str:
    """Stop glibc from trimming arenas and from mmap-ing large blocks; say what was done.

    With ``one_arena``, also make every thread allocate from the main thread's arena.
    """
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
    if one_arena:
        m_arena_max = -8
        if not libc.mallopt(m_arena_max, 1):
            return "steady, but one arena refused (mallopt: no trimming, up to 32 MiB)"
        return "one-arena (mallopt: every thread uses the main arena, no trimming, up to 32 MiB)"
    return "steady (mallopt: no trimming, blocks up to 32 MiB from the arenas)"


def make_store() -> tuple[BenchStore, str]:
    """The ``memory`` backend if it is importable, else :class:`DictStore`; and a label."""
    try:
        from sglang_storage.storage import MemoryBackend, MemoryBackendConfig
    except ImportError as error:
        return DictStore(), f"dict (fallback: sglang_storage.storage.MemoryBackend: {error})"
    return MemoryBackend(MemoryBackendConfig()), "memory (sglang_storage.storage.MemoryBackend)"


def _requests(
    ours: Namespace, theirs: Namespace, batches: int, pages: int, page_bytes: int
) -> tuple[list[list[PutRequest]], list[list[PutRequest]], list[list[GetRequest]]]:
    """Puts under ``ours`` and under ``theirs``, and gets of ``ours``, per batch.

    Both sides move the same bytes: the two puts of a page read one source buffer, and
    both sides' gets read the same stored objects into the same destination buffers.
    """
    spec = ObjectSpec.raw(page_bytes)
    source = os.urandom(page_bytes)
    our_puts, their_puts, gets = [], [], []
    for b in range(batches):
        pairs = [(f"b{b}p{p}", bytearray(source)) for p in range(pages)]
        our_puts.append([PutRequest(key=ours.key(n), spec=spec, buffers=[x]) for n, x in pairs])
        their_puts.append([PutRequest(key=theirs.key(n), spec=spec, buffers=[x]) for n, x in pairs])
        gets.append(
            [
                GetRequest(key=ours.key(n), spec=spec, buffers=[bytearray(page_bytes)])
                for n, _ in pairs
            ]
        )
    return our_puts, their_puts, gets


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


class PlainThread:
    """One thread that runs what it is given and times it there (no pipeline, no hand-off)."""

    def __init__(self) -> None:
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._seconds: queue.Queue[float] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="bench-plain", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (run := self._work.get()) is not None:
            started = time.perf_counter()
            run()
            self._seconds.put(time.perf_counter() - started)

    def seconds(self, run: Callable[[], None]) -> float:
        """Seconds ``run`` took on this thread."""
        self._work.put(run)
        return self._seconds.get()

    def close(self) -> None:
        """Stop the thread."""
        self._work.put(None)
        self._thread.join()


def _pair_seconds(
    first: Callable[[], float], second: Callable[[], float], swap: bool
) -> tuple[float, float]:
    """What ``first`` and ``second`` report, called back to back, in swapped order if ``swap``."""
    if swap:
        later = second()
        return first(), later
    earlier = first()
    return earlier, second()


def _on_main(run: Callable[[], None]) -> Callable[[], float]:
    def timed() -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    return timed


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
    def ratios(self) -> list[float]:
        """The paired throughput ratios pipeline / direct, sorted."""
        return sorted(d / p for d, p in self.pairs)

    @property
    def ratio(self) -> float:
        """Median of paired throughput ratios pipeline / direct."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        """10th and 90th percentile of the paired ratios (lowest and highest under 10 pairs)."""
        return _spread(self.ratios)

    @property
    def ratio_ci(self) -> tuple[float, float]:
        """An approximate 95% confidence interval of the median paired ratio."""
        ratios = self.ratios
        n = len(ratios)
        # The ranks n/2 -+ 1.96 standard deviations of Binomial(n, 1/2) (1-based, widened).
        half = 0.98 * math.sqrt(n)
        low = max(1, math.floor(n / 2 - half))
        high = min(n, math.ceil(1 + n / 2 + half))
        return ratios[low - 1], ratios[high - 1]

    @property
    def differences_s(self) -> list[float]:
        """The paired differences pipeline - direct in seconds, sorted."""
        return sorted(p - d for d, p in self.pairs)

    @property
    def overhead_us(self) -> float:
        """Median of paired time differences, per measurement, in microseconds."""
        return statistics.median(self.differences_s) * 1e6

    @property
    def overhead_us_per_page(self) -> float:
        """Median of paired time differences, per page, in microseconds."""
        return self.overhead_us / self.pages


def _spread(values: Sequence[float]) -> tuple[float, float]:
    """10th and 90th percentile of sorted ``values`` (first and last under 10 of them)."""
    if len(values) < 10:
        return values[0], values[-1]
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def _overhead_pct(ratio: float) -> float:
    """The time overhead in percent that a throughput ratio pipeline / direct gives."""
    return (1 / ratio - 1) * 100


def bench(
    store: BenchStore, args: argparse.Namespace, progress: Progress
) -> tuple[dict[tuple[str, str], Row], Row]:
    """Rows by (op, mode), and the no-I/O exists row; one progress step per round."""
    ours = Namespace(model="bench-pipeline", kind=DataKind.KV)
    theirs = Namespace(model="bench-direct", kind=DataKind.KV)
    plain = Namespace(model="bench-thread", kind=DataKind.KV)
    main_thread = Namespace(model="bench-main", kind=DataKind.KV)
    page_bytes = args.page_kib << 10
    pipe_puts, direct_puts, gets = _requests(ours, theirs, args.batches, args.pages, page_bytes)

    def same_pages(namespace: Namespace) -> list[list[PutRequest]]:
        return [
            [PutRequest(key=namespace.key(r.key.name), spec=r.spec, buffers=r.buffers) for r in b]
            for b in direct_puts
        ]

    thread_puts, main_puts = same_pages(plain), same_pages(main_thread)
    keys = [r.key for r in pipe_puts[0]]
    config = StoragePipelineConfig(
        workers=args.workers, batch_pages=args.pages, queue_depth=max(16, args.batches)
    )
    pairs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    exists_pairs: list[tuple[float, float]] = []
    # Spread over the rounds (and both ops) like the rows, so they see the same machine.
    exists_per_round = max(1, math.ceil(args.exists_pairs / (2 * args.repeats)))

    def clear() -> None:
        store.clear(ours)
        store.clear(theirs)
        store.clear(plain)
        store.clear(main_thread)

    thread = PlainThread()
    with StoragePipeline(store, config) as pipeline:

        def thread_only(op: str, b: int) -> tuple[Callable[[], float], Callable[[], float]]:
            if op == "put":
                return (
                    _on_main(lambda: _check(store.put_from(main_puts[b]))),
                    lambda: thread.seconds(lambda: _check(store.put_from(thread_puts[b]))),
                )
            return (
                _on_main(lambda: _check(store.get_into(gets[b]))),
                lambda: thread.seconds(lambda: _check(store.get_into(gets[b]))),
            )

        def serial(op: str, b: int) -> tuple[Callable[[], None], Callable[[], None]]:
            if op == "put":
                return (
                    lambda: _check(store.put_from(direct_puts[b])),
                    lambda: _check(pipeline.submit_put(pipe_puts[b]).result()),
                )
            return (
                lambda: _check(store.get_into(gets[b])),
                lambda: _check(pipeline.submit_get(gets[b]).result()),
            )

        def overlapped(op: str) -> tuple[Callable[[], None], Callable[[], None]]:
            def direct() -> None:
                for b in range(args.batches):
                    serial(op, b)[0]()

            def piped() -> None:
                handles: list[Any] = (
                    [pipeline.submit_put(batch) for batch in pipe_puts]
                    if op == "put"
                    else [pipeline.submit_get(batch) for batch in gets]
                )
                for handle in handles:
                    _check(handle.result())

            return direct, piped

        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            progress.step(f"round {repeat} of {args.repeats}" if repeat else "warm-up round")
            rounds: dict[tuple[str, str], list[tuple[float, float]]] = {}
            round_exists: list[tuple[float, float]] = []
            for op in ("put", "get"):
                for b in range(args.batches):
                    rounds.setdefault((op, "one-by-one"), []).append(
                        _pair(*serial(op, b), swap=(repeat + b) % 2 == 1)
                    )
                    rounds.setdefault((op, "thread-only"), []).append(
                        _pair_seconds(*thread_only(op, b), swap=(repeat + b) % 2 == 0)
                    )
                if op == "put":
                    clear()
                rounds[(op, "pipelined")] = [_pair(*overlapped(op), swap=repeat % 2 == 1)]
                round_exists.extend(
                    _pair(
                        lambda: _ignore(store.exists(keys)),
                        lambda: _ignore(pipeline.submit_exists(keys).result()),
                        swap=(repeat + i) % 2 == 1,
                    )
                    for i in range(exists_per_round)
                )
            clear()
            if repeat:
                for row, measured in rounds.items():
                    pairs.setdefault(row, []).extend(measured)
                exists_pairs.extend(round_exists)
    thread.close()
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
    parser.add_argument(
        "--repeats",
        type=int,
        default=40,
        help="counted rounds: pairs per one-by-one row = repeats x batches (median taken)",
    )
    parser.add_argument(
        "--exists-pairs",
        type=int,
        default=600,
        help="paired exists calls behind the fixed cost per operation (at least this many)",
    )
    parser.add_argument("--workers", type=int, default=2, help="pipeline worker threads")
    parser.add_argument(
        "--placement",
        choices=("both", "one-cpu", "any-cpu"),
        default="both",
        help="where the threads run: all on one CPU, on any CPU the process may use, or"
        " each in turn (see the module docstring)",
    )
    parser.add_argument(
        "--malloc",
        choices=("one-arena", "steady", "default"),
        default="one-arena",
        help="one-arena: every thread allocates from one arena, never trimmed (see the module"
        " docstring); steady: an arena per thread, never trimmed; default: glibc as it is",
    )
    args = parser.parse_args()
    if args.repeats < 1 or args.batches < 1 or args.exists_pairs < 1:
        parser.error("--repeats, --batches and --exists-pairs must be at least 1")
    malloc = (
        "default (glibc as configured)"
        if args.malloc == "default"
        else steady_malloc(one_arena=args.malloc == "one-arena")
    )
    total_pages = args.pages * args.batches
    total_mib = total_pages * args.page_kib / 1024
    allowed = sorted(os.sched_getaffinity(0))
    placements = {
        "one-cpu": [("one CPU", {allowed[0]})],
        "any-cpu": [("any CPU", set(allowed))],
        "both": [("one CPU", {allowed[0]}), ("any CPU", set(allowed))],
    }[args.placement]
    stores = [make_store() for _ in placements]  # a fresh one per placement
    print(f"store: {stores[0][1]}")  # noqa: T201
    print(f"malloc: {malloc}")  # noqa: T201
    print(  # noqa: T201
        f"{args.batches} batches x {args.pages} pages x {args.page_kib} KiB"
        f" ({total_mib:.0f} MiB per round), {args.workers} workers, {args.repeats} rounds"
        " (after a warm-up round); medians of paired runs, order alternating"
    )
    verdicts = []
    with Progress((args.repeats + 1) * len(placements), "storage_pipeline.py") as progress:
        for (name, cpus), (store, _) in zip(placements, stores, strict=True):
            os.sched_setaffinity(0, cpus)  # the pipeline's threads, started next, inherit it
            try:
                rows, exists = bench(store, args, progress)
            finally:
                os.sched_setaffinity(0, set(allowed))
            where = ", ".join(map(str, sorted(cpus)))
            print(f"threads on {name} (cpu {where}):")  # noqa: T201
            verdicts.append(_report(name, rows, exists, args))
    for line in verdicts:
        print(line)  # noqa: T201


def _report(
    placement: str, rows: dict[tuple[str, str], Row], exists: Row, args: argparse.Namespace
) -> str:
    """Print the rows of one placement; return its goal line."""
    print(  # noqa: T201
        f"{'op':<4} {'mode':<11} {'pairs':>5} {'direct MiB/s':>13} {'pipeline MiB/s':>15}"
        f" {'ratio':>7} {'spread p10-p90':>15} {'overhead us/page':>17} {'overhead %':>11}"
        f" {'95% CI of overhead %':>21}"
    )
    for (op, mode), row in sorted(rows.items()):
        mib = row.pages * args.page_kib / 1024
        low, high = row.spread
        ci_low, ci_high = row.ratio_ci
        spread = f"{low:.2f}-{high:.2f}x"
        ci = f"{_overhead_pct(ci_high):.1f} to {_overhead_pct(ci_low):.1f}%"
        print(  # noqa: T201
            f"{op:<4} {mode:<11} {len(row.pairs):>5}"
            f" {mib / row.direct_s:>13,.0f} {mib / row.pipeline_s:>15,.0f}"
            f" {row.ratio:>6.2f}x {spread:>15} {row.overhead_us_per_page:>17.1f}"
            f" {_overhead_pct(row.ratio):>10.1f}% {ci:>21}"
        )
    differences = exists.differences_s
    low_us, high_us = (x * 1e6 for x in _spread(differences))
    print(  # noqa: T201
        f"fixed cost per operation (exists of {args.pages} keys, no I/O,"
        f" {len(differences)} back-to-back pairs): median {exists.overhead_us:.1f} us"
        f" (p10-p90 {low_us:.1f} to {high_us:.1f} us; direct {exists.direct_s * 1e6:.1f} us,"
        f" pipeline {exists.pipeline_s * 1e6:.1f} us)"
    )
    serial = {op: row for (op, mode), row in sorted(rows.items()) if mode == "one-by-one"}
    per_op = ", ".join(f"{op} {row.overhead_us:.1f} us" for op, row in serial.items())
    print(  # noqa: T201
        f"one-by-one overhead per operation of {args.pages} x {args.page_kib} KiB"
        f" (median paired difference): {per_op}"
    )
    worst_op, worst = max(serial.items(), key=lambda item: _overhead_pct(item[1].ratio))
    ci_low, ci_high = worst.ratio_ci
    overhead = _overhead_pct(worst.ratio)
    return goal_verdict(
        f"one-by-one overhead < 10% at this size, threads on {placement}",
        f"worst row ({worst_op}) {overhead:.1f}%"
        f" (95% CI {_overhead_pct(ci_high):.1f} to {_overhead_pct(ci_low):.1f}%)",
        overhead < 10,
    )


if __name__ == "__main__":
    main()
