"""The ``--storage-*`` settings of a running SGLang process, and its one storage runtime.

The flags (:mod:`.flags`) travel inside SGLang's own ``ServerArgs``, as the
``--hicache-storage-backend-extra-config`` of the ``dynamic`` backend, so every process
SGLang starts (schedulers, encoder ranks, decode workers) sees them.

- :func:`parse_settings` - the one parser of that extra config: every adapter (and the
  HiCache backend SGLang's ``dynamic`` seam builds) reads its settings through it.
- :func:`runtime_settings` - the settings SGLang's ``ServerArgs`` carry, or ``None`` when
  sglang_storage is not configured (then adapters leave SGLang unchanged).
- :func:`process_runtime` - the process's
  :class:`~sglang_storage.managers.runtime.StorageRuntime` for those settings, built once:
  every adapter takes its host memory (``runtime.host_memory(component)``), its backend
  (``runtime.backend(settings.backend, settings.backend_options)``, one shared instance,
  capped with an eviction policy) and its pipelines (``runtime.storage_pipeline(lease)``)
  from it.
- :func:`storage_rank_layout` / :func:`process_rank_layout` - the rank coordinates KV pages
  are placed by, from SGLang's ``HiCacheStorageConfig`` or from the process's parallel
  state (the same values SGLang's ``_generate_storage_config`` puts in that config), for
  :func:`~sglang_storage.managers.runtime.kv_page_namespace`.

Extra-config keys (any other is a :class:`~sglang_storage.errors.ConfigError`):
``storage_backend`` (required), ``storage_options``, ``storage_managers``, ``eviction``
(the policy of a capped backend), ``host_memory`` (the process's host memory budget; when
absent, what the components ask, up to the host's share per rank), ``host_reservations``
(bytes per component: ``kv``, ``decode``, ``sparse``, ``embedding``, ``experts``,
``weights``, ``engram``, ``records``),
``storage_load_policy`` (read by the HiCache controller), ``storage_log_level`` (the
sglang_storage loggers' level, applied when the runtime is built), ``storage_records_transport``
(``store`` or ``sglang``, read by the records adapter); and SGLang's own
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ``allocator``,
``file_storage_path``, ``prefetch_*``, ``hicache_storage_pass_prefix_keys``,
``tp_lcm_size``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import types
from collections.abc import Mapping
from typing import Any, Final

import attrs

from sglang_storage.config import (
    BYTES,
    build_config,
    int_in_range,
    non_empty_str,
    one_of,
    optional,
    tuple_of,
)
from sglang_storage.config import non_negative_int as _non_negative_int
from sglang_storage.errors import ConfigError
from sglang_storage.managers.logs import LOG_LEVELS, apply_log_level
from sglang_storage.managers.observability import SOURCES, runtime_families
from sglang_storage.managers.runtime import COMPONENTS, RankLayout, RuntimeConfig, StorageRuntime
from sglang_storage.policy.eviction import EvictionConfig
from sglang_storage.storage import backend_entry, backend_names
from sglang_storage.units import format_bytes, parse_bytes
from sglang_storage_adapters.flags import (
    DYNAMIC_BACKEND_NAME,
    LOAD_POLICIES,
    MANAGER_NAMES,
    RECORDS_STAGING_MIN,
    RECORDS_TRANSPORTS,
)

__all__ = [
    "RuntimeSettings",
    "close_process_runtimes",
    "parse_settings",
    "process_rank_layout",
    "process_runtime",
    "published_settings",
    "runtime_settings",
    "storage_rank_layout",
]

log = logging.getLogger(__name__)

_OWNER: Final = "sglang_storage runtime settings (--hicache-storage-backend-extra-config)"
_DEFAULT_MANAGERS: Final = ("kv",)
_SGLANG_KEYS: Final = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "allocator",
        "file_storage_path",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
_OUR_KEYS: Final = frozenset(
    {
        "storage_backend",
        "storage_options",
        "storage_managers",
        "eviction",
        "host_memory",
        "host_reservations",
        "storage_load_policy",
        "storage_log_level",
        "storage_records_transport",
        "storage_records_staging",
    }
)


def _frozen(options: Mapping[str, object]) -> Mapping[str, object]:
    return types.MappingProxyType(dict(options))


@attrs.frozen(kw_only=True)
class RuntimeSettings:
    """Which backend stores data, which managers serve SGLang, and the host memory budget."""

    backend: str = attrs.field(validator=non_empty_str)
    """The registered sglang_storage backend name (``--storage-backend``)."""
    backend_options: Mapping[str, object] = attrs.field(factory=dict, converter=_frozen)
    """Its options (``--storage-backend-config``), as JSON shapes; a ``file`` backend
    without ``root`` has SGLang's ``--file-storage-path`` as its root."""
    managers: tuple[str, ...] = attrs.field(
        default=_DEFAULT_MANAGERS, validator=tuple_of(one_of(*MANAGER_NAMES))
    )
    """The data-kind managers switched on (``--storage-managers``)."""
    eviction: EvictionConfig | None = None
    """The eviction policy of a capped backend (``None``: LRU)."""
    host_memory: int | None = attrs.field(
        default=None, metadata=BYTES, validator=optional(_non_negative_int)
    )
    """The process's host memory budget in bytes (``None``: the components' asks)."""
    host_reservations: tuple[tuple[str, int], ...] = ()
    """Bytes reserved per component, as ``(component, bytes)`` pairs."""
    load_policy: str = attrs.field(default="always", validator=one_of(*LOAD_POLICIES))
    """Which storage hits the HiCache controller prefetches (``--storage-load-policy``)."""
    log_level: str | None = attrs.field(default=None, validator=optional(one_of(*LOG_LEVELS)))
    """The sglang_storage loggers' level (``--storage-log-level``; SGLang's when None)."""
    records_transport: str = attrs.field(default="store", validator=one_of(*RECORDS_TRANSPORTS))
    """How RL top-k records reach the client (``--storage-records-transport``)."""
    records_staging: int | None = attrs.field(
        default=None, metadata=BYTES, validator=optional(int_in_range(low=RECORDS_STAGING_MIN))
    )
    """Host bytes for records on their way to storage (``--storage-records-staging``;
    ``None``: the records adapter's default)."""

    def enabled(self, manager: str) -> bool:
        """Whether ``manager`` (one of :data:`~.flags.MANAGER_NAMES`) is switched on."""
        if manager not in MANAGER_NAMES:
            raise ConfigError(
                owner=_OWNER,
                field="manager",
                value=manager,
                reason="is not a sglang_storage manager",
                allowed=", ".join(MANAGER_NAMES),
            )
        return manager in self.managers

    def runtime_config(self, *, ranks_per_host: int = 1) -> RuntimeConfig:
        """The storage runtime these settings ask for, on a host shared by that many ranks.

        Raises:
            ConfigError: the reservations do not fit in ``host_memory``.
        """
        reserved = dict(self.host_reservations)
        try:
            return RuntimeConfig(
                host_memory=self.host_memory,
                kv=reserved.get("kv", 0),
                decode=reserved.get("decode", 0),
                sparse=reserved.get("sparse", 0),
                embedding=reserved.get("embedding", 0),
                experts=reserved.get("experts", 0),
                weights=reserved.get("weights", 0),
                engram=reserved.get("engram", 0),
                records=reserved.get("records", 0),
                eviction=self.eviction,
                ranks_per_host=ranks_per_host,
            )
        except ConfigError as error:
            raise error.renamed(owner=_OWNER) from None


