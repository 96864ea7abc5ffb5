"""The installed ``sglang-storage`` command: --version, --help, and the no-command usage error."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_storage import __version__
from sglang_storage.cli import main

SCRIPT = Path(sys.executable).with_name("sglang-storage")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_package_version_is_the_installed_metadata() -> None:
    assert __version__ == importlib.metadata.version("sglang-storage")
    assert __version__ != "0+unknown"


def test_console_script_prints_the_metadata_version() -> None:
    result = _run(str(SCRIPT), "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"sglang-storage {importlib.metadata.version('sglang-storage')}\n"


def test_python_dash_m_matches_the_console_script() -> None:
    module = _run(sys.executable, "-m", "sglang_storage", "--version")
    script = _run(str(SCRIPT), "--version")
    assert module.returncode == 0, module.stderr
    assert module.stdout == script.stdout


def test_help_describes_the_tool_and_lists_the_commands() -> None:
    result = _run(str(SCRIPT), "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert text.startswith("usage: sglang-storage")
    assert "--version" in text
    assert "typed storage subsystem for SGLang" in text
    for command in ("replay", "bench", "fsck", "stats"):
        assert command in text


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no command given" in captured.err
    assert captured.err.startswith("usage: sglang-storage")


def test_unknown_argument_is_rejected_with_exit_status_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
