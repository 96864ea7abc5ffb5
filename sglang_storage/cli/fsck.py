"""``sglang-storage fsck``: verify every stored object of a backend, and optionally repair.

The checking itself is the storage layer's (:class:`~sglang_storage.storage.Scannable`);
this module opens the backend, prints the report and turns it into an exit status, in the
manner of ``e2fsck``. It also holds the backend options every inspecting command shares
(``--backend``, ``--backend-config``, ``--dir``), which ``stats`` reuses.
"""

from __future__ import annotations

import argparse
import difflib
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
    RepairAction,
    RepairResult,
    Scannable,
    backend_entry,
    backend_names,
    create_backend,
    summarize,
)
from sglang_storage.storage.fsck import planned_action
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
    "on_terminal",
    "open_backend",
    "register",
    "repair_options",
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
  longer run (left by a kill -9 mid-write); files the backend did not write; files
  whose permissions let other users in (exposed).

states:
  ok             the object verifies
  corrupt        header, size or payload checksum is wrong     --repair quarantines it
  wrong_version  written by another format version             --repair quarantines it
  wrong_model    another model fingerprint than --model        --repair deletes it
  orphaned_temp  temporary file (.sgs-...) whose writer is gone --repair removes it
  foreign        not written by sglang-storage: listed, never touched, no effect on
                 the exit status
  quarantined, in_progress   informational (moved aside earlier; a running write)
  exposed        (any state) readable or writable by users the store's file mode
                 leaves out (e.g. objects an older version made 0644)
                                                              --repair restricts it

Without --repair nothing is changed: the file and hf3fs backends are opened read-only
(no clean-up at open). The memory backend holds only this process's objects.

--repair shows what it will do before it does it, and does nothing else: it is a dry
run when stdin is a terminal (--yes to act) or with --dry-run; it refuses a --model
that matches no stored object (a typo would delete the whole store). A directory that
holds things but no store marker is refused (--adopt checks it as a store; with
--repair it becomes one).

exit status (as e2fsck):
  0  no problems
  1  problems found, all repaired
  2  usage error (bad arguments or backend options)
  4  problems found and left (no --repair, or a repair failed)
  8  operational error (backend unavailable, or it cannot enumerate its objects)

