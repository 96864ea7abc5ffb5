"""The file backend's learned split of a batch over its I/O threads, against an even split.

Run: ``.venv/bin/python benchmarks/io_split.py`` (``--quick``, ``--rounds``,
``--cases 64KiB:4,...``). Two ``file`` backends on one store (``io_threads=2``, warm page
cache) read the same stored pages in batches: one splits each batch as the backend does
(``IOThreads.map_parts``: the caller's part ahead by what it does while a pool thread
starts, a batch the pool cannot help on the caller alone), the other always in even
halves, as before. Batches alternate between the two, so both see the same machine; each
row prints the median batch time of each, the median of the paired ratios (even /
learned: > 1 means the learned split is faster), its p10-p90 spread, and what the
learned side settled on (the pool's start delay and the caller's time per page). Every
read is checked to be a hit. Not part of ``make bench``. This is a benchmark, not a test:
machines are shared and noisy, so read the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from sglang_storage.cli.bench_report import Progress
from sglang_storage.core import DataKind, GetOutcome, GetRequest, Namespace, ObjectSpec, PutRequest
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.storage.posix import IOThreads


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def _case(text: str) -> tuple[int, int]:
    page, _, batch = text.partition(":")
    return _size(page), int(batch)


def even(threads: IOThreads) -> None:
    """Make ``threads`` split every batch in even halves, whatever it has learned."""
    cuts = IOThreads._cuts
    threads._cuts = lambda weights, pace: cuts(threads, weights, None)  # type: ignore[method-assign]


def measure(page: int, batch: int, rounds: int, root: str) -> str:
    """One row: ``rounds`` passes over the stored pages, batches alternating sides."""
    namespace = Namespace(model="bench-split", kind=DataKind.KV)
    spec = ObjectSpec.raw(page)
    count = max(4 * batch, (16 << 20) // page // batch * batch)
    keys = [namespace.key(f"p{page}-{i}") for i in range(count)]
    learned, split = (FileBackend(FileBackendConfig(root=root)) for _ in range(2))
    even(split._threads)
    try:
        source = memoryview(os.urandom(page))
        learned.put_from([PutRequest(key=key, spec=spec, buffers=[source]) for key in keys])
        targets = [memoryview(bytearray(page)) for _ in range(batch)]
        times: dict[int, list[float]] = {0: [], 1: []}
        for r in range(rounds):
            for at in range(0, count, batch):
                requests = [
                    GetRequest(key=keys[at + i], spec=spec, buffers=[targets[i]])
                    for i in range(batch)
                ]
                for side in (0, 1) if (r + at // batch) % 2 else (1, 0):
                    backend = learned if side == 0 else split
                    started = time.perf_counter()
                    results = backend.get_into(requests)
                    times[side].append(time.perf_counter() - started)
                    if any(result.outcome is not GetOutcome.HIT for result in results):
                        raise SystemExit(f"a read missed: {results}")
        warm = len(times[0]) // 5  # the first passes teach the learned side; not counted
        pairs = zip(times[0][warm:], times[1][warm:], strict=True)
        ratios = sorted(even_s / learned_s for learned_s, even_s in pairs)
        deciles = statistics.quantiles(ratios, n=10, method="inclusive")
        threads = learned._threads
        lag = statistics.median(threads._lags) * 1e6 if threads._lags else float("nan")
        pace = [value * page * 1e6 for key, value in threads._pace.items() if key[0] == "read"]
        return (
            f"{page >> 10:>6} KiB {batch:>5}"
            f" {statistics.median(times[0][warm:]) * 1e6:>11.0f}"
            f" {statistics.median(times[1][warm:]) * 1e6:>9.0f}"
            f" {statistics.median(ratios):>6.2f}x {deciles[0]:>5.2f}-{deciles[-1]:.2f}x"
            f" {lag:>9.0f} {pace[-1] if pace else float('nan'):>12.1f}"
        )
    finally:
        learned.close()
        split.close()


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--cases",
        default="64KiB:4,64KiB:32,256KiB:8,256KiB:32,1MiB:32",
        help="page:batch pairs, comma-separated",
    )
    parser.add_argument("--rounds", type=int, default=60, help="passes over the stored pages")
    parser.add_argument("--quick", action="store_true", help="20 passes")
    args = parser.parse_args()
    rounds = 20 if args.quick else args.rounds
    cases = [_case(text) for text in args.cases.split(",")]
    print(  # noqa: T201
        f"file backend, io_threads=2, warm reads, {rounds} passes over 16 MiB per case"
        " (the first fifth not counted); medians of the batch times (us), batches alternating"
    )
    print(  # noqa: T201
        f"{'page':>10} {'batch':>5} {'learned us':>11} {'even us':>9} {'ratio':>7}"
        f" {'spread':>10} {'lag us':>9} {'us per page':>12}"
    )
    with Progress(len(cases), "io_split.py") as progress:
        for page, batch in cases:
            progress.step(f"{page >> 10} KiB x {batch}")
            root = tempfile.mkdtemp(dir="/var/tmp", prefix="sglang-storage-split-")
            try:
                print(measure(page, batch, rounds, root))  # noqa: T201
            finally:
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
