"""Our file backend with many objects in one store: open (index rebuild), index memory, exists.

Run: ``.venv/bin/python benchmarks/file_scale.py`` (1,000,000 objects; ``--quick`` for
100,000). Issue 25's goals for a store of 1,000,000 objects: the index takes less than 200
bytes per object and opening the store (the directory scan that rebuilds the index) takes
less than 10 s.

The store is filled through the backend's own API (``put_from`` in batches, objects of a
64-byte payload: the index, not the data, is measured) in two steps, to a tenth of the
objects and then to all of them. At each checkpoint a fresh process (``spawn``, so no
memory freed by earlier work is reused) opens the store ``--repeats`` times and measures:

- ``open``: the time to construct the backend on the store (marker check, orphan cleanup,
  index rebuild), with directory entries and inodes in the kernel's cache as after any
  recent use; as root, also once after dropping the caches (``cold``). Reference: a bare
  ``os.walk`` of every fan directory with one ``os.lstat`` per file, the system calls any
  rebuild makes, called from Python (``scan``). Where the backend's C scan is built
  (``_fileio.c``: the listing and the ``lstat`` calls without the GIL, in C), the open
  can beat it, so ``open/scan`` below 1.0x is expected there.
- ``RSS``: the growth of the process's resident set over the first open, per object.
- ``traced``: the bytes Python allocated for the index and still holds after an open,
  per object (``tracemalloc``, in a second open of the same process).
- ``exists``: ``prefix_hits`` of every stored key in batches of ``--batch`` (all answered
  from the index), and ``exists`` of keys never stored (one ``lstat`` each).

The growth per object between the two checkpoints (the difference of the measurements
over the difference of the object counts) cancels what does not grow with the store; the
open time per object extrapolates the open of a 1,000,000-object store. Progress goes to
stderr; the results go to stdout.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Final

import attrs

from sglang_storage.cli.bench_report import Progress, goal_verdict
from sglang_storage.core import DataKind, Namespace, ObjectSpec, PutRequest
from sglang_storage.storage import FileBackend, FileBackendConfig

PAYLOAD: Final = 64
"""Payload bytes of each object."""
NAMESPACE: Final = Namespace(model="bench-scale", kind=DataKind.KV)
DEFAULT_DIR: Final = Path("/var/tmp")
DROP_CACHES: Final = "/proc/sys/vm/drop_caches"
GOAL_BYTES: Final = 200
GOAL_OPEN_S: Final = 10.0
GOAL_OBJECTS: Final = 1_000_000


def name_of(i: int) -> str:
    """The name of object ``i``: 64 hex digits, like SGLang's page hashes."""
    return f"{i:016x}{'0' * 48}"


def missing_name(i: int) -> str:
    """A name no object of the run has."""
    return f"{i:016x}{'f' * 48}"


@attrs.frozen(kw_only=True)
class Checkpoint:
    """What the measuring process found for one store size."""

    objects: int
    open_s: list[float]
    cold_open_s: float | None
    scan_s: list[float]
    rss_bytes: int
    traced_bytes: int
    exists_mkeys: list[float]
    missing_mkeys: float


def rss_bytes() -> int:
    """This process's resident set size (``VmRSS``)."""
    with open("/proc/self/status") as status:  # noqa: PTH123
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def drop_caches() -> bool:
    """Write back and drop the page cache, dentries and inodes; whether it could."""
    if os.geteuid() != 0:
        return False
    os.sync()
    try:
        with open(DROP_CACHES, "w") as control:  # noqa: PTH123
            control.write("3\n")
    except OSError:
        return False
    return True


def open_store(root: Path) -> FileBackend:
    """The backend as a server opens it: no cap, two I/O threads."""
    return FileBackend(FileBackendConfig(root=root, io_threads=2))


def scan_limit(root: Path) -> float:
    """Seconds for ``scandir`` of every fan directory and one ``lstat`` per file."""
    start = time.perf_counter()
    found = 0
    for dirpath, _, files in os.walk(root / "objects"):
        for name in files:
            os.lstat(f"{dirpath}/{name}")
            found += 1
    return time.perf_counter() - start