def parse_settings(
    extra: Mapping[str, object], *, file_storage_path: str | None = None
) -> RuntimeSettings:
    """Validate the extra config that names sglang_storage (SGLang's ``extra_config``).

    ``file_storage_path`` (SGLang's ``--file-storage-path``) is the ``file`` backend's
    root when neither the options nor the extra config's own ``file_storage_path`` give one.

    Raises:
        ConfigError: an unknown key; ``storage_backend`` missing or not a registered
            backend (the message lists those that are); ``storage_options``, ``eviction``
            or ``host_reservations`` not an object; unknown managers, components or an
            invalid eviction setting or size.
    """
    unknown = sorted(set(extra) - _SGLANG_KEYS - _OUR_KEYS)
    if unknown:
        raise ConfigError(
            owner=_OWNER,
            field=", ".join(unknown),
            reason="unknown key" + ("s" if len(unknown) > 1 else ""),
            allowed=", ".join(sorted(_SGLANG_KEYS | _OUR_KEYS)),
        )
    backend = extra.get("storage_backend")
    if not isinstance(backend, str) or not backend:
        missing = "storage_backend" not in extra
        raise ConfigError(
            owner=_OWNER,
            field="storage_backend",
            value=None if missing else backend,
            reason=(
                "is required: the sglang_storage backend that stores the pages"
                if missing
                else "must name the sglang_storage backend that stores the pages"
            ),
            allowed=f"a registered backend name: {', '.join(backend_names())}",
        )
    try:
        backend_entry(backend)
    except ConfigError as error:
        raise error.renamed(owner=_OWNER, field="storage_backend") from None
    options = extra.get("storage_options", {})
    if not isinstance(options, Mapping):
        raise ConfigError(
            owner=_OWNER,
            field="storage_options",
            value=options,
            reason="must be a mapping of the backend's option names to values",
            allowed='a JSON object, e.g. {"root": "/path"}',
        )
    options = dict(options)
    path = extra.get("file_storage_path") or file_storage_path
    if backend == "file" and "root" not in options and isinstance(path, str) and path:
        options["root"] = path  # SGLang's --file-storage-path
    managers = extra.get("storage_managers", list(_DEFAULT_MANAGERS))
    if not isinstance(managers, list | tuple):
        raise ConfigError(
            owner=_OWNER,
            field="storage_managers",
            value=managers,
            reason="must be a list of manager names",
            allowed=", ".join(MANAGER_NAMES),
        )
    eviction = _eviction(extra.get("eviction"))
    host_memory = extra.get("host_memory")
    try:
        return RuntimeSettings(
            backend=backend,
            backend_options=options,
            managers=tuple(managers),
            eviction=eviction,
            host_memory=None if host_memory is None else _size(host_memory, "host_memory"),
            host_reservations=_reservations(extra.get("host_reservations")),
            load_policy=extra.get("storage_load_policy", "always"),  # type: ignore[arg-type]
            log_level=extra.get("storage_log_level"),  # type: ignore[arg-type]
            records_transport=extra.get(  # type: ignore[arg-type]
                "storage_records_transport", "store"
            ),
            records_staging=_optional_size(extra, "storage_records_staging"),
        )
    except ConfigError as error:
        raise error.renamed(owner=_OWNER) from None


