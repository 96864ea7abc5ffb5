"""The ``file`` backend's write path, on both of its writers.

Every test runs twice (``file_writer``): on the C writer (``_fileio.c``'s
``write_objects``: the header's checksums, the locked temporary file, writev, rename,
for a whole part without the GIL) and on the Python code it stands in for (``_put``,
also what a durability of ``full``, a kernel without openat2 and anything unusual get).
Both must leave the same bytes on disk and the same index, and hand anything unusual to
``_put``: a whole object already there, a torn one, a directory or a link at the key's
place, a missing namespace directory, a cap with no room.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import component_or_skip
from support.backend_conformance import as_buffers, get_bytes, namespace, pattern, put_bytes

from sglang_storage.core import GetOutcome, ObjectKey, ObjectSpec, PutOutcome, PutRequest
from sglang_storage.errors import CapacityError
from sglang_storage.policy.eviction import EvictionConfig, make_eviction_policy
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.storage import file as file_module
from sglang_storage.storage.file import Durability
from sglang_storage.storage.format import HEADER_SIZE, checksum, encode_header
from sglang_storage.storage.posix import FileMode

NS = namespace("writes")
SIZE = 3000


def key(name: str) -> ObjectKey:
    return ObjectKey(namespace=NS, name=name)


class Writer:
    """Which writer a test runs on, and what the C writer stored (by name)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stored: list[str] = []

    def check(self, *keys: ObjectKey) -> None:
        """On the C writer, ``keys`` were stored by it (not handed back to ``_put``)."""
        if self.name == "native":
            assert {k.name for k in keys} <= set(self.stored), self.stored


@pytest.fixture(params=["native", "python"])
def file_writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Writer:
    """Which writer the backend uses in this test."""
    writer = Writer(str(request.param))
    if request.param == "native":
        component_or_skip("native")
        write_objects = file_module._WRITE_OBJECTS
        assert write_objects is not None

        def recorded(items: list[Any], modes: Any, sync: bool) -> bytes:
            codes = write_objects(items, modes, sync)
            writer.stored += [
                os.fsdecode(item[1]) for item, code in zip(items, codes, strict=True) if code == 0
            ]
            return codes

        monkeypatch.setattr(file_module, "_WRITE_OBJECTS", recorded)
    else:
        monkeypatch.setattr(file_module, "_WRITE_OBJECTS", None)
    return writer


@pytest.fixture
def backend(tmp_path: Path, file_writer: Writer) -> Iterator[FileBackend]:
    with FileBackend(FileBackendConfig(root=tmp_path / "store", io_threads=2)) as opened:
        prime(opened)
        yield opened


def prime(backend: FileBackend) -> None:
    """Store one object, so the namespace's directory exists (the C writer makes only a
    missing fan directory; a new namespace is _put's)."""
    k = key("prime")
    assert put_bytes(backend, k, spec(), pattern(k, SIZE)).outcome is PutOutcome.STORED


def capped(root: Path, capacity_bytes: int) -> FileBackend:
    return FileBackend(
        FileBackendConfig(root=root, capacity_bytes=capacity_bytes),
        eviction=make_eviction_policy(EvictionConfig(name="lru")),
    )


def spec(nbytes: int = SIZE) -> ObjectSpec:
    return ObjectSpec.raw(nbytes)


def test_the_file_is_the_header_then_the_payload(backend: FileBackend, file_writer: Writer) -> None:
    k = key("layout")
    data = pattern(k, SIZE)
    assert put_bytes(backend, k, spec(), data, parts=4).outcome is PutOutcome.STORED
    file_writer.check(k)
    raw = backend.path_of(k).read_bytes()
    # Byte for byte what the Python encoder writes: checksums included.
    assert raw == encode_header(k, spec(), checksum([memoryview(data)])) + data
    result, got = get_bytes(backend, k, spec())
    assert result.outcome is GetOutcome.HIT
    assert got == data


