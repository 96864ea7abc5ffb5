"""Nothing destroys what it did not write: files of others in and around a store.

An operator's or another local user's files end up where a store lives: notes and
backups in ``tmp/`` whose names start with digits (``20240101.notes.txt``, ``<pid>.backup``
of a pid that no longer runs, and one named exactly as this project's temporary files
were once named, ``<pid>.<token>.<n>.tmp``), names that start with our ``.sgs-`` prefix
but are links or FIFOs, and whole directories that were never a store (a build tree whose
``tmp/`` holds ``<pid>.session`` files). Each test plants them, drives the ``file`` and
``hf3fs`` backends and ``sglang-storage fsck --repair`` over them, and checks that every
foreign file is still there, byte for byte, and is listed as foreign; a directory that
is no store is refused with a ``ConfigError`` naming it, unless adopted. Our own
temporary files (``.sgs-...``, whose lock nobody holds) are still cleaned up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final

import pytest
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes
from support.ledger import Ledger

from sglang_storage.cli import main
from sglang_storage.core import GetOutcome, ObjectSpec, PutOutcome
from sglang_storage.errors import ConfigError
from sglang_storage.storage import (
    FileBackend,
    FileBackendConfig,
    Hf3fsBackend,
    Hf3fsBackendConfig,
    ObjectState,
)
from sglang_storage.storage.posix import TempNames

LEDGER_AREA: Final = "foreign files"

KEY = namespace().key("page0")
SPEC = ObjectSpec.raw(700)


def dead_pid() -> int:
    """The pid of a child that has exited and been reaped (no process has it now)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def plant(paths: list[Path]) -> dict[Path, bytes]:
    """Write each path with content of its own; returns what each must still hold."""
    contents: dict[Path, bytes] = {}
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        contents[path] = f"someone's {path.name}\n".encode()
        path.write_bytes(contents[path])
    return contents


def untouched(contents: dict[Path, bytes]) -> list[str]:
    """The planted files that are gone or changed."""
    return [str(p) for p, data in contents.items() if not p.is_file() or p.read_bytes() != data]


def foreign_tmp_files(tmp: Path) -> list[Path]:
    """Names in ``tmp/`` that an older build took for its dead writers' temporary files."""
    return [
        tmp / "20240101.notes.txt",
        tmp / f"{dead_pid()}.backup",
        tmp / f"{dead_pid()}.0123abcd.7.tmp",
        tmp / ".sgs-notes",  # our prefix, not our name
    ]


def fsck_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object]]:
    status = main(["fsck", "--json", *argv])
    document = json.loads(capsys.readouterr().out)
    assert isinstance(document, dict)
    return status, document


