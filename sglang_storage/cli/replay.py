"""``sglang-storage replay``: being built (placeholder so the command's parser is complete)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``replay`` parser to ``subparsers``."""
    parser = subparsers.add_parser("replay", help="replay (not built yet)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    print("sglang-storage replay: not built yet", file=sys.stderr)
    return 2
