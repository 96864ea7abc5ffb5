"""The host<->storage pipeline: batched gets, puts and exists on a :class:`PageStore`.

A :class:`StoragePipeline` owns a small pool of worker threads, one bounded queue per
:class:`Priority`, and every operation submitted to it. Contract, one line per primitive:

- ``submit_get`` / ``submit_put`` / ``submit_exists`` - queue an operation over a batch of
  pages and return its :class:`TransferHandle` at once. Never waits on storage I/O; when the
  priority's queue is full it raises :class:`CapacityError` (``backpressure=REJECT``) or
  waits at most ``submit_timeout_s`` for room and then raises
  :class:`OperationTimeoutError` (``WAIT``).
- ``completions(timeout_s)`` - the handles that became terminal since the last call, in the
  order they finished, each reported once (the owner drains its own list; callers never
  touch a queue), whether or not anyone queried or waited on them.
- ``metrics()`` - a frozen :class:`PipelineMetrics` snapshot.
- ``close(drain, timeout_s)`` - stop accepting work, drain or cancel what is queued, join the
  workers within ``timeout_s``, and return a :class:`CloseReport`. Also a context manager.

Scheduling: workers take the oldest operation of the most urgent non-empty priority and
make one backend call of at most ``batch_pages`` pages; a larger operation is split into
several calls (possibly on several workers at once), and with ``merge_ops`` the rest of a
call is filled with the next queued operations of the same kind and priority. Each call
is a separate chance for more urgent work to go first.

Deadlines: an operation's ``deadline_s`` bounds when its backend calls may *start*,
counted from submission. An operation none of whose calls started in time fails with
:class:`OperationTimeoutError` and the backend is never called for it; one stopped between
calls fails the same way, keeping the results of the calls that ran (``partial()``). A call
in flight is never abandoned (it writes into the caller's buffers), so an operation whose
last call started in time but finished after the deadline ends ``DONE`` with its results
and ``late=True``, and is counted as late in the metrics. A queued operation is failed at
its deadline as soon as a worker looks for work, the owner submits, or the owner calls
``completions()``; no timer thread polls for it.

Completion (the same model as the device<->host pipeline's ``poll()``): only the owner's
``completions()`` hands finished work over; the handle only observes (``state``,
``done()``, ``wait()``, ``result()``, ``partial()`` change neither the operation nor what
``completions()`` reports).

Failures: a backend call that raises :class:`StorageError` fails every operation in that
call with that error; any other exception fails them with a :class:`StorageError` that
wraps it (and is logged with its traceback); the worker then serves the next call. A
per-page failure the backend reports as a result (``GetOutcome.ERROR``...) is that page's
result and the operation still ends ``DONE``. A failed operation's error is on its own
handle (``error``; ``result()`` raises it); ``completions()``, ``close()`` and later
submissions never raise it.

Locking: one lock guards all queues, handles and metrics; the pipeline's methods take it
for bookkeeping only and never hold it during a backend call. Threads that wait (an idle
worker, a ``wait()`` on a handle, a waiting ``completions()``) each block on a lock of
their own that the thread waking them releases, after leaving the shared lock where it
can, so a woken thread does not at once block again on the lock its waker still holds.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Final, TypeAlias, TypeVar, cast

import attrs

from sglang_storage.config import (
    instance_of,
    int_in_range,
    non_negative_number,
    optional,
    positive_int,
    positive_number,
)
from sglang_storage.core import Clock, GetRequest, GetResult, ObjectKey, PutRequest, PutResult
from sglang_storage.errors import (
    CapacityError,
    ConfigError,
    OperationCancelledError,
    OperationTimeoutError,
    StateError,
    StorageError,
)
from sglang_storage.transfer.handles import (
    AnyHandle,
    CloseReport,
    ExistsHandle,
    GetHandle,
    OpKind,
    PendingQueue,
    Priority,
    PutHandle,
    TransferHandle,
)
from sglang_storage.transfer.metrics import KindRecorder, PipelineMetrics
from sglang_storage.transfer.store import PageStore

__all__ = ["THREAD_NAME_PREFIX", "BackpressureMode", "StoragePipeline", "StoragePipelineConfig"]

_LOG = logging.getLogger(__name__)
THREAD_NAME_PREFIX: Final = "sglang-storage-pipeline"
_PIPELINE_IDS = itertools.count()

R = TypeVar("R")


class BackpressureMode(enum.Enum):
    """What a submission does when its priority's queue is full."""

    REJECT = "reject"
    """Raise :class:`CapacityError` at once."""
    WAIT = "wait"
    """Wait up to ``submit_timeout_s`` for room, then raise :class:`OperationTimeoutError`."""