def _eviction(data: object) -> EvictionConfig | None:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ConfigError(
            owner=_OWNER,
            field="eviction",
            value=data,
            reason="must be a mapping of eviction settings",
            allowed='a JSON object, e.g. {"name": "lru"}',
        )
    return build_config(EvictionConfig, data, owner=f"{_OWNER}.eviction")


def _size(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            owner=_OWNER,
            field=field,
            value=value,
            reason="must be a size in bytes",
            allowed='an int, or a string such as "64GiB"',
        )
    return value if isinstance(value, int) else parse_bytes(value, owner=_OWNER, field=field)


def _optional_size(extra: Mapping[str, object], field: str) -> int | None:
    value = extra.get(field)
    return None if value is None else _size(value, field)


def _reservations(data: object) -> tuple[tuple[str, int], ...]:
    if data is None:
        return ()
    if not isinstance(data, Mapping) or not all(name in COMPONENTS for name in data):
        raise ConfigError(
            owner=_OWNER,
            field="host_reservations",
            value=data,
            reason="must map components to the bytes reserved for them",
            allowed=f"a JSON object with keys among {', '.join(COMPONENTS)}",
        )
    return tuple(
        (name, _size(data[name], f"host_reservations.{name}"))
        for name in COMPONENTS
        if name in data
    )


