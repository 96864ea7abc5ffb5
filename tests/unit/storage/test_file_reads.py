"""The ``file`` backend's read path, on both of its readers.

Every test runs twice (``file_reader``): on the C calls (``_fileio.c``: openat2, preadv,
close and the header and xxh3 checks for a whole part without the GIL; the index
rebuild's directory scan) and on the Python code they stand in for (``_read_raw`` and
``_verify``, also what a kernel without openat2 gets, and ``_scan_files``). Each outcome a read can
have is made with real files: a hit into many buffers, no file, a link at the object's
place or on its way, a FIFO, a directory, a truncated file, trailing bytes, a payload
bit flip, and a batch mixing them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import component_or_skip
from support.backend_conformance import (
    SENTINEL,
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
    Shard,
)
from sglang_storage.storage import FileBackend, FileBackendConfig
from sglang_storage.storage import file as file_module
from sglang_storage.storage.format import HEADER_SIZE, checksum

NS = namespace("reads")
SIZE = 3000


def key(name: str) -> ObjectKey:
    return ObjectKey(namespace=NS, name=name)


@pytest.fixture(params=["native", "python"])
def file_reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which reader the backend uses in this test."""
    if request.param == "native":
        component_or_skip("native")
    else:
        monkeypatch.setattr(file_module, "_READ_REQUESTS", None)
        monkeypatch.setattr(file_module, "_SCAN_FILES", None)
    return str(request.param)


@pytest.fixture
def backend(tmp_path: Path, file_reader: str) -> Iterator[FileBackend]:
    with FileBackend(FileBackendConfig(root=tmp_path / "store", io_threads=2)) as opened:
        yield opened


def stored(backend: FileBackend, name: str, nbytes: int = SIZE) -> tuple[ObjectKey, bytes]:
    k = key(name)
    data = pattern(k, nbytes)
    assert put_bytes(backend, k, ObjectSpec.raw(nbytes), data).outcome is PutOutcome.STORED
    return k, data


def test_a_hit_fills_every_buffer(backend: FileBackend) -> None:
    k, data = stored(backend, "hit")
    result, got = get_bytes(backend, k, ObjectSpec.raw(SIZE), parts=5)
    assert result.outcome is GetOutcome.HIT
    assert got == data


def test_more_buffers_than_one_readv_takes(backend: FileBackend) -> None:
    nbytes = 1500  # 1500 one-byte buffers: more than IOV_MAX (1024) in one call
    k, data = stored(backend, "many", nbytes)
    target = bytearray(nbytes)
    views = [memoryview(target)[i : i + 1] for i in range(nbytes)]
    request = GetRequest(key=k, spec=ObjectSpec.raw(nbytes), buffers=as_buffers(*views))
    [result] = backend.get_into([request])
    assert result.outcome is GetOutcome.HIT
    assert bytes(target) == data


def test_no_file_is_a_miss(backend: FileBackend) -> None:
    result, got = get_bytes(backend, key("absent"), ObjectSpec.raw(SIZE))
    assert result.outcome is GetOutcome.MISS
    assert got != bytes(SIZE)  # a miss leaves the caller's buffers as they were


def test_a_link_at_the_object_is_a_miss_and_its_target_unread(
    backend: FileBackend, tmp_path: Path
) -> None:
    k, data = stored(backend, "real")
    linked = key("linked")
    place = backend.path_of(linked)
    place.parent.mkdir(parents=True, exist_ok=True)
    place.symlink_to(backend.path_of(k))
    result, got = get_bytes(backend, linked, ObjectSpec.raw(SIZE))
    assert result.outcome is not GetOutcome.HIT
    assert got != data


def test_a_link_on_the_way_is_a_miss(backend: FileBackend, tmp_path: Path) -> None:
    k, data = stored(backend, "onway")
    fan = backend.path_of(k).parent
    moved = tmp_path / "elsewhere"
    fan.rename(moved)
    fan.symlink_to(moved)
    result, got = get_bytes(backend, k, ObjectSpec.raw(SIZE))
    assert result.outcome is GetOutcome.MISS
    assert got != data


def test_a_file_in_place_of_a_directory_on_the_way_is_a_miss(backend: FileBackend) -> None:
    k, data = stored(backend, "nodir")
    fan = backend.path_of(k).parent
    for child in fan.iterdir():
        child.unlink()
    fan.rmdir()
    fan.write_bytes(b"not a directory")  # the open fails with ENOTDIR
    result, got = get_bytes(backend, k, ObjectSpec.raw(SIZE))
    assert result.outcome is GetOutcome.MISS
    assert got != data


def test_a_fifo_at_the_object_does_not_block_and_is_corrupt(backend: FileBackend) -> None:
    k = key("fifo")
    place = backend.path_of(k)
    place.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(place)
    result, _ = get_bytes(backend, k, ObjectSpec.raw(SIZE))
    assert result.outcome is GetOutcome.CORRUPT
    assert "not a regular file" in str(result.error)


