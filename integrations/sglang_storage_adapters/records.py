"""SGLang 0.5.23's RL top-k capture on sglang_storage: the host mirror and the payload.

With ``--enable-return-routed-experts`` (and ``--enable-return-indexer-topk``) SGLang's
capturers (``srt/state_capturer/``) keep a pinned host mirror of every KV token slot,
``[slots, layers, top_k]`` int32, and on a request's finish gather its rows
``[seqlen-1-start, layers, top_k]`` into ``req.routed_experts`` / ``req.indexer_topk``.
That tensor then travels scheduler -> detokenizer as msgpack, detokenizer -> tokenizer as
base64 and on to the client in ``meta_info`` (~64 MB, then ~85 MB, for a 32K-token
request at 61 layers x top-8).

- :class:`StorageHostCache` replaces ``sglang.srt.state_capturer.base.BaseHostCache``
  (HookRegistry REPLACE; ``BaseTopkCapturer`` looks the name up as a module global): its
  ``buffer`` is the ``records`` of a :class:`~sglang_storage.memory.RecordPool` in the
  process's budget (component ``records``, ``DataKind.RECORD``), every slot allocated at
  once and zeroed as SGLang does; page-locked where CUDA exists (the runtime's allocator),
  refused at start-up when the budget cannot hold it; ``destroy()`` gives it back. On a
  machine without CUDA SGLang's own class cannot be built (it needs a driver, or an
  allocator for the device); this one can, so the capturers run on CPU.
- The payload: an AROUND hook on ``SchedulerBatchResultProcessor._maybe_collect_routed_experts``
  and ``_maybe_collect_indexer_topk`` writes the gathered tensor to a
  :class:`~sglang_storage.managers.RecordStore` on the storage backend under a key derived
  from the request id and the kind, and puts a small handle (a :class:`RecordHandle` as
  UTF-8 JSON bytes in a uint8 tensor) where the tensor was. SGLang's own code carries
  the handle unchanged: msgpack to the detokenizer, base64 into ``meta_info``; so the big
  tensor crosses no ZMQ socket and is never base64-encoded. No patch is needed.
- The client: :func:`fetch_record` reads the response (or a handle), fetches the rows from
  the backend and deletes them (``keep=True`` leaves them for a retry; then
  :func:`discard_record`). A record still being written is retried until ``timeout_s``.
  A trainer that does not import SGLang uses
  :func:`sglang_storage.managers.records.read_record` on
  ``RecordHandle.from_base64(meta_info["routed_experts"])`` (the same read).
- ``--storage-records-transport sglang`` keeps SGLang's path (the host mirror is still
  ours). Aborted requests write no record (``meta_info`` then holds no rows), so nothing is
  left behind; a retracted request has written none yet (rows are collected at finish).

Without sglang_storage settings naming ``records`` in ``--storage-managers``, constructing
the host cache builds SGLang's own and the collect hooks leave SGLang's tensor in place.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from sglang_storage.core import DataKind, PutOutcome
from sglang_storage.errors import CapacityError, ConfigError, StorageError
from sglang_storage.managers.records import (
    RecordHandle,
    RecordStore,
    RecordStoreConfig,
    RecordWritten,
    delete_record,
    read_record,
)
from sglang_storage.managers.runtime import BackendLease
from sglang_storage.memory import BlobPool, BlobPoolConfig, RecordPool, RecordPoolConfig
from sglang_storage.storage.keys import model_fingerprint
from sglang_storage_adapters import require_supported_sglang
from sglang_storage_adapters.plugin import hook_registry
from sglang_storage_adapters.runtime import RuntimeSettings, process_runtime, runtime_settings

require_supported_sglang()

# After the version check: these exist with these names in 0.5.23.
from sglang.srt.state_capturer.base import BaseHostCache  # noqa: E402

__all__ = [
    "COLLECT_TARGETS",
    "COMPONENT",
    "KINDS",
    "STAGING_BYTES",
    "TARGET",
    "RecordHandle",
    "RecordPublisher",
    "StorageHostCache",
    "discard_record",
    "fetch_record",
    "install",
    "record_handle",
    "record_key",
]

log = logging.getLogger(__name__)

TARGET: Final = "sglang.srt.state_capturer.base.BaseHostCache"
"""The class :func:`install` replaces."""
_PROCESSOR: Final = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
)
KINDS: Final = ("routed_experts", "indexer_topk")
"""The captured kinds: the ``Req`` attribute and the ``meta_info`` key of each."""
COLLECT_TARGETS: Final[Mapping[str, str]] = {
    "routed_experts": f"{_PROCESSOR}._maybe_collect_routed_experts",
    "indexer_topk": f"{_PROCESSOR}._maybe_collect_indexer_topk",
}
"""The scheduler methods :func:`install` wraps (AROUND), per kind."""
COMPONENT: Final = "records"
"""The runtime component (and ``--storage-managers`` name) the capture draws memory as."""
STAGING_BYTES: Final = 256 << 20
"""Host bytes (per scheduler) holding finished records until storage has them. A record
that finds no room there goes SGLang's way (base64 through ZMQ), with a warning."""

