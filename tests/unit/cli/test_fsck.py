"""``sglang-storage fsck``: argument errors, exit statuses, the JSON document, and what
it finds and repairs in a real store with planted damage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.backend_conformance import namespace, pattern, put_bytes
from support.mooncake import LOOPBACK, MooncakeMaster

from sglang_storage.cli import main
from sglang_storage.core import ObjectSpec, PutOutcome
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.storage.format import HEADER_SIZE
from sglang_storage.storage.posix import TempNames

KV = namespace()

FSCK_KEYS = {
    "schema",
    "command",
    "backend",
    "options",
    "payloads_checked",
    "model",
    "summary",
    "problems",
    "foreign",
    "plan",
    "dry_run",
    "repair",
    "exit_status",
}
SUMMARY_KEYS = {"objects", "problems", "exposed", "states", "kinds", "namespaces"}
REPORT_KEYS = {"state", "location", "key", "kind", "bytes", "reason", "exposed"}


def make_store(root: Path, count: int = 3) -> FileBackend:
    backend = FileBackend(FileBackendConfig(root=root))
    for i in range(count):
        key = KV.key(f"obj{i}")
        data = pattern(key, 256)
        assert put_bytes(backend, key, ObjectSpec.raw(256), data).outcome is PutOutcome.STORED
    return backend


def damage(root: Path) -> tuple[Path, Path]:
    """Flip a payload bit of obj1 and leave a dead writer's temp file; returns both paths."""
    with make_store(root) as backend:
        path = backend.path_of(KV.key("obj1"))
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 100] ^= 0x01
    path.write_bytes(raw)
    orphan = Path(TempNames().next(root / "tmp", "tmp"))  # named like ours, nobody's lock
    orphan.write_bytes(b"torn")
    return path, orphan


