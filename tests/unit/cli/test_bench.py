"""``sglang-storage bench``: argument errors, tiny real runs, the JSON document, the report,
progress on stderr, neutral wording, and where ``make bench`` writes."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_storage.cli import main
from sglang_storage.cli.bench_report import (
    CHARTS,
    SCHEMA,
    SCHEMA_VERSION,
    Progress,
    goal_verdict,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[3]
FORBIDDEN = re.compile(r"MISSED|NOT met|(?i:target in the issue|issue's target)")
"""Wording a benchmark must not use: it reports ratios and, where a goal exists, met or not."""


def tiny(tmp_path: Path, *extra: str) -> list[str]:
    """A bench run of a few 4 KiB pages, the fewest repeats, in ``tmp_path``."""
    return [
        "bench",
        "--dir",
        str(tmp_path),
        "--page-sizes",
        "4KiB",
        "--batch-sizes",
        "4",
        "--total",
        "16KiB",
        "--limit-size",
        "1MiB",
        "--settle",
        "0",
        *extra,
    ]


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``argv``; it must be refused with status 2 before anything runs. Returns stderr."""
    try:
        status = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.out == ""
    assert "sglang-storage bench: error: " in captured.err
    return " ".join(captured.err.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--page-sizes", "3x"], "argument --page-sizes: '3x' is not a size"),
        (["--page-sizes", "100"], "'100' is out of range: allowed 512 B to 1 GiB"),
        (["--page-sizes", "4KiB,4KiB"], "lists a value twice"),
        (["--page-sizes", "4KiB,"], "is not a comma-separated list of sizes"),
        (["--batch-sizes", "0"], "argument --batch-sizes: 0 is out of range: allowed 1 to 65536"),
        (["--batch-sizes", "two"], "'two' is not an integer"),
        (["--concurrency", "0"], "argument --concurrency: 0 is out of range: allowed 1 to 64"),
        (["--repeats", "1"], "argument --repeats: 1 is out of range: allowed 3 to 100"),
        (["--ops", "put,delete"], "unknown operation 'delete': allowed put, get, exists"),
        (["--reads", "hot"], "unknown read kind 'hot': allowed warm, cold"),
        (["--backend-config", "{nope"], "argument --backend-config: is not valid JSON"),
        (["--backend-config", "[1]"], "must be a JSON object, got list"),
        (["--total", "256"], "argument --total: '256' is out of range"),
        (["--limit-size", "64KiB"], "argument --limit-size: '64KiB' is out of range"),
        (["--settle", "-1"], "argument --settle: -1 is out of range: allowed 0 to 600"),
    ],
)
def test_a_bad_argument_is_refused_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in usage_error(capsys, "bench", *argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "nosuch"], "argument --backend: 'nosuch' is not a known backend; allowed:"),
        (
            ["--backend-config", '{"root": "/x"}'],
            "'root' is set by the benchmark (a fresh directory per point); choose where with --dir",
        ),
        (["--backend-config", '{"io_threads": 0}'], "argument --backend-config: file backend"),
        (["--backend-config", '{"colour": 1}'], "colour"),
        (
            ["--page-sizes", "1MiB", "--total", "64KiB"],
            "is less than the largest page size (1 MiB)",
        ),
        (
            ["--attach", "/nonexistent/log.txt"],
            "argument --attach: '/nonexistent/log.txt' is not a file",
        ),
        (["--json", "/nonexistent/dir/out.json"], "argument --json: the directory of"),
        (["--dir", "/nonexistent/dir"], "argument --dir: '/nonexistent/dir' is not a directory"),
        (
            ["--backend", "memory", "--ops", "get", "--reads", "cold"],
            "'memory' does not, so nothing would be measured (add warm)",
        ),
    ],
)
def test_a_bad_combination_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in usage_error(capsys, "bench", *argv)


def test_unknown_baseline_lists_the_installed_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = usage_error(capsys, *tiny(tmp_path, "--compare", "nosuch"))
    assert "argument --compare: 'nosuch' is not an installed bench baseline" in text
    assert "installed: sglang-file" in text


def test_attach_needs_a_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    log.write_text("output\n")
    text = usage_error(capsys, *tiny(tmp_path, "--attach", str(log)))
    assert "argument --attach: needs --report" in text


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text
    assert "sglang-storage bench --compare sglang-file" in text
    for option in ("--page-sizes", "--batch-sizes", "--concurrency", "--report", "--json"):
        assert option in text


