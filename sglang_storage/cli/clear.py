"""``sglang-storage clear --model M``: delete every stored object of one model.

The objects are found by a header scan of the backend (:class:`~sglang_storage.storage.
Scannable`); only objects the backend wrote for model ``M`` are deleted (through the
backend's own ``delete``), never foreign files, temporary files or the quarantine. A
model that matches nothing is refused with the models the store holds. As ``fsck
--repair``, it shows its plan first and is a dry run when stdin is a terminal (``--yes``
to act) or with ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Final

from sglang_storage.cli.fsck import (
    EXIT_CLEAN,
    EXIT_LEFT,
    EXIT_OPERATIONAL,
    EXIT_USAGE,
    JSON_SCHEMA,
    UsageError,
    add_backend_arguments,
    backend_choice,
    inspect_options,
    on_terminal,
    open_backend,
    repair_options,
    say,
    scannable,
)
from sglang_storage.core import ObjectKey
from sglang_storage.errors import StorageError
from sglang_storage.storage import ObjectState
from sglang_storage.units import format_bytes

__all__ = ["register"]

_DELETABLE: Final = (
    ObjectState.OK,
    ObjectState.CORRUPT,
    ObjectState.WRONG_VERSION,
    ObjectState.WRONG_MODEL,
)
"""States of objects the backend wrote at an object location (what ``clear`` deletes)."""

_EPILOG = """\
Only objects the backend wrote for the model are deleted; foreign files, temporary files
and the quarantine are kept (fsck --purge-quarantine empties the quarantine).

exit status:
  0  the model's objects were deleted (or, in a dry run, would be)
  2  usage error (bad arguments, or a model the store does not hold)
  4  some could not be deleted
  8  operational error (backend unavailable, or it cannot enumerate its objects)

examples:
  sglang-storage clear --dir /data/kv-cache --model llama3-8b-bf16-p64
  sglang-storage clear --dir /data/kv-cache --model llama3-8b-bf16-p64 --yes
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``clear`` parser to ``subparsers``."""
    parser = subparsers.add_parser(
        "clear",
        help="delete every stored object of one model (--model); shown first",
        description="Delete every stored object of one model fingerprint.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_backend_arguments(parser)
    parser.add_argument(
        "--model", required=True, metavar="FINGERPRINT", help="the model whose objects go"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="show what would be deleted and change nothing (the default on a terminal)",
    )
    parser.add_argument(
        "--yes", action="store_true", help="delete without a dry run, also on a terminal"
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        if not args.model:
            raise UsageError("--model: empty fingerprint")
        if args.dry_run and args.yes:
            raise UsageError("--dry-run and --yes contradict each other; give one")
        return _clear(args)
    except UsageError as error:
        return _fail(args, EXIT_USAGE, str(error))
    except StorageError as error:
        return _fail(args, EXIT_OPERATIONAL, str(error))


def _clear(args: argparse.Namespace) -> int:
    choice = backend_choice(args)
    if choice.options.get("read_only") is True:
        raise UsageError('clear needs a writable backend: drop "read_only" from --backend-config')
    dry_run = args.dry_run or (not args.yes and on_terminal())
    backend = open_backend(choice.name, inspect_options(choice))
    try:
        reports = list(scannable(backend, choice.name).scan(payloads=False))
    finally:
        backend.close()
    held: dict[str, int] = {}
    doomed: dict[ObjectKey, int] = {}
    for report in reports:
        if report.key is None or report.state not in _DELETABLE:
            continue
        model = report.key.namespace.model
        held[model] = held.get(model, 0) + 1
        if model == args.model:
            doomed[report.key] = report.nbytes
    if not doomed:
        models = ", ".join(f"{name} ({count})" for name, count in sorted(held.items()))
        raise UsageError(
            f"--model {args.model!r} matches no stored object; the store holds objects of: "
            f"{models or 'no model'}. Nothing was changed"
        )
    left: list[ObjectKey] = []
    if not dry_run:
        backend = open_backend(choice.name, repair_options(choice))
        try:
            backend.delete(list(doomed))
            left = [
                key
                for key, there in zip(doomed, backend.exists(list(doomed)), strict=True)
                if there
            ]
        finally:
            backend.close()
    status = EXIT_LEFT if left else EXIT_CLEAN
    nbytes = sum(doomed.values())
    if args.json:
        document = {
            "schema": JSON_SCHEMA,
            "command": "clear",
            "backend": choice.name,
            "model": args.model,
            "dry_run": dry_run,
            "objects": len(doomed),
            "bytes": nbytes,
            "left": [str(key) for key in left],
            "exit_status": status,
        }
        say(json.dumps(document, indent=1))
        return status
    where = choice.options.get("root")
    say(
        f"clear of model {args.model!r} in the {choice.name} backend"
        + (f" at {where}" if where else "")
    )
    if dry_run:
        why = "--dry-run" if args.dry_run else "stdin is a terminal"
        say(
            f"plan (dry run, {why}): delete {len(doomed)} object(s), {format_bytes(nbytes)}; "
            "nothing was changed; run again with --yes to do it"
        )
    else:
        say(
            f"removed {len(doomed) - len(left)} object(s) of {args.model!r}, {format_bytes(nbytes)}"
        )
        for key in left:
            say(f"  left   {key}")
    return status


def _fail(args: argparse.Namespace, status: int, message: str) -> int:
    import sys

    sys.stderr.write(f"sglang-storage clear: error: {message}\n")
    if getattr(args, "json", False):
        say(
            json.dumps(
                {
                    "schema": JSON_SCHEMA,
                    "command": "clear",
                    "error": message,
                    "exit_status": status,
                },
                indent=1,
            )
        )
    return status
