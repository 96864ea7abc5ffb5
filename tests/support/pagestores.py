"""Small ``PageStore`` implementations for tests of the host<->storage pipeline.

- :class:`DictPageStore` - a real, dict-backed store: copies bytes out of the put buffers
  and into the get buffers, keeps existing keys, reports misses and spec mismatches. It
  logs every call (kind and keys, in the order calls began).
- :class:`GatedPageStore` - test double: every call first waits on an Event, so a test
  holds the workers where it wants them and knows (bounded wait) when a call has begun.
- :class:`FaultyPageStore` - test double: raises scripted exceptions from the next calls,
  reports chosen keys as per-key errors, or breaks the contract by returning too few
  results.
- :class:`FakeClock` - a manually advanced monotonic clock.

Helpers build keys and requests whose payload is derived from the page index, so a read
can be checked byte for byte.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from sglang_storage.core import (
    DataKind,
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    ObjectSpec,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import CorruptObjectError, StorageError

NAMESPACE: Final = Namespace(model="test-model", kind=DataKind.KV)
PAGE_BYTES: Final = 64
WAIT_S: Final = 10.0
"""Upper bound of every wait in these helpers and the tests that use them."""


def key(index: int, prefix: str = "page") -> ObjectKey:
    """The key of page ``index``."""
    return NAMESPACE.key(f"{prefix}{index}")


def payload(index: int, size: int = PAGE_BYTES) -> bytes:
    """The bytes page ``index`` holds."""
    return bytes((index * 7 + j) % 251 for j in range(size))


def put_requests(
    indices: Sequence[int] | range, *, size: int = PAGE_BYTES, prefix: str = "page"
) -> list[PutRequest]:
    """Put requests for ``indices``, each holding :func:`payload`."""
    return [
        PutRequest(
            key=key(i, prefix),
            spec=ObjectSpec.raw(size),
            buffers=[bytearray(payload(i, size))],
        )
        for i in indices
    ]


def get_requests(
    indices: Sequence[int] | range, *, size: int = PAGE_BYTES, prefix: str = "page"
) -> list[GetRequest]:
    """Get requests for ``indices`` into fresh zeroed buffers."""
    return [
        GetRequest(key=key(i, prefix), spec=ObjectSpec.raw(size), buffers=[bytearray(size)])
        for i in indices
    ]


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        with self._lock:
            self._now += seconds


class DictPageStore:
    """A real in-memory PageStore: a dict from key to (spec, bytes), safe across threads."""

    name = "dict"

    def __init__(self) -> None:
        self._objects: dict[ObjectKey, tuple[ObjectSpec, bytes]] = {}
        self._lock = threading.Lock()
        self.calls: list[tuple[str, tuple[ObjectKey, ...]]] = []
        """Every call as (method, keys), in the order the calls began."""

    def _begin(self, method: str, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self.calls.append((method, tuple(keys)))

    def call_sizes(self, method: str | None = None) -> list[int]:
        """The number of keys in each call (of ``method``, or of all)."""
        with self._lock:
            return [len(keys) for name, keys in self.calls if method in (None, name)]

    def called_keys(self) -> set[ObjectKey]:
        """Every key any call was made for."""
        with self._lock:
            return {k for _, keys in self.calls for k in keys}

    def preload(self, requests: Sequence[PutRequest]) -> None:
        """Store ``requests`` directly, without logging a call."""
        with self._lock:
            for r in requests:
                self._objects[r.key] = (r.spec, b"".join(bytes(b) for b in r.buffers))

    def __contains__(self, item: ObjectKey) -> bool:
        with self._lock:
            return item in self._objects

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored."""
        self._begin("exists", keys)
        with self._lock:
            return [k in self._objects for k in keys]

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Copy each stored payload into its request's buffers."""
        self._begin("get_into", [r.key for r in requests])
        results = []
        for r in requests:
            with self._lock:
                found = self._objects.get(r.key)
            if found is None:
                results.append(GetResult.miss_of(r.key))
                continue
            spec, data = found
            if spec != r.spec:
                error = CorruptObjectError(key=str(r.key), reason="spec mismatch")
                results.append(GetResult.corrupt_of(r.key, error))
                continue
            offset = 0
            for buffer in r.buffers:
                buffer[:] = data[offset : offset + buffer.nbytes]
                offset += buffer.nbytes
            results.append(GetResult.hit_of(r))
        return results

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Store each request's buffers; existing keys are kept."""
        self._begin("put_from", [r.key for r in requests])
        results = []
        for r in requests:
            data = b"".join(bytes(b) for b in r.buffers)
            with self._lock:
                if r.key in self._objects:
                    results.append(PutResult.present_of(r.key))
                    continue
                self._objects[r.key] = (r.spec, data)
            results.append(PutResult.stored_of(r))
        return results


class GatedPageStore(DictPageStore):
    """Test double: every call waits for :attr:`gate` before doing its work.

    ``wait_entered(n)`` blocks (bounded) until ``n`` calls have begun, so a test knows a
    worker is inside the store. A call whose gate never opens raises after
    :data:`WAIT_S`, so a broken test fails instead of hanging.
    """

    name = "gated"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self._entered = 0
        self._entered_cond = threading.Condition()

    def _begin(self, method: str, keys: Sequence[ObjectKey]) -> None:
        super()._begin(method, keys)
        with self._entered_cond:
            self._entered += 1
            self._entered_cond.notify_all()
        if not self.gate.wait(WAIT_S):
            raise AssertionError("GatedPageStore: the test never opened the gate")

    @contextmanager
    def released_on_exit(self) -> Iterator[GatedPageStore]:
        """Open the gate when the block ends, however it ends (so workers never stay held)."""
        try:
            yield self
        finally:
            self.gate.set()

    def wait_entered(self, calls: int, timeout_s: float = WAIT_S) -> bool:
        """Wait until at least ``calls`` calls have begun; return whether they did."""
        with self._entered_cond:
            return self._entered_cond.wait_for(lambda: self._entered >= calls, timeout_s)


class FaultyPageStore(GatedPageStore):
    """Test double: injects failures into an otherwise real dict store.

    Its gate starts open (clear it to hold calls, as with :class:`GatedPageStore`).

    - :attr:`raise_next` - what the next calls raise, one entry per call in order
      (``None``: that call succeeds); faults are raised after the gate.
    - :attr:`error_keys` - keys reported as per-key ``ERROR`` results by get and put.
    - :attr:`short_results` - when set, calls return one result fewer than asked for.
    """

    name = "faulty"

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()
        self.raise_next: list[BaseException | None] = []
        self.error_keys: set[ObjectKey] = set()
        self.short_results = False

    def _begin(self, method: str, keys: Sequence[ObjectKey]) -> None:
        super()._begin(method, keys)
        with self._lock:
            fault = self.raise_next.pop(0) if self.raise_next else None
        if fault is not None:
            raise fault

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """As the dict store, with the injected faults."""
        results = super().get_into(requests)
        results = [
            GetResult.error_of(r.key, StorageError(f"injected read error at {r.key}"))
            if r.key in self.error_keys
            else r
            for r in results
        ]
        return results[:-1] if self.short_results else results

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """As the dict store, with the injected faults."""
        results = super().put_from(requests)
        results = [
            PutResult.error_of(r.key, StorageError(f"injected write error at {r.key}"))
            if r.key in self.error_keys
            else r
            for r in results
        ]
        return results[:-1] if self.short_results else results

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """As the dict store, with the injected faults."""
        results = super().exists(keys)
        return results[:-1] if self.short_results else results