@attrs.frozen(kw_only=True)
class StoragePipelineConfig:
    """How a :class:`StoragePipeline` runs; validated on construction (:class:`ConfigError`)."""

    workers: int = attrs.field(default=2, validator=int_in_range(1, 64))
    """Worker threads making backend calls."""
    queue_depth: int = attrs.field(default=1024, validator=positive_int)
    """Operations that may wait in each priority's queue."""
    batch_pages: int = attrs.field(default=128, validator=positive_int)
    """Most pages in one backend call (SGLang's ``STORAGE_BATCH_SIZE`` is 128)."""
    merge_ops: bool = attrs.field(default=True, validator=instance_of(bool))
    """Fill a backend call with queued operations of the same kind and priority."""
    backpressure: BackpressureMode = attrs.field(
        default=BackpressureMode.REJECT, validator=instance_of(BackpressureMode)
    )
    """What a submission to a full queue does."""
    submit_timeout_s: float = attrs.field(default=1.0, validator=positive_number)
    """With ``backpressure=WAIT``: how long a submission waits for room."""
    default_deadline_s: float | None = attrs.field(
        default=None, validator=optional(positive_number)
    )
    """Deadline of operations submitted without one (``None``: no deadline)."""
    close_timeout_s: float = attrs.field(default=30.0, validator=non_negative_number)
    """How long ``close()`` (and leaving a ``with`` block) waits by default."""
    track_completions: bool = attrs.field(default=True, validator=instance_of(bool))
    """Keep finished handles for ``completions()``; turn off when only ``result()`` is used."""


_NBYTES: Final = operator.attrgetter("nbytes")


