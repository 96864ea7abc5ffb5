"""``benchmarks/gpu_transfer.py --device cpu``: the GPU benchmark's own code, run for real on CPU.

The GPU run happens on a lent machine with minutes of time; a crash there costs the run.
Here the same rows run with a CPU "device" pool: every field is written, the bytes moved
are the pipeline's real copies, and a CPU row never claims the GPU target.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_transfer.py"


def test_cpu_rows_have_every_field_and_never_claim_the_gpu_target(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--pages",
            "3",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--page-kib",
            "64",
            "1024",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_transfer.json").read_text())
    assert report["facts"]["device"].startswith("CPU (no GPU")
    assert report["target"]["met"] is None  # no row applies: the target is about PCIe
    rows = report["rows"]
    assert [(r["layout"], r["page_bytes"]) for r in rows] == [
        ("layer_first", 64 << 10),
        ("layer_first", 1 << 20),
        ("page_first", 64 << 10),
        ("page_first", 1 << 20),
    ]
    for row in rows:
        assert row["transfer_bytes"] == 3 * row["page_bytes"]
        assert row["target_applies"] is False
        for direction in ("d2h", "h2d"):
            assert row[f"{direction}_gib_s"] > 0
            assert row[f"plain_{direction}_gib_s"] > 0
            ratio = row[f"{direction}_gib_s"] / row[f"plain_{direction}_gib_s"]
            # The rates are rounded to 3 decimals: allow for that on slow rows.
            assert abs(ratio - row[f"{direction}_ratio"]) < 0.05 * ratio + 1e-3
            assert row[f"{direction}_device_ratio"] > 0
        assert row["io_backend"].startswith("torch (")
    table = (tmp_path / "gpu_transfer.md").read_text()
    assert "not measured" in table
    assert "MISSED" not in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the GPU check runs it")
def test_without_cuda_the_default_device_skips_without_numbers(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0
    assert "CUDA not available: skipped" in done.stdout
    assert json.loads((tmp_path / "gpu_transfer.json").read_text())["rows"] == []
