"""The ``file`` backend: the shared conformance suite plus what only a directory can do.

Everything here uses real files, real directories and real processes: the layout on disk,
reopening (durability, index rebuild, orphan removal), ``kill -9`` of a writer, a full
filesystem (a real 1 MiB tmpfs) and a read-only root (a real read-only bind mount or
permission bits). Where the machine does not allow what a test needs, it skips and says
what it tried.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.backend_conformance import (
    BackendConformance,
    CorruptHow,
    OpenSpec,
    as_buffers,
    get_bytes,
    namespace,
    pattern,
    put_bytes,
)

from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
    Shard,
)
from sglang_storage.errors import (
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    CorruptObjectError,
)
from sglang_storage.policy.eviction import EvictionConfig, make_eviction_policy
from sglang_storage.storage import Durability, FileBackend, FileBackendConfig, create_backend
from sglang_storage.storage.file import MARKER, SPREAD_READ_BYTES
from sglang_storage.storage.format import FORMAT_VERSION, HEADER_SIZE
from sglang_storage.storage.posix import TempNames, create_temp, temp_writer

TESTS_DIR = Path(__file__).resolve().parents[2]


def open_file(root: Path, **options: object) -> FileBackend:
    config = FileBackendConfig(root=root, **options)  # type: ignore[arg-type]
    return FileBackend(config)


def store(backend: FileBackend, key: ObjectKey, nbytes: int) -> bytes:
    data = pattern(key, nbytes)
    result = put_bytes(backend, key, ObjectSpec.raw(nbytes), data)
    assert result.outcome is PutOutcome.STORED, result
    return data


def assert_hit(backend: FileBackend, key: ObjectKey, data: bytes) -> None:
    result, got = get_bytes(backend, key, ObjectSpec.raw(len(data)), parts=2)
    assert result.outcome is GetOutcome.HIT, result
    assert got == data


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    pid = int(done.stdout)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 0)
        pytest.skip(f"pid {pid} was reused before the test could use it as a dead pid")
    return pid


def files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


class TestFileBackend(BackendConformance[FileBackend]):
    def make_backend(self, tmp_path: Path) -> FileBackend:
        return open_file(tmp_path / "store")

    def reopen(self, backend: FileBackend, tmp_path: Path) -> FileBackend:
        backend.close()
        return open_file(backend.root)

    def open_spec(self, tmp_path: Path) -> OpenSpec:
        return ("file", {"root": str(tmp_path / "store")})

    def make_bounded_backend(self, tmp_path: Path, capacity_bytes: int) -> FileBackend:
        return FileBackend(
            FileBackendConfig(root=tmp_path / "bounded", capacity_bytes=capacity_bytes),
            eviction=make_eviction_policy(EvictionConfig(name="lru")),
        )

    def corrupt(self, backend: FileBackend, key: ObjectKey, how: CorruptHow) -> None:
        path = backend.path_of(key)
        size = path.stat().st_size
        if how == "truncate":
            os.truncate(path, HEADER_SIZE + (size - HEADER_SIZE) // 2)
            return
        offset = HEADER_SIZE + (size - HEADER_SIZE) // 2 if how == "flip" else 40
        with path.open("r+b") as file:
            file.seek(offset)
            byte = file.read(1)[0]
            file.seek(offset)
            file.write(bytes([byte ^ (0x10 if how == "flip" else 0xFF)]))


# ------------------------------------------------------------------ layout


def test_capabilities(tmp_path: Path) -> None:
    with open_file(tmp_path) as backend:
        caps = backend.capabilities
        assert caps.zero_copy
        assert caps.durable
        assert caps.shared_across_processes
        assert not caps.shared_across_hosts
        assert not caps.bounded
        assert backend.name == "file"


def test_directory_layout(tmp_path: Path) -> None:
    root = tmp_path / "a" / "new" / "root"
    with open_file(root) as backend:
        marker = json.loads((root / MARKER).read_text())
        assert (marker["format_version"], marker["backend"], marker["file_mode"]) == (
            FORMAT_VERSION,
            "file",
            "0600",
        )
        assert marker["created_by"].startswith("sglang-storage ")
        assert marker["creator"]["pid"] == os.getpid()
        assert {p.name for p in root.iterdir()} == {MARKER, "objects", "tmp", "quarantine"}
        shard = Shard(tp_rank=1, tp_size=4, pp_rank=0, pp_size=2)
        ns = namespace(model="fp-123", kind=DataKind.EMBEDDING, shard=shard)
        key = ns.key("mm-abcdef.0")
        data = store(backend, key, 1000)
        path = backend.path_of(key)
        relative = path.relative_to(root).as_posix()
        assert re.fullmatch(
            r"objects/fp-123/embedding/tp1of4-pp0of2/[0-9a-f]{2}/mm-abcdef\.0", relative
        ), relative
        assert path.stat().st_size == HEADER_SIZE + 1000
        raw = path.read_bytes()
        assert raw[:4] == b"SGLS"
        assert raw[HEADER_SIZE:] == data
        # The fan-out directory depends on the name alone.
        other = namespace().key("mm-abcdef.0")
        store(backend, other, 10)
        assert backend.path_of(other).parent.name == path.parent.name
        assert files_under(root / "tmp") == []


def test_root_that_is_a_file_is_unavailable(tmp_path: Path) -> None:
    root = tmp_path / "file"
    root.write_text("not a directory")
    with pytest.raises(BackendUnavailableError) as caught:
        open_file(root)
    assert str(root) in caught.value.reason


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        FileBackendConfig(root=Path("/x"), io_threads=0)
    with pytest.raises(ConfigError):
        FileBackendConfig(root=Path("/x"), capacity_bytes=0)
    with pytest.raises(ConfigError):
        FileBackend(FileBackendConfig(root=Path("/x"), capacity_bytes=10))  # cap, no policy


# ------------------------------------------------------------------ marker


def test_marker_of_another_format_version_is_refused(tmp_path: Path) -> None:
    open_file(tmp_path).close()
    (tmp_path / MARKER).write_text(json.dumps({"format_version": FORMAT_VERSION + 1}))
    with pytest.raises(BackendUnavailableError) as caught:
        open_file(tmp_path)
    assert f"format version {FORMAT_VERSION + 1}" in caught.value.reason
    assert caught.value.backend == "file"


def test_marker_that_is_not_json_is_refused(tmp_path: Path) -> None:
    open_file(tmp_path).close()
    (tmp_path / MARKER).write_text("{not json")
    with pytest.raises(BackendUnavailableError):
        open_file(tmp_path)


def test_marker_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    open_file(tmp_path).close()
    (tmp_path / MARKER).write_text("[]")
    with pytest.raises(BackendUnavailableError):
        open_file(tmp_path)


# ------------------------------------------------------------------ reopening


def test_reopen_rebuilds_the_index_and_evicts_oldest_first(tmp_path: Path) -> None:
    ns = namespace()
    keys = [ns.key(f"old{i}") for i in range(6)]
    with open_file(tmp_path) as backend:
        for key in keys:
            store(backend, key, 1000)
        # Explicit, distinct ages: keys[0] oldest.
        for age, key in enumerate(keys):
            stamp = 1_700_000_000 + age
            os.utime(backend.path_of(key), (stamp, stamp))
    bounded = FileBackend(
        FileBackendConfig(root=tmp_path, capacity_bytes=3 * (HEADER_SIZE + 1000)),
        eviction=make_eviction_policy(EvictionConfig(name="lru")),
    )
    with bounded:
        stats = bounded.stats()
        assert (stats.objects, stats.bytes, stats.evicted) == (3, 3 * (HEADER_SIZE + 1000), 3)
        assert bounded.exists(keys) == [False] * 3 + [True] * 3
        assert len(files_under(tmp_path / "objects")) == 3
        for key in keys[3:]:
            assert_hit(bounded, key, pattern(key, 1000))


def test_index_rebuild_of_5000_objects_is_fast(tmp_path: Path) -> None:
    ns = namespace(model="many")
    spec = ObjectSpec.raw(64)
    with open_file(tmp_path) as backend:
        for start in range(0, 5000, 500):
            requests = [
                PutRequest(
                    key=ns.key(f"o{i:05d}"), spec=spec, buffers=as_buffers(bytes([i % 256]) * 64)
                )
                for i in range(start, start + 500)
            ]
            assert all(r.outcome is PutOutcome.STORED for r in backend.put_from(requests))
    began = time.perf_counter()
    reopened = open_file(tmp_path)
    elapsed = time.perf_counter() - began
    print(f"index rebuild of 5000 objects: {elapsed * 1000:.0f} ms")
    with reopened:
        stats = reopened.stats()
        assert (stats.objects, stats.bytes) == (5000, 5000 * (HEADER_SIZE + 64))
        key = ns.key("o04321")
        result, got = get_bytes(reopened, key, spec)
        assert result.outcome is GetOutcome.HIT
        assert got == bytes([4321 % 256]) * 64
    assert elapsed < 10.0


def test_orphan_temp_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    open_file(tmp_path).close()
    tmp = tmp_path / "tmp"
    dead = Path(TempNames().next(tmp, "tmp"))  # named like ours, nobody holds its lock
    dead.write_bytes(b"partial object")
    fd, live_name = create_temp(TempNames(), tmp, "tmp", 0o600, exact=False)
    live = Path(live_name)
    foreign = [tmp / "notes.txt", tmp / f"{dead_pid()}.0123abcd.tmp"]
    for path in foreign:
        path.write_bytes(b"partial object")
    try:
        with open_file(tmp_path) as backend:
            assert not dead.exists()
            assert live.exists(), "a running process's write in progress must be kept"
            assert all(p.exists() for p in foreign), "what is not named like ours stays"
            assert backend.stats().objects == 0
    finally:
        os.close(fd)
    open_file(tmp_path).close()
    assert not live.exists(), "once its writer let go of it, it is an orphan"


def test_orphan_clear_directory_of_dead_process_is_removed(tmp_path: Path) -> None:
    open_file(tmp_path).close()
    leftover = Path(TempNames().next(tmp_path / "tmp", "clear"))
    (leftover / "00").mkdir(parents=True)
    (leftover / "00" / "obj").write_bytes(b"x" * 600)
    with open_file(tmp_path):
        assert not leftover.exists()


# ------------------------------------------------------------------ foreign files


def test_stray_files_under_objects_are_ignored(tmp_path: Path) -> None:
    objects = tmp_path / "objects"
    with open_file(tmp_path) as backend:
        real = namespace().key("real")
        data = store(backend, real, 100)
        fan = backend.path_of(real).parent
    strays = [
        objects / "README.txt",
        objects / "model-a" / "kv" / "loose-file",
        objects / "model-a" / "kv" / "all" / "loose-file",
        objects / "model-a" / "no-such-kind" / "all" / "00" / "obj",
        objects / "model-a" / "kv" / "not-a-shard" / "00" / "obj",
        objects / ".hidden-model" / "kv" / "all" / "00" / "obj",
        fan / "bad name!",
        fan / ".dotfile",
    ]
    for path in strays:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * 700)
    (fan / "a-directory").mkdir()
    with open_file(tmp_path) as backend:
        stats = backend.stats()
        assert (stats.objects, stats.bytes) == (1, HEADER_SIZE + 100)
        assert_hit(backend, real, data)
    assert all(path.exists() for path in strays), "foreign files are left alone"


def test_file_in_the_wrong_fan_directory_is_not_indexed(tmp_path: Path) -> None:
    with open_file(tmp_path) as backend:
        key = namespace().key("misplaced")
        right = backend.path_of(key).parent.name
        wrong = f"{(int(right, 16) + 1) % 256:02x}"
        target = backend.path_of(key).parent.parent / wrong / "misplaced"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"\0" * 700)
    with open_file(tmp_path) as backend:
        assert backend.exists([key]) == [False]
        assert backend.stats().objects == 0


def test_garbage_file_where_an_object_belongs_is_corrupt(tmp_path: Path) -> None:
    with open_file(tmp_path) as backend:
        key = namespace().key("garbage")
        path = backend.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x5a" * (HEADER_SIZE + 256))
        assert backend.exists([key]) == [True]
        result, got = get_bytes(backend, key, ObjectSpec.raw(256))
        assert result.outcome is GetOutcome.CORRUPT
        assert isinstance(result.error, CorruptObjectError)
        assert "not an sglang-storage object" in result.error.reason
        assert got == bytes(256)
        assert not path.exists()
        assert backend.quarantined == 1
        assert len(files_under(tmp_path / "quarantine")) == 1


def test_trailing_bytes_are_corrupt(tmp_path: Path) -> None:
    with open_file(tmp_path) as backend:
        key = namespace().key("longer")
        store(backend, key, 300)
        with backend.path_of(key).open("ab") as file:
            file.write(b"\0")
        result, got = get_bytes(backend, key, ObjectSpec.raw(300))
        assert result.outcome is GetOutcome.CORRUPT
        assert isinstance(result.error, CorruptObjectError)
        assert result.error.reason == "has bytes after its payload"
        assert got == bytes(300)


def test_corrupt_file_is_moved_to_quarantine(tmp_path: Path) -> None:
    with open_file(tmp_path) as backend:
        key = namespace().key("to-quarantine")
        data = store(backend, key, 500)
        path = backend.path_of(key)
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + 7] ^= 1
        path.write_bytes(raw)
        result, _ = get_bytes(backend, key, ObjectSpec.raw(500))
        assert result.outcome is GetOutcome.CORRUPT
        [moved] = files_under(tmp_path / "quarantine")
        assert moved.read_bytes() == bytes(raw)
        assert moved.name.endswith(".to-quarantine")
        assert backend.quarantined == 1
        assert data != bytes(raw[HEADER_SIZE:])


@pytest.mark.parametrize("nbytes", [SPREAD_READ_BYTES // 3, SPREAD_READ_BYTES + 4096])
def test_batch_read_gives_each_key_its_outcome(tmp_path: Path, nbytes: int) -> None:
    # Below SPREAD_READ_BYTES the batch is read on the caller's thread, above it on two.
    with open_file(tmp_path, io_threads=2) as backend:
        keys = [namespace().key(f"page-{i}") for i in range(8)]
        stored = {key: store(backend, key, nbytes) for key in keys if key.name != "page-3"}
        damaged = backend.path_of(keys[5])
        raw = bytearray(damaged.read_bytes())
        raw[HEADER_SIZE + nbytes // 2] ^= 1
        damaged.write_bytes(raw)
        targets = [bytearray([0xA5]) * nbytes for _ in keys]
        spec = ObjectSpec.raw(nbytes)
        results = backend.get_into(
            [
                GetRequest(key=key, spec=spec, buffers=as_buffers(memoryview(target)))
                for key, target in zip(keys, targets, strict=True)
            ]
        )
        assert [r.key for r in results] == keys
        outcomes = [r.outcome for r in results]
        assert (
            outcomes
            == [GetOutcome.HIT] * 3
            + [GetOutcome.MISS, GetOutcome.HIT]
            + [GetOutcome.CORRUPT]
            + [GetOutcome.HIT] * 2
        )
        for i, key in enumerate(keys):
            if outcomes[i] is GetOutcome.HIT:
                assert bytes(targets[i]) == stored[key]
        assert bytes(targets[5]) == bytes(nbytes)
        assert backend.quarantined == 1


def test_two_instances_share_one_root(tmp_path: Path) -> None:
    with open_file(tmp_path) as first, open_file(tmp_path) as second:
        key = namespace().key("shared")
        data = store(first, key, 2000)
        assert second.stats().objects == 0, "the second instance has not met it yet"
        assert second.exists([key]) == [True]
        assert_hit(second, key, data)
        assert second.stats().objects == 1, "a hit indexes an object another process wrote"
        assert put_bytes(second, key, ObjectSpec.raw(2000), data).outcome is PutOutcome.PRESENT
        first.delete([key])
        result, _ = get_bytes(second, key, ObjectSpec.raw(2000))
        assert result.outcome is GetOutcome.MISS
        assert second.stats().objects == 0


# ------------------------------------------------------------------ durability settings


@pytest.mark.parametrize("durability", [Durability.DATA, Durability.FULL])
def test_durability_settings_write_whole_files(tmp_path: Path, durability: Durability) -> None:
    ns = namespace()
    keys = [ns.key(f"{durability.value}-{i}") for i in range(8)]
    with open_file(tmp_path, durability=durability, io_threads=3) as backend:
        requests = [
            PutRequest(
                key=k, spec=ObjectSpec.raw(3000 + i), buffers=as_buffers(pattern(k, 3000 + i))
            )
            for i, k in enumerate(keys)
        ]
        assert all(r.outcome is PutOutcome.STORED for r in backend.put_from(requests))
        for i, key in enumerate(keys):
            assert backend.path_of(key).stat().st_size == HEADER_SIZE + 3000 + i
        assert files_under(tmp_path / "tmp") == []
    with open_file(tmp_path) as reopened:
        for i, key in enumerate(keys):
            assert_hit(reopened, key, pattern(key, 3000 + i))


def test_durability_accepts_names_from_options(tmp_path: Path) -> None:
    backend = create_backend("file", {"root": str(tmp_path), "durability": "full"})
    try:
        assert isinstance(backend, FileBackend)
        key = namespace().key("via-options")
        data = store(backend, key, 10)
        assert_hit(backend, key, data)
    finally:
        backend.close()


# ------------------------------------------------------------------ hostile media


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)


def _unmount(path: Path) -> None:
    if _run("umount", str(path)).returncode != 0:
        _run("umount", "-l", str(path))


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs mounted under ``tmp_path``; skips where mounting is not allowed."""
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("ENOSPC needs a small real filesystem, and there is no `mount` command")
    done = _run("mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mountpoint))
    if done.returncode != 0:
        pytest.skip(
            f"ENOSPC needs a small real filesystem: `mount -t tmpfs -o size=1m` as uid "
            f"{os.getuid()} failed ({done.stderr.strip() or done.returncode}); a full disk "
            "is not simulated with mocks"
        )
    try:
        yield mountpoint
    finally:
        _unmount(mountpoint)


def test_full_filesystem_is_a_capacity_error_and_leaves_nothing(tiny_filesystem: Path) -> None:
    nbytes = 200 * 1024
    ns = namespace()
    written: dict[ObjectKey, bytes] = {}
    with open_file(tiny_filesystem / "store") as backend:
        failed = None
        for i in range(10):
            key = ns.key(f"fill{i}")
            data = pattern(key, nbytes)
            result = put_bytes(backend, key, ObjectSpec.raw(nbytes), data, parts=3)
            if result.outcome is PutOutcome.ERROR:
                failed = (key, result)
                break
            assert result.outcome is PutOutcome.STORED
            written[key] = data
        assert failed is not None, "a 1 MiB filesystem took 2 MB of objects"
        key, result = failed
        assert 2 <= len(written) <= 5
        assert isinstance(result.error, CapacityError)
        assert "disk space" in result.error.resource
        assert result.error.requested == HEADER_SIZE + nbytes
        assert result.error.available < HEADER_SIZE + nbytes
        assert backend.exists([key]) == [False]
        assert files_under(tiny_filesystem / "store" / "tmp") == [], "no partial temp file"
        stats = backend.stats()
        assert (stats.objects, stats.put_errors) == (len(written), 1)
        for done, data in written.items():
            assert_hit(backend, done, data)
        # Freeing space makes writes work again.
        backend.delete(list(written)[:2])
        data = pattern(key, nbytes)
        assert put_bytes(backend, key, ObjectSpec.raw(nbytes), data).outcome is PutOutcome.STORED
        assert_hit(backend, key, data)


@contextlib.contextmanager
def read_only_root(root: Path) -> Iterator[int]:
    """Make ``root`` read-only for the block; yields the errno writes then fail with.

    A read-only bind mount where mounting is allowed (it binds root as well), else
    permission bits (which root ignores: then the test skips).
    """
    bind = _run("mount", "--bind", str(root), str(root))
    if bind.returncode == 0:
        remount = _run("mount", "-o", "remount,bind,ro", str(root))
        if remount.returncode == 0:
            try:
                yield errno.EROFS
            finally:
                _unmount(root)
            return
        _unmount(root)
        bind = remount
    if os.geteuid() == 0:
        pytest.skip(
            "running as root, which ignores permission bits, and a read-only bind mount "
            f"failed ({bind.stderr.strip() or bind.returncode})"
        )
    directories = [root, *(p for p in root.rglob("*") if p.is_dir())]
    for directory in directories:
        directory.chmod(0o555)
    try:
        yield errno.EACCES
    finally:
        for directory in directories:
            directory.chmod(0o755)


def test_read_only_root_fails_writes_and_serves_reads(tmp_path: Path) -> None:
    ns = namespace()
    root = tmp_path / "ro"
    keys = [ns.key(f"ro{i}") for i in range(3)]
    with open_file(root) as live:
        data = {key: store(live, key, 700) for key in keys}
        with read_only_root(root) as code, open_file(root) as reopened:
            for backend in (live, reopened):  # open before, and opened on, the read-only root
                for key, value in data.items():
                    assert_hit(backend, key, value)
                assert backend.exists(keys) == [True] * 3
                assert backend.prefix_hits(keys) == 3
                new = ns.key("ro-new")
                result = put_bytes(backend, new, ObjectSpec.raw(700), pattern(new, 700))
                assert result.outcome is PutOutcome.ERROR
                assert isinstance(result.error, BackendIOError)
                assert result.error.code == code
                assert backend.exists([new]) == [False]
                present = put_bytes(backend, keys[0], ObjectSpec.raw(700), data[keys[0]])
                assert present.outcome is PutOutcome.PRESENT
                with pytest.raises(BackendIOError) as caught:
                    backend.delete([keys[1]])
                assert caught.value.code == code
                assert_hit(backend, keys[1], data[keys[1]])
                assert backend.stats().put_errors == 1


# ------------------------------------------------------------------ kill -9

WRITER = """
import sys
from pathlib import Path
from support.backend_conformance import namespace, pattern, put_bytes
from sglang_storage.core import ObjectSpec
from sglang_storage.storage import Durability, FileBackend, FileBackendConfig

backend = FileBackend(FileBackendConfig(root=Path(sys.argv[1]), durability=Durability.DATA))
ns = namespace(model="killed")
i = 0
while True:
    key = ns.key(f"k{i:05d}")
    nbytes = 256 * 1024 + (i % 7) * 4099
    put_bytes(backend, key, ObjectSpec.raw(nbytes), pattern(key, nbytes), parts=4)
    if i == 0:
        print("ready", flush=True)
    i += 1
"""


def _child_temp_files(root: Path, pid: int) -> list[Path]:
    return [p for p in (root / "tmp").iterdir() if temp_writer(p.name) == pid]


def _kill_writer_mid_write(root: Path) -> int:
    """Start a writer, SIGKILL it ~0.3 s in (at a moment its temp file exists, when seen).

    Returns how many temp files of the dead writer were left behind.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), *sys.path])}
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready, "the writer did not start within 60 s"
        line = child.stdout.readline()
        assert line == b"ready\n", (line, child.stderr.read() if child.stderr else b"")
        time.sleep(0.3)
        deadline = time.monotonic() + 1.0
        while not _child_temp_files(root, child.pid) and time.monotonic() < deadline:
            pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
        if child.stderr is not None:
            child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    left = len(_child_temp_files(root, child.pid))
    with open_file(root):
        assert _child_temp_files(root, child.pid) == [], "a dead writer's temp files go"
    return left


def test_kill_9_during_writes_leaves_only_whole_objects(tmp_path: Path) -> None:
    root = tmp_path / "store"
    orphans = [_kill_writer_mid_write(root)]
    while not orphans[-1] and len(orphans) < 5:  # until one kill lands mid-write
        orphans.append(_kill_writer_mid_write(root))
    print(f"temp files left by each killed writer: {orphans}")
    assert any(orphans), "no kill landed while a temp file existed"
    ns = namespace(model="killed")
    with open_file(root) as backend:
        count = backend.stats().objects
        assert count >= 1
        keys = [ns.key(f"k{i:05d}") for i in range(count + 1)]
        assert backend.exists(keys) == [True] * count + [False], "written in order, one by one"
        for i, key in enumerate(keys[:count]):
            nbytes = 256 * 1024 + (i % 7) * 4099
            result, got = get_bytes(backend, key, ObjectSpec.raw(nbytes), parts=3)
            assert result.outcome is GetOutcome.HIT, result
            assert got == pattern(key, nbytes)
        assert backend.quarantined == 0
        assert backend.stats().corrupt == 0
