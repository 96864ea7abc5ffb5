"""The ``ledger`` fixture every reliability test records into (see ``support.ledger``).

A test module sets its report row with a module-level ``LEDGER_AREA = "..."``; the entry
is written at teardown when ``SGLANG_STORAGE_LEDGER_DIR`` is set.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.ledger import Ledger


@pytest.fixture
def ledger(request: pytest.FixtureRequest) -> Iterator[Ledger]:
    """A fresh :class:`Ledger` for this test, written out after it."""
    area = getattr(request.module, "LEDGER_AREA", None)
    if not isinstance(area, str) or not area:
        raise pytest.UsageError(
            f"{request.module.__name__} must set LEDGER_AREA (its row in docs/reliability.md)"
        )
    entry = Ledger(request.node.nodeid, area)
    yield entry
    entry.write()
