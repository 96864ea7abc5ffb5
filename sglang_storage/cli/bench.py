"""``sglang-storage bench``: backend micro-benchmarks, optionally against an SGLang baseline.

Times put, get (warm and cold) and exists of pages through one of our backends for a sweep
of page sizes and batch sizes, at a chosen concurrency, after measuring the machine's
memcpy and disk limits in the same run. ``--compare NAME`` runs a baseline (a plug-in, see
:mod:`.bench_baseline`; ``sglang-file`` is SGLang 0.5.23's ``HiCacheFile``) on the same
pages, interleaved, and prints the ratio ours / baseline. ``--json`` writes the results
(:mod:`.bench_report`), ``--report`` a markdown report with PNG charts.

Progress (each phase of each point, with the time elapsed; a bar on a terminal) goes to
stderr; stdout carries only the tables and the summary line.

Exit status: 0 done; 1 the run could not be done (a backend, baseline or matplotlib is
unavailable, or a pass failed); 2 a bad argument.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TextIO, TypeVar

import attrs

from sglang_storage.cli.bench_baseline import (
    BaselineEntry,
    baseline_entry,
    baseline_names,
)
from sglang_storage.cli.bench_report import (
    Progress,
    json_document,
    machine_facts,
    now_utc,
    require_matplotlib,
    summary_line,
    text_tables,
    write_report,
)
from sglang_storage.cli.bench_run import (
    SLOW_CREATE_US,
    BenchResult,
    BenchRunner,
    BenchSettings,
    Op,
    Point,
    Reads,
    create_cost_us,
    measure_limits,
)
from sglang_storage.config import build_config
from sglang_storage.errors import ConfigError, StorageError
from sglang_storage.storage import Backend, backend_entry, backend_names, create_backend
from sglang_storage.units import format_bytes, parse_bytes

__all__ = ["register"]

PROG: Final = "sglang-storage bench"
_DEFAULT_DIR: Final = Path("/var/tmp")
"""Disk-backed by convention (``/tmp`` is often tmpfs)."""
_PAGE_MIN, _PAGE_MAX = 512, 1 << 30
_TOTAL_MAX: Final = 64 << 30

_DESCRIPTION = """\
Backend micro-benchmarks: put, get (warm and cold) and exists of pages through one of
our backends, over a sweep of page sizes (at the first batch size) and batch sizes (at
the first page size). The machine's memcpy and disk limits are measured in the same run
and every result is also printed as a fraction of them. Every number is the median of
--repeats timed passes (time.perf_counter), shown with the slowest and fastest pass;
with --compare, the baseline runs on the same pages and its passes are interleaved with
ours. Progress goes to stderr, the results to stdout."""

_EPILOG = """\
examples:
  sglang-storage bench
      the file backend in a scratch directory under /var/tmp, default sweep (~1 min)
  sglang-storage bench --compare sglang-file
      side by side with SGLang 0.5.23's HiCacheFile, with ratios ours/sglang-file
  sglang-storage bench --page-sizes 1MiB,256KiB --batch-sizes 64,8 --concurrency 2
  sglang-storage bench --backend memory --ops put,get --repeats 5 --json out.json
  sglang-storage bench --backend file --backend-config '{"durability": "data"}'
  sglang-storage bench --compare sglang-file --report build/bench
      also write build/bench/report.md and its PNG charts (needs the 'report' extra)