def test_a_directory_at_the_object_is_not_a_hit(backend: FileBackend) -> None:
    k = key("dir")
    backend.path_of(k).mkdir(parents=True)
    result, _ = get_bytes(backend, k, ObjectSpec.raw(SIZE))
    assert result.outcome is not GetOutcome.HIT


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncate", "truncated"),
        ("append", "bytes after its payload"),
        ("flip", "checksum mismatch"),
        ("magic", "not an sglang-storage object"),
        ("name", "header checksum mismatch"),
        ("recorded", "payload checksum mismatch"),
    ],
)
def test_damaged_objects_are_corrupt_and_zeroed(
    backend: FileBackend, damage: str, reason: str
) -> None:
    k, _ = stored(backend, damage)
    path = backend.path_of(k)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: HEADER_SIZE + SIZE // 2]
    elif damage == "append":
        raw += b"x"
    elif damage == "flip":
        raw[HEADER_SIZE + 7] ^= 0x10
    elif damage == "magic":
        raw[0] ^= 0x01
    elif damage == "name":  # a byte of the names, past the fixed fields
        raw[raw.index(k.name.encode())] ^= 0x01
    else:  # the payload checksum the header records
        raw[24] ^= 0x01
    path.write_bytes(bytes(raw))
    result, got = get_bytes(backend, k, ObjectSpec.raw(SIZE))
    assert result.outcome is GetOutcome.CORRUPT
    assert reason in str(result.error)
    assert got == bytes(SIZE)  # zeroed, never the wrong bytes


def test_a_batch_gives_each_key_its_outcome(backend: FileBackend) -> None:
    # Big enough to be cut into parts and into cache-sized groups within a part.
    big = 200 << 10
    hits = [stored(backend, f"big-{i}", big) for i in range(6)]
    flipped, _ = stored(backend, "flipped", big)
    path = backend.path_of(flipped)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    order = [hits[0][0], key("gone"), hits[1][0], flipped, *(k for k, _ in hits[2:])]
    targets = [bytearray(big) for _ in order]
    requests = [
        GetRequest(key=k, spec=ObjectSpec.raw(big), buffers=as_buffers(memoryview(t)))
        for k, t in zip(order, targets, strict=True)
    ]
    results = backend.get_into(requests)
    assert [r.outcome for r in results] == [
        GetOutcome.HIT,
        GetOutcome.MISS,
        GetOutcome.HIT,
        GetOutcome.CORRUPT,
        *[GetOutcome.HIT] * 4,
    ]
    expected = dict(hits)
    for k, target, result in zip(order, targets, results, strict=True):
        if result.outcome is GetOutcome.HIT:
            assert bytes(target) == expected[k]
        else:
            assert target == bytes(big)


def test_one_batch_across_namespaces_and_specs_reads_each_from_its_own_place(
    backend: FileBackend,
) -> None:
    """The C reader builds each path and expected header from the request's namespace and
    spec, anew at every change between neighbours: the same names in other namespaces
    (another model, kind and shard) and sizes hold other bytes, and runs go back and forth."""
    spaces = [
        NS,
        namespace("reads-b"),
        namespace("reads", DataKind.EMBEDDING),
        namespace("reads", shard=Shard(tp_rank=1, tp_size=2)),
    ]
    sizes = [SIZE, SIZE + 8, SIZE, SIZE * 2]
    specs = {nbytes: ObjectSpec.raw(nbytes) for nbytes in [*sizes, SIZE * 3]}  # shared, as usual
    data: dict[ObjectKey, bytes] = {}
    stored_as = [
        (space, name, nbytes)
        for space, nbytes in zip(spaces, sizes, strict=True)
        for name in ("same-0", "same-1")
    ]
    stored_as.append((NS, "wide", SIZE * 3))  # the first namespace, another spec
    for space, name, nbytes in stored_as:
        k = ObjectKey(namespace=space, name=name)
        data[k] = pattern(k, nbytes)
        assert put_bytes(backend, k, specs[nbytes], data[k]).ok
    order = [
        (0, "same-0"),
        (0, "same-1"),
        (0, "wide"),
        (0, "same-0"),
        (1, "same-1"),
        (0, "same-1"),
        (2, "same-0"),
        (3, "same-1"),
        (3, "same-0"),
        (1, "same-0"),
        (0, "wide"),
        (2, "same-1"),
    ]
    asked = [
        (ObjectKey(namespace=spaces[s], name=name), SIZE * 3 if name == "wide" else sizes[s])
        for s, name in order
    ]
    # The last one asks for a stored object with another spec: refused, and kept.
    asked.append((ObjectKey(namespace=spaces[1], name="same-0"), SIZE))
    targets = [bytearray(nbytes) for _, nbytes in asked]
    requests = [
        GetRequest(key=k, spec=specs[nbytes], buffers=as_buffers(memoryview(t)))
        for (k, nbytes), t in zip(asked, targets, strict=True)
    ]
    results = backend.get_into(requests)
    assert [r.outcome for r in results] == [GetOutcome.HIT] * len(order) + [GetOutcome.CORRUPT]
    for (k, _), target in zip(asked[:-1], targets[:-1], strict=True):
        assert bytes(target) == data[k]
    assert targets[-1] == bytes(SIZE)
    kept, _ = get_bytes(backend, asked[-1][0], specs[SIZE + 8])
    assert kept.outcome is GetOutcome.HIT


