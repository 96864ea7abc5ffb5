"""The backend protocol, its declared capabilities and its statistics.

A backend stores self-checking objects (:mod:`.format`) by :class:`~sglang_storage.core.ObjectKey`
and moves payloads straight between its medium and the caller's host buffers. It
satisfies :class:`~sglang_storage.transfer.store.PageStore`, so the host<->storage pipeline
can drive it, and adds what owners and operators need: longest-prefix existence,
deletion, clearing one namespace, statistics, capabilities and closing.

A third-party backend implements :class:`Backend` (mypy checks it structurally) and is
registered by name (:mod:`.registry`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import attrs

from sglang_storage.core import (
    GetOutcome,
    GetResult,
    Namespace,
    ObjectKey,
    PutOutcome,
    PutResult,
)
from sglang_storage.storage.fsck import ObjectReport, RepairResult
from sglang_storage.transfer.store import PageStore

__all__ = [
    "Backend",
    "BackendStats",
    "Capabilities",
    "MemoryRegistrar",
    "Scannable",
    "StatsRecorder",
    "count_prefix",
    "scrub",
]


@attrs.frozen(kw_only=True)
class Capabilities:
    """What a backend promises, declared up front rather than probed at run time."""

    zero_copy: bool
    """Payloads move between the medium and the caller's buffers with no staging copy."""
    shared_across_processes: bool
    """Several processes on one host (TP ranks) can open the same store at once."""
    shared_across_hosts: bool
    """Processes on different hosts see the same objects."""
    durable: bool
    """Objects survive a restart of the process (and, per the backend's durability
    setting, of the host)."""
    bounded: bool
    """The backend evicts objects on its own to stay within a capacity."""
    registers_memory: bool = False
    """Moves are faster (or, for some transports, only possible) from host memory
    registered once through :class:`MemoryRegistrar`; owners of long-lived buffers
    (host pools) should register them."""
    scannable: bool = False
    """The backend can enumerate what its medium holds and check it object by object:
    it implements :class:`Scannable` (what ``sglang-storage fsck`` and ``stats`` use)."""


@attrs.frozen(kw_only=True)
class BackendStats:
    """What a backend holds and what it has done since it was opened."""

    objects: int
    """Objects held (those this instance knows of, for shared media)."""
    bytes: int
    """Bytes held, headers included."""
    capacity_bytes: int | None
    """The cap it evicts down to, or ``None`` when unbounded."""
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    """Reads that found an object failing verification (each was quarantined)."""
    get_errors: int = 0
    stored: int = 0
    present: int = 0
    """Writes skipped because the key was already stored."""
    put_errors: int = 0
    bytes_read: int = 0
    """Payload bytes delivered by hits."""
    bytes_written: int = 0
    """Payload bytes stored."""
    deleted: int = 0
    evicted: int = 0


class Backend(PageStore, Protocol):
    """A key-value store of self-checking objects; see :class:`PageStore` for the batch contract.

    Beyond reads and writes:

    - ``prefix_hits(keys)`` counts how many leading keys are stored (SGLang asks "how much
      of this prefix can storage serve?").
    - ``delete(keys)`` and ``clear(namespace)`` remove objects; absent keys are fine.
    - ``close()`` releases resources; any later call raises
      :class:`~sglang_storage.errors.BackendUnavailableError`. Closing twice is a no-op.
    """

    @property
    def capabilities(self) -> Capabilities:
        """What this backend promises."""
        ...

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many of ``keys``, from the first, are stored without a gap."""
        ...

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """Remove ``keys``' objects where stored."""
        ...

    def clear(self, namespace: Namespace) -> None:
        """Remove every object of ``namespace``, and nothing else."""
        ...

    def stats(self) -> BackendStats:
        """A snapshot of contents and counters."""
        ...

    def close(self) -> None:
        """Release the backend's resources."""
        ...


