"""Our file backend against SGLang 0.5.23's ``HiCacheFile``, side by side in one process.

Run: ``.venv/bin/python benchmarks/file_backend.py`` (``--quick`` for a short run; run it
as root for the cold-cache rows). For each page size it writes the same pages through
both implementations and prints, per row, the median rate of ours and SGLang's over
several repetitions (with the min-max spread), the ratio ours/SGLang (> 1 means ours is
faster), the machine's limit for that operation measured in the same run, ours as a
percentage of that limit and of the memcpy rate, and whether the row's goal (issue 25's:
set >= 1.5x, warm get >= 1.2x and >= 60% of memcpy, cold get >= 1.3x, exists >= 1.5x) is
met. Page sizes 64 KiB, 256 KiB and 1 MiB by default. Rows:

- ``set``: every page written into a fresh store that already holds 256 small objects of
  the same namespace (written untimed: for ours one in each of its 256 fan directories,
  as in any store that has served a while; SGLang's directory holds as many small files),
  in batches of ``--batch`` keys: ours with ``FileBackend.put_from`` (building the
  ``PutRequest``s is timed too), SGLang's with ``HiCacheFile.batch_set``. Limit: one
  plain ``os.write`` per file plus ``os.replace`` into one flat directory, no fsync (1 and
  2 threads, the faster counts).
- ``set new``: the same into an empty store, so ours also creates its fan directories
  (a ``mkdir`` costs about as much as writing a 64 KiB page here); no goal.
- ``get warm``: every page read back with the files in the page cache: ours with
  ``get_into`` (verifying header and xxh3 checksum), SGLang's with ``batch_get``. Limit:
  one ``os.readv`` per file of the same sizes (1 and 2 threads).
- ``get cold``: the same after ``sync; echo 3 > /proc/sys/vm/drop_caches`` before every
  sample (needs root; skipped otherwise, with the reason printed).
- ``exists``: the longest stored prefix of every batch of keys (all present): ours with
  ``prefix_hits``, SGLang's with ``batch_exists``. Limit: one ``os.stat`` per path.

Both implementations move the same bytes: the pages are rows of one host buffer
(allocated with ``torch.empty`` like a host pool, seen as a numpy ``uint8`` array), given
to ours as ``memoryview`` slices and to SGLang as tensor views (bf16, as its KV pages
are). Ours and SGLang's samples are interleaved within each repetition, in alternating
order, to cancel drift; dirty pages are flushed (``sync``) before every sample. The memcpy
limit (torch ``copy_`` of the same bytes, 1 thread and torch's default threads) is
printed for scale.

Two traits of these machines' file system (ext4 without a journal, in a VM) shape the
run: a set sample's files are evicted from the page cache afterwards but only deleted
when the run ends (creating files soon after deleting thousands is ~20x slower), and the
run starts with a probe of the cost of creating a file, waiting up to 150 s for it to
settle when it is high. The scratch directory defaults to ``/var/tmp`` (disk-backed).
Progress (one line per row and page size, and per wait, with the time elapsed) goes to
stderr; the tables go to stdout.

This is a benchmark, not a test: machines are shared and noisy, so read the ratios.
"""

# The per-file loops use raw os calls on str paths, like the backend's own hot path.
# ruff: noqa: PTH105, PTH116, PTH123

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.sglang_pools import build_hicache_file

from sglang_storage.cli.bench_report import Progress
from sglang_storage.core import (
    DataKind,
    GetRequest,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutRequest,
)
from sglang_storage.storage import FileBackend, FileBackendConfig

GIB: Final = float(1 << 30)
DROP_CACHES: Final = "/proc/sys/vm/drop_caches"
SET_BYTES: Final = 256 << 20
"""Default bytes per pass (pages x page size) when ``--pages`` is not given."""
IO_THREADS: Final = 2
DEFAULT_DIR: Final = Path("/var/tmp")
"""Disk-backed by convention (``/tmp`` is often tmpfs, and is churned by test suites)."""
SLOW_CREATE_US: Final = 150.0
SETTLE_S: Final = 150

