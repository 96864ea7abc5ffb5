"""Our storage backends as an SGLang 0.5.23 HiCache L3 backend (``HiCacheStorage``).

Loaded by SGLang's own factory through its ``dynamic`` backend, with no patch::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "sglang_storage",
        "module_path": "sglang_storage_adapters.hicache_storage",
        "class_name": "HiCacheBackend",
        "interface_v1": 1,
        "storage_backend": "file",
        "storage_options": {"root": "/var/cache/sglang-kv", "capacity_bytes": "500GiB"},
        "eviction": {"name": "lru"}
    }'

SGLang builds it as ``HiCacheBackend(storage_config, kwargs)``, then hands it the host
pools: ``register_mem_pool_host(anchor)``, ``register_mem_host_pool_v2(pool, name)`` for
every pool of a hybrid model, then ``on_host_pools_registered()``.

Extra-config keys (everything else is a :class:`~sglang_storage.errors.ConfigError`):

- ``storage_backend`` (required): a registered backend name (``file``, ``memory``,
  ``mooncake``, ``hf3fs``, or a plug-in's); ``storage_options``: that backend's options
  (JSON shapes, sizes like ``"64GiB"``). For ``file`` without a ``root``, SGLang's
  ``--file-storage-path`` (``file_storage_path``) is used as the root.
- ``eviction``: :class:`~sglang_storage.policy.eviction.EvictionConfig` fields, for a
  backend whose options set ``capacity_bytes`` (LRU when omitted).
- The rest of the process's settings (``storage_managers``, ``host_memory``, ...) and
  SGLang's own keys: :mod:`.runtime`, whose :func:`~.runtime.parse_settings` parses the
  extra config for every adapter.

The backend is the process's one instance of it (:func:`~.runtime.process_runtime`),
shared with the decode and embedding adapters, so a ``capacity_bytes`` cap holds across
them; :meth:`HiCacheBackend.close` releases this adapter's hold on it.

Where pages live: one :class:`~sglang_storage.core.Namespace` per registered pool. Its
model fingerprint covers the model name, the pool, the page's element type, shape and
host layout (and the DCP shard when decode context parallelism is on), so a reader
configured differently misses instead of reading wrong bytes. Its shard carries the TP,
PP and attention-CP ranks; MLA pools drop the TP coordinates (every TP rank holds the same
latent rows, so one stored page serves them all) except Mamba state, which is TP-sharded
even in MLA models (SGLang's ``HiCacheFile`` rule). The key of a page is SGLang's page
hash, as is. A stored page's payload is byte-identical to what SGLang's ``HiCacheFile``
writes for it (the flat data page); our objects add a header and checksum.

MLA single writer: on a rank where ``storage_config.is_storage_writer`` is false, writes
of TP-shared pools are skipped and reported successful, as SGLang's backends do.

Return conventions (SGLang's): ``batch_get_v1``/``batch_set_v1`` one bool per key;
``batch_exists`` the number of leading keys stored; ``batch_exists_v2`` a
``PoolTransferResult`` under the pools' hit policies (below); ``batch_get_v2``/
``batch_set_v2`` one bool list per pool. Per key, a corrupt object or a failed read/write
is a miss / ``False``. A failure of a whole call (backend closed or unreachable) is logged
and reported as all misses / ``False`` / an empty result, never raised into SGLang's
controller threads. ``clear()`` raises when it fails (SGLang's attachment reports that as
a failed clear).

Hit policies of ``batch_exists_v2`` (for ``ALL_PAGES`` and ``TRAILING_PAGES`` the same
results as SGLang's ``HiCacheFile``): the KV prefix is the leading run of stored KV pages,
and every prefix length ``1..kv`` starts restorable. ``ALL_PAGES``: pages ``[0, b)`` of
the pool are stored; prefixes up to ``b`` stay restorable. ``TRAILING_PAGES``: a prefix
``p`` stays restorable when the pool holds the last ``len(transfer.keys)`` (at least 1)
pages before ``p``. ``BLOCK_GROUPS`` (declared by SGLang 0.5.23 but used by none of its
backends; our reading of its docstring): the pool's keys (``transfer.keys``, else the KV
keys) form groups of ``group_pages`` keys from the span start, group ``g`` covering FULL
pages ``[g * block_pages, (g + 1) * block_pages)``; only groups whose block lies within
the KV prefix count, the pool's verdict is ``block_pages`` times its leading run of
complete groups, and it never narrows the restorable prefixes (it never gates the KV hit).
A pool's verdict is reported only when non-zero; once no prefix is restorable, later
pools get none.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol, TypeVar, cast

import attrs
import torch

from sglang_storage.core import (
    GetRequest,
    GetResult,
    Namespace,
    ObjectKey,
    PutRequest,
    PutResult,
)
from sglang_storage.errors import BackendUnavailableError, ConfigError, StorageError
from sglang_storage.managers import observability
from sglang_storage.managers.logs import RateLimitedLog
from sglang_storage.managers.runtime import BackendLease, StorageRuntime, kv_page_namespace
from sglang_storage.memory import tensor_bytes
from sglang_storage.policy.eviction import EvictionConfig
from sglang_storage.storage import Backend, BackendStats
from sglang_storage.storage.backend import MemoryRegistrar, count_prefix
from sglang_storage_adapters import metrics, require_supported_sglang
from sglang_storage_adapters._sglang_pools import PoolPages, SGLangHostPool
from sglang_storage_adapters.runtime import (
    RuntimeSettings,
    parse_settings,
    process_runtime,
    storage_rank_layout,
)

require_supported_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402 - after the version check
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransferResult,
)

__all__ = ["ADAPTER_NAME", "AdapterSettings", "HiCacheBackend", "parse_extra_config"]

log = logging.getLogger(__name__)
_limited: Final = RateLimitedLog(log)

ADAPTER_NAME: Final = "sglang_storage"
"""The ``backend_name`` this adapter is configured under."""

_KV: Final = "kv"
_MAMBA: Final = "mamba"
_SAFE_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,159}")
_GIB: Final = float(1 << 30)

R = TypeVar("R")


class _StorageConfig(Protocol):
    """The fields of SGLang's ``HiCacheStorageConfig`` this adapter reads."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    model_name: str | None
    should_split_heads: bool
    extra_config: dict[str, Any] | None
    dcp_size: int
    dcp_rank: int
    logical_page_size: int | None

    @property
    def is_storage_writer(self) -> bool:
        """Whether this rank writes TP-shared (MLA) pages."""
        ...