class MemoryRegistrar(Protocol):
    """A backend whose transport wants host memory registered once.

    Declared by :attr:`Capabilities.registers_memory`.
    """

    def register_memory(self, buffer: memoryview) -> None:
        """Register ``buffer``'s memory for zero-copy moves until it is unregistered."""
        ...

    def unregister_memory(self, buffer: memoryview) -> None:
        """Undo :meth:`register_memory` for the same buffer."""
        ...


@runtime_checkable
class Scannable(Protocol):
    """A backend that can list and check everything on its medium.

    Declared by :attr:`Capabilities.scannable`. Report types are in :mod:`.fsck`.

    - ``scan()`` yields one report per object, temporary file or foreign file found, and
      changes nothing.
    - ``repair(reports)`` re-checks each reported problem and puts it right where it is
      still there (quarantines damaged objects, removes orphaned temporary files and,
      when a model was given to the scan, objects of other models); foreign files are
      never touched.
    """

    def scan(self, *, payloads: bool = True, model: str | None = None) -> Iterator[ObjectReport]:
        """Report everything on the medium.

        Args:
            payloads: Read every payload and verify its checksum (``False``: headers and
                sizes only, which is much faster).
            model: The model fingerprint the store should hold; whole objects of other
                models are reported ``wrong_model``. ``None`` accepts every model.
        """
        ...

    def repair(self, reports: Sequence[ObjectReport]) -> list[RepairResult]:
        """Put right the problems among ``reports``; one result per report, in order.

        Raises:
            StateError: the backend was opened read-only.
        """
        ...


def count_prefix(found: Iterable[bool]) -> int:
    """The number of leading ``True`` values."""
    count = 0
    for present in found:
        if not present:
            break
        count += 1
    return count


def scrub(buffers: Sequence[memoryview]) -> None:
    """Zero ``buffers``: what a failed read leaves instead of unverified bytes."""
    for buffer in buffers:
        if buffer.nbytes:
            ctypes.memset((ctypes.c_char * buffer.nbytes).from_buffer(buffer), 0, buffer.nbytes)


class StatsRecorder:
    """Thread-safe counters behind :class:`BackendStats`, fed with per-key results."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gets = dict.fromkeys(GetOutcome, 0)
        self._puts = dict.fromkeys(PutOutcome, 0)
        self._bytes_read = 0
        self._bytes_written = 0
        self._deleted = 0
        self._evicted = 0

    def record_gets(self, results: Iterable[GetResult]) -> None:
        """Count the outcomes and delivered bytes of ``results``."""
        with self._lock:
            for result in results:
                self._gets[result.outcome] += 1
                self._bytes_read += result.nbytes

    def record_puts(self, results: Iterable[PutResult]) -> None:
        """Count the outcomes and written bytes of ``results``."""
        with self._lock:
            for result in results:
                self._puts[result.outcome] += 1
                self._bytes_written += result.nbytes

    def record_deleted(self, count: int) -> None:
        """Count objects removed on request."""
        with self._lock:
            self._deleted += count

    def record_evicted(self, count: int) -> None:
        """Count objects removed to stay within capacity."""
        with self._lock:
            self._evicted += count

    def snapshot(self, *, objects: int, nbytes: int, capacity_bytes: int | None) -> BackendStats:
        """The counters together with the backend's current contents."""
        with self._lock:
            return BackendStats(
                objects=objects,
                bytes=nbytes,
                capacity_bytes=capacity_bytes,
                hits=self._gets[GetOutcome.HIT],
                misses=self._gets[GetOutcome.MISS],
                corrupt=self._gets[GetOutcome.CORRUPT],
                get_errors=self._gets[GetOutcome.ERROR],
                stored=self._puts[PutOutcome.STORED],
                present=self._puts[PutOutcome.PRESENT],
                put_errors=self._puts[PutOutcome.ERROR],
                bytes_read=self._bytes_read,
                bytes_written=self._bytes_written,
                deleted=self._deleted,
                evicted=self._evicted,
            )
