"""The measurements behind ``sglang-storage bench``.

- :func:`measure_limits` - the machine's limits, measured in the run: memcpy (one large
  torch ``copy_``), sequential disk write (``os.write`` then ``fsync``) and sequential
  cold read (``posix_fadvise(DONTNEED)`` after ``fsync``, then ``readv``) in the bench
  directory.
- :class:`BenchRunner` - for every point (page size, batch size) of the sweep, put, get
  (warm and cold) and exists of the same pages through our backend and, when one is
  given, a :class:`~sglang_storage.cli.bench_baseline.BenchBaseline`, their samples
  interleaved in alternating order so both see the same machine. It reports each phase
  of a point (:meth:`BenchSettings.phases`) as it starts, for progress output.

Every rate is a list of samples (``repeats`` timed passes with ``time.perf_counter``);
callers report medians with the spread (``low``/``high``: the slowest and fastest pass).
Every pass must complete every page (a short count is a :class:`BenchFailedError`) and
read-back bytes are compared with what was written.
"""

from __future__ import annotations

import enum
import gc
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, Protocol, cast

import attrs
import torch

from sglang_storage.cli.bench_baseline import BaselineEntry, BenchBaseline
from sglang_storage.core import (
    DataKind,
    GetRequest,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
)
from sglang_storage.errors import StorageError
from sglang_storage.memory.tensors import tensor_bytes
from sglang_storage.storage import Backend, MemoryRegistrar

__all__ = [
    "GIB",
    "SLOW_CREATE_US",
    "BenchFailedError",
    "BenchResult",
    "BenchRunner",
    "BenchSettings",
    "Limit",
    "MachineLimits",
    "Measurement",
    "Op",
    "Point",
    "Reads",
    "create_cost_us",
    "drop_page_cache",
    "measure_limits",
]

GIB: Final = float(1 << 30)
_CHUNK: Final = 8 << 20
"""Bytes per system call of the disk limit measurements."""
SLOW_CREATE_US: Final = 150.0
"""Creating an empty file costs ~35 us on these machines' ext4 when settled; for a minute
or two after many files were deleted nearby (the end of a previous run) it costs up to
20x more, and every put would measure that."""
_EXISTS_KEYS: Final = 20_000
"""Keys an ``exists`` sample asks about at least (whole passes over the pages, at most 200)."""


class BenchFailedError(StorageError):
    """A timed pass did not do what it was asked (a short count, or wrong bytes read back)."""


class Op(enum.Enum):
    """An operation the benchmark times."""

    PUT = "put"
    GET = "get"
    EXISTS = "exists"


class Reads(enum.Enum):
    """Whether a read pass finds its files in the page cache."""

    WARM = "warm"
    COLD = "cold"
    """Each file's pages dropped from the page cache (fdatasync, then POSIX_FADV_DONTNEED)."""


@attrs.frozen(kw_only=True, order=True)
class Point:
    """One point of the sweep: page size and keys per call."""

    page_bytes: int
    batch: int

    @property
    def label(self) -> str:
        """``p<page bytes>-b<batch>``, unique per point and usable as a directory name."""
        return f"p{self.page_bytes}-b{self.batch}"