@attrs.frozen(kw_only=True)
class AdapterSettings:
    """What the extra config asks of this adapter, validated."""

    storage_backend: str
    """The registered name of the backend that stores the pages."""
    storage_options: Mapping[str, object]
    """That backend's options."""
    eviction: EvictionConfig | None
    """The eviction policy of a capacity-capped backend (``None``: LRU when capped)."""
    runtime: RuntimeSettings
    """The process's sglang_storage settings the extra config carries."""


def parse_extra_config(extra_config: Mapping[str, object] | None) -> AdapterSettings:
    """Validate SGLang's ``storage_config.extra_config`` for this adapter.

    The extra config is parsed by :func:`~.runtime.parse_settings`, the parser every
    adapter of the process uses.

    Raises:
        ConfigError: an unknown key; ``storage_backend`` missing or not a registered
            backend (the message lists those that are); ``storage_options`` or
            ``eviction`` not a mapping, or an invalid eviction setting.
    """
    settings = parse_settings(dict(extra_config or {}))
    return AdapterSettings(
        storage_backend=settings.backend,
        storage_options=settings.backend_options,
        eviction=settings.eviction,
        runtime=settings,
    )


def _pool_key(name: object) -> str:
    """A pool name as a plain string (``PoolName`` members hash by member name)."""
    value = getattr(name, "value", name)
    return str(value)


_DIGEST_PREFIX: Final = "sha256-"


def _object_name(key: str) -> str:
    """SGLang's key as an object name, a different one for every key.

    A safe key is used as is; any other key, and any key that starts like a digest name,
    becomes ``sha256-<hex of the key>``. A name kept as is never starts with the prefix,
    so it cannot be another key's digest name.
    """
    if _SAFE_NAME.fullmatch(key) and not key.startswith(_DIGEST_PREFIX):
        return key
    return _DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


_SAFE_NAMES: Final = re.compile(rf"{_SAFE_NAME.pattern}(?:/{_SAFE_NAME.pattern})*")