def measure(root: Path, objects: int, batch: int, repeats: int) -> Checkpoint:
    """Every measurement of one checkpoint; runs in a fresh process."""
    gc.collect()
    before = rss_bytes()
    open_s: list[float] = []
    start = time.perf_counter()
    backend = open_store(root)
    open_s.append(time.perf_counter() - start)
    gc.collect()
    grown = rss_bytes() - before
    if backend.stats().objects != objects:
        raise SystemExit(f"error: the store indexes {backend.stats().objects} of {objects}")
    keys = NAMESPACE.keys([name_of(i) for i in range(objects)])
    exists_mkeys = []
    for _ in range(repeats):
        began = time.perf_counter()
        hits = sum(backend.prefix_hits(keys[i : i + batch]) for i in range(0, objects, batch))
        exists_mkeys.append(objects / (time.perf_counter() - began) / 1e6)
        if hits != objects:
            raise SystemExit(f"error: exists found {hits} of {objects} objects")
    missing = NAMESPACE.keys([missing_name(i) for i in range(min(objects, 10_000))])
    began = time.perf_counter()
    if any(backend.exists(missing)):
        raise SystemExit("error: exists found an object never written")
    missing_mkeys = len(missing) / (time.perf_counter() - began) / 1e6
    backend.close()
    del backend, keys, missing
    gc.collect()
    tracemalloc.start()
    traced_before = tracemalloc.get_traced_memory()[0]
    backend = open_store(root)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - traced_before
    tracemalloc.stop()
    backend.close()
    del backend
    gc.collect()
    for _ in range(repeats - 1):
        start = time.perf_counter()
        open_store(root).close()
        open_s.append(time.perf_counter() - start)
    scan_s = [scan_limit(root) for _ in range(repeats)]
    cold: float | None = None
    if drop_caches():
        start = time.perf_counter()
        open_store(root).close()
        cold = time.perf_counter() - start
    return Checkpoint(
        objects=objects,
        open_s=open_s,
        cold_open_s=cold,
        scan_s=scan_s,
        rss_bytes=grown,
        traced_bytes=traced,
        exists_mkeys=exists_mkeys,
        missing_mkeys=missing_mkeys,
    )


