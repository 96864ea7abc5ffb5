"""Several processes (as TP ranks would) writing, reading and deleting in one file store.

Three spawned processes open one ``file`` backend directory and, for a bounded time (3 s),
each write, read, delete and ask for keys of one shared set of 40, in batches of one to
three keys; then the same processes do it again on a second directory where each has a
capacity cap small enough that it evicts all the time. Keys are written again after
deletes, each write with a new version of the key's content (:mod:`support.file_stress`),
so a reader can tell exactly which write it got. Every read's bytes are checked as they
arrive.

Afterwards the logs of all processes are replayed against a model of what must be there
(:class:`support.file_stress.StoreModel`; all times are ``CLOCK_MONOTONIC``, one clock
for every process on the host):

- every hit is a whole copy of a version some process stored, not one a delete or a
  later write had certainly removed before the read began;
- a miss is a lost object if some put was acknowledged (stored, or found present) before
  the read began and no delete or eviction of that key overlaps the time from that put's
  start to the read's end;
- at the end every object in the directory is a whole, verified copy of a version not
  certainly removed since; every key acknowledged after its last delete or eviction
  ended is present; nothing is left in ``tmp/`` or ``quarantine/``.

With a cap, "must be there" is weaker exactly where evictions happened: each process
evicts over what it knows, at any time, so an eviction can explain a missing key. The
evictions are observed, not guessed (the real LRU policy wrapped in a recorder), so keys
no process evicted or deleted still must be present. An eviction the backend rolled back
(a write refused for room) only ever makes the model more lenient, never stricter.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from pathlib import Path

from support.file_stress import (
    NAMESPACE,
    SENTINEL,
    Phase,
    StoreModel,
    WorkerLog,
    check_payload,
    key_names,
    nbytes_of,
    stress_worker,
)
from support.ledger import Ledger

from sglang_storage.core import GetOutcome, GetRequest, ObjectSpec
from sglang_storage.storage.file import FileBackend, FileBackendConfig

LEDGER_AREA = "multi-process stress (file backend)"

WORKERS = 3
SECONDS = 3.0
KEYS = 40
CAPACITY = 48 << 10
"""Per process: room for about ten of the 40 keys' objects (1-8 KiB each plus header)."""
START_S = 120.0
"""Spawned interpreters import torch; on a loaded 2-core machine that can take a while."""
CALL_BOUND_S = 20.0
"""No single batch call may take longer than this (a hang, not slowness)."""


def _run_workers(phases: list[Phase], ledger: Ledger) -> list[list[WorkerLog]]:
    """Run every phase with the same worker processes; each phase's logs, by worker."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WORKERS)
    processes = [
        context.Process(
            target=stress_worker,
            args=(phases, w, key_names(KEYS), SECONDS, barrier),
            daemon=True,
        )
        for w in range(WORKERS)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + START_S + len(phases) * (SECONDS + CALL_BOUND_S)
    for process in processes:
        process.join(timeout=max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            ledger.hang()
            process.kill()
            process.join(timeout=10)
    assert ledger.hangs == 0, "a worker did not finish in time"
    assert [p.exitcode for p in processes] == [0] * WORKERS
    return [
        [pickle.loads(Path(phase.out.format(worker=w)).read_bytes()) for w in range(WORKERS)]
        for phase in phases
    ]


def _final_contents(root: Path) -> tuple[dict[str, int | None], list[str], int]:
    """Each key's version in the directory (None: absent), what is wrong, and object bytes."""
    problems: list[str] = []
    leftovers = sorted(p.name for d in ("tmp", "quarantine") for p in (root / d).iterdir())
    if leftovers:
        problems.append(f"left in tmp/ or quarantine/: {leftovers}")
    names = set(key_names(KEYS))
    total = 0
    for directory, _, files in os.walk(root / "objects"):
        for file in files:
            path = Path(directory, file)
            total += path.stat().st_size
            relative = path.relative_to(root / "objects").parts
            if "/".join(relative[:3]) != NAMESPACE.path or file not in names:
                problems.append(f"a file that is no object of the run: {path}")
    contents: dict[str, int | None] = {}
    with FileBackend(FileBackendConfig(root=root)) as reader:
        for name in sorted(names):
            spec = ObjectSpec.raw(nbytes_of(name))
            target = bytearray([SENTINEL]) * spec.nbytes
            request = GetRequest(key=NAMESPACE.key(name), spec=spec, buffers=[memoryview(target)])
            [result] = reader.get_into([request])
            if result.outcome is GetOutcome.HIT:
                contents[name] = check_payload(name, bytes(target))
                if contents[name] is None:
                    problems.append(f"final {name}: a verified object of no version of it")
            elif result.outcome is GetOutcome.MISS:
                contents[name] = None
            else:
                problems.append(f"final {name}: {result.outcome.value}: {result.error}")
    return contents, problems, total


def test_processes_share_one_directory_and_match_the_model(tmp_path: Path, ledger: Ledger) -> None:
    """Both variants in one run of the same processes (spawning costs seconds each)."""
    phases = [
        Phase(str(tmp_path / name), capacity, str(tmp_path / f"{name}-{{worker}}.pickle"))
        for name, capacity in (("unbounded", None), ("capped", CAPACITY))
    ]
    ledger.fault("concurrent_process", WORKERS)
    for phase, logs in zip(phases, _run_workers(phases, ledger), strict=True):
        _check_phase(Path(phase.root), phase.capacity_bytes, logs, ledger)


def _check_phase(root: Path, capacity: int | None, logs: list[WorkerLog], ledger: Ledger) -> None:
    evicted = sum(log.evicted for log in logs)
    if capacity is not None:
        ledger.fault("eviction", evicted)
    ledger.operation(sum(log.calls for log in logs))
    ledger.wrong(sum(log.wrong_bytes for log in logs))
    slowest = max(log.slowest_s for log in logs)
    if slowest > CALL_BOUND_S:
        ledger.hang()

    model = StoreModel(logs)
    wrong_reads, lost_reads = model.bad_reads()
    contents, final_problems, total_bytes = _final_contents(root)
    wrong_final, lost_final = model.check_final(contents)
    ledger.wrong(sum(nbytes_of(line.split(":")[0]) for line in wrong_reads + wrong_final))
    ledger.lost(len(lost_reads) + len(lost_final))

    variant = f"{root.name} store"
    assert [line for log in logs for line in log.bad] == [], variant
    assert wrong_reads == [], variant
    assert wrong_final == [], variant
    assert lost_reads == [], variant
    assert lost_final == [], variant
    assert final_problems == [], variant
    assert (ledger.wrong_bytes, ledger.lost_durable, ledger.hangs) == (0, 0, 0), variant

    # The run did what it is meant to: contended writes, rewrites after deletes, hits.
    events = [event for log in logs for event in log.events]
    stored = sum(1 for e in events if e.outcome == "stored")
    assert stored > KEYS, f"{variant}: keys were not written again after deletes"
    assert sum(1 for e in events if e.outcome == "hit") > 100, variant
    assert sum(1 for e in events if e.outcome == "present") > 0, variant
    assert sum(1 for e in events if e.kind == "delete") > 0, variant
    assert any(version is not None for version in contents.values()), variant
    if capacity is None:
        assert evicted == 0, variant
    else:
        assert evicted > 0, "the cap never made a process evict"
        # Each process keeps what it wrote within its cap, so the directory holds at most
        # one cap per process (what a process only read does not count against its cap).
        assert total_bytes <= WORKERS * capacity
