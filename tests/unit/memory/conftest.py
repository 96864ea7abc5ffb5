"""Fixtures for the memory layer's unit tests.

Every budget here is built from injected :class:`MemoryFacts`, so no test depends on how
much memory this machine has free (only ``test_budget.py`` reads the real facts, once).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sglang_storage.memory import BudgetConfig, HostMemory, HostMemoryBudget, MemoryFacts

FACTS = MemoryFacts(physical=64 << 30, available=64 << 30)
DEFAULT_TOTAL = 64 << 20

MemoryFactory = Callable[[int], HostMemory]


def _make_memory(total: int = DEFAULT_TOTAL) -> HostMemory:
    return HostMemory(HostMemoryBudget(BudgetConfig(total=total, headroom=0), facts=FACTS))


@pytest.fixture(scope="session")
def make_memory() -> MemoryFactory:
    """A factory of fresh HostMemory objects with a ``total``-byte budget (no reservations).

    Session-scoped and stateless, so hypothesis tests can use it.
    """
    return _make_memory


@pytest.fixture
def memory() -> HostMemory:
    """A fresh 64 MiB host memory budget, plain or page-locked as ``Pinning.AUTO`` picks."""
    return _make_memory()