def test_fsck_repair_removes_only_its_own_temporary_files(
    tmp_path: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    with FileBackend(FileBackendConfig(root=root)) as backend:
        data = pattern(KEY, SPEC.nbytes)
        assert put_bytes(backend, KEY, SPEC, data).outcome is PutOutcome.STORED
    tmp = root / "tmp"
    victim = tmp_path / "victim.txt"
    contents = plant([*foreign_tmp_files(tmp), victim, root / "notes.txt"])
    # Named exactly like one of ours, but a link (to a file outside) and a FIFO.
    names = TempNames()
    link, fifo = Path(names.next(tmp, "tmp")), Path(names.next(tmp, "tmp"))
    link.symlink_to(victim)
    os.mkfifo(fifo)
    ours = Path(names.next(tmp, "tmp"))  # a killed writer's: our name, nobody's lock
    ours.write_bytes(b"half an object")
    ledger.fault("foreign_file", len(contents) + 2)

    ledger.operation()
    status, document = fsck_json(capsys, "--dir", str(root), "--repair")
    assert status == 1, document
    foreign = document["foreign"]
    assert isinstance(foreign, list)
    listed = {entry["location"] for entry in foreign}
    expected = {str(p) for p in contents if p != victim} | {str(link), str(fifo)}
    assert listed == expected
    assert untouched(contents) == []
    assert link.is_symlink()
    assert fifo.exists()
    assert not ours.exists(), "our own orphan is still cleaned up"

    # Opening the store (its clean-up at open) spares them too, and the object is whole.
    ledger.operation(2)
    with FileBackend(FileBackendConfig(root=root)) as backend:
        result, got = get_bytes(backend, KEY, SPEC)
        assert (result.outcome, got == data) == (GetOutcome.HIT, True)
    assert untouched(contents) == []
    assert link.is_symlink()
    assert fifo.exists()


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_a_directory_that_is_no_store_is_refused_and_left_alone(
    tmp_path: Path, ledger: Ledger, backend: str
) -> None:
    project = tmp_path / "project"
    contents = plant(
        [
            project / "tmp" / f"{dead_pid()}.session",
            project / "tmp" / f"{dead_pid()}.build",
            project / "README",
        ]
    )
    before = sorted(str(p.relative_to(project)) for p in project.rglob("*"))
    ledger.fault("foreign_file", len(contents))
    ledger.operation()
    with pytest.raises(ConfigError) as raised:
        open_backend(backend, project)
    assert raised.value.field == "root"
    assert str(project) in str(raised.value)
    assert "holds no store marker" in str(raised.value)
    assert "adopt=True" in str(raised.value)
    assert untouched(contents) == []
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == before, (
        "a refused open created something"
    )


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_adopting_a_directory_keeps_what_was_in_it(
    tmp_path: Path, ledger: Ledger, backend: str
) -> None:
    project = tmp_path / "project"
    contents = plant(
        [project / "tmp" / f"{dead_pid()}.session", project / "tmp" / "4242.build", project / "x"]
    )
    ledger.fault("foreign_file", len(contents))
    data = pattern(KEY, SPEC.nbytes)
    ledger.operation(3)
    with open_backend(backend, project, adopt=True) as adopted:
        assert put_bytes(adopted, KEY, SPEC, data).outcome is PutOutcome.STORED
        reports = {r.location: r.state for r in adopted.scan()}
        for path in contents:
            assert reports[str(path)] is ObjectState.FOREIGN, path
    # Now a store (it has its marker): it opens without adopt, and still spares them.
    with open_backend(backend, project) as reopened:
        result, got = get_bytes(reopened, KEY, SPEC)
        assert (result.outcome, got == data) == (GetOutcome.HIT, True)
    assert untouched(contents) == []


def test_an_empty_or_missing_directory_becomes_a_store(tmp_path: Path, ledger: Ledger) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    ledger.operation(2)
    for root in (empty, tmp_path / "missing" / "store"):
        with FileBackend(FileBackendConfig(root=root)) as backend:
            assert put_bytes(backend, KEY, SPEC, bytes(SPEC.nbytes)).outcome is PutOutcome.STORED
        assert (root / "sglang-storage.json").is_file()


def test_fsck_of_a_directory_that_is_no_store_is_a_usage_error(
    tmp_path: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "project"
    contents = plant([project / "tmp" / f"{dead_pid()}.session"])
    ledger.fault("foreign_file")
    ledger.operation(3)
    status, document = fsck_json(capsys, "--dir", str(project), "--repair")
    assert status == 2
    error = document["error"]
    assert isinstance(error, str)
    assert str(project) in error
    assert "--adopt" in error
    # --adopt checks it as a store: the session file is listed as foreign, and kept.
    status, document = fsck_json(capsys, "--dir", str(project), "--adopt")
    assert status == 0
    foreign = document["foreign"]
    assert isinstance(foreign, list)
    assert [entry["location"] for entry in foreign] == [str(p) for p in contents]
    assert not (project / "sglang-storage.json").exists(), "a check writes nothing"
    # --adopt --repair makes it a store (the marker), still touching nothing of theirs.
    status, _ = fsck_json(capsys, "--dir", str(project), "--adopt", "--repair")
    assert status == 0
    assert (project / "sglang-storage.json").is_file()
    assert untouched(contents) == []


def open_backend(backend: str, root: Path, *, adopt: bool = False) -> FileBackend | Hf3fsBackend:
    options: dict[str, object] = {"adopt": True} if adopt else {}
    if backend == "file":
        return FileBackend(FileBackendConfig(root=root, **options))  # type: ignore[arg-type]
    return Hf3fsBackend(
        Hf3fsBackendConfig(
            root=root,
            allow_non_3fs=True,
            client="posix",
            data_file_size=64 * 1024,
            data_files=2,
            **options,  # type: ignore[arg-type]
        )
    )
