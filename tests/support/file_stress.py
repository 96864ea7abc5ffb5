"""Several processes on one ``file`` backend directory, and the model their logs are checked by.

:func:`stress_worker` runs in a spawned process (as a TP rank would): it opens the store,
waits for the others, then for a bounded time writes, reads, deletes and asks for keys of
a shared set, and pickles a log of every operation with its start and end time
(``time.monotonic``, one clock for every process on the host). :class:`StoreModel`
replays the logs of all workers and says which reads, which missing objects and which
leftover objects are impossible.

Payloads carry a version: every write of a key (after a delete, keys are written again)
stores ``payload(name, version)``, whose first 8 bytes are the version and whose rest is
derived from name and version. A reader can therefore tell which write it sees, and
whether the bytes are exactly that write's, without knowing which write won.

Evictions are observed, not guessed: the worker hands the backend an LRU policy wrapped in
:class:`RecordingEviction`, which notes each victim and the time it was chosen; the worker
turns those into removal events ending when the ``put_from`` that chose them returns (the
file is unlinked before then).
"""

from __future__ import annotations

import bisect
import pickle
import random
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

from sglang_storage.core import (
    DataKind,
    EvictionPolicy,
    GetOutcome,
    GetRequest,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutOutcome,
    PutRequest,
)
from sglang_storage.errors import CapacityError
from sglang_storage.policy import EvictionConfig, make_eviction_policy
from sglang_storage.storage.file import FileBackend, FileBackendConfig

__all__ = [
    "NAMESPACE",
    "Event",
    "Phase",
    "RecordingEviction",
    "StoreModel",
    "WorkerLog",
    "check_payload",
    "key_names",
    "nbytes_of",
    "payload",
    "stress_worker",
]

NAMESPACE: Final = Namespace(model="stress-model", kind=DataKind.KV)
SENTINEL: Final = 0xA5
VERSION_BYTES: Final = 8

EventKind = Literal["put", "get", "delete", "evict"]


class Event(NamedTuple):
    """One key's part in one operation, as a worker saw it.

    ``outcome``: for puts ``"stored"``, ``"present"`` or ``"capacity"`` (a refused write);
    for gets ``"hit"`` or ``"miss"``; ``"done"`` for deletes and evictions. ``version``: the
    version written (puts) or read (hits); 0 otherwise.
    """

    kind: EventKind
    name: str
    outcome: str
    version: int
    start: float
    end: float


class WorkerLog(NamedTuple):
    """What one worker did and found."""

    worker: int
    events: list[Event]
    bad: list[str]
    """Anything that is wrong on its face: wrong bytes, corrupt or failed results,
    exceptions. Must be empty."""
    wrong_bytes: int
    calls: int
    slowest_s: float
    evicted: int
    """The backend's own eviction count at the end."""


def key_names(count: int) -> list[str]:
    """The shared key set."""
    return [f"k{i:03d}" for i in range(count)]


def nbytes_of(name: str) -> int:
    """The payload size of ``name``'s objects: 1-8 KiB, fixed per key."""
    return 1024 * (1 + int(name[1:]) % 8)


def payload(name: str, version: int, nbytes: int) -> bytes:
    """Version ``version`` of ``name``'s content: the version, then bytes derived from both."""
    rest = random.Random(f"{name}/{version}").randbytes(nbytes - VERSION_BYTES)
    return version.to_bytes(VERSION_BYTES, "little") + rest


def check_payload(name: str, data: bytes) -> int | None:
    """The version ``data`` is a whole copy of, or None when it is no version of ``name``."""
    version = int.from_bytes(data[:VERSION_BYTES], "little")
    if version == 0 or data != payload(name, version, len(data)):
        return None
    return version


