"""The storage config file: every ``--storage-*`` option of ``launch_server`` in one file.

``launch_server --storage-config FILE`` reads it (flags given on the command line override
what it holds) and ``sglang-storage config --check FILE`` validates it and prints the
effective settings. The file is TOML (``.toml``, or any other name) or JSON (``.json``);
its keys are the flag names without ``--storage-`` (``backend``, ``backend-config``,
``host-memory``, ...; ``_`` may stand for ``-``)::

    backend = "file"
    host-memory = "48GiB"          # decimal (GB) and binary (GiB) units, any case
    write-policy = "write_back"
    managers = ["kv", "decode"]    # or "kv,decode"

    [backend-config]
    root = "/var/cache/sglang-kv"
    capacity_bytes = "500GiB"

:func:`load_settings` returns a validated :class:`StorageSettings`; an unknown key, a bad
value or a contradiction is a :class:`~sglang_storage.errors.ConfigError` naming the file
and key (an unknown key suggests the nearest one). The names and value sets here are the
ones the ``--storage-*`` flags check (``sglang_storage_adapters.flags`` imports them).
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from sglang_storage.config import (
    BYTES,
    build_config,
    int_in_range,
    non_negative_int,
    non_negative_number,
    one_of,
    optional,
    positive_number,
)
from sglang_storage.errors import ConfigError
from sglang_storage.storage.registry import backend_entry, backend_names

__all__ = [
    "AVAILABLE_MANAGERS",
    "LOAD_POLICIES",
    "MANAGER_NAMES",
    "MAX_CONFIG_BYTES",
    "PREFETCH_POLICIES",
    "RECORDS_TRANSPORTS",
    "SETTING_KEYS",
    "WRITE_POLICIES",
    "StorageSettings",
    "load_settings",
    "read_config_bytes",
]

MAX_CONFIG_BYTES: Final = 1 << 20
"""The largest config file (``--storage-config``, ``--storage-backend-config @FILE``) read."""

MANAGER_NAMES: Final = (
    "kv",
    "decode",
    "sparse",
    "npu-sparse",
    "embedding",
    "experts",
    "records",
    "weights",
    "engram",
)
"""Every data-kind manager sglang_storage has or will have, in ``--storage-managers`` order."""
AVAILABLE_MANAGERS: Final = (
    "kv",
    "decode",
    "sparse",
    "npu-sparse",
    "embedding",
    "experts",
    "records",
    "weights",
    "engram",
)
"""The managers the SGLang integration serves in this release: the HiCache KV tiers,
decode-side request offload, HiSparse token offload, the NPU sparse KV offload, the
encoder embedding cache, the paged-experts host store, RL routed-expert / indexer top-k
capture, the elastic-EP expert backup and the DeepSeek-V4.1 Engram host tables.
Each takes effect only where SGLang builds that component (e.g. ``decode`` under
``--disaggregation-decode-enable-offload-kvcache``, ``npu-sparse`` on an Ascend NPU under
``SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD=1``, ``experts`` under ``--enable-paged-experts``,
``records`` under ``--enable-return-routed-experts`` / ``--enable-return-indexer-topk``,
``weights`` under elastic EP's expert backup, ``engram`` under
``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1``)."""
WRITE_POLICIES: Final = ("write_through", "write_through_selective", "write_back")
"""``--storage-write-policy`` values; SGLang's ``--hicache-write-policy`` choices."""
PREFETCH_POLICIES: Final = ("best_effort", "wait_complete", "timeout")
"""``--storage-prefetch-policy`` values; SGLang's ``--hicache-storage-prefetch-policy``."""
LOAD_POLICIES: Final = ("always", "cost")
"""``--storage-load-policy`` values (``sglang_storage.managers.controller.LoadPolicy``)."""
RECORDS_TRANSPORTS: Final = ("store", "sglang")
"""``--storage-records-transport`` values: a finished request's top-k rows go through the
storage backend with a small handle in ``meta_info`` (``store``), or as SGLang sends them,
base64 through ZMQ (``sglang``)."""


