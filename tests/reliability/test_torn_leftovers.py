"""What a crash, a full disk or another user leaves at an object's path of a ``file`` store.

A same-size file with a zeroed tail (a torn write) must not make a put ``PRESENT``; a
directory at one key's path is that key's error, not the batch's; a sparse 1 TiB file
must neither make a capped store evict its valid objects nor make fsck read a terabyte
of holes; and ``durability=full`` must fsync every directory a put created.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes
from support.ledger import Ledger

from sglang_storage.core import GetOutcome, ObjectSpec, PutOutcome, PutRequest
from sglang_storage.errors import BackendIOError
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage import Durability, FileBackend, FileBackendConfig
from sglang_storage.storage.format import HEADER_SIZE, checksum, encode_header

LEDGER_AREA: Final = "torn leftovers"

NS = namespace(model="torn-model")
SPEC = ObjectSpec.raw(4096)
_TIB: Final = 1 << 40
_FSCK: Final = "import sys; from sglang_storage.cli import main; sys.exit(main(sys.argv[1:]))"


def _file(root: Path, **options: object) -> FileBackend:
    return FileBackend(FileBackendConfig(root=root, **options))  # type: ignore[arg-type]


def test_a_same_size_torn_file_is_replaced_not_present(tmp_path: Path, ledger: Ledger) -> None:
    key = NS.key("torn")
    data = pattern(key, SPEC.nbytes)
    with _file(tmp_path / "store") as store:
        assert put_bytes(store, key, SPEC, data).outcome is PutOutcome.STORED
        path = store.path_of(key)
        whole = path.read_bytes()
        # The header and half the payload reached the disk, the rest is zeros.
        cut = HEADER_SIZE + SPEC.nbytes // 2
        path.write_bytes(whole[:cut] + bytes(len(whole) - cut))
        ledger.fault("torn_write")
        ledger.operation(2)
        again = put_bytes(store, key, SPEC, data)
        assert again.outcome is PutOutcome.STORED
        result, got = get_bytes(store, key, SPEC)
        assert result.outcome is GetOutcome.HIT
        if got != data:
            ledger.wrong(len(data))
        assert got == data
        # A whole object is still PRESENT.
        assert put_bytes(store, key, SPEC, data).outcome is PutOutcome.PRESENT


def test_a_directory_at_one_keys_path_fails_that_key_only(tmp_path: Path, ledger: Ledger) -> None:
    keys = [NS.key(f"batch{i}") for i in range(4)]
    with _file(tmp_path / "store") as store:
        blocked = store.path_of(keys[1])
        blocked.mkdir(parents=True)
        (blocked / "someone's").write_bytes(b"kept")
        ledger.fault("directory_at_path")
        for attempt in range(2):  # every retry of the batch
            ledger.operation()
            requests = [
                PutRequest(key=k, spec=SPEC, buffers=(bytearray(pattern(k, SPEC.nbytes)),))
                for k in keys
            ]
            results = store.put_from(requests)
            outcomes = [r.outcome for r in results]
            expected = PutOutcome.STORED if attempt == 0 else PutOutcome.PRESENT
            assert outcomes == [expected, PutOutcome.ERROR, expected, expected]
            assert isinstance(results[1].error, BackendIOError)
            assert "directory" in str(results[1].error)
        assert (blocked / "someone's").read_bytes() == b"kept"
        for key in (keys[0], keys[2], keys[3]):
            assert get_bytes(store, key, SPEC)[1] == pattern(key, SPEC.nbytes)


def test_a_sparse_terabyte_file_does_not_evict_a_capped_store(
    tmp_path: Path, ledger: Ledger
) -> None:
    root = tmp_path / "store"
    keys = [NS.key(f"valid{i}") for i in range(100)]
    with FileBackend(
        FileBackendConfig(root=root, capacity_bytes=1 << 20), eviction=LRUPolicy()
    ) as store:
        for key in keys:
            assert put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes)).outcome is (
                PutOutcome.STORED
            )
        sparse = store.path_of(NS.key("sparse"))
    sparse.parent.mkdir(parents=True, exist_ok=True)
    with sparse.open("wb") as handle:
        handle.truncate(_TIB)
    ledger.fault("sparse_file")
    ledger.operation(101)
    with FileBackend(
        FileBackendConfig(root=root, capacity_bytes=1 << 20), eviction=LRUPolicy()
    ) as store:
        lost = 0
        for key in keys:
            result, got = get_bytes(store, key, SPEC)
            lost += result.outcome is not GetOutcome.HIT or got != pattern(key, SPEC.nbytes)
        ledger.lost(lost)
        assert lost == 0
        assert store.stats().bytes <= 1 << 20
    assert not sparse.exists()  # quarantined: it accounts for nothing it claims


def test_fsck_of_a_sparse_object_reads_no_holes(tmp_path: Path, ledger: Ledger) -> None:
    root = tmp_path / "store"
    key = NS.key("claims-a-tib")
    spec = ObjectSpec.raw(_TIB)
    with _file(root) as store:
        path = store.path_of(key)
    path.parent.mkdir(parents=True)
    # A valid header for a 1 TiB payload, then nothing but a hole.
    header = encode_header(key, spec, checksum([memoryview(b"")]))
    with path.open("wb") as handle:
        handle.write(header)
        handle.truncate(HEADER_SIZE + _TIB)
    ledger.fault("sparse_file")
    ledger.operation()
    done = subprocess.run(
        [sys.executable, "-c", _FSCK, "fsck", "--dir", str(root)],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert done.returncode == 4, done.stdout + done.stderr
    assert "has a hole" in done.stdout


def test_full_durability_fsyncs_every_directory_it_created(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: set[tuple[int, int]] = set()
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        status = os.fstat(fd)
        synced.add((status.st_dev, status.st_ino))
        real_fsync(fd)

    key = NS.key("durable")
    with _file(tmp_path / "store", durability=Durability.FULL) as store:
        monkeypatch.setattr(os, "fsync", spy)
        ledger.operation()
        assert put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes)).outcome is (PutOutcome.STORED)
        monkeypatch.undo()
        fan = store.path_of(key).parent
        objects = store.root / "objects"
    # objects/ holds the new model directory; each directory below it holds a new entry.
    directories = [fan, *(p for p in fan.parents if p.is_relative_to(objects))]
    assert len(directories) == 5
    missing = [str(d) for d in directories if (d.stat().st_dev, d.stat().st_ino) not in synced]
    assert missing == []
