"""``sglang-storage stats``: what a backend holds, by namespace and data kind.

Contents come from a scan of the object headers (no payloads are read, nothing is
changed; the file and hf3fs backends are opened read-only), next to the backend's own
:class:`~sglang_storage.storage.BackendStats`. A backend that cannot enumerate its
objects (``mooncake``) reports its own statistics only. ``--prometheus`` prints the same
figures in the Prometheus text format, under the names a serving process exports
(:mod:`sglang_storage.managers.observability`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import attrs

from sglang_storage.cli.fsck import (
    EXIT_CLEAN,
    EXIT_OPERATIONAL,
    EXIT_USAGE,
    JSON_SCHEMA,
    BackendChoice,
    UsageError,
    add_backend_arguments,
    backend_choice,
    inspect_options,
    open_backend,
    say,
    scannable,
)
from sglang_storage.errors import StorageError
from sglang_storage.storage import BackendStats, ObjectState, ScanSummary, summarize
from sglang_storage.units import format_bytes

__all__ = ["register"]

_EPILOG = """\
Objects, bytes (headers included), namespaces (model/kind/shard) and data kinds come
from the stored object headers; payloads are not read or verified (use fsck for that).
Backends that cannot enumerate their objects (mooncake) show their own counters only.

--prometheus prints the Prometheus text format (sglang_storage_store_* and
sglang_storage_backend_* families; needs prometheus_client), e.g. for a textfile
collector.

exit status: 0 done, 2 usage error, 8 backend unavailable

examples:
  sglang-storage stats --dir /data/kv-cache
  sglang-storage stats --dir /data/kv-cache --json
  sglang-storage stats --dir /data/kv-cache --prometheus > /var/lib/node_exporter/kv.prom
  sglang-storage stats --backend hf3fs --backend-config '{"root": "/3fs/kv"}'
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``stats`` parser to ``subparsers``."""
    parser = subparsers.add_parser(
        "stats",
        help="what a backend holds: objects, bytes, namespaces, data kinds",
        description="Show what a backend holds (objects, bytes, namespaces, data kinds,\n"
        "read from the object headers) and the backend's own counters.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_backend_arguments(parser)
    parser.add_argument(
        "--prometheus",
        action="store_true",
        help="print the figures in the Prometheus text exposition format",
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.json and args.prometheus:
            raise UsageError("give one of --json and --prometheus")
        choice = backend_choice(args)
        summary, counters = _collect(choice)
        if args.prometheus:
            say(_exposition(choice, summary, counters).rstrip("\n"))
            return EXIT_CLEAN
    except UsageError as error:
        return _fail(args, EXIT_USAGE, str(error))
    except StorageError as error:
        return _fail(args, EXIT_OPERATIONAL, str(error))
    if args.json:
        say(json.dumps(_document(choice, summary, counters), indent=1))
    else:
        _print_human(choice, summary, counters)
    return EXIT_CLEAN


def _collect(choice: BackendChoice) -> tuple[ScanSummary | None, BackendStats]:
    backend = open_backend(choice.name, inspect_options(choice))
    try:
        summary = None
        if backend.capabilities.scannable:
            summary = summarize(scannable(backend, choice.name).scan(payloads=False))
        return summary, backend.stats()
    finally:
        backend.close()


def _exposition(choice: BackendChoice, summary: ScanSummary | None, counters: BackendStats) -> str:
    # Imported here: only --prometheus needs prometheus_client (and the managers' torch).
    from sglang_storage.managers.observability import (
        MetricFamily,
        backend_families,
        store_families,
    )
    from sglang_storage.managers.prometheus import exposition

    families: list[MetricFamily] = [] if summary is None else store_families(summary)
    families += backend_families(counters, backend=choice.name)
    return exposition(families)


def _document(
    choice: BackendChoice, summary: ScanSummary | None, counters: BackendStats
) -> dict[str, object]:
    return {
        "schema": JSON_SCHEMA,
        "command": "stats",
        "backend": choice.name,
        "options": dict(choice.options),
        "scanned": summary is not None,
        "contents": None if summary is None else summary.as_json(),
        "backend_stats": attrs.asdict(counters),
    }


def _print_human(
    choice: BackendChoice, summary: ScanSummary | None, counters: BackendStats
) -> None:
    where = choice.options.get("root")
    say(f"{choice.name} backend" + (f" at {where}" if where else ""))
    if summary is None:
        say(
            "contents: not available (the backend cannot enumerate its objects); "
            "its own counters follow"
        )
    else:
        objects = summary.objects
        say(f"objects: {objects.count}  ({format_bytes(objects.bytes)}, headers included)")
        say(f"namespaces: {len(summary.namespaces)}")
        for path, tally in summary.namespaces.items():
            say(f"  {path:<48} {tally.count:>8}  {format_bytes(tally.bytes)}")
        say("by data kind:")
        for kind, tally in summary.kinds.items():
            say(f"  {kind.value:<48} {tally.count:>8}  {format_bytes(tally.bytes)}")
        others = [
            f"{state.value} {tally.count} ({format_bytes(tally.bytes)})"
            for state, tally in summary.states.items()
            if state is not ObjectState.OK and tally.count
        ]
        if others:
            say("not counted above: " + ", ".join(others) + " (see sglang-storage fsck)")
    cap = counters.capacity_bytes
    say("backend counters (this process):")
    say(
        f"  indexed objects {counters.objects}, bytes {format_bytes(counters.bytes)}, "
        f"capacity {'unbounded' if cap is None else format_bytes(cap)}"
    )


def _fail(args: argparse.Namespace, status: int, message: str) -> int:
    sys.stderr.write(f"sglang-storage stats: error: {message}\n")
    if getattr(args, "json", False):
        document = {"schema": JSON_SCHEMA, "command": "stats", "error": message}
        say(json.dumps({**document, "exit_status": status}, indent=1))
    return status
