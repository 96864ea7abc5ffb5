"""The ``file`` and ``hf3fs`` quarantine: bounded by the cap, and only for damaged objects.

A read that asks for a whole object with the wrong spec is the caller's mistake: it is
refused (nothing delivered) and the object stays, readable with its own spec. Objects
that really are damaged move to ``quarantine/`` with their bytes still counted against
``capacity_bytes`` (before, and after a reopen), so objects and quarantine together
never exceed the cap; purging the quarantine gives the room back and keeps whatever the
backend did not put there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Final

import pytest
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes
from support.ledger import Ledger

from sglang_storage.core import GetOutcome, ObjectSpec, PutOutcome
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage import FileBackend, FileBackendConfig

if TYPE_CHECKING:
    from sglang_storage.storage import Hf3fsBackendConfig

LEDGER_AREA: Final = "quarantine"

NS = namespace(model="quarantine-model")
SPEC = ObjectSpec(dtype="float16", shape=(64, 512), layout="page_first")  # 64 KiB
_CAP: Final = 1 << 20


def _capped(root: Path) -> FileBackend:
    return FileBackend(FileBackendConfig(root=root, capacity_bytes=_CAP), eviction=LRUPolicy())


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.parent != root)


def test_a_read_with_the_wrong_spec_keeps_the_object(tmp_path: Path, ledger: Ledger) -> None:
    key = NS.key("whole")
    data = pattern(key, SPEC.nbytes)
    with FileBackend(FileBackendConfig(root=tmp_path / "store")) as store:
        assert put_bytes(store, key, SPEC, data).outcome is PutOutcome.STORED
        for other in (
            ObjectSpec(dtype="bfloat16", shape=(64, 512), layout="page_first"),
            ObjectSpec(dtype="float16", shape=(512, 64), layout="page_first"),
            ObjectSpec(dtype="float16", shape=(64, 512), layout="layer_first"),
            ObjectSpec.raw(4096),
        ):
            ledger.fault("wrong_spec")
            ledger.operation()
            result, got = get_bytes(store, key, other)
            assert result.outcome is GetOutcome.CORRUPT
            assert got == bytes(other.nbytes)
        assert store.quarantined == 0
        assert list((tmp_path / "store" / "quarantine").iterdir()) == []
        ledger.operation()
        result, got = get_bytes(store, key, SPEC)
        assert result.outcome is GetOutcome.HIT
        if got != data:
            ledger.wrong(len(data))
        assert got == data


def _hf3fs_config(root: Path, *, read_only: bool = False) -> Hf3fsBackendConfig:
    """A small hf3fs store through the POSIX client (no 3FS here)."""
    from sglang_storage.storage import Hf3fsBackendConfig

    return Hf3fsBackendConfig(
        root=root,
        allow_non_3fs=True,
        data_file_size=1 << 20,
        data_files=2,
        client="posix",
        read_only=read_only,
    )


def _flip(store: FileBackend, name: str) -> None:
    path = store.path_of(NS.key(name))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)


def test_quarantined_bytes_count_against_the_cap(tmp_path: Path, ledger: Ledger) -> None:
    root = tmp_path / "store"
    with _capped(root) as store:
        for i in range(12):
            key = NS.key(f"old{i}")
            assert put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes)).outcome is (
                PutOutcome.STORED
            )
        for i in range(6):
            _flip(store, f"old{i}")
            ledger.fault("bit_flip")
            ledger.operation()
            result, _ = get_bytes(store, NS.key(f"old{i}"), SPEC)
            assert result.outcome is GetOutcome.CORRUPT
        assert store.quarantined == 6
        for i in range(20):
            key = NS.key(f"new{i}")
            ledger.operation()
            put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes))
            assert _disk_bytes(root) <= _CAP
    # Reopened, the quarantine found there is counted too.
    with _capped(root) as store:
        for i in range(20):
            key = NS.key(f"again{i}")
            ledger.operation()
            put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes))
            assert _disk_bytes(root) <= _CAP


def test_purging_the_quarantine_frees_its_room_and_keeps_strays(
    tmp_path: Path, ledger: Ledger
) -> None:
    root = tmp_path / "store"
    with _capped(root) as store:
        for i in range(14):
            key = NS.key(f"k{i}")
            put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes))
        for i in range(10):
            _flip(store, f"k{i}")
            ledger.fault("bit_flip")
            ledger.operation()
            get_bytes(store, NS.key(f"k{i}"), SPEC)
        stray = root / "quarantine" / "someone's notes"
        stray.write_bytes(b"kept")
        ledger.fault("foreign_file")
        held = store.quarantine_bytes
        assert held > 0
        removed = store.purge_quarantine()
        assert len(removed) == 10
        assert store.quarantine_bytes == 0
        assert stray.read_bytes() == b"kept"
        # The room is back: as many new objects fit as the cap allows, none evicted early.
        for i in range(14):
            key = NS.key(f"n{i}")
            ledger.operation()
            assert put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes)).outcome is (
                PutOutcome.STORED
            )
        assert store.exists([NS.key(f"n{i}") for i in range(14)]) == [True] * 14


def test_hf3fs_keeps_a_slot_read_with_the_wrong_spec(tmp_path: Path, ledger: Ledger) -> None:
    from sglang_storage.storage import Hf3fsBackend

    root = tmp_path / "hf3fs"
    root.mkdir()
    config = _hf3fs_config(root)
    key = NS.key("whole")
    data = pattern(key, SPEC.nbytes)
    with Hf3fsBackend(config) as store:
        assert put_bytes(store, key, SPEC, data).outcome is PutOutcome.STORED
        for other in (  # the same size: the same slot class, another spec in the header
            ObjectSpec(dtype="bfloat16", shape=(64, 512), layout="page_first"),
            ObjectSpec(dtype="float16", shape=(512, 64), layout="page_first"),
            ObjectSpec(dtype="float16", shape=(64, 512), layout="layer_first"),
        ):
            ledger.fault("wrong_spec")
            ledger.operation()
            result, got = get_bytes(store, key, other)
            assert result.outcome is GetOutcome.CORRUPT
            assert got == bytes(other.nbytes)
        assert store.quarantined == 0
        ledger.operation()
        result, got = get_bytes(store, key, SPEC)
        assert result.outcome is GetOutcome.HIT
        if got != data:
            ledger.wrong(len(data))
        assert got == data


def test_hf3fs_purges_its_slot_copies_and_keeps_strays(tmp_path: Path, ledger: Ledger) -> None:
    import os

    from sglang_storage.errors import StateError
    from sglang_storage.storage import Hf3fsBackend

    root = tmp_path / "hf3fs"
    root.mkdir()
    config = _hf3fs_config(root)
    with Hf3fsBackend(config) as store:
        for i in range(3):
            key = NS.key(f"h{i}")
            assert put_bytes(store, key, SPEC, pattern(key, SPEC.nbytes)).outcome is (
                PutOutcome.STORED
            )
        for i in range(2):
            where = store.locate(NS.key(f"h{i}"))
            assert where is not None
            fd = os.open(where.path, os.O_WRONLY)
            try:
                os.pwrite(fd, b"\xff" * 64, where.offset + 4096)  # inside the payload
            finally:
                os.close(fd)
            ledger.fault("bit_flip")
            ledger.operation()
            assert get_bytes(store, NS.key(f"h{i}"), SPEC)[0].outcome is GetOutcome.CORRUPT
        assert store.quarantined == 2
        quarantine = root / "quarantine"
        stray = quarantine / "someone's notes"
        stray.write_bytes(b"kept")
        (quarantine / "1.2.linked").symlink_to(stray)  # named like a copy, but a link
        ledger.fault("foreign_file")
        planned = store.purge_quarantine(dry_run=True)
        assert len(planned) == 2
        assert all(Path(path).exists() for path, _ in planned)
        removed = store.purge_quarantine()
        assert removed == planned
        assert not any(Path(path).exists() for path, _ in removed)
        assert stray.read_bytes() == b"kept"
        assert (quarantine / "1.2.linked").is_symlink()
        assert store.purge_quarantine() == []
        ledger.operation()
        key = NS.key("h2")
        result, got = get_bytes(store, key, SPEC)  # the undamaged object is untouched
        assert result.outcome is GetOutcome.HIT
        if got != pattern(key, SPEC.nbytes):
            ledger.wrong(SPEC.nbytes)
    with Hf3fsBackend(_hf3fs_config(root, read_only=True)) as reader:
        with pytest.raises(StateError, match="read-only"):
            reader.purge_quarantine()
        assert len(reader.purge_quarantine(dry_run=True)) == 0