examples:
  sglang-storage fsck --dir /data/kv-cache
  sglang-storage fsck --dir /data/kv-cache --repair
  sglang-storage fsck --dir /data/kv-cache --repair --yes
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
        except RecursionError:
            raise UsageError("--backend-config is nested too deeply to be options") from None
        if not isinstance(parsed, dict):
            raise UsageError(
                f"--backend-config must be a JSON object of options, got {type(parsed).__name__}"
            )
        options.update(parsed)
    fields = attrs.fields_dict(entry.config_type)
    unknown = sorted(set(options) - set(fields))
    if unknown:  # before the root check, so a typo of "root" is not reported as missing
        near = {key: difflib.get_close_matches(key, fields, n=1) for key in unknown}
        hints = [f"{key!r} -> {match[0]!r}" for key, match in near.items() if match]
        raise UsageError(
            f"--backend-config: unknown option{'s' if len(unknown) > 1 else ''} of the "
            f"{name} backend: {', '.join(unknown)}"
            + (f" (did you mean {', '.join(hints)}?)" if hints else "")
            + f"; allowed: {', '.join(sorted(fields))}"
        )
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
        if error.field == "root" and error.has_value:
            raise UsageError(f"{error} (fsck --adopt checks it as a store anyway)") from error
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
        help="quarantine damaged objects, remove orphaned temporary files, restrict exposed "
        "files (and, with --model, delete objects of other models); shown first",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="with --repair: show what it would do and change nothing (the default when "
        "stdin is a terminal)",
    )
    parser.add_argument(
        "--yes",
        action="store_true",
        help="with --repair: do it without a dry run, also on a terminal",
    )
    parser.add_argument(
        "--adopt",
        action="store_true",
        help="check a directory that holds no store marker as a store; with --repair, "
        "write the marker (what the backend did not write is never touched)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="FINGERPRINT",
        help="the model fingerprint the store should hold; objects of others are wrong_model",
    )
    parser.add_argument(
        "--purge-quarantine",
        action="store_true",
        help="empty the quarantine (only what the backend moved there) instead of checking; "
        "shown first, as --repair",
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
        if (args.dry_run or args.yes) and not (args.repair or args.purge_quarantine):
            raise UsageError("--dry-run and --yes go with --repair or --purge-quarantine")
        if args.purge_quarantine and args.repair:
            raise UsageError("--purge-quarantine and --repair are separate runs; give one")
        if args.dry_run and args.yes:
            raise UsageError("--dry-run and --yes contradict each other; give one")
        choice = backend_choice(args)
        if args.adopt:
            choice = _adopting(choice)
        if args.purge_quarantine:
            return _purge(args, choice)
        return _check(args, choice)
    except UsageError as error:
        return _fail(args, EXIT_USAGE, str(error))
    except StorageError as error:
        return _fail(args, EXIT_OPERATIONAL, str(error))


def _adopting(choice: BackendChoice) -> BackendChoice:
    if "adopt" not in attrs.fields_dict(backend_entry(choice.name).config_type):
        raise UsageError(f"--adopt: the {choice.name} backend has no store marker to adopt")
    return attrs.evolve(choice, options={**choice.options, "adopt": True})


def on_terminal() -> bool:
    """Whether a person is at the command (stdin is a terminal)."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def _check(args: argparse.Namespace, choice: BackendChoice) -> int:
    if args.repair and choice.options.get("read_only") is True:
        raise UsageError(
            '--repair needs a writable backend: drop "read_only" from --backend-config'
        )
    scan_options = inspect_options(choice)
    backend = open_backend(choice.name, scan_options)
    dry_run = args.repair and (args.dry_run or (not args.yes and on_terminal()))
    try:
        reports = list(
            scannable(backend, choice.name).scan(payloads=not args.headers_only, model=args.model)
        )
        problems = [report for report in reports if report.problem]
        if args.repair:
            _check_model(args.model, reports)
        repairs: list[RepairResult] | None = None
        if args.repair and not dry_run and (problems or args.adopt):
            if scan_options.get("read_only") is True:
                # Writable now, but with no clean-up at open: only what was shown changes.
                backend.close()
                backend = open_backend(choice.name, repair_options(choice))
            repairs = scannable(backend, choice.name).repair(problems)
    finally:
        backend.close()
    left = (
        len(problems) if repairs is None else sum(not result.action.resolved for result in repairs)
    )
    status = EXIT_CLEAN if not problems else EXIT_LEFT if left else EXIT_REPAIRED
    if args.json:
        say(json.dumps(_document(args, choice, reports, repairs, status, dry_run), indent=1))
    else:
        _print_human(args, choice, reports, repairs, left, dry_run)
    return status


def _purge(args: argparse.Namespace, choice: BackendChoice) -> int:
    """Empty the quarantine of the chosen backend (a plan only, in a dry run)."""
    if choice.options.get("read_only") is True:
        raise UsageError(
            '--purge-quarantine needs a writable backend: drop "read_only" from --backend-config'
        )
    dry_run = args.dry_run or (not args.yes and on_terminal())
    backend = open_backend(
        choice.name, inspect_options(choice) if dry_run else repair_options(choice)
    )
    try:
        purge = getattr(backend, "purge_quarantine", None)
        if purge is None:
            raise UsageError(f"--purge-quarantine: the {choice.name} backend keeps no quarantine")
        removed: list[tuple[str, int]] = purge(dry_run=dry_run)
    finally:
        backend.close()
    nbytes = sum(size for _, size in removed)
    if args.json:
        document = {
            "schema": JSON_SCHEMA,
            "command": "fsck",
            "backend": choice.name,
            "purge_quarantine": [{"location": path, "bytes": size} for path, size in removed],
            "dry_run": dry_run,
            "bytes": nbytes,
            "exit_status": EXIT_CLEAN,
        }
        say(json.dumps(document, indent=1))
        return EXIT_CLEAN
    verb = "would remove" if dry_run else "removed"
    for path, size in removed:
        say(f"  {verb:<12} {path} ({format_bytes(size)})")
    if dry_run:
        why = "--dry-run" if args.dry_run else "stdin is a terminal"
        say(
            f"quarantine: {len(removed)} file(s), {format_bytes(nbytes)}; dry run ({why}): "
            "nothing was changed; run again with --purge-quarantine --yes to remove them"
        )
    else:
        say(f"quarantine purged: removed {len(removed)} file(s), {format_bytes(nbytes)}")
    return EXIT_CLEAN


def repair_options(choice: BackendChoice) -> dict[str, object]:
    """The chosen options for a writable open that cleans nothing up at open."""
    options = dict(choice.options)
    if "clean_at_open" in attrs.fields_dict(backend_entry(choice.name).config_type):
        options["clean_at_open"] = False
    return options


def _check_model(model: str | None, reports: Sequence[ObjectReport]) -> None:
    """Refuse a repair whose ``--model`` matches no stored object (it would delete all)."""
    if model is None or not any(r.state is ObjectState.WRONG_MODEL for r in reports):
        return
    counts: dict[str, int] = {}
    for report in reports:
        if report.key is not None and report.state is not ObjectState.QUARANTINED:
            name = report.key.namespace.model
            counts[name] = counts.get(name, 0) + 1
    if model in counts:
        return
    held = ", ".join(f"{name} ({count})" for name, count in sorted(counts.items()))
    raise UsageError(
        f"--model {model!r} matches no stored object, so --repair would delete all "
        f"{sum(counts.values())} of them; the store holds objects of: {held}. Nothing was "
        "changed; check the fingerprint"
    )


_VERBS: Final = {
    RepairAction.QUARANTINED: "quarantine",
    RepairAction.REMOVED: "remove",
    RepairAction.RESTRICTED: "restrict",
    RepairAction.KEPT: "keep",
}


def _report_json(report: ObjectReport) -> dict[str, object]:
    return {
        "state": report.state.value,
        "location": report.location,
        "key": None if report.key is None else str(report.key),
        "kind": None if report.kind is None else report.kind.value,
        "bytes": report.nbytes,
        "reason": report.reason,
        "exposed": report.exposed,
    }


def _document(
    args: argparse.Namespace,
    choice: BackendChoice,
    reports: Sequence[ObjectReport],
    repairs: Sequence[RepairResult] | None,
    status: int,
    dry_run: bool,
) -> dict[str, object]:
    problems = [r for r in reports if r.problem]
    return {
        "schema": JSON_SCHEMA,
        "command": "fsck",
        "backend": choice.name,
        "options": dict(choice.options),
        "payloads_checked": not args.headers_only,
        "model": args.model,
        "summary": summarize(reports).as_json(),
        "problems": [_report_json(r) for r in problems],
        "foreign": [_report_json(r) for r in reports if r.state is ObjectState.FOREIGN],
        "plan": None
        if not args.repair
        else [{**_report_json(r), "action": planned_action(r).value} for r in problems],
        "dry_run": dry_run,
        "repair": None
        if repairs is None
        else [
            {**_report_json(r.report), "action": r.action.value, "action_reason": r.reason}
            for r in repairs
        ],
        "exit_status": status,
    }


_EXPOSED_SHOWN: Final = 20


def _print_human(
    args: argparse.Namespace,
    choice: BackendChoice,
    reports: Sequence[ObjectReport],
    repairs: Sequence[RepairResult] | None,
    left: int,
    dry_run: bool,
) -> None:
    where = choice.options.get("root")
    say(f"fsck of the {choice.name} backend" + (f" at {where}" if where else ""))
    exposed_only = [r for r in reports if r.exposed and not r.state.problem]
    for report in reports:
        if report.state.problem or report.state is ObjectState.FOREIGN:
            say(f"  {report.state.value:<14} {report.location}: {report.reason}")
    for report in exposed_only[:_EXPOSED_SHOWN]:
        say(f"  {'exposed':<14} {report.location}: {report.reason}")
    if len(exposed_only) > _EXPOSED_SHOWN:
        say(f"  ... and {len(exposed_only) - _EXPOSED_SHOWN} more exposed (--json lists all)")
    summary = summarize(reports)
    say("summary:")
    for state, tally in summary.states.items():
        if tally.count or state in (ObjectState.OK, ObjectState.CORRUPT):
            say(f"  {state.value:<14} {tally.count:>8}  {format_bytes(tally.bytes)}")
    if summary.exposed.count:
        exposed = summary.exposed
        say(f"  {'exposed':<14} {exposed.count:>8}  {format_bytes(exposed.bytes)}")
    if not args.headers_only:
        checked = "payload checksums verified"
    else:
        checked = "headers and sizes only (--headers-only)"
    say(f"checked: {checked}")
    if args.model is not None and not any(
        r.key is not None and r.key.namespace.model == args.model for r in reports
    ):
        say(f"note: no stored object is of model {args.model!r}")
    problems = summary.problems
    if args.repair and problems:
        say("repair plan:" if not dry_run else "repair plan (dry run, nothing is changed):")
        for report in reports:
            if report.problem:
                say(f"  {_VERBS[planned_action(report)]:<12} {report.location}")
    if not problems:
        say("result: clean")
    elif dry_run:
        why = "--dry-run" if args.dry_run else "stdin is a terminal"
        say(
            f"result: {problems} problem(s) found; dry run ({why}): nothing was changed; "
            "run again with --repair --yes to do the above"
        )
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
