"""kill -9 in the middle of a stream of batched writes to the ``file`` backend, then restart.

A writer process (forked from this one, so it starts in milliseconds) opens the store with
``Durability.FULL`` and writes batches of objects whose payloads are derived from their
keys. After each batch it appends the keys acknowledged ``STORED`` to an ack file and
fsyncs it, so every key in the file was acknowledged under the durable setting before
the line reached the disk. The test kills the writer with SIGKILL at a seeded random
moment, waiting for a moment when one of its temporary files exists so that the kill
lands mid-write, and after every kill checks with the fsck API (a read-only scan):

- the store opens;
- nothing is corrupt, and every ``ok`` object's payload is exactly the bytes the writer
  meant for that key (wrong bytes are counted and must be 0);
- every acknowledged key is present and correct (lost ones are counted and must be 0);
- the killed writer's temporary files are reported ``orphaned_temp``; they are then
  cleaned, alternately by ``sglang-storage fsck --repair`` and by opening the store, and
  a second scan finds none.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import xxhash
from support.ledger import Ledger

from sglang_storage.cli import main
from sglang_storage.core import (
    DataKind,
    GetOutcome,
    GetRequest,
    Namespace,
    ObjectSpec,
    PutOutcome,
    PutRequest,
)
from sglang_storage.storage import Durability, FileBackend, FileBackendConfig, ObjectState
from sglang_storage.storage.posix import temp_writer

LEDGER_AREA = "kill -9 during writes (file backend)"

KILLS: Final = 10
SEED: Final = 20261203
BATCH: Final = 16
MAX_BATCHES: Final = 2000
"""A writer stops by itself after this many batches (bounded even if never killed)."""
NAMESPACE: Final = Namespace(model="crash-model", kind=DataKind.KV)


def payload_size(name: str) -> int:
    """The payload size of ``name``'s object: 4-36 KiB, fixed by the name."""
    return 4096 * (1 + xxhash.xxh32_intdigest(name.encode()) % 9)


def payload(name: str) -> bytes:
    """The bytes the writer stores under ``name`` (the same in every process)."""
    return random.Random(f"crash/{name}").randbytes(payload_size(name))


def batch_names(life: int, batch: int) -> list[str]:
    """The keys of one batch; every writer's first batch repeats eight shared keys."""
    names = [f"life{life}-b{batch}-{i}" for i in range(BATCH)]
    if batch == 0:
        names[:8] = [f"shared-{i}" for i in range(8)]
    return names


def _writer(root: str, life: int, ack_path: str) -> None:
    """The child: batches of durable writes, each acknowledged key fsync'ed to the ack file."""
    try:
        backend = FileBackend(
            FileBackendConfig(root=Path(root), durability=Durability.FULL, io_threads=2)
        )
        ack = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for batch in range(MAX_BATCHES):
            requests = [
                PutRequest(
                    key=NAMESPACE.key(name),
                    spec=ObjectSpec.raw(payload_size(name)),
                    buffers=[memoryview(payload(name))],
                )
                for name in batch_names(life, batch)
            ]
            results = backend.put_from(requests)
            acked = [r.key.name for r in results if r.outcome is PutOutcome.STORED]
            os.write(ack, "".join(f"{name}\n" for name in acked).encode())
            os.fsync(ack)
        backend.close()
    finally:
        os._exit(0)


def acknowledged(ack_path: Path) -> list[str]:
    """The keys of the complete lines of an ack file (a torn last line is not an ack)."""
    if not ack_path.exists():
        return []
    text = ack_path.read_text()
    return text.split("\n")[:-1]


def temp_files_of(root: Path, pid: int) -> list[Path]:
    return [p for p in (root / "tmp").iterdir() if temp_writer(p.name) == pid]


def kill_mid_write(root: Path, life: int, ack_path: Path, rng: random.Random) -> int:
    """Run one writer and SIGKILL it mid-write; returns its pid (reaped)."""
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_writer, args=(str(root), life, str(ack_path)), daemon=True)
    child.start()
    assert child.pid is not None
    try:
        deadline = time.monotonic() + 30
        while not acknowledged(ack_path) and child.is_alive():
            assert time.monotonic() < deadline, "the writer acknowledged nothing within 30 s"
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        deadline = time.monotonic() + 1.0
        while not temp_files_of(root, child.pid) and time.monotonic() < deadline:
            time.sleep(0)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    assert child.exitcode == -signal.SIGKILL, f"the writer ended by itself ({child.exitcode})"
    return child.pid


