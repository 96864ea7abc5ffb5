"""``sglang-storage stats``: being built (placeholder so the command's parser is complete)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``stats`` parser to ``subparsers``."""
    parser = subparsers.add_parser("stats", help="stats (not built yet)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    print("sglang-storage stats: not built yet", file=sys.stderr)
    return 2