def test_the_c_reader_refuses_a_layout_of_the_wrong_shape(tmp_path: Path) -> None:
    """What the C reader is handed is checked: a layout must give three byte strings, a
    directory without NUL and header parts that fit, else a typed error and nothing read."""
    component_or_skip("native")
    read_requests = file_module._READ_REQUESTS
    assert read_requests is not None
    backend = FileBackend(FileBackendConfig(root=tmp_path / "store"))
    k, _ = stored(backend, "layout")
    request = GetRequest(key=k, spec=ObjectSpec.raw(SIZE), buffers=as_buffers(bytearray(SIZE)))
    good = backend._layout(k.namespace, request.spec)
    with pytest.raises(TypeError, match="directory, head, tail"):
        read_requests([request], lambda _n, _s: (good[0], good[1]))  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="NUL"):
        read_requests([request], lambda _n, _s: (b"/x\0y/", good[1], good[2]))
    with pytest.raises(ValueError, match="exceed a header"):
        read_requests([request], lambda _n, _s: (good[0], bytes(HEADER_SIZE), b"x"))
    with pytest.raises(ZeroDivisionError):
        read_requests([request], lambda _n, _s: (1 // 0, b"", b""))  # type: ignore[arg-type,return-value]
    codes, details = read_requests([request], backend._layout)
    assert codes == bytes([file_module._VERIFIED])
    assert details == {}
    backend.close()


def test_where_openat2_is_refused_the_part_is_read_from_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A named fake of a kernel without openat2 (this one has it): the C reader answers
    ``NO_OPENAT2`` for every item, and each is then read by the component-wise open."""
    component_or_skip("native")
    with FileBackend(FileBackendConfig(root=tmp_path / "store")) as backend:
        k, data = stored(backend, "fallback")
        refused = (0, 0, 0, b"", None)
        monkeypatch.setattr(
            file_module,
            "_READ_REQUESTS",
            lambda requests, _layout: (
                bytes([5] * len(requests)),
                dict.fromkeys(range(len(requests)), refused),
            ),
        )
        result, got = get_bytes(backend, k, ObjectSpec.raw(SIZE))
    assert result.outcome is GetOutcome.HIT
    assert got == data


def test_reopening_indexes_the_objects_and_nothing_else(tmp_path: Path, file_reader: str) -> None:
    """The index rebuild's directory scan (in C, or from Python): regular files only, a
    sparse file that claims more than its header accounts for is quarantined."""
    root = tmp_path / "store"
    with FileBackend(FileBackendConfig(root=root)) as backend:
        kept = [stored(backend, f"kept-{i}") for i in range(40)]
        fan = backend.path_of(kept[0][0]).parent
        sparse = backend.path_of(key("sparse"))
        linked = backend.path_of(key("linked"))
        fifo = backend.path_of(key("fifo"))
    for place in (sparse, linked, fifo):
        place.parent.mkdir(parents=True, exist_ok=True)
    with sparse.open("wb") as handle:
        handle.truncate(1 << 30)  # 1 GiB of holes
    linked.symlink_to(backend.path_of(kept[1][0]))
    os.mkfifo(fifo)
    (fan / "stray-dir").mkdir()
    with FileBackend(FileBackendConfig(root=root)) as reopened:
        stats = reopened.stats()
        assert stats.objects == len(kept)
        assert stats.bytes == len(kept) * (HEADER_SIZE + SIZE)
        assert reopened.exists([k for k, _ in kept]) == [True] * len(kept)
        assert reopened.exists([key("sparse"), key("linked"), key("fifo")]) == [False] * 3
        for k, data in kept[:3]:
            result, got = get_bytes(reopened, k, ObjectSpec.raw(SIZE))
            assert result.outcome is GetOutcome.HIT
            assert got == data
    assert not sparse.exists()  # quarantined at the scan


def _drop_from_page_cache(path: Path) -> bool:
    """Write ``path`` back and drop it from the page cache; whether it is now uncached."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        except OSError:  # RWF_NOWAIT unsupported here: cannot tell
            return False
        return False
    finally:
        os.close(fd)


def test_a_cold_batch_over_several_readahead_windows_reads_every_object(
    backend: FileBackend,
) -> None:
    """Objects not in the page cache are asked of the disk a window at a time.

    A window ends after 64 objects or about 4 MiB, so this batch (two parts of 75 objects,
    1 MiB ones among small ones) crosses both limits; a miss and a damaged object sit
    between the windows' edges, and every other object must still be read whole.
    """
    small, large = 3000, 1 << 20
    sizes = [large if i % 10 == 3 else small for i in range(150)]
    objects = [stored(backend, f"cold-{i}", n) for i, n in enumerate(sizes)]
    flipped = objects[70][0]
    raw = bytearray(backend.path_of(flipped).read_bytes())
    raw[-1] ^= 1
    backend.path_of(flipped).write_bytes(bytes(raw))
    cold = [_drop_from_page_cache(backend.path_of(k)) for k, _ in objects]
    if sum(cold) < len(cold) // 2:
        pytest.skip("this file system keeps the objects cached (or has no RWF_NOWAIT)")
    order = [k for k, _ in objects]
    order.insert(64, key("gone"))
    wanted = dict(zip((k for k, _ in objects), sizes, strict=True)) | {key("gone"): small}
    targets = {k: bytearray(wanted[k]) for k in order}
    requests = [
        GetRequest(key=k, spec=ObjectSpec.raw(wanted[k]), buffers=as_buffers(targets[k]))
        for k in order
    ]
    results = backend.get_into(requests)
    expected = dict(objects)
    for k, result in zip(order, results, strict=True):
        if k == key("gone"):
            assert result.outcome is GetOutcome.MISS
        elif k == flipped:
            assert result.outcome is GetOutcome.CORRUPT
            assert targets[k] == bytes(wanted[k])
        else:
            assert result.outcome is GetOutcome.HIT, k
            assert bytes(targets[k]) == expected[k]


def test_large_cached_objects_are_read_and_checked_in_parts(backend: FileBackend) -> None:
    """Objects over 512 KiB in the page cache are read in 256 KiB parts, each hashed as it
    arrives: buffers whose edges fall anywhere against the parts still get every byte, and
    damage in any part, a missing tail or an extra byte is still caught."""
    big = (1 << 20) + 4099
    hits = [stored(backend, f"large-{i}", big) for i in range(3)]
    damaged = {}
    for name, offset in (("middle", (384 << 10) + 7), ("last", big - 1), ("first", 0)):
        k, _ = stored(backend, f"flip-{name}", big)
        path = backend.path_of(k)
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + offset] ^= 0x40
        path.write_bytes(bytes(raw))
        damaged[k] = GetOutcome.CORRUPT
    short, _ = stored(backend, "short", big)
    backend.path_of(short).write_bytes(backend.path_of(short).read_bytes()[:-5000])
    longer, _ = stored(backend, "longer", big)
    with backend.path_of(longer).open("ab") as tail:
        tail.write(b"x")
    damaged |= {short: GetOutcome.CORRUPT, longer: GetOutcome.CORRUPT}
    for parts in (1, 7):
        for k, data in hits:
            result, got = get_bytes(backend, k, ObjectSpec.raw(big), parts=parts)
            assert result.outcome is GetOutcome.HIT
            assert got == data
    for k, outcome in damaged.items():  # once: a corrupt object is then quarantined
        result, got = get_bytes(backend, k, ObjectSpec.raw(big), parts=7)
        assert result.outcome is outcome, k
        assert got in (bytes(big), bytes([SENTINEL]) * big)


@pytest.mark.parametrize("avx2", [False, True], ids=["sse2", "avx2"])
def test_both_checksum_loops_give_xxh3_bit_for_bit(avx2: bool) -> None:
    """The C reader and writer take xxh3 with an AVX2 loop where the CPU has one, else the
    baseline one: each gives the format's checksum (the ``xxhash`` package's) for lengths
    around every internal boundary, whole or in parts cut anywhere."""
    component_or_skip("native")
    fileio = file_module._FILEIO
    assert fileio is not None
    if avx2 and not fileio.AVX2:
        pytest.skip("this CPU (or build) has no AVX2 loop")
    rng = random.Random(25)
    for length in (0, 1, 16, 128, 240, 241, 1024, 1025, 64 << 10, (256 << 10) + 7, 1 << 20):
        data = rng.randbytes(length)
        cuts = sorted(rng.randrange(length + 1) for _ in range(3))
        parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
        assert fileio.digest([data], avx2) == checksum([memoryview(data)]), length
        assert fileio.digest(parts, avx2) == checksum([memoryview(data)]), (length, cuts)
    with pytest.raises(TypeError, match="list or tuple"):
        fileio.digest(b"not a list of buffers", avx2)
