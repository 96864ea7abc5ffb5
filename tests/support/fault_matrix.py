"""What the fault-matrix tests (``tests/reliability/test_fault_matrix_*.py``) share.

- :func:`schedules` - the four seeded fault schedules every manager is run under.
- :class:`Watch` - bounds on the owner thread's calls and waits; a bound passed is a hang.
- :func:`host_memory` and :func:`open_inner` - the host budget and the backend a test wraps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from sglang_storage.memory import BudgetConfig, HostMemory, HostMemoryBudget, MemoryFacts
from sglang_storage.storage import (
    Backend,
    Durability,
    FaultSchedule,
    FileBackend,
    FileBackendConfig,
    MemoryBackend,
)
from support.ledger import Ledger

__all__ = ["CALL_BOUND_S", "WAIT_BOUND_S", "Watch", "host_memory", "open_inner", "schedules"]

WAIT_BOUND_S: Final = 15.0
"""The longest any wait for the manager may take; past it, a hang."""
CALL_BOUND_S: Final = 5.0
"""The longest one manager call may block the owner thread; past it, a hang."""


def schedules(seed: int) -> dict[str, FaultSchedule]:
    """The four schedules, seeded from ``seed`` (each module uses its own hundred)."""
    return {
        "errors": FaultSchedule(seed=seed + 1, error_rate=0.15, partial_batch_rate=0.2),
        "slow": FaultSchedule(
            seed=seed + 2, latency_rate=0.3, latency_s=0.005, timeout_rate=0.1, timeout_s=0.02
        ),
        "media": FaultSchedule(
            seed=seed + 3, vanish_rate=0.1, torn_write_rate=0.15, bit_flip_rate=0.15
        ),
        "all": FaultSchedule(
            seed=seed + 4,
            error_rate=0.05,
            partial_batch_rate=0.1,
            latency_rate=0.1,
            latency_s=0.005,
            timeout_rate=0.05,
            timeout_s=0.02,
            vanish_rate=0.05,
            torn_write_rate=0.05,
            bit_flip_rate=0.05,
        ),
    }


class Watch:
    """Bounds on the owner thread's calls and waits; a bound passed is a hang."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def call(self, fn: Callable[[], object]) -> object:
        """Run one call, counted as an operation; a slow one is a hang."""
        start = time.monotonic()
        result = fn()
        self.ledger.operation()
        if time.monotonic() - start > CALL_BOUND_S:
            self.ledger.hang()
        return result

    def until(self, poll: Callable[[], None], done: Callable[[], bool]) -> bool:
        """Poll until ``done()``; False (and a hang) once the bound passes."""
        end = time.monotonic() + WAIT_BOUND_S
        while time.monotonic() < end:
            poll()
            if done():
                return True
            time.sleep(0.002)
        self.ledger.hang()
        return False


def host_memory(total: int = 64 << 20) -> HostMemory:
    """A host budget of ``total`` bytes on a machine said to have plenty."""
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    return HostMemory(HostMemoryBudget(BudgetConfig(total=total, headroom=0), facts=facts))


def open_inner(kind: str, root: Path) -> Backend:
    """The backend a test wraps: ``memory``, or ``file`` under ``root`` with full durability."""
    if kind == "memory":
        return MemoryBackend()
    if kind == "file":
        return FileBackend(FileBackendConfig(root=root, durability=Durability.FULL))
    raise ValueError(f"open_inner: unknown kind {kind!r} (memory or file)")
