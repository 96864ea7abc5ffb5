"""What every host pool shares: one budgeted buffer with a life cycle, and slot allocation.

- :class:`HostPool` - takes one buffer from :class:`HostMemory` for a data kind; ``buffer``
  and every data access raise :class:`StateError` once the pool is closed; ``close()``
  (also on leaving a ``with`` block) is refused while an in-flight transfer pins anything,
  then gives the bytes back to the budget. Closing twice is a no-op.
- :class:`SlotPool` - a host pool whose units are the slots of one
  :class:`SlotAllocator`: ``alloc`` / ``free`` / ``pin`` / ``unpin`` / ``pinned``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Self

import torch

from sglang_storage.core import DataKind
from sglang_storage.errors import StateError
from sglang_storage.memory.host import HostBuffer, HostMemory
from sglang_storage.memory.slots import SlotAllocator

__all__ = ["HostPool", "SlotPool"]


class HostPool:
    """A pool over one buffer charged to ``kind``'s budget.

    Args:
        memory: Where the buffer comes from.
        kind: The budget it is charged to.
        nbytes: The buffer's size.
        label: The pool's name in stats and errors.

    Raises:
        CapacityError: the budget has no room for the buffer.
    """

    def __init__(self, memory: HostMemory, kind: DataKind, nbytes: int, *, label: str) -> None:
        self._memory = memory
        self._label = label
        self._buffer: HostBuffer | None = memory.allocate(kind, nbytes, label=label)

    @property
    def label(self) -> str:
        """The pool's name."""
        return self._label

    @property
    def buffer(self) -> HostBuffer:
        """The underlying host memory block (for registration with zero-copy backends)."""
        return self._check_open()

    @property
    def page_locked(self) -> bool:
        """Whether the pool's memory is page-locked for DMA."""
        return self._memory.page_locked

    def close(self) -> None:
        """Give the buffer back to the budget; the pool cannot be used afterwards.

        Raises:
            StateError: something is pinned by an in-flight transfer; nothing was closed.
        """
        if self._buffer is None:
            return
        pinned = self._pinned_reason()
        if pinned is not None:
            raise StateError(subject=f"{self._label} close", reason=pinned)
        buffer, self._buffer = self._buffer, None
        self._on_close()
        self._memory.release(buffer)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> HostBuffer:
        if self._buffer is None:
            raise StateError(subject=self._label, reason="is closed")
        return self._buffer

    def _pinned_reason(self) -> str | None:
        """What in-flight transfers pin, or None when nothing is (then the pool may close)."""
        return None

    def _on_close(self) -> None:
        """Drop what the pool tracks about its contents once the buffer is gone."""


class SlotPool(HostPool):
    """A host pool whose units are the slots of one :class:`SlotAllocator`.

    Args:
        memory: Where the buffer comes from.
        kind: The budget it is charged to.
        nbytes: The buffer's size.
        label: The pool's name.
        capacity: The number of slots.
        unit: What a slot is, plural ("pages", "records"), for errors.
    """

    def __init__(
        self,
        memory: HostMemory,
        kind: DataKind,
        nbytes: int,
        *,
        label: str,
        capacity: int,
        unit: str,
    ) -> None:
        super().__init__(memory, kind, nbytes, label=label)
        self._unit = unit
        self._slots = SlotAllocator(capacity, name=f"{label} {unit}")

    @property
    def slots(self) -> SlotAllocator:
        """The slot allocator (counts and pin state)."""
        return self._slots

    def alloc(self, n: int) -> torch.Tensor:
        """Allocate ``n`` slots; see :meth:`SlotAllocator.alloc`."""
        self._check_open()
        return self._slots.alloc(n)

    def free(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Free allocated, unpinned slots; see :meth:`SlotAllocator.free`."""
        self._check_open()
        self._slots.free(slots)

    def pin(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Pin slots for an in-flight transfer; see :meth:`SlotAllocator.pin`."""
        self._check_open()
        self._slots.pin(slots)

    def unpin(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Drop one pin per slot; see :meth:`SlotAllocator.unpin`."""
        self._check_open()
        self._slots.unpin(slots)

    @contextmanager
    def pinned(self, slots: torch.Tensor | Sequence[int]) -> Iterator[torch.Tensor]:
        """Pin ``slots`` for a ``with`` block; yields them as a tensor."""
        self._check_open()
        with self._slots.pinned(slots) as index:
            yield index

    def _pinned_reason(self) -> str | None:
        pinned = self._slots.stats().pinned
        return f"{pinned} {self._unit} are pinned by in-flight transfers" if pinned else None
