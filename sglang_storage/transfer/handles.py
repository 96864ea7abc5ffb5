"""Typed handles for host<->storage operations, and the life cycle they go through.

A :class:`TransferHandle` is what :class:`~sglang_storage.transfer.pipeline.StoragePipeline`
returns for every submitted get, put or exists. Contract, one line per primitive:

- ``state`` - the :class:`OpState`: ``PENDING`` (queued, no backend call made yet) ->
  ``RUNNING`` (at least one backend call made) -> one of the terminal states ``DONE``,
  ``FAILED`` (``error`` is the cause) or ``CANCELLED``. ``PENDING`` may also go straight to
  ``FAILED`` (deadline passed before it started) or ``CANCELLED``.
- ``done()`` / ``wait(timeout_s)`` - whether / block until the handle is terminal.
- ``result(timeout_s)`` - one result per submitted page, in submission order, for a ``DONE``
  handle; raises ``error`` for a failed or cancelled one.
- ``partial()`` - for a terminal handle in any state: the results of the pages whose backend
  call finished, and for the pages never attempted a result that carries ``error``
  (``False`` for exists), so a caller can use what landed before a cancel or failure.
- ``cancel()`` - stop the operation: a queued one ends ``CANCELLED`` at once; a running one
  finishes its backend calls in flight and makes no more.

A handle becomes terminal only when no backend call on its buffers is in flight, so once
``done()`` is true the caller may reuse or free the host buffers it submitted.

:class:`PendingQueue` holds a pipeline's handles until their pages are handed to backend
calls: one FIFO per :class:`Priority`, most urgent first, with a deadline index.
:class:`CloseReport` says what closing a pipeline did to the handles still in it.

Locking: only the pipeline that created a handle changes it, through the underscore
methods below, always with the pipeline's lock held; readers (``state``, ``done``, the
properties) see a consistent snapshot without taking it, and neither they nor ``wait``,
``result`` and ``partial`` change anything (the pipeline's ``completions()`` reports the
handle all the same). Waiters never take the pipeline's lock either: each handle has a
gate, a lock held from its creation that the pipeline releases once, after the handle
became terminal; ``wait`` passes through it (taking and at once releasing it).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import operator
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeAlias, TypeVar, cast

import attrs

from sglang_storage.core import GetResult, PutResult
from sglang_storage.errors import (
    OperationCancelledError,
    OperationTimeoutError,
    StateError,
    StorageError,
)

__all__ = [
    "AnyHandle",
    "CloseReport",
    "ExistsHandle",
    "GetHandle",
    "OpKind",
    "OpState",
    "PendingQueue",
    "Priority",
    "PutHandle",
    "TransferHandle",
]

R = TypeVar("R")


class OpKind(enum.Enum):
    """What an operation does to the store."""

    GET = "get"
    """Read pages from storage into host buffers."""
    PUT = "put"
    """Write pages from host buffers to storage."""
    EXISTS = "exists"
    """Ask which keys the store holds."""


class OpState(enum.Enum):
    """Where an operation is in its life cycle."""

    PENDING = "pending"
    """Queued; no backend call has been made for it yet."""
    RUNNING = "running"
    """At least one backend call has been made; not finished yet."""
    DONE = "done"
    """Every page has a result from the backend."""
    FAILED = "failed"
    """Stopped by an error (a backend failure, a missed deadline); ``error`` is the cause."""
    CANCELLED = "cancelled"
    """Stopped by ``cancel()`` or by closing the pipeline."""

    @property
    def terminal(self) -> bool:
        """Whether the state is final (``DONE``, ``FAILED`` or ``CANCELLED``)."""
        return self in (OpState.DONE, OpState.FAILED, OpState.CANCELLED)


class Priority(enum.IntEnum):
    """Scheduling class: lower values run first; first in, first out within one class."""

    URGENT = 0
    """Work a request is waiting for (a prefetch on the critical path)."""
    NORMAL = 1
    """Ordinary work."""
    BACKGROUND = 2
    """Work nobody waits for (write-back, warm-up)."""


class TransferHandle(Generic[R]):
    """The typed future of one submitted get (``R`` = GetResult), put (PutResult) or exists (bool).

    Created only by the pipeline; see the module docstring for the contract.
    """

    def __init__(
        self,
        *,
        op_id: int,
        kind: OpKind,
        priority: Priority,
        items: Sequence[object],
        nbytes: int | Callable[[], int],
        submitted_at: float,
        deadline_s: float | None,
        store_name: str,
        placeholder: Callable[[int, StorageError], R],
        canceller: Callable[[TransferHandle[R]], bool],
    ) -> None:
        self._op_id = op_id
        self._kind = kind
        self._priority = priority
        self._items = tuple(items)
        self._nbytes = nbytes  # a callable until first read: summing is per page
        self._submitted_at = submitted_at
        self._deadline_s = deadline_s
        self._deadline = None if deadline_s is None else submitted_at + deadline_s
        self._store_name = store_name
        self._placeholder = placeholder
        self._canceller = canceller
        # Held until the pipeline lets waiters through (``_gate_to_open``), once terminal.
        self._gate = threading.Lock()
        self._gate.acquire()
        self._state = OpState.PENDING
        self._results: list[R | None] = [None] * len(self._items)
        self._next = 0
        self._inflight = 0
        self._stop_error: StorageError | None = None
        self._error: StorageError | None = None
        self._latency_s: float | None = None
        self._late = False
        self._transferred = 0

    # ------------------------------------------------------------------ read side

    @property
    def op_id(self) -> int:
        """A number unique within the pipeline, increasing in submission order."""
        return self._op_id

    @property
    def kind(self) -> OpKind:
        """Get, put or exists."""
        return self._kind

    @property
    def priority(self) -> Priority:
        """The scheduling class it was submitted with."""
        return self._priority

    @property
    def pages(self) -> int:
        """How many pages (keys) were submitted."""
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Payload bytes the operation was asked to move (0 for exists)."""
        if callable(self._nbytes):
            self._nbytes = self._nbytes()
        return self._nbytes

    @property
    def transferred_bytes(self) -> int:
        """Payload bytes actually moved so far: read for hits, written for stored pages."""
        return self._transferred

    @property
    def deadline_s(self) -> float | None:
        """Seconds after submission by which each backend call must start, or ``None``."""
        return self._deadline_s

    @property
    def state(self) -> OpState:
        """The current life-cycle state."""
        return self._state

    @property
    def error(self) -> StorageError | None:
        """Why the operation failed or was cancelled; ``None`` while running or when done."""
        return self._error

    @property
    def latency_s(self) -> float | None:
        """Seconds from submission to the terminal state; ``None`` until then."""
        return self._latency_s

    @property
    def late(self) -> bool:
        """Whether a ``DONE`` operation finished after its deadline (its results are valid)."""
        return self._late

    def done(self) -> bool:
        """Whether the operation is terminal (done, failed or cancelled)."""
        return self._state.terminal

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the operation is terminal or ``timeout_s`` passes; return ``done()``."""
        if self._state.terminal:
            return True
        gate = self._gate
        if timeout_s is None:
            passed = gate.acquire()
        elif timeout_s > 0:
            passed = gate.acquire(True, min(timeout_s, threading.TIMEOUT_MAX))
        else:
            passed = gate.acquire(False)
        if passed:
            gate.release()  # the next waiter passes too
        return self._state.terminal

    def result(self, timeout_s: float | None = None) -> list[R]:
        """One result per submitted page, in order, once the operation is done.

        Raises:
            OperationTimeoutError: The operation is not terminal within ``timeout_s`` (it
                keeps running; call again or cancel it).
            StorageError: The operation failed (the cause, e.g. a backend error or an
                :class:`~sglang_storage.errors.OperationTimeoutError` for a missed
                deadline) or was cancelled (an
                :class:`~sglang_storage.errors.OperationCancelledError`).
        """
        if not self.wait(timeout_s):
            raise OperationTimeoutError(
                operation=f"waiting for {self._description}", timeout_s=timeout_s or 0.0
            )
        if self._error is not None:
            raise self._error
        return self._filled()

    def partial(self) -> list[R]:
        """Per-page results of a terminal operation in any state, in submission order.

        Pages whose backend call finished carry its result; pages never attempted carry an
        error result whose cause is :attr:`error` (``False`` for exists).

        Raises:
            StateError: The operation is not terminal yet.
        """
        if not self._state.terminal:
            raise StateError(
                subject=f"TransferHandle.partial of {self._description}",
                reason=f"the operation is still {self._state.value}",
            )
        return self._filled()

    def cancel(self) -> bool:
        """Stop the operation; return whether it will end ``CANCELLED``.

        A queued operation is cancelled at once. A running one makes no further backend
        calls, ends ``CANCELLED`` when the calls in flight return, and keeps their results
        (see :meth:`partial`). Returns ``False`` when it is already terminal or has no
        backend call left to skip.
        """
        return self._canceller(self)

    def __repr__(self) -> str:
        return f"<TransferHandle #{self._op_id} {self._description}: {self._state.value}>"

    @property
    def _description(self) -> str:
        """What the operation is, for messages (built only when one is needed)."""
        unit = "keys" if self._kind is OpKind.EXISTS else "pages"
        return f"{self._kind.value} of {len(self._items)} {unit} on {self._store_name!r}"

    def _filled(self) -> list[R]:
        if self._state is OpState.DONE:  # every page has its result
            return cast(list[R], list(self._results))
        cause = self._error or StorageError(f"{self._description}: no result")
        return [
            self._placeholder(i, cause) if r is None else r for i, r in enumerate(self._results)
        ]

    # --------------------------------------------- owner side (pipeline lock held)

    def _deadline_at(self) -> float | None:
        """The clock reading by which each backend call must start, or ``None``."""
        return self._deadline

    def _items_between(self, start: int, end: int) -> tuple[object, ...]:
        """The submitted items (requests or keys) ``start .. end - 1``."""
        return self._items[start:end]

    def _remaining(self) -> int:
        """Pages not yet handed to a backend call."""
        return len(self._items) - self._next

    def _take(self, limit: int) -> tuple[int, int]:
        """Hand out the next at most ``limit`` pages for one backend call."""
        start = self._next
        self._next = min(len(self._items), start + limit)
        self._inflight += 1
        self._state = OpState.RUNNING
        return start, self._next

    def _record(self, start: int, results: Sequence[R], moved: int) -> None:
        """Store one backend call's results for pages ``start ..``."""
        self._results[start : start + len(results)] = results
        self._transferred += moved
        self._inflight -= 1

    def _call_failed(self, error: StorageError) -> None:
        """A backend call for this operation raised ``error``."""
        self._inflight -= 1
        self._stop(error)

    def _stop(self, error: StorageError) -> bool:
        """Make no more backend calls; the first stop reason wins. Returns whether it skips any."""
        if self._stop_error is None:
            self._stop_error = error
        return self._next < len(self._items)

    def _settle(self, now: float) -> bool:
        """Become terminal if nothing is in flight and nothing is left to do; True if it did.

        When it did, the pipeline must then open the gate (:meth:`_gate_to_open`), once,
        with or without its lock held: until then ``wait`` blocks.
        """
        if self._state.terminal or self._inflight:
            return False
        if self._stop_error is None and self._next < len(self._items):
            return False
        # Everything a reader may look at goes first: the state is published last, so a
        # reader that sees a terminal state without the lock sees the rest too.
        self._latency_s = max(0.0, now - self._submitted_at)
        if self._stop_error is not None:
            self._error = self._stop_error
            cancelled = isinstance(self._stop_error, OperationCancelledError)
            self._state = OpState.CANCELLED if cancelled else OpState.FAILED
        else:
            self._late = self._deadline is not None and now > self._deadline
            self._state = OpState.DONE
        return True

    def _gate_to_open(self) -> threading.Lock:
        """The gate ``wait`` blocks on; the pipeline releases it once, after ``_settle``."""
        return self._gate

    def _skipped(self) -> int:
        """Pages no backend call returned a result for."""
        # By identity: ``count(None)`` would call each result's ``__eq__`` (Python code).
        return sum(map(operator.is_, self._results, itertools.repeat(None)))