@pytest.mark.parametrize("backend", ["file", "memory"])
def test_tiny_run_times_every_operation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, backend: str
) -> None:
    scratch, out_json = tmp_path / "scratch", tmp_path / "out.json"
    scratch.mkdir()
    assert main(tiny(scratch, "--backend", backend, "--json", str(out_json))) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0] + " " + line.split()[1] for line in out.splitlines() if " ours " in line
    }
    expected = {"put ours", "get warm", "exists ours"}
    if backend == "file":
        expected.add("get cold")
        assert "note: get cold" not in out
    else:
        assert "note: get cold: not measured for memory (its pages are not local files)" in out
    assert rows == expected
    assert f"summary ({backend} at page 4 KiB, batch 4):" in out
    assert "machine limits, measured in this run" in out
    assert "note: creating an empty file in the bench directory took" in out
    # Disk fractions only where the disk bounds the result: puts and cold reads of files.
    of_disk = {
        (r["op"], r["reads"]): r["of_disk"] is not None
        for r in json.loads(out_json.read_text())["results"]
    }
    on_disk = backend == "file"
    assert of_disk.pop(("put", None)) is on_disk
    assert of_disk.pop(("get", "warm")) is False
    assert of_disk.pop(("get", "cold"), False) is on_disk
    assert of_disk == {("exists", None): False}
    # The scratch directory is removed at the end.
    assert list(scratch.iterdir()) == []


