"""The conformance suite every storage backend runs unchanged.

:class:`BackendConformance` holds the tests; a backend's test module subclasses it once
(``class TestFileBackend(BackendConformance[FileBackend])``) and implements the hooks that
need knowledge of the backend's medium:

- :meth:`~BackendConformance.make_backend` - a fresh, empty, unbounded backend under
  ``tmp_path`` (the ``backend`` fixture closes it afterwards).
- :meth:`~BackendConformance.corrupt` - damage one stored object on the medium: ``"flip"``
  one payload bit, ``"truncate"`` the payload to half, flip a ``"header"`` byte.
- :meth:`~BackendConformance.reopen` - close and open the same store again; needed only
  when ``capabilities.durable``.
- :meth:`~BackendConformance.open_spec` - a picklable ``(name, options)`` for
  :func:`~sglang_storage.storage.create_backend`, with which other processes open the
  same store; needed only when ``capabilities.shared_across_processes``.
- :meth:`~BackendConformance.make_bounded_backend` - a backend with a byte cap and an LRU
  eviction policy, or ``None`` when the backend cannot be bounded (the capacity tests skip).

Which tests run follows the backend's declared :class:`~sglang_storage.storage.Capabilities`:
durability across a reopen only for durable backends, several processes only for backends
shared across processes; the skip reason names the capability.

A subclass lists the tests that fail because of a known bug in ``known_bugs`` (test name
to reason); those run as strict xfails, so fixing the bug makes the suite say so.

The class name has no ``Test`` prefix, so pytest collects its tests only in subclasses.
"""

from __future__ import annotations

import abc
import multiprocessing
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeAlias, TypeVar, cast

import pytest

from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
    PutResult,
    Shard,
)
from sglang_storage.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    CorruptObjectError,
)
from sglang_storage.storage import Backend, ObjectState, Scannable, create_backend, summarize
from sglang_storage.storage.format import HEADER_SIZE

__all__ = [
    "SENTINEL",
    "BackendConformance",
    "CorruptHow",
    "OpenSpec",
    "as_buffers",
    "get_bytes",
    "namespace",
    "pattern",
    "put_bytes",
    "split",
]

B = TypeVar("B", bound=Backend)

CorruptHow: TypeAlias = Literal["flip", "truncate", "header"]
"""How :meth:`BackendConformance.corrupt` damages an object."""

OpenSpec: TypeAlias = tuple[str, dict[str, Any]]
"""``(backend name, options)`` for ``create_backend``: how another process opens a store."""

SENTINEL = 0xA5
"""What read buffers hold before a read, so a read that writes nothing is visible."""

CORRUPT_HOWS: tuple[CorruptHow, ...] = ("flip", "truncate", "header")

CORRUPT_REASONS: Mapping[CorruptHow, str] = {
    "flip": r"payload checksum mismatch",
    "truncate": r"truncated|holds \d+ payload bytes, header says \d+",
    "header": r"header checksum mismatch",
}
"""What the ``CorruptObjectError.reason`` of each kind of damage must name."""

KV = DataKind.KV


# ------------------------------------------------------------------ helpers


def namespace(model: str = "model-a", kind: DataKind = KV, shard: Shard | None = None) -> Namespace:
    """A namespace with test defaults."""
    return Namespace(model=model, kind=kind, shard=shard or Shard())


def pattern(key: ObjectKey, nbytes: int) -> bytes:
    """Deterministic, key-specific, non-periodic content (the same in every process)."""
    return random.Random(f"payload/{key}").randbytes(nbytes)


def as_buffers(*buffers: object) -> Any:
    """``buffers`` for a request's ``buffers=`` argument.

    Typed ``Any`` so the bad-input tests can hand requests what their signature refuses;
    the request checks each buffer at run time.
    """
    return list(buffers)


def split(data: bytes | bytearray, parts: int, *, seed: int = 0) -> list[memoryview]:
    """``data`` cut into ``parts`` views of uneven sizes; some may be empty.

    The views share ``data``'s memory (a ``bytearray`` gives writable views).
    """
    view = memoryview(data)
    if parts == 1:
        return [view]
    cuts = sorted(random.Random(seed).choices(range(len(data) + 1), k=parts - 1))
    bounds = [0, *cuts, len(data)]
    return [view[bounds[i] : bounds[i + 1]] for i in range(parts)]


def put_bytes(
    backend: Backend, key: ObjectKey, spec: ObjectSpec, data: bytes, *, parts: int = 1
) -> PutResult:
    """Store ``data`` as ``key`` from ``parts`` buffers; returns the one result."""
    request = PutRequest(key=key, spec=spec, buffers=as_buffers(*split(data, parts, seed=parts)))
    [result] = backend.put_from([request])
    assert result.key == key
    return result


def get_bytes(
    backend: Backend, key: ObjectKey, spec: ObjectSpec, *, parts: int = 1
) -> tuple[GetResult, bytes]:
    """Read ``key`` into ``parts`` sentinel-filled buffers; returns the result and the bytes."""
    target = bytearray([SENTINEL]) * spec.nbytes
    request = GetRequest(
        key=key, spec=spec, buffers=as_buffers(*split(target, parts, seed=parts + 1))
    )
    [result] = backend.get_into([request])
    assert result.key == key
    return result, bytes(target)