def fsck(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """Run ``fsck --json ARGV``; returns the status, the parsed document and stderr."""
    status = main(["fsck", "--json", *argv])
    captured = capsys.readouterr()
    return status, json.loads(captured.out), captured.err


# ------------------------------------------------------------------ help and arguments


def test_help_has_states_exit_statuses_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fsck", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in (
        "--repair",
        "--backend NAME",
        "--backend-config JSON",
        "--dir PATH",
        "--model FINGERPRINT",
        "--headers-only",
        "--dry-run",
        "--yes",
        "--adopt",
        "exposed",
        "--json",
        "orphaned_temp",
        "wrong_version",
        "foreign",
        "0  no problems",
        "1  problems found, all repaired",
        "4  problems found and left",
        "8  operational error",
        "sglang-storage fsck --dir /data/kv-cache --repair",
    ):
        assert needle in text, needle


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--backend-config", "{root: x}"], "is not valid JSON", id="bad-json"),
        pytest.param(["--backend-config", "[1, 2]"], "must be a JSON object", id="not-object"),
        pytest.param(["--backend", "nosuch"], "not a known backend; choose one of", id="name"),
        pytest.param([], "needs its root directory: --dir PATH", id="no-root"),
        pytest.param(["--dir", ""], "--dir: empty path", id="empty-dir"),
        pytest.param(
            ["--dir", "/x", "--backend-config", '{"root": "/y"}'], "give the root once", id="twice"
        ),
        pytest.param(
            ["--backend", "memory", "--dir", "/x"], "has no root directory option", id="no-root-opt"
        ),
        pytest.param(
            ["--backend-config", '{"root": "/x", "colour": 1}'], "colour", id="unknown-option"
        ),
        pytest.param(
            ["--backend-config", '{"root": "/x", "io_threads": 0}'], "io_threads", id="bad-value"
        ),
        pytest.param(["--dir", "/x", "--model", ""], "--model: empty fingerprint", id="model"),
        pytest.param(
            ["--repair", "--backend-config", '{"root": "/x", "read_only": true}'],
            "--repair needs a writable backend",
            id="repair-read-only",
        ),
        pytest.param(["--dir", "/x", "--yes"], "go with --repair", id="yes-alone"),
        pytest.param(["--dir", "/x", "--dry-run"], "go with --repair", id="dry-run-alone"),
        pytest.param(
            ["--dir", "/x", "--repair", "--dry-run", "--yes"], "give one", id="dry-run-and-yes"
        ),
        pytest.param(
            ["--backend", "memory", "--adopt"], "has no store marker to adopt", id="adopt-memory"
        ),
        pytest.param(
            ["--backend-config", '{"root": "/x", "file_mode": "0644"}'], "file_mode", id="mode"
        ),
    ],
)
def test_argument_errors_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["fsck", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("sglang-storage fsck: error: ")
    assert message in captured.err
    status, document, _ = fsck(capsys, *argv)
    assert status == 2
    assert document == {
        "schema": 1,
        "command": "fsck",
        "error": document["error"],
        "exit_status": 2,
    }
    assert message in document["error"]


def test_unknown_flag_is_argparse_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fsck", "--fix-everything"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --fix-everything" in capsys.readouterr().err


# ------------------------------------------------------------------ exit statuses


def test_clean_store_is_0_with_the_json_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_store(tmp_path).close()
    status, document, err = fsck(capsys, "--dir", str(tmp_path))
    assert (status, err) == (0, "")
    assert set(document) == FSCK_KEYS
    assert document["schema"] == 1
    assert document["command"] == "fsck"
    assert document["backend"] == "file"
    assert document["options"] == {"root": str(tmp_path)}
    assert document["payloads_checked"] is True
    assert document["model"] is None
    assert document["exit_status"] == 0
    assert (document["problems"], document["foreign"], document["repair"]) == ([], [], None)
    summary = document["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert summary["objects"] == {"count": 3, "bytes": 3 * (HEADER_SIZE + 256)}
    assert summary["problems"] == 0
    assert summary["kinds"]["kv"] == {"count": 3, "bytes": 3 * (HEADER_SIZE + 256)}
    assert summary["namespaces"] == {"model-a/kv/all": summary["objects"]}
    assert set(summary["states"]) == {
        "ok",
        "corrupt",
        "wrong_version",
        "wrong_model",
        "orphaned_temp",
        "foreign",
        "quarantined",
        "in_progress",
    }


def test_problems_found_are_4_and_nothing_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt, orphan = damage(tmp_path)
    before = corrupt.read_bytes()
    status, document, _ = fsck(capsys, "--dir", str(tmp_path))
    assert status == 4
    assert document["exit_status"] == 4
    problems = {p["state"]: p for p in document["problems"]}
    assert set(problems) == {"corrupt", "orphaned_temp"}
    assert all(set(p) == REPORT_KEYS for p in document["problems"])
    assert problems["corrupt"]["key"] == "model-a/kv/all/obj1"
    assert problems["corrupt"]["kind"] == "kv"
    assert problems["corrupt"]["reason"] == "payload checksum mismatch"
    assert problems["corrupt"]["location"] == str(corrupt)
    assert problems["orphaned_temp"]["location"] == str(orphan)
    assert document["summary"]["objects"]["count"] == 2
    assert corrupt.read_bytes() == before
    assert orphan.exists(), "fsck without --repair must not even clean up at open"

    main(["fsck", "--dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert "corrupt        " + str(corrupt) + ": payload checksum mismatch" in text
    assert "orphaned_temp" in text
    assert "result: 2 problem(s) found; run with --repair to fix them" in text


def test_repair_is_1_then_clean_is_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corrupt, orphan = damage(tmp_path)
    (tmp_path / "notes.txt").write_text("not the store's")
    status, document, _ = fsck(capsys, "--dir", str(tmp_path), "--repair")
    assert status == 1
    actions = {a["state"]: a["action"] for a in document["repair"]}
    # The repair removes the orphan itself: reopening for it cleans up nothing unshown.
    assert actions == {"corrupt": "quarantined", "orphaned_temp": "removed"}
    assert [(p["state"], p["action"]) for p in document["plan"]] == [
        ("corrupt", "quarantined"),
        ("orphaned_temp", "removed"),
    ]
    assert document["dry_run"] is False
    assert [f["location"] for f in document["foreign"]] == [str(tmp_path / "notes.txt")]
    assert not corrupt.exists()
    assert not orphan.exists()
    assert (tmp_path / "notes.txt").exists()

    main(["fsck", "--dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert "result: clean" in text
    assert "foreign" in text
    assert "quarantined" in text
    status, document, _ = fsck(capsys, "--dir", str(tmp_path), "--repair")
    assert (status, document["repair"]) == (0, None)


def test_model_and_headers_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damage(tmp_path)
    status, document, _ = fsck(capsys, "--dir", str(tmp_path), "--headers-only")
    assert document["payloads_checked"] is False
    assert [p["state"] for p in document["problems"]] == ["orphaned_temp"]
    assert status == 4
    status, document, _ = fsck(capsys, "--dir", str(tmp_path), "--model", "model-z")
    assert document["model"] == "model-z"
    states = sorted(p["state"] for p in document["problems"])
    assert states == ["corrupt", "orphaned_temp", "wrong_model", "wrong_model"]
    # A fingerprint that matches nothing stored would delete every object: refused.
    status, document, err = fsck(capsys, "--dir", str(tmp_path), "--model", "model-z", "--repair")
    assert status == 2
    assert "--model 'model-z' matches no stored object" in err
    assert "model-a (3)" in document["error"]
    status, document, _ = fsck(capsys, "--dir", str(tmp_path))
    assert (status, document["summary"]["objects"]["count"]) == (4, 2)


def test_memory_backend_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    status, document, _ = fsck(capsys, "--backend", "memory")
    assert (status, document["summary"]["objects"]["count"]) == (0, 0)


def test_missing_directory_is_an_operational_error_and_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nothing-here"
    status, document, err = fsck(capsys, "--dir", str(missing))
    assert status == 8
    assert document["exit_status"] == 8
    assert "is not a directory" in err
    assert not missing.exists()


def test_store_of_another_format_version_is_8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_store(tmp_path).close()
    (tmp_path / "sglang-storage.json").write_text('{"format_version": 7}')
    status, _, err = fsck(capsys, "--dir", str(tmp_path))
    assert status == 8
    assert "format version 7" in err


@pytest.mark.mooncake
def test_mooncake_cannot_be_scanned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with MooncakeMaster(tmp_path) as master:
        config = json.dumps(
            {
                "master_address": master.master_address,
                "metadata_server": master.metadata_url,
                "local_hostname": LOOPBACK,
                "global_segment_size": 0,
                "local_buffer_size": "16MiB",
            }
        )
        status, document, err = fsck(capsys, "--backend", "mooncake", "--backend-config", config)
        assert status == 8
        assert "cannot enumerate the objects it holds" in err
        assert "Mooncake's Python client has no call that lists keys" in document["error"]
        # stats still shows the backend's own counters.
        assert main(["stats", "--backend", "mooncake", "--backend-config", config, "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert (stats["scanned"], stats["contents"]) == (False, None)
        assert "objects" in stats["backend_stats"]


def test_dry_run_shows_the_plan_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt, orphan = damage(tmp_path)
    before = corrupt.read_bytes()
    status, document, _ = fsck(capsys, "--dir", str(tmp_path), "--repair", "--dry-run")
    assert (status, document["dry_run"], document["repair"]) == (4, True, None)
    assert {(p["location"], p["action"]) for p in document["plan"]} == {
        (str(corrupt), "quarantined"),
        (str(orphan), "removed"),
    }
    assert corrupt.read_bytes() == before
    assert orphan.exists()
    assert main(["fsck", "--dir", str(tmp_path), "--repair", "--dry-run"]) == 4
    text = capsys.readouterr().out
    assert f"quarantine   {corrupt}" in text
    assert f"remove       {orphan}" in text
    assert "dry run (--dry-run): nothing was changed" in text


def test_exposed_objects_are_listed_in_the_human_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with make_store(tmp_path) as backend:
        path = backend.path_of(KV.key("obj2"))
    path.chmod(0o644)
    assert main(["fsck", "--dir", str(tmp_path)]) == 4
    text = capsys.readouterr().out
    assert f"exposed        {path}: mode 0644 lets other users in" in text
    assert "result: 1 problem(s) found" in text
