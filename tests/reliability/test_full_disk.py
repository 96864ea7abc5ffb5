"""A full disk under the ``file`` backend: writes fail cleanly, reads keep working.

Two disks, one scenario:

- ``tmpfs``: a real 4 MiB tmpfs mounted for the test (needs root and a container that
  allows ``mount``; skipped with the reason otherwise) and unmounted afterwards.
- ``quota``: the backend's real files on the ordinary disk, with the Python writer's
  write seam (``sglang_storage.storage.file._writev_full``, which every object write of
  ``_put`` goes through; the C writer is switched off for it) wrapped by
  :class:`QuotaDisk`: a write that would take the bytes under the store past a quota
  writes what fits and then fails with ``ENOSPC``, exactly as a full file system's
  ``writev`` does. Deleting objects frees quota, as on a real disk. Runs everywhere.
  The tmpfs disk runs the C writer where it is built (an ``ENOSPC`` there is handed to
  ``_put``, which meets it again and reports it).

The scenario fills the disk, then asserts: every failed write is a per-key
``CapacityError`` naming the disk (no exception escapes the batch call); every object
stored before keeps reading back correctly; nothing half-written is visible as an
object and no temporary file is left behind; and once objects are deleted, the refused
keys can be written and read again, and everything survives a reopen.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.ledger import Ledger

import sglang_storage.storage.file as file_module
from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
)
from sglang_storage.errors import CapacityError
from sglang_storage.storage.file import FileBackend, FileBackendConfig
from sglang_storage.storage.format import HEADER_SIZE

LEDGER_AREA = "full disk"

DISK_BYTES = 4 << 20
OBJECT_BYTES = 256 << 10
NAMESPACE = Namespace(model="full-disk-model", kind=DataKind.KV)
SPEC = ObjectSpec.raw(OBJECT_BYTES)
SENTINEL = 0xA5


def _content(key: ObjectKey) -> bytes:
    return random.Random(str(key)).randbytes(OBJECT_BYTES)


def _used_bytes(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += (Path(directory) / name).lstat().st_size
            except FileNotFoundError:
                continue
    return total


class QuotaDisk:
    """The file backend's write seam with a byte quota over everything under ``root``.

    A write that fits goes through unchanged. One that does not writes the bytes that
    still fit into the real temporary file and then raises ``OSError(ENOSPC)``, as a
    full file system's ``writev`` does; what the backend does with that half-written
    file is what the test checks.
    """

    def __init__(self, root: Path, quota: int, real: Callable[[int, list[memoryview]], None]):
        self.root = root
        self.quota = quota
        self.refused = 0
        self._real = real

    def writev_full(self, fd: int, views: list[memoryview]) -> None:
        wanted = sum(view.nbytes for view in views)
        room = max(0, self.quota - _used_bytes(self.root))
        if wanted <= room:
            self._real(fd, views)
            return
        fits: list[memoryview] = []
        left = room
        for view in views:
            if left <= 0:
                break
            fits.append(view[:left])
            left -= min(left, view.nbytes)
        self._real(fd, fits)
        self.refused += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def tmpfs_root(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test, or a skip saying why it cannot be."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the quota variant covers a full disk")
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if mount is None or umount is None:
        pytest.skip("no mount/umount command here; the quota variant covers a full disk")
    point = tmp_path / "tmpfs"
    point.mkdir()
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={DISK_BYTES // 1024}k", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(
            f"this container does not allow mounting a tmpfs ({done.stderr.strip()}); "
            "the quota variant covers a full disk"
        )
    try:
        yield point / "store"
    finally:
        unmounted = subprocess.run([umount, str(point)], capture_output=True, timeout=30)
        if unmounted.returncode != 0:
            subprocess.run([umount, "-l", str(point)], capture_output=True, timeout=30)


def _put(backend: FileBackend, keys: list[ObjectKey]) -> list[tuple[ObjectKey, PutOutcome, object]]:
    requests = [PutRequest(key=key, spec=SPEC, buffers=[_content(key)]) for key in keys]
    return [(r.key, r.outcome, r.error) for r in backend.put_from(requests)]


def _read(backend: FileBackend, key: ObjectKey) -> tuple[GetOutcome, bytes]:
    target = bytearray([SENTINEL]) * OBJECT_BYTES
    view = memoryview(target)
    request = GetRequest(key=key, spec=SPEC, buffers=[view[:1000], view[1000:]])
    [result] = backend.get_into([request])
    return result.outcome, bytes(target)


def _check_whole(backend: FileBackend, keys: set[ObjectKey], ledger: Ledger) -> list[str]:
    """Read ``keys`` back; report every one that is not a hit with its exact bytes."""
    problems = []
    for key in sorted(keys, key=str):
        ledger.operation()
        outcome, data = _read(backend, key)
        if outcome is not GetOutcome.HIT:
            ledger.lost(1)
            problems.append(f"{key}: {outcome.value}")
        elif data != _content(key):
            ledger.wrong(OBJECT_BYTES)
            problems.append(f"{key}: wrong bytes")
    return problems


def _fill_and_recover(root: Path, ledger: Ledger) -> None:
    keys = [NAMESPACE.key(f"obj{i:03d}") for i in range(40)]
    stored: set[ObjectKey] = set()
    refused: list[ObjectKey] = []
    with FileBackend(FileBackendConfig(root=root)) as backend:
        # Fill: batches of two until writes are refused, then one more batch of three.
        at = 0
        while at < len(keys) and len(refused) < 3:
            size = 2 if not refused else 3
            batch = keys[at : at + size]
            at += size
            ledger.operation()
            for key, outcome, error in _put(backend, batch):
                if outcome is PutOutcome.STORED:
                    stored.add(key)
                    continue
                assert outcome is PutOutcome.ERROR, (key, outcome)
                assert isinstance(error, CapacityError), error
                assert f"disk space under {root}" in error.resource
                assert error.requested == HEADER_SIZE + OBJECT_BYTES
                ledger.fault("enospc")
                refused.append(key)
        assert refused, "the disk never filled"
        assert len(stored) >= 4, "the disk filled before anything was stored"

        # Reads keep working, and nothing half-written is visible.
        assert _check_whole(backend, stored, ledger) == []
        assert backend.exists(refused) == [False] * len(refused)
        assert [_read(backend, key)[0] for key in refused] == [GetOutcome.MISS] * len(refused)
        assert list((root / "tmp").iterdir()) == [], "a failed write left its temporary file"
        objects = {
            name: (Path(d) / name).stat().st_size
            for d, _, files in os.walk(root / "objects")
            for name in files
        }
        assert sorted(objects) == sorted(key.name for key in stored)
        assert set(objects.values()) == {HEADER_SIZE + OBJECT_BYTES}
        stats = backend.stats()
        assert (stats.objects, stats.put_errors) == (len(stored), len(refused))

        # Free space: the refused keys fit again and read back correctly.
        freed = sorted(stored, key=str)[: len(refused) + 1]
        backend.delete(freed)
        stored -= set(freed)
        ledger.operation()
        again = _put(backend, refused)
        assert [outcome for _, outcome, _ in again] == [PutOutcome.STORED] * len(refused), again
        stored |= set(refused)
        assert _check_whole(backend, stored, ledger) == []

    # Everything acknowledged survives a reopen, whole.
    with FileBackend(FileBackendConfig(root=root)) as reopened:
        assert reopened.stats().objects == len(stored)
        assert _check_whole(reopened, stored, ledger) == []
    assert (ledger.wrong_bytes, ledger.lost_durable, ledger.hangs) == (0, 0, 0)


def test_full_tmpfs_fails_writes_cleanly_and_keeps_reads(tmpfs_root: Path, ledger: Ledger) -> None:
    _fill_and_recover(tmpfs_root, ledger)


def test_enospc_from_the_write_seam_fails_cleanly_and_keeps_reads(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    disk = QuotaDisk(root, DISK_BYTES, file_module._writev_full)
    monkeypatch.setattr(file_module, "_WRITE_OBJECTS", None)  # every write through the seam
    monkeypatch.setattr(file_module, "_writev_full", disk.writev_full)
    _fill_and_recover(root, ledger)
    assert disk.refused > 0, "the quota never refused a write"
