"""The ``--storage-*`` flags of ``launch_server``, their checks, and what they set in ServerArgs.

SGLang 0.5.23 loads an out-of-tree HiCache storage backend through its own ``dynamic``
backend. These flags are a typed front for that seam: ``--storage-backend file`` and its
options become SGLang's own settings (``--enable-hierarchical-cache``,
``--hicache-storage-backend dynamic`` and an extra config naming
:data:`HICACHE_MODULE_PATH`/:data:`HICACHE_CLASS_NAME`), so SGLang's resolution and
runtime see nothing but their own fields. The patches in ``patches/sglang-0.5.23`` call
two functions of this module and nothing else:

- :func:`add_storage_cli_args` - adds the flag group to SGLang's parser
  (``ServerArgs.add_cli_args``).
- :func:`apply_storage_args` - checks the parsed flags and writes the ``hicache_*`` fields
  they stand for into the namespace (``prepare_server_args`` with the parser, so a bad
  flag is a usage error; ``ServerArgs.from_cli_args`` without it, so every other caller
  gets a :class:`~sglang_storage.errors.ConfigError`). Without any ``--storage-*`` flag
  it returns the namespace untouched.

Each flag is checked as it is parsed (backend name against the registry, sizes, policy
and manager names); what needs several flags (the backend's options against its config
class, conflicts with ``--hicache-*`` flags) is checked when :class:`StorageFlags` is
built. :func:`hicache_settings` is the translation itself.

``--storage-config FILE`` holds any of the other flags in a TOML or JSON file (the format
and keys are :mod:`sglang_storage.cli.settings`'s); a flag given on the command line
overrides the file's value.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import tomllib
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from sglang_storage.cli.settings import (
    AVAILABLE_MANAGERS,
    LOAD_POLICIES,
    MANAGER_NAMES,
    MAX_CONFIG_BYTES,
    PREFETCH_POLICIES,
    RECORDS_STAGING_MIN,
    RECORDS_TRANSPORTS,
    WRITE_POLICIES,
    StorageSettings,
    load_settings,
    read_config_bytes,
)
from sglang_storage.config import (
    BYTES,
    build_config,
    int_in_range,
    non_empty_str,
    non_negative_int,
    non_negative_number,
    one_of,
    optional,
    positive_number,
    tuple_of,
)
from sglang_storage.errors import ConfigError, StorageError
from sglang_storage.managers.logs import LOG_LEVELS
from sglang_storage.storage.registry import backend_entry, backend_names
from sglang_storage.units import SIZE_HELP, describe_bytes, parse_bytes

__all__ = [
    "AVAILABLE_MANAGERS",
    "DYNAMIC_BACKEND_NAME",
    "HICACHE_CLASS_NAME",
    "HICACHE_MODULE_PATH",
    "LOAD_POLICIES",
    "LOG_LEVELS",
    "MANAGER_NAMES",
    "PREFETCH_POLICIES",
    "RECORDS_STAGING_MIN",
    "RECORDS_TRANSPORTS",
    "SGLANG_DEFAULTS",
    "STORAGE_DESTS",
    "WRITE_POLICIES",
    "StorageFlags",
    "add_storage_cli_args",
    "apply_storage_args",
    "check_managers",
    "extra_config",
    "hicache_settings",
    "host_pool_size",
    "parse_backend_config",
    "parse_config_file",
    "parse_host_memory",
    "parse_managers",
    "storage_flags_from_args",
]

HICACHE_MODULE_PATH: Final = "sglang_storage_adapters.hicache_storage"
"""The module of the ``HiCacheStorage`` adapter SGLang's ``dynamic`` backend imports."""
HICACHE_CLASS_NAME: Final = "HiCacheBackend"
"""The adapter class in :data:`HICACHE_MODULE_PATH`."""
DYNAMIC_BACKEND_NAME: Final = "sglang_storage"
"""The ``backend_name`` SGLang's ``dynamic`` backend logs and registers the adapter under."""

# MANAGER_NAMES, AVAILABLE_MANAGERS, WRITE_POLICIES, PREFETCH_POLICIES and LOAD_POLICIES
# are sglang_storage.cli.settings's, which checks the config file with them.

