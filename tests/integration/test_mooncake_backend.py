"""The ``mooncake`` backend against a real Mooncake cluster on loopback.

Every test runs against a real ``mooncake_master`` (with its HTTP metadata server) and a
separate ``mooncake_client`` process that contributes the memory: the backend under test
contributes none, so every byte it stores or reads crosses TCP to another process. A raw
Mooncake client of the test's own looks behind the backend (reads and damages stored
values, wipes the cluster between tests).

Beyond the shared conformance suite: Mooncake's quirks (a put of an existing key keeps
the old value; removal during a read lease; a full cluster; a master restart under load),
memory registration, header-slot batching, and configuration errors.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from support.mooncake import LOOPBACK, MooncakeCluster, free_port

from sglang_storage.core import (
    GetOutcome,
    GetRequest,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
)
from sglang_storage.errors import BackendUnavailableError, CapacityError, ConfigError
from sglang_storage.storage import (
    MooncakeBackend,
    MooncakeBackendConfig,
    MooncakeProtocol,
    MooncakeTransfer,
    backend_names,
    create_backend,
)
from sglang_storage.storage.format import HEADER_SIZE

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    with MooncakeCluster(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


def open_backend(cluster: MooncakeCluster, **extra: object) -> MooncakeBackend:
    backend = create_backend("mooncake", cluster.options(**extra))
    assert isinstance(backend, MooncakeBackend)
    return backend


class TestMooncakeBackend(BackendConformance[MooncakeBackend]):
    """The shared suite; each test starts from an empty cluster."""

    cluster: MooncakeCluster

    @pytest.fixture(autouse=True)
    def _empty_cluster(self, cluster: MooncakeCluster) -> None:
        self.cluster = cluster
        cluster.wipe()

    def make_backend(self, tmp_path: Path) -> MooncakeBackend:
        return open_backend(self.cluster)

    def open_spec(self, tmp_path: Path) -> OpenSpec:
        return ("mooncake", self.cluster.options())

    def corrupt(self, backend: MooncakeBackend, key: ObjectKey, how: CorruptHow) -> None:
        raw = self.cluster.raw
        data = bytearray(raw.get(str(key)))
        assert len(data) > HEADER_SIZE + 64
        if how == "flip":
            data[HEADER_SIZE + 40] ^= 0x10
        elif how == "truncate":
            data = data[: HEADER_SIZE + (len(data) - HEADER_SIZE) // 2]
        else:
            data[20] ^= 0xFF  # the payload length field, covered by the header checksum
        assert raw.remove(str(key), True) == 0
        assert raw.put(str(key), bytes(data)) == 0


class TestMooncakeBackendZeroCopy(TestMooncakeBackend):
    """The shared suite again with every object moved zero copy (the RDMA default)."""

    def make_backend(self, tmp_path: Path) -> MooncakeBackend:
        backend = open_backend(self.cluster, transfer="zero_copy")
        assert backend.transfer is MooncakeTransfer.ZERO_COPY
        return backend

    def open_spec(self, tmp_path: Path) -> OpenSpec:
        return ("mooncake", self.cluster.options(transfer="zero_copy"))


# ---------------------------------------------------------------------- the cluster's own rules


@pytest.fixture
def backend(cluster: MooncakeCluster) -> Iterator[MooncakeBackend]:
    cluster.wipe()
    opened = open_backend(cluster)
    yield opened
    opened.close()


def test_registered_name_and_capabilities(backend: MooncakeBackend) -> None:
    assert "mooncake" in backend_names()
    caps = backend.capabilities
    assert (caps.zero_copy, caps.shared_across_hosts, caps.durable) == (True, True, False)
    assert caps.registers_memory


def test_objects_live_in_the_other_process_segment(
    backend: MooncakeBackend, cluster: MooncakeCluster
) -> None:
    """The backend contributes no memory, so what it stores is in the segment process."""
    key = namespace().key("remote")
    data = pattern(key, 64 << 10)
    assert put_bytes(backend, key, ObjectSpec.raw(len(data)), data).outcome is PutOutcome.STORED
    stored = cluster.raw.get(str(key))
    assert len(stored) == HEADER_SIZE + len(data)
    assert stored[HEADER_SIZE:] == data
    assert stored[:4] == b"SGLS"


def test_put_of_existing_key_keeps_the_old_value_even_from_another_client(
    backend: MooncakeBackend, cluster: MooncakeCluster
) -> None:
    key = namespace().key("first-wins")
    spec = ObjectSpec.raw(4096)
    first = pattern(key, 4096)
    assert put_bytes(backend, key, spec, first).outcome is PutOutcome.STORED
    other = open_backend(cluster)
    try:
        second = bytes(reversed(first))
        assert put_bytes(other, key, spec, second).outcome is PutOutcome.PRESENT
        got, out = get_bytes(other, key, spec)
        assert got.outcome is GetOutcome.HIT
        assert out == first
    finally:
        other.close()


def test_duplicate_keys_in_one_batch(backend: MooncakeBackend) -> None:
    key = namespace().key("twice")
    data = pattern(key, 1000)
    requests = [PutRequest(key=key, spec=ObjectSpec.raw(1000), buffers=[data])] * 2
    outcomes = [result.outcome for result in backend.put_from(requests)]
    assert outcomes == [PutOutcome.STORED, PutOutcome.PRESENT]
    assert backend.stats().objects == 1


def test_one_batch_across_namespaces_names_every_key_by_its_own(
    backend: MooncakeBackend, cluster: MooncakeCluster
) -> None:
    """Keys of several namespaces (and equal but distinct namespace objects) in one batch.

    The backend builds Mooncake's names from the first key's namespace for speed; every
    other key must still be stored, asked for and removed under its own full name.
    """
    first, other, same = namespace(), namespace(model="model-b"), namespace()
    assert same == first
    assert same is not first
    keys = [first.key("k0"), other.key("k0"), same.key("k1"), first.key("k2")]
    spec = ObjectSpec.raw(1024)
    requests = [PutRequest(key=k, spec=spec, buffers=[pattern(k, 1024)]) for k in keys]
    assert [r.outcome for r in backend.put_from(requests)] == [PutOutcome.STORED] * 4
    assert all(cluster.raw.is_exist(str(key)) == 1 for key in keys)
    assert backend.exists(keys) == [True] * 4
    assert backend.prefix_hits(keys) == 4
    backend.delete([other.key("k0")])
    assert cluster.raw.is_exist(str(other.key("k0"))) == 0
    assert backend.exists(keys) == [True, False, True, True]
    assert backend.prefix_hits(keys) == 1
    assert backend.prefix_hits([first.key("absent"), *keys]) == 0


def test_delete_right_after_a_read_is_not_refused_by_the_lease(backend: MooncakeBackend) -> None:
    ns = namespace()
    keys = [ns.key(f"leased{i}") for i in range(4)]
    for key in keys:
        put_bytes(backend, key, ObjectSpec.raw(2048), pattern(key, 2048))
    for key in keys:
        assert get_bytes(backend, key, ObjectSpec.raw(2048))[0].outcome is GetOutcome.HIT
    backend.delete(keys)  # within the read lease: Mooncake alone would refuse (-706)
    assert backend.exists(keys) == [False] * 4
    assert backend.stats().deleted == 4


def test_batches_larger_than_the_header_arena(cluster: MooncakeCluster) -> None:
    cluster.wipe()
    backend = open_backend(cluster, header_slots=3)
    try:
        ns = namespace()
        keys = [ns.key(f"slot{i:02d}") for i in range(17)]
        data = {key: pattern(key, 700 + 13 * i) for i, key in enumerate(keys)}
        puts = backend.put_from(
            [PutRequest(key=k, spec=ObjectSpec.raw(len(v)), buffers=[v]) for k, v in data.items()]
        )
        assert [p.outcome for p in puts] == [PutOutcome.STORED] * 17
        outs = {key: bytearray(len(value)) for key, value in data.items()}
        gets = backend.get_into(
            [
                GetRequest(key=k, spec=ObjectSpec.raw(len(v)), buffers=[memoryview(v)])
                for k, v in outs.items()
            ]
        )
        assert [g.key for g in gets] == keys
        assert all(g.outcome is GetOutcome.HIT for g in gets)
        assert {k: bytes(v) for k, v in outs.items()} == data

        # Threads share the three slots; every batch still completes with its own bytes.
        errors: list[str] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(20):
                pick = rng.sample(keys, 5)
                bufs = {k: bytearray(len(data[k])) for k in pick}
                results = backend.get_into(
                    [
                        GetRequest(key=k, spec=ObjectSpec.raw(len(b)), buffers=[memoryview(b)])
                        for k, b in bufs.items()
                    ]
                )
                if any(r.outcome is not GetOutcome.HIT for r in results):
                    errors.append(f"not all hits: {results}")
                if any(bytes(b) != data[k] for k, b in bufs.items()):
                    errors.append("wrong bytes")

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
    finally:
        backend.close()


@pytest.mark.parametrize("transfer", ["auto", "staged", "zero_copy"])
def test_mixed_sizes_in_one_batch_keep_order_and_bytes(
    cluster: MooncakeCluster, transfer: str
) -> None:
    """Small objects are staged and large ones zero copy under ``auto``; staging arenas of
    1 MiB make the 600 KiB objects span several arena runs under ``staged``."""
    cluster.wipe()
    backend = open_backend(cluster, transfer=transfer, staging_bytes="4MiB")
    try:
        ns = namespace()
        sizes = [100, 300 << 10, 5000, 600 << 10, 0, 64 << 10, 2 << 20, 129 << 10, 7]
        keys = [ns.key(f"mixed-{transfer}-{i}") for i in range(len(sizes))]
        data = [pattern(key, size) for key, size in zip(keys, sizes, strict=True)]
        puts = backend.put_from(
            [
                PutRequest(
                    key=k, spec=ObjectSpec.raw(len(d)), buffers=[d[: len(d) // 2], d[len(d) // 2 :]]
                )
                for k, d in zip(keys, data, strict=True)
            ]
        )
        assert [p.key for p in puts] == keys
        assert all(p.outcome is PutOutcome.STORED for p in puts), puts
        outs = [bytearray(len(d)) for d in data]
        gets = backend.get_into(
            [
                GetRequest(key=k, spec=ObjectSpec.raw(len(o)), buffers=[memoryview(o)])
                for k, o in zip(keys, outs, strict=True)
            ]
        )
        assert [g.key for g in gets] == keys
        assert all(g.outcome is GetOutcome.HIT for g in gets), gets
        assert [bytes(o) for o in outs] == data
        for key, d in zip(keys, data, strict=True):
            assert cluster.raw.get(str(key))[HEADER_SIZE:] == d
    finally:
        backend.close()


class RacingStore:
    """The real client, except that its first read delivers another key's value: what a
    read sees when a forced removal let that memory be reused under it."""

    def __init__(self, store: Any, other: str) -> None:
        self.store, self.other, self.raced = store, other, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def batch_get_into(self, keys: list[str], *args: Any) -> Any:
        return self.store.batch_get_into(self._keys(keys), *args)

    def batch_get_into_multi_buffers(self, keys: list[str], *args: Any) -> Any:
        return self.store.batch_get_into_multi_buffers(self._keys(keys), *args)

    def _keys(self, keys: list[str]) -> list[str]:
        if self.raced:
            return keys
        self.raced += 1
        return [self.other] * len(keys)


@pytest.mark.parametrize("transfer", ["staged", "zero_copy"])
def test_a_read_racing_a_removal_is_read_again_not_called_corrupt(
    cluster: MooncakeCluster, transfer: str
) -> None:
    cluster.wipe()
    backend = open_backend(cluster, transfer=transfer)
    try:
        ns = namespace()
        mine, other = ns.key(f"mine-{transfer}"), ns.key(f"other-{transfer}")
        spec = ObjectSpec.raw(4096)
        for key in (mine, other):
            put_bytes(backend, key, spec, pattern(key, spec.nbytes))
        backend._store = RacingStore(backend._store, str(other))  # fault injection
        got, out = get_bytes(backend, mine, spec)
        assert got.outcome is GetOutcome.HIT
        assert out == pattern(mine, spec.nbytes)
        assert backend.stats().corrupt == 0
        assert backend.exists([mine, other]) == [True, True]
    finally:
        backend.close()


def test_registered_memory_round_trip_and_overlap_refused(backend: MooncakeBackend) -> None:
    arena = bytearray(1 << 20)
    view = memoryview(arena)
    backend.register_memory(view)
    with pytest.raises(ConfigError, match="overlaps memory registered before"):
        backend.register_memory(view[4096:8192])
    with pytest.raises(ConfigError, match="is empty"):
        backend.register_memory(view[:0])
    key = namespace().key("registered")
    data = pattern(key, 256 << 10)
    view[: len(data)] = data
    spec = ObjectSpec.raw(len(data))
    put = backend.put_from([PutRequest(key=key, spec=spec, buffers=[view[: len(data)]])])
    assert put[0].outcome is PutOutcome.STORED
    out = view[512 << 10 : (512 << 10) + len(data)]
    got = backend.get_into([GetRequest(key=key, spec=spec, buffers=[out])])
    assert got[0].outcome is GetOutcome.HIT
    assert bytes(out) == data
    backend.unregister_memory(view)
    backend.register_memory(view)  # registrable again once unregistered


def test_stored_value_larger_than_the_spec_is_corrupt(backend: MooncakeBackend) -> None:
    key = namespace().key("bigger")
    put_bytes(backend, key, ObjectSpec.raw(8192), pattern(key, 8192))
    got, out = get_bytes(backend, key, ObjectSpec.raw(4096))
    assert got.outcome is GetOutcome.CORRUPT
    assert got.error is not None
    assert "holds 8192 payload bytes, the spec needs 4096" in str(got.error)
    assert out == bytes(4096)


def test_full_cluster_is_a_capacity_error_and_reads_keep_working(tmp_path: Path) -> None:
    with MooncakeCluster(tmp_path, segment_size="16MB") as small:
        backend = open_backend(small)
        try:
            ns = namespace()
            results = []
            for i in range(40):  # 40 MiB into 16 MiB
                key = ns.key(f"full{i:02d}")
                results.append(
                    (key, put_bytes(backend, key, ObjectSpec.raw(1 << 20), pattern(key, 1 << 20)))
                )
            errors = [r for _, r in results if r.outcome is PutOutcome.ERROR]
            assert errors, "a 16 MiB segment cannot hold 40 MiB"
            assert all(isinstance(r.error, CapacityError) for r in errors)
            assert "Mooncake cluster segments" in str(errors[0].error)
            for key, result in results:
                got, out = get_bytes(backend, key, ObjectSpec.raw(1 << 20))
                if got.outcome is GetOutcome.HIT:
                    assert result.outcome is PutOutcome.STORED
                    assert out == pattern(key, 1 << 20)
                else:
                    assert got.outcome is GetOutcome.MISS
        finally:
            backend.close()


def test_master_restart_under_load_degrades_to_misses_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Calls during the outage are misses and per-key errors, never exceptions or wrong
    bytes; afterwards the same backend serves again without being reopened."""
    caplog.set_level(logging.WARNING, logger="sglang_storage.storage.mooncake")
    with MooncakeCluster(tmp_path) as restarting:
        backend = open_backend(restarting)
        stop = threading.Event()
        seen: dict[str, int] = {"hit": 0, "miss": 0, "error": 0, "stored": 0, "present": 0}
        bad: list[str] = []
        ns = namespace()
        spec = ObjectSpec.raw(16 << 10)

        def load(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                key = ns.key(f"load{rng.randrange(64):02d}")
                try:
                    if rng.random() < 0.5:
                        put = put_bytes(backend, key, spec, pattern(key, spec.nbytes))
                        seen[put.outcome.value] += 1
                    else:
                        got, out = get_bytes(backend, key, spec)
                        seen[got.outcome.value] += 1
                        if got.outcome is GetOutcome.HIT and out != pattern(key, spec.nbytes):
                            bad.append(f"wrong bytes for {key}")
                        if got.outcome is GetOutcome.CORRUPT:
                            bad.append(f"corrupt {key}: {got.error}")
                    backend.exists([key])
                except Exception as error:  # noqa: BLE001 - the point is that none escape
                    bad.append(f"{type(error).__name__}: {error}")

        try:
            workers = [threading.Thread(target=load, args=(s,)) for s in range(2)]
            for worker in workers:
                worker.start()
            time.sleep(1.0)
            before = dict(seen)
            restarting.master.restart(down_s=1.5)
            restarting.wait_writable()
            # The same backend serves again, with no reopen.
            deadline = time.monotonic() + 30
            key = ns.key("after-restart")
            while True:
                put = put_bytes(backend, key, spec, pattern(key, spec.nbytes))
                if put.outcome is PutOutcome.STORED or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert put.outcome is PutOutcome.STORED, put
            got, out = get_bytes(backend, key, spec)
            assert got.outcome is GetOutcome.HIT
            assert out == pattern(key, spec.nbytes)
            time.sleep(0.5)
        finally:
            stop.set()
            for worker in workers:
                worker.join(timeout=30)
            backend.close()
        assert bad == []
        assert before["stored"] + before["present"] > 0
        # The outage was seen: the backend said so, and the restarted master had lost
        # every object, so reads that hit before it missed or failed after it.
        assert any("unreachable" in r.getMessage() for r in caplog.records)
        assert seen["miss"] + seen["error"] > before["miss"] + before["error"]
        assert seen["hit"] > before["hit"], "no hits after the restart"


# ---------------------------------------------------------------------- configuration


def test_unreachable_master_fails_fast_with_its_address() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError, match=rf"master at 127\.0\.0\.1:{port}"):
        MooncakeBackend(
            MooncakeBackendConfig(
                master_address=f"{LOOPBACK}:{port}",
                metadata_server=f"http://{LOOPBACK}:{port}/metadata",
                connect_timeout_s=2.0,
            )
        )
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({"master_address": "nohost"}, "master_address", "host:port"),
        ({"master_address": "h:70000"}, "master_address", "host:port"),
        ({"metadata_server": "ftp://x"}, "metadata_server", "metadata server"),
        ({"protocol": "udp"}, "protocol", "tcp"),
        ({"device_names": "mlx5_0"}, "device_names", "protocol is tcp"),
        ({"global_segment_size": -1}, "global_segment_size", ""),
        ({"replicas": 0}, "replicas", ""),
        ({"header_slots": 0}, "header_slots", ""),
        ({"connect_timeout_s": 0}, "connect_timeout_s", ""),
        ({"transfer": "copy"}, "transfer", "zero_copy"),
        ({"staging_bytes": "1KiB"}, "staging_bytes", ""),
        ({"segment": 1}, "segment", "master_address"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any], field: str, message: str) -> None:
    base: dict[str, Any] = {
        "master_address": "127.0.0.1:1",
        "metadata_server": "http://127.0.0.1:2/metadata",
    }
    with pytest.raises(ConfigError) as raised:
        create_backend("mooncake", {**base, **options})
    assert field in str(raised.value)
    assert message in str(raised.value)


