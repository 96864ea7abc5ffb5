"""Run the reliability suite and write its evidence table, docs/reliability.md.

Usage (from the repository root)::

    .venv/bin/python ci/reliability_report.py            # run, then write docs/reliability.md
    .venv/bin/python ci/reliability_report.py --ledger-dir DIR --no-run   # render only

It runs ``pytest tests/reliability -n 2`` with ``SGLANG_STORAGE_LEDGER_DIR`` set to a
temporary directory, where every reliability test writes one JSON entry (schema in
``tests/support/ledger.py``: area, faults by kind, operations, wrong bytes, hangs,
acknowledged-durable objects lost). The entries are summed per area (whatever modules
exist: the script knows no area by name) into a Markdown table with totals; the entries
that broke the promise are listed with pytest's verdict on each (an xfail names a known
bug); then the command, the date, the machine and the git revision.

Exit status: 0 when pytest passed and every must-be-zero column (wrong bytes, hangs,
acknowledged-durable lost) is zero in every entry; 1 otherwise; 2 for bad arguments or
unreadable ledger files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[1]
LEDGER_DIR_ENV: Final = "SGLANG_STORAGE_LEDGER_DIR"  # as tests/support/ledger.py
SCHEMA: Final = 1  # the ledger JSON version this script reads
SGLANG_ENV_PREFIX: Final = f"{LEDGER_DIR_ENV}="
MUST_BE_ZERO: Final = ("wrong_bytes", "hangs", "lost_durable")


@dataclass
class Area:
    """The summed entries of one report row."""

    name: str
    tests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    operations: int = 0
    wrong_bytes: int = 0
    hangs: int = 0
    lost_durable: int = 0

    def add(self, entry: dict[str, object]) -> None:
        """Add one test's entry."""
        self.tests += 1
        faults = entry.get("faults", {})
        if not isinstance(faults, dict):
            raise ValueError(f"faults must be an object, got {faults!r}")
        for kind, count in faults.items():
            self.faults[str(kind)] += _count(count, f"faults.{kind}")
        self.operations += _count(entry.get("operations", 0), "operations")
        self.wrong_bytes += _count(entry.get("wrong_bytes", 0), "wrong_bytes")
        self.hangs += _count(entry.get("hangs", 0), "hangs")
        self.lost_durable += _count(entry.get("lost_durable", 0), "lost_durable")

    @property
    def clean(self) -> bool:
        """Whether every must-be-zero column is zero."""
        return not (self.wrong_bytes or self.hangs or self.lost_durable)


@dataclass
class Outcome:
    """What pytest reported (from its JUnit XML)."""

    returncode: int
    seconds: float
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)
    results: dict[str, str] = field(default_factory=dict)
    """Per test (``classname::name`` as JUnit writes it): passed, failed, error, skipped or
    ``xfail: <reason>``."""


def _count(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return value


def run_pytest(ledger_dir: Path, workers: int, extra: list[str]) -> tuple[Outcome, list[str]]:
    """Run the reliability suite with the ledger on; return its outcome and command."""
    junit = ledger_dir / "junit.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests/reliability",
        "-n",
        str(workers),
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *extra,
    ]
    env = {**os.environ, LEDGER_DIR_ENV: str(ledger_dir)}
    start = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, check=False)
    outcome = Outcome(returncode=done.returncode, seconds=time.monotonic() - start)
    if junit.exists():
        root = ET.parse(junit).getroot()
        for suite in root.iter("testsuite"):
            outcome.tests += int(suite.get("tests", 0))
            outcome.failures += int(suite.get("failures", 0))
            outcome.errors += int(suite.get("errors", 0))
            outcome.skipped += int(suite.get("skipped", 0))
        for case in root.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome.results[name] = _result_of(case)
            if outcome.results[name] in ("failed", "error"):
                outcome.failed.append(name)
    shown = ["python", *(part for part in command[1:] if part != f"--junitxml={junit}")]
    return outcome, shown