_OWNER: Final = "sglang_storage RL top-k records"


def _settings() -> RuntimeSettings | None:
    """This process's sglang_storage settings, or ``None`` (none published, or not on)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return runtime_settings(get_server_args())
    except (RuntimeError, ValueError):  # no server arguments published in this process
        return None


# ---------------------------------------------------------------------- host mirror


class StorageHostCache(BaseHostCache):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's ``BaseHostCache`` with ``buffer`` the records of a budgeted RecordPool.

    Constructed as SGLang constructs its host cache; see the module docstring.

    Raises:
        CapacityError: the host memory budget cannot hold the mirror.
        ConfigError: no sglang_storage settings are published, or a size is not >= 1.
    """

    pool: RecordPool | None
    """The record pool behind ``buffer`` (``None`` once destroyed)."""
    buffer: torch.Tensor | None
    """``[slots, layers, top_k]`` int32, SGLang's name for the mirror (``None`` once destroyed)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """This host cache when sglang_storage serves ``records``, else SGLang's own."""
        settings = _settings()
        if cls is StorageHostCache and (settings is None or not settings.enabled(COMPONENT)):
            original: Any = object.__new__(StorageHostCache.__bases__[0])
            original.__init__(*args, **kwargs)
            return original
        return object.__new__(cls)

    def __init__(
        self, num_tokens: int, num_layers: int, topk_size: int, name: str, device: str
    ) -> None:
        del device  # the runtime's allocator decides page-locking, whatever the device
        settings = _settings()
        if settings is None:
            raise ConfigError(
                owner=_OWNER,
                field="settings",
                reason="no sglang_storage settings are published in this process",
                allowed="--storage-backend with --storage-managers including records",
            )
        memory = process_runtime(settings).host_memory(COMPONENT)
        config = RecordPoolConfig(
            shape=(num_layers, topk_size),
            dtype=torch.int32,
            capacity=num_tokens,
            kind=DataKind.RECORD,
            label=f"{name} capture host mirror",
        )
        pool = RecordPool(config, memory)
        pool.alloc(num_tokens)  # SGLang indexes every slot directly
        self.pool = pool
        self.buffer = pool.records
        self.buffer.zero_()
        self.num_tokens = num_tokens
        self.num_layers = num_layers
        self.topk_size = topk_size
        self.name = name
        self._finalizer = weakref.finalize(self, _close_pool, pool)
        self._log_allocation()
        log.info(
            "sglang_storage %s capture: %d slots x %d layers x top-%d in the budget%s",
            name,
            num_tokens,
            num_layers,
            topk_size,
            " (page-locked)" if pool.page_locked else "",
        )

    def destroy(self) -> None:
        """Give the mirror back to the budget (a second call does nothing)."""
        if self.buffer is None:
            return
        self.buffer = None
        self.pool = None
        self._finalizer()

    def get_buffer_size_bytes(self) -> int:
        """Bytes of the mirror (0 once destroyed)."""
        if self.buffer is None:
            return 0
        return int(self.buffer.numel() * self.buffer.element_size())


