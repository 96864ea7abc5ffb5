"""The encoder embedding cache: encoder outputs by multimodal content hash, host and storage.

Replaces SGLang's ``EmbeddingCacheController`` (map section 5.1: its own pinned pools, range
allocator, LRU, busy-polling I/O thread and queues) with a composition: an
:class:`~sglang_storage.memory.EmbeddingPool` (host tier), an eviction policy, and a
:class:`~sglang_storage.transfer.StoragePipeline` over any backend. Contract, one line each:

- :func:`content_hash` - the key of multimodal content: SHA-256 over bytes and tensors
  (dtype, shape and bytes), the same in every process (never Python's ``hash()``).
- ``insert(key, rows)`` - copy encoder output rows (any device) into the host pool, evicting
  unpinned entries to make room, and queue a storage put (owner rank only).
- ``prefetch(keys, num_rows)`` - per key: READY (on host), LOADING (a storage get is queued;
  an :class:`EmbeddingFetched` follows from ``poll``) or ABSENT (no storage, or no room).
- ``state(key)`` / ``load(key, out)`` - where a key is; copy READY rows into ``out`` (H2D).
- ``poll(timeout_s)`` - finished storage work as :class:`EmbeddingStored` /
  :class:`EmbeddingFetched` values; on CUDA also releases rows whose loads have landed.

Not thread-safe: one owner thread (the encoder's scheduler loop) calls every method. The
manager owns the pipeline it is given (``poll`` drains its completions) but not its threads'
life: whoever built the pipeline closes it.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

import attrs
import torch

from sglang_storage.config import instance_of, int_in_range, optional
from sglang_storage.core import (
    DataKind,
    EvictionPolicy,
    GetOutcome,
    GetRequest,
    GetResult,
    Namespace,
    PutOutcome,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import CapacityError, ConfigError, StateError, StorageError
from sglang_storage.memory import EmbeddingPool, dtype_name, tensor_bytes, tensor_spec
from sglang_storage.transfer import AnyHandle, Priority, StoragePipeline

__all__ = [
    "EmbeddingCacheConfig",
    "EmbeddingCacheManager",
    "EmbeddingEvent",
    "EmbeddingFetched",
    "EmbeddingState",
    "EmbeddingStored",
    "content_hash",
]


def content_hash(*parts: bytes | torch.Tensor) -> str:
    """The 64-hex-digit SHA-256 of ``parts``: raw bytes, or tensors as dtype, shape and bytes.

    Stable across processes and hosts, so every rank and every restart names the same
    multimodal content the same way (SGLang's ``combine_hashes`` uses ``hash()``, which is not).
    """
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            header = f"tensor:{dtype_name(part.dtype)}:{tuple(part.shape)};"
            digest.update(header.encode())
            digest.update(tensor_bytes(part.detach().to("cpu").contiguous()))
        else:
            digest.update(f"bytes:{len(part)};".encode())
            digest.update(part)
    return digest.hexdigest()


class EmbeddingState(enum.Enum):
    """Where a key's rows are."""

    ABSENT = "absent"
    LOADING = "loading"
    """A storage get is in flight; the rows are not readable yet."""
    READY = "ready"
    """On host; ``load`` copies them."""


@attrs.frozen(kw_only=True)
class EmbeddingStored:
    """A storage put of ``key`` finished; ``error`` is set unless ``outcome`` is ok."""

    key: str
    outcome: PutOutcome
    error: StorageError | None = None


@attrs.frozen(kw_only=True)
class EmbeddingFetched:
    """A prefetch of ``key`` finished: READY on a hit, gone from the host otherwise."""

    key: str
    outcome: GetOutcome
    error: StorageError | None = None


EmbeddingEvent = EmbeddingStored | EmbeddingFetched
"""What ``poll`` returns."""


@attrs.frozen(kw_only=True)
class EmbeddingCacheConfig:
    """How an embedding cache runs."""

    model: str = attrs.field(validator=instance_of(str))
    """The model fingerprint naming the storage namespace (``storage.keys.model_fingerprint``)."""
    rank: int = attrs.field(default=0, validator=int_in_range(0))
    """This process's encoder TP rank."""
    owner_rank: int | None = attrs.field(default=None, validator=optional(int_in_range(0)))
    """The only rank that writes to storage (others read); ``None``: every rank writes."""
    put_priority: Priority = attrs.field(
        default=Priority.BACKGROUND, validator=instance_of(Priority)
    )
    get_priority: Priority = attrs.field(default=Priority.URGENT, validator=instance_of(Priority))

    @property
    def namespace(self) -> Namespace:
        """Where the embeddings are stored."""
        return Namespace(model=self.model, kind=DataKind.EMBEDDING)

    @property
    def writes_storage(self) -> bool:
        """Whether this rank puts to storage."""
        return self.owner_rank is None or self.owner_rank == self.rank

    def __attrs_post_init__(self) -> None:
        try:
            Namespace(model=self.model, kind=DataKind.EMBEDDING)
        except ConfigError as error:
            raise error.renamed(owner="EmbeddingCacheConfig", field="model") from None


class EmbeddingCacheManager:
    """Encoder outputs cached on host, backed by storage, evicted by a policy.

    Args:
        config: Namespace, rank and priorities.
        pool: The host tier.
        eviction: Chooses host victims; weights are pages. Owned by the manager from now on.
        storage: The pipeline to the backend; ``None`` for a host-only cache.
    """

    def __init__(
        self,
        config: EmbeddingCacheConfig,
        pool: EmbeddingPool,
        eviction: EvictionPolicy[str],
        storage: StoragePipeline | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._eviction = eviction
        self._storage = storage
        self._namespace = config.namespace
        self._ops: dict[int, tuple[str, ...]] = {}  # op id -> keys, pinned until it finishes
        self._loading: set[str] = set()
        self._loads: list[tuple[torch.cuda.Event, str]] = []
        self._early: list[EmbeddingEvent] = []  # submissions refused: reported by poll

    @property
    def config(self) -> EmbeddingCacheConfig:
        """The cache's configuration."""
        return self._config

    def state(self, key: str) -> EmbeddingState:
        """Where ``key``'s rows are."""
        if key in self._loading:
            return EmbeddingState.LOADING
        return EmbeddingState.READY if key in self._pool else EmbeddingState.ABSENT

    def insert(self, key: str, rows: torch.Tensor) -> None:
        """Cache ``rows`` ``(n, dim)`` (any device) as ``key`` and queue its storage put.

        A key already cached is only marked used. Raises :class:`CapacityError` when pinned
        entries leave no room (nothing is stored), and the pool's errors for bad rows.
        """
        object_key = self._namespace.key(key)  # checks the name before any work
        if key in self._pool:
            self._touch(key)
            return
        self._make_room(rows.shape[0] if rows.dim() == 2 else 1)
        entry = self._pool.put(key, rows)
        self._eviction.insert(key, sum(run.length for run in entry.runs))
        if self._storage is None or not self._config.writes_storage:
            return
        spec = tensor_spec(self._pool.config.dtype, (entry.num_rows, self._pool.config.dim))
        buffers = [tensor_bytes(s) for s in self._pool.segments(key)]
        self._pin(key)
        try:
            handle = self._storage.submit_put(
                [PutRequest(key=object_key, spec=spec, buffers=buffers)],
                priority=self._config.put_priority,
            )
        except StorageError as error:  # a full queue or a closed pipeline: report, keep the rows
            self._unpin(key)
            self._early.append(EmbeddingStored(key=key, outcome=PutOutcome.ERROR, error=error))
            return
        self._ops[handle.op_id] = (key,)

    def prefetch(self, keys: Sequence[str], num_rows: Sequence[int]) -> list[EmbeddingState]:
        """Start reading the host misses among ``keys`` (of ``num_rows`` rows each) from storage."""
        object_keys = [self._namespace.key(key) for key in keys]  # all checked before any work
        if len(keys) != len(num_rows) or any(type(n) is not int or n < 1 for n in num_rows):
            raise ConfigError(
                owner="EmbeddingCacheManager.prefetch",
                field="num_rows",
                value=list(num_rows)[:8],
                reason=f"must give one row count >= 1 per key ({len(keys)} keys)",
            )
        states: list[EmbeddingState] = []
        requests: list[GetRequest] = []
        c = self._pool.config
        for key, object_key, rows in zip(keys, object_keys, num_rows, strict=True):
            state = self.state(key)
            if state is EmbeddingState.READY:
                self._touch(key)
            elif state is EmbeddingState.ABSENT and self._storage is not None:
                try:
                    self._make_room(rows)
                    # No reserve-without-copy in EmbeddingPool: a broadcast zero row costs a
                    # memset, not an allocation. The rows stay LOADING until the get lands.
                    entry = self._pool.put(
                        key, torch.zeros((1, c.dim), dtype=c.dtype).expand(rows, -1)
                    )
                except CapacityError:
                    states.append(EmbeddingState.ABSENT)  # no room: a miss, not a failure
                    continue
                self._eviction.insert(key, sum(run.length for run in entry.runs))
                self._pin(key)  # before the next key's _make_room can choose it
                buffers = [tensor_bytes(s) for s in self._pool.segments(key)]
                spec = tensor_spec(c.dtype, (rows, c.dim))
                requests.append(GetRequest(key=object_key, spec=spec, buffers=buffers))
                self._loading.add(key)
                state = EmbeddingState.LOADING
            states.append(state)
        if not requests or self._storage is None:
            return states
        names = tuple(r.key.name for r in requests)
        try:
            handle = self._storage.submit_get(requests, priority=self._config.get_priority)
        except StorageError:  # a full queue or a closed pipeline: these keys stay misses
            for key in names:
                self._drop(key)
            return [
                EmbeddingState.ABSENT if k in names else s
                for k, s in zip(keys, states, strict=True)
            ]
        self._ops[handle.op_id] = names
        return states

    def load(self, key: str, out: torch.Tensor) -> None:
        """Copy READY ``key``'s rows into ``out`` ``(n, dim)`` (any device; async on CUDA).

        On CUDA the copy is ordered on the current stream, and the rows stay pinned on host
        until a later ``poll`` sees it done. Raises :class:`StateError` unless READY.
        """
        if self.state(key) is not EmbeddingState.READY:
            raise StateError(subject="EmbeddingCacheManager.load", reason=f"{key!r} is not READY")
        self._pool.read_into(key, out)
        self._touch(key)
        if out.device.type == "cuda":
            self._pin(key)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(out.device))
            self._loads.append((event, key))

    def poll(self, timeout_s: float = 0.0) -> list[EmbeddingEvent]:
        """Finished storage work since the last call (waits up to ``timeout_s`` for some)."""
        landed = [(e, k) for e, k in self._loads if e.query()]  # type: ignore[no-untyped-call]
        for item in landed:
            self._loads.remove(item)
            self._unpin(item[1])
        events, self._early = self._early, []
        if self._storage is None:
            return events
        for handle in self._storage.completions(timeout_s):
            keys = self._ops.pop(handle.op_id, None)
            if keys is not None:
                events.extend(self._finish(handle, keys))
        return events

    # ------------------------------------------------------------------ internals

    def _finish(self, handle: AnyHandle, keys: tuple[str, ...]) -> list[EmbeddingEvent]:
        events: list[EmbeddingEvent] = []
        for key, result in zip(keys, handle.partial(), strict=True):
            if isinstance(result, PutResult):
                self._unpin(key)
                events.append(EmbeddingStored(key=key, outcome=result.outcome, error=result.error))
            elif isinstance(result, GetResult):
                if result.hit:
                    self._loading.discard(key)
                    self._unpin(key)
                else:
                    self._drop(key)
                events.append(EmbeddingFetched(key=key, outcome=result.outcome, error=result.error))
        return events

    def _drop(self, key: str) -> None:
        """Forget a LOADING key whose get failed (its rows were never valid)."""
        self._loading.discard(key)
        self._unpin(key)
        self._eviction.remove(key)
        self._pool.remove(key)

    def _make_room(self, num_rows: int) -> None:
        page_bytes = self._pool.config.page_rows * self._pool.config.row_bytes
        short = self._pool.pages_for(num_rows) - self._pool.stats().free_bytes // page_bytes
        if short > 0:
            for victim in self._eviction.evict(short):
                self._pool.remove(victim)

    def _touch(self, key: str) -> None:
        if key in self._eviction:
            self._eviction.access(key)

    def _pin(self, key: str) -> None:
        self._pool.pin(key)
        self._eviction.pin(key)

    def _unpin(self, key: str) -> None:
        self._pool.unpin(key)
        self._eviction.unpin(key)
