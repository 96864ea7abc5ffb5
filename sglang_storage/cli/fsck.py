"""``sglang-storage fsck``: being built (placeholder so the command's parser is complete)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``fsck`` parser to ``subparsers``."""
    parser = subparsers.add_parser("fsck", help="fsck (not built yet)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    print("sglang-storage fsck: not built yet", file=sys.stderr)
    return 2