class StoragePipeline:
    """Moves pages between host buffers and a :class:`PageStore` on a small worker pool.

    Args:
        store: The backend; called from the worker threads only.
        config: How to run (default: :class:`StoragePipelineConfig` defaults).
        clock: Monotonic seconds for deadlines and latencies (injectable for tests).

    See the module docstring for the contract. The worker threads start here and stop in
    :meth:`close`.
    """

    def __init__(
        self,
        store: PageStore,
        config: StoragePipelineConfig | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self._config = config if config is not None else StoragePipelineConfig()
        if not isinstance(self._config, StoragePipelineConfig):
            raise ConfigError(owner="StoragePipeline", field="config", reason="wrong type")
        self._store = store
        self._store_name = store.name
        self._clock = clock
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._space = {p: threading.Condition(self._lock) for p in Priority}
        self._room_waiters = 0  # submissions waiting on ``_space``
        # Wake-up locks (held while on the list) of idle workers and waiting completions().
        self._idle_workers: list[threading.Lock] = []
        self._completion_waiters: list[threading.Lock] = []
        self._pending = PendingQueue(on_leave=self._left_queue_locked)
        self._live: dict[int, AnyHandle] = {}
        self._finished: list[AnyHandle] = []
        self._recorders = {kind: KindRecorder(kind) for kind in OpKind}
        self._ids = itertools.count()
        self._closing = False
        self._workers_alive = self._config.workers
        pipeline_id = next(_PIPELINE_IDS)
        self._threads = [
            threading.Thread(
                target=self._worker,
                args=(_held_lock(),),
                name=f"{THREAD_NAME_PREFIX}-{pipeline_id}-{i}",
                daemon=True,
            )
            for i in range(self._config.workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def config(self) -> StoragePipelineConfig:
        """The configuration the pipeline runs with."""
        return self._config

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (no more submissions are accepted)."""
        return self._closing

    # ---------------------------------------------------------------- submissions

    def submit_get(
        self,
        requests: Sequence[GetRequest],
        *,
        priority: Priority = Priority.NORMAL,
        deadline_s: float | None = None,
    ) -> GetHandle:
        """Queue reading each request's object into its buffers.

        Args:
            requests: The pages to read; leave their buffers alone until the handle is done.
            priority: The scheduling class.
            deadline_s: Seconds from now by which each backend call must start
                (default: the config's ``default_deadline_s``).

        Raises:
            CapacityError: The queue is full and back-pressure is ``REJECT``.
            OperationTimeoutError: The queue stayed full for ``submit_timeout_s`` (``WAIT``).
            StateError: The pipeline is closed.
            ConfigError: An argument is invalid.
        """
        items = _checked(requests, GetRequest, "submit_get", "requests")

        def placeholder(index: int, cause: StorageError) -> GetResult:
            return GetResult.error_of(items[index].key, cause)

        size = lambda: sum(r.nbytes for r in items)  # noqa: E731 - read lazily: per page
        return self._submit(OpKind.GET, items, size, priority, deadline_s, placeholder)

    def submit_put(
        self,
        requests: Sequence[PutRequest],
        *,
        priority: Priority = Priority.NORMAL,
        deadline_s: float | None = None,
    ) -> PutHandle:
        """Queue storing each request's buffers under its key (existing keys are kept).

        Arguments and errors as for :meth:`submit_get`; the buffers must stay unchanged
        until the handle is done.
        """
        items = _checked(requests, PutRequest, "submit_put", "requests")

        def placeholder(index: int, cause: StorageError) -> PutResult:
            return PutResult.error_of(items[index].key, cause)

        size = lambda: sum(r.nbytes for r in items)  # noqa: E731 - read lazily: per page
        return self._submit(OpKind.PUT, items, size, priority, deadline_s, placeholder)

    def submit_exists(
        self,
        keys: Sequence[ObjectKey],
        *,
        priority: Priority = Priority.NORMAL,
        deadline_s: float | None = None,
    ) -> ExistsHandle:
        """Queue asking whether each key is stored (a hint; keys never checked read ``False``).

        Arguments and errors as for :meth:`submit_get`.
        """
        items = _checked(keys, ObjectKey, "submit_exists", "keys")
        return self._submit(OpKind.EXISTS, items, 0, priority, deadline_s, _absent)

    # ---------------------------------------------------------------- owner API

    def completions(self, timeout_s: float | None = 0.0) -> list[AnyHandle]:
        """Handles that became terminal since the last call, in the order they finished.

        Args:
            timeout_s: With nothing finished, wait this long for a completion (``0``: do
                not wait; ``None``: until one arrives or the pipeline is closed and idle).

        Raises:
            StateError: The pipeline was configured with ``track_completions=False``.
        """
        if not self._config.track_completions:
            raise StateError(
                subject="StoragePipeline.completions",
                reason="the pipeline was configured with track_completions=False",
            )
        with self._lock:
            self._expire_due_locked(self._clock())
            if not self._finished and (timeout_s is None or timeout_s > 0):
                self._wait_for_completion_locked(timeout_s)
            finished, self._finished = self._finished, []
        return finished

    def _wait_for_completion_locked(self, timeout_s: float | None) -> None:
        """Until something finished, or the pipeline is closed and idle, or ``timeout_s``."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._finished and not (self._closing and not self._live):
            left = -1.0
            if end is not None:
                left = min(end - time.monotonic(), threading.TIMEOUT_MAX)
                if left <= 0:
                    return
            waiter = _held_lock()
            self._completion_waiters.append(waiter)
            self._lock.release()
            try:
                waiter.acquire(True, left)
            finally:
                self._lock.acquire()
                if waiter in self._completion_waiters:  # not woken: timed out or interrupted
                    self._completion_waiters.remove(waiter)

    def metrics(self) -> PipelineMetrics:
        """A snapshot of the pipeline's metrics."""
        with self._lock:
            return PipelineMetrics(
                store=self._store_name,
                workers=self._config.workers,
                in_flight=len(self._live),
                queued={p: self._pending.depth(p) for p in Priority},
                get=self._recorders[OpKind.GET].snapshot(),
                put=self._recorders[OpKind.PUT].snapshot(),
                exists=self._recorders[OpKind.EXISTS].snapshot(),
            )

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> CloseReport:
        """Stop accepting work and stop the workers, waiting at most ``timeout_s`` in all.

        Args:
            drain: Let queued operations run (those still queued at the timeout are
                cancelled); ``False`` cancels every queued operation at once. Backend
                calls in flight always complete (they use the caller's buffers).
            timeout_s: The bound on the whole close (default: ``close_timeout_s``).

        Returns:
            What was cancelled, what is still unfinished and how many workers are still
            alive (stuck in a backend call). Calling again joins the workers again and
            reports the state then.
        """
        timeout = self._config.close_timeout_s if timeout_s is None else timeout_s
        if not _is_seconds(timeout, allow_zero=True):
            raise ConfigError(
                owner="StoragePipeline.close",
                field="timeout_s",
                value=timeout_s,
                reason="must be >= 0",
            )
        end = time.monotonic() + timeout
        cancelled: list[AnyHandle] = []
        with self._lock:
            first = not self._closing
            self._closing = True
            for condition in self._space.values():
                condition.notify_all()
            if first and not drain:
                cancelled += self._cancel_queued_locked("the pipeline was closed without draining")
            self._wake_idle_workers_locked()
            if first and drain:
                self._idle.wait_for(lambda: not self._pending, max(0.0, end - time.monotonic()))
                if self._pending:
                    reason = f"the pipeline's close did not drain within {timeout:g} s"
                    cancelled += self._cancel_queued_locked(reason)
                    self._wake_idle_workers_locked()
            _open_all(self._completion_waiters)
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        with self._lock:
            unfinished = tuple(self._live.values())
        return CloseReport(
            cancelled=tuple(cancelled),
            unfinished=unfinished,
            threads_alive=sum(thread.is_alive() for thread in self._threads),
        )

    def __enter__(self) -> StoragePipeline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(drain=exc_type is None)

    def __repr__(self) -> str:
        state = "closed" if self._closing else "open"
        return f"<StoragePipeline on {self._store_name!r}, {self._config.workers} workers, {state}>"

    # ---------------------------------------------------------------- bookkeeping

    def _submit(
        self,
        kind: OpKind,
        items: tuple[object, ...],
        nbytes: int | Callable[[], int],
        priority: Priority,
        deadline_s: float | None,
        placeholder: Callable[[int, StorageError], R],
    ) -> TransferHandle[R]:
        if not isinstance(priority, Priority):
            raise ConfigError(
                owner=_submit_method(kind),
                field="priority",
                value=priority,
                reason="must be a Priority",
            )
        deadline = self._config.default_deadline_s if deadline_s is None else deadline_s
        if deadline is not None and not _is_seconds(deadline, allow_zero=False):
            raise ConfigError(
                owner=_submit_method(kind), field="deadline_s", value=deadline, reason="must be > 0"
            )
        now = self._clock()
        with self._lock:
            if self._closing or not self._workers_alive:
                reason = "the pipeline is closed" if self._closing else "no worker thread is left"
                raise StateError(subject=_submit_method(kind), reason=reason)
            self._expire_due_locked(now)
            if items and self._pending.depth(priority) >= self._config.queue_depth:
                self._wait_for_room_locked(kind, priority, len(items))
            handle: TransferHandle[R] = TransferHandle(
                op_id=next(self._ids),
                kind=kind,
                priority=priority,
                items=items,
                nbytes=nbytes,
                submitted_at=now,
                deadline_s=deadline,
                store_name=self._store_name,
                placeholder=placeholder,
                canceller=self._cancel,
            )
            op = cast(AnyHandle, handle)
            recorder = self._recorders[kind]
            recorder.submitted(len(items))
            self._live[op.op_id] = op
            if not items:
                self._settle_locked(op, now)
                return handle
            self._pending.push(op)
            recorder.enqueued()
            # Woken once out of the lock: it would otherwise wake to block on it at once.
            worker = self._idle_workers.pop() if self._idle_workers else None
        if worker is not None:
            worker.release()
        return handle

    def _wait_for_room_locked(self, kind: OpKind, priority: Priority, pages: int) -> None:
        depth = self._config.queue_depth
        resource = f"storage pipeline {priority.name} queue (queue_depth={depth})"
        if self._config.backpressure is BackpressureMode.REJECT:
            self._recorders[kind].rejected()
            raise CapacityError(
                resource=resource,
                requested=1,
                available=0,
                unit="operations",
                hint="raise StoragePipelineConfig.queue_depth or use backpressure='wait'",
            )
        timeout = self._config.submit_timeout_s
        self._room_waiters += 1
        try:
            room = self._space[priority].wait_for(
                lambda: self._closing or self._pending.depth(priority) < depth, timeout
            )
        finally:
            self._room_waiters -= 1
        if self._closing:
            raise StateError(
                subject=_submit_method(kind), reason="the pipeline was closed while waiting"
            )
        if not room:
            self._recorders[kind].rejected()
            unit = "keys" if kind is OpKind.EXISTS else "pages"
            description = f"{kind.value} of {pages} {unit} on {self._store_name!r}"
            raise OperationTimeoutError(
                operation=f"submitting {description}: the {resource} stayed full",
                timeout_s=timeout,
            )

    def _cancel(self, handle: TransferHandle[Any]) -> bool:
        with self._lock:
            if handle not in self._pending:
                return False
            self._stop_locked(
                handle,
                OperationCancelledError(
                    operation=handle._description, reason="requested by the caller"
                ),
            )
            return True

    def _cancel_queued_locked(self, reason: str) -> list[AnyHandle]:
        cancelled = cast(list[AnyHandle], self._pending.ops())
        for op in cancelled:
            self._stop_locked(op, OperationCancelledError(operation=op._description, reason=reason))
        return cancelled

    def _stop_locked(
        self,
        op: TransferHandle[Any],
        error: StorageError,
        wakes: list[threading.Lock] | None = None,
    ) -> None:
        """Dispatch nothing more of ``op``: it ends with ``error`` once its calls return."""
        if op in self._pending:
            self._pending.remove(op)
        op._stop(error)
        self._settle_locked(op, self._clock(), wakes)

    def _left_queue_locked(self, op: TransferHandle[Any]) -> None:
        self._recorders[op.kind].dequeued()
        if self._room_waiters:
            self._space[op.priority].notify()
        if self._closing and not self._pending:
            self._idle.notify_all()  # only close() waits on it

    def _expire_due_locked(self, now: float) -> None:
        for op in self._pending.pop_expired(now):
            late = "a backend call did not start in time"
            error = OperationTimeoutError(
                operation=f"{op._description} ({late})", timeout_s=op.deadline_s or 0.0
            )
            op._stop(error)
            self._settle_locked(op, now)

    def _settle_locked(
        self, op: TransferHandle[Any], now: float, wakes: list[threading.Lock] | None = None
    ) -> None:
        """Make ``op`` terminal if nothing of it is in flight or left to do.

        Its waiters (and those of ``completions()``) are woken at once, or, given ``wakes``,
        their locks are added there for the caller to release once out of the lock.
        """
        if not op._settle(now):
            return
        del self._live[op.op_id]
        self._recorders[op.kind].finished(op, op._skipped())
        if self._config.track_completions:
            self._finished.append(cast(AnyHandle, op))
        if wakes is None:
            op._gate_to_open().release()
            _open_all(self._completion_waiters)
        else:
            wakes.append(op._gate_to_open())
            wakes += self._completion_waiters
            self._completion_waiters.clear()

    def _wake_idle_workers_locked(self) -> None:
        _open_all(self._idle_workers)

    # ---------------------------------------------------------------- workers

    def _worker(self, wake: threading.Lock) -> None:
        """Run backend calls until closed; ``wake`` (held) is what this worker idles on."""
        wakes: list[threading.Lock] = []  # released once out of the lock
        finished: _Finished | None = None
        try:
            while True:
                with self._lock:
                    if finished is not None:
                        self._complete_locked(*finished, wakes)
                        finished = None
                    batch = self._next_batch_locked()
                    if batch is None:
                        if self._closing and not self._pending:
                            return
                        self._idle_workers.append(wake)
                _open_all(wakes)
                if batch is None:
                    wake.acquire()  # released by a submission, another worker or close()
                else:
                    finished = self._run(*batch, wakes)
        finally:
            with self._lock:
                self._workers_alive -= 1
                if not self._workers_alive:
                    # Only after a BaseException killed the last worker: nobody would run these.
                    for op in self._pending.ops():
                        self._stop_locked(
                            op, StorageError(f"{op._description}: no worker thread is left")
                        )
            _open_all(wakes)

    def _next_batch_locked(self) -> tuple[OpKind, tuple[_Segment, ...]] | None:
        self._expire_due_locked(self._clock())
        batch = self._pending.take(self._config.batch_pages, merge=self._config.merge_ops)
        if batch is not None and self._pending and self._idle_workers:
            self._idle_workers.pop().release()  # more work: wake another worker
        return batch

    def _run(
        self, kind: OpKind, segments: tuple[_Segment, ...], wakes: list[threading.Lock]
    ) -> _Finished:
        """Make the backend call of one batch; what it returned, for ``_complete_locked``."""
        if len(segments) == 1:
            op, start, end = segments[0]
            items = list(op._items_between(start, end))
        else:
            items = []
            for op, start, end in segments:
                items.extend(op._items_between(start, end))
        results: Sequence[object] = ()
        error: StorageError | None = None
        started = self._clock()
        try:
            results = self._invoke(kind, items)
            if len(results) != len(items):
                error = StorageError(
                    f"{self._call_name(kind, items)} returned {len(results)} results "
                    "(the PageStore contract is one per input)"
                )
        except StorageError as exc:
            error = exc
            _LOG.warning("%s failed: %s", self._call_name(kind, items), exc)
        except Exception as exc:  # noqa: BLE001 - any backend bug fails the ops, not the worker
            what = self._call_name(kind, items)
            error = StorageError(f"{what} raised {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            _LOG.error("%s raised an unexpected exception", what, exc_info=exc)
        except BaseException as exc:
            what = self._call_name(kind, items)
            interrupted = StorageError(f"{what} was interrupted by {type(exc).__name__}")
            now = self._clock()
            with self._lock:
                self._complete_locked(kind, segments, (), interrupted, started, now, wakes)
            raise
        return kind, segments, results, error, started, self._clock()

    def _call_name(self, kind: OpKind, items: Sequence[object]) -> str:
        return f"{self._store_name!r}.{_METHODS[kind]} of {len(items)} pages"

    def _invoke(self, kind: OpKind, items: list[object]) -> Sequence[object]:
        if kind is OpKind.GET:
            return self._store.get_into(cast("list[GetRequest]", items))
        if kind is OpKind.PUT:
            return self._store.put_from(cast("list[PutRequest]", items))
        return self._store.exists(cast("list[ObjectKey]", items))

    def _complete_locked(
        self,
        kind: OpKind,
        segments: tuple[_Segment, ...],
        results: Sequence[object],
        error: StorageError | None,
        started: float,
        now: float,
        wakes: list[threading.Lock],
    ) -> None:
        delivered = results if error is None else ()
        self._recorders[kind].call(now - started, delivered, failed=error is not None)
        position = 0
        for op, start, end in segments:
            if error is None:
                part = results[position : position + end - start]
                moved = sum(map(_NBYTES, part)) if kind is not OpKind.EXISTS else 0
                op._record(start, part, moved)
                self._settle_locked(op, now, wakes)
            else:
                op._call_failed(error)
                self._stop_locked(op, error, wakes)
            position += end - start


_Segment: TypeAlias = tuple[TransferHandle[Any], int, int]
_Finished: TypeAlias = tuple[
    OpKind, tuple[_Segment, ...], Sequence[object], StorageError | None, float, float
]
"""A finished backend call: kind, segments, results, error, start and end clock readings."""
_METHODS: Final = {OpKind.GET: "get_into", OpKind.PUT: "put_from", OpKind.EXISTS: "exists"}


def _checked(items: Sequence[Any], kind: type[R], method: str, field: str) -> tuple[R, ...]:
    values = tuple(items)
    if all(map(isinstance, values, itertools.repeat(kind))):
        return values
    for index, value in enumerate(values):
        if not isinstance(value, kind):
            raise ConfigError(
                owner=f"StoragePipeline.{method}",
                field=f"{field}[{index}]",
                value=type(value).__name__,
                reason=f"must be a {kind.__name__}",
            )
    return values  # pragma: no cover - the fast check above found a mismatch


def _submit_method(kind: OpKind) -> str:
    return f"StoragePipeline.submit_{kind.value}"


def _held_lock() -> threading.Lock:
    """A new lock, already held: a one-shot wake-up for whoever blocks on it."""
    lock = threading.Lock()
    lock.acquire()
    return lock


def _open_all(locks: list[threading.Lock]) -> None:
    """Release every lock of ``locks`` (each held, each released once) and empty the list."""
    for lock in locks:
        lock.release()
    locks.clear()


def _absent(index: int, cause: StorageError) -> bool:
    return False


def _is_seconds(value: object, *, allow_zero: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return value >= 0 if allow_zero else value > 0
