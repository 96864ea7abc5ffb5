"""``sglang-storage fsck``: verify every stored object of a backend, and optionally repair.

The checking itself is the storage layer's (:class:`~sglang_storage.storage.Scannable`);
this module opens the backend, prints the report and turns it into an exit status, in the
manner of ``e2fsck``. It also holds the backend options every inspecting command shares
(``--backend``, ``--backend-config``, ``--dir``), which ``stats`` reuses.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from sglang_storage.errors import BackendUnavailableError, ConfigError, StorageError
from sglang_storage.storage import (
    Backend,
    ObjectReport,
    ObjectState,
    RepairResult,
    Scannable,
    backend_entry,
    backend_names,
    create_backend,
    summarize,
)
from sglang_storage.units import format_bytes

__all__ = [
    "EXIT_CLEAN",
    "EXIT_LEFT",
    "EXIT_OPERATIONAL",
    "EXIT_REPAIRED",
    "EXIT_USAGE",
    "JSON_SCHEMA",
    "BackendChoice",
    "UsageError",
    "add_backend_arguments",
    "backend_choice",
    "inspect_options",
    "open_backend",
    "register",
    "say",
    "scannable",
]

EXIT_CLEAN: Final = 0
"""Nothing wrong was found."""
EXIT_REPAIRED: Final = 1
"""Problems were found and every one was repaired."""
EXIT_USAGE: Final = 2
"""The command line was wrong (argparse's status)."""
EXIT_LEFT: Final = 4
"""Problems were found and some are still there (no ``--repair``, or not repairable)."""
EXIT_OPERATIONAL: Final = 8
"""The check could not be done: the backend is unavailable or cannot be scanned."""

JSON_SCHEMA: Final = 1
"""Version of the ``--json`` documents of ``fsck`` and ``stats``."""

_EPILOG = """\
what is checked:
  every object's header (format version, data kind, shape, model fingerprint, header
  checksum), its size and its payload checksum; temporary files of writers that no
  longer run (left by a kill -9 mid-write); files the backend did not write.

states:
  ok             the object verifies
  corrupt        header, size or payload checksum is wrong     --repair quarantines it
  wrong_version  written by another format version             --repair quarantines it
  wrong_model    another model fingerprint than --model        --repair deletes it
  orphaned_temp  temporary file of a dead writer               --repair removes it
  foreign        not written by sglang-storage: listed, never touched, no effect on
                 the exit status
  quarantined, in_progress   informational (moved aside earlier; a running write)

Without --repair nothing is changed: the file and hf3fs backends are opened read-only
(no clean-up at open). The memory backend holds only this process's objects.

exit status (as e2fsck):
  0  no problems
  1  problems found, all repaired
  2  usage error (bad arguments or backend options)
  4  problems found and left (no --repair, or a repair failed)
  8  operational error (backend unavailable, or it cannot enumerate its objects)

examples:
  sglang-storage fsck --dir /data/kv-cache
  sglang-storage fsck --dir /data/kv-cache --repair
  sglang-storage fsck --dir /data/kv-cache --model llama3-8b-bf16-p64 --json
  sglang-storage fsck --backend hf3fs --backend-config '{"root": "/3fs/kv"}'
"""


def say(text: str = "") -> None:
    """Write one line of the command's output to stdout."""
    sys.stdout.write(f"{text}\n")


class UsageError(Exception):
    """A command-line mistake, reported with exit status 2."""


@attrs.frozen(kw_only=True)
class BackendChoice:
    """The backend a command inspects: its registered name and options."""

    name: str
    options: Mapping[str, object]


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--backend``, ``--backend-config``, ``--dir`` and ``--json`` to ``parser``."""
    group = parser.add_argument_group("backend")
    group.add_argument(
        "--backend",
        default="file",
        metavar="NAME",
        help=f"a registered backend: {', '.join(backend_names())} (default: file)",
    )
    group.add_argument(
        "--backend-config",
        default=None,
        metavar="JSON",
        help='the backend\'s options as a JSON object, e.g. \'{"root": "/data/kv"}\'',
    )
    group.add_argument(
        "--dir",
        default=None,
        metavar="PATH",
        help='the store\'s root directory (file, hf3fs): short for {"root": PATH}',
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def backend_choice(args: argparse.Namespace) -> BackendChoice:
    """The backend and options the arguments name.

    Raises:
        UsageError: malformed JSON, options given twice, an unknown backend, or a
            directory backend without a root.
    """
    name = args.backend
    try:
        entry = backend_entry(name)
    except ConfigError as error:
        raise UsageError(
            f"--backend {name!r} is not a known backend; choose one of {', '.join(backend_names())}"
        ) from error
    except BackendUnavailableError as error:
        raise UsageError(f"--backend {name!r}: {error.reason}") from error
    options: dict[str, object] = {}
    if args.backend_config is not None:
        try:
            parsed = json.loads(args.backend_config)
        except json.JSONDecodeError as error:
            raise UsageError(f"--backend-config is not valid JSON: {error}") from error
        if not isinstance(parsed, dict):
            raise UsageError(
                f"--backend-config must be a JSON object of options, got {type(parsed).__name__}"
            )
        options.update(parsed)
    fields = attrs.fields_dict(entry.config_type)
    if args.dir is not None:
        if "root" not in fields:
            raise UsageError(f"--dir: the {name} backend has no root directory option")
        if "root" in options:
            raise UsageError('give the root once: --dir or "root" in --backend-config')
        if not args.dir:
            raise UsageError("--dir: empty path")
        options["root"] = args.dir
    root = fields.get("root")
    if root is not None and root.default is attrs.NOTHING and "root" not in options:
        raise UsageError(
            f"the {name} backend needs its root directory: --dir PATH "
            '(or "root" in --backend-config)'
        )
    return BackendChoice(name=name, options=options)


def inspect_options(choice: BackendChoice) -> dict[str, object]:
    """The chosen options, with ``read_only`` set where the backend has that option."""
    options = dict(choice.options)
    if "read_only" in attrs.fields_dict(backend_entry(choice.name).config_type):
        options.setdefault("read_only", True)
    return options


def open_backend(name: str, options: Mapping[str, object]) -> Backend:
    """Open backend ``name`` with ``options``.

    Raises:
        UsageError: invalid options.
        BackendUnavailableError: the backend cannot be opened.
    """
    try:
        return create_backend(name, options)
    except ConfigError as error:
        raise UsageError(f"--backend-config: {error}") from error


def scannable(backend: Backend, name: str) -> Scannable:
    """``backend`` as :class:`Scannable`, which its capabilities must declare.

    Raises:
        BackendUnavailableError: the backend cannot enumerate what it holds.
    """
    if not backend.capabilities.scannable:
        raise BackendUnavailableError(
            backend=name,
            reason="it cannot enumerate the objects it holds (capabilities.scannable is "
            "false), so it cannot be scanned"
            + (
                "; Mooncake's Python client has no call that lists keys"
                if name == "mooncake"
                else ""
            ),
        )
    if not isinstance(backend, Scannable):
        raise BackendUnavailableError(
            backend=name,
            reason=f"{type(backend).__name__} declares capabilities.scannable but does not "
            "implement scan() and repair() (a bug in the backend)",
        )
    return backend


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``fsck`` parser to ``subparsers``."""
    parser = subparsers.add_parser(
        "fsck",
        help="verify every stored object of a backend; --repair fixes what is wrong",
        description="Verify every stored object of a backend (header, size, payload\n"
        "checksum), find temporary files left by dead writers and files that are not\n"
        "the backend's, and with --repair quarantine or remove what is wrong.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_backend_arguments(parser)
    parser.add_argument(
        "--repair",
        action="store_true",
        help="quarantine damaged objects, remove orphaned temporary files (and, with "
        "--model, objects of other models)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="FINGERPRINT",
        help="the model fingerprint the store should hold; objects of others are wrong_model",
    )
    parser.add_argument(
        "--headers-only",
        action="store_true",
        help="check headers and sizes but skip reading payloads (fast; no payload checksums)",
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.model is not None and not args.model:
            raise UsageError("--model: empty fingerprint")
        choice = backend_choice(args)
        return _check(args, choice)
    except UsageError as error:
        return _fail(args, EXIT_USAGE, str(error))
    except StorageError as error:
        return _fail(args, EXIT_OPERATIONAL, str(error))


def _check(args: argparse.Namespace, choice: BackendChoice) -> int:
    if args.repair and choice.options.get("read_only") is True:
        raise UsageError(
            '--repair needs a writable backend: drop "read_only" from --backend-config'
        )
    scan_options = inspect_options(choice)
    backend = open_backend(choice.name, scan_options)
    try:
        reports = list(
            scannable(backend, choice.name).scan(payloads=not args.headers_only, model=args.model)
        )
        repairs: list[RepairResult] | None = None
        problems = [report for report in reports if report.state.problem]
        if args.repair and problems:
            if scan_options.get("read_only") is True:
                # Reopened writable (which also removes orphans of dead writers at open:
                # their repair then finds them gone).
                backend.close()
                backend = open_backend(choice.name, choice.options)
            repairs = scannable(backend, choice.name).repair(problems)
    finally:
        backend.close()
    left = (
        len(problems) if repairs is None else sum(not result.action.resolved for result in repairs)
    )
    status = EXIT_CLEAN if not problems else EXIT_LEFT if left else EXIT_REPAIRED
    if args.json:
        say(json.dumps(_document(args, choice, reports, repairs, status), indent=1))
    else:
        _print_human(args, choice, reports, repairs, left)
    return status


def _report_json(report: ObjectReport) -> dict[str, object]:
    return {
        "state": report.state.value,
        "location": report.location,
        "key": None if report.key is None else str(report.key),
        "kind": None if report.kind is None else report.kind.value,
        "bytes": report.nbytes,
        "reason": report.reason,
    }


def _document(
    args: argparse.Namespace,
    choice: BackendChoice,
    reports: Sequence[ObjectReport],
    repairs: Sequence[RepairResult] | None,
    status: int,
) -> dict[str, object]:
    return {
        "schema": JSON_SCHEMA,
        "command": "fsck",
        "backend": choice.name,
        "options": dict(choice.options),
        "payloads_checked": not args.headers_only,
        "model": args.model,
        "summary": summarize(reports).as_json(),
        "problems": [_report_json(r) for r in reports if r.state.problem],
        "foreign": [_report_json(r) for r in reports if r.state is ObjectState.FOREIGN],
        "repair": None
        if repairs is None
        else [
            {**_report_json(r.report), "action": r.action.value, "action_reason": r.reason}
            for r in repairs
        ],
        "exit_status": status,
    }


def _print_human(
    args: argparse.Namespace,
    choice: BackendChoice,
    reports: Sequence[ObjectReport],
    repairs: Sequence[RepairResult] | None,
    left: int,
) -> None:
    where = choice.options.get("root")
    say(f"fsck of the {choice.name} backend" + (f" at {where}" if where else ""))
    for report in reports:
        if report.state.problem or report.state is ObjectState.FOREIGN:
            say(f"  {report.state.value:<14} {report.location}: {report.reason}")
    summary = summarize(reports)
    say("summary:")
    for state, tally in summary.states.items():
        if tally.count or state in (ObjectState.OK, ObjectState.CORRUPT):
            say(f"  {state.value:<14} {tally.count:>8}  {format_bytes(tally.bytes)}")
    if not args.headers_only:
        checked = "payload checksums verified"
    else:
        checked = "headers and sizes only (--headers-only)"
    say(f"checked: {checked}")
    problems = summary.problems
    if not problems:
        say("result: clean")
    elif repairs is None:
        say(f"result: {problems} problem(s) found; run with --repair to fix them")
    else:
        for result in repairs:
            reason = f" ({result.reason})" if result.reason else ""
            say(f"  {result.action.value:<12} {result.report.location}{reason}")
        say(f"result: {problems - left} of {problems} problem(s) repaired, {left} left")


def _fail(args: argparse.Namespace, status: int, message: str) -> int:
    sys.stderr.write(f"sglang-storage fsck: error: {message}\n")
    if getattr(args, "json", False):
        say(
            json.dumps(
                {
                    "schema": JSON_SCHEMA,
                    "command": "fsck",
                    "error": message,
                    "exit_status": status,
                },
                indent=1,
            )
        )
    return status
