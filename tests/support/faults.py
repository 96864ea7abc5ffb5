"""Fault-injecting test doubles shared by the manager tests.

- :class:`FaultyBackend` - test double around a real backend: held, failing or per-key
  failing calls, corrupt or vanished objects.
- :class:`FaultyIO` - the torch device<->host I/O backend, whose copies fail on demand.
- :class:`PipelineCloser` - tracks the storage pipelines a test module builds and closes
  them after each test (through an autouse fixture it makes).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Literal

import pytest
import torch

from sglang_storage.core import (
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import BackendIOError, CorruptObjectError
from sglang_storage.storage import Backend, BackendStats, Capabilities
from sglang_storage.storage.backend import count_prefix
from sglang_storage.transfer import CopyPlan, StoragePipeline, TorchIOBackend
from support.pagestores import WAIT_S

__all__ = ["FaultyBackend", "FaultyIO", "Op", "PipelineCloser"]

Op = Literal["exists", "get", "put"]
"""A batch call of the page store: ``exists``, ``get_into`` or ``put_from``."""

_ALL_OPS: tuple[Op, ...] = ("exists", "get", "put")


class FaultyBackend:
    """Test double around a real backend (the ``inner`` one), failing on demand.

    Every call goes to ``inner`` unless a knob says otherwise; the knobs are plain
    attributes a test sets while the double is in use. Whole-call failures raise
    :class:`~sglang_storage.errors.BackendIOError`; per-key failures are that key's result.

    Constructor options (what differs between the tests using it):

    - ``name`` - the store's name; default ``"faulty-<inner name>"``.
    - ``gated`` - the calls (:data:`Op`) that wait for :attr:`gate`; default all three.
    - ``key_errors_on`` - the calls :attr:`error_keys` applies to; default get and put.

    Knobs:

    - :attr:`gate` - an Event, set at first; clear it to hold the ``gated`` calls where
      they begin (bounded by :data:`~support.pagestores.WAIT_S`, then the call fails).
    - :attr:`raise_next` - the next this many ``exists``/``get_into``/``put_from`` calls
      raise (after the gate).
    - :attr:`fail_exists`, :attr:`fail_gets`, :attr:`fail_puts`, :attr:`fail_deletes` -
      while set, every such call raises.
    - :attr:`error_keys` - keys (an :class:`~sglang_storage.core.ObjectKey`, or a key's
      name as a string) whose get or put is an ``ERROR`` result; ``inner`` never sees them.
    - :attr:`corrupt` - keys read as ``CORRUPT`` (after ``inner`` read them).
    - :attr:`vanished` - keys read as misses though ``exists`` says they are stored.

    Observations: :attr:`entered` (set once any page-store call has begun) and
    :attr:`started` (page-store calls begun, counted by :data:`Op`).
    """

    def __init__(
        self,
        inner: Backend,
        *,
        name: str | None = None,
        gated: Collection[Op] = _ALL_OPS,
        key_errors_on: Collection[Op] = ("get", "put"),
    ) -> None:
        self.inner = inner
        self._name = f"faulty-{inner.name}" if name is None else name
        self._gated = frozenset(gated)
        self._key_errors_on = frozenset(key_errors_on)
        self._lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.started: Counter[Op] = Counter()
        self.raise_next = 0
        self.fail_exists = False
        self.fail_gets = False
        self.fail_puts = False
        self.fail_deletes = False
        self.error_keys: set[ObjectKey | str] = set()
        self.corrupt: set[ObjectKey] = set()
        self.vanished: set[ObjectKey] = set()

    @property
    def name(self) -> str:
        """The name given, or ``"faulty-<inner name>"``."""
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        """The inner backend's."""
        return self.inner.capabilities

    def _error(self, operation: str, reason: str = "injected") -> BackendIOError:
        return BackendIOError(backend=self._name, operation=operation, reason=reason)

    def _begin(self, op: Op, fail: bool) -> None:
        """Count the call, wait at the gate when ``op`` is gated, raise the injected faults."""
        with self._lock:
            self.started[op] += 1
        self.entered.set()
        if op in self._gated:
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        with self._lock:
            raise_now = self.raise_next > 0
            if raise_now:
                self.raise_next -= 1
        if raise_now or fail:
            raise self._error(op)

    def _key_error(self, op: Op, key: ObjectKey) -> bool:
        return op in self._key_errors_on and (key in self.error_keys or key.name in self.error_keys)

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """The inner backend's answer, after the gate and the injected faults."""
        self._begin("exists", self.fail_exists)
        return self.inner.exists(keys)

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """The inner backend's reads, with the injected faults."""
        self._begin("get", self.fail_gets)
        failing = [self._key_error("get", r.key) for r in requests]
        read = iter(
            self.inner.get_into([r for r, bad in zip(requests, failing, strict=True) if not bad])
        )
        results = []
        for r, bad in zip(requests, failing, strict=True):
            if bad:
                results.append(
                    GetResult.error_of(r.key, self._error("get", f"injected at {r.key}"))
                )
            elif r.key in self.corrupt:
                next(read)
                error = CorruptObjectError(key=str(r.key), reason="injected")
                results.append(GetResult.corrupt_of(r.key, error))
            elif r.key in self.vanished:
                next(read)
                results.append(GetResult.miss_of(r.key))
            else:
                results.append(next(read))
        return results

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """The inner backend's writes, with the injected faults."""
        self._begin("put", self.fail_puts)
        good = [r for r in requests if not self._key_error("put", r.key)]
        by_key = {result.key: result for result in self.inner.put_from(good)}
        return [
            by_key.get(r.key)
            or PutResult.error_of(r.key, self._error("put", f"injected at {r.key}"))
            for r in requests
        ]

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """Leading stored keys, as :meth:`exists` (faults included) reports them."""
        return count_prefix(self.exists(keys))

    def delete(self, keys: Sequence[ObjectKey]) -> None:
        """The inner backend's delete, unless :attr:`fail_deletes` is set."""
        if self.fail_deletes:
            raise self._error("delete")
        self.inner.delete(keys)

    def clear(self, namespace: Namespace) -> None:
        """The inner backend's."""
        self.inner.clear(namespace)

    def stats(self) -> BackendStats:
        """The inner backend's."""
        return self.inner.stats()

    def close(self) -> None:
        """Close the inner backend."""
        self.inner.close()