def _undelivered(nbytes: int) -> tuple[bytes, bytes]:
    """What buffers may hold after a failed read: zeros, or their untouched sentinel."""
    return bytes(nbytes), bytes([SENTINEL]) * nbytes


def _store(backend: Backend, key: ObjectKey, nbytes: int) -> bytes:
    data = pattern(key, nbytes)
    result = put_bytes(backend, key, ObjectSpec.raw(nbytes), data)
    assert result.outcome is PutOutcome.STORED, result
    return data


def _assert_hit(backend: Backend, key: ObjectKey, data: bytes, *, parts: int = 1) -> None:
    result, got = get_bytes(backend, key, ObjectSpec.raw(len(data)), parts=parts)
    assert result.outcome is GetOutcome.HIT, result
    assert result.nbytes == len(data)
    assert result.error is None
    assert got == data


def _assert_miss(backend: Backend, key: ObjectKey, nbytes: int) -> None:
    result, got = get_bytes(backend, key, ObjectSpec.raw(nbytes))
    assert result.outcome is GetOutcome.MISS, result
    assert result.nbytes == 0
    assert got == bytes([SENTINEL]) * nbytes, "a miss must leave the buffers alone"


ROUND_TRIP_SPECS = [
    pytest.param(ObjectSpec(dtype="float16", shape=(2, 8, 16), layout="page_first"), id="f16-3d"),
    pytest.param(
        ObjectSpec(dtype="bfloat16", shape=(4, 2, 8, 3), layout="layer_first"), id="bf16-4d"
    ),
    pytest.param(ObjectSpec(dtype="float32", shape=(7, 64)), id="f32-2d"),
    pytest.param(ObjectSpec(dtype="float8_e4m3fn", shape=(1, 129), layout="x_1"), id="f8-odd"),
    pytest.param(ObjectSpec(dtype="int64", shape=(3, 5)), id="i64"),
    pytest.param(ObjectSpec(dtype="uint8", shape=(4096,)), id="u8-page"),
    pytest.param(ObjectSpec(dtype="bool", shape=(3,)), id="bool"),
    pytest.param(ObjectSpec(dtype="int32", shape=()), id="scalar"),
]


# ------------------------------------------------------------------ other processes


def _mp_worker(
    spec: OpenSpec,
    worker: int,
    nbytes_of: Mapping[str, int],
    churn: Sequence[str],
    seconds: float,
    max_ops: int,
    barrier: Any,
    results: Any,
) -> None:
    """Write, read and delete overlapping keys of one store from another process.

    Every object's content is a function of its key, so any whole object read is right.
    Keys in ``churn`` are also deleted (then written again), so writes keep racing reads;
    the others are only ever written. Reports counts, the names written, and anything bad.
    """
    report: dict[str, Any] = {
        "worker": worker,
        "ops": 0,
        "hits": 0,
        "misses": 0,
        "stored": 0,
        "present": 0,
        "deleted": 0,
        "written": [],
        "bad": [],
    }
    try:
        backend = create_backend(spec[0], spec[1])
        ns = namespace(model="mp")
        names = sorted(nbytes_of)
        rng = random.Random(worker)
        barrier.wait(timeout=60)
        deadline = time.monotonic() + seconds
        while report["ops"] < max_ops and time.monotonic() < deadline:
            name = rng.choice(names)
            key = ns.key(name)
            raw = ObjectSpec.raw(nbytes_of[name])
            report["ops"] += 1
            op = rng.random()
            if op < 0.1 and name in churn:
                backend.delete([key])
                report["deleted"] += 1
            elif op < 0.45:
                put = put_bytes(backend, key, raw, pattern(key, raw.nbytes), parts=3)
                if put.outcome is PutOutcome.ERROR:
                    report["bad"].append(f"put {name}: {put.error}")
                else:
                    report[put.outcome.value] += 1
                    report["written"].append(name)
            else:
                got, data = get_bytes(backend, key, raw, parts=2)
                if got.outcome is GetOutcome.HIT:
                    report["hits"] += 1
                    if data != pattern(key, raw.nbytes):
                        report["bad"].append(f"get {name}: wrong bytes")
                elif got.outcome is GetOutcome.MISS:
                    report["misses"] += 1
                else:
                    report["bad"].append(f"get {name}: {got.outcome.value} {got.error}")
        backend.close()
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails
        report["bad"].append(f"worker crashed: {type(error).__name__}: {error}")
    results.put(report)


# ------------------------------------------------------------------ the suite