exit status: 0 done; 1 the run could not be done (something unavailable, a pass
failed); 2 a bad argument."""

T = TypeVar("T")


# ---------------------------------------------------------------------- argument types


def _bad(text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(text)


def _size_value(text: str, low: int, high: int) -> int:
    try:
        value = parse_bytes(text.strip(), owner="bench", field="size")
    except ConfigError as error:
        raise _bad(f"{text!r} is not a size (examples: 4096, 64KiB, 1MiB)") from error
    if not low <= value <= high:
        raise _bad(f"{text!r} is out of range: allowed {format_bytes(low)} to {format_bytes(high)}")
    return value


def _list_of(text: str, item: Callable[[str], T], what: str) -> tuple[T, ...]:
    parts = text.split(",")
    if not text.strip() or any(not p.strip() for p in parts):
        raise _bad(f"{text!r} is not a comma-separated list of {what}")
    values = tuple(item(p.strip()) for p in parts)
    if len(set(values)) != len(values):
        raise _bad(f"{text!r} lists a value twice")
    return values


def _page_sizes(text: str) -> tuple[int, ...]:
    return _list_of(text, lambda p: _size_value(p, _PAGE_MIN, _PAGE_MAX), "sizes")


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _bad(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise _bad(f"{value} is out of range: allowed {low} to {high}")
        return value

    return parse


def _batch_sizes(text: str) -> tuple[int, ...]:
    return _list_of(text, _int_in(1, 65536), "integers")


def _total(text: str) -> int:
    return _size_value(text, _PAGE_MIN, _TOTAL_MAX)


def _limit_size(text: str) -> int:
    return _size_value(text, 1 << 20, _TOTAL_MAX)


def _ops(text: str) -> tuple[Op, ...]:
    names = {op.value: op for op in Op}

    def one(part: str) -> Op:
        if part not in names:
            raise _bad(f"unknown operation {part!r}: allowed {', '.join(names)}")
        return names[part]

    chosen = _list_of(text, one, "operations")
    return tuple(op for op in Op if op in chosen)


def _reads(text: str) -> tuple[Reads, ...]:
    names = {reads.value: reads for reads in Reads}

    def one(part: str) -> Reads:
        if part not in names:
            raise _bad(f"unknown read kind {part!r}: allowed {', '.join(names)}")
        return names[part]

    chosen = _list_of(text, one, "read kinds")
    return tuple(reads for reads in Reads if reads in chosen)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise _bad(f"is not valid JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:
        raise _bad("is nested too deeply to be options") from None
    if not isinstance(value, dict):
        raise _bad(f"must be a JSON object, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------- parser


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``bench`` parser to ``subparsers``."""
    parser = subparsers.add_parser(
        "bench",
        help="backend micro-benchmarks, optionally against SGLang's HiCacheFile",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_argument_group("what to measure")
    what.add_argument(
        "--backend",
        default="file",
        metavar="NAME",
        help="our backend, by registered name (default: file)",
    )
    what.add_argument(
        "--backend-config",
        type=_json_object,
        default={},
        metavar="JSON",
        help="the backend's options as a JSON object; a 'root' directory is set by the "
        "benchmark (under --dir)",
    )
    what.add_argument(
        "--page-sizes",
        type=_page_sizes,
        default=(256 << 10, 64 << 10, 1 << 20),
        metavar="LIST",
        help="page sizes, comma-separated (512B to 1GiB); the first is held fixed while "
        "batch sizes vary (default: 256KiB,64KiB,1MiB)",
    )
    what.add_argument(
        "--batch-sizes",
        type=_batch_sizes,
        default=(32, 8, 128),
        metavar="LIST",
        help="keys per call, comma-separated (1 to 65536); the first is held fixed while "
        "page sizes vary (default: 32,8,128)",
    )
    what.add_argument(
        "--concurrency",
        type=_int_in(1, 64),
        default=1,
        metavar="N",
        help="threads issuing batches at once, for every side (1 to 64; default: 1)",
    )
    what.add_argument(
        "--total",
        type=_total,
        default=32 << 20,
        metavar="SIZE",
        help="bytes per timed pass, at least the largest page size (default: 32MiB)",
    )
    what.add_argument(
        "--repeats",
        type=_int_in(3, 100),
        default=3,
        metavar="N",
        help="timed passes per measurement, medians reported (3 to 100; default: 3)",
    )
    what.add_argument(
        "--ops",
        type=_ops,
        default=tuple(Op),
        metavar="LIST",
        help="operations: put, get, exists (default: all three)",
    )
    what.add_argument(
        "--reads",
        type=_reads,
        default=tuple(Reads),
        metavar="LIST",
        help="get passes: warm (files in the page cache), cold (page cache dropped with "
        "posix_fadvise first; local files only) (default: warm,cold)",
    )
    what.add_argument(
        "--limit-size",
        type=_limit_size,
        default=256 << 20,
        metavar="SIZE",
        help="bytes of the memcpy and disk limit measurements (default: 256MiB)",
    )
    what.add_argument(
        "--seed", type=_int_in(0, 2**31 - 1), default=0, help="seed of the page bytes (default: 0)"
    )
    what.add_argument(
        "--dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where the scratch directory goes (default: {_DEFAULT_DIR}, disk-backed; "
        "removed at the end)",
    )
    what.add_argument(
        "--settle",
        type=_int_in(0, 600),
        default=60,
        metavar="SECONDS",
        help="at the start, wait up to this long while creating a file is slow in --dir (it "
        "is, on ext4, for a minute or two after many deletions nearby); 0: do not wait "
        "(default: 60)",
    )
    what.add_argument(
        "--compare",
        metavar="BASELINE",
        help="also run this baseline on the same pages (installed: "
        f"{', '.join(_installed_baselines())})",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON to PATH")
    out.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="write DIR/report.md with PNG charts, and DIR/results.json (needs matplotlib: "
        "pip install 'sglang-storage[report]')",
    )
    out.add_argument(
        "--attach",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="append FILE (a benchmarks/ script's output) to the report; repeatable",
    )
    parser.set_defaults(run=_run)


def _installed_baselines() -> list[str]:
    try:
        return baseline_names() or ["none"]
    except Exception:  # noqa: BLE001 - --help must work whatever the installed metadata holds
        return ["unknown"]


# ---------------------------------------------------------------------- run


class _UsageError(Exception):
    """A bad combination of arguments (exit status 2)."""


@attrs.frozen(kw_only=True)
class _Plan:
    """Validated arguments: what to run and where the output goes."""

    settings: BenchSettings
    options: dict[str, Any]
    has_root: bool
    base: Path
    baseline: BaselineEntry | None
    json_path: Path | None
    report_dir: Path | None
    attachments: tuple[Path, ...]


def _say(stream: TextIO, text: str = "") -> None:
    stream.write(text + "\n")
    stream.flush()


def _error(text: str) -> None:
    _say(sys.stderr, f"{PROG}: error: {text}")


def _available_memory() -> int | None:
    try:
        with Path("/proc/meminfo").open() as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_backend(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    names = backend_names()
    if args.backend not in backend_names(test_backends=True):
        raise _UsageError(
            f"argument --backend: {args.backend!r} is not a known backend; allowed: "
            + ", ".join(names)
        )
    entry = backend_entry(args.backend)
    options = dict(args.backend_config)
    has_root = "root" in attrs.fields_dict(entry.config_type)
    if has_root and "root" in options:
        raise _UsageError(
            "argument --backend-config: 'root' is set by the benchmark (a fresh directory "
            "per point); choose where with --dir"
        )
    probe = {**options, "root": "/nonexistent/probe"} if has_root else options
    try:
        build_config(entry.config_type, probe, owner=f"{args.backend} backend options")
    except ConfigError as error:
        raise _UsageError(f"argument --backend-config: {error}") from None
    return options, has_root


def _check_paths(args: argparse.Namespace, settings: BenchSettings, sides: int) -> Path:
    base: Path = args.dir or (
        _DEFAULT_DIR if _DEFAULT_DIR.is_dir() else Path(tempfile.gettempdir())
    )
    if not base.is_dir():
        raise _UsageError(f"argument --dir: {str(base)!r} is not a directory")
    if args.json is not None and not args.json.parent.is_dir():
        raise _UsageError(f"argument --json: the directory of {str(args.json)!r} does not exist")
    if args.report is not None and args.report.exists() and not args.report.is_dir():
        raise _UsageError(f"argument --report: {str(args.report)!r} exists and is not a directory")
    for path in args.attach:
        if not path.is_file():
            raise _UsageError(f"argument --attach: {str(path)!r} is not a file")
    if args.attach and args.report is None:
        raise _UsageError("argument --attach: needs --report (it adds to the report)")
    points = settings.points()
    passes = settings.repeats if Op.PUT in settings.ops else 1
    needed = sides * passes * sum(settings.pages_at(p) * p.page_bytes for p in points)
    needed += settings.limit_bytes
    free = shutil.disk_usage(base).free
    if needed * 1.1 > free:
        raise _UsageError(
            f"the run needs about {format_bytes(needed)} under {base} but "
            f"{format_bytes(free)} is free; lower --total or --repeats, or use --dir"
        )
    return base


def _plan(args: argparse.Namespace) -> _Plan:
    """Validate the arguments together (each was validated alone by its type)."""
    settings = BenchSettings(
        backend=args.backend,
        page_sizes=args.page_sizes,
        batch_sizes=args.batch_sizes,
        concurrency=args.concurrency,
        total_bytes=args.total,
        repeats=args.repeats,
        ops=args.ops,
        reads=args.reads,
        limit_bytes=args.limit_size,
        seed=args.seed,
    )
    if args.total < max(settings.page_sizes):
        raise _UsageError(
            f"argument --total: {format_bytes(args.total)} is less than the largest page "
            f"size ({format_bytes(max(settings.page_sizes))})"
        )
    options, has_root = _check_backend(args)
    if not has_root and settings.ops == (Op.GET,) and settings.reads == (Reads.COLD,):
        raise _UsageError(
            f"argument --reads: cold reads apply to backends that keep local files; "
            f"{args.backend!r} does not, so nothing would be measured (add warm)"
        )
    baseline: BaselineEntry | None = None
    if args.compare is not None:
        try:
            baseline = baseline_entry(args.compare)
        except ConfigError as error:
            raise _UsageError(
                f"argument --compare: {args.compare!r} is not an installed bench baseline; "
                f"installed: {error.allowed}"
            ) from None
    largest = max(settings.pages_at(p) * p.page_bytes for p in settings.points())
    memory = 2 * largest + 2 * settings.limit_bytes
    available = _available_memory()
    if available is not None and memory > available // 2:
        raise _UsageError(
            f"the run holds about {format_bytes(memory)} in memory but only "
            f"{format_bytes(available)} is available; lower --total or --limit-size"
        )
    base = _check_paths(args, settings, 2 if baseline else 1)
    return _Plan(
        settings=settings,
        options=options,
        has_root=has_root,
        base=base,
        baseline=baseline,
        json_path=args.json,
        report_dir=args.report,
        attachments=tuple(args.attach),
    )


def _command(args: argparse.Namespace) -> str:
    """The full command line of the run, every setting spelled out."""
    argv = [
        "sglang-storage",
        "bench",
        "--backend",
        args.backend,
        "--page-sizes",
        ",".join(format_bytes(s).replace(" ", "") for s in args.page_sizes),
        "--batch-sizes",
        ",".join(str(b) for b in args.batch_sizes),
        "--concurrency",
        str(args.concurrency),
        "--total",
        format_bytes(args.total).replace(" ", ""),
        "--repeats",
        str(args.repeats),
        "--ops",
        ",".join(op.value for op in args.ops),
        "--reads",
        ",".join(reads.value for reads in args.reads),
    ]
    if args.backend_config:
        argv += ["--backend-config", json.dumps(args.backend_config)]
    if args.compare:
        argv += ["--compare", args.compare]
    return shlex.join(argv)


def _run(args: argparse.Namespace) -> int:
    try:
        plan = _plan(args)
    except _UsageError as error:
        _error(str(error))
        return 2
    try:
        if plan.report_dir is not None:
            require_matplotlib()
        return _measure(args, plan)
    except StorageError as error:
        _error(str(error))
        return 1


def _measure(args: argparse.Namespace, plan: _Plan) -> int:
    settings = plan.settings
    load_at_start = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="sglang-storage-bench-", dir=plan.base))
    try:
        if plan.baseline is not None:  # fail now, not after the limits, when it cannot open
            probe = scratch / "baseline-probe"
            probe.mkdir()
            plan.baseline.open(probe).close()

        def open_ours(point: Point, directory: Path) -> tuple[Backend, Path | None]:
            options = dict(plan.options)
            if plan.has_root:
                options["root"] = str(directory)
            backend = create_backend(settings.backend, options)
            return backend, directory if plan.has_root else None

        points = settings.points()
        # The progress ends before the tables are printed: a bar and stdout often share
        # one terminal.
        with Progress(1 + len(points) * len(settings.phases()), PROG) as progress:
            notes = _settle(scratch, args.settle, progress)
            progress.step(f"the machine's limits (memcpy, disk write and read) in {scratch}")
            limits = measure_limits(scratch, settings.limit_bytes, settings.repeats)

            def on_phase(point: Point, phase: str) -> None:
                page = format_bytes(point.page_bytes)
                progress.step(f"page {page}, batch {point.batch}: {phase}")

            runner = BenchRunner(settings, scratch, open_ours, plan.baseline, on_phase)
            measurements = []
            for point in points:
                measurements += runner.run_point(point)
        result = BenchResult(
            settings=settings,
            limits=limits,
            ours=settings.backend,
            baseline=None if plan.baseline is None else plan.baseline.name,
            measurements=tuple(measurements),
            notes=(*notes, *runner.notes),
        )
        _write(args, plan, result, load_at_start)
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _settle(scratch: Path, limit_s: int, progress: Progress) -> list[str]:
    """Wait (up to ``limit_s``) until creating a file costs what it does when settled."""
    cost = create_cost_us(scratch)
    waited = 0
    while cost > SLOW_CREATE_US and waited < limit_s:
        if not waited:
            progress.note(
                f"creating a file takes {cost:.0f} us here (many files were deleted nearby "
                f"recently); waiting up to {limit_s} s for it to settle"
            )
        else:
            progress.note(f"still {cost:.0f} us per file after {waited} s of {limit_s} s")
        step = min(15, limit_s - waited)
        time.sleep(step)
        waited += step
        cost = create_cost_us(scratch)
    note = f"creating an empty file in the bench directory took {cost:.0f} us at the start"
    if waited:
        note += f" (after waiting {waited} s for it to settle)"
    if cost > SLOW_CREATE_US:
        note += (
            f"; above {SLOW_CREATE_US:.0f} us, so puts are slowed by recent deletions near the "
            "bench directory (run again later, or use --dir elsewhere)"
        )
    return [note]


def _write(
    args: argparse.Namespace, plan: _Plan, result: BenchResult, load_at_start: float
) -> None:
    command = _command(args)
    created = now_utc()
    for line in text_tables(result):
        _say(sys.stdout, line)
    _say(sys.stdout, "")
    _say(sys.stdout, summary_line(result))
    if plan.json_path is None and plan.report_dir is None:
        return
    machine = machine_facts(plan.base, load_at_start=load_at_start)
    if plan.json_path is not None:
        document = json_document(
            result, machine=machine, command=shlex.split(command), created=created
        )
        plan.json_path.write_text(json.dumps(document, indent=2) + "\n")
        _say(sys.stderr, f"{PROG}: wrote {plan.json_path}")
    if plan.report_dir is not None:
        report = write_report(
            result,
            plan.report_dir,
            machine=machine,
            command=command,
            created=created,
            attachments=plan.attachments,
        )
        (plan.report_dir / "results.json").write_text(
            json.dumps(
                json_document(
                    result, machine=machine, command=shlex.split(command), created=created
                ),
                indent=2,
            )
            + "\n"
        )
        _say(sys.stderr, f"{PROG}: wrote {report}")