def test_sizes_and_protocol_parse_from_json_shapes() -> None:
    config = MooncakeBackendConfig(master_address="10.0.0.5:50051", metadata_server="P2PHANDSHAKE")
    assert config.protocol is MooncakeProtocol.TCP
    from sglang_storage.config import build_config

    built = build_config(
        MooncakeBackendConfig,
        {
            "master_address": "[::1]:50051",
            "metadata_server": "etcd://10.0.0.1:2379",
            "protocol": "rdma",
            "device_names": "mlx5_0,mlx5_1",
            "global_segment_size": "2GiB",
        },
    )
    assert built.global_segment_size == 2 << 30
    assert built.protocol is MooncakeProtocol.RDMA


def test_missing_client_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(BackendUnavailableError, match=r"sglang-storage\[mooncake-cpu\]"):
        MooncakeBackend(
            MooncakeBackendConfig(
                master_address="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata"
            )
        )


def test_close_waits_for_the_calls_in_flight_and_then_refuses_new_ones() -> None:
    from sglang_storage.storage.mooncake import _InFlight

    lock = threading.Lock()
    calls = _InFlight(lock, "mooncake")
    inside, leave = threading.Event(), threading.Event()
    closed: list[float] = []

    def call() -> None:
        with calls:
            inside.set()
            leave.wait(10)

    def close() -> None:
        with lock:
            assert calls.close_locked()
        closed.append(time.monotonic())

    caller = threading.Thread(target=call)
    caller.start()
    assert inside.wait(10)
    with calls:  # a second call, begun and ended while the first runs, wakes no one
        pass
    closer = threading.Thread(target=close)
    closer.start()
    time.sleep(0.2)
    assert not closed, "close returned while a call was in flight"
    left = time.monotonic()
    leave.set()
    caller.join(10)
    closer.join(10)
    assert closed, "close never returned"
    assert closed[0] >= left, "close returned before the call in flight ended"
    with pytest.raises(BackendUnavailableError), calls:
        pass
    with lock:
        assert not calls.close_locked(), "a second close is not the first"