class RecordingEviction:
    """An eviction policy (the real LRU) that notes every victim it hands out.

    An observer around the real policy, not a fake: every decision is the LRU's. The
    backend calls it under its index lock from its I/O threads; :meth:`drain` takes the
    victims noted so far, with the time each was chosen.
    """

    def __init__(self) -> None:
        self._inner: EvictionPolicy[ObjectKey] = make_eviction_policy(EvictionConfig(name="lru"))
        self._lock = threading.Lock()
        self._victims: list[tuple[ObjectKey, float]] = []

    @property
    def name(self) -> str:
        """The wrapped policy's name."""
        return self._inner.name

    def insert(self, key: ObjectKey, weight: int = 1) -> None:
        self._inner.insert(key, weight)

    def access(self, key: ObjectKey) -> None:
        self._inner.access(key)

    def remove(self, key: ObjectKey) -> None:
        self._inner.remove(key)

    def pin(self, key: ObjectKey) -> None:
        self._inner.pin(key)

    def unpin(self, key: ObjectKey) -> None:
        self._inner.unpin(key)

    def evict(self, amount: int) -> list[ObjectKey]:
        victims = self._inner.evict(amount)
        now = time.monotonic()
        with self._lock:
            self._victims.extend((victim, now) for victim in victims)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._inner

    def __len__(self) -> int:
        return len(self._inner)

    def drain(self) -> list[tuple[ObjectKey, float]]:
        """The victims chosen since the last call, with when."""
        with self._lock:
            victims, self._victims = self._victims, []
        return victims


class Phase(NamedTuple):
    """One store the workers share for a while: its root, its cap, where logs go."""

    root: str
    capacity_bytes: int | None
    out: str
    """A ``{worker}`` template: each worker's pickled :class:`WorkerLog`."""


def stress_worker(
    phases: Sequence[Phase], worker: int, names: Sequence[str], seconds: float, barrier: Any
) -> None:
    """One process's share of the stress run: each phase in turn, started together."""
    for phase in phases:
        _run_phase(phase, worker, names, seconds, barrier)


def _run_phase(
    phase: Phase, worker: int, names: Sequence[str], seconds: float, barrier: Any
) -> None:
    root, capacity_bytes = phase.root, phase.capacity_bytes
    events: list[Event] = []
    bad: list[str] = []
    counters = {"wrong": 0, "calls": 0, "evicted": 0}
    slowest = 0.0
    eviction = RecordingEviction()
    rng = random.Random(1000 + worker)
    next_version = (worker + 1) << 32
    try:
        backend = FileBackend(
            FileBackendConfig(root=Path(root), capacity_bytes=capacity_bytes),
            eviction=eviction if capacity_bytes is not None else None,
        )
        barrier.wait(timeout=120)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            chosen = rng.sample(list(names), rng.randint(1, 3))
            keys = [NAMESPACE.key(name) for name in chosen]
            op = rng.random()
            start = time.monotonic()
            if op < 0.4:
                versions = []
                for _ in chosen:
                    next_version += 1
                    versions.append(next_version)
                _put(backend, chosen, keys, versions, events, bad, start)
                end = events[-1].end
                for victim, chosen_at in eviction.drain():
                    events.append(Event("evict", victim.name, "done", 0, chosen_at, end))
            elif op < 0.85:
                counters["wrong"] += _get(backend, chosen, keys, events, bad, start, rng)
                end = events[-1].end
            elif op < 0.95:
                backend.delete(keys)
                end = time.monotonic()
                events.extend(Event("delete", name, "done", 0, start, end) for name in chosen)
            else:
                # Other processes change the answers meanwhile; only the shapes are fixed.
                found = backend.exists(keys)
                hits = backend.prefix_hits(keys)
                end = time.monotonic()
                if len(found) != len(keys) or not 0 <= hits <= len(keys):
                    bad.append(f"exists({chosen}) = {found}, prefix_hits = {hits}")
            counters["calls"] += 1
            slowest = max(slowest, end - start)
        counters["evicted"] = backend.stats().evicted
        backend.close()
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails
        bad.append(f"worker {worker} crashed: {type(error).__name__}: {error}")
        bad.append(traceback.format_exc())
    log = WorkerLog(
        worker=worker,
        events=events,
        bad=bad,
        wrong_bytes=counters["wrong"],
        calls=counters["calls"],
        slowest_s=slowest,
        evicted=counters["evicted"],
    )
    Path(phase.out.format(worker=worker)).write_bytes(pickle.dumps(log))