GB: Final = 10**9
"""The unit of SGLang's ``--hicache-size`` (``int(size * 1e9 // bytes_per_token)``)."""
HOST_POOL_BYTES_KEY: Final = "storage_host_pool_bytes"
"""The extra-config key that carries ``--storage-host-memory`` exactly, in bytes (SGLang's
``--hicache-size`` holds whole GB); :func:`host_pool_size` reads it."""

SGLANG_DEFAULTS: Final[Mapping[str, object]] = types.MappingProxyType(
    {
        "enable_hierarchical_cache": False,
        "hicache_storage_backend": None,
        "hicache_storage_backend_extra_config": None,
        "hicache_size": 0,
        "hicache_ratio": None,
        "hicache_write_policy": "write_through",
        "hicache_storage_prefetch_policy": "timeout",
        "disable_radix_cache": False,
        "enable_unified_cache_external_linker": False,
    }
)
"""SGLang 0.5.23's declared defaults of the ServerArgs fields the flags set or conflict
with. A field holding anything else was given on the command line."""

_OWNER: Final = "launch_server"


@attrs.frozen
class _Flag:
    option: str
    dest: str
    metavar: str | None
    help: str
    parse: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None


def _plain_message(error: ConfigError) -> str:
    """The error without its ``owner.field:`` prefix (argparse already names the flag)."""
    given = f" (got {error.value!r})" if error.has_value else ""
    hint = f"; allowed: {error.allowed}" if error.allowed else ""
    return f"{error.reason}{given}{hint}"


def _usage_message(error: StorageError) -> str:
    """The error for ``parser.error``: led by the flag it is about, not by an owner."""
    if isinstance(error, ConfigError) and error.owner == _OWNER:
        return f"{error.field}: {_plain_message(error)}"
    return str(error)


def _argparse_type(parse: Callable[[str], object], name: str) -> Callable[[str], object]:
    """Wrap ``parse`` so argparse prints its ConfigError text instead of 'invalid value'."""

    def check(text: str) -> object:
        try:
            return parse(text)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(_plain_message(error)) from None

    check.__name__ = name
    return check


def _parse_backend_name(text: str) -> str:
    # Test-only backends (faulty) are accepted by name but not listed.
    if text not in backend_names(test_backends=True):
        raise ConfigError(
            owner=_OWNER,
            field="--storage-backend",
            value=text,
            reason="is not a known sglang_storage backend",
            allowed=", ".join(backend_names()),
        )
    return text


def parse_config_file(text: str) -> StorageSettings:
    """Return the settings of the ``--storage-config`` file at ``text``.

    Raises:
        ConfigError: as :func:`sglang_storage.cli.settings.load_settings` (the reason
            names the file's path and key).
    """
    try:
        return load_settings(text)
    except ConfigError as error:
        raise ConfigError(
            owner=_OWNER, field="--storage-config", value=text, reason=str(error)
        ) from None


def parse_backend_config(text: str) -> dict[str, object]:
    """Return the backend options ``text`` holds: a JSON object, or ``@path`` to a file.

    The file may be JSON (``.json``), TOML (``.toml``) or YAML (``.yaml``/``.yml``, needs
    PyYAML). Keys are option names of the chosen backend's config class; sizes may be
    written as ``"64GiB"``.

    Raises:
        ConfigError: the text is not JSON, the file cannot be read or parsed, or the
            result is not an object/table/mapping.
    """
    field = "--storage-backend-config"
    if text.startswith("@"):
        path = Path(text[1:])
        suffix = path.suffix.lower()
        loaders: dict[str, Callable[[bytes], object]] = {
            ".json": json.loads,
            ".toml": lambda data: tomllib.loads(data.decode()),
            ".yaml": _load_yaml,
            ".yml": _load_yaml,
        }
        loader = loaders.get(suffix)
        if loader is None:
            raise ConfigError(
                owner=_OWNER,
                field=field,
                value=text,
                reason="names a file of an unknown format",
                allowed="@FILE.json, @FILE.toml, @FILE.yaml, @FILE.yml",
            )
        try:
            data = read_config_bytes(path)
        except OSError as error:
            raise ConfigError(
                owner=_OWNER, field=field, value=text, reason=f"cannot be read: {error}"
            ) from None
        except ValueError as error:
            raise ConfigError(
                owner=_OWNER,
                field=field,
                value=text,
                reason=str(error),
                allowed=f"a file of at most {describe_bytes(MAX_CONFIG_BYTES)}",
            ) from None
        try:
            options = loader(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            raise ConfigError(
                owner=_OWNER, field=field, value=text, reason=f"is not valid {suffix[1:]}: {error}"
            ) from None
    else:
        try:
            options = json.loads(text)
        except (ValueError, RecursionError) as error:
            raise ConfigError(
                owner=_OWNER,
                field=field,
                value=text,
                reason=f"is not valid JSON: {str(error) or 'nested too deeply'}",
                allowed='a JSON object such as \'{"root": "/var/cache/kv"}\', or @FILE',
            ) from None
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ConfigError(
            owner=_OWNER,
            field=field,
            value=text,
            reason=f"must hold an object of options, not {type(options).__name__}",
        )
    _require_json(options, field=field)
    return options


def _load_yaml(data: bytes) -> object:
    """Parse YAML ``data`` with the safe loader, refusing aliases (``*name``, ``<<: *name``).

    An alias repeats a node without copying its text, so a few lines can expand to
    billions of values (an alias bomb); backend options never need one.
    """
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        raise ValueError("reading YAML needs PyYAML (pip install pyyaml)") from None

    class _NoAliasLoader(yaml.SafeLoader):  # type: ignore[misc,name-defined]
        def compose_node(self, parent: object, index: object) -> object:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"alias *{event.anchor} is not accepted (write the value out)",
                    event.start_mark,
                )
            return super().compose_node(parent, index)

    try:
        return yaml.load(data, Loader=_NoAliasLoader)
    except yaml.YAMLError as error:
        raise ValueError(str(error)) from None


