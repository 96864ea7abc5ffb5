"""The ``sglang-storage`` command.

Sub-commands, one module each:

- ``replay`` (:mod:`.replay`) - drive the KV cache manager with a generated multi-turn
  workload through device, host and a backend, and report what each tier served.
- ``bench`` (:mod:`.bench`) - backend micro-benchmarks, optionally side by side with
  SGLang 0.5.23's ``HiCacheFile``, with a markdown report.
- ``fsck`` (:mod:`.fsck`) - verify every stored object of a backend and optionally repair.
- ``stats`` (:mod:`.stats`) - what a backend holds.

Each module exposes ``register(subparsers)``, which adds its parser and sets the
parser's ``run`` default to a function taking the parsed namespace and returning the exit
status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from sglang_storage import __version__
from sglang_storage.cli import bench, fsck, replay, stats

__all__ = ["build_parser", "main"]

_DESCRIPTION = (
    "sglang-storage: the typed storage subsystem for SGLang (KV cache and other large "
    "tensors between GPU, host DRAM and storage backends)."
)
_EPILOG = (
    "Start with `sglang-storage replay` (the demo); `sglang-storage <command> --help` "
    "shows each command's options and examples."
)

Runner = Callable[[argparse.Namespace], int]
"""What a sub-command's parser stores as its ``run`` default."""


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``sglang-storage`` command."""
    parser = argparse.ArgumentParser(
        prog="sglang-storage",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__}",
        help="print the installed version and exit",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="<command>")
    for module in (replay, bench, fsck, stats):
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Runner | None = getattr(args, "run", None)
    if run is None:
        parser.print_usage(sys.stderr)
        print(
            f"{parser.prog}: error: no command given; choose one of replay, bench, fsck, "
            "stats (see --help)",
            file=sys.stderr,
        )
        return 2
    return run(args)
