"""How the command starts and ends: no torch for light commands, one help text however the
parser is built, a closed pipe, backend listings, option typos, and ``config --check``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_storage.cli import COMMANDS, EXIT_BROKEN_PIPE, build_parser, main
from sglang_storage.storage import create_backend

SCRIPT = Path(sys.executable).with_name("sglang-storage")

# Runs main(argv) in a fresh interpreter and prints which heavy modules it imported.
_PROBE = """
import json, sys
from sglang_storage.cli import main
try:
    status = main(json.loads(sys.argv[1]))
except SystemExit as stop:
    status = stop.code
sys.stderr.write(json.dumps({"status": status, "torch": "torch" in sys.modules}) + "\\n")
"""


def _probe(*argv: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    result: dict[str, object] = json.loads(done.stderr.strip().splitlines()[-1])
    return result


def _store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    create_backend("file", {"root": str(root), "durability": "none"}).close()
    return root


def test_help_imports_no_torch() -> None:
    assert _probe("--help") == {"status": 0, "torch": False}


def test_fsck_imports_no_torch(tmp_path: Path) -> None:
    assert _probe("fsck", "--dir", str(_store(tmp_path))) == {"status": 0, "torch": False}


def test_stats_imports_no_torch(tmp_path: Path) -> None:
    assert _probe("stats", "--dir", str(_store(tmp_path))) == {"status": 0, "torch": False}


def test_config_check_imports_no_torch(tmp_path: Path) -> None:
    path = tmp_path / "storage.toml"
    path.write_text('backend = "memory"\n')
    assert _probe("config", "--check", str(path)) == {"status": 0, "torch": False}


def test_the_light_parser_lists_commands_as_the_full_one_does() -> None:
    assert build_parser(()).format_help() == build_parser().format_help()
    full = build_parser()
    assert set(COMMANDS) <= set(full.format_help().split())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_help_is_its_own(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: sglang-storage {command}")


def _closed_pipe_run(*argv: str) -> subprocess.CompletedProcess[bytes]:
    read, write = os.pipe()
    os.close(read)  # nobody will read: the first write fails with EPIPE
    try:
        return subprocess.run(
            [str(SCRIPT), *argv], stdout=write, stderr=subprocess.PIPE, timeout=120, check=False
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("argv", [("--list-backends",), ("stats", "--dir", "{root}")])
def test_a_closed_pipe_ends_quietly(argv: tuple[str, ...], tmp_path: Path) -> None:
    root = str(_store(tmp_path))
    done = _closed_pipe_run(*(a.format(root=root) for a in argv))
    assert done.returncode == EXIT_BROKEN_PIPE
    assert b"Traceback" not in done.stderr
    assert b"BrokenPipeError" not in done.stderr


def test_test_backends_are_listed_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-backends"]) == 0
    listed = capsys.readouterr().out
    assert "file " in listed
    assert "faulty" not in listed
    assert main(["--list-test-backends"]) == 0
    assert "faulty" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["fsck", "--help"])
    assert "faulty" not in capsys.readouterr().out


def test_a_backend_option_typo_suggests_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fsck", "--backend-config", json.dumps({"rot": str(tmp_path)})]) == 2
    err = capsys.readouterr().err
    assert "unknown option of the file backend: rot (did you mean 'rot' -> 'root'?)" in err
    assert "needs its root" not in err


def test_config_check_prints_the_effective_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "storage.toml"
    path.write_text(
        'backend = "file"\nhost-memory = "10GB"\nmanagers = "kv"\n'
        f'[backend-config]\nroot = "{tmp_path}"\n'
    )
    assert main(["config", "--check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: valid" in out
    assert "10000000000 bytes (9.31 GiB) per rank" in out
    assert "(default) SGLang's (write_through)" in out
    assert main(["config", "--check", str(path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["valid"] is True
    assert document["settings"] == {
        "backend": "file",
        "backend-config": {"root": str(tmp_path)},
        "host-memory": 10**10,
        "managers": ["kv"],
    }
    assert "write-policy" in document["defaults"]


def test_config_check_of_a_bad_file_names_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "storage.toml"
    path.write_text('backend = "file"\nhost-memory = "10gigs"\n')
    assert main(["config", "--check", str(path), "--json"]) == 1
    captured = capsys.readouterr()
    assert "host-memory: unknown unit 'gigs'; did you mean 10GB or 10GiB?" in captured.err
    assert json.loads(captured.out)["valid"] is False