Rate = Callable[[], float]
"""One timed sample; returns its rate (GiB/s, or M keys/s for ``exists``)."""


class SGLangFile(Protocol):
    """The part of SGLang's ``HiCacheFile`` this benchmark calls (SGLang is untyped)."""

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> bool:
        """Write each key's tensor as one file."""
        ...

    def batch_get(
        self, keys: list[str], target_locations: list[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Read each key's file into its tensor; ``None`` for a miss."""
        ...

    def batch_exists(self, keys: list[str]) -> int:
        """How many leading keys are stored."""
        ...


@attrs.frozen(kw_only=True)
class Goal:
    """The goal of one row."""

    ratio: float | None
    """Ours / SGLang at least this; ``None``: the row has no goal."""
    of_memcpy: float | None = None
    """Ours at least this fraction of the memcpy rate of the same run."""


GOALS: Final[dict[str, Goal]] = {
    "set": Goal(ratio=1.5),
    "set new": Goal(ratio=None),
    "get warm": Goal(ratio=1.2, of_memcpy=0.6),
    "get cold": Goal(ratio=1.3),
    "exists": Goal(ratio=1.5),
}
"""Issue 25's goals (``set new`` has none: it is shown for what a first write costs)."""
SMALL: Final = bytes(64)
"""The payload of each small object a ``set`` store holds before its sample."""
WARM_NAMES: Final = 256
"""Objects written (untimed) into each ``set`` store first, one per fan directory of ours."""


@attrs.define(kw_only=True)
class Row:
    """The samples of one row: ours, SGLang's and the limit candidates."""

    name: str
    unit: str
    ours: list[float] = attrs.field(factory=list)
    sglang: list[float] = attrs.field(factory=list)
    limits: dict[str, list[float]] = attrs.field(factory=dict)

    def limit(self) -> tuple[str, list[float]]:
        """The fastest limit candidate (by median) and its samples."""
        return max(self.limits.items(), key=lambda item: statistics.median(item[1]))


class Pages:
    """``count`` pages of ``page_bytes`` random bytes, and where they are read back into."""

    def __init__(self, count: int, page_bytes: int, seed: int) -> None:
        self.count = count
        self.page_bytes = page_bytes
        self.total = count * page_bytes
        # Host memory as a host pool allocates it (torch.empty, as ``HostMemory`` and
        # SGLang's host pools do), seen through numpy. Not numpy's own allocation: numpy
        # asks for transparent huge pages, and on these VMs the kernel copies into such
        # memory 3x slower (180 vs 50 us per 256 KiB ``readv``), which would cap every row.
        generator = torch.Generator().manual_seed(seed)
        src = torch.empty((count, page_bytes), dtype=torch.uint8)
        src.random_(0, 256, generator=generator)
        dst = torch.empty((count, page_bytes), dtype=torch.uint8)
        self.src: npt.NDArray[np.uint8] = src.numpy()
        self.dst: npt.NDArray[np.uint8] = dst.numpy()
        self.dst.fill(1)  # fault every destination page in before timing
        self.src_views = [memoryview(row) for row in self.src]
        self.dst_views = [memoryview(row) for row in self.dst]
        # Each request's ``buffers``: typed Any because the requests' ``converter=tuple``
        # makes mypy expect an unsolved ``Iterable[_T_co]`` (a typing flaw in core.objects).
        self.src_buffers: list[Any] = [(view,) for view in self.src_views]
        self.dst_buffers: list[Any] = [(view,) for view in self.dst_views]
        self.src_tensors = list(src.view(torch.bfloat16).unbind(0))
        self.dst_tensors = list(dst.view(torch.bfloat16).unbind(0))
        self.names = [
            hashlib.sha256(f"{page_bytes}/{seed}/{i}".encode()).hexdigest() for i in range(count)
        ]
        self.spec = ObjectSpec(dtype="bfloat16", shape=(page_bytes // 2,), layout="page_first")

    def batches(self, batch: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` of each batch of keys."""
        for start in range(0, self.count, batch):
            yield start, min(start + batch, self.count)

    def check_read_back(self, who: str) -> None:
        """Fail loudly unless ``dst`` now holds exactly ``src``."""
        if not np.array_equal(self.src, self.dst):
            bad = int(np.flatnonzero((self.src != self.dst).any(axis=1))[0])
            raise SystemExit(f"error: {who} read back different bytes (first bad page {bad})")
        self.dst.fill(1)


# ---------------------------------------------------------------------- ours


class Ours:
    """Our ``FileBackend`` on the pages; keys are the page hashes in one KV namespace."""

    def __init__(self, pages: Pages, batch: int) -> None:
        self.pages = pages
        self.batch = batch
        namespace = Namespace(model="bench", kind=DataKind.KV)
        self.keys = [ObjectKey(namespace=namespace, name=name) for name in pages.names]

    @staticmethod
    def open(root: Path) -> FileBackend:
        """A backend on ``root`` with two I/O threads (this machine has two cores)."""
        return FileBackend(FileBackendConfig(root=root, io_threads=IO_THREADS))

    def put_all(self, backend: FileBackend) -> int:
        """Write every page in batches; returns how many were stored."""
        pages, keys, spec = self.pages, self.keys, self.pages.spec
        stored = 0
        for start, stop in pages.batches(self.batch):
            requests = [
                PutRequest(key=keys[i], spec=spec, buffers=pages.src_buffers[i])
                for i in range(start, stop)
            ]
            stored += sum(r.ok for r in backend.put_from(requests))
        return stored

    def put_small(self, backend: FileBackend, count: int) -> None:
        """Store ``count`` small objects (other keys, same namespace), each in a new fan.

        With ``count`` >= 256, every fan directory of the namespace exists afterwards.
        """
        namespace = self.keys[0].namespace
        fans: dict[str, ObjectKey] = {}
        spare: list[ObjectKey] = []
        candidate = 0
        while len(fans) + len(spare) < count:
            key = ObjectKey(namespace=namespace, name=f"small-{candidate}")
            candidate += 1
            fan = backend.path_of(key).parent.name
            if fan not in fans:
                fans[fan] = key
            elif len(fans) >= 256:
                spare.append(key)
        spec = ObjectSpec.raw(len(SMALL))
        requests = [
            PutRequest(key=key, spec=spec, buffers=(memoryview(SMALL),))
            for key in [*fans.values(), *spare]
        ]
        if not all(r.ok for r in backend.put_from(requests)):
            raise SystemExit("error: ours could not store the small objects")

    def get_all(self, backend: FileBackend) -> int:
        """Read every page in batches into ``dst``; returns how many were hits."""
        pages, keys, spec = self.pages, self.keys, self.pages.spec
        hits = 0
        for start, stop in pages.batches(self.batch):
            requests = [
                GetRequest(key=keys[i], spec=spec, buffers=pages.dst_buffers[i])
                for i in range(start, stop)
            ]
            hits += sum(r.hit for r in backend.get_into(requests))
        return hits

    def prefix_all(self, backend: FileBackend) -> int:
        """``prefix_hits`` of every batch; returns the sum."""
        return sum(
            backend.prefix_hits(self.keys[start:stop])
            for start, stop in self.pages.batches(self.batch)
        )


# ---------------------------------------------------------------------- SGLang


def open_sglang(directory: Path) -> SGLangFile:
    """SGLang's ``HiCacheFile`` on ``directory``, as SGLang's factory builds it for TP 1."""
    store: Any = build_hicache_file(directory, model_name="bench")
    if store.metadata_cache is not None or store._evictor.enabled:
        raise SystemExit("error: HiCacheFile did not come up with its default settings")
    return store  # type: ignore[no-any-return]


class Theirs:
    """SGLang's ``HiCacheFile`` on the same pages, keyed by the same page hashes."""

    def __init__(self, pages: Pages, batch: int) -> None:
        self.pages = pages
        self.batch = batch

    def put_all(self, store: SGLangFile) -> int:
        """``batch_set`` of every batch; returns how many pages were in batches that succeeded."""
        pages = self.pages
        stored = 0
        for start, stop in pages.batches(self.batch):
            if store.batch_set(pages.names[start:stop], values=pages.src_tensors[start:stop]):
                stored += stop - start
        return stored

    def put_small(self, store: SGLangFile, count: int) -> None:
        """Store ``count`` small objects under other keys."""
        if count == 0:
            return
        values = [torch.zeros(len(SMALL) // 2, dtype=torch.bfloat16) for _ in range(count)]
        if not store.batch_set([f"small-{i}" for i in range(count)], values=values):
            raise SystemExit("error: SGLang could not store the small objects")

    def get_all(self, store: SGLangFile) -> int:
        """``batch_get`` of every batch into ``dst``; returns how many were found."""
        pages = self.pages
        hits = 0
        for start, stop in pages.batches(self.batch):
            got = store.batch_get(
                pages.names[start:stop], target_locations=pages.dst_tensors[start:stop]
            )
            hits += sum(t is not None for t in got)
        return hits

    def prefix_all(self, store: SGLangFile) -> int:
        """``batch_exists`` of every batch; returns the sum."""
        pages = self.pages
        return sum(
            store.batch_exists(pages.names[start:stop]) for start, stop in pages.batches(self.batch)
        )


# ---------------------------------------------------------------------- limits


class Plain:
    """The machine's limits: the plainest os calls that do the same file work."""

    def __init__(self, pages: Pages, pool: ThreadPoolExecutor) -> None:
        self.pages = pages
        self.pool = pool

    def _spread(self, threads: int, work: Callable[[int, int], None]) -> None:
        """Run ``work(start, stop)`` over the pages, split over ``threads`` threads."""
        count = self.pages.count
        if threads == 1:
            work(0, count)
            return
        half = count // 2
        future = self.pool.submit(work, half, count)
        work(0, half)
        future.result()

    def write(self, directory: str, threads: int) -> None:
        """One file per page: ``os.write`` (no fsync) then ``os.replace`` into place."""
        views = self.pages.src_views

        def work(start: int, stop: int) -> None:
            for i in range(start, stop):
                tmp = f"{directory}/.{i}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    view = views[i]
                    while view.nbytes:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
                os.replace(tmp, f"{directory}/{i}.bin")

        self._spread(threads, work)

    def read(self, directory: str, threads: int) -> None:
        """One ``os.readv`` per file straight into its page of ``dst``."""
        views = self.pages.dst_views

        def work(start: int, stop: int) -> None:
            for i in range(start, stop):
                fd = os.open(f"{directory}/{i}.bin", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if os.readv(fd, [views[i]]) != views[i].nbytes:
                        raise SystemExit(f"error: short read of {directory}/{i}.bin")
                finally:
                    os.close(fd)

        self._spread(threads, work)

    def stat(self, directory: str) -> None:
        """One ``os.stat`` per file."""
        for i in range(self.pages.count):
            os.stat(f"{directory}/{i}.bin")


def memcpy_rate(pages: Pages, threads: int, repeats: int) -> float:
    """Median GiB/s of torch ``copy_`` of the pages' bytes into pre-faulted memory."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src, dst = torch.from_numpy(pages.src), torch.from_numpy(pages.dst)
        dst.copy_(src)
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            rates.append(pages.total / GIB / (time.perf_counter() - start))
        pages.dst.fill(1)
        return statistics.median(rates)
    finally:
        torch.set_num_threads(saved)


# ---------------------------------------------------------------------- harness


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache, dentries and inodes."""
    os.sync()
    with open(DROP_CACHES, "w") as control:
        control.write("3\n")


def cold_cache_support() -> str | None:
    """Why the cold rows cannot run here, or ``None`` when they can."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}); dropping the page cache needs root"
    if not os.access(DROP_CACHES, os.W_OK):
        return f"{DROP_CACHES} is not writable"
    try:
        drop_caches()
    except OSError as error:
        return f"writing {DROP_CACHES} failed: {error}"
    return None


def timed(before: Callable[[], None], run: Callable[[], int], expect: int, nbytes: float) -> float:
    """Run ``before`` (untimed), then time ``run``; its count must equal ``expect``."""
    before()
    gc.collect()
    start = time.perf_counter()
    done = run()
    elapsed = time.perf_counter() - start
    if done != expect:
        raise SystemExit(f"error: a timed pass completed {done} of {expect} operations")
    return nbytes / elapsed


def sample(rows: list[tuple[list[float], Rate]], repeats: int) -> None:
    """``repeats`` samples of every candidate, interleaved; the order alternates per repeat."""
    for repeat in range(repeats):
        order = rows if repeat % 2 == 0 else rows[::-1]
        for samples, rate in order:
            samples.append(rate())


class Bench:
    """Every row for one page size, in a scratch directory under ``base``."""

    def __init__(
        self,
        pages: Pages,
        args: argparse.Namespace,
        base: Path,
        *,
        cold: bool,
        keep: bool,
        progress: Progress,
    ) -> None:
        self.pages = pages
        self.args = args
        self.progress = progress
        self.base = base
        self.cold = cold
        self.keep = keep
        self.ours = Ours(pages, args.batch)
        self.theirs = Theirs(pages, args.batch)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-limit")
        self.plain = Plain(pages, self.pool)
        self.fresh = 0
        base.mkdir(parents=True, exist_ok=True)

    def _dir(self, label: str) -> Path:
        self.fresh += 1
        return self.base / f"{label}-{self.fresh}"

    def verify(self) -> tuple[FileBackend, SGLangFile, str]:
        """Write the read-back stores once and check both return exactly the bytes written."""
        pages, count = self.pages, self.pages.count
        ours = Ours.open(self._dir("ours-read"))
        if self.ours.put_all(ours) != count or self.ours.get_all(ours) != count:
            raise SystemExit("error: ours did not store and find every page")
        pages.check_read_back("ours")
        sizes = {e.stat().st_size for e in (ours.root / "objects").rglob("*") if e.is_file()}
        if len(sizes) != 1 or min(sizes) < pages.page_bytes:
            raise SystemExit(f"error: ours wrote files of sizes {sorted(sizes)}")
        theirs = open_sglang(self._dir("sglang-read"))
        if self.theirs.put_all(theirs) != count or self.theirs.get_all(theirs) != count:
            raise SystemExit("error: SGLang did not store and find every page")
        pages.check_read_back("SGLang")
        plain = self._dir("plain-read")
        plain.mkdir()
        self.plain.write(str(plain), 1)
        self.plain.read(str(plain), 1)
        pages.check_read_back("plain readv")
        return ours, theirs, str(plain)

    def _discard(self, directory: Path) -> None:
        """Put a set sample's files out of the way of the next sample.

        They are flushed and evicted from the page cache, so every sample writes into
        recycled memory as a server with a full page cache does (on these VMs a page
        cache that keeps growing into never-used memory made writes 5x slower as the run
        went on). Then they are kept until the run ends, or deleted now when the disk is
        short (see ``keep``).
        """
        os.sync()
        for parent, _, files in os.walk(directory):
            for name in files:
                fd = os.open(f"{parent}/{name}", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        if not self.keep:
            shutil.rmtree(directory)

    def set_row(self, *, new: bool) -> Row:
        """Row ``set`` (or ``set new``): each sample writes every page into a fresh store.

        ``set``: the store already holds :data:`WARM_NAMES` small objects of the same
        namespace (written untimed; for ours one in each of its 256 fan directories), as a
        store that has served for a while does; SGLang's directory and the plain limit's
        hold as many small files. ``set new``: an empty store, whose first writes also
        create our fan directories.
        """
        row = Row(name="set new" if new else "set", unit="GiB/s")
        total = self.pages.total / GIB
        count = self.pages.count
        warm = 0 if new else WARM_NAMES

        def ours() -> float:
            backend = Ours.open(self._dir("ours-set"))
            try:
                self.ours.put_small(backend, warm)
                return timed(os.sync, lambda: self.ours.put_all(backend), count, total)
            finally:
                backend.close()
                self._discard(backend.root)

        def theirs() -> float:
            directory = self._dir("sglang-set")
            store = open_sglang(directory)
            try:
                self.theirs.put_small(store, warm)
                return timed(os.sync, lambda: self.theirs.put_all(store), count, total)
            finally:
                self._discard(directory)

        def plain(threads: int) -> Rate:
            def go() -> float:
                directory = self._dir("plain-set")
                directory.mkdir()
                for i in range(warm):
                    (directory / f"small-{i}.bin").write_bytes(SMALL)

                def run() -> int:
                    self.plain.write(str(directory), threads)
                    return count

                try:
                    return timed(os.sync, run, count, total)
                finally:
                    self._discard(directory)

            return go

        row.limits = {"write 1 thread": [], "write 2 threads": []}
        sample(
            [
                (row.ours, ours),
                (row.sglang, theirs),
                (row.limits["write 1 thread"], plain(1)),
                (row.limits["write 2 threads"], plain(2)),
            ],
            self.args.repeats,
        )
        os.sync()
        return row

    def get_row(self, stores: tuple[FileBackend, SGLangFile, str], *, cold: bool) -> Row:
        """Row ``get warm`` or ``get cold`` from the read-back stores."""
        ours, theirs, plain_dir = stores
        row = Row(name="get cold" if cold else "get warm", unit="GiB/s")
        total = self.pages.total / GIB
        count = self.pages.count
        before = drop_caches if cold else os.sync

        def plain(threads: int) -> Rate:
            def run() -> int:
                self.plain.read(plain_dir, threads)
                return count

            return lambda: timed(before, run, count, total)

        candidates: list[tuple[list[float], Rate]] = [
            (row.ours, lambda: timed(before, lambda: self.ours.get_all(ours), count, total)),
            (row.sglang, lambda: timed(before, lambda: self.theirs.get_all(theirs), count, total)),
        ]
        row.limits = {"readv 1 thread": [], "readv 2 threads": []}
        candidates += [
            (row.limits["readv 1 thread"], plain(1)),
            (row.limits["readv 2 threads"], plain(2)),
        ]
        if not cold:
            for _, rate in candidates:  # bring everything into the page cache
                rate()
        sample(candidates, self.args.repeats)
        self.pages.check_read_back("the last timed pass")
        return row

    def exists_row(self, stores: tuple[FileBackend, SGLangFile, str]) -> Row:
        """Row ``exists``: longest stored prefix of every batch (every key is stored)."""
        ours, theirs, plain_dir = stores
        row = Row(name="exists", unit="Mkeys/s")
        count = self.pages.count
        loops = max(1, 20_000 // count)
        mkeys = loops * count / 1e6

        def repeat(once: Callable[[], int]) -> Callable[[], int]:
            return lambda: sum(once() for _ in range(loops))

        def plain() -> int:
            for _ in range(loops):
                self.plain.stat(plain_dir)
            return loops * count

        def no_setup() -> None:
            return None

        row.limits = {"stat 1 thread": []}
        candidates: list[tuple[list[float], Rate]] = [
            (
                row.ours,
                lambda: timed(
                    no_setup, repeat(lambda: self.ours.prefix_all(ours)), loops * count, mkeys
                ),
            ),
            (
                row.sglang,
                lambda: timed(
                    no_setup,
                    repeat(lambda: self.theirs.prefix_all(theirs)),
                    loops * count,
                    mkeys,
                ),
            ),
            (row.limits["stat 1 thread"], lambda: timed(no_setup, plain, loops * count, mkeys)),
        ]
        for _, rate in candidates:
            rate()
        sample(candidates, self.args.repeats)
        return row

    def _step(self, row: str) -> None:
        self.progress.step(f"{self.pages.page_bytes >> 10} KiB pages: {row}")

    def run(self) -> list[Row]:
        """Every row, then clean up; one progress step per row."""
        self._step("write and verify the read-back stores")
        stores = self.verify()
        try:
            self._step("set")
            rows = [self.set_row(new=False)]
            self._step("set new")
            rows.append(self.set_row(new=True))
            self._step("get warm")
            rows.append(self.get_row(stores, cold=False))
            if self.cold:
                self._step("get cold")
                rows.append(self.get_row(stores, cold=True))
            self._step("exists")
            rows.append(self.exists_row(stores))
            return rows
        finally:
            stores[0].close()
            self.pool.shutdown()


# ---------------------------------------------------------------------- output


def spread(samples: Sequence[float]) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(samples):6.2f} ({min(samples):.2f}-{max(samples):.2f})"


def print_table(title: str, rows: list[Row], memcpy: float) -> list[str]:
    """Print one page size's table; returns one ``row ratio/%limit met|not met`` per row."""
    print(f"\n{title}")  # noqa: T201
    header = (
        f"{'row':<9} {'unit':<8} {'ours':>20} {'sglang':>20} {'ratio':>7} "
        f"{'limit':>20} {'ours/lim':>8} {'/memcpy':>7}  {'goal':<18} met"
    )
    print(header)  # noqa: T201
    print("-" * len(header))  # noqa: T201
    verdicts = []
    for row in rows:
        ours, theirs = statistics.median(row.ours), statistics.median(row.sglang)
        _, limit_samples = row.limit()
        limit = statistics.median(limit_samples)
        ratio, of_limit = ours / theirs, ours / limit
        of_memcpy = ours / memcpy if row.unit == "GiB/s" else None
        goal = GOALS[row.name]
        if goal.ratio is None:
            wanted, met = "-", None
        else:
            wanted = f">={goal.ratio:.1f}x"
            met = ratio >= goal.ratio
            if goal.of_memcpy is not None:
                wanted += f", >={goal.of_memcpy:.0%} memcpy"
                met = met and of_memcpy is not None and of_memcpy >= goal.of_memcpy
        shown = "-" if of_memcpy is None else f"{of_memcpy:.0%}"
        print(  # noqa: T201
            f"{row.name:<9} {row.unit:<8} {spread(row.ours):>20} {spread(row.sglang):>20} "
            f"{ratio:>6.2f}x {spread(limit_samples):>20} {of_limit:>8.0%} {shown:>7}  "
            f"{wanted:<18} {'-' if met is None else 'yes' if met else 'no'}"
        )
        verdict = "no goal" if met is None else "met" if met else "not met"
        extra = "" if of_memcpy is None else f"/{of_memcpy:.0%}memcpy"
        verdicts.append(f"{row.name} {ratio:.2f}x/{of_limit:.0%}lim{extra} {verdict}")
    print("limit candidates (median, min-max; the fastest is the row's limit):")  # noqa: T201
    for row in rows:
        for name, samples in row.limits.items():
            print(f"  {row.name:<9} {name:<16} {spread(samples)} {row.unit}")  # noqa: T201
    return verdicts


def create_probe(base: Path, count: int = 256) -> float:
    """Microseconds per creation of an empty file under ``base`` (kept until cleanup)."""
    directory = Path(tempfile.mkdtemp(prefix="create-probe-", dir=base))
    start = time.perf_counter()
    for i in range(count):
        os.close(os.open(f"{directory}/{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return (time.perf_counter() - start) / count * 1e6


def mount_of(path: Path) -> str:
    """``device on mountpoint type fstype`` of the file system holding ``path``."""
    best = ("?", "/", "?")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, point, fstype, *_ = line.split()
                if str(path).startswith(point.rstrip("/") + "/") and len(point) >= len(best[1]):
                    best = (device, point, fstype)
    except OSError:
        pass
    return f"{best[0]} on {best[1]} type {best[2]}"


def main() -> None:
    """Parse the options, run every page size and print the tables and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, help="pages per pass (default: 256 MiB worth)")
    parser.add_argument("--page-kib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5, help="samples per row (median)")
    parser.add_argument("--batch", type=int, default=128, help="keys per call (SGLang's 128)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR if DEFAULT_DIR.is_dir() else None,
        help=f"where the scratch directory goes (default {DEFAULT_DIR}: disk, not tmpfs)",
    )
    parser.add_argument("--no-drop-caches", action="store_true", help="skip the cold rows")
    parser.add_argument("--quick", action="store_true", help="64 MiB passes, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 3)
    set_bytes = SET_BYTES // 4 if args.quick else SET_BYTES

    skip_cold = "--no-drop-caches was given" if args.no_drop_caches else cold_cache_support()
    progress = Progress(len(args.page_kib) * (6 if skip_cold is None else 5), "file_backend.py")
    base = Path(tempfile.mkdtemp(prefix="sglang-storage-bench-", dir=args.dir))
    command = shlex.join(sys.orig_argv)
    print(f"command: {command}")  # noqa: T201
    print(  # noqa: T201
        f"scratch: {base} ({mount_of(base)}); cpus: {os.cpu_count()}; "
        f"torch threads: {torch.get_num_threads()}; ours: io_threads={IO_THREADS}"
    )
    # Every set sample writes a pass into a fresh directory. Keeping them until the end
    # avoids deleting thousands of files mid-run: ext4 without a journal skips inodes freed
    # in the last 60 s (360 s while unsynced) when it allocates new ones, which made file
    # creation 30x slower on these machines after a deletion burst.
    passes = len(args.page_kib) * (8 * args.repeats + 3)
    needed = passes * (args.pages * max(args.page_kib) << 10 if args.pages else set_bytes)
    keep = shutil.disk_usage(base).free > 2 * needed
    probe = create_probe(base)
    waited = 0
    while probe > SLOW_CREATE_US and waited < SETTLE_S:
        # ext4 without a journal skips inodes freed in the last minute or so when it
        # allocates new ones; after a burst of deletions (a previous run's cleanup, a
        # test suite) creating a file costs ~20x more for 60-100 s. Wait it out.
        progress.note(
            f"creating a file takes {probe:.0f} us here; waiting for it to settle "
            f"({waited} s of at most {SETTLE_S} s so far)"
        )
        time.sleep(15)
        waited += 15
        probe = create_probe(base)
    print(  # noqa: T201
        f"file creation here: {probe:.0f} us per empty file"
        + (f" (after waiting {waited} s for it to settle)" if waited else "")
        + "; set passes are "
        + (
            f"kept until the end ({needed / GIB:.1f} GiB)"
            if keep
            else "deleted after each sample (too little free space to keep them)"
        )
    )
    if probe > SLOW_CREATE_US:
        print(  # noqa: T201
            f"warning: creating a file still takes {probe:.0f} us here (~35 us when settled): "
            "many recently deleted files near this directory slow ext4 down, and the set "
            "row will be low for everyone; use --dir elsewhere or run again later."
        )
    if skip_cold is not None:
        print(f"cold rows skipped: {skip_cold}")  # noqa: T201
    summary = []
    try:
        for kib in args.page_kib:
            page_bytes = kib << 10
            count = args.pages or max(1, set_bytes // page_bytes)
            pages = Pages(count, page_bytes, seed=kib)
            copy_1 = memcpy_rate(pages, 1, args.repeats)
            copy_n = memcpy_rate(pages, torch.get_num_threads(), args.repeats)
            bench = Bench(
                pages,
                args,
                base / f"{kib}k",
                cold=skip_cold is None,
                keep=keep,
                progress=progress,
            )
            rows = bench.run()
            title = (
                f"== {kib} KiB pages: {count} pages, {pages.total / GIB:.3f} GiB per pass, "
                f"batches of {args.batch}, median (min-max) of {args.repeats} ==\n"
                f"memcpy (torch copy_): {copy_1:.2f} GiB/s 1 thread, {copy_n:.2f} GiB/s "
                f"{torch.get_num_threads()} threads -> memcpy {max(copy_1, copy_n):.2f} GiB/s"
            )
            verdicts = print_table(title, rows, max(copy_1, copy_n))
            summary.append(f"{kib} KiB: " + ", ".join(verdicts))
            del pages
            gc.collect()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        os.sync()  # a clean inode table lets the next run reuse these inodes sooner
    progress.close()
    print(f"summary [{command}]: " + "; ".join(summary))  # noqa: T201


if __name__ == "__main__":
    main()
