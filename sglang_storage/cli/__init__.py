"""The ``sglang-storage`` command.

Sub-commands, one module each:

- ``replay`` (:mod:`.replay`) - drive the KV cache manager with a generated multi-turn
  workload through device, host and a backend, and report what each tier served.
- ``bench`` (:mod:`.bench`) - backend micro-benchmarks, optionally side by side with
  SGLang 0.5.23's ``HiCacheFile``, with a markdown report.
- ``fsck`` (:mod:`.fsck`) - verify every stored object of a backend and optionally repair.
- ``stats`` (:mod:`.stats`) - what a backend holds.
- ``clear`` (:mod:`.clear`) - delete every stored object of one model.
- ``config`` (:mod:`.config_check`) - validate a storage config file (``--storage-config``)
  and print the effective settings.

Each module exposes ``register(subparsers)``, which adds its parser and sets the
parser's ``run`` default to a function taking the parsed namespace and returning the exit
status. :func:`main` imports only the module of the command it runs (the others get a
parser that only names them), so ``--help``, ``fsck`` and ``stats`` never import torch.
Output cut short by a closed pipe (``stats | head``) ends quietly with status 141, as a
process killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Final

from sglang_storage import __version__

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

COMMANDS: Final = {
    "replay": (
        "replay",
        "replay a multi-turn workload through device, host and storage (the demo)",
    ),
    "bench": ("bench", "backend micro-benchmarks, optionally against SGLang's HiCacheFile"),
    "fsck": ("fsck", "verify every stored object of a backend; --repair fixes what is wrong"),
    "stats": ("stats", "what a backend holds: objects, bytes, namespaces, data kinds"),
    "clear": ("clear", "delete every stored object of one model (--model); shown first"),
    "config": ("config_check", "check a --storage-config file and print the effective settings"),
}
"""Each command: its module in this package and the one line ``--help`` lists it with."""

EXIT_BROKEN_PIPE: Final = 141
"""The status when stdout was closed early (128 + SIGPIPE, as a shell reports it)."""


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """Return the argument parser of the ``sglang-storage`` command.

    Args:
        commands: The commands whose modules are imported and whose parsers are complete;
            the others can only be listed. ``None``: all of them.
    """
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
    parser.add_argument(
        "--list-backends",
        action="store_true",
        help="list the registered storage backends and exit",
    )
    parser.add_argument(
        "--list-test-backends",
        action="store_true",
        help="list them with the test-only ones (faulty) and exit",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="<command>")
    for name, (module, summary) in COMMANDS.items():
        if commands is None or name in commands:
            importlib.import_module(f"{__name__}.{module}").register(subparsers)
        else:
            subparsers.add_parser(name, help=summary, add_help=False)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (its first word that is not an option), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def _list_backends(*, test_backends: bool) -> int:
    from sglang_storage.storage import backend_entry, backend_names

    for name in backend_names(test_backends=test_backends):
        entry = backend_entry(name)
        test = " (test only)" if entry.test_only else ""
        sys.stdout.write(f"{name:<10} {entry.summary}{test}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    words = sys.argv[1:] if argv is None else list(argv)
    command = _command(words)
    parser = build_parser(() if command is None else (command,))
    try:
        args = parser.parse_args(words)
        if args.list_backends or args.list_test_backends:
            return _list_backends(test_backends=args.list_test_backends)
        run: Runner | None = getattr(args, "run", None)
        if run is None:
            parser.print_usage(sys.stderr)
            sys.stderr.write(
                f"{parser.prog}: error: no command given; choose one of "
                f"{', '.join(COMMANDS)} (see --help)\n"
            )
            return 2
        status = run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`stats | head`): what it did not read is not an error.
        # Point stdout at /dev/null so the interpreter's final flush is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return status