def _object_names(keys: Sequence[str]) -> list[str]:
    """``[_object_name(k) for k in keys]``, with one check for a batch of safe keys.

    The keys are joined with ``/`` (in no safe name) and matched once: with exactly
    ``n - 1`` separators the pieces are the keys, so a match means every key is safe, and
    no piece starting with the digest prefix means every key is kept as is. Any other
    batch is named key by key.
    """
    try:
        joined = "/".join(keys)
    except TypeError:
        return [_object_name(k) for k in keys]
    if (
        keys
        and joined.count("/") == len(keys) - 1
        and _SAFE_NAMES.fullmatch(joined)
        and not joined.startswith(_DIGEST_PREFIX)
        and f"/{_DIGEST_PREFIX}" not in joined
    ):
        return list(keys)
    return [_object_name(k) for k in keys]


@attrs.frozen(kw_only=True, eq=False)
class _Pool:
    pages: PoolPages
    namespace: Namespace | None
    shared: bool
    """The pool's pages are the same on every TP rank (only the writer rank stores them)."""

    def key(self, key: str) -> ObjectKey:
        assert self.namespace is not None  # logical pools are never keyed
        return ObjectKey(namespace=self.namespace, name=_object_name(key))

    def keys(self, keys: Sequence[str]) -> list[ObjectKey]:
        """``[self.key(k) for k in keys]``, named and built for the whole batch."""
        assert self.namespace is not None  # logical pools are never keyed
        return self.namespace.keys(_object_names(keys))


