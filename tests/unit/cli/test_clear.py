"""``sglang-storage clear --model M`` and ``fsck --purge-quarantine``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes

from sglang_storage.cli import main
from sglang_storage.core import GetOutcome, ObjectSpec, PutOutcome
from sglang_storage.storage import FileBackend, FileBackendConfig

SPEC = ObjectSpec.raw(4096)


def _store(root: Path) -> None:
    with FileBackend(FileBackendConfig(root=root)) as store:
        for model, count in (("model-a", 3), ("model-b", 2)):
            ns = namespace(model=model)
            for i in range(count):
                key = ns.key(f"k{i}")
                assert put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes)).outcome is (
                    PutOutcome.STORED
                )


def _exists(root: Path, model: str, count: int) -> list[bool]:
    with FileBackend(FileBackendConfig(root=root, read_only=True)) as store:
        return store.exists([namespace(model=model).key(f"k{i}") for i in range(count)])


def _on_terminal(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    monkeypatch.setattr("sglang_storage.cli.fsck.on_terminal", lambda: value)
    monkeypatch.setattr("sglang_storage.cli.clear.on_terminal", lambda: value)


def test_clear_deletes_one_models_objects_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    _store(root)
    foreign = root / "objects" / "notes.txt"
    foreign.write_bytes(b"someone's")
    _on_terminal(monkeypatch, False)
    assert main(["clear", "--dir", str(root), "--model", "model-a", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["objects"], document["dry_run"], document["left"]) == (3, False, [])
    assert _exists(root, "model-a", 3) == [False] * 3
    assert _exists(root, "model-b", 2) == [True] * 2
    assert foreign.read_bytes() == b"someone's"


def test_clear_is_a_dry_run_on_a_terminal_unless_yes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    _store(root)
    _on_terminal(monkeypatch, True)
    assert main(["clear", "--dir", str(root), "--model", "model-b"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out
    assert "delete 2 object(s)" in out
    assert _exists(root, "model-b", 2) == [True] * 2
    assert main(["clear", "--dir", str(root), "--model", "model-b", "--yes"]) == 0
    assert "removed 2 object(s)" in capsys.readouterr().out
    assert _exists(root, "model-b", 2) == [False] * 2


def test_clear_refuses_a_model_the_store_does_not_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    _store(root)
    _on_terminal(monkeypatch, False)
    assert main(["clear", "--dir", str(root), "--model", "model-c"]) == 2
    err = capsys.readouterr().err
    assert "matches no stored object" in err
    assert "model-a (3)" in err
    assert "model-b (2)" in err
    assert _exists(root, "model-a", 3) == [True] * 3


def _quarantine_two(root: Path) -> None:
    ns = namespace(model="model-a")
    with FileBackend(FileBackendConfig(root=root)) as store:
        for i in range(2):
            path = store.path_of(ns.key(f"k{i}"))
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(raw)
            result, _ = get_bytes(store, ns.key(f"k{i}"), SPEC)
            assert result.outcome is GetOutcome.CORRUPT
        assert store.quarantined == 2


def test_fsck_purge_quarantine_plans_then_removes_what_the_backend_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    _store(root)
    _quarantine_two(root)
    stray = root / "quarantine" / "keep me"
    stray.write_bytes(b"not the backend's")
    quarantined = sorted(p for p in (root / "quarantine").iterdir() if p != stray)
    assert len(quarantined) == 2
    _on_terminal(monkeypatch, True)
    assert main(["fsck", "--dir", str(root), "--purge-quarantine"]) == 0
    assert "dry run" in capsys.readouterr().out
    assert all(p.exists() for p in quarantined)
    assert main(["fsck", "--dir", str(root), "--purge-quarantine", "--yes", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert sorted(entry["location"] for entry in document["purge_quarantine"]) == [
        str(p) for p in quarantined
    ]
    assert not any(p.exists() for p in quarantined)
    assert stray.read_bytes() == b"not the backend's"
    assert _exists(root, "model-a", 3) == [False, False, True]


def test_purge_quarantine_and_repair_are_separate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    _store(root)
    assert main(["fsck", "--dir", str(root), "--purge-quarantine", "--repair"]) == 2
    assert "separate runs" in capsys.readouterr().err