def _require_json(options: Mapping[str, object], *, field: str) -> None:
    # The options travel to the scheduler processes inside SGLang's JSON extra config.
    try:
        json.dumps(dict(options))
    except (TypeError, ValueError) as error:
        raise ConfigError(
            owner=_OWNER,
            field=field,
            reason=f"holds a value that JSON cannot carry: {error}",
            allowed="strings, numbers, booleans, null, lists and objects",
        ) from None


def parse_host_memory(text: str) -> int:
    """Return the KV host pool size ``text`` names, in bytes (``"64GiB"``, ``"200GB"``).

    The count is exact: the pool is sized from it, not from SGLang's whole-GB
    ``--hicache-size``.

    Raises:
        ConfigError: not a size, or zero.
    """
    field = "--storage-host-memory"
    size = parse_bytes(text, owner=_OWNER, field=field)
    if size <= 0:
        raise ConfigError(owner=_OWNER, field=field, value=text, reason="must be more than 0")
    return size


def parse_records_staging(text: str) -> int:
    """Return the host bytes ``text`` names for records on their way to storage.

    Raises:
        ConfigError: not a size, or less than 4 KiB.
    """
    field = "--storage-records-staging"
    size = parse_bytes(text, owner=_OWNER, field=field)
    if size < RECORDS_STAGING_MIN:
        raise ConfigError(
            owner=_OWNER, field=field, value=text, reason="must be at least 4KiB (one block)"
        )
    return size


def parse_managers(text: str) -> tuple[str, ...]:
    """Return the manager names of a comma-separated ``--storage-managers`` value.

    Raises:
        ConfigError: the list is empty, names an unknown manager, or names one that this
            release does not serve yet (only :data:`AVAILABLE_MANAGERS` are).
    """
    names = tuple(name.strip() for name in text.split(","))
    check_managers(names)
    return names


def check_managers(names: tuple[str, ...]) -> None:
    """Raise unless ``names`` is a non-empty list of managers this release serves.

    Raises:
        ConfigError: as :func:`parse_managers`.
    """
    field = "--storage-managers"
    if not names or any(not name for name in names):
        raise ConfigError(
            owner=_OWNER,
            field=field,
            value=",".join(names),
            reason="must be a comma-separated list of manager names without empty items",
            allowed=", ".join(MANAGER_NAMES),
        )
    unknown = [name for name in names if name not in MANAGER_NAMES]
    if unknown:
        raise ConfigError(
            owner=_OWNER,
            field=field,
            value=",".join(unknown),
            reason="names no sglang_storage manager",
            allowed=", ".join(MANAGER_NAMES),
        )
    later = [name for name in names if name not in AVAILABLE_MANAGERS]
    if later:
        raise ConfigError(
            owner=_OWNER,
            field=field,
            value=",".join(later),
            reason=(
                ("names managers that are" if len(later) > 1 else "names a manager that is")
                + " not available yet in this release of the SGLang integration"
            ),
            allowed=", ".join(AVAILABLE_MANAGERS),
        )


