"""``sglang-storage fsck --repair`` removes only what it showed, and never on a typo.

An operator's slips, made on a real store: a ``--model`` fingerprint with a typo (every
object is then of "another model"), ``--repair`` typed at a terminal without a second
thought, and a repair whose plan must cover everything that changes. Each ends with the
store's files compared with what fsck reported.
"""

from __future__ import annotations

import json
import os
import pty
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, TextIO

import pytest
from support.backend_conformance import namespace, pattern, put_bytes
from support.ledger import Ledger

from sglang_storage.cli import main
from sglang_storage.core import ObjectSpec, PutOutcome
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.storage.format import HEADER_SIZE

LEDGER_AREA: Final = "fsck repair"

OURS = namespace(model="llama3-8b-bf16-p64")
THEIRS = namespace(model="qwen2-7b-bf16-p64")
SPEC = ObjectSpec.raw(300)


def make_store(root: Path, ours: int, theirs: int) -> list[Path]:
    """A store with objects of two models; returns the paths of every object."""
    paths = []
    with FileBackend(FileBackendConfig(root=root)) as backend:
        for ns, count in ((OURS, ours), (THEIRS, theirs)):
            for i in range(count):
                key = ns.key(f"p{i:04d}")
                assert put_bytes(backend, key, SPEC, pattern(key, SPEC.nbytes)).outcome is (
                    PutOutcome.STORED
                )
                paths.append(backend.path_of(key))
    return paths


def files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fsck_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    status = main(["fsck", "--json", *argv])
    document = json.loads(capsys.readouterr().out)
    assert isinstance(document, dict)
    return status, document


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[TextIO]:
    """stdin on a real terminal (a pseudo-terminal's slave end), as when a person types."""
    leader, follower = pty.openpty()
    stdin = os.fdopen(follower, "r")
    try:
        assert stdin.isatty()
        monkeypatch.setattr(sys, "stdin", stdin)
        yield stdin
    finally:
        stdin.close()
        os.close(leader)


def test_a_model_typo_is_refused_and_deletes_nothing(
    tmp_path: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    make_store(root, ours=40, theirs=0)
    before = files(root)
    ledger.fault("model_typo")
    ledger.operation()
    status, document = fsck_json(
        capsys, "--dir", str(root), "--model", "llama3-8b-bf16-p46", "--repair"
    )
    gone = len(before) - len(files(root))
    ledger.lost(gone)
    assert status == 2, document
    assert "matches no stored object" in document["error"]
    assert f"{OURS.model} (40)" in document["error"]
    assert files(root) == before


def test_repair_removes_exactly_what_its_plan_showed(
    tmp_path: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    paths = make_store(root, ours=6, theirs=4)
    damaged = paths[0]
    raw = bytearray(damaged.read_bytes())
    raw[HEADER_SIZE + 7] ^= 1
    damaged.write_bytes(raw)
    (root / "tmp" / "1234.notes").write_text("an operator's")
    before = files(root)
    ledger.fault("model_switch")
    ledger.fault("bit_flip")
    ledger.operation()
    status, document = fsck_json(capsys, "--dir", str(root), "--model", OURS.model, "--repair")
    assert status == 1, document
    plan = {entry["location"]: entry["action"] for entry in document["plan"]}
    assert plan == {str(damaged): "quarantined"} | {str(p): "removed" for p in paths[6:]}
    done = {entry["location"]: entry["action"] for entry in document["repair"]}
    assert done == plan
    after = files(root)
    changed = {path for path in before if before[path] != after.get(path)}
    unplanned = sorted(changed - set(plan))
    ledger.lost(len(unplanned))
    assert unplanned == []
    assert sorted(set(before) - set(after)) == sorted(plan)


def test_repair_at_a_terminal_shows_the_plan_and_waits_for_yes(
    tmp_path: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str], terminal: TextIO
) -> None:
    root = tmp_path / "store"
    paths = make_store(root, ours=3, theirs=2)
    before = files(root)
    ledger.fault("model_switch")
    ledger.operation(2)
    assert main(["fsck", "--dir", str(root), "--model", OURS.model, "--repair"]) == 4
    shown = capsys.readouterr().out
    assert "repair plan (dry run, nothing is changed):" in shown
    for path in paths[3:]:
        assert f"remove       {path}" in shown
    assert "dry run (stdin is a terminal): nothing was changed" in shown
    assert "--repair --yes" in shown
    assert files(root) == before

    status = main(["fsck", "--dir", str(root), "--model", OURS.model, "--repair", "--yes"])
    assert status == 1
    assert [p.exists() for p in paths] == [True] * 3 + [False] * 2
