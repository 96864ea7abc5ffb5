"""SGLang 0.5.23's encoder embedding caches, run on sglang_storage's embedding manager.

SGLang keeps encoder outputs in two places (map section 5), each with its own machinery:

- ``EmbeddingCacheController`` (EPD encoder, ``--enable-mm-global-cache``): pinned pools per
  modality, a range allocator, an LRU, a busy-polling I/O thread and two queues in front of
  an ``EmbeddingStore`` (Mooncake only). Its caller (``MMEncoder``) polls
  ``check_prefetch_progress`` and runs ``wait_store_to_pool``/``insert_batch`` on worker
  threads (``asyncio.to_thread``).
- ``MultiModalStaticCache`` (language-side ``mm_schedule.embedding_cache`` and the encoder's
  ``--enable-prefix-mm-cache``): an in-process LRU of device tensors under a byte budget;
  what it evicts is gone.

This module keeps both call contracts and puts our
:class:`~sglang_storage.managers.embedding.EmbeddingCacheManager` underneath:

- :class:`StorageEmbeddingStore` - an ``EmbeddingStore`` that carries our backend (built
  from the ``--storage-*`` settings); SGLang's ``EmbeddingStoreFactory.create_backend`` hands
  it out instead of its Mooncake store when the ``embedding`` manager is on.
- :class:`StorageEmbeddingCacheController` - ``EmbeddingCacheController``'s constructor,
  methods and attributes over one manager per modality pool (vision, audio: SGLang's 80/20
  split of ``max_pool_size_gb``). Completions are drained from the managers (values) inside
  the calls SGLang already makes; the adapter has no thread or queue of its own (each
  pool's storage pipeline does the I/O on its workers).
- :class:`StorageMultiModalCache` - ``MultiModalStaticCache`` whose evictions are not lost:
  every admitted plain ``EmbeddingResult`` is also copied into a host-only embedding
  manager (``host_bytes``, default twice the device budget), and a device-tier miss the host
  tier holds is loaded back instead of re-encoded.
- :func:`install` - the seams: a HookRegistry AROUND hook on
  ``EmbeddingStoreFactory.create_backend`` and class REPLACE of the two caches (map 6.2).
  :mod:`.plugin` (the ``sglang.srt.plugins`` entry point) calls it; patch 0003 calls it in every
  ``MMEncoder`` (spawned encoder TP ranks and DP workers never load plug-ins).

Switching on: :func:`embedding_settings` - SGLang's ``ServerArgs`` carry the ``--storage-*``
flags (:func:`~.runtime.runtime_settings`); only when they name the ``embedding`` manager
does anything change. Otherwise the replaced classes construct SGLang's own objects
(``__new__`` hands back an instance of SGLang's class), and :func:`install` does not even
hook when the process's published settings leave the manager off.

Differences from SGLang's controller, all on its private side of the contract:

- The storage put of an embedding is queued when its rows enter the host pool
  (``store_to_pool_async``), not by ``insert_batch``, which only reports finished puts.
- ``store_to_pool_async`` copies synchronously (any device; SGLang's requires CUDA and
  copies on a side stream), so ``wait_store_to_pool`` has nothing to wait for.
- ``get_pool_views`` returns one copy per entry instead of views into the pool (the
  manager has no public read lease); ``release_pool_views`` therefore has nothing to release.
- A key another request is still loading is waited for, not re-encoded.
- ``batch_is_exist`` does not mark local hits as recently used (the manager marks use on
  ``prefetch``, ``insert`` and ``load``, which every hit goes through next).
- ``max_eviction_batch`` is not enforced (the eviction policy frees what a put needs), and
  SGLang's ``total_evicted``/``eviction_count`` statistics stay 0.

Keys: SGLang's hashes (``str(item hash)``) are object names as they are when safe, else
``sha256-`` plus their digest. Namespace: the model path, the pool's row width and element
type, and the cache's role; a reader with another geometry misses, never reads wrong bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import torch

from sglang_storage.config import instance_of, non_empty_str, optional
from sglang_storage.core import GetOutcome, PutOutcome
from sglang_storage.errors import CapacityError, ConfigError, StateError, StorageError
from sglang_storage.managers import observability
from sglang_storage.managers.embedding import (
    EmbeddingCacheConfig,
    EmbeddingCacheManager,
    EmbeddingEvent,
    EmbeddingFetched,
    EmbeddingState,
)
from sglang_storage.managers.logs import RateLimitedLog
from sglang_storage.managers.runtime import BackendLease, StorageRuntime
from sglang_storage.memory import (
    EmbeddingPool,
    EmbeddingPoolConfig,
    HostMemory,
    dtype_name,
    tensor_bytes,
)
from sglang_storage.policy import LRUPolicy
from sglang_storage.storage import Backend
from sglang_storage.storage.backend import MemoryRegistrar
from sglang_storage.storage.keys import model_fingerprint
from sglang_storage.transfer import StoragePipeline, StoragePipelineConfig
from sglang_storage_adapters import metrics, require_supported_sglang
from sglang_storage_adapters.runtime import RuntimeSettings, process_runtime, runtime_settings

require_supported_sglang()

# After the version check: these modules exist with these names in 0.5.23 only.
from sglang.srt.managers.schedule_batch import Modality  # noqa: E402
from sglang.srt.mem_cache import embedding_cache_controller as _controller_module  # noqa: E402
from sglang.srt.mem_cache import embedding_store as _store_module  # noqa: E402
from sglang.srt.mem_cache import multimodal_cache as _static_module  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402
from sglang.srt.runtime_context import get_parallel, get_server_args  # noqa: E402

__all__ = [
    "CONTROLLER_TARGET",
    "STATIC_CACHE_TARGET",
    "STORE_FACTORY_TARGET",
    "EmbeddingSettings",
    "StagedEmbedding",
    "StorageEmbeddingCacheController",
    "StorageEmbeddingStore",
    "StorageMultiModalCache",
    "embedding_settings",
    "install",
    "object_name",
    "process_settings",
]

log = logging.getLogger(__name__)
_limited: Final = RateLimitedLog(log)

CONTROLLER_TARGET: Final = (
    "sglang.srt.mem_cache.embedding_cache_controller.EmbeddingCacheController"
)
"""The class :func:`install` replaces with :class:`StorageEmbeddingCacheController`."""
STATIC_CACHE_TARGET: Final = "sglang.srt.mem_cache.multimodal_cache.MultiModalStaticCache"
"""The class :func:`install` replaces with :class:`StorageMultiModalCache`."""
STORE_FACTORY_TARGET: Final = (
    "sglang.srt.mem_cache.embedding_store.EmbeddingStoreFactory.create_backend"
)
"""The factory method :func:`install` wraps to hand out :class:`StorageEmbeddingStore`."""

_OWNER: Final = "sglang_storage embedding cache"
_MANAGER: Final = "embedding"
_SAFE_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,159}")
_VISION_POOL_RATIO: Final = 0.8  # SGLang's VISION_POOL_RATIO
_GIB: Final = 1024**3
_MIB: Final = 1024**2


@attrs.frozen(kw_only=True)
class _SGLangClasses:
    """SGLang's own classes, held outside module globals.

    HookRegistry re-binds every module attribute that *is* a replaced class (to catch stale
    ``from X import Y`` copies), which would turn a plain alias here into our own subclass.
    """

    controller: type
    static_cache: type
    embedding_result: type


_SGLANG: Final = _SGLangClasses(
    controller=_controller_module.EmbeddingCacheController,
    static_cache=_static_module.MultiModalStaticCache,
    embedding_result=_static_module.EmbeddingResult,
)


def object_name(mm_hash: object) -> str:
    """The object name of SGLang's multimodal hash (an ``int`` or its ``str``).

    As is when it is a safe name; otherwise ``sha256-`` and the hex digest of its text.
    """
    text = str(mm_hash)
    if _SAFE_NAME.fullmatch(text):
        return text
    return "sha256-" + hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------- settings


@attrs.frozen(kw_only=True)
class EmbeddingSettings:
    """Where this process's embedding caches store, from the ``--storage-*`` flags."""

    backend: str = attrs.field(validator=non_empty_str)
    """The registered sglang_storage backend name."""
    backend_options: Mapping[str, object] = attrs.field(
        factory=dict, validator=instance_of(Mapping)
    )
    """Its options (JSON shapes)."""
    model: str = attrs.field(validator=non_empty_str)
    """The model the embeddings belong to (SGLang's ``--model-path``); names the namespace."""
    runtime: RuntimeSettings | None = attrs.field(
        default=None, validator=optional(instance_of(RuntimeSettings))
    )
    """The process's settings these came from (``None``: just this backend)."""

    def storage_runtime(self) -> StorageRuntime:
        """The process's storage runtime: the host memory budget and shared backends."""
        runtime = self.runtime or RuntimeSettings(
            backend=self.backend, backend_options=self.backend_options, managers=(_MANAGER,)
        )
        return process_runtime(runtime)