def test_json_document_schema(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = tiny(tmp_path, "--backend", "memory", "--ops", "put,exists", "--json", str(out))
    argv[argv.index("--batch-sizes") + 1] = "4,2"
    assert main(argv) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA
    assert doc["version"] == SCHEMA_VERSION == 1
    assert doc["command"][:4] == ["sglang-storage", "bench", "--backend", "memory"]
    assert {"CPU", "cores", "memory", "file system", "disk", "kernel", "Python", "torch"} <= set(
        doc["machine"]
    )
    assert doc["settings"]["page_sizes"] == [4096]
    assert doc["settings"]["batch_sizes"] == [4, 2]
    assert doc["settings"]["baseline"] is None
    for name in ("memcpy", "disk_write", "disk_read_cold"):
        limit = doc["limits"][name]
        assert limit["unit"] == "GiB/s"
        assert len(limit["samples"]) == 3
        assert limit["median"] > 0
        assert (limit["min"], limit["max"]) == (min(limit["samples"]), max(limit["samples"]))
    results = doc["results"]
    assert {(r["op"], r["batch"]) for r in results} == {
        ("put", 4),
        ("exists", 4),
        ("put", 2),
        ("exists", 2),
    }
    for r in results:
        assert r["side"] == "ours"
        assert r["name"] == "memory"
        assert r["pages"] == 4
        assert r["concurrency"] == 1
        assert len(r["samples"]) == 3
        assert sorted(r["samples"])[1] == pytest.approx(r["median"])
        assert (r["min"], r["max"]) == (min(r["samples"]), max(r["samples"]))
        assert r["ours_over_baseline"] is None
        if r["op"] == "put":
            assert r["unit"] == "GiB/s"
            assert r["of_memcpy"] == pytest.approx(r["median"] / doc["limits"]["memcpy"]["median"])
            assert r["of_disk"] is None  # the memory backend keeps no files
        else:
            assert r["unit"] == "Mkeys/s"
            assert r["of_memcpy"] is None


def test_concurrency_runs_batches_on_several_threads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = tiny(tmp_path, "--concurrency", "3", "--reads", "cold", "--ops", "get")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "batch 4, concurrency 3: 4 pages" in out
    assert "get cold  ours" in out
    assert "get warm  ours" not in out


def test_report_has_markdown_and_png_charts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.axes import Axes

    bars: list[dict[str, Any]] = []
    draw = Axes.bar

    def recording_bar(self: Axes, *args: Any, **kwargs: Any) -> Any:
        bars.append(kwargs)
        return draw(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "bar", recording_bar)
    report = tmp_path / "report"
    log = tmp_path / "host_pool.txt"
    log.write_text("alloc+free 16 pages  1.00x\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    argv = tiny(scratch, "--report", str(report), "--attach", str(log), "--reads", "warm")
    argv[argv.index("--page-sizes") + 1] = "4KiB,8KiB"
    argv[argv.index("--batch-sizes") + 1] = "4,2"
    assert main(argv) == 0
    assert f"wrote {report / 'report.md'}" in capsys.readouterr().err
    text = (report / "report.md").read_text()
    for heading in (
        "# sglang-storage bench report",
        "## Machine",
        "## Machine limits (measured in this run)",
        "## Headline: page 4 KiB, batch 4",
        "## Every measurement",
        "### host_pool.txt",
    ):
        assert heading in text
    assert "alloc+free 16 pages  1.00x" in text
    for name in CHARTS.values():
        assert f"]({name})" in text
        data = (report / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        assert len(data) > 1000
    doc = json.loads((report / "results.json").read_text())
    assert doc["schema"] == SCHEMA
    # Every chart bar carries its spread: whiskers from the slowest to the fastest pass.
    assert "whiskers reach from the slowest pass to the fastest" in text

    def whiskers(median: float, low: float, high: float) -> tuple[float, float]:
        return round(median - low, 9), round(high - median, 9)

    # Two charts (by page size: 4 and 8 KiB at batch 4; by batch: 2 and 4 at 4 KiB), three
    # panels (put, get warm, exists) each, one side: six bar series, one bar per point.
    assert len(bars) == 6
    drawn = []
    for call in bars:
        assert call["capsize"] > 0
        below, above = call["yerr"]
        drawn += [whiskers(0.0, -b, a) for b, a in zip(below, above, strict=True)]
    charted = [(4096, 4), (8192, 4), (4096, 2), (4096, 4)]
    expected = [
        whiskers(r["median"], r["min"], r["max"])
        for point in charted
        for r in doc["results"]
        if (r["page_bytes"], r["batch"]) == point
    ]
    assert sorted(drawn) == sorted(expected)
    assert all(low >= 0 and high >= 0 for low, high in drawn)


def test_progress_goes_to_stderr_and_results_to_stdout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(tiny(tmp_path)) == 0
    captured = capsys.readouterr()
    steps = [
        line for line in captured.err.splitlines() if line.startswith("sglang-storage bench: [")
    ]
    # The limits, then each phase of the one point, each with the time elapsed.
    assert [line.split("] ")[1].split(" (")[0] for line in steps] == [
        "the machine's limits",
        "page 4 KiB, batch 4: put",
        "page 4 KiB, batch 4: get warm",
        "page 4 KiB, batch 4: get cold",
        "page 4 KiB, batch 4: exists",
    ]
    assert all(
        re.search(r"^sglang-storage bench: \[\d/5\] .* \(\d+\.\d s elapsed\)$", s) for s in steps
    )
    assert re.search(r"sglang-storage bench: done: 5 steps in \d+\.\d s", captured.err)
    assert "elapsed" not in captured.out
    assert "sglang-storage bench:" not in captured.out
    assert "summary (file at page 4 KiB, batch 4):" in captured.out


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    with Progress(2, "demo", stream=terminal) as progress:
        progress.step("first")
        progress.note("a note")
        progress.step("second")
    assert "\r" in terminal.getvalue()  # tqdm redraws one line
    assert "2/2" in terminal.getvalue()
    assert "demo: a note\n" in terminal.getvalue()

    log = io.StringIO()

    def fail_in_the_first_step() -> None:
        with Progress(3, "demo", stream=log) as progress:
            progress.step("first")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        fail_in_the_first_step()
    lines = log.getvalue().splitlines()
    assert re.fullmatch(r"demo: \[1/3\] first \(\d+\.\d s elapsed\)", lines[0])
    assert re.fullmatch(r"demo: stopped in step 1 after \d+\.\d s", lines[1])
    assert "\r" not in log.getvalue()


def test_goal_verdicts_are_neutral() -> None:
    assert goal_verdict(">= 1.5x", "1.62x", True) == "goal: >= 1.5x; measured: 1.62x; met"
    assert goal_verdict(">= 1.5x", "0.87x", False) == "goal: >= 1.5x; measured: 0.87x; not met"
    assert goal_verdict(">= 90%", "-", None).endswith("; does not apply")


def test_no_benchmark_output_uses_judging_wording(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    report = tmp_path / "report"
    assert main(tiny(scratch, "--compare", "sglang-file", "--report", str(report))) == 0
    captured = capsys.readouterr()
    for text in (captured.out, captured.err, (report / "report.md").read_text()):
        assert not FORBIDDEN.search(text)
    # The scripts print through the same words; their sources hold every line they print.
    sources = [
        *(REPO / "benchmarks").glob("*.py"),
        *(REPO / "sglang_storage/cli").glob("bench*.py"),
    ]
    assert len(sources) >= 8
    offending = [
        f"{path.name}: {m.group()}"
        for path in sources
        for m in FORBIDDEN.finditer(path.read_text())
    ]
    assert offending == []


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(
    ("extra", "directory"), [((), "build/bench"), (("BENCH_REPORT=docs/bench",), "docs/bench")]
)
def test_make_bench_writes_its_report_to_build_unless_told(
    extra: tuple[str, ...], directory: str
) -> None:
    done = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "bench", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    bench = [line for line in done.stdout.splitlines() if "/sglang-storage bench " in line]
    assert len(bench) == 1
    assert f" --report {directory} " in bench[0]
    assert f"report: {directory}/report.md" in done.stdout


def test_report_without_matplotlib_says_what_to_install(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(tiny(tmp_path, "--report", str(tmp_path / "report"))) == 1
    err = capsys.readouterr().err
    assert "pip install 'sglang-storage[report]'" in err
    assert not (tmp_path / "report").exists()
