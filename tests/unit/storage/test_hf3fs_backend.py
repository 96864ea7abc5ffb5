"""The ``hf3fs`` backend: the shared conformance suite plus what only its slot layout does.

POSIX path on a local directory, not a 3FS mount: every test here except
:class:`TestHf3fsUsrbioCluster` runs the backend's POSIX client against a directory under
``tmp_path`` (opted in with ``allow_non_3fs=True``), with real data files, real ``fcntl``
locks and real processes. The on-disk layout is the one a 3FS mount gets.

The usrbio client needs a 3FS cluster: :class:`TestHf3fsUsrbioCluster` runs the
conformance suite through it when ``hf3fs_fuse`` is importable and
``SGLANG_STORAGE_HF3FS_ROOT`` names a directory on a 3FS mount, and skips otherwise.
:class:`FakeUsrbio` is a fake, named as such: a stand-in for ``hf3fs_fuse.io`` built on
``os.pread``/``os.pwrite``, so the usrbio code path (staging, chunking, registration) runs
here; it proves nothing about 3FS itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from support.backend_conformance import (
    BackendConformance,
    CorruptHow,
    OpenSpec,
    get_bytes,
    namespace,
    pattern,
    put_bytes,
)

from sglang_storage.config import build_config
from sglang_storage.core import (
    DataKind,
    EvictionPolicy,
    GetOutcome,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
)
from sglang_storage.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    CorruptObjectError,
)
from sglang_storage.policy.eviction import EvictionConfig, make_eviction_policy
from sglang_storage.storage.format import HEADER_SIZE
from sglang_storage.storage.hf3fs import (
    MARKER,
    SLOT_ALIGNMENT,
    Hf3fsBackend,
    Hf3fsBackendConfig,
    mount_of,
)

MIB = 2**20
LOCAL: dict[str, Any] = {
    "client": "posix",
    "allow_non_3fs": True,
    "data_file_size": MIB,
    "data_files": 4,
}
"""Options of a store on a local directory: small data files, the POSIX client."""

HAVE_USRBIO = importlib.util.find_spec("hf3fs_fuse") is not None
CLUSTER_ROOT = os.environ.get("SGLANG_STORAGE_HF3FS_ROOT", "")
USRBIO_SKIP = "needs a 3FS cluster (hf3fs_fuse usrbio client)" + (
    ": set SGLANG_STORAGE_HF3FS_ROOT to a directory on a 3FS mount" if HAVE_USRBIO else ""
)
REPO = Path(__file__).resolve().parents[3]


def open_local(root: Path, *, eviction: bool = False, **options: Any) -> Hf3fsBackend:
    root.mkdir(parents=True, exist_ok=True)
    config = Hf3fsBackendConfig(root=root, **{**LOCAL, **options})
    policy: EvictionPolicy[ObjectKey] | None = (
        make_eviction_policy(EvictionConfig(name="lru")) if eviction else None
    )
    return Hf3fsBackend(config, eviction=policy)


def store(backend: Hf3fsBackend, key: ObjectKey, nbytes: int) -> bytes:
    data = pattern(key, nbytes)
    result = put_bytes(backend, key, ObjectSpec.raw(nbytes), data)
    assert result.outcome is PutOutcome.STORED, result
    return data


def assert_hit(backend: Hf3fsBackend, key: ObjectKey, data: bytes) -> None:
    result, got = get_bytes(backend, key, ObjectSpec.raw(len(data)), parts=2)
    assert result.outcome is GetOutcome.HIT, result
    assert got == data


def assert_miss(backend: Hf3fsBackend, key: ObjectKey, nbytes: int) -> None:
    result, _ = get_bytes(backend, key, ObjectSpec.raw(nbytes))
    assert result.outcome is GetOutcome.MISS, result


def damage(backend: Hf3fsBackend, key: ObjectKey, offset_in_slot: int, data: bytes) -> None:
    """Overwrite bytes of ``key``'s slot behind the backend's back."""
    where = backend.locate(key)
    assert where is not None
    fd = os.open(where.path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, where.offset + offset_in_slot)
    finally:
        os.close(fd)


def read_slot(backend: Hf3fsBackend, key: ObjectKey, nbytes: int) -> bytes:
    where = backend.locate(key)
    assert where is not None
    with where.path.open("rb") as file:
        file.seek(where.offset)
        return file.read(nbytes)


class TestHf3fsBackend(BackendConformance[Hf3fsBackend]):
    """The conformance suite on the POSIX path, on a local directory (not a 3FS mount)."""

    options: ClassVar[dict[str, Any]] = LOCAL

    def root_of(self, tmp_path: Path) -> Path:
        return tmp_path / "store"

    def make_backend(self, tmp_path: Path) -> Hf3fsBackend:
        return open_local(self.root_of(tmp_path), **self.options)

    def reopen(self, backend: Hf3fsBackend, tmp_path: Path) -> Hf3fsBackend:
        backend.close()
        return open_local(backend.root, **self.options)

    def open_spec(self, tmp_path: Path) -> OpenSpec:
        return ("hf3fs", {**self.options, "root": str(self.root_of(tmp_path))})

    def make_bounded_backend(self, tmp_path: Path, capacity_bytes: int) -> Hf3fsBackend:
        return open_local(
            self.root_of(tmp_path) / "bounded",
            eviction=True,
            capacity_bytes=capacity_bytes,
            **self.options,
        )

    def corrupt(self, backend: Hf3fsBackend, key: ObjectKey, how: CorruptHow) -> None:
        header = read_slot(backend, key, HEADER_SIZE)
        nbytes = int.from_bytes(header[16:24], "little")
        if how == "flip":
            offset = HEADER_SIZE + nbytes // 2
            byte = read_slot(backend, key, offset + 1)[offset]
            damage(backend, key, offset, bytes([byte ^ 0x10]))
        elif how == "truncate":
            # A slot has no end of its own: a truncated object is one whose payload's
            # tail was never written (zeros in a fresh data file).
            half = nbytes // 2
            damage(backend, key, HEADER_SIZE + half, bytes(nbytes - half))
        else:
            damage(backend, key, 40, bytes([header[40] ^ 0xFF]))


# ------------------------------------------------------------------ layout


def test_capabilities_and_client(tmp_path: Path) -> None:
    with open_local(tmp_path) as backend:
        caps = backend.capabilities
        assert (caps.zero_copy, caps.durable, caps.shared_across_processes) == (True, True, True)
        assert not caps.shared_across_hosts
        assert not caps.bounded
        assert backend.name == "hf3fs"
        assert backend.client == "posix"
        assert not backend.on_3fs


def test_layout_is_preallocated_slots_in_large_files(tmp_path: Path) -> None:
    with open_local(tmp_path, data_files=2) as backend:
        assert json.loads((tmp_path / MARKER).read_text())["layout_version"] == 1
        ns = namespace(model="fp-1", kind=DataKind.EMBEDDING)
        keys = [ns.key(f"obj{i}") for i in range(40)]
        data = {key: store(backend, key, 1000) for key in keys}
        class_dir = tmp_path / "classes" / "fp-1" / "embedding" / "all" / f"s{SLOT_ALIGNMENT}"
        geometry = json.loads((class_dir / "class.json").read_text())
        assert geometry == {
            "slot_size": SLOT_ALIGNMENT,
            "slots_per_file": MIB // SLOT_ALIGNMENT,
            "ways": 8,
            "data_files": 2,
        }
        files = sorted(class_dir.glob("*.data"))
        assert [f.name for f in files] == ["00000.data", "00001.data"]
        assert all(f.stat().st_size == MIB for f in files), "data files are sized up front"
        for key in keys:
            where = backend.locate(key)
            assert where is not None
            assert where.offset % SLOT_ALIGNMENT == 0
            raw = read_slot(backend, key, HEADER_SIZE + 1000)
            assert raw[:4] == b"SGLS"
            assert raw[HEADER_SIZE:] == data[key]
        # Forty objects, two files: no file per object.
        assert len(list(tmp_path.rglob("*.data"))) == 2


def test_objects_of_other_sizes_get_their_own_class(tmp_path: Path) -> None:
    with open_local(tmp_path) as backend:
        ns = namespace()
        small, large = ns.key("small"), ns.key("large")
        store(backend, small, 100)
        store(backend, large, 3 * SLOT_ALIGNMENT)
        sizes = {p.name for p in (tmp_path / "classes" / ns.path).iterdir()}
        assert sizes == {f"s{SLOT_ALIGNMENT}", f"s{4 * SLOT_ALIGNMENT}"}
        assert backend.exists([small, large]) == [True, True]
        # One key, one object: a put of another size finds it and keeps it.
        assert put_bytes(backend, small, ObjectSpec.raw(9000), bytes(9000)).outcome is (
            PutOutcome.PRESENT
        )


def test_object_larger_than_a_data_file_gets_whole_files(tmp_path: Path) -> None:
    with open_local(tmp_path, data_file_size=64 * 1024) as backend:
        key = namespace().key("big")
        data = store(backend, key, 200_000)
        where = backend.locate(key)
        assert where is not None
        assert where.offset == 0
        assert where.path.stat().st_size == where.slot_size == _round(200_000 + HEADER_SIZE)
        assert_hit(backend, key, data)


def _round(size: int) -> int:
    return -(-size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


# ------------------------------------------------------------------ slots


def one_set(tmp_path: Path, *, eviction: bool = False) -> Hf3fsBackend:
    """A store whose 4 KiB class is a single set of 8 slots in one 32 KiB file."""
    return open_local(
        tmp_path, eviction=eviction, data_file_size=8 * SLOT_ALIGNMENT, data_files=1, ways=8
    )


def test_slots_are_reused_after_delete(tmp_path: Path) -> None:
    with one_set(tmp_path) as backend:
        ns = namespace()
        keys = [ns.key(f"k{i}") for i in range(8)]
        for key in keys:
            store(backend, key, 1000)
        places = {key: backend.locate(key) for key in keys}
        assert len({p.offset for p in places.values() if p is not None}) == 8
        backend.delete([keys[3]])
        newcomer = ns.key("newcomer")
        data = store(backend, newcomer, 1000)
        assert backend.locate(newcomer) == places[keys[3]], "the freed slot was reused"
        assert_hit(backend, newcomer, data)
        assert [p.stat().st_size for p in (tmp_path / "classes").rglob("*.data")] == [
            8 * SLOT_ALIGNMENT
        ]


def test_full_set_without_policy_is_a_capacity_error(tmp_path: Path) -> None:
    with one_set(tmp_path) as backend:
        ns = namespace()
        for i in range(8):
            store(backend, ns.key(f"k{i}"), 1000)
        extra = ns.key("extra")
        result = put_bytes(backend, extra, ObjectSpec.raw(1000), bytes(1000))
        assert result.outcome is PutOutcome.ERROR
        assert isinstance(result.error, CapacityError)
        assert result.error.unit == "slots"
        assert "eviction policy" in str(result.error)
        stats = backend.stats()
        assert (stats.objects, stats.put_errors, stats.evicted) == (8, 1, 0)
        assert backend.exists([extra]) == [False]


def test_full_set_with_policy_evicts_its_least_recently_used(tmp_path: Path) -> None:
    with one_set(tmp_path, eviction=True) as backend:
        assert not backend.capabilities.bounded  # no byte cap, only the slots
        ns = namespace()
        keys = [ns.key(f"k{i}") for i in range(8)]
        data = {key: store(backend, key, 1000) for key in keys}
        for key in keys[:2] + keys[3:]:
            assert_hit(backend, key, data[key])  # keys[2] is now the least recent
        newcomer = ns.key("newcomer")
        assert put_bytes(backend, newcomer, ObjectSpec.raw(10), bytes(10)).ok
        assert backend.exists([*keys, newcomer]) == [True] * 2 + [False] + [True] * 6
        stats = backend.stats()
        assert (stats.objects, stats.evicted) == (8, 1)


def test_objects_another_process_wrote_are_evicted_first(tmp_path: Path) -> None:
    with one_set(tmp_path) as writer:
        ns = namespace()
        theirs = [ns.key(f"theirs{i}") for i in range(4)]
        for key in theirs:
            store(writer, key, 100)
    with one_set(tmp_path, eviction=True) as backend:
        mine = [ns.key(f"mine{i}") for i in range(4)]
        for key in mine:
            store(backend, key, 100)
        store(backend, ns.key("one-more"), 100)
        assert backend.exists(mine) == [True] * 4
        assert backend.exists(theirs).count(False) == 1


# ------------------------------------------------------------------ sharing


def test_two_instances_on_one_root_see_each_other(tmp_path: Path) -> None:
    with open_local(tmp_path) as first, open_local(tmp_path) as second:
        ns = namespace()
        key = ns.key("shared")
        data = store(first, key, 5000)
        assert second.exists([key]) == [True]
        assert second.prefix_hits([key, ns.key("absent")]) == 1
        assert_hit(second, key, data)
        assert second.stats().objects == 1, "an object met on a hit is indexed"
        assert put_bytes(second, key, ObjectSpec.raw(5000), data).outcome is PutOutcome.PRESENT
        second.delete([key])
        assert first.exists([key]) == [False]
        assert_miss(first, key, 5000)
        # A class created by the other instance after this one listed the namespace.
        other = ns.key("other-size")
        assert first.exists([other]) == [False]
        payload = store(second, other, 20_000)
        assert first.exists([other]) == [True]
        assert_hit(first, other, payload)
        first.clear(ns)
        assert second.exists([other]) == [False]
        assert_miss(second, other, 20_000)


_CHILD = textwrap.dedent(
    """
    import json, random, sys
    from pathlib import Path
    from sglang_storage.core import DataKind, Namespace, ObjectSpec, PutRequest, GetRequest
    from sglang_storage.storage.hf3fs import Hf3fsBackend, Hf3fsBackendConfig

    root, options, steps = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    backend = Hf3fsBackend(Hf3fsBackendConfig(root=Path(root), **options))
    ns = Namespace(model="model-a", kind=DataKind.KV)
    out = []
    for mode, names in steps:
        for name in names:
            key = ns.key(name)
            data = random.Random(f"payload/{key}").randbytes(3000)
            spec = ObjectSpec.raw(3000)
            if mode == "put":
                [r] = backend.put_from([PutRequest(key=key, spec=spec, buffers=[data])])
                out.append(r.outcome.value)
            else:
                target = bytearray(3000)
                [r] = backend.get_into([GetRequest(key=key, spec=spec, buffers=[target])])
                out.append(r.outcome.value if target == data or not r.hit else "wrong bytes")
    backend.close()
    print(json.dumps(out))
    """
)


def run_child(root: Path, steps: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Run ``steps`` (``("put" | "get", names)``) in another process; one outcome a name."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), json.dumps(LOCAL), json.dumps(steps)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: list[str] = json.loads(done.stdout)
    return result


def test_two_processes_see_each_others_objects(tmp_path: Path) -> None:
    ns = namespace()
    with open_local(tmp_path) as backend:
        mine = [f"parent{i}" for i in range(10)]
        for name in mine:
            store(backend, ns.key(name), 3000)
        theirs = [f"child{i}" for i in range(10)]
        outcomes = run_child(tmp_path, [("get", mine), ("put", theirs), ("put", mine[:3])])
        assert outcomes == ["hit"] * 10 + ["stored"] * 10 + ["present"] * 3
        for name in theirs:
            assert_hit(backend, ns.key(name), pattern(ns.key(name), 3000))


def test_concurrent_writers_of_one_set_never_share_a_slot(tmp_path: Path) -> None:
    """Threads of two instances fill one set: every slot goes to exactly one key."""
    ns = namespace()
    first, second = one_set(tmp_path, eviction=True), one_set(tmp_path, eviction=True)
    errors: list[str] = []

    def work(backend: Hf3fsBackend, seed: int) -> None:
        for i in range(60):
            key = ns.key(f"w{(seed * 7 + i) % 24}")
            result = put_bytes(backend, key, ObjectSpec.raw(700), pattern(key, 700))
            if not result.ok:
                errors.append(f"put {key}: {result.error}")
            got, data = get_bytes(backend, key, ObjectSpec.raw(700))
            if got.outcome not in (GetOutcome.HIT, GetOutcome.MISS):
                errors.append(f"get {key}: {got.outcome} {got.error}")
            elif got.hit and data != pattern(key, 700):
                errors.append(f"get {key}: wrong bytes")

    try:
        threads = [
            threading.Thread(target=work, args=(backend, seed))
            for seed, backend in enumerate([first, second, first, second])
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
        keys = [ns.key(f"w{i}") for i in range(24)]
        held = [key for key, found in zip(keys, first.exists(keys), strict=True) if found]
        assert len(held) == 8
        places = {first.locate(key) for key in held}
        assert len(places) == 8, "two keys in one slot"
        for key in held:
            assert_hit(second, key, pattern(key, 700))
    finally:
        first.close()
        second.close()


# ------------------------------------------------------------------ damage


def test_payload_overwritten_after_commit_is_corrupt_then_miss(tmp_path: Path) -> None:
    with open_local(tmp_path) as backend:
        key = namespace().key("torn")
        store(backend, key, 4000)
        damage(backend, key, HEADER_SIZE + 100, b"\x00\x01" * 500)
        result, out = get_bytes(backend, key, ObjectSpec.raw(4000), parts=3)
        assert result.outcome is GetOutcome.CORRUPT
        assert isinstance(result.error, CorruptObjectError)
        assert "payload checksum mismatch" in result.error.reason
        assert out == bytes(4000)
        assert backend.quarantined == 1
        assert len(list((tmp_path / "quarantine").iterdir())) == 1
        assert backend.exists([key]) == [False]
        assert_miss(backend, key, 4000)
        assert backend.stats().corrupt == 1


def test_zeroed_header_is_a_miss(tmp_path: Path) -> None:
    with open_local(tmp_path) as backend, open_local(tmp_path) as other:
        key = namespace().key("unheaded")
        data = store(backend, key, 4000)
        assert_hit(other, key, data)
        damage(backend, key, 0, bytes(HEADER_SIZE))
        for reader in (backend, other):
            result, out = get_bytes(reader, key, ObjectSpec.raw(4000))
            assert result.outcome is GetOutcome.MISS
            assert out in (bytes(4000), bytes([0xA5]) * 4000)
            assert reader.exists([key]) == [False]
        assert backend.stats().corrupt == 0
        assert put_bytes(backend, key, ObjectSpec.raw(4000), data).outcome is PutOutcome.STORED


def test_slot_reused_by_another_key_is_a_miss_not_corrupt(tmp_path: Path) -> None:
    """A stale hint leads to a slot another process gave to another key."""
    with one_set(tmp_path) as reader:
        ns = namespace()
        keys = [ns.key(f"k{i}") for i in range(8)]
        for key in keys:
            store(reader, key, 1000)
        with one_set(tmp_path) as writer:
            writer.delete([keys[0]])
            store(writer, ns.key("replacement"), 1000)
        assert_miss(reader, keys[0], 1000)
        assert reader.stats().corrupt == 0
        assert_hit(reader, ns.key("replacement"), pattern(ns.key("replacement"), 1000))


# ------------------------------------------------------------------ reopening


def test_reopen_rebuilds_the_index(tmp_path: Path) -> None:
    ns = namespace()
    other = namespace(model="model-b", shard=None)
    with open_local(tmp_path) as backend:
        data = {ns.key(f"r{i}"): store(backend, ns.key(f"r{i}"), 500 * (i + 1)) for i in range(6)}
        data[other.key("x")] = store(backend, other.key("x"), 9000)
        backend.delete([ns.key("r0")])
        del data[ns.key("r0")]
    with open_local(tmp_path) as reopened:
        stats = reopened.stats()
        assert stats.objects == len(data)
        assert stats.bytes == sum(HEADER_SIZE + len(v) for v in data.values())
        for key, value in data.items():
            assert_hit(reopened, key, value)
        assert_miss(reopened, ns.key("r0"), 500)
    bounded = open_local(tmp_path, eviction=True, capacity_bytes=2 * (HEADER_SIZE + 9000))
    with bounded:
        stats = bounded.stats()
        assert stats.bytes <= 2 * (HEADER_SIZE + 9000)
        assert stats.evicted > 0
        held = [key for key in data if bounded.exists([key])[0]]
        assert len(held) == stats.objects


def test_marker_of_another_layout_is_refused(tmp_path: Path) -> None:
    open_local(tmp_path).close()
    (tmp_path / MARKER).write_text(json.dumps({"format_version": 1, "layout_version": 99}))
    with pytest.raises(BackendUnavailableError) as caught:
        open_local(tmp_path)
    assert "layout_version" in caught.value.reason


def test_close_stops_threads_and_refuses_calls(tmp_path: Path) -> None:
    backend = open_local(tmp_path, io_threads=4)
    ns = namespace()
    for i in range(8):
        store(backend, ns.key(f"c{i}"), 100)
    backend.get_into([])
    backend.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("sglang-storage-hf3fs")]
    with pytest.raises(BackendUnavailableError):
        backend.locate(ns.key("c0"))


# ------------------------------------------------------------------ configuration


def test_config_accepts_sizes_as_text() -> None:
    config = build_config(
        Hf3fsBackendConfig,
        {"root": "/mnt/3fs/kv", "data_file_size": "64GiB", "capacity_bytes": "1TiB"},
    )
    assert config.data_file_size == 64 * 2**30
    assert config.capacity_bytes == 2**40
    assert config.root == Path("/mnt/3fs/kv")
    assert config.client == "auto"
    assert not config.allow_non_3fs


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("data_file_size", 0),
        ("data_file_size", 5000),
        ("data_files", 0),
        ("ways", 0),
        ("ways", 65),
        ("client", "nfs"),
        ("io_threads", 0),
        ("capacity_bytes", 0),
        ("allow_non_3fs", 1),
        ("usrbio_buffer_bytes", 100),
    ],
)
def test_bad_config_is_refused(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        Hf3fsBackendConfig(root=Path("/x"), **{field: value})
    assert caught.value.field == field


def test_cap_without_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        open_local(tmp_path, capacity_bytes=MIB)
    assert caught.value.field == "eviction"


def test_local_directory_needs_the_opt_in(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        Hf3fsBackend(Hf3fsBackendConfig(root=tmp_path, client="posix"))
    assert "not on a 3FS mount" in caught.value.reason
    assert "allow_non_3fs" in caught.value.reason
    assert caught.value.backend == "hf3fs"
    assert not (tmp_path / MARKER).exists(), "nothing is written to a refused root"


def test_missing_root_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        open_local_no_mkdir(tmp_path / "absent")
    assert "does not exist" in caught.value.reason
    (tmp_path / "file").write_text("x")
    with pytest.raises(BackendUnavailableError) as caught:
        open_local_no_mkdir(tmp_path / "file")
    assert "not a directory" in caught.value.reason


def open_local_no_mkdir(root: Path) -> Hf3fsBackend:
    return Hf3fsBackend(Hf3fsBackendConfig(root=root, **LOCAL))


@pytest.mark.skipif(HAVE_USRBIO, reason="hf3fs_fuse is installed here")
def test_usrbio_requested_but_missing(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        Hf3fsBackend(Hf3fsBackendConfig(root=tmp_path, client="usrbio", allow_non_3fs=True))
    assert "hf3fs_fuse" in caught.value.reason
    assert "client='posix'" in caught.value.reason


@pytest.mark.skipif(HAVE_USRBIO, reason="hf3fs_fuse is installed here")
def test_auto_falls_back_to_posix(tmp_path: Path) -> None:
    with Hf3fsBackend(
        Hf3fsBackendConfig(root=tmp_path, client="auto", allow_non_3fs=True)
    ) as backend:
        assert backend.client == "posix"


MOUNTINFO = textwrap.dedent(
    """\
    22 1 8:1 / / rw,relatime - ext4 /dev/vda rw
    40 22 0:50 / /mnt/3fs rw,nosuid,nodev - fuse.hf3fs hf3fs.stage rw,user_id=0
    41 22 0:51 / /mnt/3fs\\040old rw - tmpfs tmpfs rw
    """
)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/mnt/3fs/kv/cache", ("/mnt/3fs", "fuse.hf3fs")),
        ("/mnt/3fs", ("/mnt/3fs", "fuse.hf3fs")),
        ("/mnt/3fsx/kv", ("/", "ext4")),
        ("/mnt/3fs old/kv", ("/mnt/3fs old", "tmpfs")),
        ("/data", ("/", "ext4")),
    ],
)
def test_mount_detection(path: str, expected: tuple[str, str]) -> None:
    assert mount_of(Path(path), mountinfo=MOUNTINFO) == expected


# ------------------------------------------------------------------ usrbio, faked


class FakeUsrbio:
    """FAKE ``hf3fs_fuse.io``: rings that run ``os.pread``/``os.pwrite`` at once.

    Only the calls the backend makes (``make_iovec``, ``make_ioring``, ``prepare``,
    ``submit().wait()``, ``register_fd``/``deregister_fd``, ``extract_mount_point``), so
    the backend's usrbio client runs on a machine without 3FS. Not evidence about 3FS.
    """

    def __init__(self, mount_point: Path) -> None:
        self.mount_point = mount_point
        self.registered: set[int] = set()
        self.transfers = 0
        self.module = types.ModuleType("hf3fs_fuse.io")
        for name in ("make_iovec", "make_ioring", "register_fd", "deregister_fd"):
            setattr(self.module, name, getattr(self, name))
        self.module.extract_mount_point = lambda path: str(self.mount_point)  # type: ignore[attr-defined]

    def make_iovec(self, shm: Any, mount_point: str) -> memoryview:
        assert mount_point == str(self.mount_point)
        view: memoryview = shm.buf
        return view

    def make_ioring(self, mount_point: str, entries: int, *, for_read: bool) -> FakeRing:
        return FakeRing(self, for_read)

    def register_fd(self, fd: int) -> None:
        assert fd not in self.registered
        self.registered.add(fd)

    def deregister_fd(self, fd: int) -> None:
        self.registered.remove(fd)


class FakeRing:
    def __init__(self, owner: FakeUsrbio, for_read: bool) -> None:
        self.owner, self.for_read = owner, for_read
        self.done: list[types.SimpleNamespace] = []

    def prepare(self, iov: memoryview, read: bool, fd: int, offset: int) -> None:
        assert read is self.for_read
        assert fd in self.owner.registered, "I/O on a descriptor usrbio does not know"
        self.owner.transfers += 1
        if read:
            data = os.pread(fd, iov.nbytes, offset)
            iov[: len(data)] = data
            self.done.append(types.SimpleNamespace(result=len(data)))
        else:
            self.done.append(types.SimpleNamespace(result=os.pwrite(fd, iov, offset)))

    def submit(self) -> FakeRing:
        return self

    def wait(self, *, min_results: int, timeout: object) -> list[types.SimpleNamespace]:
        done, self.done = self.done, []
        assert len(done) >= min_results
        return done


@pytest.fixture
def fake_usrbio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeUsrbio:
    fake = FakeUsrbio(tmp_path)
    package = types.ModuleType("hf3fs_fuse")
    package.io = fake.module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hf3fs_fuse", package)
    monkeypatch.setitem(sys.modules, "hf3fs_fuse.io", fake.module)
    return fake


def test_usrbio_client_path_with_a_fake(tmp_path: Path, fake_usrbio: FakeUsrbio) -> None:
    backend = open_local(tmp_path, client="usrbio", usrbio_buffer_bytes=2 * SLOT_ALIGNMENT)
    try:
        assert backend.client == "usrbio"
        assert not backend.capabilities.zero_copy
        ns = namespace()
        big, small = ns.key("big"), ns.key("small")
        # Larger than the staging buffer: moved in pieces.
        data = store(backend, big, 5 * SLOT_ALIGNMENT + 123)
        small_data = store(backend, small, 10)
        assert_hit(backend, big, data)
        assert_hit(backend, small, small_data)
        assert fake_usrbio.registered, "data files are registered with usrbio"
        assert fake_usrbio.transfers > 6
    finally:
        backend.close()
    assert fake_usrbio.registered == set(), "close deregisters every data file"
    # The POSIX client reads what the usrbio client wrote: one layout.
    with open_local(tmp_path, client="posix") as posix:
        assert_hit(posix, big, data)


# ------------------------------------------------------------------ usrbio, for real


@pytest.mark.skipif(not (HAVE_USRBIO and CLUSTER_ROOT), reason=USRBIO_SKIP)
class TestHf3fsUsrbioCluster(TestHf3fsBackend):
    """The conformance suite through the usrbio client on a real 3FS mount."""

    options: ClassVar[dict[str, Any]] = {"client": "usrbio", "data_file_size": MIB, "data_files": 4}

    def root_of(self, tmp_path: Path) -> Path:
        return Path(CLUSTER_ROOT) / f"pytest-{os.getpid()}-{tmp_path.name}"
