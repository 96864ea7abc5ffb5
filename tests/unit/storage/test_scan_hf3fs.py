"""Scan and repair of the ``hf3fs`` backend (POSIX path on a local directory).

Damage is written into the slots of the real data files: a flipped payload bit, a slot
whose header a future format version wrote, a header hit by a stray write; plus a dead
writer's temporary file (named like ours, its lock held by nobody) and files that are not
the backend's (one named as temporary files once were, ``<dead pid>.<...>``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes

from sglang_storage.core import GetOutcome, ObjectKey, ObjectSpec, PutOutcome
from sglang_storage.errors import StateError
from sglang_storage.storage import (
    Hf3fsBackend,
    Hf3fsBackendConfig,
    ObjectState,
    RepairAction,
    summarize,
)
from sglang_storage.storage.format import FORMAT_VERSION, HEADER_SIZE
from sglang_storage.storage.posix import TempNames

KV = namespace()


def open_local(root: Path, **options: object) -> Hf3fsBackend:
    config = Hf3fsBackendConfig(
        root=root,
        allow_non_3fs=True,
        client="posix",
        data_file_size=256 * 1024,
        data_files=4,
        **options,  # type: ignore[arg-type]
    )
    return Hf3fsBackend(config)


def store(backend: Hf3fsBackend, key: ObjectKey, nbytes: int) -> bytes:
    data = pattern(key, nbytes)
    assert put_bytes(backend, key, ObjectSpec.raw(nbytes), data).outcome is PutOutcome.STORED
    return data


def write_at(backend: Hf3fsBackend, key: ObjectKey, offset_in_slot: int, data: bytes) -> str:
    """Overwrite bytes of ``key``'s slot behind the backend's back; returns its location."""
    where = backend.locate(key)
    assert where is not None
    fd = os.open(where.path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, where.offset + offset_in_slot)
    finally:
        os.close(fd)
    return f"{where.path}@{where.offset}"


def dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_scan_reports_slots_orphans_and_foreign_files(tmp_path: Path) -> None:
    with open_local(tmp_path) as backend:
        assert backend.capabilities.scannable
        data = {f"k{i}": store(backend, KV.key(f"k{i}"), 1000 + i) for i in range(6)}
        healthy = list(backend.scan())
        assert {r.state for r in healthy} == {ObjectState.OK}
        assert {r.key.name for r in healthy if r.key} == set(data)
        assert summarize(healthy).objects.bytes == sum(HEADER_SIZE + len(d) for d in data.values())

        flip = write_at(backend, KV.key("k1"), HEADER_SIZE + 10, bytes([data["k1"][10] ^ 1]))
        future = write_at(backend, KV.key("k2"), 4, (FORMAT_VERSION + 1).to_bytes(2, "little"))
        hit = write_at(backend, KV.key("k3"), 40, b"\xff")
        orphan = Path(TempNames().next(tmp_path / "tmp", "json"))
        orphan.write_text("{}")
        pidlike = tmp_path / "tmp" / f"{dead_pid()}.abcdef.json"
        pidlike.write_text("{}")
        notes = tmp_path / "notes.txt"
        notes.write_text("mine, not the store's")
        stray = backend.locate(KV.key("k0"))
        assert stray is not None
        loose = stray.path.parent / "extra.bin"
        loose.write_bytes(b"\0" * 100)

        reports = list(backend.scan())
        found = {r.location: r for r in reports}
        assert found[flip].state is ObjectState.CORRUPT
        assert found[flip].reason == "payload checksum mismatch"
        assert found[future].state is ObjectState.WRONG_VERSION
        assert found[hit].state is ObjectState.CORRUPT
        assert found[hit].reason == "header checksum mismatch"
        assert found[str(orphan)].state is ObjectState.ORPHANED_TEMP
        assert found[str(notes)].state is ObjectState.FOREIGN
        assert found[str(pidlike)].state is ObjectState.FOREIGN
        assert found[str(loose)].state is ObjectState.FOREIGN
        assert summarize(reports).problems == 4

        # Headers only: the payload flip goes unseen; the rest does not.
        quick = {r.location: r.state for r in backend.scan(payloads=False)}
        assert quick[flip] is ObjectState.OK
        assert quick[future] is ObjectState.WRONG_VERSION

        results = backend.repair(reports)
        actions = {r.report.location: r.action for r in results}
        assert actions[flip] is RepairAction.QUARANTINED
        assert actions[future] is RepairAction.QUARANTINED
        assert actions[hit] is RepairAction.QUARANTINED
        assert actions[str(orphan)] is RepairAction.REMOVED
        assert actions[str(notes)] is RepairAction.KEPT
        assert actions[str(pidlike)] is RepairAction.KEPT
        assert notes.exists()
        assert pidlike.exists()
        assert loose.exists()
        assert not orphan.exists()
        after = summarize(backend.scan())
        assert after.problems == 0
        assert after.objects.count == 3
        assert after.states[ObjectState.QUARANTINED].count == 3
        for name in ("k1", "k2", "k3"):
            result, _ = get_bytes(backend, KV.key(name), ObjectSpec.raw(len(data[name])))
            assert result.outcome is GetOutcome.MISS
        result, got = get_bytes(backend, KV.key("k4"), ObjectSpec.raw(1004))
        assert result.outcome is GetOutcome.HIT
        assert got == data["k4"]
        # A second repair of the same reports finds the slots rewritten (freed): no harm.
        again = backend.repair([r for r in reports if r.location == flip])
        assert [r.action for r in again] == [RepairAction.GONE]


def test_wrong_model_slots_are_freed(tmp_path: Path) -> None:
    with open_local(tmp_path) as backend:
        store(backend, KV.key("mine"), 100)
        store(backend, namespace(model="model-b").key("theirs"), 100)
        [stale] = [r for r in backend.scan(model="model-a") if r.state.problem]
        assert stale.state is ObjectState.WRONG_MODEL
        assert [r.action for r in backend.repair([stale])] == [RepairAction.REMOVED]
        assert backend.exists([namespace(model="model-b").key("theirs")]) == [False]
        assert summarize(backend.scan(model="model-a")).objects.count == 1


def test_read_only_open_changes_nothing(tmp_path: Path) -> None:
    with open_local(tmp_path) as backend:
        data = store(backend, KV.key("k"), 2000)
        flip = write_at(backend, KV.key("k"), HEADER_SIZE + 5, bytes([data[5] ^ 1]))
    orphan = Path(TempNames().next(tmp_path / "tmp", "json"))
    orphan.write_text("{}")
    with open_local(tmp_path, read_only=True) as backend:
        [report] = [r for r in backend.scan() if r.state is ObjectState.CORRUPT]
        assert report.location == flip
        result, _ = get_bytes(backend, KV.key("k"), ObjectSpec.raw(2000))
        assert result.outcome is GetOutcome.CORRUPT
        with pytest.raises(StateError, match="read-only"):
            backend.repair([report])
        with pytest.raises(StateError, match="read-only"):
            put_bytes(backend, KV.key("new"), ObjectSpec.raw(8), bytes(8))
        with pytest.raises(StateError, match="read-only"):
            backend.delete([KV.key("k")])
        assert backend.quarantined == 0
    assert orphan.exists()
    assert list((tmp_path / "quarantine").iterdir()) == []
    with open_local(tmp_path, read_only=True) as backend:
        assert [r.state for r in backend.scan() if r.state.problem] == [
            ObjectState.CORRUPT,
            ObjectState.ORPHANED_TEMP,
        ]


def test_data_files_open_to_others_are_exposed_and_repair_narrows_them(tmp_path: Path) -> None:
    with open_local(tmp_path) as backend:
        for i in range(3):
            store(backend, KV.key(f"k{i}"), 100)
        where = backend.locate(KV.key("k0"))
        assert where is not None
        assert where.path.stat().st_mode & 0o777 == 0o600
        where.path.chmod(0o644)  # as an older version created every data file
        reports = list(backend.scan())
        exposed = [r for r in reports if r.exposed]
        assert exposed
        assert all(r.location.startswith(f"{where.path}@") for r in exposed)
        assert all(r.state is ObjectState.OK for r in exposed)
        assert all("data file's mode 0644" in r.reason for r in exposed)
        assert summarize(reports).problems == len(exposed)
        results = backend.repair([r for r in reports if r.problem])
        assert {r.action for r in results} == {RepairAction.RESTRICTED}
        assert where.path.stat().st_mode & 0o777 == 0o600
        assert summarize(backend.scan()).problems == 0
