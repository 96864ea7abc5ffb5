"""Stored KV is private: what the backends create, and what fsck says about the rest.

KV pages encode users' prompts. Every file the ``file`` and ``hf3fs`` backends create
(objects, temporary files, the marker, data and lock files, quarantined copies) must be
``0600`` and every directory ``0700`` unless ``file_mode`` shares them with a group, and
that must hold whatever the process umask is. Objects an older version left ``0644``
are reported by ``sglang-storage fsck`` as exposed and ``--repair`` narrows them. As root,
a real other user (``nobody``) then tries to read an object.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from conftest import component_or_skip
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes
from support.ledger import Ledger

import sglang_storage.storage.file as file_module
from sglang_storage.cli import main
from sglang_storage.core import GetOutcome, ObjectSpec, PutOutcome
from sglang_storage.storage import FileBackend, FileBackendConfig, Hf3fsBackend, Hf3fsBackendConfig
from sglang_storage.storage.format import HEADER_SIZE

LEDGER_AREA: Final = "permissions"

KEYS = [namespace().key(f"page{i}") for i in range(3)]
SPEC = ObjectSpec.raw(900)
NOBODY: Final = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def modes_under(root: Path) -> dict[str, int]:
    """The permission bits of ``root`` and of everything under it."""
    found = {".": mode(root)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = mode(path)
    return found


def wrong_modes(root: Path, file_bits: int, dir_bits: int) -> dict[str, str]:
    """Entries under ``root`` whose bits are not the expected ones, as octal text."""
    wrong = {}
    for name, bits in modes_under(root).items():
        expected = dir_bits if (root / name).is_dir() else file_bits
        if bits != expected:
            wrong[name] = f"{bits:04o} (expected {expected:04o})"
    return wrong


@pytest.fixture(params=[0o022, 0o000, 0o002], ids=["umask022", "umask000", "umask002"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def store_pages(backend: FileBackend | Hf3fsBackend) -> None:
    for key in KEYS:
        assert put_bytes(backend, key, SPEC, pattern(key, SPEC.nbytes)).outcome is (
            PutOutcome.STORED
        )


@pytest.mark.parametrize("writer", ["native", "python"])
def test_file_backend_creates_everything_private(
    tmp_path: Path, ledger: Ledger, umask: int, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """On the C writer (where built) and on the Python one, whose temporary files are
    also seen while they are written; the C writer's become the objects checked below."""
    root = tmp_path / "store"
    temp_modes: list[int] = []
    real_write = file_module._writev_full

    def seen(fd: int, views: list[memoryview]) -> None:
        temp_modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real_write(fd, views)

    if writer == "native":
        component_or_skip("native")
    else:
        monkeypatch.setattr(file_module, "_WRITE_OBJECTS", None)
    monkeypatch.setattr(file_module, "_writev_full", seen)
    if umask != 0o022:
        ledger.fault("umask")
    ledger.operation(len(KEYS) + 1)
    with FileBackend(FileBackendConfig(root=root)) as backend:
        store_pages(backend)
        # A damaged object goes to quarantine/, still private.
        path = backend.path_of(KEYS[0])
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE] ^= 1
        path.write_bytes(raw)
        result, _ = get_bytes(backend, KEYS[0], SPEC)
        assert result.outcome is GetOutcome.CORRUPT
        assert backend.quarantined == 1
    if writer == "python":
        assert temp_modes == [0o600] * len(KEYS), "temporary files"
    else:  # the first put made the namespace (_put's); the C writer wrote the others
        assert temp_modes == [0o600], "temporary files"
    assert wrong_modes(root, 0o600, 0o700) == {}


def test_quarantine_narrows_an_object_an_older_version_left_open(
    tmp_path: Path, ledger: Ledger
) -> None:
    root = tmp_path / "store"
    ledger.fault("exposed_mode")
    ledger.operation(2)
    with FileBackend(FileBackendConfig(root=root)) as backend:
        store_pages(backend)
        path = backend.path_of(KEYS[1])
        path.chmod(0o644)
        path.write_bytes(path.read_bytes()[:-1])  # and damaged: it is quarantined
        result, _ = get_bytes(backend, KEYS[1], SPEC)
        assert result.outcome is GetOutcome.CORRUPT
    [moved] = (root / "quarantine").iterdir()
    assert mode(moved) == 0o600


