"""The ``sglang-file`` bench baseline: SGLang 0.5.23's real ``HiCacheFile`` behind ``--compare``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from sglang_storage_adapters.bench_baselines import SGLANG_FILE, SGLangFileBaseline

from sglang_storage.cli import main
from sglang_storage.cli.bench_baseline import baseline_entry, baseline_names
from sglang_storage.errors import BackendUnavailableError


def test_the_baseline_is_found_through_its_entry_point() -> None:
    assert "sglang-file" in baseline_names()
    assert baseline_entry("sglang-file") is SGLANG_FILE


@pytest.mark.sglang
def test_sglang_file_stores_and_reads_back_pages(tmp_path: Path) -> None:
    baseline = SGLangFileBaseline(tmp_path)
    src = torch.randint(0, 256, (5, 4096), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    names = [f"{i:064x}" for i in range(5)]
    assert baseline.exists(names) == 0
    assert baseline.put(names[:3], list(src[:3].unbind(0))) == 3
    assert baseline.exists(names) == 3
    assert baseline.get(names, list(dst.unbind(0))) == 3
    assert torch.equal(dst[:3], src[:3])
    assert not dst[3:].any()
    # HiCacheFile's own layout: one raw page per file.
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 3
    assert all(f.endswith(".bin") for f in files)
    assert all(p.stat().st_size == 4096 for p in tmp_path.iterdir())
    baseline.close()


def row_line(out: str, row: str, side: str) -> str:
    """The printed table line of ``side`` for ``row`` ("get warm", ...)."""
    width = len(row.split()) + 1
    return next(line for line in out.splitlines() if line.split()[:width] == [*row.split(), side])


@pytest.mark.sglang
def test_compare_prints_both_sides_and_the_ratio(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [
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
        "--compare",
        "sglang-file",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for row in ("put", "get warm", "get cold", "exists"):
        ours, theirs = row_line(out, row, "ours"), row_line(out, row, "baseline")
        assert theirs.split()[len(row.split()) + 1] == "sglang-file"
        ratio = ours.split()[-1]
        assert ratio.endswith("x")
        assert float(ratio[:-1]) > 0
    assert "= " in out.splitlines()[-1]
    assert "x sglang-file" in out.splitlines()[-1]


def test_without_sglang_the_error_says_what_to_install(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SGLang made unimportable for this test: None in sys.modules fails every import of it.
    for name in (
        "sglang",
        "sglang.srt",
        "sglang.srt.mem_cache",
        "sglang.srt.mem_cache.hicache_storage",
    ):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'sglang-storage\[sglang\]'"):
        SGLangFileBaseline(tmp_path)
    argv = ["bench", "--dir", str(tmp_path), "--compare", "sglang-file"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "backend 'sglang-file' is unavailable: " in err
    assert "pip install 'sglang-storage[sglang]'" in err
    assert list(tmp_path.iterdir()) == []