def test_a_batch_spread_over_the_threads_is_stored_in_order(
    backend: FileBackend, file_writer: Writer
) -> None:
    keys = [key(f"batch-{i}") for i in range(40)]
    data = {k: pattern(k, 70_000) for k in keys}
    requests = [
        PutRequest(key=k, spec=spec(70_000), buffers=as_buffers(memoryview(data[k]))) for k in keys
    ]
    results = backend.put_from(requests)
    assert [r.key for r in results] == keys
    assert all(r.outcome is PutOutcome.STORED for r in results)
    file_writer.check(*keys)
    assert backend.stats().objects == len(keys) + 1  # and prime's
    for k in keys:
        result, got = get_bytes(backend, k, spec(70_000))
        assert result.outcome is GetOutcome.HIT
        assert got == data[k]
    assert list((backend.root / "tmp").iterdir()) == []  # no temporary file is left


def test_more_buffers_than_one_writev_takes(backend: FileBackend, file_writer: Writer) -> None:
    nbytes = 1500  # 1500 one-byte buffers: more than IOV_MAX (1024) in one call
    k = key("many")
    data = pattern(k, nbytes)
    views = [memoryview(data)[i : i + 1] for i in range(nbytes)]
    request = PutRequest(key=k, spec=spec(nbytes), buffers=as_buffers(*views))
    [result] = backend.put_from([request])
    assert result.outcome is PutOutcome.STORED
    file_writer.check(k)
    assert get_bytes(backend, k, spec(nbytes))[1] == data


def test_a_whole_object_is_present_and_a_torn_one_replaced(backend: FileBackend) -> None:
    whole, torn = key("whole"), key("torn")
    # Another process, opened before they were stored: its index does not know them.
    with FileBackend(FileBackendConfig(root=backend.root)) as other:
        for k in (whole, torn):
            assert put_bytes(backend, k, spec(), pattern(k, SIZE)).outcome is PutOutcome.STORED
        path = backend.path_of(torn)
        path.write_bytes(path.read_bytes()[: HEADER_SIZE + 10])
        results = other.put_from(
            [
                PutRequest(key=k, spec=spec(), buffers=as_buffers(pattern(k, SIZE)))
                for k in (whole, torn)
            ]
        )
        assert [r.outcome for r in results] == [PutOutcome.PRESENT, PutOutcome.STORED]
        assert get_bytes(other, torn, spec())[1] == pattern(torn, SIZE)


def test_a_directory_at_the_key_is_that_keys_error(backend: FileBackend) -> None:
    blocked, fine = key("blocked"), key("fine")
    backend.path_of(blocked).mkdir(parents=True)
    results = backend.put_from(
        [
            PutRequest(key=k, spec=spec(), buffers=as_buffers(pattern(k, SIZE)))
            for k in (blocked, fine)
        ]
    )
    assert [r.outcome for r in results] == [PutOutcome.ERROR, PutOutcome.STORED]
    assert "directory" in str(results[0].error)


def test_a_link_on_the_way_is_never_followed(backend: FileBackend, tmp_path: Path) -> None:
    k = key("linked")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fan = backend.path_of(k).parent
    fan.parent.mkdir(parents=True, exist_ok=True)
    fan.symlink_to(elsewhere, target_is_directory=True)
    result = put_bytes(backend, k, spec(), pattern(k, SIZE))
    assert result.outcome is PutOutcome.ERROR
    assert "link" in str(result.error)
    assert list(elsewhere.iterdir()) == []