def read_all(backend: FileBackend, names: list[str]) -> Iterator[tuple[str, GetOutcome, bytes]]:
    """Read ``names`` in batches: ``(name, outcome, bytes read)``."""
    for start in range(0, len(names), 64):
        part = names[start : start + 64]
        buffers = [bytearray(payload_size(name)) for name in part]
        requests = [
            GetRequest(
                key=NAMESPACE.key(name),
                spec=ObjectSpec.raw(len(buffer)),
                buffers=[memoryview(buffer)],
            )
            for name, buffer in zip(part, buffers, strict=True)
        ]
        for name, buffer, result in zip(part, buffers, backend.get_into(requests), strict=True):
            yield name, result.outcome, bytes(buffer)


def wrong_bytes(expected: bytes, got: bytes) -> int:
    return sum(a != b for a, b in zip(expected, got, strict=True))


def test_kill_9_during_writes_loses_nothing_acknowledged_and_returns_no_wrong_bytes(
    tmp_path: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    root = tmp_path / "store"
    rng = random.Random(SEED)
    acked: set[str] = set()
    compared: set[str] = set()
    orphans_found = 0
    for life in range(KILLS):
        ack_path = tmp_path / f"ack-{life}"
        pid = kill_mid_write(root, life, ack_path, rng)
        ledger.fault("kill_9")
        new_acks = acknowledged(ack_path)
        ledger.operation(len(new_acks))
        acked.update(new_acks)

        # The fsck API, read-only: nothing is changed by looking.
        with FileBackend(FileBackendConfig(root=root, read_only=True)) as backend:
            reports = list(backend.scan())
            by_state = {state: [r for r in reports if r.state is state] for state in ObjectState}
            assert by_state[ObjectState.CORRUPT] == []
            assert by_state[ObjectState.WRONG_VERSION] == []
            assert by_state[ObjectState.FOREIGN] == []
            orphans = by_state[ObjectState.ORPHANED_TEMP]
            assert all(temp_writer(Path(r.location).name) == pid for r in orphans), orphans
            orphans_found += len(orphans)

            ok_names = {r.key.name for r in by_state[ObjectState.OK] if r.key is not None}
            fresh = sorted(ok_names - compared)
            for name, outcome, got in read_all(backend, fresh):
                ledger.operation()
                expected = payload(name)
                if outcome is not GetOutcome.HIT or got != expected:
                    ledger.wrong(max(1, wrong_bytes(expected, got)))
            compared.update(fresh)

            missing = sorted(acked - ok_names)
            ledger.lost(len(missing))
            assert missing == [], f"acknowledged durable keys missing after kill {life}"

        # Clean the dead writer's temporary files: by fsck --repair, or by opening.
        if life % 2:
            status = main(["fsck", "--dir", str(root), "--repair", "--json"])
            document = json.loads(capsys.readouterr().out)
            assert status == (1 if orphans else 0), document
            assert document["exit_status"] == status
            actions = document["repair"] or []
            assert {a["state"] for a in actions} <= {"orphaned_temp"}
            assert all(a["action"] in ("removed", "gone") for a in actions), actions
        else:
            FileBackend(FileBackendConfig(root=root)).close()
        with FileBackend(FileBackendConfig(root=root, read_only=True)) as backend:
            left = [r for r in backend.scan(payloads=False) if r.state.problem]
            assert left == [], f"after clean-up {life}"

    assert ledger.wrong_bytes == 0
    assert ledger.lost_durable == 0
    assert orphans_found > 0, "no kill landed while a temporary file existed"

    # A normal open after all of it serves every acknowledged key, intact.
    with FileBackend(FileBackendConfig(root=root)) as backend:
        results = list(read_all(backend, sorted(acked)))
        ledger.operation(len(results))
        damaged = [name for name, outcome, got in results if got != payload(name)]
        assert damaged == []
        assert all(outcome is GetOutcome.HIT for _, outcome, _ in results)
    print(
        f"{KILLS} kills, {len(acked)} acknowledged keys, {len(compared)} objects compared, "
        f"{orphans_found} orphaned temp files, {time.monotonic() - started:.1f} s"
    )
    assert time.monotonic() - started < 90