def _result_of(case: ET.Element) -> str:
    if case.find("failure") is not None:
        return "failed"
    if case.find("error") is not None:
        return "error"
    skipped = case.find("skipped")
    if skipped is None:
        return "passed"
    if skipped.get("type") == "pytest.xfail":
        return f"xfail (a known bug): {skipped.get('message', '')}"
    return "skipped"


def junit_name(nodeid: str) -> str:
    """The ``classname::name`` JUnit XML gives the test with pytest node id ``nodeid``."""
    parts = nodeid.split("::")
    module = parts[0].removesuffix(".py").replace("/", ".")
    return ".".join([module, *parts[1:-1]]) + "::" + parts[-1]


def collect(ledger_dir: Path) -> tuple[dict[str, Area], list[dict[str, object]]]:
    """The ledger entries under ``ledger_dir``, summed per area; and the broken ones.

    An entry is broken when a must-be-zero count of it is above 0.
    """
    areas: dict[str, Area] = {}
    broken: list[dict[str, object]] = []
    for path in sorted(ledger_dir.glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            if not isinstance(entry, dict) or entry.get("schema") != SCHEMA:
                raise ValueError(f"not a schema-{SCHEMA} ledger entry")
            name = entry.get("area")
            if not isinstance(name, str) or not name:
                raise ValueError("has no area")
            areas.setdefault(name, Area(name)).add(entry)
            if any(entry.get(column) for column in MUST_BE_ZERO):
                broken.append(entry)
        except (OSError, ValueError) as error:
            raise SystemExit(f"reliability_report: {path.name}: {error}") from None
    return areas, broken


def _faults_text(faults: Counter[str]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(faults.items()) if n) or "-"


def _git_rev() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unavailable"
    return done.stdout.strip() + " (plus any uncommitted changes in the working tree)"


def render(
    areas: dict[str, Area],
    broken: list[dict[str, object]],
    outcome: Outcome | None,
    command: list[str] | None,
) -> str:
    """The Markdown report."""
    total = Area("**total**")
    for area in areas.values():
        total.tests += area.tests
        total.faults.update(area.faults)
        total.operations += area.operations
        total.wrong_bytes += area.wrong_bytes
        total.hangs += area.hangs
        total.lost_durable += area.lost_durable
    verdict = "PASS" if total.clean and (outcome is None or outcome.returncode == 0) else "FAIL"
    lines = [
        "# Reliability evidence",
        "",
        "The promise: under faults the system degrades to misses and clear errors; it never",
        "returns wrong data, never hangs the scheduler, and never loses data it acknowledged",
        "as durable. Every test under `tests/reliability` records what it injected and what",
        "it saw (`tests/support/ledger.py`); this page is generated from one run of them by",
        "`ci/reliability_report.py`. Do not edit it by hand.",
        "",
        f"**Verdict: {verdict}** - wrong bytes, hangs and acknowledged-durable objects lost "
        "must all be 0, and pytest must pass.",
        "",
        "| area | tests | faults injected (by kind) | operations | wrong bytes | hangs "
        "| acknowledged-durable lost |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    lines.extend(_row(area) for area in sorted(areas.values(), key=lambda a: a.name.lower()))
    lines.append(_row(total))
    lines += [
        "",
        f"Faults injected in all: {sum(total.faults.values())} "
        f"({len([k for k, n in total.faults.items() if n])} kinds).",
        "",
        "Columns: *operations* are batch calls or manager steps attempted; *wrong bytes* are",
        "bytes delivered that differ from what was written; a *hang* is an operation or wait",
        "that passed its bound; *acknowledged-durable lost* counts objects a store or manager",
        "acknowledged as stored that did not read back exactly once faults stopped (after a",
        "restart where the area restarts). Objects the injector destroyed on purpose (torn",
        "writes, bit flips, objects deleted between exists and get) are not counted as lost:",
        "no single-copy store can return them; they must come back as misses or errors, never",
        "as wrong bytes, and that is what the *wrong bytes* column checks.",
        "",
    ]
    if broken:
        lines += [
            "## Entries that broke the promise",
            "",
            "| test | pytest | wrong bytes | hangs | acknowledged-durable lost |",
            "|---|---|---:|---:|---:|",
        ]
        for entry in broken:
            test = str(entry.get("test"))
            result = "not run" if outcome is None else outcome.results.get(junit_name(test), "?")
            lines.append(
                f"| `{test}` | {result.replace('|', '/')} | {entry.get('wrong_bytes')} "
                f"| {entry.get('hangs')} | {entry.get('lost_durable')} |"
            )
        lines.append("")
    lines += ["## Run", ""]
    if outcome is not None and command is not None:
        lines += [
            f"- Command: `{SGLANG_ENV_PREFIX}<tmp> {shlex.join(command)}`",
            f"- pytest: exit {outcome.returncode}; {outcome.tests} tests, "
            f"{outcome.failures} failed, {outcome.errors} errors, {outcome.skipped} skipped; "
            f"{outcome.seconds:.1f} s",
        ]
        lines += [f"- Failed: `{name}`" for name in outcome.failed]
    else:
        lines.append("- Rendered from an existing ledger directory (pytest not run).")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines += [
        f"- Date: {now}",
        f"- Machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        f"- Git revision: {_git_rev()}",
        "",
    ]
    return "\n".join(lines)


KEPT_MARK = "<!-- written by hand below: ci/reliability_report.py keeps it -->"
_GENERATED_HEADINGS = ("## Run", "## Entries that broke the promise")


def kept_sections(output: Path) -> str:
    """The hand-written end of the report at ``output``, to keep on regeneration.

    It starts at :data:`KEPT_MARK` or, in a report that has none yet, at its first
    second-level heading that this script does not write; empty when there is none.
    """
    try:
        old = output.read_text()
    except FileNotFoundError:
        return ""
    start = old.find(KEPT_MARK)
    if start < 0:
        lines = old.splitlines(keepends=True)
        offset = 0
        for line in lines:
            if line.startswith("## ") and not line.startswith(_GENERATED_HEADINGS):
                return f"\n{KEPT_MARK}\n\n{old[offset:]}"
            offset += len(line)
        return ""
    return "\n" + old[start:]


def _row(area: Area) -> str:
    return (
        f"| {area.name} | {area.tests} | {_faults_text(area.faults)} | {area.operations} "
        f"| {area.wrong_bytes} | {area.hangs} | {area.lost_durable} |"
    )


def main(argv: list[str] | None = None) -> int:
    """Run (or only render) and write the report; the exit status says whether it held."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "reliability.md")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (-n)")
    parser.add_argument(
        "--ledger-dir", type=Path, help="keep the entries here (default: a temporary directory)"
    )
    parser.add_argument("--no-run", action="store_true", help="render --ledger-dir only")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.no_run and args.ledger_dir is None:
        parser.error("--no-run needs --ledger-dir")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    with tempfile.TemporaryDirectory(prefix="reliability-ledger-") as scratch:
        ledger_dir: Path = args.ledger_dir or Path(scratch)
        ledger_dir.mkdir(parents=True, exist_ok=True)
        outcome: Outcome | None = None
        command: list[str] | None = None
        if not args.no_run:
            for stale in ledger_dir.glob("*.json"):
                stale.unlink()
            outcome, command = run_pytest(ledger_dir, args.workers, args.pytest_args)
        areas, broken = collect(ledger_dir)
    text = render(areas, broken, outcome, command)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text + kept_sections(args.output))
    clean = bool(areas) and all(area.clean for area in areas.values())
    if not areas:
        sys.stderr.write("reliability_report: no ledger entries: nothing was measured\n")
    passed = outcome is None or outcome.returncode == 0
    summary = "held" if clean and passed else "DID NOT HOLD"
    sys.stdout.write(
        f"reliability_report: wrote {args.output} ({len(areas)} areas); the promise {summary}\n"
    )
    if outcome is not None:
        sys.stdout.write(
            f"reliability_report: pytest took {outcome.seconds:.1f} s (exit {outcome.returncode})\n"
        )
    return 0 if clean and passed else 1


if __name__ == "__main__":
    sys.exit(main())