def test_missing_directories_are_made_with_the_stores_mode(
    tmp_path: Path, file_writer: Writer
) -> None:
    config = FileBackendConfig(root=tmp_path / "store", file_mode=FileMode.GROUP_READ)
    old = os.umask(0o077)  # narrower than the mode: the bits must be set exactly
    try:
        with FileBackend(config) as backend:
            first, second = key("first"), key("second")
            # The first put makes the namespace (_put); the second a new fan (the C
            # writer, where it runs: the two names are in different fans).
            assert backend.path_of(first).parent != backend.path_of(second).parent
            for k in (first, second):
                assert put_bytes(backend, k, spec(), pattern(k, SIZE)).outcome is PutOutcome.STORED
            file_writer.check(second)
            for k in (first, second):
                path = backend.path_of(k)
                assert stat.S_IMODE(path.stat().st_mode) == 0o640
                assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
    finally:
        os.umask(old)


@pytest.mark.parametrize("durability", [Durability.DATA, Durability.FULL])
def test_each_durability_stores_whole_objects(
    tmp_path: Path, file_writer: Writer, durability: Durability
) -> None:
    config = FileBackendConfig(root=tmp_path / "store", durability=durability)
    with FileBackend(config) as backend:
        prime(backend)
        keys = [key(f"durable-{i}") for i in range(6)]
        for k in keys:
            assert put_bytes(backend, k, spec(), pattern(k, SIZE)).outcome is PutOutcome.STORED
        if durability is Durability.DATA:  # full: always _put's (it fsyncs directories)
            file_writer.check(*keys)
    with FileBackend(config) as reopened:
        for k in keys:
            assert get_bytes(reopened, k, spec())[1] == pattern(k, SIZE)


def test_a_batch_larger_than_the_cap_evicts_its_own_objects(
    tmp_path: Path, file_writer: Writer
) -> None:
    one = HEADER_SIZE + SIZE
    with capped(tmp_path / "store", 4 * one) as backend:
        prime(backend)
        keys = [key(f"capped-{i}") for i in range(10)]
        results = backend.put_from(
            [PutRequest(key=k, spec=spec(), buffers=as_buffers(pattern(k, SIZE))) for k in keys]
        )
        assert all(r.outcome is PutOutcome.STORED for r in results)
        stats = backend.stats()
        assert stats.bytes <= 4 * one
        # Which four stay depends on how the threads interleave; each reads back whole.
        kept = [k for k, there in zip(keys, backend.exists(keys), strict=True) if there]
        assert len(kept) == 4
        assert stats.evicted == 7  # prime's too
        for k in kept:
            assert get_bytes(backend, k, spec())[1] == pattern(k, SIZE)


def test_a_present_put_under_a_full_cap_evicts_nothing(tmp_path: Path, file_writer: Writer) -> None:
    one = HEADER_SIZE + SIZE
    root = tmp_path / "store"
    keys = [key(f"full-{i}") for i in range(4)]
    with capped(root, 4 * one) as backend:
        for k in keys:
            put_bytes(backend, k, spec(), pattern(k, SIZE))
        file_writer.check(*keys[1:])  # keys[0] made the namespace
    # Reopened: the index knows them from the scan; a put of one is PRESENT, no room made.
    with capped(root, 4 * one) as backend:
        assert put_bytes(backend, keys[0], spec(), pattern(keys[0], SIZE)).outcome is (
            PutOutcome.PRESENT
        )
        assert backend.exists(keys) == [True] * 4
        assert backend.stats().evicted == 0


def test_an_object_larger_than_the_cap_is_refused(tmp_path: Path, file_writer: Writer) -> None:
    with capped(tmp_path / "store", HEADER_SIZE + 100) as backend:
        result = put_bytes(backend, key("big"), spec(), pattern(key("big"), SIZE))
    assert result.outcome is PutOutcome.ERROR
    assert isinstance(result.error, CapacityError)


def test_the_same_key_twice_in_one_batch(backend: FileBackend) -> None:
    k = key("twice")
    data = pattern(k, SIZE)
    request = PutRequest(key=k, spec=spec(), buffers=as_buffers(data))
    results = backend.put_from([request, request])
    assert all(r.ok for r in results)
    assert backend.stats().objects == 2  # and prime's
    assert get_bytes(backend, k, spec())[1] == data