class BackendConformance(abc.ABC, Generic[B]):
    """The shared backend suite; subclass it once per backend (see the module docstring)."""

    known_bugs: ClassVar[Mapping[str, str]] = {}
    """Test name (without parameters) to the reason it fails: run as strict xfail."""

    # -------------------------------------------------------------- hooks

    @abc.abstractmethod
    def make_backend(self, tmp_path: Path) -> B:
        """A fresh, empty, unbounded backend whose medium lives under ``tmp_path``."""

    @abc.abstractmethod
    def corrupt(self, backend: B, key: ObjectKey, how: CorruptHow) -> None:
        """Damage ``key``'s stored object (its payload is at least 64 bytes) on the medium."""

    def reopen(self, backend: B, tmp_path: Path) -> B:
        """Close ``backend`` and open its store again (durable backends only)."""
        raise NotImplementedError(f"{type(self).__name__} must implement reopen()")

    def open_spec(self, tmp_path: Path) -> OpenSpec:
        """How another process opens the store of ``make_backend(tmp_path)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement open_spec()")

    def make_bounded_backend(self, tmp_path: Path, capacity_bytes: int) -> B | None:
        """A backend capped at ``capacity_bytes`` with LRU eviction, or None if unsupported."""
        return None

    # -------------------------------------------------------------- fixtures

    @pytest.fixture(autouse=True)
    def _known_bug(self, request: pytest.FixtureRequest) -> None:
        name = getattr(request.node, "originalname", request.node.name)
        reason = self.known_bugs.get(name)
        if reason is not None:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[B]:
        backend = self.make_backend(tmp_path)
        yield backend
        backend.close()

    def _bounded(self, tmp_path: Path, capacity_bytes: int) -> B:
        backend = self.make_bounded_backend(tmp_path, capacity_bytes)
        if backend is None:
            pytest.skip(f"{type(self).__name__} provides no bounded backend")
        assert backend.capabilities.bounded
        return backend

    # -------------------------------------------------------------- round trips

    @pytest.mark.parametrize("spec", ROUND_TRIP_SPECS)
    @pytest.mark.parametrize("kind", list(DataKind), ids=[k.value for k in DataKind])
    def test_round_trip(self, backend: B, kind: DataKind, spec: ObjectSpec) -> None:
        key = namespace(kind=kind).key(f"obj-{spec.dtype}")
        data = pattern(key, spec.nbytes)
        put = put_bytes(backend, key, spec, data)
        assert (put.outcome, put.nbytes, put.error) == (PutOutcome.STORED, spec.nbytes, None)
        assert put.ok
        got, out = get_bytes(backend, key, spec)
        assert (got.outcome, got.nbytes, got.error) == (GetOutcome.HIT, spec.nbytes, None)
        assert got.hit
        assert out == data

    @pytest.mark.parametrize(
        ("put_parts", "get_parts"),
        [(1, 1), (1, 64), (64, 1), (64, 64), (7, 1100), (1100, 3)],
    )
    def test_scattered_buffers(self, backend: B, put_parts: int, get_parts: int) -> None:
        """One object from and into many uneven buffers (some empty), split differently."""
        spec = ObjectSpec(dtype="float16", shape=(3, 2000), layout="page_first")
        key = namespace().key(f"scatter-{put_parts}-{get_parts}")
        data = pattern(key, spec.nbytes)
        assert put_bytes(backend, key, spec, data, parts=put_parts).outcome is PutOutcome.STORED
        got, out = get_bytes(backend, key, spec, parts=get_parts)
        assert got.outcome is GetOutcome.HIT
        assert out == data

    @pytest.mark.parametrize("parts", [0, 1, 3])
    def test_empty_payload(self, backend: B, parts: int) -> None:
        """A shape with a 0 dimension is a valid, 0-byte object."""
        spec = ObjectSpec(dtype="float16", shape=(0, 16))
        assert spec.nbytes == 0
        key = namespace().key(f"empty-{parts}")
        views = [memoryview(bytearray(0)) for _ in range(parts)]
        [put] = backend.put_from([PutRequest(key=key, spec=spec, buffers=as_buffers(*views))])
        assert (put.outcome, put.nbytes) == (PutOutcome.STORED, 0)
        assert backend.exists([key]) == [True]
        [got] = backend.get_into([GetRequest(key=key, spec=spec, buffers=as_buffers(*views))])
        assert (got.outcome, got.nbytes) == (GetOutcome.HIT, 0)
        # The 0-byte object of another shape is still another object.
        other = ObjectSpec(dtype="float16", shape=(16, 0))
        [mismatch] = backend.get_into([GetRequest(key=key, spec=other, buffers=as_buffers(*views))])
        assert mismatch.outcome is GetOutcome.CORRUPT
        [again] = backend.put_from([PutRequest(key=key, spec=spec, buffers=as_buffers(*views))])
        assert again.outcome in (PutOutcome.PRESENT, PutOutcome.STORED)

    def test_batches_keep_input_order(self, backend: B) -> None:
        ns = namespace()
        keys = [ns.key(f"order-{i:02d}") for i in range(24)]
        sizes = {key: 64 + 37 * i for i, key in enumerate(keys)}
        puts = backend.put_from(
            [
                PutRequest(
                    key=k, spec=ObjectSpec.raw(sizes[k]), buffers=as_buffers(pattern(k, sizes[k]))
                )
                for k in keys
            ]
        )
        assert [r.key for r in puts] == keys
        assert all(r.outcome is PutOutcome.STORED for r in puts)
        order = random.Random(3).sample(keys, len(keys))
        absent = ns.key("order-absent")
        order.insert(5, absent)
        targets = {k: bytearray(sizes.get(k, 8)) for k in order}
        gets = backend.get_into(
            [
                GetRequest(
                    key=k, spec=ObjectSpec.raw(sizes.get(k, 8)), buffers=as_buffers(targets[k])
                )
                for k in order
            ]
        )
        assert [r.key for r in gets] == order
        for key, result in zip(order, gets, strict=True):
            if key == absent:
                assert result.outcome is GetOutcome.MISS
            else:
                assert result.outcome is GetOutcome.HIT
                assert bytes(targets[key]) == pattern(key, sizes[key])

    def test_batch_with_hit_miss_and_corrupt(self, backend: B) -> None:
        """A corrupt object fails only its own key; the batch's other keys proceed."""
        ns = namespace()
        good, bad, absent = ns.key("good"), ns.key("bad"), ns.key("absent")
        data = {k: _store(backend, k, 256) for k in (good, bad)}
        self.corrupt(backend, bad, "flip")
        targets = [bytearray([SENTINEL]) * 256 for _ in range(3)]
        results = backend.get_into(
            [
                GetRequest(key=k, spec=ObjectSpec.raw(256), buffers=as_buffers(t))
                for k, t in zip((bad, good, absent), targets, strict=True)
            ]
        )
        assert [r.outcome for r in results] == [
            GetOutcome.CORRUPT,
            GetOutcome.HIT,
            GetOutcome.MISS,
        ]
        assert bytes(targets[1]) == data[good]
        assert bytes(targets[2]) == bytes([SENTINEL]) * 256

    # -------------------------------------------------------------- existence

    def test_exists_per_key(self, backend: B) -> None:
        ns = namespace()
        keys = [ns.key(f"e{i}") for i in range(6)]
        for key in keys[::2]:
            _store(backend, key, 100)
        assert backend.exists(keys) == [True, False, True, False, True, False]
        assert backend.exists([]) == []
        assert backend.exists([keys[1], keys[0], keys[0]]) == [False, True, True]

    @pytest.mark.parametrize(
        ("stored", "expected"),
        [
            pytest.param((), 0, id="none"),
            pytest.param((0, 1, 2, 3, 4, 5, 6, 7), 8, id="all"),
            pytest.param((1, 2, 3, 4, 5, 6, 7), 0, id="gap-at-start"),
            pytest.param((0, 1, 2, 4, 5, 6, 7), 3, id="gap-in-middle"),
            pytest.param((0, 1, 2, 3, 4, 5, 6), 7, id="gap-at-end"),
            pytest.param((0, 2, 4, 6), 1, id="alternating"),
        ],
    )
    def test_prefix_hits(self, backend: B, stored: tuple[int, ...], expected: int) -> None:
        ns = namespace()
        keys = [ns.key(f"page-{i}") for i in range(8)]
        for index in stored:
            _store(backend, keys[index], 32)
        assert backend.prefix_hits(keys) == expected
        assert backend.prefix_hits([]) == 0
        assert backend.prefix_hits(keys[:expected]) == expected

    # -------------------------------------------------------------- writes

    def test_put_of_existing_key_is_present_and_keeps_old_bytes(self, backend: B) -> None:
        key = namespace().key("keep")
        spec = ObjectSpec.raw(512)
        first = pattern(key, 512)
        assert put_bytes(backend, key, spec, first).outcome is PutOutcome.STORED
        again = put_bytes(backend, key, spec, bytes(reversed(first)), parts=4)
        assert (again.outcome, again.nbytes, again.error) == (PutOutcome.PRESENT, 0, None)
        assert again.ok
        _assert_hit(backend, key, first)

    def test_miss_on_absent_key(self, backend: B) -> None:
        _assert_miss(backend, namespace().key("absent"), 300)
        _store(backend, namespace().key("present"), 300)
        _assert_miss(backend, namespace().key("absent"), 300)

    # -------------------------------------------------------------- namespaces

    def test_namespaces_are_isolated(self, backend: B) -> None:
        spaces = [
            namespace(),
            namespace(model="model-b"),
            namespace(kind=DataKind.EMBEDDING),
            namespace(kind=DataKind.WEIGHT),
            namespace(shard=Shard(tp_rank=0, tp_size=2)),
            namespace(shard=Shard(tp_rank=1, tp_size=2)),
            namespace(shard=Shard(pp_rank=0, pp_size=2)),
        ]
        name = "same-name"
        first = spaces[0].key(name)
        data = _store(backend, first, 200)
        others = [ns.key(name) for ns in spaces[1:]]
        assert backend.exists(others) == [False] * len(others)
        for key in others:
            assert backend.prefix_hits([key]) == 0
            _assert_miss(backend, key, 200)
        stored = {key: _store(backend, key, 200) for key in others}
        assert len({*stored.values(), data}) == len(spaces), "patterns differ per namespace"
        _assert_hit(backend, first, data)
        for key, value in stored.items():
            _assert_hit(backend, key, value)

    @pytest.mark.parametrize(
        "wanted",
        [
            pytest.param(ObjectSpec(dtype="int16", shape=(4, 8), layout="page_first"), id="dtype"),
            pytest.param(
                ObjectSpec(dtype="float16", shape=(8, 4), layout="page_first"), id="shape"
            ),
            pytest.param(
                ObjectSpec(dtype="float16", shape=(4, 8), layout="layer_first"), id="layout"
            ),
            pytest.param(ObjectSpec(dtype="uint8", shape=(64,)), id="raw"),
        ],
    )
    def test_spec_mismatch_is_corrupt_and_delivers_nothing(
        self, backend: B, wanted: ObjectSpec
    ) -> None:
        stored = ObjectSpec(dtype="float16", shape=(4, 8), layout="page_first")
        assert wanted.nbytes == stored.nbytes
        key = namespace().key("typed")
        put_bytes(backend, key, stored, pattern(key, stored.nbytes))
        got, out = get_bytes(backend, key, wanted, parts=3)
        assert got.outcome is GetOutcome.CORRUPT
        assert got.nbytes == 0
        assert isinstance(got.error, CorruptObjectError)
        assert "not the expected" in got.error.reason
        assert out in _undelivered(stored.nbytes), "the stored bytes must not be delivered"

    def test_spec_mismatch_zeroes_buffers(self, backend: B) -> None:
        """What a failed read leaves is zeros, whatever the buffers held before."""
        stored = ObjectSpec(dtype="float16", shape=(4, 8))
        key = namespace().key("typed-zeroed")
        put_bytes(backend, key, stored, pattern(key, stored.nbytes))
        got, out = get_bytes(backend, key, ObjectSpec(dtype="int16", shape=(4, 8)), parts=2)
        assert got.outcome is GetOutcome.CORRUPT
        assert out == bytes(stored.nbytes)

    def test_clear_removes_one_namespace_only(self, backend: B) -> None:
        target = namespace()
        kept_spaces = [
            namespace(model="model-b"),
            namespace(kind=DataKind.RECORD),
            namespace(shard=Shard(cp_rank=1, cp_size=2)),
        ]
        doomed = [target.key(f"c{i}") for i in range(5)]
        for key in doomed:
            _store(backend, key, 128)
        kept = {ns.key(f"c{i}"): b"" for ns in kept_spaces for i in range(2)}
        for key in kept:
            kept[key] = _store(backend, key, 128)
        before = backend.stats()
        backend.clear(target)
        assert backend.exists(doomed) == [False] * len(doomed)
        for key in doomed:
            _assert_miss(backend, key, 128)
        for key, value in kept.items():
            _assert_hit(backend, key, value)
        after = backend.stats()
        assert after.objects == before.objects - len(doomed)
        assert after.bytes == before.bytes - len(doomed) * (HEADER_SIZE + 128)
        backend.clear(target)  # already empty
        backend.clear(namespace(model="never-used"))
        # The namespace is usable again.
        value = _store(backend, doomed[0], 128)
        _assert_hit(backend, doomed[0], value)

    def test_delete(self, backend: B) -> None:
        ns = namespace()
        present, absent, other = ns.key("d-present"), ns.key("d-absent"), ns.key("d-other")
        _store(backend, present, 100)
        kept = _store(backend, other, 100)
        backend.delete([present, absent])
        assert backend.exists([present, absent, other]) == [False, False, True]
        _assert_miss(backend, present, 100)
        _assert_hit(backend, other, kept)
        backend.delete([])
        backend.delete([absent, present])
        stats = backend.stats()
        assert stats.deleted == 1
        assert stats.objects == 1
        # A deleted key can be written again.
        value = _store(backend, present, 100)
        _assert_hit(backend, present, value)

    # -------------------------------------------------------------- corruption

    @pytest.mark.parametrize("how", CORRUPT_HOWS)
    def test_corrupt_object_is_detected_and_quarantined(self, backend: B, how: CorruptHow) -> None:
        ns = namespace()
        key, neighbour = ns.key(f"victim-{how}"), ns.key(f"neighbour-{how}")
        spec = ObjectSpec(dtype="bfloat16", shape=(16, 64))
        data = pattern(key, spec.nbytes)
        put_bytes(backend, key, spec, data)
        kept = _store(backend, neighbour, 300)
        self.corrupt(backend, key, how)
        before = backend.stats()

        got, out = get_bytes(backend, key, spec, parts=3)
        assert got.outcome is GetOutcome.CORRUPT
        assert got.nbytes == 0
        assert isinstance(got.error, CorruptObjectError)
        assert got.error.key == str(key)
        assert re.search(CORRUPT_REASONS[how], got.error.reason), got.error.reason
        assert out in _undelivered(spec.nbytes), "unverified bytes must not be delivered"

        after = backend.stats()
        assert after.corrupt == before.corrupt + 1
        assert after.hits == before.hits
        assert after.objects == before.objects - 1
        # Quarantined: gone for every later call, and the key can be written again.
        assert backend.exists([key]) == [False]
        again, out = get_bytes(backend, key, spec)
        assert again.outcome is GetOutcome.MISS
        assert backend.stats().corrupt == before.corrupt + 1
        _assert_hit(backend, neighbour, kept)
        assert put_bytes(backend, key, spec, data, parts=2).outcome is PutOutcome.STORED
        got, out = get_bytes(backend, key, spec)
        assert got.outcome is GetOutcome.HIT
        assert out == data

    @pytest.mark.parametrize("how", CORRUPT_HOWS)
    def test_corrupt_read_zeroes_buffers(self, backend: B, how: CorruptHow) -> None:
        """A corrupt result leaves zeros in the buffers, never the sentinel or stored bytes."""
        key = namespace().key(f"zeroed-{how}")
        spec = ObjectSpec.raw(4096)
        put_bytes(backend, key, spec, pattern(key, spec.nbytes))
        self.corrupt(backend, key, how)
        got, out = get_bytes(backend, key, spec, parts=5)
        assert got.outcome is GetOutcome.CORRUPT
        assert out == bytes(spec.nbytes)

    # -------------------------------------------------------------- stats

    def test_stats_count_every_outcome(self, backend: B) -> None:
        ns = namespace()
        empty = backend.stats()
        assert (empty.objects, empty.bytes, empty.hits, empty.misses) == (0, 0, 0, 0)
        assert (empty.stored, empty.present, empty.corrupt) == (0, 0, 0)
        assert (empty.bytes_read, empty.bytes_written, empty.deleted) == (0, 0, 0)
        assert empty.capacity_bytes is None
        sizes = {ns.key("s1"): 100, ns.key("s2"): 200, ns.key("s3"): 300}
        data = {key: _store(backend, key, size) for key, size in sizes.items()}
        put_bytes(backend, ns.key("s1"), ObjectSpec.raw(100), data[ns.key("s1")])
        _assert_hit(backend, ns.key("s2"), data[ns.key("s2")])
        _assert_hit(backend, ns.key("s3"), data[ns.key("s3")])
        _assert_hit(backend, ns.key("s3"), data[ns.key("s3")])
        _assert_miss(backend, ns.key("s4"), 50)
        stats = backend.stats()
        assert stats.objects == 3
        assert stats.bytes == 600 + 3 * HEADER_SIZE
        assert (stats.stored, stats.present, stats.put_errors) == (3, 1, 0)
        assert (stats.hits, stats.misses, stats.corrupt, stats.get_errors) == (3, 1, 0, 0)
        assert stats.bytes_written == 600
        assert stats.bytes_read == 200 + 300 + 300
        backend.delete([ns.key("s1")])
        stats = backend.stats()
        assert (stats.objects, stats.bytes, stats.deleted) == (2, 500 + 2 * HEADER_SIZE, 1)

    # -------------------------------------------------------------- lifecycle

    def test_closed_backend_refuses_every_call(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path)
        ns = namespace()
        key = ns.key("closed")
        _store(backend, key, 64)
        backend.close()
        backend.close()  # a second close is a no-op
        target = bytearray(64)
        calls: dict[str, Callable[[], object]] = {
            "exists": lambda: backend.exists([key]),
            "exists-empty": lambda: backend.exists([]),
            "prefix_hits": lambda: backend.prefix_hits([key]),
            "get_into": lambda: backend.get_into(
                [GetRequest(key=key, spec=ObjectSpec.raw(64), buffers=as_buffers(target))]
            ),
            "get_into-empty": lambda: backend.get_into([]),
            "put_from": lambda: backend.put_from(
                [PutRequest(key=ns.key("new"), spec=ObjectSpec.raw(64), buffers=as_buffers(target))]
            ),
            "put_from-many": lambda: backend.put_from(
                [
                    PutRequest(
                        key=ns.key(f"n{i}"), spec=ObjectSpec.raw(64), buffers=as_buffers(target)
                    )
                    for i in range(8)
                ]
            ),
            "delete": lambda: backend.delete([key]),
            "clear": lambda: backend.clear(ns),
        }
        for name, call in calls.items():
            with pytest.raises(BackendUnavailableError) as caught:
                call()
            assert caught.value.backend == backend.name, name
        assert target == bytearray(64)

    def test_stats_after_close_raises(self, tmp_path: Path) -> None:
        """The Backend contract: after close(), *any* call raises BackendUnavailableError."""
        backend = self.make_backend(tmp_path)
        backend.close()
        with pytest.raises(BackendUnavailableError):
            backend.stats()

    # -------------------------------------------------------------- bad input

    def test_bad_requests_are_config_errors_before_io(self, backend: B) -> None:
        key = namespace().key("bad")
        spec = ObjectSpec(dtype="float32", shape=(4, 4))
        with pytest.raises(ConfigError) as caught:
            GetRequest(key=key, spec=spec, buffers=as_buffers(bytearray(63)))
        assert caught.value.field == "buffers"
        with pytest.raises(ConfigError):
            GetRequest(key=key, spec=spec, buffers=as_buffers(bytearray(32), bytearray(33)))
        with pytest.raises(ConfigError):
            GetRequest(key=key, spec=spec, buffers=as_buffers(bytes(64)))
        with pytest.raises(ConfigError):
            GetRequest(key=key, spec=spec, buffers=as_buffers(bytearray(32), memoryview(bytes(32))))
        with pytest.raises(ConfigError):
            GetRequest(key=key, spec=spec, buffers=as_buffers(memoryview(bytearray(128))[::2]))
        with pytest.raises(ConfigError):
            PutRequest(key=key, spec=spec, buffers=as_buffers(bytes(65)))
        with pytest.raises(ConfigError):
            PutRequest(key=key, spec=spec, buffers=as_buffers(object()))
        # Read-only buffers are fine to write from.
        assert put_bytes(backend, key, spec, bytes(range(64))).outcome is PutOutcome.STORED
        assert backend.stats().objects == 1

    # -------------------------------------------------------------- concurrency

    def test_threads_share_one_backend(self, backend: B) -> None:
        ns = namespace(model="threads")
        names = [f"t{i:02d}" for i in range(24)]
        sizes = {name: 100 + 997 * (i % 5) for i, name in enumerate(names)}
        errors: list[str] = []
        written: set[str] = set()
        lock = threading.Lock()

        def work(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(150):
                    name = rng.choice(names)
                    key, spec = ns.key(name), ObjectSpec.raw(sizes[name])
                    op = rng.random()
                    if op < 0.35:
                        put = put_bytes(backend, key, spec, pattern(key, spec.nbytes), parts=2)
                        if put.outcome is PutOutcome.ERROR:
                            errors.append(f"put {name}: {put.error}")
                        with lock:
                            written.add(name)
                    elif op < 0.5:
                        backend.exists([key, ns.key(rng.choice(names))])
                        backend.prefix_hits([key])
                    else:
                        got, data = get_bytes(backend, key, spec, parts=3)
                        if got.outcome is GetOutcome.HIT and data != pattern(key, spec.nbytes):
                            errors.append(f"get {name}: wrong bytes")
                        elif got.outcome not in (GetOutcome.HIT, GetOutcome.MISS):
                            errors.append(f"get {name}: {got.outcome} {got.error}")
            except Exception as error:  # noqa: BLE001 - collected and asserted below
                errors.append(f"thread {seed}: {type(error).__name__}: {error}")

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a thread did not finish within 60 s"
        assert errors == []
        assert written
        for name in written:
            _assert_hit(backend, ns.key(name), pattern(ns.key(name), sizes[name]))
        stats = backend.stats()
        assert stats.objects == len(written)
        assert stats.corrupt == 0

    def test_processes_share_one_store(self, backend: B, tmp_path: Path) -> None:
        if not backend.capabilities.shared_across_processes:
            pytest.skip(f"{backend.name}: capabilities.shared_across_processes is false")
        spec = self.open_spec(tmp_path)
        nbytes_of = {f"p{i:02d}": 4096 + 8191 * (i % 4) for i in range(16)}
        churn = [name for i, name in enumerate(sorted(nbytes_of)) if i % 2]
        workers = 3
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(workers)
        results = context.Queue()
        processes = [
            context.Process(
                target=_mp_worker,
                args=(spec, w, nbytes_of, churn, 2.5, 20_000, barrier, results),
                daemon=True,
            )
            for w in range(workers)
        ]
        for process in processes:
            process.start()
        reports: list[dict[str, Any]] = []
        try:
            while len(reports) < workers:
                reports.append(results.get(timeout=60))
        except queue.Empty:
            pytest.fail(f"only {len(reports)} of {workers} workers reported within 60 s")
        finally:
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
        bad = [line for report in reports for line in report["bad"]]
        assert bad == []
        assert all(process.exitcode == 0 for process in processes)
        assert sum(r["hits"] for r in reports) > 0
        assert sum(r["stored"] for r in reports) > len(nbytes_of), "deleted keys were rewritten"
        assert sum(r["deleted"] for r in reports) > 0
        written = {name for report in reports for name in report["written"]}
        ns = namespace(model="mp")
        for name in sorted(written):
            key, nbytes = ns.key(name), nbytes_of[name]
            if name in churn:  # may have been deleted last; if there, it is whole
                got, data = get_bytes(backend, key, ObjectSpec.raw(nbytes), parts=2)
                assert got.outcome in (GetOutcome.HIT, GetOutcome.MISS), got
                assert got.outcome is GetOutcome.MISS or data == pattern(key, nbytes)
            else:
                _assert_hit(backend, key, pattern(key, nbytes), parts=2)

    # -------------------------------------------------------------- durability

    def test_objects_survive_reopen(self, backend: B, tmp_path: Path) -> None:
        if not backend.capabilities.durable:
            pytest.skip(f"{backend.name}: capabilities.durable is false")
        ns = namespace()
        data = {ns.key(f"r{i}"): b"" for i in range(5)}
        for i, key in enumerate(data):
            data[key] = _store(backend, key, 100 * (i + 1))
        before = backend.stats()
        reopened = self.reopen(backend, tmp_path)
        try:
            stats = reopened.stats()
            assert (stats.objects, stats.bytes) == (before.objects, before.bytes)
            assert (stats.hits, stats.stored) == (0, 0), "counters start again at a reopen"
            for key, value in data.items():
                _assert_hit(reopened, key, value, parts=2)
            assert put_bytes(
                reopened, ns.key("r0"), ObjectSpec.raw(100), data[ns.key("r0")]
            ).outcome is (PutOutcome.PRESENT)
        finally:
            reopened.close()

    # -------------------------------------------------------------- scanning (fsck)

    def test_scan_reports_every_object_and_repair_removes_damage(self, backend: B) -> None:
        if not backend.capabilities.scannable:
            pytest.skip(f"{backend.name}: capabilities.scannable is false")
        scanner = cast(Scannable, backend)
        ns, embeddings = namespace(), namespace(kind=DataKind.EMBEDDING)
        data = {ns.key(f"scan{i}"): b"" for i in range(4)}
        for i, key in enumerate(data):
            data[key] = _store(backend, key, 100 * (i + 1))
        data[embeddings.key("emb")] = _store(backend, embeddings.key("emb"), 300)
        reports = [r for r in scanner.scan() if r.key is not None]
        assert {r.key: r.state for r in reports} == dict.fromkeys(data, ObjectState.OK)
        assert {r.key: r.nbytes for r in reports} == {
            key: HEADER_SIZE + len(value) for key, value in data.items()
        }
        summary = summarize(scanner.scan())
        assert summary.problems == 0
        assert summary.kinds[DataKind.EMBEDDING].count == 1
        assert summary.namespaces[ns.path].count == 4

        damaged = ns.key("scan1")
        self.corrupt(backend, damaged, "flip")
        quick = [r for r in scanner.scan(payloads=False) if r.key is not None]
        assert {r.state for r in quick} == {ObjectState.OK}, "headers only: payloads unread"
        bad = [r for r in scanner.scan() if r.state.problem]
        assert [(r.state, r.key) for r in bad] == [(ObjectState.CORRUPT, damaged)]
        assert bad[0].reason == "payload checksum mismatch"
        assert [r.action.resolved for r in scanner.repair(bad)] == [True]
        assert summarize(scanner.scan()).problems == 0
        _assert_miss(backend, damaged, 200)
        for key, value in data.items():
            if key != damaged:
                _assert_hit(backend, key, value)

    # -------------------------------------------------------------- capacity

    def test_capacity_is_never_exceeded(self, tmp_path: Path) -> None:
        size = HEADER_SIZE + 1000
        backend = self._bounded(tmp_path, 10 * size + 100)
        try:
            assert backend.stats().capacity_bytes == 10 * size + 100
            ns = namespace()
            keys = [ns.key(f"cap{i:02d}") for i in range(30)]
            for key in keys:
                _store(backend, key, 1000)
                stats = backend.stats()
                assert stats.bytes <= 10 * size + 100
            stats = backend.stats()
            assert (stats.objects, stats.bytes) == (10, 10 * size)
            assert stats.evicted == 20
            # The newest ten remain, whole.
            assert backend.exists(keys) == [False] * 20 + [True] * 10
            for key in keys[20:]:
                _assert_hit(backend, key, pattern(key, 1000))
        finally:
            backend.close()

    def test_capacity_evicts_least_recently_used(self, tmp_path: Path) -> None:
        backend = self._bounded(tmp_path, 4 * (HEADER_SIZE + 500))
        try:
            ns = namespace()
            a, b, c, d, e, f = (ns.key(n) for n in "abcdef")
            for key in (a, b, c, d):
                _store(backend, key, 500)
            _assert_hit(backend, a, pattern(a, 500))  # a is now the most recent
            _store(backend, e, 500)  # evicts b
            assert backend.exists([a, b, c, d, e]) == [True, False, True, True, True]
            _assert_hit(backend, c, pattern(c, 500))
            put_bytes(backend, d, ObjectSpec.raw(500), pattern(d, 500))  # PRESENT: a use
            _store(backend, f, 500)  # evicts a (c and d were used after it)
            assert backend.exists([a, b, c, d, e, f]) == [False, False, True, True, True, True]
            assert backend.stats().evicted == 2
        finally:
            backend.close()

    def test_object_larger_than_capacity_is_refused(self, tmp_path: Path) -> None:
        cap = 3 * (HEADER_SIZE + 200)
        backend = self._bounded(tmp_path, cap)
        try:
            ns = namespace()
            small = [ns.key(f"small{i}") for i in range(3)]
            for key in small:
                _store(backend, key, 200)
            big = ns.key("big")
            result = put_bytes(backend, big, ObjectSpec.raw(cap), pattern(big, cap))
            assert result.outcome is PutOutcome.ERROR
            assert not result.ok
            assert isinstance(result.error, CapacityError)
            assert result.error.requested == cap + HEADER_SIZE
            assert result.error.available == cap
            stats = backend.stats()
            assert (stats.put_errors, stats.evicted, stats.objects) == (1, 0, 3)
            assert backend.exists([*small, big]) == [True, True, True, False]
        finally:
            backend.close()
