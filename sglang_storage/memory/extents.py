"""Runs of consecutive units (pages, aligned blocks) allocated best-fit, with coalescing.

Contract, one line per primitive:

- ``allocate(n)`` - ``n`` units as the fewest runs it can: one run when any free run is
  large enough (the smallest such run: best fit), otherwise the largest free runs first.
  Fails only when fewer than ``n`` units are free in all.
- ``allocate_contiguous(n)`` - ``n`` units as exactly one run, or a CapacityError that says
  the space is fragmented.
- ``free(runs)`` - give runs back; neighbours merge at once, so free space never stays
  split into pieces that could be one.

Costs are O(log R) to find a run plus O(R) list insertions (R = number of free runs, a
memmove in C), where SGLang's first-fit ``RangePageAllocator`` scans and re-sorts all free
ranges on every free. Freeing a run that is not allocated (double free, a made-up run) is a
:class:`StateError` and changes nothing.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable

import attrs

from sglang_storage.config import require_int
from sglang_storage.errors import CapacityError, StateError

__all__ = ["ExtentAllocator", "Run"]


@attrs.frozen(order=True)
class Run:
    """Units ``start .. start + length - 1``, as an allocator handed them out.

    Not validated on construction: runs are made by :class:`ExtentAllocator`, which checks
    every run given back against what it handed out.
    """

    start: int
    length: int

    @property
    def end(self) -> int:
        """One past the last unit."""
        return self.start + self.length


class ExtentAllocator:
    """Allocates runs of consecutive units out of ``capacity`` units.

    Args:
        capacity: The number of units (>= 1).
        name: What the units are, for errors ("embedding pool pages").
    """

    def __init__(self, capacity: int, *, name: str = "units") -> None:
        require_int(capacity, owner="ExtentAllocator", field="capacity", low=1)
        self._capacity = capacity
        self._name = name
        self._free_by_start: dict[int, int] = {0: capacity}
        self._free_by_end: dict[int, int] = {capacity: 0}
        self._by_size: list[tuple[int, int]] = [(capacity, 0)]  # (length, start), sorted
        self._allocated: dict[int, int] = {}  # start -> length of every handed-out run
        self._free_units = capacity
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Total units."""
        return self._capacity

    @property
    def free_units(self) -> int:
        """Units not allocated."""
        return self._free_units

    @property
    def free_runs(self) -> int:
        """How many separate free runs there are (1 means no fragmentation)."""
        return len(self._by_size)

    @property
    def largest_free_run(self) -> int:
        """The longest run ``allocate_contiguous`` could hand out now."""
        with self._lock:
            return self._by_size[-1][0] if self._by_size else 0

    def allocate(self, n: int) -> tuple[Run, ...]:
        """Allocate ``n`` units as the fewest runs possible, ordered by start.

        Raises:
            ConfigError: ``n`` is not an int >= 1.
            CapacityError: fewer than ``n`` units are free; nothing was allocated.
        """
        self._check_count(n)
        with self._lock:
            if n > self._free_units:
                raise CapacityError(
                    resource=self._name,
                    requested=n,
                    available=self._free_units,
                    unit="units",
                    hint="free or evict entries first",
                )
            fit = bisect.bisect_left(self._by_size, (n, -1))
            if fit < len(self._by_size):
                return (self._take(self._by_size[fit], n),)
            runs: list[Run] = []
            remaining = n
            while remaining:
                length, start = self._by_size[-1]
                take = min(length, remaining)
                runs.append(self._take((length, start), take))
                remaining -= take
            return tuple(sorted(runs))

    def allocate_contiguous(self, n: int) -> Run:
        """Allocate ``n`` units as one run.

        Raises:
            ConfigError: ``n`` is not an int >= 1.
            CapacityError: no free run holds ``n`` units; nothing was allocated.
        """
        self._check_count(n)
        with self._lock:
            fit = bisect.bisect_left(self._by_size, (n, -1))
            if fit == len(self._by_size):
                largest = self._by_size[-1][0] if self._by_size else 0
                raise CapacityError(
                    resource=f"{self._name} (one contiguous run)",
                    requested=n,
                    available=largest,
                    unit="units",
                    hint=f"{self._free_units} units are free in {len(self._by_size)} runs",
                )
            return self._take(self._by_size[fit], n)

    def free(self, runs: Iterable[Run]) -> None:
        """Give ``runs`` back; each must be a run exactly as it was handed out.

        Raises:
            StateError: a run is not allocated (double free, or not a run from here);
                nothing was freed.
        """
        runs = list(runs)
        with self._lock:
            seen: set[int] = set()
            for run in runs:
                if self._allocated.get(run.start) != run.length or run.start in seen:
                    raise StateError(
                        subject=f"{self._name} free",
                        reason=f"run {run.start}+{run.length} is not allocated (double free?)",
                    )
                seen.add(run.start)
            for run in runs:
                del self._allocated[run.start]
                self._free_units += run.length
                self._insert_free(run.start, run.length)

    # ------------------------------------------------------------------ internals

    def _check_count(self, n: int) -> None:
        require_int(n, owner=f"{self._name} allocate", field="n", low=1)

    def _take(self, entry: tuple[int, int], n: int) -> Run:
        length, start = entry
        self._remove_free(start, length)
        if length > n:
            self._add_free(start + n, length - n)
        self._allocated[start] = n
        self._free_units -= n
        return Run(start, n)

    def _insert_free(self, start: int, length: int) -> None:
        end = start + length
        before = self._free_by_end.get(start)
        if before is not None:
            before_length = start - before
            self._remove_free(before, before_length)
            start, length = before, length + before_length
        after_length = self._free_by_start.get(end)
        if after_length is not None:
            self._remove_free(end, after_length)
            length += after_length
        self._add_free(start, length)

    def _add_free(self, start: int, length: int) -> None:
        self._free_by_start[start] = length
        self._free_by_end[start + length] = start
        bisect.insort(self._by_size, (length, start))

    def _remove_free(self, start: int, length: int) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + length]
        index = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[index]