def embedding_settings(server_args: object) -> EmbeddingSettings | None:
    """The embedding cache settings ``server_args`` (SGLang's ``ServerArgs``) carry.

    ``None`` unless the ``--storage-*`` flags are given and name the ``embedding`` manager.

    Raises:
        ConfigError: the flags' settings are malformed (see :func:`~.runtime.runtime_settings`).
    """
    runtime = runtime_settings(server_args)
    if runtime is None or not runtime.enabled(_MANAGER):
        return None
    model = getattr(server_args, "model_path", None)
    return EmbeddingSettings(
        backend=runtime.backend,
        backend_options=dict(runtime.backend_options),
        model=model if isinstance(model, str) and model else "unnamed-model",
        runtime=runtime,
    )


def process_settings() -> EmbeddingSettings | None:
    """:func:`embedding_settings` of the ``ServerArgs`` this process published, if any."""
    try:
        server_args = get_server_args()
    except ValueError:  # SGLang's "Global server args is not set yet!"
        return None
    return embedding_settings(server_args)


def _namespace_model(settings: EmbeddingSettings, role: str, dim: int, dtype: torch.dtype) -> str:
    return model_fingerprint(settings.model, role=role, dim=dim, dtype=dtype_name(dtype))


# ---------------------------------------------------------------------- the store


