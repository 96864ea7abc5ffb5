"""``ci/gpu_check.sh`` on a machine without CUDA: green, every gpu test skipped with its reason.

Runs the real script once (about 10 s) into a temporary directory with this interpreter and
checks its exit status and every file it writes: the JUnit XML lists each gpu test as
skipped with the CUDA reason, the benchmark reports its skip without numbers, and the
pytest run imported neither SGLang nor Mooncake (the script fails the step otherwise).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the CPU-only behaviour; CUDA is present here"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu-check") / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SGLANG_STORAGE"))}
    env["PYTHON"] = sys.executable
    env["SGLANG_STORAGE_REQUIRE"] = "sglang,mooncake"  # the script must override it
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        cwd=REPO / "tests",  # the script finds the repository itself
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done, out


def test_exits_zero_and_writes_every_file(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, out = run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for name in [
        "env.txt",
        "gpu-tests.xml",
        "gpu-tests.log",
        "gpu_transfer.json",
        "gpu_transfer.md",
        "benchmark.log",
        "summary.txt",
    ]:
        assert (out / name).is_file(), name
    assert "CUDA available: False" in (out / "env.txt").read_text()
    summary = (out / "summary.txt").read_text()
    assert "tests: exit 0" in summary
    assert "benchmark: exit 0" in summary


def test_every_gpu_test_is_reported_skipped_with_the_reason(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, out = run
    cases = ET.parse(out / "gpu-tests.xml").getroot().iter("testcase")
    by_file: dict[str, int] = {}
    for case in cases:
        skipped = case.find("skipped")
        assert skipped is not None, case.get("name")
        assert "needs gpu: CUDA is not available here" in skipped.get("message", "")
        module = case.get("classname", "").rsplit(".", 1)[-1]
        by_file[module] = by_file.get(module, 0) + 1
    assert by_file.get("test_device_pipeline", 0) >= 40
    assert by_file.get("test_transfer_matrix", 0) >= 20
    assert by_file.get("test_pinned_memory", 0) >= 5
    log = (out / "gpu-tests.log").read_text()
    # pytest's last line, e.g. "=== 85 skipped in 1.9s ===": skips only, nothing else.
    final = [line for line in log.splitlines() if line.startswith("=") and " in " in line][-1]
    assert re.fullmatch(r"=+ \d+ skipped in [\d.]+s(?: \([\d:]+\))? =+", final), final
    assert "gpu_check: the gpu tests imported" not in log


def test_benchmark_reports_its_skip_without_numbers(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, out = run
    report = json.loads((out / "gpu_transfer.json").read_text())
    assert report["skipped"].startswith("CUDA not available: skipped")
    assert report["rows"] == []
    assert "CUDA not available: skipped" in (out / "gpu_transfer.md").read_text()
    assert "CUDA not available: skipped" in (out / "benchmark.log").read_text()


def test_usage_error_without_an_output_directory() -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2
    assert "usage:" in done.stderr
