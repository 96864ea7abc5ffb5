"""``exists`` / ``prefix_hits`` of the ``file`` backend answered from its index.

The index is a cache: a key it holds is a "yes" without a system call, even after
another process removed the object (a get then misses and the key is forgotten); a key
it does not hold is looked up on disk, so an object another process wrote is found. A
get never returns a hit for a missing object, whatever exists said.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    Namespace,
    ObjectSpec,
    PutRequest,
)
from sglang_storage.storage import FileBackend, FileBackendConfig

NAMESPACE = Namespace(model="m", kind=DataKind.KV)
SPEC = ObjectSpec.raw(4096)
PAYLOAD = bytes(range(256)) * 16


def open_file(root: Path) -> FileBackend:
    return FileBackend(FileBackendConfig(root=root))


def put(backend: FileBackend, name: str) -> None:
    request = PutRequest(key=NAMESPACE.key(name), spec=SPEC, buffers=(memoryview(PAYLOAD),))
    assert all(r.ok for r in backend.put_from([request]))


def get(backend: FileBackend, name: str) -> tuple[GetOutcome, bytes]:
    out = bytearray(b"\xff" * SPEC.nbytes)
    request = GetRequest(key=NAMESPACE.key(name), spec=SPEC, buffers=(memoryview(out),))
    (result,) = backend.get_into([request])
    return result.outcome, bytes(out)


def test_an_indexed_key_is_answered_without_the_file_system(tmp_path: Path) -> None:
    with open_file(tmp_path / "store") as backend:
        put(backend, "a")
        backend.path_of(NAMESPACE.key("a")).unlink()  # behind the index's back
        assert backend.exists([NAMESPACE.key("a")]) == [True]  # a cache's stale yes
        outcome, data = get(backend, "a")
        assert outcome is GetOutcome.MISS
        assert data != PAYLOAD
        # The miss taught the index: it now looks on disk, and finds nothing.
        assert backend.exists([NAMESPACE.key("a")]) == [False]
        assert backend.prefix_hits([NAMESPACE.key("a")]) == 0


def test_a_key_another_process_wrote_is_found_on_disk(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with open_file(root) as reader, open_file(root) as writer:
        keys = [NAMESPACE.key(n) for n in ("a", "b", "c")]
        assert reader.exists(keys) == [False, False, False]
        put(writer, "a")
        put(writer, "b")
        assert reader.exists(keys) == [True, True, False]
        assert reader.prefix_hits(keys) == 2
        assert get(reader, "b") == (GetOutcome.HIT, PAYLOAD)


def test_a_namespace_cleared_elsewhere_never_reads_as_a_hit(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with open_file(root) as first, open_file(root) as second:
        put(first, "a")
        assert first.exists([NAMESPACE.key("a")]) == [True]
        second.clear(NAMESPACE)
        outcome, _ = get(first, "a")
        assert outcome is GetOutcome.MISS
        assert first.exists([NAMESPACE.key("a")]) == [False]


def test_clear_and_delete_forget_at_once(tmp_path: Path) -> None:
    with open_file(tmp_path / "store") as backend:
        put(backend, "a")
        put(backend, "b")
        backend.delete([NAMESPACE.key("a")])
        assert backend.exists([NAMESPACE.key("a"), NAMESPACE.key("b")]) == [False, True]
        backend.clear(NAMESPACE)
        assert backend.exists([NAMESPACE.key("b")]) == [False]


def test_a_reopened_store_answers_from_its_rebuilt_index(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with open_file(root) as backend:
        for name in ("a", "b"):
            put(backend, name)
    with open_file(root) as backend:
        assert backend.stats().objects == 2
        shutil.rmtree(root / "objects")
        (root / "objects").mkdir(mode=0o700)
        assert backend.prefix_hits([NAMESPACE.key("a"), NAMESPACE.key("b")]) == 2
        assert get(backend, "a")[0] is GetOutcome.MISS
        assert backend.prefix_hits([NAMESPACE.key("a"), NAMESPACE.key("b")]) == 0


def test_clear_forgets_only_its_namespace(tmp_path: Path) -> None:
    other = Namespace(model="other", kind=DataKind.KV)
    page = "ab" * 32
    with open_file(tmp_path / "store") as backend:
        for namespace in (NAMESPACE, other):
            for name in (page, page.upper(), "text"):
                request = PutRequest(
                    key=namespace.key(name), spec=SPEC, buffers=(memoryview(PAYLOAD),)
                )
                assert all(r.ok for r in backend.put_from([request]))
        assert backend.stats().objects == 6
        backend.clear(NAMESPACE)
        assert backend.stats().objects == 3
        names = (page, page.upper(), "text")
        assert backend.exists([NAMESPACE.key(n) for n in names]) == [False] * 3
        shutil.rmtree(backend.root / "objects" / "other")  # only the index can answer now
        assert backend.exists([other.key(n) for n in names]) == [True] * 3


def test_eviction_removes_the_files_of_its_victims(tmp_path: Path) -> None:
    from sglang_storage.policy import LRUPolicy

    size = 512 + SPEC.nbytes
    config = FileBackendConfig(root=tmp_path / "store", capacity_bytes=2 * size)
    names = ["cd" * 32, "Victim-Name", "third"]
    with FileBackend(config, eviction=LRUPolicy()) as backend:
        for name in names:
            put(backend, name)
        assert backend.stats().objects == 2
        assert not backend.path_of(NAMESPACE.key(names[0])).exists()  # the oldest went
        put(backend, names[0])
        assert not backend.path_of(NAMESPACE.key(names[1])).exists()  # a text name too
        assert backend.exists([NAMESPACE.key(n) for n in names]) == [True, False, True]
    with FileBackend(config, eviction=LRUPolicy()) as reopened:
        assert reopened.stats().objects == 2
