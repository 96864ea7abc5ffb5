"""``sglang-storage config --check FILE``: validate a storage config file, print its effect.

The file is what ``launch_server --storage-config FILE`` reads (:mod:`.settings` has the
format). The check is the one the server makes at start-up, less what needs the server's
own flags (conflicts with ``--hicache-*``, a ``file`` root taken from
``--file-storage-path``); the output lists every setting with its value and where it comes
from (the file, or the server's default).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Final

import attrs

from sglang_storage.cli.settings import AVAILABLE_MANAGERS, StorageSettings, load_settings
from sglang_storage.errors import StorageError
from sglang_storage.units import describe_bytes

__all__ = ["EXIT_INVALID", "EXIT_VALID", "JSON_SCHEMA", "register"]

EXIT_VALID: Final = 0
"""The file is valid."""
EXIT_INVALID: Final = 1
"""The file cannot be read or holds an invalid setting."""
JSON_SCHEMA: Final = 1
"""Version of the ``--json`` document."""

_DEFAULTS: Final = {
    "backend": "none: --storage-backend must then be given",
    "backend-config": "the backend's defaults",
    "host-memory": "SGLang's sizing (--hicache-ratio)",
    "write-policy": "SGLang's (write_through)",
    "prefetch-policy": "SGLang's (timeout)",
    "prefetch-threshold": "256",
    "prefetch-timeout-base": "1",
    "prefetch-timeout-per-ki-token": "0.25",
    "load-policy": "always",
    "log-level": "SGLang's level",
    "managers": ",".join(AVAILABLE_MANAGERS),
}

_EPILOG = """\
The file is TOML (JSON when it ends in .json); its keys are the --storage-* flags without
--storage- (backend, backend-config, host-memory, write-policy, ...). Flags given to
launch_server override the file's values.

exit status: 0 valid, 1 invalid (the error names the key), 2 usage error

examples:
  sglang-storage config --check /etc/sglang/storage.toml
  sglang-storage config --check storage.json --json
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``config`` parser to ``subparsers``."""
    parser = subparsers.add_parser(
        "config",
        help="check a --storage-config file and print the effective settings",
        description="Validate a storage config file (launch_server --storage-config FILE)\n"
        "and print every setting it leads to, with where each comes from.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--check", required=True, metavar="FILE", help="the config file to validate"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.check)
    except StorageError as error:
        sys.stderr.write(f"sglang-storage config: error: {error}\n")
        if args.json:
            document = {"schema": JSON_SCHEMA, "command": "config", "file": args.check}
            sys.stdout.write(
                json.dumps({**document, "valid": False, "error": str(error)}, indent=1) + "\n"
            )
        return EXIT_INVALID
    if args.json:
        sys.stdout.write(json.dumps(_document(args.check, settings), indent=1) + "\n")
    else:
        _print_human(args.check, settings)
    return EXIT_VALID


def _document(path: str, settings: StorageSettings) -> dict[str, object]:
    given = settings.given()
    return {
        "schema": JSON_SCHEMA,
        "command": "config",
        "file": path,
        "valid": True,
        "settings": {_key(name): value for name, value in given.items()},
        "defaults": {
            key: text for key, text in _DEFAULTS.items() if key.replace("-", "_") not in given
        },
    }


def _key(name: str) -> str:
    return name.replace("_", "-")


def _print_human(path: str, settings: StorageSettings) -> None:
    given = settings.given()
    sys.stdout.write(f"{path}: valid\neffective settings:\n")
    for field in attrs.fields(StorageSettings):
        key = _key(field.name)
        if field.name not in given:
            sys.stdout.write(f"  {key:<30} (default) {_DEFAULTS.get(key, '')}\n")
            continue
        value = given[field.name]
        if field.name == "host_memory" and isinstance(value, int):
            shown = describe_bytes(value) + " per rank"
        elif isinstance(value, list):
            shown = ",".join(str(item) for item in value)
        elif isinstance(value, dict):
            shown = json.dumps(value, sort_keys=True)
        else:
            shown = str(value)
        sys.stdout.write(f"  {key:<30} {shown}\n")
    if settings.backend is None:
        sys.stdout.write("note: no backend is set; launch_server then needs --storage-backend\n")