def runtime_settings(server_args: object) -> RuntimeSettings | None:
    """The sglang_storage settings ``server_args`` (SGLang's ``ServerArgs``) carry.

    ``None`` when sglang_storage is not configured: the HiCache storage backend is not
    ``dynamic``, or its extra config names another backend.

    Raises:
        ConfigError: the extra config is not a JSON object, or names sglang_storage with
            settings :func:`parse_settings` refuses.
    """
    if getattr(server_args, "hicache_storage_backend", None) != "dynamic":
        return None
    raw = getattr(server_args, "hicache_storage_backend_extra_config", None)
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            extra = json.loads(raw)
        except (ValueError, RecursionError) as error:
            raise ConfigError(
                owner=_OWNER,
                field="hicache_storage_backend_extra_config",
                value=raw,
                reason=f"is not JSON ({error})",
                allowed="a JSON object",
            ) from None
    else:
        extra = raw
    if not isinstance(extra, Mapping):
        raise ConfigError(
            owner=_OWNER,
            field="hicache_storage_backend_extra_config",
            value=raw,
            reason="is not an object",
            allowed="a JSON object",
        )
    if extra.get("backend_name") != DYNAMIC_BACKEND_NAME:
        return None
    path = getattr(server_args, "file_storage_path", None)
    if path is None:
        path = _published_file_storage_path()
    return parse_settings(extra, file_storage_path=path if isinstance(path, str) else None)


def published_settings() -> RuntimeSettings | None:
    """This process's settings from SGLang's resolved ``memory`` namespace, or ``None``.

    ``None`` when SGLang has published no configuration in this process or sglang_storage
    is not on. Where SGLang's own components read ``hicache_storage_backend*`` (decode
    offload, HiSparse, the NPU sparse manager), the adapters read them too.

    Raises:
        ConfigError: as :func:`runtime_settings`.
    """
    from sglang.srt.runtime_context import get_memory

    try:
        memory = get_memory()
    except ValueError:  # SGLang's "config namespace ... not published"
        return None
    return runtime_settings(memory)


