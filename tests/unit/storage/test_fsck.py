"""Checking what a backend holds: the shared classification, and scan/repair of the
``file`` and ``memory`` backends on real directories with planted damage.

Damage is planted the way it happens: a flipped payload bit, a file cut short, a header
byte hit, a writer killed mid-write (a temporary file named like ours whose lock nobody
holds), an object of another format version, and files that are not ours (in the root,
under ``objects/``, in a fan directory they do not belong to, in ``tmp/`` with a name that
only looks like an old writer's).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.backend_conformance import get_bytes, namespace, pattern, put_bytes

from sglang_storage.core import DataKind, GetOutcome, ObjectKey, ObjectSpec, PutOutcome
from sglang_storage.errors import BackendUnavailableError, StateError
from sglang_storage.storage import (
    FileBackend,
    FileBackendConfig,
    MemoryBackend,
    ObjectReport,
    ObjectState,
    RepairAction,
    summarize,
)
from sglang_storage.storage.format import FORMAT_VERSION, HEADER_SIZE, checksum, encode_header
from sglang_storage.storage.fsck import inspect_header, inspect_object
from sglang_storage.storage.posix import TempNames, create_temp

KV = namespace()
EMB = namespace(kind=DataKind.EMBEDDING)
OTHER_MODEL = namespace(model="model-b")


def dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


HELD: list[int] = []
"""Descriptors of temporary files this test process holds the lock of (a live writer)."""


@pytest.fixture(autouse=True)
def _release_held_temp_files() -> Iterator[None]:
    yield
    while HELD:
        os.close(HELD.pop())


def orphan_temp(directory: Path, data: bytes) -> Path:
    """A temporary file as a writer killed mid-write leaves it: named like ours, unlocked."""
    path = Path(TempNames().next(directory, "tmp"))
    path.write_bytes(data)
    return path


def live_temp(directory: Path, data: bytes) -> Path:
    """A temporary file whose writer (this process) still holds its lock."""
    fd, path = create_temp(TempNames(), directory, "tmp", 0o600, exact=False)
    os.write(fd, data)
    HELD.append(fd)
    return Path(path)


def store(backend: FileBackend | MemoryBackend, key: ObjectKey, nbytes: int) -> bytes:
    data = pattern(key, nbytes)
    assert put_bytes(backend, key, ObjectSpec.raw(nbytes), data).outcome is PutOutcome.STORED
    return data


def other_version(raw: bytes, version: int = FORMAT_VERSION + 1) -> bytes:
    """``raw`` as a future format version would have written it (version field changed)."""
    changed = bytearray(raw)
    changed[4:6] = version.to_bytes(2, "little")
    return bytes(changed)


def tree(root: Path) -> dict[str, tuple[int, int, float]]:
    """Every path under ``root`` with its inode, size and mtime."""
    out: dict[str, tuple[int, int, float]] = {}
    for path in sorted(root.rglob("*")):
        stat = path.lstat()
        out[str(path.relative_to(root))] = (stat.st_ino, stat.st_size, stat.st_mtime)
    return out


def states(reports: list[ObjectReport]) -> dict[str, ObjectState]:
    return {report.location: report.state for report in reports}


# ------------------------------------------------------------------ classification


def test_header_classification() -> None:
    key = KV.key("obj")
    data = pattern(key, 100)
    header = encode_header(key, ObjectSpec.raw(100), checksum([memoryview(data)]))
    ok = inspect_header(header, where="x", expected=key)
    assert (ok.state, ok.reason) == (ObjectState.OK, "")
    assert ok.header is not None
    assert ok.header.key == key

    short = inspect_header(header[:100], where="x")
    assert (short.state, short.reason) == (ObjectState.CORRUPT, "truncated header (100 bytes)")
    garbage = inspect_header(b"\x5a" * HEADER_SIZE, where="x")
    assert garbage.state is ObjectState.CORRUPT
    assert "not an sglang-storage object" in garbage.reason
    future = inspect_header(other_version(header), where="x")
    assert future.state is ObjectState.WRONG_VERSION
    assert future.reason == f"format version {FORMAT_VERSION + 1}; this build reads version 1"
    hit = bytearray(header)
    hit[40] ^= 0xFF
    assert inspect_header(hit, where="x").reason == "header checksum mismatch"
    elsewhere = inspect_header(header, where="x", expected=KV.key("other"))
    assert elsewhere.state is ObjectState.CORRUPT
    assert elsewhere.reason == "holds object model-a/kv/all/obj, not model-a/kv/all/other"
    model = inspect_header(header, where="x", model="model-b")
    assert model.state is ObjectState.WRONG_MODEL
    assert "'model-a', not 'model-b'" in model.reason

    size = HEADER_SIZE + 100
    good = ok.header.payload_checksum
    assert inspect_object(ok, stored_bytes=size, payload_checksum=good).state is ObjectState.OK
    assert inspect_object(ok, stored_bytes=size, payload_checksum=None).state is ObjectState.OK
    assert inspect_object(ok, stored_bytes=size - 1, payload_checksum=None).reason == (
        "truncated: 99 of 100 payload bytes"
    )
    assert inspect_object(ok, stored_bytes=size + 1, payload_checksum=None).reason == (
        "has bytes after its payload"
    )
    assert inspect_object(ok, stored_bytes=size, payload_checksum=good ^ 1).reason == (
        "payload checksum mismatch"
    )
    # A header that already failed stays as it was.
    assert inspect_object(future, stored_bytes=0, payload_checksum=None) is future


def test_summary_counts_by_state_kind_and_namespace() -> None:
    reports = [
        ObjectReport(state=ObjectState.OK, location="a", nbytes=10, key=KV.key("a")),
        ObjectReport(state=ObjectState.OK, location="b", nbytes=20, key=KV.key("b")),
        ObjectReport(state=ObjectState.OK, location="c", nbytes=5, key=EMB.key("c")),
        ObjectReport(state=ObjectState.CORRUPT, location="d", nbytes=7, key=KV.key("d")),
        ObjectReport(state=ObjectState.FOREIGN, location="e", nbytes=3),
        ObjectReport(state=ObjectState.ORPHANED_TEMP, location="f", nbytes=1),
    ]
    summary = summarize(reports)
    assert (summary.objects.count, summary.objects.bytes) == (3, 35)
    assert summary.problems == 2  # foreign is reported, not a problem
    assert summary.kinds[DataKind.KV].count == 2
    assert summary.kinds[DataKind.EMBEDDING].bytes == 5
    assert summary.kinds[DataKind.WEIGHT].count == 0
    assert list(summary.namespaces) == ["model-a/embedding/all", "model-a/kv/all"]
    document = summary.as_json()
    assert document["problems"] == 2
    assert document["states"]["corrupt"] == {"count": 1, "bytes": 7}
    assert set(document["states"]) == {s.value for s in ObjectState}


# ------------------------------------------------------------------ file backend


def planted_store(root: Path) -> dict[str, Path]:
    """A store with one of each kind of thing fsck must tell apart; returns their paths."""
    with FileBackend(FileBackendConfig(root=root)) as backend:
        for i in range(4):
            store(backend, KV.key(f"good{i}"), 300 + i)
        store(backend, EMB.key("emb"), 1000)
        for name in ("flip", "cut", "head", "future"):
            store(backend, KV.key(name), 500)
        paths = {name: backend.path_of(KV.key(name)) for name in ("flip", "cut", "head", "future")}
        paths["good0"] = backend.path_of(KV.key("good0"))
    raw = bytearray(paths["flip"].read_bytes())
    raw[HEADER_SIZE + 250] ^= 0x10
    paths["flip"].write_bytes(raw)
    os.truncate(paths["cut"], HEADER_SIZE + 100)
    raw = bytearray(paths["head"].read_bytes())
    raw[40] ^= 0xFF
    paths["head"].write_bytes(raw)
    paths["future"].write_bytes(other_version(paths["future"].read_bytes()))
    paths["orphan"] = orphan_temp(root / "tmp", b"half an object")
    paths["live"] = live_temp(root / "tmp", b"being written")
    fan = paths["good0"].parent
    wrong_fan = fan.parent / f"{(int(fan.name, 16) + 1) % 256:02x}"
    wrong_fan.mkdir(exist_ok=True)
    foreign = {
        "notes": root / "notes.txt",
        "readme": root / "objects" / "README",
        "badkind": root / "objects" / "model-a" / "no-such-kind" / "all" / "00" / "obj",
        "badname": fan / "bad name!",
        "misplaced": wrong_fan / "good0",
        "tmpjunk": root / "tmp" / "editor.swp",
        # <pid>.<anything> of a dead pid: how temporary files were once named, and how
        # anyone's file may be named. Not ours: reported, never removed.
        "pidlike": root / "tmp" / f"{dead_pid()}.0123abcd.7.tmp",
    }
    for name, path in foreign.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * 700)
        paths[name] = path
    return paths


def test_file_scan_tells_every_kind_of_thing_apart_and_changes_nothing(tmp_path: Path) -> None:
    paths = planted_store(tmp_path)
    before = tree(tmp_path)
    with FileBackend(FileBackendConfig(root=tmp_path, read_only=True)) as backend:
        assert backend.read_only
        assert backend.capabilities.scannable
        reports = list(backend.scan())
        assert list(backend.scan()) == reports, "a scan is repeatable"
    assert tree(tmp_path) == before, "opening read-only and scanning changed the store"

    found = states(reports)
    expected = {
        "flip": ObjectState.CORRUPT,
        "cut": ObjectState.CORRUPT,
        "head": ObjectState.CORRUPT,
        "future": ObjectState.WRONG_VERSION,
        "orphan": ObjectState.ORPHANED_TEMP,
        "live": ObjectState.IN_PROGRESS,
        "notes": ObjectState.FOREIGN,
        "readme": ObjectState.FOREIGN,
        "misplaced": ObjectState.FOREIGN,
        "badname": ObjectState.FOREIGN,
        "tmpjunk": ObjectState.FOREIGN,
        "pidlike": ObjectState.FOREIGN,
        "good0": ObjectState.OK,
    }
    for name, state in expected.items():
        assert found[str(paths[name])] is state, name
    assert found[str(tmp_path / "objects" / "model-a" / "no-such-kind" / "all")] is (
        ObjectState.FOREIGN
    )
    reasons = {r.location: r.reason for r in reports}
    assert reasons[str(paths["flip"])] == "payload checksum mismatch"
    assert reasons[str(paths["cut"])] == "truncated: 100 of 500 payload bytes"
    assert reasons[str(paths["head"])] == "header checksum mismatch"
    assert "format version 2" in reasons[str(paths["future"])]
    assert "not in its fan directory" in reasons[str(paths["misplaced"])]

    summary = summarize(reports)
    assert summary.objects.count == 5
    sizes = [HEADER_SIZE + 300 + i for i in range(4)] + [HEADER_SIZE + 1000]
    assert summary.objects.bytes == sum(sizes)
    assert summary.kinds[DataKind.EMBEDDING].count == 1
    assert summary.problems == 5
    assert summary.states[ObjectState.FOREIGN].count == 7  # badkind: its directory


def test_headers_only_scan_skips_payload_checksums(tmp_path: Path) -> None:
    paths = planted_store(tmp_path)
    with FileBackend(FileBackendConfig(root=tmp_path, read_only=True)) as backend:
        found = states(list(backend.scan(payloads=False)))
    assert found[str(paths["flip"])] is ObjectState.OK, "a payload bit flip needs the payload"
    assert found[str(paths["cut"])] is ObjectState.CORRUPT, "sizes are still checked"


def test_repair_quarantines_removes_and_keeps_what_is_not_ours(tmp_path: Path) -> None:
    paths = planted_store(tmp_path)
    with FileBackend(FileBackendConfig(root=tmp_path, read_only=True)) as backend:
        reports = list(backend.scan())
        with pytest.raises(StateError, match="read-only"):
            backend.repair(reports)
    problems = [r for r in reports if r.state.problem]
    with FileBackend(FileBackendConfig(root=tmp_path)) as backend:
        results = backend.repair(reports)
        assert [r.report for r in results] == reports
        actions = {r.report.location: r.action for r in results}
        for name in ("flip", "cut", "head", "future"):
            assert actions[str(paths[name])] is RepairAction.QUARANTINED, name
        # Opening the store removed the dead writer's temporary file first.
        assert actions[str(paths["orphan"])] is RepairAction.GONE
        for name in ("notes", "misplaced", "badname", "live", "good0", "tmpjunk", "pidlike"):
            assert actions[str(paths[name])] is RepairAction.KEPT, name
        assert all(r.action.resolved for r in results if r.report.state.problem)
        assert len(problems) == 5
        assert backend.quarantined == 4
        after = list(backend.scan())
        for name in ("flip", "future", "orphan"):
            assert not paths[name].exists()
        for name in ("notes", "misplaced", "badname", "live", "tmpjunk", "pidlike"):
            assert paths[name].exists(), f"{name} is not ours to remove and must stay"
        assert summarize(after).problems == 0
        assert summarize(after).states[ObjectState.QUARANTINED].count == 4
        # A repaired key is a plain miss; it can be written again.
        result, _ = get_bytes(backend, KV.key("future"), ObjectSpec.raw(500))
        assert result.outcome is GetOutcome.MISS
        store(backend, KV.key("future"), 500)


def test_repair_removes_an_orphan_a_running_backend_left(tmp_path: Path) -> None:
    with FileBackend(FileBackendConfig(root=tmp_path)) as backend:
        orphan = orphan_temp(tmp_path / "tmp", b"x" * 10)
        [report] = [r for r in backend.scan() if r.state is ObjectState.ORPHANED_TEMP]
        [result] = backend.repair([report])
        assert result.action is RepairAction.REMOVED
        assert not orphan.exists()
        [again] = backend.repair([report])
        assert again.action is RepairAction.GONE


def test_repair_leaves_an_object_replaced_since_the_scan(tmp_path: Path) -> None:
    with FileBackend(FileBackendConfig(root=tmp_path)) as backend:
        key = KV.key("replaced")
        data = store(backend, key, 400)
        path = backend.path_of(key)
        raw = bytearray(path.read_bytes())
        path.write_bytes(bytes(raw[:-1]))
        [report] = [r for r in backend.scan() if r.state is ObjectState.CORRUPT]
        # Another writer puts a whole object in place (a new inode, as a rename makes).
        fresh = path.with_name("fresh")
        fresh.write_bytes(raw)
        fresh.replace(path)
        [result] = backend.repair([report])
        assert (result.action, result.reason) == (RepairAction.GONE, "replaced since the scan")
        result_get, got = get_bytes(backend, key, ObjectSpec.raw(400))
        assert result_get.outcome is GetOutcome.HIT
        assert got == data


def test_wrong_model_only_with_a_model_and_repair_deletes_it(tmp_path: Path) -> None:
    with FileBackend(FileBackendConfig(root=tmp_path)) as backend:
        store(backend, KV.key("mine"), 100)
        store(backend, OTHER_MODEL.key("theirs"), 100)
        assert summarize(backend.scan()).problems == 0
        reports = list(backend.scan(model="model-a"))
        [stale] = [r for r in reports if r.state is ObjectState.WRONG_MODEL]
        assert stale.key == OTHER_MODEL.key("theirs")
        [result] = backend.repair([stale])
        assert result.action is RepairAction.REMOVED
        assert backend.exists([OTHER_MODEL.key("theirs"), KV.key("mine")]) == [False, True]
        assert summarize(backend.scan(model="model-a")).problems == 0


def test_foreign_and_old_format_files_are_reported_and_read_as_no_data(tmp_path: Path) -> None:
    paths = planted_store(tmp_path)
    # A whole directory of old-format objects, as an older build would have left them.
    with FileBackend(FileBackendConfig(root=tmp_path)) as backend:
        assert not paths["orphan"].exists(), "open removes a dead writer's temporary files"
        old = [KV.key(f"old{i}") for i in range(3)]
        for key in old:
            store(backend, key, 64)
            path = backend.path_of(key)
            path.write_bytes(other_version(path.read_bytes(), version=0))
        reports = list(backend.scan())
        found = states(reports)
        for key in old:
            assert found[str(backend.path_of(key))] is ObjectState.WRONG_VERSION
        # Reads never crash and never deliver: a file that is not where a key lives is a
        # miss; an old-format object is refused (and quarantined) and then a miss.
        result, got = get_bytes(backend, KV.key("notes"), ObjectSpec.raw(700 - HEADER_SIZE))
        assert result.outcome is GetOutcome.MISS
        misplaced, _ = get_bytes(backend, KV.key("good0"), ObjectSpec.raw(300))
        assert misplaced.outcome is GetOutcome.HIT, "the real good0, not the misplaced copy"
        for key in old:
            first, got = get_bytes(backend, key, ObjectSpec.raw(64))
            assert first.outcome is GetOutcome.CORRUPT
            assert "format version 0" in str(first.error)
            assert got in (bytes(64), bytes([0xA5]) * 64)
            second, _ = get_bytes(backend, key, ObjectSpec.raw(64))
            assert second.outcome is GetOutcome.MISS
        assert backend.exists([KV.key("notes"), KV.key("misplaced")]) == [False, False]


def test_read_only_open_refuses_changes_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(BackendUnavailableError, match="not a directory"):
        FileBackend(FileBackendConfig(root=missing, read_only=True))
    assert not missing.exists()
    paths = planted_store(tmp_path)
    before = tree(tmp_path)
    with FileBackend(FileBackendConfig(root=tmp_path, read_only=True)) as backend:
        assert backend.stats().objects == 9
        key = KV.key("new")
        with pytest.raises(StateError, match="read-only"):
            put_bytes(backend, key, ObjectSpec.raw(10), bytes(10))
        with pytest.raises(StateError, match="read-only"):
            backend.delete([KV.key("good0")])
        with pytest.raises(StateError, match="read-only"):
            backend.clear(KV)
        # A failed read is reported, but the file stays where it is.
        result, _ = get_bytes(backend, KV.key("flip"), ObjectSpec.raw(500))
        assert result.outcome is GetOutcome.CORRUPT
        assert backend.quarantined == 0
        assert paths["flip"].exists()
    assert tree(tmp_path) == before


def test_read_only_open_refuses_another_format_version(tmp_path: Path) -> None:
    FileBackend(FileBackendConfig(root=tmp_path)).close()
    (tmp_path / "sglang-storage.json").write_text('{"format_version": 99}\n')
    with pytest.raises(BackendUnavailableError, match="format version 99"):
        FileBackend(FileBackendConfig(root=tmp_path, read_only=True))


def test_exposed_objects_and_quarantined_files_are_narrowed_never_through_a_link(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("someone's")
    outside.chmod(0o644)
    root = tmp_path / "store"
    with FileBackend(FileBackendConfig(root=root)) as backend:
        store(backend, KV.key("open"), 100)
        store(backend, KV.key("closed"), 100)
        opened = backend.path_of(KV.key("open"))
        opened.chmod(0o664)
        moved = root / "quarantine" / "1.2.old"
        moved.write_bytes(b"aside")
        moved.chmod(0o644)
        (root / "quarantine" / "1.3.link").symlink_to(outside)
        reports = list(backend.scan())
        exposed = sorted(r.location for r in reports if r.exposed)
        assert exposed == sorted([str(opened), str(moved)])
        assert summarize(reports).exposed.count == 2
        assert summarize(reports).problems == 2
        results = {r.report.location: r.action for r in backend.repair(reports)}
        assert results[str(opened)] is RepairAction.RESTRICTED
        assert results[str(moved)] is RepairAction.RESTRICTED
    assert (opened.stat().st_mode & 0o777, moved.stat().st_mode & 0o777) == (0o600, 0o600)
    assert outside.stat().st_mode & 0o777 == 0o644, "a link was followed"


# ------------------------------------------------------------------ memory backend


def test_memory_scan_and_repair() -> None:
    backend = MemoryBackend()
    assert backend.capabilities.scannable
    for i in range(3):
        store(backend, KV.key(f"m{i}"), 200)
    store(backend, OTHER_MODEL.key("theirs"), 50)
    backend._objects[KV.key("m1")][HEADER_SIZE + 3] ^= 1
    stored = backend._objects[KV.key("m2")]
    stored[:] = other_version(bytes(stored))
    reports = list(backend.scan(model="model-a"))
    found = {r.key.name: r.state for r in reports if r.key is not None}
    assert found == {
        "m0": ObjectState.OK,
        "m1": ObjectState.CORRUPT,
        "m2": ObjectState.WRONG_VERSION,
        "theirs": ObjectState.WRONG_MODEL,
    }
    results = backend.repair(reports)
    assert [r.action for r in results] == [
        RepairAction.KEPT,
        RepairAction.REMOVED,
        RepairAction.REMOVED,
        RepairAction.REMOVED,
    ]
    assert backend.exists([KV.key("m0"), KV.key("m1")]) == [True, False]
    assert summarize(backend.scan()).objects.count == 1
    assert backend.stats().objects == 1
    assert [r.action for r in backend.repair(reports[1:2])] == [RepairAction.GONE]