def _close_pool(pool: RecordPool) -> None:
    pool.close()  # a second close does nothing


# ---------------------------------------------------------------------- handles


def record_key(kind: str, rid: str) -> str:
    """The storage name of request ``rid``'s ``kind`` rows (safe for any rid)."""
    _check_kind(kind)
    digest = hashlib.blake2b(rid.encode(), digest_size=20).hexdigest()
    return f"{kind}.{digest}"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ConfigError(
            owner=_OWNER, field="kind", value=kind, reason="is not a captured kind",
            allowed=", ".join(KINDS),
        )  # fmt: skip


def record_handle(
    source: Mapping[str, Any] | RecordHandle | torch.Tensor, kind: str = "routed_experts"
) -> RecordHandle | None:
    """The handle in a response (or its ``meta_info``), a handle tensor, or a handle.

    ``None`` when the response has no rows of ``kind`` (not asked for, or aborted).

    Raises:
        ConfigError: the rows there are not a handle: the server sent SGLang's own rows
            (``--storage-records-transport sglang``, records not managed, or no staging
            room for that request); decode those with SGLang's
            ``extract_routed_experts_from_meta_info``.
    """
    if isinstance(source, RecordHandle):
        return source
    if isinstance(source, torch.Tensor):
        return RecordHandle.from_bytes(source.numpy().tobytes())
    _check_kind(kind)
    inner = source.get("meta_info")
    value = (inner if isinstance(inner, Mapping) else source).get(kind)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(
            owner=_OWNER, field=f"meta_info[{kind!r}]", value=type(value).__name__,
            reason="must be the base64 string SGLang puts there",
        )  # fmt: skip
    try:
        return RecordHandle.from_base64(value)
    except ConfigError as error:
        raise ConfigError(
            owner=_OWNER,
            field=f"meta_info[{kind!r}]",
            value=f"{len(value)} base64 characters",
            reason=f"{error.reason} (the server sent the rows themselves)",
            allowed="decode them with SGLang's extract_routed_experts_from_meta_info",
        ) from None


def _handle_tensor(handle: RecordHandle) -> torch.Tensor:
    """``handle`` as the uint8 tensor SGLang carries in place of the rows."""
    return torch.frombuffer(bytearray(handle.to_bytes()), dtype=torch.uint8)


def _is_handle_tensor(rows: object) -> bool:
    """Whether ``rows`` is a handle already (SGLang's rows are never uint8)."""
    return isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8


_ROW_DTYPES: Final = (torch.int16, torch.int32, torch.int64)


# ---------------------------------------------------------------------- scheduler side


