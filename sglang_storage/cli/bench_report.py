"""What ``sglang-storage bench`` writes: text tables, the JSON document, the markdown report.

- :func:`machine_facts` - the machine a run measured (CPU, cores, memory, file system and
  disk of the bench directory, kernel, Python and library versions), gathered from
  ``/proc``, ``/sys`` and package metadata.
- :func:`text_tables` - the tables the command prints.
- :func:`json_document` - the machine-readable results, schema :data:`SCHEMA` version
  :data:`SCHEMA_VERSION`.
- :func:`write_report` - ``report.md`` plus PNG charts (throughput vs page size and vs batch
  size for each backend: bars at the median, whiskers from the slowest to the fastest pass,
  see :func:`chart_series`), drawn with matplotlib's Agg backend; :func:`require_matplotlib`
  says what to install when it is missing.
- :class:`Progress` - a long run's steps on stderr (a tqdm bar on a terminal, else one line
  per step with the time elapsed), used by the command and the ``benchmarks/`` scripts.
- :func:`goal_verdict` - the neutral line a benchmark prints where a goal exists.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TextIO

import attrs

from sglang_storage.cli.bench_run import BenchResult, Limit, Measurement, Point
from sglang_storage.errors import BackendUnavailableError
from sglang_storage.units import format_bytes

__all__ = [
    "CHARTS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "ChartSeries",
    "Progress",
    "chart_series",
    "goal_verdict",
    "json_document",
    "machine_facts",
    "require_matplotlib",
    "summary_line",
    "text_tables",
    "write_report",
]

SCHEMA: Final = "sglang-storage.bench"
SCHEMA_VERSION: Final = 1
CHARTS: Final = {
    "page": "throughput_vs_page_size.png",
    "batch": "throughput_vs_batch_size.png",
}
_MATPLOTLIB_HINT: Final = "pip install 'sglang-storage[report]'"


# ---------------------------------------------------------------------- progress


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """A long run's steps, reported on stderr (stdout keeps only the results).

    On a terminal, with tqdm installed (an SGLang dependency), a progress bar; otherwise
    (a pipe, a log file, no tqdm) one line per step, ``PREFIX: [3/7] WHAT (12.4 s
    elapsed)``, and a last line with the total time. Use it as a context manager and call
    :meth:`step` as each step starts; :meth:`note` prints a line without breaking the bar.

    Args:
        total: How many steps the run has (more are counted without failing).
        prefix: What runs (``sglang-storage bench``, a script's name).
        stream: Where to write; default ``sys.stderr`` when the progress is created.
        bar: Force the bar on or off; default: on when ``stream`` is a terminal.
    """

    def __init__(
        self, total: int, prefix: str, *, stream: TextIO | None = None, bar: bool | None = None
    ) -> None:
        self._stream = sys.stderr if stream is None else stream
        self._total = total
        self._prefix = prefix
        self._started = 0
        self._start = time.perf_counter()
        self._bar: Any = None
        if _is_terminal(self._stream) if bar is None else bar:
            try:
                tqdm: Any = importlib.import_module("tqdm").tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(
                    total=total,
                    desc=prefix,
                    file=self._stream,
                    dynamic_ncols=True,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
                )

    @property
    def elapsed_s(self) -> float:
        """Seconds since the progress was created."""
        return time.perf_counter() - self._start

    def _line(self, text: str) -> None:
        self._stream.write(f"{self._prefix}: {text}\n")
        self._stream.flush()

    def step(self, what: str) -> None:
        """Step ``what`` starts now (the one before it is done)."""
        self._started += 1
        if self._bar is not None:
            self._bar.update(self._started - 1 - self._bar.n)
            self._bar.set_postfix_str(what)
            return
        total = max(self._total, self._started)
        self._line(f"[{self._started}/{total}] {what} ({self.elapsed_s:.1f} s elapsed)")

    def note(self, text: str) -> None:
        """A line between the steps (a wait, a skipped row)."""
        if self._bar is not None:
            self._bar.write(f"{self._prefix}: {text}", file=self._stream)
        else:
            self._line(text)

    def close(self, *, finished: bool = True) -> None:
        """End the progress: every step done, or (``finished=False``) stopped by an error."""
        if self._bar is not None:
            if finished:
                self._bar.update(max(self._total, self._started) - self._bar.n)
            self._bar.close()
            self._bar = None
        elif finished:
            self._line(f"done: {self._started} steps in {self.elapsed_s:.1f} s")
        else:
            self._line(f"stopped in step {self._started} after {self.elapsed_s:.1f} s")

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close(finished=kind is None)


def goal_verdict(goal: str, measured: str, met: bool | None) -> str:
    """The line a benchmark prints where a goal exists: ``goal: GOAL; measured: X; met``.

    ``met`` is ``None`` when the goal does not apply to what was measured.
    """
    verdict = "does not apply" if met is None else "met" if met else "not met"
    return f"goal: {goal}; measured: {measured}; {verdict}"


# ---------------------------------------------------------------------- machine


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _cpu_model() -> str:
    text = _read("/proc/cpuinfo") or ""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in text.splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    if any(line.startswith("flags") and " hypervisor" in line for line in text.splitlines()):
        model += " (virtual machine)"
    return model


def _memory() -> str:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return format_bytes(int(line.split()[1]) * 1024)
    return "unknown"


def _mount(path: Path) -> tuple[str, str, str, str]:
    """``(device, mount point, fstype, options)`` of the file system holding ``path``."""
    target = str(path.resolve())
    best = ("unknown", "/", "unknown", "")
    for line in (_read("/proc/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        device, point, fstype, options = fields[:4]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[1]):
            best = (device, point, fstype, options)
    return best


def _disk(device: str) -> str:
    """The block device's model, size and kind, from ``/sys/block``."""
    name = Path(device).name
    block = Path("/sys/block") / name
    if not block.exists():
        parent = next((b for b in Path("/sys/block").glob("*") if (b / name).exists()), None)
        if parent is None:
            return "unknown"
        block = parent
    parts = []
    model = _read(f"{block}/device/model")
    vendor = _read(f"{block}/device/vendor")
    driver = Path(f"{block}/device/driver").resolve().name
    if model:
        parts.append(" ".join(p for p in (vendor, model) if p))
    elif driver and driver != "driver":
        parts.append(f"{block.name} ({driver} driver)")
    sectors = _read(f"{block}/size")
    if sectors and sectors.isdigit():
        parts.append(format_bytes(int(sectors) * 512))
    rotational = _read(f"{block}/queue/rotational")
    if rotational is not None:
        parts.append("reported rotational" if rotational == "1" else "reported non-rotational")
    return ", ".join(parts) or "unknown"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _os_name() -> str:
    for line in (_read("/etc/os-release") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip('"')
    return platform.system()


def machine_facts(directory: Path, *, load_at_start: float | None = None) -> dict[str, str]:
    """The machine a run measured, with the file system and disk holding ``directory``.

    ``load_at_start`` is the 1-minute load average when the run began; it is reported
    next to the current one (other work on the machine shows in every number).
    """
    device, point, fstype, options = _mount(directory)
    load = f"{os.getloadavg()[0]:.2f} at the end"
    if load_at_start is not None:
        load = f"{load_at_start:.2f} at the start, {load}"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "CPU": _cpu_model(),
        "cores": f"{os.cpu_count()} logical, {usable} usable by this process",
        "memory": _memory(),
        "load (1-minute average)": load,
        "bench directory": str(directory),
        "file system": f"{fstype} on {device}, mounted at {point} ({options})",
        "disk": _disk(device),
        "kernel": f"{platform.system()} {platform.release()}",
        "OS": _os_name(),
        "Python": platform.python_version(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "sglang-storage": _version("sglang-storage"),
        "SGLang": _version("sglang"),
    }


# ---------------------------------------------------------------------- text


def _spread(samples: Sequence[float]) -> str:
    return f"{statistics.median(samples):.3f} ({min(samples):.3f}-{max(samples):.3f})"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _point_title(result: BenchResult, point: Point) -> str:
    pages = result.settings.pages_at(point)
    return (
        f"page {format_bytes(point.page_bytes)}, batch {point.batch}, concurrency "
        f"{result.settings.concurrency}: {pages} pages = {format_bytes(pages * point.page_bytes)} "
        f"per pass; median (min-max) of {result.settings.repeats}"
    )


def _limit_line(limit: Limit, extra: str = "") -> str:
    return f"  {limit.name + extra:<34} {_spread(limit.samples):>26} GiB/s"


def text_tables(result: BenchResult) -> list[str]:
    """The lines the command prints: the limits, then one table per point."""
    limits = result.limits
    lines = [
        f"machine limits, measured in this run ({format_bytes(limits.memcpy.nbytes)}, median "
        f"(min-max) of {len(limits.memcpy.samples)}; disk in {limits.directory}):",
        _limit_line(limits.memcpy, f", {limits.torch_threads} threads"),
        _limit_line(limits.disk_write),
        _limit_line(limits.disk_read),
        "reads: 'get warm' finds the files in the page cache; 'get cold' drops each file's "
        "pages first (fdatasync once after writing, then posix_fadvise DONTNEED).",
    ]
    for point in result.settings.points():
        lines += ["", _point_title(result, point)]
        header = (
            f"  {'row':<9} {'side':<9} {'name':<12} {'median (min-max)':>26} {'unit':<8}"
            f" {'/memcpy':>7} {'/disk':>6} {'ours/base':>9}"
        )
        lines += [header, "  " + "-" * (len(header) - 2)]
        for row in result.rows():
            for side in ("ours", "baseline"):
                m = result.find(side, row, point)
                if m is None:
                    continue
                memcpy, disk = result.of_limit(m)
                ratio = result.ratio(row, point) if side == "ours" else None
                lines.append(
                    f"  {row:<9} {side:<9} {m.name:<12} {_spread(m.samples):>26} {m.unit:<8}"
                    f" {_percent(memcpy):>7} {_percent(disk):>6}"
                    f" {'' if ratio is None else f'{ratio:.2f}x':>9}"
                )
    lines += [f"note: {note}" for note in result.notes]
    return lines


def summary_line(result: BenchResult) -> str:
    """One line: ours / baseline and ours / limit for each row at the fixed point."""
    point = result.settings.points()[0]
    parts = []
    for row in result.rows():
        ours = result.find("ours", row, point)
        if ours is None:
            continue
        text = f"{row} {ours.median:.3f} {ours.unit}"
        ratio = result.ratio(row, point)
        if ratio is not None:
            text += f" = {ratio:.2f}x {result.baseline}"
        _, disk = result.of_limit(ours)
        if disk is not None:
            text += f", {disk:.0%} of disk"
        parts.append(text)
    return (
        f"summary ({result.ours} at page {format_bytes(point.page_bytes)}, batch {point.batch}): "
        + "; ".join(parts)
    )


# ---------------------------------------------------------------------- JSON


def _limit_json(limit: Limit) -> dict[str, Any]:
    return {
        "name": limit.name,
        "unit": "GiB/s",
        "bytes": limit.nbytes,
        "median": limit.median,
        "min": limit.low,
        "max": limit.high,
        "samples": list(limit.samples),
    }


def _measurement_json(result: BenchResult, m: Measurement) -> dict[str, Any]:
    memcpy, disk = result.of_limit(m)
    return {
        "side": m.side,
        "name": m.name,
        "op": m.op.value,
        "reads": None if m.reads is None else m.reads.value,
        "page_bytes": m.point.page_bytes,
        "batch": m.point.batch,
        "concurrency": m.concurrency,
        "pages": m.pages,
        "unit": m.unit,
        "median": m.median,
        "min": m.low,
        "max": m.high,
        "samples": list(m.samples),
        "of_memcpy": memcpy,
        "of_disk": disk,
        "ours_over_baseline": result.ratio(m.row, m.point) if m.side == "ours" else None,
    }


def json_document(
    result: BenchResult, *, machine: dict[str, str], command: Sequence[str], created: str
) -> dict[str, Any]:
    """The machine-readable results (schema :data:`SCHEMA`, version :data:`SCHEMA_VERSION`)."""
    settings = result.settings
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "created": created,
        "command": list(command),
        "machine": machine,
        "settings": {
            "backend": settings.backend,
            "baseline": result.baseline,
            "page_sizes": list(settings.page_sizes),
            "batch_sizes": list(settings.batch_sizes),
            "concurrency": settings.concurrency,
            "total_bytes": settings.total_bytes,
            "repeats": settings.repeats,
            "ops": [op.value for op in settings.ops],
            "reads": [reads.value for reads in settings.reads],
            "limit_bytes": settings.limit_bytes,
            "seed": settings.seed,
        },
        "limits": {
            "memcpy": _limit_json(result.limits.memcpy),
            "disk_write": _limit_json(result.limits.disk_write),
            "disk_read_cold": _limit_json(result.limits.disk_read),
            "torch_threads": result.limits.torch_threads,
        },
        "results": [_measurement_json(result, m) for m in result.measurements],
        "notes": list(result.notes),
    }


def now_utc() -> str:
    """The current time, ISO 8601 in UTC to the second."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()


# ---------------------------------------------------------------------- report


def require_matplotlib() -> None:
    """Raise unless matplotlib (the ``report`` extra) imports.

    Raises:
        BackendUnavailableError: matplotlib is missing; the message says what to install.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise BackendUnavailableError(
            backend="bench --report",
            reason=f"the charts need matplotlib ({error}); install it with: {_MATPLOTLIB_HINT}",
        ) from error


@attrs.frozen(kw_only=True)
class ChartSeries:
    """One side's bars in one chart panel: the median of each point with its spread."""

    label: str
    medians: tuple[float, ...]
    lows: tuple[float, ...]
    """The slowest pass at each point (NaN where the side has no measurement there)."""
    highs: tuple[float, ...]
    """The fastest pass at each point (NaN where the side has no measurement there)."""

    @property
    def errors(self) -> tuple[list[float], list[float]]:
        """Matplotlib's ``yerr``: how far each whisker reaches below and above the bar."""
        return (
            [m - low for m, low in zip(self.medians, self.lows, strict=True)],
            [high - m for m, high in zip(self.medians, self.highs, strict=True)],
        )


def chart_series(result: BenchResult, row: str, points: Sequence[Point]) -> list[ChartSeries]:
    """The bars of panel ``row`` over ``points``: ours, then the baseline when measured."""
    series = []
    for side in ("ours", "baseline"):
        found = [result.find(side, row, p) for p in points]
        named = [m for m in found if m is not None]
        if not named:
            continue
        name = named[0].name
        series.append(
            ChartSeries(
                label=f"{name} (sglang-storage)" if side == "ours" else name,
                medians=tuple(math.nan if m is None else m.median for m in found),
                lows=tuple(math.nan if m is None else m.low for m in found),
                highs=tuple(math.nan if m is None else m.high for m in found),
            )
        )
    return series


def _chart(
    result: BenchResult,
    path: Path,
    points: list[Point],
    x_of: Callable[[Point], float],
    x_label: str,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    rows = result.rows()
    columns = 2 if len(rows) > 1 else 1
    lines = (len(rows) + columns - 1) // columns
    figure, axes = pyplot.subplots(lines, columns, figsize=(6 * columns, 4 * lines), squeeze=False)
    limit_of = {
        "put": result.limits.disk_write,
        "get warm": result.limits.memcpy,
        "get cold": result.limits.disk_read,
    }
    for index, row in enumerate(rows):
        ax = axes[index // columns][index % columns]
        series = chart_series(result, row, points)
        width = 0.8 / max(1, len(series))
        for k, bars in enumerate(series):
            offset = (k - (len(series) - 1) / 2) * width
            ax.bar(
                [i + offset for i in range(len(points))],
                bars.medians,
                width=width,
                yerr=bars.errors,
                capsize=4,
                error_kw={"elinewidth": 1},
                label=bars.label,
            )
        limit = limit_of.get(row)
        if limit is not None:
            ax.axhline(limit.median, linestyle="--", color="grey", label=limit.name)
        ax.set_xticks(list(range(len(points))))
        ax.set_xticklabels([f"{x_of(p):g}" for p in points])
        ax.set_xlabel(x_label)
        ax.set_ylabel("Mkeys/s" if row == "exists" else "GiB/s")
        ax.set_ylim(bottom=0)
        ax.set_title(row)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for index in range(len(rows), lines * columns):
        axes[index // columns][index % columns].set_visible(False)
    figure.suptitle(
        f"{title}\nbars: median of {result.settings.repeats} passes; whiskers: slowest to fastest"
    )
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    pyplot.close(figure)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _measurement_rows(result: BenchResult, points: Sequence[Point]) -> list[list[str]]:
    rows = []
    for point in points:
        for row in result.rows():
            for side in ("ours", "baseline"):
                m = result.find(side, row, point)
                if m is None:
                    continue
                memcpy, disk = result.of_limit(m)
                ratio = result.ratio(row, point) if side == "ours" else None
                rows.append(
                    [
                        format_bytes(point.page_bytes),
                        str(point.batch),
                        row,
                        m.name,
                        f"{m.median:.3f}",
                        f"{min(m.samples):.3f}-{max(m.samples):.3f}",
                        m.unit,
                        _percent(memcpy),
                        _percent(disk),
                        "" if ratio is None else f"**{ratio:.2f}x**",
                    ]
                )
    return rows


def write_report(
    result: BenchResult,
    directory: Path,
    *,
    machine: dict[str, str],
    command: str,
    created: str,
    attachments: Sequence[Path] = (),
) -> Path:
    """Write ``report.md`` and the charts into ``directory``; returns the markdown's path.

    ``attachments`` are text files (other benchmarks' output) appended as sections.
    """
    require_matplotlib()
    directory.mkdir(parents=True, exist_ok=True)
    settings = result.settings
    fixed = settings.points()[0]
    by_page = sorted(
        (p for p in settings.points() if p.batch == fixed.batch), key=lambda p: p.page_bytes
    )
    by_batch = sorted(
        (p for p in settings.points() if p.page_bytes == fixed.page_bytes), key=lambda p: p.batch
    )
    against = f" against {result.baseline}" if result.baseline else ""
    _chart(
        result,
        directory / CHARTS["page"],
        by_page,
        lambda p: p.page_bytes / 1024,
        "page size (KiB)",
        f"{result.ours}{against}: throughput vs page size (batch {fixed.batch})",
    )
    _chart(
        result,
        directory / CHARTS["batch"],
        by_batch,
        lambda p: float(p.batch),
        "batch size (keys per call)",
        f"{result.ours}{against}: throughput vs batch size (page {format_bytes(fixed.page_bytes)})",
    )
    limits = result.limits
    ratio_header = f"ours/{result.baseline}" if result.baseline else "ours/baseline"
    md = [
        "# sglang-storage bench report",
        "",
        f"Generated {created} by `{command}`.",
        "",
        f"Our `{result.ours}` backend"
        + (f" and SGLang's baseline `{result.baseline}`" if result.baseline else "")
        + " on the same pages in the same run. Every number is the median of "
        f"{settings.repeats} timed passes (min-max alongside); the two sides' passes are "
        "interleaved in alternating order. Ratios > 1 mean ours is faster. `/memcpy` and "
        "`/disk` are each result as a fraction of the machine's limits measured in the "
        "same run (disk write for put, cold disk read for a cold get; a warm get is "
        "bounded by memcpy, not the disk). Neither side fsyncs a put (our file backend's "
        "default durability `none`, like HiCacheFile), so a put ends in the page cache and "
        "can beat the disk write limit (which includes `fsync`): /disk above 100% for put "
        "means the write-back came after the pass.",
        "",
        "## Machine",
        "",
        *_table(["", "value"], [[key, value] for key, value in machine.items()]),
        "",
        "## Machine limits (measured in this run)",
        "",
        *_table(
            ["limit", "median GiB/s", "min-max", "bytes"],
            [
                [
                    limit.name,
                    f"{limit.median:.3f}",
                    f"{min(limit.samples):.3f}-{max(limit.samples):.3f}",
                    format_bytes(limit.nbytes),
                ]
                for limit in (limits.memcpy, limits.disk_write, limits.disk_read)
            ],
        ),
        "",
        f"memcpy uses {limits.torch_threads} torch threads. Disk limits: one file written "
        f"with `write` then `fsync`, then read with `readv` after `fsync` and "
        "`posix_fadvise(DONTNEED)` (cold).",
        "",
        "## Settings",
        "",
        *_table(
            ["setting", "value"],
            [
                ["backend", result.ours],
                ["baseline", result.baseline or "none"],
                ["page sizes", ", ".join(format_bytes(s) for s in settings.page_sizes)],
                ["batch sizes", ", ".join(str(b) for b in settings.batch_sizes)],
                ["concurrency (threads issuing batches)", str(settings.concurrency)],
                ["bytes per pass", format_bytes(settings.total_bytes)],
                ["repeats", str(settings.repeats)],
                ["operations", ", ".join(result.rows())],
            ],
        ),
        "",
        "Reads: `get warm` finds every file in the page cache; `get cold` first drops each "
        "file's pages from the page cache (`posix_fadvise(DONTNEED)`, after one `fdatasync` "
        "of each file once it is written); directory entries and inodes stay cached. Puts "
        "write every page under new names into the same store, so every pass creates files; "
        "between passes the files just written are flushed and dropped from the page cache "
        "(not timed), so no pass pays for another's write-back.",
        "",
        f"## Headline: page {format_bytes(fixed.page_bytes)}, batch {fixed.batch}",
        "",
        *_table(
            [
                "page",
                "batch",
                "op",
                "name",
                "median",
                "min-max",
                "unit",
                "/memcpy",
                "/disk",
                ratio_header,
            ],
            _measurement_rows(result, [fixed]),
        ),
        "",
        "## Throughput vs page size",
        "",
        f"Bars are medians of the {settings.repeats} passes; whiskers reach from the "
        "slowest pass to the fastest (min-max). Dashed: the machine limit that bounds the row.",
        "",
        f"![throughput vs page size]({CHARTS['page']})",
        "",
        "## Throughput vs batch size",
        "",
        f"![throughput vs batch size]({CHARTS['batch']})",
        "",
        "## Every measurement",
        "",
        *_table(
            [
                "page",
                "batch",
                "op",
                "name",
                "median",
                "min-max",
                "unit",
                "/memcpy",
                "/disk",
                ratio_header,
            ],
            _measurement_rows(result, settings.points()),
        ),
        "",
    ]
    if result.notes:
        md += ["## Notes", "", *[f"- {note}" for note in result.notes], ""]
    if attachments:
        md += [
            "## Benchmark scripts",
            "",
            "The output of the repository's `benchmarks/` scripts, run by `make bench` "
            "before this report was written.",
            "",
        ]
        for path in attachments:
            md += [f"### {path.name}", "", "```text", path.read_text().rstrip(), "```", ""]
    report = directory / "report.md"
    report.write_text("\n".join(md))
    return report
