"""Backends by name: the built-in ones and third-party ones from an entry point group.

A backend is described by a :class:`BackendEntry`: its name, its frozen attrs config class
and a factory. :func:`create_backend` builds one from a name and options (a mapping such
as parsed JSON, or a config instance); unknown names and bad options are
:class:`~sglang_storage.errors.ConfigError` s that list what exists or what is allowed.

Third-party packages add backends through the ``sglang_storage.backends`` entry point
group; each entry point names a :class:`BackendEntry` (or a function returning one)::

    [project.entry-points."sglang_storage.backends"]
    mystore = "mypackage.store:ENTRY"
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final, Generic, TypeVar

import attrs

from sglang_storage.config import build_config, non_empty_str
from sglang_storage.core import EvictionPolicy, ObjectKey
from sglang_storage.errors import BackendUnavailableError, ConfigError
from sglang_storage.storage.backend import Backend
from sglang_storage.storage.dram import MemoryBackend, MemoryBackendConfig
from sglang_storage.storage.faults import FaultInjectingBackend, FaultyBackendConfig
from sglang_storage.storage.file import FileBackend, FileBackendConfig
from sglang_storage.storage.hf3fs import Hf3fsBackend, Hf3fsBackendConfig
from sglang_storage.storage.mooncake import MooncakeBackend, MooncakeBackendConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendContext",
    "BackendEntry",
    "backend_entry",
    "backend_names",
    "create_backend",
    "register_backend",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP: Final = "sglang_storage.backends"

C = TypeVar("C", bound=attrs.AttrsInstance)


@attrs.frozen(kw_only=True)
class BackendContext:
    """What a backend is handed besides its own options."""

    eviction: EvictionPolicy[ObjectKey] | None = None
    """The eviction policy for a capacity-bounded backend (built by the caller, since the
    policy layer sits above storage)."""


@attrs.frozen(kw_only=True)
class BackendEntry(Generic[C]):
    """A registrable backend: name, config class and factory."""

    name: str = attrs.field(validator=non_empty_str)
    config_type: type[C]
    """A frozen attrs class; options are built into it with ``build_config``."""
    factory: Callable[[C, BackendContext], Backend]
    summary: str = ""
    """One line for listings (``sglang-storage stats``, errors naming what exists)."""
    test_only: bool = False
    """A backend for tests and drills (``faulty``): usable by name, but left out of
    listings unless they ask for test backends (``backend_names(test_backends=True)``)."""


_lock = threading.Lock()
_entries: dict[str, BackendEntry[Any]] = {}
_broken: dict[str, str] = {}
_plugins_loaded = False


def register_backend(entry: BackendEntry[Any], *, replace: bool = False) -> None:
    """Make ``entry`` available by its name.

    Raises:
        ConfigError: the name is taken and ``replace`` is false.
    """
    with _lock:
        if entry.name in _entries and not replace:
            raise ConfigError(
                owner="backend registry",
                field="name",
                value=entry.name,
                reason="is already registered (pass replace=True to override it)",
                allowed=", ".join(sorted(_entries)),
            )
        _entries[entry.name] = entry


def backend_names(*, test_backends: bool = False) -> list[str]:
    """The names of the available backends, sorted.

    Args:
        test_backends: Include the test-only ones (:attr:`BackendEntry.test_only`), which
            :func:`backend_entry` and :func:`create_backend` accept by name either way.
    """
    _load_plugins()
    with _lock:
        return sorted(n for n, e in _entries.items() if test_backends or not e.test_only)


def backend_entry(name: str) -> BackendEntry[Any]:
    """The entry registered as ``name``.

    Raises:
        ConfigError: no backend has that name (the message lists those that exist).
        BackendUnavailableError: a plug-in registered the name but failed to load.
    """
    _load_plugins()
    with _lock:
        entry = _entries.get(name)
        broken = _broken.get(name)
        known = ", ".join(sorted(n for n, e in _entries.items() if not e.test_only))
    if entry is not None:
        return entry
    if broken is not None:
        raise BackendUnavailableError(backend=name, reason=broken)
    raise ConfigError(
        owner="backend registry",
        field="name",
        value=name,
        reason="is not a known backend",
        allowed=known,
    )


def create_backend(
    name: str,
    options: Mapping[str, object] | attrs.AttrsInstance | None = None,
    *,
    eviction: EvictionPolicy[ObjectKey] | None = None,
) -> Backend:
    """Build the backend called ``name``.

    Args:
        name: A registered backend name (see :func:`backend_names`).
        options: Its config, as an instance of its config class or as a mapping of option
            names to values (JSON shapes accepted; sizes like ``"64GiB"``).
        eviction: The eviction policy a capacity cap needs.

    Raises:
        ConfigError: unknown name, unknown or invalid options.
        BackendUnavailableError: the backend cannot start (missing dependency, unusable
            directory, unreachable service).
    """
    entry = backend_entry(name)
    if options is None:
        options = {}
    if isinstance(options, Mapping):
        config = build_config(entry.config_type, options, owner=f"{name} backend options")
    elif isinstance(options, entry.config_type):
        config = options
    else:
        raise ConfigError(
            owner=f"{name} backend",
            field="options",
            value=type(options).__name__,
            reason="is neither a mapping nor the backend's config class",
            allowed=f"a mapping, or {entry.config_type.__name__}",
        )
    return entry.factory(config, BackendContext(eviction=eviction))


def _load_plugins() -> None:
    global _plugins_loaded
    with _lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = point.load()
            entry = loaded if isinstance(loaded, BackendEntry) else loaded()
            if not isinstance(entry, BackendEntry):
                raise TypeError(f"{point.value} is not a BackendEntry")
            if entry.name != point.name:
                raise ValueError(f"entry point {point.name!r} names backend {entry.name!r}")
            register_backend(entry)
        except Exception as error:  # noqa: BLE001 - a broken plug-in must not break the rest
            reason = f"plug-in {point.value!r} failed to load: {type(error).__name__}: {error}"
            log.warning("sglang_storage: %s", reason)
            with _lock:
                _broken[point.name] = reason


def _memory(config: MemoryBackendConfig, context: BackendContext) -> Backend:
    return MemoryBackend(config, eviction=context.eviction)


def _file(config: FileBackendConfig, context: BackendContext) -> Backend:
    return FileBackend(config, eviction=context.eviction)


def _hf3fs(config: Hf3fsBackendConfig, context: BackendContext) -> Backend:
    return Hf3fsBackend(config, eviction=context.eviction)


def _mooncake(config: MooncakeBackendConfig, context: BackendContext) -> Backend:
    return MooncakeBackend(config, eviction=context.eviction)


def _faulty(config: FaultyBackendConfig, context: BackendContext) -> Backend:
    inner = create_backend(config.inner, config.inner_options, eviction=context.eviction)
    try:
        return FaultInjectingBackend(inner, config.schedule)
    except ConfigError:
        inner.close()
        raise


register_backend(
    BackendEntry(
        name="memory",
        config_type=MemoryBackendConfig,
        factory=_memory,
        summary="in-process DRAM; single process and tests",
    )
)
register_backend(
    BackendEntry(
        name="file",
        config_type=FileBackendConfig,
        factory=_file,
        summary="one self-checking file per object under a local directory (the default)",
    )
)
register_backend(
    BackendEntry(
        name="mooncake",
        config_type=MooncakeBackendConfig,
        factory=_mooncake,
        summary="a Mooncake Store cluster (DRAM of many hosts, TCP or RDMA)",
    )
)
register_backend(
    BackendEntry(
        name="hf3fs",
        config_type=Hf3fsBackendConfig,
        factory=_hf3fs,
        summary="slots in large preallocated files on a 3FS mount (usrbio client or POSIX)",
    )
)
register_backend(
    BackendEntry(
        name="faulty",
        config_type=FaultyBackendConfig,
        factory=_faulty,
        summary="another backend with seeded injected faults (reliability tests, drills)",
        test_only=True,
    )
)