def _published_file_storage_path() -> str | None:
    """SGLang's ``--file-storage-path`` of this process (SGLang's namespaces lack it)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        path = get_server_args().file_storage_path
    except (ValueError, AttributeError):  # no server args published
        return None
    return path if isinstance(path, str) and path else None


# ---------------------------------------------------------------------- the runtime

_RUNTIMES: dict[RuntimeConfig, StorageRuntime] = {}
_runtimes_lock = threading.Lock()


def process_runtime(
    settings: RuntimeSettings, *, ranks_per_host: int | None = None
) -> StorageRuntime:
    """This process's storage runtime for ``settings`` (built on first use, then shared).

    Every adapter of a process gets the same runtime, hence one budget and one instance
    of each backend. The budget's ``ranks_per_host`` is SGLang's (launch ranks per node)
    unless given: a process of which the host runs one (the elastic-EP expert holder)
    passes 1.

    Raises:
        ConfigError: the reservations do not fit in ``host_memory``.
        CapacityError: ``host_memory`` exceeds this rank's share of the host.
    """
    key = settings.runtime_config()  # the runtime's identity: all but the host's rank count
    with _runtimes_lock:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            if settings.log_level is not None:
                apply_log_level(settings.log_level)
            ranks = _ranks_per_host() if ranks_per_host is None else ranks_per_host
            runtime = StorageRuntime(settings.runtime_config(ranks_per_host=ranks))
            if not _RUNTIMES:
                atexit.register(close_process_runtimes)
            _RUNTIMES[key] = runtime
            SOURCES.add(runtime, runtime_families)
            log.info("%s", startup_line(settings, runtime))
        return runtime


def close_process_runtimes() -> None:
    """Close this process's storage runtimes: queued writes drain (bounded), backends close.

    Registered with :mod:`atexit` when the first runtime is built, so a scheduler that
    exits normally does not drop the backups it had queued. Later adapters build anew.
    """
    with _runtimes_lock:
        runtimes = list(_RUNTIMES.values())
        _RUNTIMES.clear()
    for runtime in runtimes:
        try:
            runtime.close()
        except Exception:  # at exit: one runtime's failure must not keep the next open
            log.exception("closing the storage runtime failed")


def startup_line(settings: RuntimeSettings, runtime: StorageRuntime) -> str:
    """The one line a process logs when its storage runtime starts: what serves, and where."""
    options = settings.backend_options
    where = ""
    for option in ("root", "master_address", "metadata_server"):
        if options.get(option):
            where += f" {option}={options[option]}"
    budget = runtime.budget.stats().total
    reserved = ", ".join(f"{name} {format_bytes(n)}" for name, n in settings.host_reservations)
    return (
        f"sglang_storage on (pid {os.getpid()}): managers {','.join(settings.managers)}; "
        f"backend {settings.backend}{where}; host memory budget {format_bytes(budget)}"
        + (f" (reserved: {reserved})" if reserved else "")
        + f"; load policy {settings.load_policy}"
    )


def _ranks_per_host() -> int:
    from sglang.srt.mem_cache.pool_host.base import ranks_per_host

    return int(ranks_per_host())


def storage_rank_layout(storage_config: Any, *, page_size: int) -> RankLayout:
    """The rank coordinates SGLang's ``HiCacheStorageConfig`` gives a storage backend."""
    dcp_size = int(getattr(storage_config, "dcp_size", 1) or 1)
    return RankLayout(
        tp_rank=int(storage_config.tp_rank),
        tp_size=int(storage_config.tp_size),
        pp_rank=int(storage_config.pp_rank),
        pp_size=int(storage_config.pp_size),
        cp_rank=int(storage_config.attn_cp_rank),
        cp_size=int(storage_config.attn_cp_size),
        dcp_rank=int(getattr(storage_config, "dcp_rank", 0) or 0) if dcp_size > 1 else 0,
        dcp_size=dcp_size,
        logical_page_size=(storage_config.logical_page_size or page_size) if dcp_size > 1 else None,
    )


def process_rank_layout(*, page_size: int, tp_rank: int, tp_size: int) -> RankLayout:
    """This process's rank coordinates, as SGLang's ``_generate_storage_config`` takes them.

    TP is the attention-TP group's under DP attention, else the TP group's; PP, attention
    CP and decode CP come from SGLang's parallel state. ``tp_rank``/``tp_size`` (the
    caller's group) stand in where SGLang has written no ranks (a single-rank process).
    """
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()

    def read(name: str, default: int) -> int:
        try:
            return int(getattr(parallel, name))
        except (RuntimeError, ValueError, AttributeError):  # not written in this process
            return default

    try:
        dp_attention = bool(is_dp_attention_enabled())
    except (RuntimeError, ValueError, AttributeError):
        dp_attention = False
    tp = ("attn_tp_rank", "attn_tp_size") if dp_attention else ("tp_rank", "tp_size")
    dcp_size = read("attn_dcp_size", 1)
    return RankLayout(
        tp_rank=read(tp[0], tp_rank),
        tp_size=read(tp[1], tp_size),
        pp_rank=read("pp_rank", 0),
        pp_size=read("pp_size", 1),
        cp_rank=read("attn_cp_rank", 0),
        cp_size=read("attn_cp_size", 1),
        dcp_rank=read("attn_dcp_rank", 0) if dcp_size > 1 else 0,
        dcp_size=dcp_size,
        logical_page_size=page_size if dcp_size > 1 else None,
    )