def _put(
    backend: FileBackend,
    chosen: Sequence[str],
    keys: Sequence[ObjectKey],
    versions: Sequence[int],
    events: list[Event],
    bad: list[str],
    start: float,
) -> None:
    requests = [
        PutRequest(
            key=key,
            spec=ObjectSpec.raw(nbytes_of(name)),
            buffers=[payload(name, version, nbytes_of(name))],
        )
        for name, key, version in zip(chosen, keys, versions, strict=True)
    ]
    results = backend.put_from(requests)
    end = time.monotonic()
    for name, version, result in zip(chosen, versions, results, strict=True):
        if result.outcome is PutOutcome.ERROR:
            if isinstance(result.error, CapacityError):
                events.append(Event("put", name, "capacity", version, start, end))
            else:
                bad.append(f"put {name}: {type(result.error).__name__}: {result.error}")
            continue
        events.append(Event("put", name, result.outcome.value, version, start, end))


def _get(
    backend: FileBackend,
    chosen: Sequence[str],
    keys: Sequence[ObjectKey],
    events: list[Event],
    bad: list[str],
    start: float,
    rng: random.Random,
) -> int:
    """Read ``keys``; returns the number of wrong bytes delivered."""
    targets = [bytearray([SENTINEL]) * nbytes_of(name) for name in chosen]
    requests = []
    for name, key, target in zip(chosen, keys, targets, strict=True):
        view = memoryview(target)
        cut = rng.randrange(len(target) + 1)
        requests.append(
            GetRequest(
                key=key, spec=ObjectSpec.raw(nbytes_of(name)), buffers=[view[:cut], view[cut:]]
            )
        )
    results = backend.get_into(requests)
    end = time.monotonic()
    wrong = 0
    for name, target, result in zip(chosen, targets, results, strict=True):
        data = bytes(target)
        if result.outcome is GetOutcome.HIT:
            version = check_payload(name, data)
            if version is None:
                wrong += len(data)
                bad.append(f"get {name}: a hit delivered bytes of no version of it")
                continue
            events.append(Event("get", name, "hit", version, start, end))
        elif result.outcome is GetOutcome.MISS:
            if data != bytes([SENTINEL]) * len(data):
                bad.append(f"get {name}: a miss wrote into the buffers")
            events.append(Event("get", name, "miss", 0, start, end))
        else:
            bad.append(f"get {name}: {result.outcome.value}: {result.error}")
    return wrong


# ---------------------------------------------------------------------- the model


class _Intervals:
    """Time intervals of one kind of event on one key, for the model's range questions."""

    def __init__(self, spans: Iterable[tuple[float, float]]) -> None:
        by_start = sorted(spans)
        self.starts = [start for start, _ in by_start]
        # Suffix minimum of ends (by start) and prefix maximum of ends (by start).
        self._suffix_min_end = [0.0] * len(by_start)
        low = float("inf")
        for i in range(len(by_start) - 1, -1, -1):
            low = min(low, by_start[i][1])
            self._suffix_min_end[i] = low
        self._prefix_max_end: list[float] = []
        high = float("-inf")
        for _, end in by_start:
            high = max(high, end)
            self._prefix_max_end.append(high)

    def any_within(self, after: float, before: float) -> bool:
        """Whether some interval starts after ``after`` and ends before ``before``."""
        at = bisect.bisect_right(self.starts, after)
        return at < len(self.starts) and self._suffix_min_end[at] < before

    def any_overlapping(self, after: float, before: float) -> bool:
        """Whether some interval ends after ``after`` and starts before ``before``."""
        at = bisect.bisect_left(self.starts, before)
        return at > 0 and self._prefix_max_end[at - 1] > after

    def latest_end(self) -> float:
        """The latest end, or -inf when there are none."""
        return self._prefix_max_end[-1] if self._prefix_max_end else float("-inf")

    def latest_start(self) -> float:
        """The latest start, or -inf when there are none."""
        return self.starts[-1] if self.starts else float("-inf")


