"""The reliability ledger: what each reliability test injected and what it observed.

Every test under ``tests/reliability`` takes the ``ledger`` fixture (``tests/reliability/
conftest.py``) and records, as it goes, the faults it injected (by kind), the operations
it attempted, and the three things that must stay zero: wrong bytes returned, hangs, and
acknowledged-durable objects lost. Tests still assert those zeros themselves; the ledger
only reports them.

When ``SGLANG_STORAGE_LEDGER_DIR`` is set, each test writes its entries to one JSON file
there at teardown (schema: :data:`SCHEMA`); ``ci/reliability_report.py`` runs the suite
with it set and renders ``docs/reliability.md`` from the files. Unset, nothing is written.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Final

__all__ = ["LEDGER_DIR_ENV", "SCHEMA", "Ledger"]

LEDGER_DIR_ENV: Final = "SGLANG_STORAGE_LEDGER_DIR"
SCHEMA: Final = 1
"""Version of the JSON a test writes: ``{"schema", "test", "area", "faults": {kind: n},
"operations", "wrong_bytes", "hangs", "lost_durable"}``."""


class Ledger:
    """Counts for one test; see the module docstring."""

    def __init__(self, test: str, area: str) -> None:
        self.test = test
        self.area = area
        """The row of the report this test feeds, e.g. ``"fault matrix: KV cache"``."""
        self.faults: Counter[str] = Counter()
        self.operations = 0
        self.wrong_bytes = 0
        self.hangs = 0
        self.lost_durable = 0

    def fault(self, kind: str, count: int = 1) -> None:
        """Record ``count`` injected faults of ``kind`` (e.g. ``"bit_flip"``, ``"kill_9"``)."""
        self._check(count)
        self.faults[kind] += count

    def add_faults(self, by_kind: Mapping[str, int]) -> None:
        """Record several kinds at once (e.g. a fault wrapper's own counts)."""
        for kind, count in by_kind.items():
            self.fault(kind, count)

    def operation(self, count: int = 1) -> None:
        """Record ``count`` operations attempted (one batch call or one manager step each)."""
        self._check(count)
        self.operations += count

    def wrong(self, nbytes: int) -> None:
        """Record ``nbytes`` returned that differ from what was written (must stay 0)."""
        self._check(nbytes)
        self.wrong_bytes += nbytes

    def hang(self, count: int = 1) -> None:
        """Record an operation that did not finish within its bound (must stay 0)."""
        self._check(count)
        self.hangs += count

    def lost(self, count: int) -> None:
        """Record acknowledged-durable objects found missing or changed (must stay 0)."""
        self._check(count)
        self.lost_durable += count

    def as_json(self) -> dict[str, object]:
        """The entry this test writes."""
        return {
            "schema": SCHEMA,
            "test": self.test,
            "area": self.area,
            "faults": dict(sorted(self.faults.items())),
            "operations": self.operations,
            "wrong_bytes": self.wrong_bytes,
            "hangs": self.hangs,
            "lost_durable": self.lost_durable,
        }

    def write(self) -> Path | None:
        """Write the entry when ``SGLANG_STORAGE_LEDGER_DIR`` is set; return its path."""
        directory = os.environ.get(LEDGER_DIR_ENV)
        if not directory:
            return None
        path = Path(directory) / (re.sub(r"[^A-Za-z0-9_.-]+", "_", self.test) + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_json(), indent=1) + "\n")
        return path

    @staticmethod
    def _check(count: int) -> None:
        if count < 0:
            raise ValueError(f"a ledger count must be >= 0, got {count}")