def measured_apart(root: Path, objects: int, batch: int, repeats: int) -> Checkpoint:
    """:func:`measure` in a fresh interpreter (its memory owes nothing to the writes)."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        result: Checkpoint = pool.apply(measure, (root, objects, batch, repeats))
    return result


def fill(root: Path, start: int, stop: int, progress: Progress) -> float:
    """Store objects ``start`` to ``stop`` through the backend; returns the seconds taken."""
    spec = ObjectSpec.raw(PAYLOAD)
    payload: Any = (memoryview(bytes(range(PAYLOAD))),)
    began = time.perf_counter()
    with open_store(root) as writer:
        for first in range(start, stop, 1000):
            keys = NAMESPACE.keys([name_of(i) for i in range(first, min(first + 1000, stop))])
            requests = [PutRequest(key=key, spec=spec, buffers=payload) for key in keys]
            if not all(r.ok for r in writer.put_from(requests)):
                raise SystemExit("error: could not store every object")
            if first and first % 100_000 == 0:
                progress.note(f"{first} of {stop} objects written")
    os.sync()
    return time.perf_counter() - began


def spread(samples: list[float], digits: int = 2) -> str:
    """``median (min-max)``."""
    return (
        f"{statistics.median(samples):.{digits}f} "
        f"({min(samples):.{digits}f}-{max(samples):.{digits}f})"
    )


def report(points: list[Checkpoint], repeats: int, batch: int) -> None:
    """Print one row per checkpoint, the growth between them and the goals."""
    print(  # noqa: T201
        f"\n== file backend, one store, {PAYLOAD}-byte objects; median (min-max) of {repeats} =="
    )
    header = (
        f"{'objects':>9} {'open s':>18} {'us/obj':>7} {'py scan s':>18} {'open/scan':>9} "
        f"{'cold s':>7} {'RSS B/obj':>9} {'traced B/obj':>12} {'exists Mkeys/s':>18} "
        f"{'missing':>8}"
    )
    print(header)  # noqa: T201
    print("-" * len(header))  # noqa: T201
    for p in points:
        opened = statistics.median(p.open_s)
        cold = "-" if p.cold_open_s is None else f"{p.cold_open_s:.2f}"
        print(  # noqa: T201
            f"{p.objects:>9} {spread(p.open_s):>18} {opened / p.objects * 1e6:>7.2f} "
            f"{spread(p.scan_s):>18} {opened / statistics.median(p.scan_s):>8.2f}x {cold:>7} "
            f"{p.rss_bytes / p.objects:>9.0f} {p.traced_bytes / p.objects:>12.0f} "
            f"{spread(p.exists_mkeys):>18} {p.missing_mkeys:>8.3f}"
        )
    print(f"exists: prefix_hits in batches of {batch}, all stored (from the index); ")  # noqa: T201
    print("missing: exists of keys never stored (one lstat each), Mkeys/s")  # noqa: T201
    small, large = points[0], points[-1]
    added = large.objects - small.objects
    rss = (large.rss_bytes - small.rss_bytes) / added
    traced = (large.traced_bytes - small.traced_bytes) / added
    per_object_s = (statistics.median(large.open_s) - statistics.median(small.open_s)) / added
    at_goal = statistics.median(large.open_s) + per_object_s * (GOAL_OBJECTS - large.objects)
    print(  # noqa: T201
        f"\ngrowth per object from {small.objects} to {large.objects} objects: "
        f"RSS {rss:.0f} B, traced {traced:.0f} B, open {per_object_s * 1e6:.2f} us"
    )
    index_bytes = max(rss, traced, large.rss_bytes / large.objects)
    print(  # noqa: T201
        goal_verdict(
            f"index < {GOAL_BYTES} B per object",
            f"{index_bytes:.0f} B (the largest of the RSS and traced growth and the RSS per "
            f"object at {large.objects})",
            index_bytes < GOAL_BYTES,
        )
    )
    where = "measured" if large.objects == GOAL_OBJECTS else "extrapolated from the growth"
    print(  # noqa: T201
        goal_verdict(
            f"open of {GOAL_OBJECTS} objects < {GOAL_OPEN_S:.0f} s",
            f"{at_goal:.2f} s ({where})",
            at_goal < GOAL_OPEN_S,
        )
    )


def main() -> None:
    """Parse the options, fill the store in two steps and measure each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=GOAL_OBJECTS, help="objects at the end")
    parser.add_argument("--quick", action="store_true", help="100,000 objects")
    parser.add_argument("--repeats", type=int, default=3, help="opens and exists passes")
    parser.add_argument("--batch", type=int, default=128, help="keys per prefix_hits call")
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR if DEFAULT_DIR.is_dir() else None,
        help=f"where the scratch store goes (default {DEFAULT_DIR}: disk, not tmpfs)",
    )
    args = parser.parse_args()
    total = 100_000 if args.quick else args.objects
    if total < 20 or args.repeats < 1 or args.batch < 1:
        parser.error("--objects must be at least 20; --repeats and --batch at least 1")
    steps = [total // 10, total]
    base = Path(tempfile.mkdtemp(prefix="sglang-storage-scale-", dir=args.dir))
    root = base / "store"
    print(f"command: {shlex.join(sys.orig_argv)}")  # noqa: T201
    print(f"scratch: {base}; cpus: {os.cpu_count()}; ours: io_threads=2, no cap")  # noqa: T201
    points = []
    written = 0
    with Progress(2 * len(steps), "file_scale.py") as progress:
        try:
            for count in steps:
                progress.step(f"write objects {written} to {count}")
                took = fill(root, written, count, progress)
                print(  # noqa: T201
                    f"wrote {count - written} objects in {took:.1f} s "
                    f"({(count - written) / took:.0f} puts/s)"
                )
                written = count
                progress.step(f"measure {count} objects (a fresh process)")
                points.append(measured_apart(root, count, args.batch, args.repeats))
        finally:
            shutil.rmtree(base, ignore_errors=True)
            os.sync()
    report(points, args.repeats, args.batch)


if __name__ == "__main__":
    main()