class FaultyIO(TorchIOBackend):
    """The torch I/O backend whose copies fail while ``fail`` is set."""

    fail = False

    def plan(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> CopyPlan:
        if self.fail:
            raise RuntimeError("injected copy failure")
        return super().plan(host_pages, device_pages)


class PipelineCloser:
    """The storage pipelines a test module built, closed after each test.

    A module keeps one (``PIPELINES = PipelineCloser()``), registers each pipeline it
    builds with :meth:`track`, and binds :meth:`autouse_fixture` to a module name so that
    pytest finds it (fixtures defined here are not discovered otherwise). A fixture that
    owns a backend calls :meth:`close_all` before closing it, so no worker still calls it.
    """

    def __init__(self) -> None:
        self._open: list[StoragePipeline] = []

    def track(self, pipeline: StoragePipeline) -> StoragePipeline:
        """Close ``pipeline`` with the others; return it."""
        self._open.append(pipeline)
        return pipeline

    def close_all(self) -> None:
        """Stop every tracked pipeline without draining, newest first."""
        while self._open:
            self._open.pop().close(drain=False, timeout_s=5.0)

    def autouse_fixture(self) -> Callable[[], Iterator[None]]:
        """An autouse fixture that calls :meth:`close_all` after each test."""

        def close_pipelines() -> Iterator[None]:
            """Stop every pipeline a test built, so no worker thread outlives its test."""
            yield
            self.close_all()

        return pytest.fixture(autouse=True)(close_pipelines)


if TYPE_CHECKING:

    def _is_a_backend(double: FaultyBackend) -> Backend:
        return double  # mypy checks FaultyBackend against the Backend protocol here