class StorageEmbeddingStore(_store_module.EmbeddingStore):  # type: ignore[misc]  # untyped
    """An ``EmbeddingStore`` whose objects live in one of our backends.

    It is the handle :class:`StorageEmbeddingCacheController` recognises and takes its
    backend from. The controller moves rows itself, so the pointer-based methods of SGLang's
    store (``batch_get``/``batch_put`` and the ``_multi_buffers`` pair), which only SGLang's
    own controller calls, raise :class:`~sglang_storage.errors.StateError`.

    Args:
        settings: The backend to use: the process's shared instance of it, from the
            storage runtime (capped backends get their eviction policy there).
        backend: An already built backend to use instead (it is closed by :meth:`close`).

    Raises:
        ConfigError: unknown backend or options.
        BackendUnavailableError: the backend cannot start.
    """

    def __init__(self, settings: EmbeddingSettings, backend: Backend | None = None) -> None:
        self._settings = settings
        self._runtime = settings.storage_runtime()
        self._lease: BackendLease | None = None
        if backend is None:
            self._lease = self._runtime.backend(settings.backend, settings.backend_options)
            backend = self._lease.backend
        self._backend = backend
        observability.watch_backend(backend)
        self._namespace_models: list[str] = []
        self._lock = threading.Lock()

    @property
    def settings(self) -> EmbeddingSettings:
        """What the store was built from."""
        return self._settings

    @property
    def backend(self) -> Backend:
        """The backend the objects live in."""
        return self._backend

    @property
    def runtime(self) -> StorageRuntime:
        """The process's storage runtime (host memory for the controller's pools)."""
        return self._runtime

    def pipeline(self, config: StoragePipelineConfig) -> StoragePipeline:
        """A new storage pipeline on the backend, for one pool of a controller."""
        if self._lease is not None:
            return self._runtime.storage_pipeline(self._lease, config)
        return StoragePipeline(self._backend, config)

    def use_namespace(self, config: EmbeddingCacheConfig) -> None:
        """Include ``config``'s namespace in :meth:`batch_is_exist` (a pool registers it)."""
        with self._lock:
            if config.model not in self._namespace_models:
                self._namespace_models.append(config.model)

    def batch_is_exist(self, hashes: list[str]) -> list[bool]:
        """Whether each hash is stored in any registered namespace (a hint, as SGLang's)."""
        with self._lock:
            models = list(self._namespace_models)
        found = [False] * len(hashes)
        names = [object_name(h) for h in hashes]
        for model in models:
            namespace = EmbeddingCacheConfig(model=model).namespace
            left = [i for i, hit in enumerate(found) if not hit]
            if not left:
                break
            hits = self._backend.exists([namespace.key(names[i]) for i in left])
            for i, hit in zip(left, hits, strict=True):
                found[i] = hit
        return found

    def _unsupported(self, method: str) -> StateError:
        return StateError(
            subject=f"StorageEmbeddingStore.{method}",
            reason=(
                "the sglang_storage embedding store is driven by the sglang_storage "
                "EmbeddingCacheController; SGLang's own controller cannot use it (this "
                "process constructed SGLang's controller: is patches/sglang-0.5.23/0003 applied?)"
            ),
        )

    def batch_get(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Not supported (see the class docstring)."""
        raise self._unsupported("batch_get")

    def batch_put(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Not supported (see the class docstring)."""
        raise self._unsupported("batch_put")

    def batch_get_into_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Not supported (see the class docstring)."""
        raise self._unsupported("batch_get_into_multi_buffers")

    def batch_put_from_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Not supported (see the class docstring)."""
        raise self._unsupported("batch_put_from_multi_buffers")

    def close(self) -> None:
        """Release the shared backend (its last user closes it), or close the given one."""
        observability.SOURCES.capture(self._backend)
        if self._lease is not None:
            self._lease.release()
        else:
            self._backend.close()


# ---------------------------------------------------------------------- one modality pool


class _Tier:
    """One pool + manager (+ pipeline): what one SGLang pool becomes."""

    def __init__(
        self,
        *,
        label: str,
        dim: int,
        dtype: torch.dtype,
        capacity: int,
        memory: HostMemory,
        model: str,
        rank: int,
        store: StorageEmbeddingStore | None,
    ) -> None:
        self.label = label
        self.dim = dim
        self.dtype = dtype
        config = EmbeddingPoolConfig(
            dim=dim, dtype=dtype, capacity=capacity, label=f"{label} embedding pool"
        )
        self.pool = EmbeddingPool(config, memory)
        observability.watch_pool(self.pool, "embedding")
        self.page_bytes = config.page_rows * config.row_bytes
        self.pipeline: StoragePipeline | None = None
        if store is not None:
            backend = store.backend
            self.pipeline = store.pipeline(StoragePipelineConfig(workers=2))
            observability.watch_storage_pipeline(self.pipeline, "embedding")
            if backend.capabilities.registers_memory:
                registrar: MemoryRegistrar = backend  # type: ignore[assignment]
                registrar.register_memory(tensor_bytes(self.pool.buffer.tensor))
        self.config = EmbeddingCacheConfig(model=model, rank=rank, owner_rank=0)
        self.manager = EmbeddingCacheManager(self.config, self.pool, LRUPolicy(), self.pipeline)

    def rows_of(self, key: str) -> int | None:
        entry = self.pool.entry(key)
        return None if entry is None else entry.num_rows

    def ready(self, key: str) -> bool:
        return self.manager.state(key) is EmbeddingState.READY

    def free_pages(self) -> int:
        return self.pool.stats().free_bytes // self.page_bytes

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            observability.SOURCES.remove(self.pipeline)
        self.manager.poll()  # releases what the closed pipeline finished
        self.pool.close()


# ---------------------------------------------------------------------- the controller


@attrs.frozen(kw_only=True)
class StagedEmbedding:
    """An embedding ``store_to_pool_async`` put in the host pool (SGLang's entry slot)."""

    hash: str
    """SGLang's hash."""
    modality: object
    num_tokens: int
    dim: int


class StorageEmbeddingCacheController(_controller_module.EmbeddingCacheController):  # type: ignore[misc]
    """SGLang's ``EmbeddingCacheController`` over sglang_storage's embedding manager.

    Constructed exactly as SGLang's (``MMEncoder.__init__``). Given any store but a
    :class:`StorageEmbeddingStore`, the construction returns SGLang's own controller
    instead, so SGLang is unchanged without the ``--storage-*`` flags.

    Locking: every method takes ``self.lock`` around the managers (SGLang's callers use the
    controller from the event loop and from ``asyncio.to_thread`` workers); no method holds
    it across storage I/O or an ``await``.

    Raises:
        ConfigError: a pool smaller than one page where SGLang's would be usable, bad dims.
        CapacityError: the host cannot hold the pools.
    """

    def __new__(
        cls, embedding_store: object = None, *args: Any, **kwargs: Any
    ) -> StorageEmbeddingCacheController:
        """Ours for a :class:`StorageEmbeddingStore`; SGLang's own controller otherwise."""
        if not isinstance(embedding_store, StorageEmbeddingStore):
            sglang: StorageEmbeddingCacheController = _SGLANG.controller(
                embedding_store, *args, **kwargs
            )
            return sglang  # SGLang's own object; Python then skips our __init__
        instance: StorageEmbeddingCacheController = object.__new__(cls)
        return instance

    def __init__(
        self,
        embedding_store: StorageEmbeddingStore,
        max_pool_size_gb: float = 4.0,
        hidden_dims: Mapping[Any, int] | None = None,
        all_rank_get: bool = False,
        enable_eviction: bool = True,
        max_eviction_batch: int = 100,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        # Not SGLang's __init__: it would start its I/O thread and allocate its own pools.
        parallel = get_parallel()
        self.tp_world_size: int = parallel.tp_size
        self.tp_rank: int = _rank_or_zero()
        self.tp_group = parallel.tp_group.cpu_group if self.tp_world_size > 1 else None
        self.all_rank_get = all_rank_get
        self.hidden_dims: dict[Any, int] = dict(hidden_dims or {})
        self.dtype = dtype
        self.element_size = torch.tensor([], dtype=dtype).element_size()
        self.enable_eviction = enable_eviction
        self.max_eviction_batch = max_eviction_batch
        self.embedding_store = embedding_store
        self.total_pool_size_bytes = int(max_pool_size_gb * _GIB)
        self.stats: dict[str, int] = {
            "total_allocated": 0,
            "total_evicted": 0,
            "eviction_count": 0,
            "allocation_failures": 0,
        }
        self.ongoing_prefetch: dict[str, set[tuple[str, str]]] = {}
        """Request id -> (pool, key) pairs whose storage get has not finished."""
        self.lock = threading.Lock()

        vision_dim = self.hidden_dims.get(Modality.IMAGE) or self.hidden_dims.get(Modality.VIDEO)
        audio_dim = self.hidden_dims.get(Modality.AUDIO) or vision_dim
        if not isinstance(vision_dim, int) or not isinstance(audio_dim, int):
            raise ConfigError(
                owner=_OWNER,
                field="hidden_dims",
                value=self.hidden_dims,
                reason="must give the image (or video) embedding width",
                allowed="a dict of Modality to int, e.g. {Modality.IMAGE: 3584}",
            )
        self.dims: dict[str, int] = {"vision": vision_dim, "audio": audio_dim}
        vision_bytes = int(self.total_pool_size_bytes * _VISION_POOL_RATIO)
        sizes = {"vision": vision_bytes, "audio": self.total_pool_size_bytes - vision_bytes}
        row_bytes = {label: dim * self.element_size for label, dim in self.dims.items()}
        usable = {
            label: size for label, size in sizes.items() if _holds_a_page(size, row_bytes[label])
        }
        for label in sizes.keys() - usable.keys():
            log.warning(
                "[Rank %d] %s embedding pool has zero pages; dim=%d, budget=%d bytes",
                self.tp_rank,
                label,
                self.dims[label],
                sizes[label],
            )
        # The process's one host memory budget, shared with every other adapter.
        self._memory = embedding_store.runtime.host_memory(_MANAGER) if usable else None
        settings = embedding_store.settings
        self._tiers: dict[str, _Tier] = {}
        try:
            for label, size in usable.items():
                assert self._memory is not None
                tier = _Tier(
                    label=label,
                    dim=self.dims[label],
                    dtype=dtype,
                    capacity=size,
                    memory=self._memory,
                    model=_namespace_model(settings, "encoder", self.dims[label], dtype),
                    rank=self.tp_rank,
                    store=embedding_store,
                )
                self._tiers[label] = tier
                embedding_store.use_namespace(tier.config)
        except BaseException:
            self.close()
            raise

        if self.tp_world_size > 1:
            if self.tp_group is None:
                raise ValueError("tp_group must be provided when tp_size > 1")
            from sglang.srt.distributed.parallel_state import create_custom_parallel_group

            group_ranks = torch.distributed.get_process_group_ranks(self.tp_group)
            self.prefetch_tp_group = create_custom_parallel_group(
                group_ranks=group_ranks, backend="gloo"
            )
        else:
            self.prefetch_tp_group = None
        log.info(
            "[Rank %d] sglang_storage embedding cache: %s backend, pools %s",
            self.tp_rank,
            settings.backend,
            ", ".join(
                f"{t.label} dim={t.dim} pages={t.pool.config.num_pages}"
                for t in self._tiers.values()
            ),
        )

    # ------------------------------------------------------------------ facts

    def _label(self, modality: object) -> str | None:
        if modality == Modality.AUDIO:
            return "audio"
        if modality in (Modality.IMAGE, Modality.VIDEO):
            return "vision"
        return None

    def _tier(self, modality: object) -> _Tier | None:
        label = self._label(modality)
        return None if label is None else self._tiers.get(label)

    def _ready_tier(self, key: str) -> _Tier | None:
        for tier in self._tiers.values():
            if tier.ready(key):
                return tier
        return None

    def get_embedding_dim(self, modality: object = None) -> int:
        """The row width of ``modality``'s pool.

        Raises:
            ConfigError: ``modality`` has no pool (SGLang's raises ``AttributeError``).
        """
        label = self._label(modality)
        if label is None:
            raise ConfigError(
                owner=_OWNER,
                field="modality",
                value=modality,
                reason="has no embedding pool",
                allowed="Modality.IMAGE, Modality.VIDEO, Modality.AUDIO",
            )
        return self.dims[label]

    # ------------------------------------------------------------------ completions

    def _drain(self) -> list[EmbeddingEvent]:
        """Take finished storage work from the managers (caller holds ``self.lock``)."""
        metrics.refresh()
        events: list[EmbeddingEvent] = []
        for tier in self._tiers.values():
            for event in tier.manager.poll():
                events.append(event)
                if isinstance(event, EmbeddingFetched):
                    for pending in self.ongoing_prefetch.values():
                        pending.discard((tier.label, event.key))
                    if event.outcome is not GetOutcome.HIT:
                        _limited.warning(
                            f"get-{event.outcome.value}",
                            "[Rank %d] embedding %s: storage get %s%s",
                            self.tp_rank,
                            event.key,
                            event.outcome.value,
                            f" ({event.error})" if event.error else "",
                        )
                elif event.outcome is PutOutcome.ERROR:
                    _limited.warning(
                        "put-error",
                        "[Rank %d] storage put of embedding %s failed (%s); keeping the host copy",
                        self.tp_rank,
                        event.key,
                        event.error,
                    )
        return events

    # ------------------------------------------------------------------ lookup / prefetch

    async def batch_is_exist(self, mm_hashes: list[str]) -> list[bool]:
        """Per hash: READY on host, else stored (asked off the event loop)."""
        keys = [object_name(h) for h in mm_hashes]
        with self.lock:
            self._drain()
            local = [self._ready_tier(key) is not None for key in keys]
        missing = [i for i, hit in enumerate(local) if not hit]
        found = list(local)
        if missing:
            stored = await asyncio.to_thread(
                self.embedding_store.batch_is_exist, [mm_hashes[i] for i in missing]
            )
            for i, hit in zip(missing, stored, strict=True):
                found[i] = hit
        log.info(
            "=== Multi-Level Cache Check === Total: %d | Local Hits: %d | Global Hits: %d",
            len(keys),
            sum(local),
            sum(found) - sum(local),
        )
        return found

    def prefetch(
        self,
        req_id: str,
        mm_hashes: list[str],
        expected_tokens: list[int],
        modality: object = None,
    ) -> None:
        """Start one storage get for the hashes not on host (``expected_tokens`` rows each)."""
        tier = self._tier(modality)
        if tier is None:
            log.warning("prefetch: unknown modality %s (or no pool); skipping.", modality)
            return
        with self.lock:
            self._drain()
            keys: list[str] = []
            rows: list[int] = []
            waiting: set[tuple[str, str]] = set()
            free = tier.free_pages()
            for mm_hash, tokens in zip(mm_hashes, expected_tokens, strict=True):
                key = object_name(mm_hash)
                state = tier.manager.state(key)
                if state is EmbeddingState.LOADING:
                    waiting.add((tier.label, key))  # another request's get: wait for it
                    continue
                if key in keys:
                    continue
                if state is EmbeddingState.READY:  # the manager only marks it used
                    keys.append(key)
                    rows.append(int(tokens))
                    continue
                need = tier.pool.pages_for(int(tokens))
                if not self.enable_eviction:
                    if need > free:
                        self.stats["allocation_failures"] += 1
                        continue
                    free -= need
                keys.append(key)
                rows.append(int(tokens))
            if keys:
                states = tier.manager.prefetch(keys, rows)
                for key, n, state in zip(keys, rows, states, strict=True):
                    if state is EmbeddingState.LOADING:
                        waiting.add((tier.label, key))
                        self.stats["total_allocated"] += n * tier.dim * self.element_size
                    elif state is EmbeddingState.ABSENT:
                        self.stats["allocation_failures"] += 1
                        _limited.warning(
                            "prefetch-room",
                            "Req %s: no room for %d tokens in the %s pool; falling back "
                            "to the encoder.",
                            req_id,
                            n,
                            tier.label,
                        )
            if waiting:
                self.ongoing_prefetch.setdefault(req_id, set()).update(waiting)

    def check_prefetch_progress(self, req_id: str) -> bool:
        """Whether ``req_id``'s gets have finished (on every TP rank when ``all_rank_get``)."""
        with self.lock:
            self._drain()
            local_ready = not self.ongoing_prefetch.get(req_id)
        if self.all_rank_get and self.tp_world_size > 1:
            ready = torch.tensor([1 if local_ready else 0], dtype=torch.int, device="cpu")
            torch.distributed.all_reduce(
                ready, op=torch.distributed.ReduceOp.MIN, group=self.prefetch_tp_group
            )
            local_ready = ready.item() == 1
        if local_ready:
            with self.lock:
                self.ongoing_prefetch.pop(req_id, None)
        return local_ready

    def has_local_embedding(self, mm_hash: str) -> bool:
        """Whether ``mm_hash``'s rows are READY on host."""
        with self.lock:
            self._drain()
            return self._ready_tier(object_name(mm_hash)) is not None

    # ------------------------------------------------------------------ insert

    def store_to_pool_async(
        self,
        mm_hashes: list[str],
        tensors: list[torch.Tensor],
        modality: object = None,
    ) -> list[tuple[StagedEmbedding, Any]]:
        """Copy encoder outputs into the host pool and queue their storage puts.

        Items that cannot be stored (already cached or loading, no room, wrong width) are
        skipped, as SGLang's; the caller then keeps using its own tensor for them. Returns
        SGLang's ``(entry, AsyncCopyHandle)`` pairs for ``wait_store_to_pool``, already
        complete.
        """
        tier = self._tier(modality)
        if tier is None:
            return []
        staged: list[tuple[StagedEmbedding, Any]] = []
        with self.lock:
            self._drain()
            for mm_hash, tensor in zip(mm_hashes, tensors, strict=True):
                rows = tensor.detach()
                if rows.dim() != 2:
                    rows = rows.reshape(-1, rows.shape[-1])
                if int(rows.shape[1]) != tier.dim:
                    log.warning(
                        "[Rank %d] Embedding dim mismatch for %s: pool.dim=%d, tensor.dim=%d; "
                        "skipping pool store",
                        self.tp_rank,
                        mm_hash,
                        tier.dim,
                        rows.shape[1],
                    )
                    continue
                key = object_name(mm_hash)
                if tier.manager.state(key) is not EmbeddingState.ABSENT:
                    continue
                if (
                    not self.enable_eviction
                    and tier.pool.pages_for(rows.shape[0]) > tier.free_pages()
                ):
                    self.stats["allocation_failures"] += 1
                    continue
                try:
                    tier.manager.insert(key, rows.to(tier.dtype).contiguous())
                except StorageError as error:  # no room (CapacityError), empty rows: skip it
                    self.stats["allocation_failures"] += int(isinstance(error, CapacityError))
                    _limited.warning(
                        "insert",
                        "[Rank %d] cannot cache embedding %s: %s",
                        self.tp_rank,
                        mm_hash,
                        error,
                    )
                    continue
                self.stats["total_allocated"] += rows.shape[0] * tier.dim * self.element_size
                entry = StagedEmbedding(
                    hash=mm_hash, modality=modality, num_tokens=int(rows.shape[0]), dim=tier.dim
                )
                staged.append((entry, _controller_module.AsyncCopyHandle(None, mm_hash)))
        return staged

    def wait_store_to_pool(self, handles: Sequence[tuple[StagedEmbedding, Any]]) -> None:
        """Wait for ``store_to_pool_async``'s copies (they are already done)."""
        for _entry, handle in handles:
            handle.wait()
        with self.lock:
            self._drain()

    def insert_batch(self, mm_hashes: list[str], modality: object = None) -> None:
        """Report finished storage puts (queued by ``store_to_pool_async``)."""
        if self._tier(modality) is None:
            log.warning("insert_batch: unknown modality %s (or no pool); skipping.", modality)
            return
        with self.lock:
            events = self._drain()
        stored = sum(
            1
            for e in events
            if not isinstance(e, EmbeddingFetched) and e.outcome is not PutOutcome.ERROR
        )
        if stored:
            log.info("Global Cache: %d embeddings stored", stored)

    # ------------------------------------------------------------------ reads

    def get_pool_views(self, mm_hashes: list[str]) -> list[list[torch.Tensor] | None]:
        """Per hash, its rows as a one-tensor list (a copy in pageable memory), or None."""
        results: list[list[torch.Tensor] | None] = []
        with self.lock:
            self._drain()
            for mm_hash in mm_hashes:
                key = object_name(mm_hash)
                tier = self._ready_tier(key)
                rows = None if tier is None else tier.rows_of(key)
                if tier is None or rows is None:
                    results.append(None)
                    continue
                out = torch.empty((rows, tier.dim), dtype=tier.dtype)
                tier.manager.load(key, out)
                results.append([out])
        return results

    def release_pool_views(self, mm_hashes: list[str]) -> None:
        """End a ``get_pool_views`` (its copies hold nothing in the pool)."""
        with self.lock:
            self._drain()

    def load_to_device_async(
        self, mm_hash: str, dst_tensor: torch.Tensor, dst_token_offset: int
    ) -> Any:
        """Copy READY rows into ``dst_tensor[dst_token_offset:]``; SGLang's handle, or None."""
        key = object_name(mm_hash)
        with self.lock:
            self._drain()
            tier = self._ready_tier(key)
            rows = None if tier is None else tier.rows_of(key)
            if tier is None or rows is None:
                _limited.warning(
                    "not-found", "Hash %s not found in local cache (or not ready)", mm_hash
                )
                return None
            tier.manager.load(key, dst_tensor[dst_token_offset : dst_token_offset + rows])
        event = None
        if dst_tensor.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(dst_tensor.device))
        return _controller_module.AsyncCopyHandle(event, mm_hash, device=dst_tensor.device)

    def wait_load_to_device(self, handles: Sequence[Any]) -> None:
        """Wait for ``load_to_device_async`` copies; the pool's rows are released."""
        for handle in handles:
            handle.wait()
        with self.lock:
            self._drain()

    # ------------------------------------------------------------------ stats / life

    def get_stats(self) -> dict[str, Any]:
        """SGLang's statistics keys, from our pools."""
        with self.lock:
            pools = {label: tier.pool.stats() for label, tier in self._tiers.items()}
            pages = {label: tier.free_pages() for label, tier in self._tiers.items()}
            cached = sum(len(tier.pool) for tier in self._tiers.values())
            pending = sum(len(p) for p in self.ongoing_prefetch.values())
        return {
            **self.stats,
            "num_cached": cached,
            "num_pinned": pending,
            "allocated_mb": sum(s.used_bytes for s in pools.values()) / _MIB,
            "free_mb": sum(s.free_bytes for s in pools.values()) / _MIB,
            "total_mb": sum(s.capacity_bytes for s in pools.values()) / _MIB,
            "vision_free_pages": pages.get("vision", 0),
            "audio_free_pages": pages.get("audio", 0),
        }

    def close(self) -> None:
        """Finish queued storage work and free the pools (SGLang never calls this)."""
        tiers = getattr(self, "_tiers", {})
        with self.lock:
            for tier in tiers.values():
                tier.close()
            tiers.clear()


def _rank_or_zero() -> int:
    """This process's TP rank, 0 where SGLang has not written one (a single-rank encoder)."""
    try:
        rank = get_parallel().tp_rank
    except (RuntimeError, ValueError):
        return 0
    return int(rank)


def _holds_a_page(size: int, row_bytes: int) -> bool:
    page_rows = max(1, (256 * 1024) // row_bytes)
    return size // (page_rows * row_bytes) >= 1


# ---------------------------------------------------------------------- the static cache


class StorageMultiModalCache(_static_module.MultiModalStaticCache):  # type: ignore[misc]
    """SGLang's ``MultiModalStaticCache`` with a host tier behind its device-tensor LRU.

    The device tier is SGLang's own code (an ``OrderedDict`` LRU under ``max_size`` bytes).
    Every plain ``EmbeddingResult`` it admits is also copied into a host embedding manager
    (one per row width and element type, ``host_bytes`` each, LRU); a lookup the device
    tier misses but the host tier holds is copied back to the device the rows came from and
    re-admitted. ``free`` withdraws a hash from both tiers. Results of other types (EVS)
    stay device-only. Host-tier failures are logged, never raised into the scheduler.

    Constructed as SGLang's (``MultiModalStaticCache(max_size)``); where the process's
    settings leave the ``embedding`` manager off, the construction returns SGLang's own cache.
    """

    def __new__(cls, max_size: int, *args: Any, **kwargs: Any) -> StorageMultiModalCache:
        """Ours when the ``embedding`` manager is on; SGLang's own cache otherwise."""
        if kwargs.get("settings") is None and process_settings() is None:
            sglang: StorageMultiModalCache = _SGLANG.static_cache(max_size, *args, **kwargs)
            return sglang
        instance: StorageMultiModalCache = object.__new__(cls)
        return instance

    def __init__(
        self,
        max_size: int,
        *,
        settings: EmbeddingSettings | None = None,
        host_bytes: int | None = None,
    ) -> None:
        super().__init__(max_size)
        self.host_bytes = 2 * max_size if host_bytes is None else host_bytes
        """Bytes of each host tier (default: twice the device budget)."""
        resolved = settings or process_settings()
        if resolved is None:  # only reachable by calling __init__ again by hand
            raise StateError(subject=_OWNER, reason="the embedding manager is not switched on")
        self._settings = resolved
        self._host: dict[tuple[int, torch.dtype], tuple[_Tier, torch.device]] = {}
        self._withdrawn: set[str] = set()  # freed: the host copy may be stale
        self._host_lock = threading.Lock()

    # ------------------------------------------------------------------ SGLang's methods

    def get(self, mm_hashes: list[int], combined_hash: int | None = None) -> Any:
        """The combined hash's embedding from the device tier, else from the host tier."""
        found = super().get(mm_hashes, combined_hash)
        if found is None:
            found = self._recall(self.combine_hashes(mm_hashes))
        return found

    def get_single(self, mm_hash: int) -> Any:
        """One hash's embedding from the device tier, else from the host tier."""
        found = super().get_single(mm_hash)
        if found is None:
            found = self._recall(mm_hash)
        return found

    def set(self, mm_hash: int, embedding: Any, loc: torch.Tensor | None = None) -> bool:
        """Admit to the device tier (SGLang's rules) and copy plain results to the host tier."""
        admitted = bool(super().set(mm_hash, embedding, loc))
        if admitted and type(embedding) is _SGLANG.embedding_result:
            self._keep(mm_hash, self.mm_cache.get(mm_hash, embedding).embedding)
        return admitted

    def has(self, mm_hash: int) -> bool:
        """Whether either tier holds ``mm_hash``."""
        if super().has(mm_hash):
            return True
        key = object_name(mm_hash)
        with self._host_lock:
            return key not in self._withdrawn and any(
                tier.ready(key) for tier, _ in self._host.values()
            )

    def free(self, mm_hash: int, mm_embedding_allocator: Any = None) -> bool:
        """Drop ``mm_hash`` from the device tier and withdraw its host copy."""
        key = object_name(mm_hash)
        with self._host_lock:
            held = any(tier.ready(key) for tier, _ in self._host.values())
            if held:
                self._withdrawn.add(key)
        return bool(super().free(mm_hash, mm_embedding_allocator)) or held

    def clear(self) -> None:
        """Empty both tiers."""
        super().clear()
        with self._host_lock:
            for tier, _ in self._host.values():
                tier.close()
            self._host.clear()
            self._withdrawn.clear()

    def close(self) -> None:
        """Free the host tier (SGLang never calls this)."""
        self.clear()

    # ------------------------------------------------------------------ the host tier

    def _tier_for(self, rows: torch.Tensor) -> _Tier | None:
        """The host tier of ``rows``' width and type, built on first use (lock held)."""
        dim, dtype = int(rows.shape[-1]), rows.dtype
        held = self._host.get((dim, dtype))
        if held is not None:
            return held[0]
        if not dtype.is_floating_point or not _holds_a_page(
            self.host_bytes, dim * rows.element_size()
        ):
            return None
        tier = _Tier(
            label=f"prefix-{dim}-{dtype_name(dtype)}",
            dim=dim,
            dtype=dtype,
            capacity=self.host_bytes,
            memory=self._settings.storage_runtime().host_memory(_MANAGER),
            model=_namespace_model(self._settings, "prefix", dim, dtype),
            rank=0,
            store=None,
        )
        self._host[(dim, dtype)] = (tier, rows.device)
        return tier

    def _keep(self, mm_hash: int, tensor: torch.Tensor) -> None:
        key = object_name(mm_hash)
        rows = tensor.detach()
        rows = rows.reshape(-1, rows.shape[-1]) if rows.dim() != 2 else rows
        with self._host_lock:
            if key in self._withdrawn or rows.shape[0] < 1:
                return  # a stale copy may still sit in the pool under this key
            try:
                tier = self._tier_for(rows)
                if tier is not None:
                    tier.manager.poll()  # releases rows of recalls that have landed
                    tier.manager.insert(key, rows.contiguous())
            except StorageError as error:
                _limited.warning(
                    "prefix-copy",
                    "prefix embedding cache: host copy of %s skipped: %s",
                    mm_hash,
                    error,
                )

    def _recall(self, mm_hash: int | None) -> Any:
        if mm_hash is None:
            return None
        key = object_name(mm_hash)
        with self._host_lock:
            if key in self._withdrawn:
                return None
            for tier, device in self._host.values():
                rows = tier.rows_of(key) if tier.ready(key) else None
                if rows is None:
                    continue
                out = torch.empty((rows, tier.dim), dtype=tier.dtype, device=device)
                try:
                    tier.manager.load(key, out)
                    tier.manager.poll()
                except StorageError as error:
                    _limited.warning(
                        "prefix-recall",
                        "prefix embedding cache: recall of %s failed: %s",
                        mm_hash,
                        error,
                    )
                    return None
                break
            else:
                return None
        result = _SGLANG.embedding_result(embedding=out)
        super().set(mm_hash, result)
        return result


# ---------------------------------------------------------------------- installation

_INSTALLED = False
_install_lock = threading.Lock()


def _create_backend(
    original: Callable[..., Any], cls: type, backend_name: str, **kwargs: Any
) -> Any:
    """AROUND ``EmbeddingStoreFactory.create_backend``: our store when the manager is on."""
    settings = process_settings()
    if settings is None:
        return original(cls, backend_name, **kwargs)
    log.info(
        "sglang_storage: --mm-global-cache-backend %s served by the sglang_storage %s backend",
        backend_name,
        settings.backend,
    )
    return StorageEmbeddingStore(settings)


def install() -> bool:
    """Hook the embedding caches into SGLang through HookRegistry (once per process).

    Registers an AROUND hook on ``EmbeddingStoreFactory.create_backend`` and class REPLACE of
    ``EmbeddingCacheController`` and ``MultiModalStaticCache``, then applies them (which also
    re-binds ``from ... import`` copies in loaded modules). Where this process has published
    ``ServerArgs`` that leave the ``embedding`` manager off, nothing is hooked. Returns
    whether the hooks are in place.
    """
    global _INSTALLED
    with _install_lock:
        if _INSTALLED:
            return True
        try:
            get_server_args()
        except ValueError:
            pass  # a plug-in at process start: decide when SGLang constructs
        else:
            if process_settings() is None:
                return False
        HookRegistry.register(STORE_FACTORY_TARGET, _create_backend, HookType.AROUND)
        HookRegistry.register(CONTROLLER_TARGET, StorageEmbeddingCacheController, HookType.REPLACE)
        HookRegistry.register(STATIC_CACHE_TARGET, StorageMultiModalCache, HookType.REPLACE)
        HookRegistry.apply_hooks()
        _INSTALLED = True
        return True