def _parse_count(text: str, *, field: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(owner=_OWNER, field=field, value=text, reason="must be an int >= 0")
    return value


def _parse_seconds(text: str, *, field: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        rule = ">= 0" if allow_zero else "> 0"
        raise ConfigError(
            owner=_OWNER, field=field, value=text, reason=f"must be a finite number {rule}"
        )
    return value


def _flags() -> tuple[_Flag, ...]:
    return (
        _Flag(
            "--storage-backend",
            "storage_backend",
            "NAME",
            "Serve HiCache's storage tier from this sglang_storage backend "
            f"(registered now: {', '.join(backend_names())}). Turns on "
            "--enable-hierarchical-cache and sets --hicache-storage-backend dynamic with "
            "an extra config that loads sglang_storage's adapter; cannot be combined "
            "with --hicache-storage-backend or --hicache-storage-backend-extra-config. "
            "Every other --storage-* flag needs it.",
            _parse_backend_name,
        ),
        _Flag(
            "--storage-backend-config",
            "storage_backend_config",
            "JSON|@FILE",
            "The backend's options as a JSON object, or @FILE (.json, .toml, .yaml). "
            'Example for file: \'{"root": "/var/cache/sglang-kv", '
            '"capacity_bytes": "500GiB"}\' (without root, file uses --file-storage-path). '
            "Checked against the backend's config class when the flags are parsed: "
            "unknown or invalid options are errors.",
            parse_backend_config,
        ),
        _Flag(
            "--storage-config",
            "storage_config",
            "FILE",
            "A TOML (or .json) file holding any of the other --storage-* options, keyed by "
            'the flag name without --storage- (backend = "file", host-memory = "64GiB", '
            "[backend-config] ...). A flag given on the command line overrides the file's "
            "value (--storage-backend-config replaces the whole table). Check one with "
            "`sglang-storage config --check FILE`.",
            parse_config_file,
        ),
        _Flag(
            "--storage-host-memory",
            "storage_host_memory",
            "SIZE",
            "Host (CPU) memory for the KV host pool of each rank, such as 64GiB or 200GB "
            f"({SIZE_HELP}). The pool gets exactly this many bytes (also under 1GB); "
            "SGLang's own --hicache-size is set to it in whole GB (at least 1). The size "
            "read is printed at start. Default: SGLang's sizing (--hicache-ratio).",
            parse_host_memory,
        ),
        _Flag(
            "--storage-write-policy",
            "storage_write_policy",
            None,
            "When pages are written from GPU to host and storage; sets "
            "--hicache-write-policy. Default: write_through.",
            choices=WRITE_POLICIES,
        ),
        _Flag(
            "--storage-prefetch-policy",
            "storage_prefetch_policy",
            None,
            "When prefetching from storage stops; sets --hicache-storage-prefetch-policy. "
            "Default: timeout.",
            choices=PREFETCH_POLICIES,
        ),
        _Flag(
            "--storage-prefetch-threshold",
            "storage_prefetch_threshold",
            "TOKENS",
            "Prefetch from storage only when at least this many tokens hit there. Default: 256.",
            lambda text: _parse_count(text, field="--storage-prefetch-threshold"),
        ),
        _Flag(
            "--storage-prefetch-timeout-base",
            "storage_prefetch_timeout_base",
            "SECONDS",
            "Timeout prefetch policy: the fixed part of the deadline. Default: 1.",
            lambda text: _parse_seconds(
                text, field="--storage-prefetch-timeout-base", allow_zero=False
            ),
        ),
        _Flag(
            "--storage-prefetch-timeout-per-ki-token",
            "storage_prefetch_timeout_per_ki_token",
            "SECONDS",
            "Timeout prefetch policy: the deadline added per 1024 tokens. Default: 0.25.",
            lambda text: _parse_seconds(
                text, field="--storage-prefetch-timeout-per-ki-token", allow_zero=True
            ),
        ),
        _Flag(
            "--storage-load-policy",
            "storage_load_policy",
            None,
            "Which storage hits are prefetched: always (every hit at or above the "
            "prefetch threshold, SGLang's behaviour) or cost (only hits the cost model, "
            "fed with every read's measured time, says load faster than prefill "
            "recomputes them). Default: always.",
            choices=LOAD_POLICIES,
        ),
        _Flag(
            "--storage-log-level",
            "storage_log_level",
            None,
            "The level of sglang_storage's own log messages (the sglang_storage and "
            "sglang_storage_adapters loggers) in every SGLang process; SGLang's "
            "--log-level stays for the rest. Default: SGLang's level.",
            choices=LOG_LEVELS,
        ),
        _Flag(
            "--storage-records-transport",
            "storage_records_transport",
            None,
            "How a finished request's RL top-k rows (--enable-return-routed-experts, "
            "--enable-return-indexer-topk) reach the client under --storage-managers "
            "records: store (written to the storage backend; meta_info carries a small "
            "handle that sglang_storage_adapters.records.fetch_record reads) or sglang "
            "(SGLang's base64 through ZMQ). Default: store.",
            choices=RECORDS_TRANSPORTS,
        ),
        _Flag(
            "--storage-records-staging",
            "storage_records_staging",
            "SIZE",
            "Host memory of each scheduler process for RL top-k records on their way to "
            f"storage ({SIZE_HELP}), taken from the process's host memory budget; a "
            "record that finds no room there goes SGLang's way (base64 through ZMQ) and "
            "is logged. Default: 256MiB.",
            parse_records_staging,
        ),
        _Flag(
            "--storage-managers",
            "storage_managers",
            "LIST",
            "Comma-separated data kinds sglang_storage manages: "
            f"{', '.join(MANAGER_NAMES)}. This release serves "
            f"{', '.join(AVAILABLE_MANAGERS)} only; naming another is an error. Default: all "
            "of those; each takes effect only where SGLang builds that component.",
            parse_managers,
        ),
    )


STORAGE_DESTS: Final = (
    "storage_backend",
    "storage_backend_config",
    "storage_config",
    "storage_host_memory",
    "storage_write_policy",
    "storage_prefetch_policy",
    "storage_prefetch_threshold",
    "storage_prefetch_timeout_base",
    "storage_prefetch_timeout_per_ki_token",
    "storage_load_policy",
    "storage_log_level",
    "storage_records_transport",
    "storage_records_staging",
    "storage_managers",
)
"""The argparse destinations of the ``--storage-*`` flags (none is a ServerArgs field)."""


def add_storage_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--storage-*`` flag group to ``parser`` (SGLang's ``launch_server`` parser).

    Every flag defaults to ``None`` ("not given"), so a command line without them parses
    to the same ServerArgs as before.
    """
    group = parser.add_argument_group(
        "sglang_storage (--storage-*)",
        "Run HiCache's storage tier on sglang_storage. These flags become SGLang's own "
        "--hicache-* settings; without them SGLang behaves as it does unpatched. "
        "Example: --storage-backend file --storage-backend-config "
        '\'{"root": "/var/cache/sglang-kv"}\'',
    )
    for flag in _flags():
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": None, "help": flag.help}
        if flag.metavar is not None:
            kwargs["metavar"] = flag.metavar
        if flag.parse is not None:
            kwargs["type"] = _argparse_type(flag.parse, flag.dest)
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        group.add_argument(flag.option, **kwargs)


def _frozen_options(options: Mapping[str, object]) -> Mapping[str, object]:
    return types.MappingProxyType(dict(options))


@attrs.frozen(kw_only=True)
class StorageFlags:
    """The ``--storage-*`` flags of one command line, validated on construction.

    ``None`` means "not given": SGLang's own setting (or its default) stays.

    Raises:
        ConfigError: an unknown backend, options its config class rejects, a bad value,
            managers this release does not serve, or prefetch timeouts with a
            non-timeout prefetch policy.
        BackendUnavailableError: a plug-in registered the backend but failed to load.
    """

    backend: str = attrs.field(validator=non_empty_str)
    """A registered sglang_storage backend (``sglang_storage.storage.backend_names()``)."""
    backend_options: Mapping[str, object] = attrs.field(factory=dict, converter=_frozen_options)
    """The backend's options, as given (JSON shapes; built into its config class to check)."""
    host_memory_bytes: int | None = attrs.field(
        default=None, validator=optional(int_in_range(low=1))
    )
    """The KV host pool size per rank, in bytes (exact)."""
    write_policy: str | None = attrs.field(
        default=None, validator=optional(one_of(*WRITE_POLICIES))
    )
    prefetch_policy: str | None = attrs.field(
        default=None, validator=optional(one_of(*PREFETCH_POLICIES))
    )
    prefetch_threshold: int | None = attrs.field(default=None, validator=optional(non_negative_int))
    """Tokens that must hit in storage before a prefetch starts."""
    prefetch_timeout_base: float | None = attrs.field(
        default=None, validator=optional(positive_number)
    )
    """Seconds; the fixed part of the ``timeout`` policy's deadline."""
    prefetch_timeout_per_ki_token: float | None = attrs.field(
        default=None, validator=optional(non_negative_number)
    )
    """Seconds per 1024 tokens; the growing part of the ``timeout`` policy's deadline."""
    load_policy: str | None = attrs.field(default=None, validator=optional(one_of(*LOAD_POLICIES)))
    """Which storage hits are prefetched (``always`` when None)."""
    log_level: str | None = attrs.field(default=None, validator=optional(one_of(*LOG_LEVELS)))
    """The sglang_storage loggers' level (SGLang's when None)."""
    records_transport: str | None = attrs.field(
        default=None, validator=optional(one_of(*RECORDS_TRANSPORTS))
    )
    """How RL top-k records reach the client (``store`` when None)."""
    records_staging_bytes: int | None = attrs.field(
        default=None, metadata=BYTES, validator=optional(int_in_range(low=RECORDS_STAGING_MIN))
    )
    """Host bytes for records on their way to storage (256 MiB when None)."""
    managers: tuple[str, ...] = attrs.field(
        default=AVAILABLE_MANAGERS, validator=tuple_of(one_of(*MANAGER_NAMES))
    )
    file_storage_path: str | None = attrs.field(default=None, validator=optional(non_empty_str))
    """SGLang's ``--file-storage-path``: the adapter uses it as the ``file`` backend's
    ``root`` when the options name none, so the options are checked with it."""

    def __attrs_post_init__(self) -> None:
        _parse_backend_name(self.backend)
        entry = backend_entry(self.backend)
        _require_json(self.backend_options, field="--storage-backend-config")
        options = dict(self.backend_options)
        if self.backend == "file" and "root" not in options and self.file_storage_path:
            options["root"] = self.file_storage_path
        build_config(
            entry.config_type,
            options,
            owner=f"{self.backend} backend options (--storage-backend-config)",
        )
        check_managers(self.managers)
        timeouts = [
            name
            for name, value in (
                ("--storage-prefetch-timeout-base", self.prefetch_timeout_base),
                ("--storage-prefetch-timeout-per-ki-token", self.prefetch_timeout_per_ki_token),
            )
            if value is not None
        ]
        if timeouts and self.prefetch_policy not in (None, "timeout"):
            raise ConfigError(
                owner=_OWNER,
                field=", ".join(timeouts),
                reason="applies only to the timeout prefetch policy",
                value=self.prefetch_policy,
                allowed="--storage-prefetch-policy timeout",
            )


def storage_flags_from_args(args: argparse.Namespace) -> StorageFlags | None:
    """Return the ``--storage-*`` flags ``args`` holds, or ``None`` when none was given.

    Raises:
        ConfigError: a flag was given without ``--storage-backend``, or as
            :class:`StorageFlags`.
    """
    given: dict[str, Any] = {
        dest: getattr(args, dest) for dest in STORAGE_DESTS if getattr(args, dest, None) is not None
    }
    if not given:
        return None
    settings = given.pop("storage_config", None)
    if isinstance(settings, StorageSettings):
        # The file's values under the command line's.
        from_file: dict[str, Any] = {f"storage_{k}": v for k, v in settings.given().items()}
        given = from_file | given
        if isinstance(given.get("storage_managers"), list):
            given["storage_managers"] = tuple(given["storage_managers"])
    backend = given.get("storage_backend")
    if backend is None:
        names = ", ".join("--" + dest.replace("_", "-") for dest in given)
        raise ConfigError(
            owner=_OWNER,
            field=names,
            reason="needs --storage-backend (it configures sglang_storage's storage tier)",
            allowed=f"add --storage-backend NAME, one of: {', '.join(backend_names())}",
        )
    return StorageFlags(
        backend=backend,
        backend_options=given.get("storage_backend_config", {}),
        host_memory_bytes=given.get("storage_host_memory"),
        write_policy=given.get("storage_write_policy"),
        prefetch_policy=given.get("storage_prefetch_policy"),
        prefetch_threshold=given.get("storage_prefetch_threshold"),
        prefetch_timeout_base=given.get("storage_prefetch_timeout_base"),
        prefetch_timeout_per_ki_token=given.get("storage_prefetch_timeout_per_ki_token"),
        load_policy=given.get("storage_load_policy"),
        log_level=given.get("storage_log_level"),
        records_transport=given.get("storage_records_transport"),
        records_staging_bytes=given.get("storage_records_staging"),
        managers=given.get("storage_managers", AVAILABLE_MANAGERS),
        file_storage_path=getattr(args, "file_storage_path", None) or None,
    )


def extra_config(flags: StorageFlags) -> dict[str, object]:
    """The ``--hicache-storage-backend-extra-config`` object that loads our adapter.

    SGLang's ``dynamic`` backend reads ``backend_name``, ``module_path``, ``class_name``
    and ``interface_v1``, and pops the ``prefetch_*`` keys; the adapter reads
    ``storage_backend`` and ``storage_options``, and every adapter reads
    ``storage_managers`` (through :func:`~.runtime.runtime_settings`).
    """
    config: dict[str, object] = {
        "backend_name": DYNAMIC_BACKEND_NAME,
        "module_path": HICACHE_MODULE_PATH,
        "class_name": HICACHE_CLASS_NAME,
        "interface_v1": 1,
        "storage_backend": flags.backend,
        "storage_options": dict(flags.backend_options),
        "storage_managers": list(flags.managers),
    }
    if flags.load_policy is not None:
        config["storage_load_policy"] = flags.load_policy
    if flags.host_memory_bytes is not None:
        config[HOST_POOL_BYTES_KEY] = flags.host_memory_bytes
    if flags.log_level is not None:
        config["storage_log_level"] = flags.log_level
    if flags.records_transport is not None:
        config["storage_records_transport"] = flags.records_transport
    if flags.records_staging_bytes is not None:
        config["storage_records_staging"] = flags.records_staging_bytes
    prefetch = {
        "prefetch_threshold": flags.prefetch_threshold,
        "prefetch_timeout_base": flags.prefetch_timeout_base,
        "prefetch_timeout_per_ki_token": flags.prefetch_timeout_per_ki_token,
    }
    config.update({key: value for key, value in prefetch.items() if value is not None})
    return config


def hicache_settings(flags: StorageFlags) -> dict[str, object]:
    """The ServerArgs fields (SGLang's own ``--hicache-*`` settings) ``flags`` stand for."""
    settings: dict[str, object] = {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps(extra_config(flags), sort_keys=True),
    }
    if flags.host_memory_bytes is not None:
        # SGLang's view in whole GB (0 would mean "use --hicache-ratio"); our host pool
        # takes the exact bytes from the extra config (host_pool_size).
        settings["hicache_size"] = max(1, flags.host_memory_bytes // GB)
    if flags.write_policy is not None:
        settings["hicache_write_policy"] = flags.write_policy
    if flags.prefetch_policy is not None:
        settings["hicache_storage_prefetch_policy"] = flags.prefetch_policy
    return settings


def host_pool_size(server_args: object) -> float | None:
    """The KV host pool size ``--storage-host-memory`` set, as SGLang's ``host_size`` (GB).

    SGLang's host pools take ``host_size`` in GB and hold
    ``int(host_size * 1e9 // bytes_per_token)`` tokens; the value returned is the exact
    byte count over 10^9, nudged up where floating point would land below it, so the pool
    holds exactly ``bytes // bytes_per_token`` tokens. ``None`` when the flag was not
    given (SGLang's own ``hicache_size`` / ratio applies).
    """
    raw = getattr(server_args, "hicache_storage_backend_extra_config", None)
    try:
        extra = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return None
    exact = extra.get(HOST_POOL_BYTES_KEY) if isinstance(extra, Mapping) else None
    if not isinstance(exact, int) or isinstance(exact, bool) or exact <= 0:
        return None
    size = exact / GB
    while size * 1e9 < exact:
        size = math.nextafter(size, math.inf)
    return size


# (our flag, the flag it conflicts with, the ServerArgs fields that flag sets, why)
_CONFLICTS: Final = (
    (
        "--storage-backend",
        "--hicache-storage-backend",
        ("hicache_storage_backend",),
        "both choose the HiCache storage backend "
        "(--storage-backend sets --hicache-storage-backend dynamic)",
    ),
    (
        "--storage-backend",
        "--hicache-storage-backend-extra-config",
        ("hicache_storage_backend_extra_config",),
        "--storage-backend writes the extra config itself (give backend options with "
        "--storage-backend-config)",
    ),
    (
        "--storage-backend",
        "--disable-radix-cache",
        ("disable_radix_cache",),
        "the hierarchical cache that --storage-backend turns on needs the radix cache",
    ),
    (
        "--storage-backend",
        "--enable-unified-cache-external-linker",
        ("enable_unified_cache_external_linker",),
        "SGLang runs the external linker only without the hierarchical cache that "
        "--storage-backend turns on",
    ),
    (
        "--storage-host-memory",
        "--hicache-size/--hicache-ratio",
        ("hicache_size", "hicache_ratio"),
        "both size the KV host pool (--storage-host-memory sets --hicache-size)",
    ),
    (
        "--storage-write-policy",
        "--hicache-write-policy",
        ("hicache_write_policy",),
        "both set the HiCache write policy",
    ),
    (
        "--storage-prefetch-policy",
        "--hicache-storage-prefetch-policy",
        ("hicache_storage_prefetch_policy",),
        "both set the storage prefetch policy",
    ),
)


def _check_conflicts(flags: StorageFlags, args: argparse.Namespace) -> None:
    ours = {
        "--storage-backend": True,
        "--storage-host-memory": flags.host_memory_bytes is not None,
        "--storage-write-policy": flags.write_policy is not None,
        "--storage-prefetch-policy": flags.prefetch_policy is not None,
    }
    for flag, other, fields, why in _CONFLICTS:
        given = [f for f in fields if getattr(args, f, SGLANG_DEFAULTS[f]) != SGLANG_DEFAULTS[f]]
        if not (ours[flag] and given):
            continue
        value = getattr(args, given[0])
        shown = {} if isinstance(value, bool) else {"value": value}
        raise ConfigError(
            owner=_OWNER,
            field=f"{flag} with {other}",
            reason=f"cannot be combined: {why}",
            allowed=f"one of {flag} or {other}",
            **shown,
        )
    if flags.prefetch_policy is None and (
        flags.prefetch_timeout_base is not None or flags.prefetch_timeout_per_ki_token is not None
    ):
        policy = getattr(args, "hicache_storage_prefetch_policy", "timeout")
        if policy != "timeout":
            raise ConfigError(
                owner=_OWNER,
                field="--storage-prefetch-timeout-* with --hicache-storage-prefetch-policy",
                value=policy,
                reason="applies only to the timeout prefetch policy",
                allowed="timeout",
            )


def apply_storage_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Return ``args`` with the ``--storage-*`` flags turned into SGLang's ``hicache_*`` fields.

    Without any ``--storage-*`` flag, ``args`` itself is returned untouched. Otherwise a
    copy is returned whose ``storage_*`` entries are consumed (reset to ``None``), so a
    second call is a no-op.

    Args:
        args: The namespace SGLang's parser produced.
        parser: When given, a bad flag is reported with ``parser.error`` (usage, exit 2).

    Raises:
        ConfigError: a bad flag or a conflict with a ``--hicache-*`` flag (without parser).
        BackendUnavailableError: the backend's plug-in failed to load (without parser).
    """
    try:
        flags = storage_flags_from_args(args)
        if flags is None:
            return args
        _check_conflicts(flags, args)
    except StorageError as error:
        if parser is None:
            raise
        parser.error(_usage_message(error))
    translated = argparse.Namespace(**vars(args))
    for dest in STORAGE_DESTS:
        setattr(translated, dest, None)
    for field, value in hicache_settings(flags).items():
        setattr(translated, field, value)
    if parser is not None and flags.host_memory_bytes is not None:
        # Echoed once, on the command line's path: 10GB and 10GiB differ by 7%.
        sys.stderr.write(
            "sglang_storage: --storage-host-memory is "
            f"{describe_bytes(flags.host_memory_bytes)} per rank\n"
        )
    return translated