def test_group_mode_is_exact_and_kept_by_the_store(
    tmp_path: Path, ledger: Ledger, umask: int
) -> None:
    root = tmp_path / "store"
    if umask != 0o022:
        ledger.fault("umask")
    ledger.operation(2 * len(KEYS))
    with FileBackend(FileBackendConfig(root=root, file_mode="0660")) as backend:
        store_pages(backend)
    assert json.loads((root / "sglang-storage.json").read_text())["file_mode"] == "0660"
    # A later open without the option keeps the store's mode.
    with FileBackend(FileBackendConfig(root=root)) as backend:
        key = namespace().key("later")
        assert put_bytes(backend, key, SPEC, bytes(SPEC.nbytes)).outcome is PutOutcome.STORED
    assert wrong_modes(root, 0o660, 0o770) == {}


def test_hf3fs_backend_creates_everything_private(
    tmp_path: Path, ledger: Ledger, umask: int
) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    if umask != 0o022:
        ledger.fault("umask")
    ledger.operation(len(KEYS) + 1)
    config = Hf3fsBackendConfig(
        root=root, allow_non_3fs=True, client="posix", data_file_size=64 * 1024, data_files=2
    )
    with Hf3fsBackend(config) as backend:
        store_pages(backend)
        where = backend.locate(KEYS[2])
        assert where is not None
        fd = os.open(where.path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff", where.offset + HEADER_SIZE + 3)
        finally:
            os.close(fd)
        result, _ = get_bytes(backend, KEYS[2], SPEC)
        assert result.outcome is GetOutcome.CORRUPT
    assert len(list((root / "quarantine").iterdir())) == 1
    assert wrong_modes(root, 0o600, 0o700) == {}


def test_fsck_reports_exposed_objects_and_repair_narrows_them(
    tmp_path: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    with FileBackend(FileBackendConfig(root=root)) as backend:
        store_pages(backend)
        paths = [backend.path_of(key) for key in KEYS]
    for path in paths[:2]:
        path.chmod(0o644)  # as an older version created every object
    ledger.fault("exposed_mode", 2)
    ledger.operation(3)
    assert main(["fsck", "--dir", str(root), "--json"]) == 4
    document = json.loads(capsys.readouterr().out)
    assert document["summary"]["exposed"]["count"] == 2
    exposed = sorted(p["location"] for p in document["problems"] if p["exposed"])
    assert exposed == sorted(str(p) for p in paths[:2])
    assert all("mode 0644" in p["reason"] for p in document["problems"])

    assert main(["fsck", "--dir", str(root), "--repair", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert {(r["action"], r["location"]) for r in document["repair"]} == {
        ("restricted", str(p)) for p in paths[:2]
    }
    assert [mode(p) for p in paths] == [0o600] * 3
    assert main(["fsck", "--dir", str(root)]) == 0
    capsys.readouterr()
    with FileBackend(FileBackendConfig(root=root, read_only=True)) as backend:
        for key in KEYS:
            result, got = get_bytes(backend, key, SPEC)
            assert (result.outcome, got == pattern(key, SPEC.nbytes)) == (GetOutcome.HIT, True)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (as ``/var/cache`` is; pytest's are ``0700``)."""
    directory = Path(tempfile.mkdtemp(prefix="sgs-open-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as another user")
def test_another_local_user_cannot_read_a_stored_page(open_dir: Path, ledger: Ledger) -> None:
    with FileBackend(FileBackendConfig(root=open_dir / "kv")) as backend:
        store_pages(backend)
        path = backend.path_of(KEYS[0])
    ledger.fault("other_user")
    ledger.operation()
    read = subprocess.run(
        ["cat", str(path)],
        capture_output=True,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        timeout=30,
        check=False,
    )
    if read.returncode == 0:
        ledger.wrong(len(read.stdout))
    assert read.returncode != 0, "user nobody read a stored KV page"
    assert b"Permission denied" in read.stderr