@attrs.frozen(kw_only=True)
class BenchSettings:
    """What one ``sglang-storage bench`` run measures (validated by the command line)."""

    backend: str
    """Our backend's registered name."""
    page_sizes: tuple[int, ...]
    """Page sizes in bytes; the first is held fixed while batch sizes vary."""
    batch_sizes: tuple[int, ...]
    """Keys per call; the first is held fixed while page sizes vary."""
    concurrency: int
    """Threads issuing batches at once (the batches of a pass are dealt out round robin)."""
    total_bytes: int
    """Bytes per pass; a pass moves ``total_bytes // page_bytes`` pages (at least one)."""
    repeats: int
    """Timed passes per measurement."""
    ops: tuple[Op, ...]
    reads: tuple[Reads, ...]
    limit_bytes: int
    """Bytes of the memcpy and disk limit measurements."""
    seed: int

    def points(self) -> list[Point]:
        """Each page size at the first batch size, then each other batch at the first page size."""
        points = [Point(page_bytes=size, batch=self.batch_sizes[0]) for size in self.page_sizes]
        points += [Point(page_bytes=self.page_sizes[0], batch=b) for b in self.batch_sizes[1:]]
        return points

    def pages_at(self, point: Point) -> int:
        """How many pages one pass moves at ``point``."""
        return max(1, self.total_bytes // point.page_bytes)

    def phases(self) -> tuple[str, ...]:
        """The phases of every point, in the order they run.

        The puts (one untimed pass when put is not measured: the reads and exists need the
        pages), each get, exists.
        """
        phases = ["put" if Op.PUT in self.ops else "put (untimed, for the reads)"]
        if Op.GET in self.ops:
            phases += [f"get {reads.value}" for reads in self.reads]
        if Op.EXISTS in self.ops:
            phases.append("exists")
        return tuple(phases)


@attrs.frozen(kw_only=True)
class Limit:
    """One machine limit: its samples in GiB/s."""

    name: str
    samples: tuple[float, ...]
    nbytes: int

    @property
    def median(self) -> float:
        """The median sample."""
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        """The lowest sample (the slowest pass)."""
        return min(self.samples)

    @property
    def high(self) -> float:
        """The highest sample (the fastest pass)."""
        return max(self.samples)


@attrs.frozen(kw_only=True)
class MachineLimits:
    """The machine's limits measured in the run."""

    memcpy: Limit
    disk_write: Limit
    """Sequential write of one file, ``fsync`` included."""
    disk_read: Limit
    """Sequential read of one file whose pages were dropped from the page cache."""
    directory: Path
    """Where the disk limits were measured (the bench directory)."""
    torch_threads: int


@attrs.frozen(kw_only=True)
class Measurement:
    """The samples of one operation by one side at one point."""

    side: str
    """``"ours"`` or ``"baseline"``."""
    name: str
    """The backend's or baseline's name."""
    op: Op
    reads: Reads | None
    """For ``get``: warm or cold; ``None`` otherwise."""
    point: Point
    pages: int
    concurrency: int
    samples: tuple[float, ...]
    on_disk: bool
    """The side keeps its pages in local files (so the disk limits apply to it)."""

    @property
    def unit(self) -> str:
        """``GiB/s`` for put and get, ``Mkeys/s`` for exists."""
        return "Mkeys/s" if self.op is Op.EXISTS else "GiB/s"

    @property
    def median(self) -> float:
        """The median sample."""
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        """The lowest sample (the slowest pass)."""
        return min(self.samples)

    @property
    def high(self) -> float:
        """The highest sample (the fastest pass)."""
        return max(self.samples)

    @property
    def row(self) -> str:
        """``put``, ``get warm``, ``get cold`` or ``exists``."""
        return self.op.value if self.reads is None else f"{self.op.value} {self.reads.value}"


@attrs.frozen(kw_only=True)
class BenchResult:
    """Everything one run measured."""

    settings: BenchSettings
    limits: MachineLimits
    ours: str
    baseline: str | None
    measurements: tuple[Measurement, ...]
    notes: tuple[str, ...]
    """What was skipped and why, and other facts a reader needs."""

    def find(self, side: str, row: str, point: Point) -> Measurement | None:
        """The measurement of ``side`` for ``row`` (``"get cold"``, ...) at ``point``."""
        for m in self.measurements:
            if m.side == side and m.row == row and m.point == point:
                return m
        return None

    def ratio(self, row: str, point: Point) -> float | None:
        """Ours / baseline medians for ``row`` at ``point`` (> 1: ours is faster)."""
        ours, theirs = self.find("ours", row, point), self.find("baseline", row, point)
        if ours is None or theirs is None:
            return None
        return ours.median / theirs.median

    def of_limit(self, m: Measurement) -> tuple[float | None, float | None]:
        """``m``'s median as fractions of memcpy and of the disk limit that bounds it.

        Put is set against the disk write limit and a cold get against the cold read
        limit, for sides that keep pages in local files; a warm get (bounded by memcpy,
        not the disk) and exists (no bytes moved) have no disk fraction.
        """
        if m.op is Op.EXISTS:
            return None, None
        memcpy = m.median / self.limits.memcpy.median
        if not m.on_disk or m.reads is Reads.WARM:
            return memcpy, None
        disk = self.limits.disk_write if m.op is Op.PUT else self.limits.disk_read
        return memcpy, m.median / disk.median

    def rows(self) -> list[str]:
        """The rows measured, in the order they are reported."""
        order = ["put", "get warm", "get cold", "exists"]
        present = {m.row for m in self.measurements}
        return [row for row in order if row in present]


# ---------------------------------------------------------------------- limits


def drop_page_cache(directory: Path, clean: set[str]) -> int:
    """Drop from the page cache every file under ``directory``; returns how many.

    A file not in ``clean`` is flushed first (``fdatasync``: ``POSIX_FADV_DONTNEED`` drops
    only clean pages) and added to it; pass the same set for the same files each time, so
    each file is flushed once, after it is written, and nothing outside ``directory`` is.
    """
    dropped = 0
    for parent, _, files in os.walk(directory):
        for name in files:
            path = f"{parent}/{name}"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # a temporary file renamed away meanwhile
            try:
                if path not in clean:
                    os.fdatasync(fd)
                    clean.add(path)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            dropped += 1
    return dropped


def _memcpy(nbytes: int, repeats: int) -> Limit:
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # fault every destination page in before timing
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(nbytes / GIB / (time.perf_counter() - start))
    return Limit(name="memcpy (torch copy_)", samples=tuple(samples), nbytes=nbytes)


def _disk(directory: Path, nbytes: int, repeats: int) -> tuple[Limit, Limit]:
    block = torch.randint(0, 256, (_CHUNK,), dtype=torch.uint8, generator=torch.Generator())
    chunk = tensor_bytes(block)
    sink = tensor_bytes(torch.empty(_CHUNK, dtype=torch.uint8))
    writes, reads = [], []
    for rep in range(repeats):
        path = f"{directory}/disk-limit-{rep}.bin"
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            left = nbytes
            while left:
                left -= os.write(fd, chunk[: min(left, _CHUNK)])
            os.fsync(fd)
        finally:
            os.close(fd)
        writes.append(nbytes / GIB / (time.perf_counter() - start))
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            done = 0
            while (got := os.readv(fd, [sink])) > 0:
                done += got
            reads.append(nbytes / GIB / (time.perf_counter() - start))
        finally:
            os.close(fd)
            Path(path).unlink()
        if done != nbytes:
            raise BenchFailedError(f"disk limit: read back {done} of {nbytes} bytes of {path}")
    return (
        Limit(name="disk write (write + fsync)", samples=tuple(writes), nbytes=nbytes),
        Limit(name="disk read, cold (readv)", samples=tuple(reads), nbytes=nbytes),
    )


def create_cost_us(directory: Path, count: int = 256) -> float:
    """Microseconds per creation of an empty file in a new directory under ``directory``.

    The files stay (deleting them would slow the next creations down; see
    :data:`SLOW_CREATE_US`).
    """
    probe = Path(tempfile.mkdtemp(prefix="create-probe-", dir=directory))
    start = time.perf_counter()
    for i in range(count):
        os.close(os.open(f"{probe}/{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC))
    return (time.perf_counter() - start) / count * 1e6


def measure_limits(directory: Path, nbytes: int, repeats: int) -> MachineLimits:
    """Measure memcpy and sequential disk write/read of ``nbytes`` under ``directory``."""
    memcpy = _memcpy(nbytes, repeats)
    gc.collect()
    write, read = _disk(directory, nbytes, repeats)
    return MachineLimits(
        memcpy=memcpy,
        disk_write=write,
        disk_read=read,
        directory=directory,
        torch_threads=torch.get_num_threads(),
    )


# ---------------------------------------------------------------------- pages and sides


class Pages:
    """``count`` pages of random bytes (rows of one host buffer) and where they are read into."""

    def __init__(self, count: int, page_bytes: int, seed: int) -> None:
        self.count = count
        self.page_bytes = page_bytes
        self.seed = seed
        generator = torch.Generator().manual_seed(seed)
        # torch.empty, as host pools allocate (numpy's allocator asks for huge pages).
        self.src = torch.empty((count, page_bytes), dtype=torch.uint8)
        self.src.random_(0, 256, generator=generator)
        self.dst = torch.empty((count, page_bytes), dtype=torch.uint8)
        self.dst.fill_(1)  # fault every destination page in before timing
        self.src_tensors = list(self.src.unbind(0))
        self.dst_tensors = list(self.dst.unbind(0))
        # Each request's ``buffers`` is typed Any: the requests' ``converter=tuple`` makes
        # mypy expect an unsolved ``Iterable[_T_co]``.
        self.src_buffers: list[Any] = [(tensor_bytes(row),) for row in self.src_tensors]
        self.dst_buffers: list[Any] = [(tensor_bytes(row),) for row in self.dst_tensors]

    @property
    def nbytes(self) -> int:
        """Bytes per pass."""
        return self.count * self.page_bytes

    def names(self, generation: int) -> list[str]:
        """Unique page names (hex digests) of one generation of writes."""
        prefix = f"{self.seed}/{self.page_bytes}/{generation}/"
        return [hashlib.sha256(f"{prefix}{i}".encode()).hexdigest() for i in range(self.count)]

    def check_read_back(self, who: str) -> None:
        """Raise unless ``dst`` holds exactly ``src``; then clear ``dst``."""
        if not torch.equal(self.src, self.dst):
            bad = int(torch.nonzero((self.src != self.dst).any(dim=1))[0])
            raise BenchFailedError(f"{who} read back different bytes (first bad page {bad})")
        self.dst.fill_(1)


class _Side(Protocol):
    """One implementation under test, on one :class:`Pages`."""

    side: str
    name: str
    local_dir: Path | None
    """Where its files are, when they are local files (cold reads apply)."""

    def use(self, names: list[str]) -> None:
        """Address the pages by ``names`` from now on (untimed)."""
        ...

    def put(self, start: int, stop: int) -> int:
        """Store pages ``start:stop``; returns how many were written."""
        ...

    def get(self, start: int, stop: int) -> int:
        """Read pages ``start:stop`` into ``dst``; returns how many were found."""
        ...

    def exists(self, start: int, stop: int) -> int:
        """The longest stored prefix of pages ``start:stop``."""
        ...

    def close(self) -> None:
        """Release the implementation."""
        ...


class _Ours:
    """Our backend on the pages; keys are the page names in one KV namespace."""

    side = "ours"

    def __init__(self, backend: Backend, pages: Pages, local_dir: Path | None) -> None:
        self.name = backend.name
        self.local_dir = local_dir
        self._backend = backend
        self._pages = pages
        self._namespace = Namespace(model="sglang-storage-bench", kind=DataKind.KV)
        self._spec = ObjectSpec.raw(pages.page_bytes)
        self._keys: list[ObjectKey] = []
        self._registered: list[memoryview] = []
        if backend.capabilities.registers_memory:
            registrar = cast(MemoryRegistrar, backend)
            for tensor in (pages.src, pages.dst):
                view = tensor_bytes(tensor)
                registrar.register_memory(view)
                self._registered.append(view)

    def use(self, names: list[str]) -> None:
        self._keys = [self._namespace.key(name) for name in names]

    def put(self, start: int, stop: int) -> int:
        keys, spec, buffers = self._keys, self._spec, self._pages.src_buffers
        requests = [
            PutRequest(key=keys[i], spec=spec, buffers=buffers[i]) for i in range(start, stop)
        ]
        return sum(r.outcome is PutOutcome.STORED for r in self._backend.put_from(requests))

    def get(self, start: int, stop: int) -> int:
        keys, spec, buffers = self._keys, self._spec, self._pages.dst_buffers
        requests = [
            GetRequest(key=keys[i], spec=spec, buffers=buffers[i]) for i in range(start, stop)
        ]
        return sum(r.hit for r in self._backend.get_into(requests))

    def exists(self, start: int, stop: int) -> int:
        return self._backend.prefix_hits(self._keys[start:stop])

    def close(self) -> None:
        registrar = cast(MemoryRegistrar, self._backend)
        for view in self._registered:
            registrar.unregister_memory(view)
        self._registered.clear()
        self._backend.close()


class _Baseline:
    """A baseline on the pages, keyed by the same names."""

    side = "baseline"

    def __init__(
        self, name: str, baseline: BenchBaseline, pages: Pages, local_dir: Path | None
    ) -> None:
        self.name = name
        self.local_dir = local_dir
        self._baseline = baseline
        self._pages = pages
        self._names: list[str] = []

    def use(self, names: list[str]) -> None:
        self._names = names

    def put(self, start: int, stop: int) -> int:
        return self._baseline.put(self._names[start:stop], self._pages.src_tensors[start:stop])

    def get(self, start: int, stop: int) -> int:
        return self._baseline.get(self._names[start:stop], self._pages.dst_tensors[start:stop])

    def exists(self, start: int, stop: int) -> int:
        return self._baseline.exists(self._names[start:stop])

    def close(self) -> None:
        self._baseline.close()


# ---------------------------------------------------------------------- runner

OursFactory = Callable[[Point, Path], tuple[Backend, Path | None]]
"""Open our backend for one point, given a fresh directory it may use; returns the
backend and the directory holding its files when they are local files."""
PhaseHook = Callable[[Point, str], None]
"""Told each phase of a point (one of :meth:`BenchSettings.phases`) as it starts."""


def _no_phase(point: Point, phase: str) -> None:
    return None


def _batches(count: int, batch: int) -> list[tuple[int, int]]:
    return [(start, min(start + batch, count)) for start in range(0, count, batch)]


def _sample_order(sides: Sequence[_Side], repeat: int) -> Iterator[_Side]:
    return iter(sides if repeat % 2 == 0 else list(reversed(sides)))


class BenchRunner:
    """Runs every point of a sweep for our backend and an optional baseline.

    Args:
        settings: What to measure.
        scratch: An empty directory the run may fill (each point gets its own directory).
        open_ours: Opens our backend for a point.
        baseline: The baseline to run side by side, or ``None``.
        on_phase: Told each phase of a point as it starts (progress output).
    """

    def __init__(
        self,
        settings: BenchSettings,
        scratch: Path,
        open_ours: OursFactory,
        baseline: BaselineEntry | None,
        on_phase: PhaseHook = _no_phase,
    ) -> None:
        self._settings = settings
        self._scratch = scratch
        self._open_ours = open_ours
        self._baseline = baseline
        self._on_phase = on_phase
        self._notes: list[str] = []

    @property
    def notes(self) -> list[str]:
        """What was skipped and why."""
        return list(self._notes)

    def _note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    def run_point(self, point: Point) -> list[Measurement]:
        """Every operation of the settings at ``point``, for every side."""
        settings = self._settings
        pages = Pages(settings.pages_at(point), point.page_bytes, settings.seed)
        directory = self._scratch / point.label
        directory.mkdir()
        # Long-lived objects (SGLang's modules among them) leave the collector's view for
        # the point, so the collection before each pass is quick.
        gc.collect()
        gc.freeze()
        try:
            return self._run_point(point, pages, directory)
        finally:
            gc.unfreeze()

    def _run_point(self, point: Point, pages: Pages, directory: Path) -> list[Measurement]:
        settings = self._settings
        sides: list[_Side] = []
        try:
            backend, local = self._open_ours(point, directory / "ours")
            sides.append(_Ours(backend, pages, local))
            if self._baseline is not None:
                where = directory / "baseline"
                where.mkdir()
                opened = self._baseline.open(where)
                local_dir = where if self._baseline.files_local else None
                sides.append(_Baseline(self._baseline.name, opened, pages, local_dir))
            pool = (
                ThreadPoolExecutor(settings.concurrency, thread_name_prefix="bench")
                if settings.concurrency > 1
                else None
            )
            try:
                return _PointRun(
                    settings, point, pages, sides, pool, self._note, self._on_phase
                ).run()
            finally:
                if pool is not None:
                    pool.shutdown()
        finally:
            for side in sides:
                side.close()


class _PointRun:
    """The measurements of one point (one use; see :meth:`BenchRunner.run_point`)."""

    def __init__(
        self,
        settings: BenchSettings,
        point: Point,
        pages: Pages,
        sides: list[_Side],
        pool: ThreadPoolExecutor | None,
        note: Callable[[str], None],
        on_phase: PhaseHook,
    ) -> None:
        self.settings = settings
        self.point = point
        self.pages = pages
        self.sides = sides
        self.pool = pool
        self.note = note
        self.phases = iter(settings.phases())
        self.on_phase = on_phase
        self.ranges = _batches(pages.count, point.batch)
        self.out: list[Measurement] = []
        self.clean: dict[int, set[str]] = {id(side): set() for side in sides}

    def _drop(self, side: _Side) -> None:
        if side.local_dir is not None:
            drop_page_cache(side.local_dir, self.clean[id(side)])

    @staticmethod
    def _nothing() -> None:
        return None

    def _pass(self, work: Callable[[int, int], int]) -> int:
        """``work`` over every batch, dealt round robin to ``concurrency`` threads."""
        if self.pool is None:
            return sum(work(start, stop) for start, stop in self.ranges)
        lanes = self.settings.concurrency
        chunks = [self.ranges[lane::lanes] for lane in range(lanes)]

        def lane_work(chunk: list[tuple[int, int]]) -> int:
            return sum(work(start, stop) for start, stop in chunk)

        return sum(self.pool.map(lane_work, chunks))

    def _timed(
        self, before: Callable[[], object], work: Callable[[int, int], int], what: str
    ) -> float:
        """Seconds of one pass of ``work`` after ``before`` (untimed); checks the count."""
        before()
        gc.collect()
        start = time.perf_counter()
        done = self._pass(work)
        elapsed = time.perf_counter() - start
        if done != self.pages.count:
            raise BenchFailedError(f"{what}: {done} of {self.pages.count} pages done in a pass")
        return elapsed

    def _record(self, side: _Side, op: Op, reads: Reads | None, samples: list[float]) -> None:
        self.out.append(
            Measurement(
                side=side.side,
                name=side.name,
                op=op,
                reads=reads,
                point=self.point,
                pages=self.pages.count,
                concurrency=self.settings.concurrency,
                samples=tuple(samples),
                on_disk=side.local_dir is not None,
            )
        )

    def _phase(self) -> None:
        """Announce the next phase of :meth:`BenchSettings.phases`."""
        self.on_phase(self.point, next(self.phases))

    def run(self) -> list[Measurement]:
        settings, gib = self.settings, self.pages.nbytes / GIB
        self._phase()
        self._puts(gib, timed=Op.PUT in settings.ops)
        if Op.GET in settings.ops:
            for side in self.sides:  # verify, and bring every file into the page cache
                if side.get(0, self.pages.count) != self.pages.count:
                    raise BenchFailedError(f"{side.name}: did not find every page it stored")
                self.pages.check_read_back(side.name)
            for reads in settings.reads:
                self._phase()
                self._gets(gib, reads)
        if Op.EXISTS in settings.ops:
            self._phase()
            self._exists()
        return self.out

    def _puts(self, gib: float, *, timed: bool) -> None:
        """Put samples, each writing every page under new names (the last set stays)."""
        repeats = self.settings.repeats if timed else 1
        samples: dict[int, list[float]] = {id(side): [] for side in self.sides}
        for repeat in range(repeats):
            names = self.pages.names(repeat)
            for side in _sample_order(self.sides, repeat):
                side.use(names)
                seconds = self._timed(self._nothing, side.put, f"{side.name} put")
                samples[id(side)].append(gib / seconds)
                if repeat + 1 < repeats:
                    # Written pages are flushed and leave the page cache, as on a server
                    # whose cache is full: the next pass writes into recycled memory and
                    # no write-back of this one runs during it.
                    self._drop(side)
        if timed:
            for side in self.sides:
                self._record(side, Op.PUT, None, samples[id(side)])

    def _gets(self, gib: float, reads: Reads) -> None:
        sides = self.sides
        if reads is Reads.COLD:
            for side in sides:
                if side.local_dir is None:
                    self.note(
                        f"get cold: not measured for {side.name} (its pages are not local files)"
                    )
            sides = [side for side in sides if side.local_dir is not None]
            if not sides:
                return
        samples: dict[int, list[float]] = {id(side): [] for side in sides}
        for repeat in range(self.settings.repeats):
            for side in _sample_order(sides, repeat):

                def before(side: _Side = side) -> None:
                    if reads is Reads.COLD:
                        self._drop(side)

                seconds = self._timed(before, side.get, f"{side.name} get")
                samples[id(side)].append(gib / seconds)
        self.pages.check_read_back("the last timed read pass")
        for side in sides:
            self._record(side, Op.GET, reads, samples[id(side)])

    def _exists(self) -> None:
        loops = max(1, min(200, _EXISTS_KEYS // self.pages.count))
        mkeys = loops * self.pages.count / 1e6
        samples: dict[int, list[float]] = {id(side): [] for side in self.sides}
        for repeat in range(self.settings.repeats + 1):  # the first round warms up
            for side in _sample_order(self.sides, repeat):
                start = time.perf_counter()
                found = sum(self._pass(side.exists) for _ in range(loops))
                elapsed = time.perf_counter() - start
                if found != loops * self.pages.count:
                    raise BenchFailedError(
                        f"{side.name} exists: {found} of {loops * self.pages.count} keys found"
                    )
                if repeat:
                    samples[id(side)].append(mkeys / elapsed)
        for side in self.sides:
            self._record(side, Op.EXISTS, None, samples[id(side)])
