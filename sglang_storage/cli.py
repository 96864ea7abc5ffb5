"""The ``sglang-storage`` command.

``sglang-storage --version`` prints the installed version and ``--help`` the usage. The
sub-commands (``replay``, ``bench``, ``fsck``, ``stats``) are not built yet; until they
are, running the command without ``--help`` or ``--version`` is a usage error (exit 2)
that says so.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sglang_storage import __version__

__all__ = ["build_parser", "main"]

_DESCRIPTION = (
    "sglang-storage: the typed storage subsystem for SGLang (KV cache and other large "
    "tensors between GPU, host DRAM and storage backends)."
)
_EPILOG = (
    "Sub-commands: none yet. The replay demo, backend benchmarks, fsck and stats are "
    "planned; see README.md, section Status."
)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``sglang-storage`` command."""
    parser = argparse.ArgumentParser(
        prog="sglang-storage", description=_DESCRIPTION, epilog=_EPILOG
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__}",
        help="print the installed version and exit",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_usage(sys.stderr)
    print(
        f"{parser.prog}: error: no sub-command given; none is available yet (see --help)",
        file=sys.stderr,
    )
    return 2