class _Metrics:
    """Thread-safe accumulation of SGLang's ``StorageMetrics``, drained by ``get_stats``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []

    def record(self, *, prefetch: bool, pages: int, nbytes: int, seconds: float) -> None:
        if not self.enabled or pages == 0:
            return
        bandwidth = nbytes / max(seconds, 1e-9) / _GIB
        with self._lock:
            if prefetch:
                self._prefetch_pgs.append(pages)
                self._prefetch_bw.append(bandwidth)
            else:
                self._backup_pgs.append(pages)
                self._backup_bw.append(bandwidth)

    def drain(self) -> Any:
        # Imported here: the metrics module is large, and only a polling tree needs it.
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._lock:
            metrics.prefetch_pgs.extend(self._prefetch_pgs)
            metrics.backup_pgs.extend(self._backup_pgs)
            metrics.prefetch_bandwidth.extend(self._prefetch_bw)
            metrics.backup_bandwidth.extend(self._backup_bw)
            self._prefetch_pgs.clear()
            self._backup_pgs.clear()
            self._prefetch_bw.clear()
            self._backup_bw.clear()
        return metrics


class HiCacheBackend(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped
    """A ``HiCacheStorage`` that stores SGLang's pages in one of our backends.

    See the module docstring for configuration, namespaces and return conventions.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``.
        kwargs: Extra arguments from SGLang's factory (an empty dict; unused).

    Raises:
        ConfigError: the extra config is invalid (see :func:`parse_extra_config`), or a
            backend option is.
        BackendUnavailableError: the backend cannot start.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, object] | None = None) -> None:
        config: _StorageConfig = storage_config
        settings = parse_extra_config(config.extra_config)
        self._settings = settings
        self._config = config
        self._writer = bool(config.is_storage_writer)
        self._model = config.model_name or ""
        if not self._model:
            log.warning(
                "sglang_storage HiCache backend: SGLang gave no model name; pages are "
                "namespaced under 'unnamed-model' and the page geometry only"
            )
            self._model = "unnamed-model"
        if config.should_split_heads:
            log.warning(
                "sglang_storage HiCache backend: tp_lcm_size head splitting (heterogeneous "
                "TP sharing) is not supported; each TP size keeps its own pages"
            )
        self._metrics = _Metrics(bool(config.enable_storage_metrics))
        self._pools: dict[str, _Pool] = {}
        self._pools_lock = threading.Lock()
        self._anchor: _Pool | None = None
        self._registered: set[int] = set()
        # The process's one instance of the backend, shared with every other adapter.
        self._runtime = process_runtime(settings.runtime)
        self._lease = self._runtime.backend(settings.storage_backend, settings.storage_options)
        self._backend: Backend = self._lease.backend
        observability.watch_backend(self._backend)
        self._closed = False
        log.info(
            "sglang_storage HiCache backend: %s backend, rank tp%d/%d pp%d/%d cp%d/%d, %s",
            settings.storage_backend,
            config.tp_rank,
            config.tp_size,
            config.pp_rank,
            config.pp_size,
            config.attn_cp_rank,
            config.attn_cp_size,
            "MLA" if config.is_mla_model else "MHA",
        )

    # ------------------------------------------------------------------ facts

    @property
    def backend(self) -> Backend:
        """The backend that stores the pages (the process's shared instance)."""
        return self._backend

    @property
    def runtime(self) -> StorageRuntime:
        """The process's storage runtime the backend comes from."""
        return self._runtime

    @property
    def lease(self) -> BackendLease:
        """This adapter's hold on the shared backend (released by :meth:`close`)."""
        return self._lease

    @property
    def settings(self) -> AdapterSettings:
        """The validated extra config."""
        return self._settings

    def namespace(self, pool_name: object = _KV) -> Namespace | None:
        """The namespace of a registered pool's pages (``None`` for a logical pool).

        Raises:
            ConfigError: no pool of that name is registered.
        """
        return self._pool(pool_name).namespace

    def object_key(self, key: str, pool_name: object = _KV) -> ObjectKey:
        """The object key SGLang's page ``key`` of pool ``pool_name`` is stored under.

        Raises:
            ConfigError: no pool of that name is registered, or it is logical.
        """
        pool = self._pool(pool_name)
        if pool.namespace is None:
            raise ConfigError(
                owner="sglang_storage HiCache backend",
                field="pool_name",
                value=_pool_key(pool_name),
                reason="is a logical pool; it stores nothing",
            )
        return pool.key(key)

    def record_transfer(self, *, prefetch: bool, pages: int, nbytes: int, seconds: float) -> None:
        """Count pages moved for this backend by someone else (the controller's pipeline).

        They appear in the next ``get_stats()`` as SGLang's prefetch or backup metrics.
        """
        self._metrics.record(prefetch=prefetch, pages=pages, nbytes=nbytes, seconds=seconds)

    def backend_stats(self) -> BackendStats:
        """Our backend's contents and counters (richer than SGLang's ``StorageMetrics``)."""
        return self._backend.stats()

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's anchor host pool (the KV pool every legacy/v1 call addresses).

        Its memory is registered with the backend when the backend asks for that
        (``Capabilities.registers_memory``, e.g. Mooncake).

        Raises:
            ConfigError: the pool's layout has no page API (``page_unified``).
            StorageError: the backend refused to register the pool's memory.
        """
        super().register_mem_pool_host(mem_pool_host)
        pool = self._describe(_KV, mem_pool_host)
        self._register_memory(pool)
        self._anchor = pool
        with self._pools_lock:
            self._pools.setdefault(_KV, pool)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take one pool of a hybrid model's host pool group (KV, Mamba, SWA, ...).

        A pool whose pages cannot be stored (no page API) is logged and refused per call
        (its transfers report ``False``), so a late sidecar cannot break a running server.
        """
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_key(host_pool_name)
        anchor = self._anchor
        if name == _KV and anchor is not None and anchor.pages.pool is host_pool:
            return
        try:
            pool = self._describe(name, host_pool)
            self._register_memory(pool)
        except StorageError as error:
            log.error(
                "sglang_storage HiCache backend: pool %s: %s; its transfers will fail", name, error
            )
            return
        with self._pools_lock:
            self._pools[name] = pool

    def on_host_pools_registered(self) -> None:
        """Finish attaching (the pools' memory was registered as each pool arrived).

        Raises:
            ConfigError: no anchor pool was registered.
        """
        if self._anchor is None:
            raise ConfigError(
                owner="sglang_storage HiCache backend",
                field="host pools",
                reason="on_host_pools_registered came before register_mem_pool_host",
            )

    def _register_memory(self, pool: _Pool) -> None:
        """Register the pool's memory once with a backend whose transport wants that."""
        if not self._backend.capabilities.registers_memory:
            return
        registrar = cast(MemoryRegistrar, self._backend)
        for ptr, memory in pool.pages.memory():
            with self._pools_lock:
                if ptr in self._registered:
                    continue
                self._registered.add(ptr)
            registrar.register_memory(memory)

    def _describe(self, name: str, host_pool: SGLangHostPool) -> _Pool:
        pages = PoolPages.describe(name, host_pool)
        config = self._config
        shared = bool(config.is_mla_model) and name != _MAMBA
        if pages.logical:
            return _Pool(pages=pages, namespace=None, shared=shared)
        spec = pages.spec
        namespace = kv_page_namespace(
            self._model,
            pool=name,
            mla=bool(config.is_mla_model),
            shared=shared,
            dtype=spec.dtype,
            shape=spec.shape,
            layout=spec.layout,
            page_size=pages.tokens_per_page,
            ranks=storage_rank_layout(config, page_size=pages.tokens_per_page),
        )
        return _Pool(pages=pages, namespace=namespace, shared=shared)

    def _pool(self, name: object) -> _Pool:
        key = _pool_key(name)
        with self._pools_lock:
            pool = self._pools.get(key)
        if pool is None:
            with self._pools_lock:
                known = ", ".join(sorted(self._pools)) or "none yet"
            raise ConfigError(
                owner="sglang_storage HiCache backend",
                field="pool",
                value=key,
                reason="is not a registered host pool",
                allowed=known,
            )
        return pool

    def _kv(self) -> _Pool:
        if self._anchor is None:
            raise ConfigError(
                owner="sglang_storage HiCache backend",
                field="host pools",
                reason="no host pool is registered yet (register_mem_pool_host)",
            )
        return self._anchor

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailableError(
                backend=ADAPTER_NAME, reason="this HiCache backend was closed"
            )

    def _skips_writes(self, pool: _Pool) -> bool:
        return pool.shared and not self._writer

    # ------------------------------------------------------------------ guarding

    def _guard(self, what: str, fallback: R, call: Callable[[], R]) -> R:
        """Run ``call``; report a failure of the whole call as ``fallback``."""
        try:
            self._check_open()
            return call()
        except StorageError as error:
            _limited.warning(
                f"call-{what.split()[0]}", "sglang_storage HiCache %s failed: %s", what, error
            )
        except Exception:
            log.exception("sglang_storage HiCache %s failed unexpectedly", what)
        return fallback

    # ------------------------------------------------------------------ moving pages

    def _get_requests(
        self, pool: _Pool, keys: Sequence[str], host_indices: torch.Tensor | None
    ) -> tuple[list[GetRequest], list[tuple[int, torch.Tensor]]]:
        """Reads of ``keys`` into the pool's pages; staged pages to commit afterwards."""
        pages = pool.pages
        starts = pages.page_starts(host_indices, len(keys))
        spec = pages.spec
        if pages.zero_copy:
            views = pages.views
            requests = [
                GetRequest(key=pool.key(k), spec=spec, buffers=views(s))
                for k, s in zip(keys, starts, strict=True)
            ]
            return requests, []
        staged = [(s, pages.staging_page()) for s in starts]
        owner = f"staging page of {pages.name!r}"
        requests = [
            GetRequest(key=pool.key(k), spec=spec, buffers=(tensor_bytes(t, owner=owner),))
            for k, (_, t) in zip(keys, staged, strict=True)
        ]
        return requests, staged

    def _put_requests(
        self, pool: _Pool, keys: Sequence[str], host_indices: torch.Tensor | None
    ) -> list[PutRequest]:
        pages = pool.pages
        starts = pages.page_starts(host_indices, len(keys))
        spec = pages.spec
        source = pages.views if pages.zero_copy else lambda s: (pages.read_copy(s),)
        return [
            PutRequest(key=pool.key(k), spec=spec, buffers=source(s))
            for k, s in zip(keys, starts, strict=True)
        ]

    def _read(
        self, batches: Sequence[tuple[_Pool, Sequence[str], torch.Tensor | None]]
    ) -> list[list[bool]]:
        """Read every batch in one backend call; one bool list per batch."""
        requests: list[GetRequest] = []
        spans: list[tuple[int, int, list[tuple[int, torch.Tensor]], _Pool]] = []
        for pool, keys, host_indices in batches:
            batch, staged = self._get_requests(pool, keys, host_indices)
            spans.append((len(requests), len(batch), staged, pool))
            requests.extend(batch)
        started = time.perf_counter()
        results: list[GetResult] = self._backend.get_into(requests) if requests else []
        elapsed = time.perf_counter() - started
        out: list[list[bool]] = []
        for first, count, staged, pool in spans:
            hits = [r.hit for r in results[first : first + count]]
            for hit, (start, page) in zip(hits, staged, strict=False):
                if hit:
                    pool.pages.commit(start, page)
            out.append(hits)
        self._metrics.record(
            prefetch=True,
            pages=len(requests),
            nbytes=sum(r.nbytes for r in results),
            seconds=elapsed,
        )
        return out

    def _write(
        self, batches: Sequence[tuple[_Pool, Sequence[str], torch.Tensor | None]]
    ) -> list[list[bool]]:
        """Write every batch in one backend call; one bool list per batch."""
        requests: list[PutRequest] = []
        spans: list[tuple[int, int]] = []
        for pool, keys, host_indices in batches:
            batch = self._put_requests(pool, keys, host_indices)
            spans.append((len(requests), len(batch)))
            requests.extend(batch)
        started = time.perf_counter()
        results: list[PutResult] = self._backend.put_from(requests) if requests else []
        elapsed = time.perf_counter() - started
        self._metrics.record(
            prefetch=False,
            pages=len(requests),
            nbytes=sum(r.nbytes for r in results),
            seconds=elapsed,
        )
        return [[r.ok for r in results[first : first + count]] for first, count in spans]

    # ------------------------------------------------------------------ v1: zero copy

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read ``keys``' pages straight into the anchor pool at ``host_indices``.

        One bool per key (SGLang uses the leading run of ``True``).
        """
        keys = list(keys)

        def call() -> list[bool]:
            pool = self._kv()
            if pool.pages.logical:
                return [True] * len(keys)
            return self._read([(pool, keys, host_indices)])[0]

        return self._guard(f"batch_get_v1 of {len(keys)} pages", [False] * len(keys), call)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the anchor pool's pages at ``host_indices`` as ``keys``; one bool per key.

        A non-writer rank of a TP-shared (MLA) pool stores nothing and reports success.
        """
        keys = list(keys)

        def call() -> list[bool]:
            pool = self._kv()
            if pool.pages.logical or self._skips_writes(pool):
                return [True] * len(keys)
            return self._write([(pool, keys, host_indices)])[0]

        return self._guard(f"batch_set_v1 of {len(keys)} pages", [False] * len(keys), call)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, have their KV page stored."""
        keys = list(keys)

        def call() -> int:
            pool = self._kv()
            if pool.pages.logical:
                return len(keys)
            return self._backend.prefix_hits(pool.keys(keys))

        return self._guard(f"batch_exists of {len(keys)} keys", 0, call)

    # ------------------------------------------------------------------ v2: multi-pool

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[Any] | None = None,
        extra_info: Any = None,
    ) -> Any:
        """The usable KV prefix and each pool's verdict under its hit policy.

        Returns SGLang's ``PoolTransferResult`` (see the module docstring for the
        policies); an empty one when the whole query fails.
        """
        keys = list(keys)
        transfers = list(pool_transfers or [])
        return self._guard(
            f"batch_exists_v2 of {len(keys)} keys",
            PoolTransferResult.empty(),
            lambda: self._exists_v2(keys, transfers),
        )

    def _exists_v2(self, keys: list[str], transfers: list[Any]) -> Any:
        kv = self._pools.get(_KV) or self._kv()
        queries: list[ObjectKey] = []
        if not kv.pages.logical:
            queries.extend(kv.keys(keys))
        # Per transfer: a slice of ``found`` to read, or a fixed answer.
        plans: list[tuple[Any, slice | list[bool]]] = []
        for transfer in transfers:
            if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS and transfer.keys:
                pool_keys = list(transfer.keys)
            else:
                pool_keys = keys
            try:
                pool = self._pool(transfer.name)
            except ConfigError as error:
                _limited.warning("exists_v2", "sglang_storage HiCache batch_exists_v2: %s", error)
                plans.append((transfer, [False] * len(pool_keys)))
                continue
            if pool.pages.logical:
                plans.append((transfer, [True] * len(pool_keys)))
                continue
            plans.append((transfer, slice(len(queries), len(queries) + len(pool_keys))))
            queries.extend(pool.keys(pool_keys))
        found = self._backend.exists(queries) if queries else []
        kv_pages = len(keys) if kv.pages.logical else count_prefix(found[: len(keys)])

        hit_count: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        if not restorable:
            return PoolTransferResult(0, hit_count, [])
        for transfer, plan in plans:
            if not restorable:
                break
            present = found[plan] if isinstance(plan, slice) else plan
            boundary, allowed = _apply_policy(transfer, present, kv_pages)
            if boundary:
                hit_count[transfer.name] = boundary
            if allowed is not None:
                restorable = [p for p in restorable if p in allowed]
        final_pages = restorable[-1] if restorable else 0
        return PoolTransferResult(final_pages, hit_count, restorable)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read each transfer's pages into its pool; one bool list per pool name."""
        return self._io_v2("batch_get_v2", list(transfers), write=False)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's pages from its pool; one bool list per pool name.

        TP-shared pools on a non-writer rank store nothing and report success.
        """
        return self._io_v2("batch_set_v2", list(transfers), write=True)

    def _io_v2(self, what: str, transfers: list[Any], *, write: bool) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        batches: list[tuple[Any, tuple[_Pool, Sequence[str], torch.Tensor | None]]] = []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            try:
                pool = self._pool(transfer.name)
                if pool.pages.logical or (write and self._skips_writes(pool)):
                    results[transfer.name] = [True] * len(keys)
                    continue
                # Check the indices now, so one bad transfer fails alone.
                pool.pages.page_starts(transfer.host_indices, len(keys))
            except ConfigError as error:
                _limited.warning(f"pool-{what}", "sglang_storage HiCache %s: %s", what, error)
                results[transfer.name] = [False] * len(keys)
                continue
            if keys:
                batches.append((transfer.name, (pool, keys, transfer.host_indices)))
            else:
                results[transfer.name] = []
        if batches:
            move = self._write if write else self._read
            lists = self._guard(
                f"{what} of {sum(len(b[1][1]) for b in batches)} pages",
                [[False] * len(b[1][1]) for b in batches],
                lambda: move([b[1] for b in batches]),
            )
            for (name, _), flags in zip(batches, lists, strict=True):
                results[name] = flags
        return {t.name: results[t.name] for t in transfers if t.name in results}

    # ------------------------------------------------------------------ v0: generic

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Read ``key``'s KV page into ``target_location`` (a flat page tensor).

        Returns the filled tensor (a new one when none is given), or ``None`` on a miss.
        """
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read KV pages into flat page tensors (SGLang's generic path).

        ``target_locations`` are SGLang's ``get_dummy_flat_data_page()`` tensors (new ones
        are made when omitted). Returns each filled tensor, or ``None`` for a miss.
        """
        keys = list(keys)

        def call() -> list[torch.Tensor | None]:
            pool = self._kv()
            pages = pool.pages
            targets: list[torch.Tensor] = (
                list(target_locations)
                if target_locations is not None
                else [pages.staging_page() for _ in keys]
            )
            requests: list[GetRequest] = []
            slots: list[int] = []
            for i, (key, target) in enumerate(zip(keys, targets, strict=True)):
                try:
                    view = tensor_bytes(target, owner="batch_get target")
                    requests.append(GetRequest(key=pool.key(key), spec=pages.spec, buffers=(view,)))
                except ConfigError as error:
                    _limited.warning(
                        "batch_get-page",
                        "sglang_storage HiCache batch_get: page %s: %s",
                        key,
                        error,
                    )
                    continue
                slots.append(i)
            started = time.perf_counter()
            results = self._backend.get_into(requests) if requests else []
            elapsed = time.perf_counter() - started
            self._metrics.record(
                prefetch=True,
                pages=len(requests),
                nbytes=sum(r.nbytes for r in results),
                seconds=elapsed,
            )
            out: list[torch.Tensor | None] = [None] * len(keys)
            for slot, result in zip(slots, results, strict=True):
                if result.hit:
                    out[slot] = targets[slot]
            return out

        return self._guard(f"batch_get of {len(keys)} pages", [None] * len(keys), call)

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store one flat KV page tensor as ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat KV page tensors (SGLang's generic path); ``True`` when all are stored.

        A non-writer rank of a TP-shared (MLA) pool stores nothing and reports success.
        """
        keys = list(keys)

        def call() -> bool:
            pool = self._kv()
            if pool.pages.logical or self._skips_writes(pool):
                return True
            tensors: list[torch.Tensor] = list(values or [])
            if len(tensors) != len(keys):
                raise ConfigError(
                    owner="sglang_storage HiCache batch_set",
                    field="values",
                    value=len(tensors),
                    reason="must hold one page tensor per key",
                    allowed=str(len(keys)),
                )
            requests = [
                PutRequest(
                    key=pool.key(key),
                    spec=pool.pages.spec,
                    buffers=(tensor_bytes(value.contiguous(), owner="batch_set value"),),
                )
                for key, value in zip(keys, tensors, strict=True)
            ]
            started = time.perf_counter()
            results = self._backend.put_from(requests) if requests else []
            self._metrics.record(
                prefetch=False,
                pages=len(requests),
                nbytes=sum(r.nbytes for r in results),
                seconds=time.perf_counter() - started,
            )
            return all(r.ok for r in results)

        return self._guard(f"batch_set of {len(keys)} pages", False, call)

    def exists(self, key: str) -> bool:
        """Whether ``key``'s KV page is stored."""
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ housekeeping

    def clear(self) -> None:
        """Remove every page of this rank's namespaces (MLA's are shared by all TP ranks).

        Raises:
            StorageError: the backend failed to clear (SGLang reports the clear failed).
        """
        self._check_open()
        with self._pools_lock:
            namespaces = {p.namespace for p in self._pools.values() if p.namespace is not None}
        for namespace in sorted(namespaces, key=str):
            self._backend.clear(namespace)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (empty unless metrics are on).

        SGLang's tree calls it on every ``check_hicache_events`` when metrics are on;
        each call also refreshes this process's sglang_storage series for ``/metrics``
        (at most once a second, see :mod:`.metrics`).
        """
        metrics.refresh()
        return self._metrics.drain()

    def close(self) -> None:
        """Release the shared backend (the last user closes it); later calls report misses.

        Closing twice is a no-op.
        """
        self._closed = True
        observability.SOURCES.capture(self._backend)  # its counts, should this close it
        self._lease.release()


def _apply_policy(
    transfer: Any, present: Sequence[bool], kv_pages: int
) -> tuple[int, set[int] | None]:
    """A pool's verdict (its boundary in pages) and the prefixes it leaves restorable.

    ``None`` for the prefixes means the pool does not narrow them (``BLOCK_GROUPS``).

    Raises:
        ConfigError: an unknown hit policy.
    """
    policy = transfer.hit_policy
    if policy == PoolHitPolicy.ALL_PAGES:
        boundary = count_prefix(present[:kv_pages])
        return boundary, set(range(1, boundary + 1))
    if policy == PoolHitPolicy.TRAILING_PAGES:
        trailing = max(1, len(transfer.keys) if transfer.keys else 1)
        allowed = {p for p in range(1, kv_pages + 1) if all(present[max(0, p - trailing) : p])}
        return max(allowed, default=0), allowed
    if policy == PoolHitPolicy.BLOCK_GROUPS:
        block, group = int(transfer.block_pages), int(transfer.group_pages)
        if block <= 0 or group <= 0:
            _limited.warning(
                f"block-groups-{transfer.name}",
                "sglang_storage HiCache batch_exists_v2: pool %s has BLOCK_GROUPS with "
                "block_pages=%d, group_pages=%d; both must be >= 1, so it gets no verdict",
                transfer.name,
                block,
                group,
            )
            return 0, None
        complete = 0
        for g in range(min(kv_pages // block, len(present) // group)):
            if not all(present[g * group : (g + 1) * group]):
                break
            complete += 1
        return complete * block, None
    raise ConfigError(
        owner="sglang_storage HiCache batch_exists_v2",
        field="hit_policy",
        value=policy,
        reason="is not a known hit policy",
        allowed=", ".join(p.value for p in PoolHitPolicy),
    )