GetHandle: TypeAlias = TransferHandle[GetResult]
"""The handle of a get: one :class:`GetResult` per request."""
PutHandle: TypeAlias = TransferHandle[PutResult]
"""The handle of a put: one :class:`PutResult` per request."""
ExistsHandle: TypeAlias = TransferHandle[bool]
"""The handle of an exists: one ``bool`` per key."""
AnyHandle: TypeAlias = GetHandle | PutHandle | ExistsHandle
"""Any handle the pipeline returns (what ``completions()`` reports)."""


@attrs.frozen(kw_only=True)
class CloseReport:
    """What ``close()`` did to the work that was still in the pipeline."""

    cancelled: tuple[AnyHandle, ...] = ()
    """Operations the close cancelled (queued ones, and running ones it stopped)."""
    unfinished: tuple[AnyHandle, ...] = ()
    """Operations still not terminal when close returned (a backend call outlived the timeout)."""
    threads_alive: int = 0
    """Worker threads that had not exited when close returned."""

    @property
    def clean(self) -> bool:
        """Whether every operation is terminal and every worker thread has exited."""
        return not self.unfinished and self.threads_alive == 0


class PendingQueue:
    """Operations waiting for backend calls: one FIFO per :class:`Priority`, with deadlines.

    Owner-only and not thread-safe: the pipeline that owns it calls it with its lock held.
    ``on_leave`` is called for each operation that leaves the queue (dispatched in full,
    stopped or expired), after it has left.
    """

    def __init__(self, on_leave: Callable[[TransferHandle[Any]], None]) -> None:
        self._queues: dict[Priority, deque[TransferHandle[Any]]] = {p: deque() for p in Priority}
        self._members: set[TransferHandle[Any]] = set()
        self._deadlines: list[tuple[float, int, TransferHandle[Any]]] = []
        self._on_leave = on_leave

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, op: object) -> bool:
        return op in self._members

    def depth(self, priority: Priority) -> int:
        """Operations queued at ``priority``."""
        return len(self._queues[priority])

    def ops(self) -> list[TransferHandle[Any]]:
        """Every queued operation, most urgent first, oldest first within a priority."""
        return [op for queue in self._queues.values() for op in queue]

    def push(self, op: TransferHandle[Any]) -> None:
        """Queue ``op`` behind the others of its priority."""
        self._queues[op.priority].append(op)
        self._members.add(op)
        at = op._deadline_at()
        if at is not None:
            heapq.heappush(self._deadlines, (at, op.op_id, op))

    def remove(self, op: TransferHandle[Any]) -> None:
        """Take ``op`` out of the queue (it must be queued)."""
        queue = self._queues[op.priority]
        if queue[0] is op:
            queue.popleft()
        else:
            queue.remove(op)
        self._members.discard(op)
        self._on_leave(op)

    def pop_expired(self, now: float) -> list[TransferHandle[Any]]:
        """Remove and return the queued operations whose deadline is ``now`` or earlier."""
        heap = self._deadlines
        expired = []
        while heap and heap[0][0] <= now:
            op = heapq.heappop(heap)[2]
            if op in self._members:
                self.remove(op)
                expired.append(op)
        if len(heap) > 2 * len(self._members) + 64:
            # Entries of operations that left before their deadline: drop them.
            self._deadlines = [entry for entry in heap if entry[2] in self._members]
            heapq.heapify(self._deadlines)
        return expired

    def take(
        self, batch_pages: int, *, merge: bool
    ) -> tuple[OpKind, tuple[tuple[TransferHandle[Any], int, int], ...]] | None:
        """The pages of the next backend call, as (operation, start, end) ranges; or None.

        Takes from the oldest operation of the most urgent non-empty priority, at most
        ``batch_pages`` pages; with ``merge``, fills the rest of the call from the next
        operations of the same priority while they are of the same kind.
        """
        for queue in self._queues.values():
            segments: list[tuple[TransferHandle[Any], int, int]] = []
            room = batch_pages
            kind: OpKind | None = None
            while queue and room:
                op = queue[0]
                if kind is not None and op.kind is not kind:
                    break
                kind = op.kind
                start, end = op._take(room)
                segments.append((op, start, end))
                room -= end - start
                if not op._remaining():
                    self.remove(op)
                if not merge:
                    break
            if kind is not None:
                return kind, tuple(segments)
        return None