def _frozen(options: Mapping[str, object] | None) -> Mapping[str, object] | None:
    return None if options is None else types.MappingProxyType(dict(options))


def _check_managers(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    names = value if isinstance(value, tuple) else ()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="must be a non-empty list of manager names",
            allowed=", ".join(AVAILABLE_MANAGERS),
        )
    unknown = [n for n in names if n not in AVAILABLE_MANAGERS]
    if unknown:
        later = all(n in MANAGER_NAMES for n in unknown)
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=",".join(unknown),
            reason="not available yet in this release of the SGLang integration"
            if later
            else "names no sglang_storage manager",
            allowed=", ".join(AVAILABLE_MANAGERS),
        )


def _check_log_level(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
    # Imported here: the managers package needs torch, and only this setting needs it.
    from sglang_storage.managers.logs import LOG_LEVELS

    one_of(*LOG_LEVELS)(instance, attribute, value)


RECORDS_STAGING_MIN: Final = 4096
"""The least records staging: one block of the staging pool
(``sglang_storage.memory.records.BLOB_ALIGNMENT``; this module imports no torch)."""


@attrs.frozen(kw_only=True)
class StorageSettings:
    """What a storage config file sets; ``None`` is "not set" (the flag's default applies).

    Field ``x_y`` is key ``x-y`` of the file and flag ``--storage-x-y``.

    Raises:
        ConfigError: an unknown backend, options its config class rejects, a bad value,
            or prefetch timeouts with a prefetch policy other than ``timeout``.
    """

    backend: str | None = attrs.field(default=None)
    """A registered sglang_storage backend."""
    backend_config: Mapping[str, object] | None = attrs.field(default=None, converter=_frozen)
    """The backend's options (its config class's field names; sizes such as ``"64GiB"``)."""
    host_memory: int | None = attrs.field(
        default=None, validator=optional(int_in_range(low=1)), metadata=BYTES
    )
    """The KV host pool of each rank, in bytes (exact: the pool is sized from it)."""
    write_policy: str | None = attrs.field(
        default=None, validator=optional(one_of(*WRITE_POLICIES))
    )
    prefetch_policy: str | None = attrs.field(
        default=None, validator=optional(one_of(*PREFETCH_POLICIES))
    )
    prefetch_threshold: int | None = attrs.field(default=None, validator=optional(non_negative_int))
    prefetch_timeout_base: float | None = attrs.field(
        default=None, validator=optional(positive_number)
    )
    prefetch_timeout_per_ki_token: float | None = attrs.field(
        default=None, validator=optional(non_negative_number)
    )
    load_policy: str | None = attrs.field(default=None, validator=optional(one_of(*LOAD_POLICIES)))
    log_level: str | None = attrs.field(default=None, validator=optional(_check_log_level))
    records_transport: str | None = attrs.field(
        default=None, validator=optional(one_of(*RECORDS_TRANSPORTS))
    )
    records_staging: int | None = attrs.field(
        default=None, validator=optional(int_in_range(low=RECORDS_STAGING_MIN)), metadata=BYTES
    )
    """Host bytes of each scheduler process for records on their way to storage."""
    managers: tuple[str, ...] | None = attrs.field(default=None, validator=_check_managers)

    def __attrs_post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("prefetch_timeout_base", "prefetch_timeout_per_ki_token"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(owner=owner, field=name, value=value, reason="must be finite")
        if self.backend is not None:
            if self.backend not in backend_names(test_backends=True):
                raise ConfigError(
                    owner=owner,
                    field="backend",
                    value=self.backend,
                    reason="is not a known sglang_storage backend",
                    allowed=", ".join(backend_names()),
                )
            options = dict(self.backend_config or {})
            try:
                json.dumps(options)
            except (TypeError, ValueError) as error:
                raise ConfigError(
                    owner=owner,
                    field="backend_config",
                    reason=f"holds a value that JSON cannot carry: {error}",
                ) from None
            entry = backend_entry(self.backend)
            root = attrs.fields_dict(entry.config_type).get("root")
            if root is not None and root.default is attrs.NOTHING:
                # The server may take it from --file-storage-path; check the rest.
                options.setdefault("root", "/")
            build_config(entry.config_type, options, owner=f"{owner}.backend_config")
        timeouts = self.prefetch_timeout_base, self.prefetch_timeout_per_ki_token
        if any(t is not None for t in timeouts) and self.prefetch_policy not in (None, "timeout"):
            raise ConfigError(
                owner=owner,
                field="prefetch_timeout_base, prefetch_timeout_per_ki_token",
                value=self.prefetch_policy,
                reason="applies only to the timeout prefetch policy",
                allowed="prefetch-policy = timeout",
            )

    def given(self) -> dict[str, object]:
        """The settings the file set, by field name (JSON shapes: lists, plain dicts)."""
        values: dict[str, object] = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            values[field.name] = value
        return values


SETTING_KEYS: Final = tuple(f.name.replace("_", "-") for f in attrs.fields(StorageSettings))
"""The keys a config file may hold, as the file writes them."""


def read_config_bytes(path: Path) -> bytes:
    """The bytes of the config file at ``path``, at most :data:`MAX_CONFIG_BYTES` of them.

    Raises:
        OSError: the file cannot be read.
        ValueError: it holds more than :data:`MAX_CONFIG_BYTES` (no config is that large;
            a larger input is refused before it is parsed).
    """
    with path.open("rb") as file:
        data = file.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"is larger than {MAX_CONFIG_BYTES} bytes, the most a config file holds")
    return data


def load_settings(path: str | Path) -> StorageSettings:
    """Read and validate the storage config file at ``path``.

    Raises:
        ConfigError: the file cannot be read or parsed, holds an unknown key (the reason
            suggests the nearest), or a setting is invalid (owner names the file, field
            the key).
    """
    path = Path(path)
    owner = f"storage config {path}"
    try:
        data = read_config_bytes(path)
    except OSError as error:
        raise ConfigError(
            owner=owner, field="file", value=str(path), reason=f"cannot be read: {error}"
        ) from None
    except ValueError as error:
        raise ConfigError(
            owner=owner,
            field="file",
            value=str(path),
            reason=str(error),
            allowed=f"a file of at most {MAX_CONFIG_BYTES} bytes",
        ) from None
    kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
    try:
        text = data.decode()
        parsed: object = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise ConfigError(
            owner=owner, field="file", value=str(path), reason=f"is not valid {kind}: {error}"
        ) from None
    if not isinstance(parsed, dict):
        raise ConfigError(
            owner=owner,
            field="file",
            value=type(parsed).__name__,
            reason="must hold a table (object) of settings",
        )
    mapping: dict[str, object] = {}
    for key, value in parsed.items():
        name = key.replace("_", "-").removeprefix("storage-") if isinstance(key, str) else ""
        if name not in SETTING_KEYS:
            near = difflib.get_close_matches(name, SETTING_KEYS, n=1)
            raise ConfigError(
                owner=owner,
                field=str(key),
                reason="unknown setting" + (f" (did you mean {near[0]!r}?)" if near else ""),
                allowed=", ".join(SETTING_KEYS),
            )
        if name in mapping:
            raise ConfigError(owner=owner, field=str(key), reason="is given twice")
        if isinstance(value, bool):
            raise ConfigError(
                owner=owner, field=str(key), value=value, reason="is not a value this key takes"
            )
        if name == "managers" and isinstance(value, str):  # "kv,decode" as the flag takes
            value = [part.strip() for part in value.split(",")]
        mapping[name] = value
    fields = {name.replace("-", "_"): value for name, value in mapping.items()}
    try:
        return build_config(StorageSettings, fields, owner=owner)
    except ConfigError as error:
        # Report keys as the file writes them (backend options keep their own names).
        inner = error.owner
        if inner.startswith(StorageSettings.__name__):  # raised after construction
            inner = owner + inner.removeprefix(StorageSettings.__name__)
        inner = inner.replace(".backend_config", ".backend-config", 1)
        field = error.field.replace("_", "-") if inner == owner else error.field
        raise error.renamed(owner=inner, field=field) from None