class _KeyHistory:
    """Everything every worker did to one key."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.stored = {e.version: (e.start, e.end) for e in events if e.outcome == "stored"}
        acknowledged = [e for e in events if e.kind == "put" and e.outcome in ("stored", "present")]
        # Puts by end, with the latest start among those ending no later (for misses).
        acknowledged.sort(key=lambda e: e.end)
        self.ack_ends = [e.end for e in acknowledged]
        self.ack_best_start: list[float] = []
        best = float("-inf")
        for e in acknowledged:
            best = max(best, e.start)
            self.ack_best_start.append(best)
        deletes = [(e.start, e.end) for e in events if e.kind == "delete"]
        evictions = [(e.start, e.end) for e in events if e.kind == "evict"]
        # Certainly gone afterwards: an explicit delete, or another write replacing it.
        self.gone = _Intervals(deletes + list(self.stored.values()))
        # Possibly removed: deletes and evictions (an eviction may be rolled back).
        self.removals = _Intervals(deletes + evictions)


class StoreModel:
    """What the workers' logs allow, checked read by read and object by object.

    Rules (``P_v`` is the put that stored version ``v``; each version is written once):

    - A hit of ``v`` needs ``P_v`` to have started before the read ended, and no delete
      and no other stored write of the key that started after ``P_v`` ended and ended
      before the read started (that would have removed or replaced ``v`` for good).
    - A miss is a lost object when some acknowledged put (stored or present) ended before
      the read started and no delete or eviction of the key overlaps the span from that
      put's start to the read's end.
    - At the end, an object present holds a stored version not removed or replaced for
      good afterwards (as above: so a key deleted after every stored write of it ended
      must be absent); a key whose latest delete or eviction ended before some
      acknowledged put started must be present.
    """

    def __init__(self, logs: Sequence[WorkerLog]) -> None:
        by_name: dict[str, list[Event]] = defaultdict(list)
        for log in logs:
            for event in log.events:
                by_name[event.name].append(event)
        self._history = {name: _KeyHistory(events) for name, events in by_name.items()}
        self._reads = [e for log in logs for e in log.events if e.kind == "get"]

    def history(self, name: str) -> _KeyHistory:
        return self._history.get(name) or _KeyHistory([])

    def bad_reads(self) -> tuple[list[str], list[str]]:
        """``(wrong, lost)``: impossible hits, and misses of objects that must be there.

        Each line starts with the key's name and a colon.
        """
        wrong: list[str] = []
        lost: list[str] = []
        for read in self._reads:
            history = self.history(read.name)
            if read.outcome == "hit":
                why = self._impossible_version(history, read.version, read.start, read.end)
                if why:
                    wrong.append(
                        f"{read.name}: hit of v{read.version:#x} at {read.start:.6f}: {why}"
                    )
            elif self._must_hit(history, read.start, read.end):
                lost.append(f"{read.name}: miss at {read.start:.6f} after an acknowledged put")
        return wrong, lost

    @staticmethod
    def _impossible_version(history: _KeyHistory, version: int, start: float, end: float) -> str:
        span = history.stored.get(version)
        if span is None:
            return "no worker stored that version"
        if span[0] >= end:
            return "its write began after the read ended"
        if history.gone.any_within(span[1], start):
            return "a delete or another write replaced it before the read began"
        return ""

    @staticmethod
    def _must_hit(history: _KeyHistory, start: float, end: float) -> bool:
        at = bisect.bisect_left(history.ack_ends, start)
        if at == 0:
            return False
        put_start = history.ack_best_start[at - 1]
        return not history.removals.any_overlapping(put_start, end)

    def check_final(self, present: Mapping[str, int | None]) -> tuple[list[str], list[str]]:
        """``(wrong, lost)`` for the final contents: key name to version read (None: absent)."""
        wrong: list[str] = []
        lost: list[str] = []
        for name, version in present.items():
            history = self.history(name)
            if version is not None:
                why = self._impossible_version(history, version, float("inf"), float("inf"))
                if why:
                    wrong.append(f"{name}: final v{version:#x}: {why}")
            elif history.ack_best_start and (
                history.ack_best_start[-1] > history.removals.latest_end()
            ):
                lost.append(f"{name}: absent at the end, but written after its last removal")
        return wrong, lost
