"""The ``--storage-*`` settings a running SGLang process was started with.

The flags (:mod:`.flags`) travel inside SGLang's own ``ServerArgs``, as the
``--hicache-storage-backend-extra-config`` of the ``dynamic`` backend, so every process
SGLang starts (schedulers, encoder ranks, decode workers) sees them. Adapters ask
:func:`runtime_settings` whether sglang_storage is on and which managers it serves; when
it returns ``None`` they leave SGLang's behaviour unchanged.
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping
from typing import Final

import attrs

from sglang_storage.config import non_empty_str, one_of, tuple_of
from sglang_storage.errors import ConfigError
from sglang_storage_adapters.flags import DYNAMIC_BACKEND_NAME, MANAGER_NAMES

__all__ = ["RuntimeSettings", "runtime_settings"]

_OWNER: Final = "sglang_storage runtime settings (--hicache-storage-backend-extra-config)"
_DEFAULT_MANAGERS: Final = ("kv",)


def _frozen(options: Mapping[str, object]) -> Mapping[str, object]:
    return types.MappingProxyType(dict(options))


@attrs.frozen(kw_only=True)
class RuntimeSettings:
    """Which backend stores data and which managers serve SGLang in this process."""

    backend: str = attrs.field(validator=non_empty_str)
    """The registered sglang_storage backend name (``--storage-backend``)."""
    backend_options: Mapping[str, object] = attrs.field(factory=dict, converter=_frozen)
    """Its options (``--storage-backend-config``), as JSON shapes."""
    managers: tuple[str, ...] = attrs.field(
        default=_DEFAULT_MANAGERS, validator=tuple_of(one_of(*MANAGER_NAMES))
    )
    """The data-kind managers switched on (``--storage-managers``)."""

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


def runtime_settings(server_args: object) -> RuntimeSettings | None:
    """The sglang_storage settings ``server_args`` (SGLang's ``ServerArgs``) carry.

    ``None`` when sglang_storage is not configured: the HiCache storage backend is not
    ``dynamic``, or its extra config names another backend.

    Raises:
        ConfigError: the extra config is not a JSON object, or names sglang_storage with
            a missing backend or unknown managers.
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
    managers = extra.get("storage_managers", list(_DEFAULT_MANAGERS))
    if not isinstance(managers, list | tuple):
        raise ConfigError(
            owner=_OWNER,
            field="storage_managers",
            value=managers,
            reason="must be a list of manager names",
            allowed=", ".join(MANAGER_NAMES),
        )
    options = extra.get("storage_options", {})
    if not isinstance(options, Mapping):
        raise ConfigError(
            owner=_OWNER,
            field="storage_options",
            value=options,
            reason="must be an object of the backend's options",
            allowed='a JSON object, e.g. {"root": "/path"}',
        )
    backend = extra.get("storage_backend")
    if not isinstance(backend, str):
        raise ConfigError(
            owner=_OWNER,
            field="storage_backend",
            value=backend,
            reason="must name the sglang_storage backend",
            allowed="a registered backend name, e.g. file",
        )
    try:
        return RuntimeSettings(
            backend=backend,
            backend_options=options,
            managers=tuple(managers),
        )
    except ConfigError as error:
        raise error.renamed(owner=_OWNER) from None