class RecordPublisher:
    """Writes finished requests' rows to a RecordStore and returns their handles.

    One per scheduler process (:func:`publisher`); called on the scheduler thread only
    (the store's one owner). Storage completions are drained on every call, so a stored
    record's host copy is given back at the next finish.

    Args:
        settings: The process's sglang_storage settings (backend, budget).
        model: The model the records belong to (their namespace).
        staging_bytes: Host bytes for records on their way to storage.

    Raises:
        CapacityError: the budget cannot hold the staging pool.
        ConfigError, BackendUnavailableError: the backend cannot be opened.
    """

    def __init__(
        self, settings: RuntimeSettings, *, model: str, staging_bytes: int = STAGING_BYTES
    ) -> None:
        runtime = process_runtime(settings)
        self._settings = settings
        self._model = model_fingerprint(model, kind="rl-topk-records")
        self._lease: BackendLease = runtime.backend(settings.backend, settings.backend_options)
        pipeline = runtime.storage_pipeline(self._lease)
        pool = BlobPool(
            BlobPoolConfig(
                capacity=staging_bytes, kind=DataKind.RECORD, label="RL top-k records staging"
            ),
            runtime.host_memory(COMPONENT),
        )
        self._pool = pool
        self._pipeline = pipeline
        self._store = RecordStore(
            RecordStoreConfig(model=self._model, kind=DataKind.RECORD),
            pool,
            pipeline,
            self._lease.backend,
        )
        self.failed_writes = 0
        """Records whose storage put failed (the client will find none)."""

    @property
    def store(self) -> RecordStore:
        """The record store the rows are written through."""
        return self._store

    @property
    def staging_bytes(self) -> int:
        """Host bytes held for records on their way to storage."""
        return self._pool.stats().capacity_bytes

    def publish(self, kind: str, rid: str, rows: torch.Tensor) -> RecordHandle | None:
        """Write ``rows`` of request ``rid`` and return its handle.

        ``None`` when the staging pool has no room for them now (the caller keeps SGLang's
        path for this request).

        Raises:
            StateError: ``rid``'s ``kind`` rows are already written and not yet taken.
            ConfigError: ``rows`` are not SGLang's top-k rows (an integer tensor
                ``[tokens, layers, top_k]``), e.g. a handle passed back in.
        """
        if rows.dtype not in _ROW_DTYPES or rows.dim() != 3:
            raise ConfigError(
                owner="RecordPublisher.publish",
                field="rows",
                value=f"{rows.dtype} of shape {tuple(rows.shape)} ({kind} of {rid!r})",
                reason="must be SGLang's top-k rows, an integer tensor [tokens, layers, top_k]",
                allowed="int16, int32 or int64, 3 dimensions",
            )
        self.drain()
        key = record_key(kind, rid)
        handle = RecordHandle(
            key=key,
            model=self._model,
            kind=DataKind.RECORD,
            shape=tuple(int(d) for d in rows.shape),
            dtype="int32",
            backend=self._settings.backend,
            options=dict(self._settings.backend_options),
            tag=kind,
        )
        if rows.numel() == 0:
            return handle  # nothing to store; the client gets an empty tensor
        try:
            self._store.write(key, rows.to(torch.int32))
        except CapacityError as error:
            log.warning(
                "sglang_storage records: %s rows of %s (%d bytes) do not fit the staging "
                "pool now; sent SGLang's way (%s)",
                kind, rid, handle.nbytes, error,
            )  # fmt: skip
            return None
        return handle

    def drain(self) -> None:
        """Take finished storage work (frees stored records' host copies)."""
        for event in self._store.poll():
            if isinstance(event, RecordWritten) and event.outcome is not PutOutcome.STORED:
                self.failed_writes += 1
                log.warning(
                    "sglang_storage records: storing %s failed (%s): %s",
                    event.key, event.outcome.value, event.error,
                )  # fmt: skip

    def discard(self, kind: str, rid: str) -> None:
        """Drop request ``rid``'s ``kind`` record here and in storage (absent is fine)."""
        self._store.discard(record_key(kind, rid))

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` for records still being stored, then release everything."""
        end = time.monotonic() + timeout_s
        while self._store_pending() and time.monotonic() < end:
            for _ in self._store.poll(timeout_s=0.1):
                pass
        self._pipeline.close()
        self._lease.release()

    def _store_pending(self) -> bool:
        return self._pool.stats().used_bytes > 0


_publishers: dict[int, RecordPublisher] = {}
_publishers_lock = threading.Lock()


def publisher(settings: RuntimeSettings, model: str) -> RecordPublisher:
    """This process's record publisher (built on first use)."""
    with _publishers_lock:
        found = _publishers.get(0)
        if found is None:
            staging = settings.records_staging or STAGING_BYTES
            found = _publishers[0] = RecordPublisher(settings, model=model, staging_bytes=staging)
        return found


def _model_name() -> str:
    from sglang.srt.runtime_context import get_server_args

    try:
        args = get_server_args()
    except (RuntimeError, ValueError):
        return "unknown-model"
    return str(getattr(args, "served_model_name", None) or getattr(args, "model_path", "model"))


def _sends_output() -> bool:
    """Whether this scheduler is the one whose outputs reach the detokenizer."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_tp_rank) == 0
    except (RuntimeError, ValueError, AttributeError):  # nothing published: one rank
        return True


def _collect(kind: str) -> Callable[..., None]:
    def around(original: Callable[..., None], processor: Any, req: Any) -> None:
        original(processor, req)
        rows = getattr(req, kind, None)
        if rows is None or not getattr(req, f"return_{kind}", False):
            return  # SGLang gathers indexer rows for every request, sends only those asked
        if _is_handle_tensor(rows):
            return  # published by an inner copy of this hook (the adapter installed twice)
        settings = _settings()
        if settings is None or not settings.enabled(COMPONENT):
            return
        if settings.records_transport != "store" or not _sends_output():
            return
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if isinstance(getattr(req, "finished_reason", None), FINISH_ABORT):
            setattr(req, kind, None)  # an aborted request leaves no record behind
            return
        try:
            handle = publisher(settings, _model_name()).publish(kind, str(req.rid), rows)
        except StorageError as error:  # no staging pool or backend: SGLang's way, not a crash
            log.warning(
                "sglang_storage records: %s rows of %s sent SGLang's way: %s", kind, req.rid, error
            )
            return
        if handle is not None:
            setattr(req, kind, _handle_tensor(handle))

    around.__name__ = f"sglang_storage_collect_{kind}"
    return around


# ---------------------------------------------------------------------- client side


def fetch_record(
    source: Mapping[str, Any] | RecordHandle | torch.Tensor,
    kind: str = "routed_experts",
    *,
    timeout_s: float = 30.0,
    keep: bool = False,
    backend_options: Mapping[str, object] | None = None,
) -> torch.Tensor | None:
    """A finished request's ``kind`` rows, ``[rows, layers, top_k]`` int32, from storage.

    ``source`` is the response (or its ``meta_info``, or the handle); ``None`` when it
    carries no rows of that kind. A record still being written is retried until
    ``timeout_s``; it is deleted once read unless ``keep`` (then read it again, or drop it
    with :func:`discard_record`). ``backend_options`` replace the server's (e.g. the file
    root as this host mounts it). A reader that should not import SGLang calls
    :func:`sglang_storage.managers.records.read_record` with
    ``RecordHandle.from_base64(meta_info[kind])``: this is that, with the checks.

    Raises:
        ConfigError: the response holds SGLang's rows, not a handle (see
            :func:`record_handle`).
        StorageError: no such record within ``timeout_s`` (taken already, discarded,
            evicted or never stored), or the backend failed or returned a corrupt object.
    """
    handle = record_handle(source, kind)
    if handle is None:
        return None
    return read_record(handle, timeout_s=timeout_s, keep=keep, backend_options=backend_options)


def discard_record(
    source: Mapping[str, Any] | RecordHandle | torch.Tensor,
    kind: str = "routed_experts",
    *,
    backend_options: Mapping[str, object] | None = None,
) -> None:
    """Delete a record without reading it (a sample the trainer drops); absent is fine.

    Raises:
        StorageError: the backend failed to delete it.
    """
    handle = record_handle(source, kind)
    if handle is not None:
        delete_record(handle, backend_options=backend_options)


# ---------------------------------------------------------------------- install


def install(registry: Any = None) -> None:
    """Register the host cache (REPLACE) and the collect hooks (AROUND) with SGLang.

    Call from the ``sglang.srt.plugins`` entry point (SGLang applies the hooks after the
    plug-ins ran). ``registry`` defaults to SGLang's ``HookRegistry``.
    """
    registry, hook_type = hook_registry(registry)
    registry.register(TARGET, StorageHostCache, hook_type.REPLACE)
    for kind, target in COLLECT_TARGETS.items():
        registry.register(target, _collect(kind), hook_type.AROUND)
