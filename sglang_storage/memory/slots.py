"""Fixed-size slot allocation with pin counts, N slots per call.

A :class:`SlotAllocator` hands out slot numbers ``0 .. capacity-1`` as int64 tensors, the
shape SGLang's host pools use for page and token indices. Contract, one line per primitive:

- ``alloc(n)`` - ``n`` distinct free slots, now allocated; :class:`CapacityError` when fewer
  than ``n`` are free (nothing is allocated then).
- ``free(slots)`` - give allocated, unpinned slots back.
- ``pin(slots)`` / ``unpin(slots)`` - add / drop one pin per slot; a pinned slot (one an
  in-flight transfer uses) cannot be freed, so it cannot be handed out again mid-transfer.
- ``pinned(slots)`` - a context manager that pins on entry and unpins on exit.
- ``reset()`` - free every slot at once (refused while any slot is pinned).

Batch arguments are 1-D integer tensors (or sequences of ints) of distinct slots. A slot
out of range, a repeated slot, freeing a free slot, freeing a pinned slot, pinning a free
slot or unpinning an unpinned one is refused as a whole with a typed error
(:class:`ConfigError` for a bad argument, :class:`StateError` for a state rule) and changes
nothing. Every call costs O(n) in the slots it touches, never O(capacity), and is atomic
with respect to other threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from sglang_storage.config import require_int
from sglang_storage.errors import CapacityError, ConfigError, StateError

__all__ = ["SlotAllocator", "SlotStats", "as_slot_tensor", "slot_array"]

_FREE: Final = -1
_SHOWN: Final = 8  # how many offending slots an error message lists


@attrs.frozen(kw_only=True)
class SlotStats:
    """Counts of a slot allocator's slots by state."""

    capacity: int
    """Total slots."""
    used: int
    """Allocated slots, pinned or not."""
    free: int
    """Slots that ``alloc`` can hand out."""
    pinned: int
    """Allocated slots with at least one pin."""


def as_slot_tensor(slots: torch.Tensor | Sequence[int], *, owner: str) -> torch.Tensor:
    """Return ``slots`` as a 1-D int64 CPU tensor, or raise ConfigError naming ``owner``."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise ConfigError(
                owner=owner,
                field="slots",
                value=f"tensor of {slots.dtype}",
                reason="must be an integer tensor",
                allowed="torch.int32 or torch.int64 (or any integer dtype)",
            )
        if slots.dim() != 1:
            raise ConfigError(
                owner=owner,
                field="slots",
                value=f"tensor of shape {tuple(slots.shape)}",
                reason="must be 1-D",
            )
        return slots.to(device="cpu", dtype=torch.int64)
    values = list(slots)
    if any(isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) for v in values):
        raise ConfigError(
            owner=owner, field="slots", value=values, reason="must be a sequence of ints"
        )
    return torch.tensor([int(v) for v in values], dtype=torch.int64)


def slot_array(slots: torch.Tensor | Sequence[int], *, owner: str) -> npt.NDArray[np.int64]:
    """Return ``slots`` as a 1-D int64 numpy array (sharing a CPU int64 tensor's memory)."""
    return as_slot_tensor(slots, owner=owner).numpy()


def _listed(values: npt.NDArray[np.int64]) -> str:
    shown = values[:_SHOWN].tolist()
    more = f" and {values.size - _SHOWN} more" if values.size > _SHOWN else ""
    return f"{shown}{more}"


class SlotAllocator:
    """Slots ``0 .. capacity-1`` allocated and freed N at a time, with pin counts.

    Args:
        capacity: The number of slots (>= 1).
        name: What the slots are, for error messages ("KV host pool pages").
    """

    def __init__(self, capacity: int, *, name: str = "slots") -> None:
        require_int(capacity, owner="SlotAllocator", field="capacity", low=1)
        self._capacity = capacity
        self._name = name
        # Bookkeeping lives in numpy arrays: a small numpy index op costs a fraction of
        # torch's dispatch, and tensors cross over without copies (from_numpy / numpy()).
        # Free slots are _stack[_head:]; alloc takes from _head upwards, free pushes below it.
        self._stack = np.arange(capacity, dtype=np.int64)
        self._head = 0
        # Per slot: _FREE, or the pin count (>= 0) of an allocated slot.
        self._state = np.full(capacity, _FREE, dtype=np.int32)
        # Scratch for the O(n) duplicate check (holds stale values between calls; that is fine).
        self._scratch = np.zeros(capacity, dtype=np.int64)
        self._positions = np.arange(capacity, dtype=np.int64)
        self._pinned_slots = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """The number of slots."""
        return self._capacity

    @property
    def name(self) -> str:
        """What the slots are, as errors name them."""
        return self._name

    @property
    def free_count(self) -> int:
        """How many slots ``alloc`` can hand out now."""
        return self._capacity - self._head

    @property
    def used_count(self) -> int:
        """How many slots are allocated."""
        return self._head

    def stats(self) -> SlotStats:
        """Counts of slots by state."""
        with self._lock:
            return SlotStats(
                capacity=self._capacity,
                used=self._head,
                free=self._capacity - self._head,
                pinned=self._pinned_slots,
            )

    def alloc(self, n: int) -> torch.Tensor:
        """Allocate ``n`` distinct free slots and return them as an int64 tensor.

        Raises:
            ConfigError: ``n`` is not an int >= 0.
            CapacityError: fewer than ``n`` slots are free; nothing was allocated.
        """
        require_int(n, owner=f"{self._name} alloc", field="n")
        with self._lock:
            free = self._capacity - self._head
            if n > free:
                raise CapacityError(
                    resource=self._name,
                    requested=n,
                    available=free,
                    unit="slots",
                    hint="free or evict slots first, or size the pool larger",
                )
            slots = self._stack[self._head : self._head + n].copy()
            self._state[slots] = 0
            self._head += n
        return torch.from_numpy(slots)

    def free(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Give allocated, unpinned ``slots`` back; they may be handed out again.

        Raises:
            ConfigError: a slot is out of range or repeated, or ``slots`` is not 1-D integer.
            StateError: a slot is already free, or pinned; nothing was freed.
        """
        index = self._checked(slots, "free")
        n = index.size
        if n == 0:
            return
        with self._lock:
            self._check_distinct(index, "free")
            state = self._state[index]
            if not (state == 0).all():
                self._refuse(index, state == _FREE, "free", "are already free (double free)")
                self._refuse(
                    index, state > 0, "free", "are pinned by an in-flight transfer; unpin first"
                )
            self._state[index] = _FREE
            self._head -= n
            self._stack[self._head : self._head + n] = index

    def pin(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Add one pin to each of ``slots``, which must be allocated.

        Raises:
            ConfigError: a slot is out of range or repeated.
            StateError: a slot is free; nothing was pinned.
        """
        index = self._checked(slots, "pin")
        if index.size == 0:
            return
        with self._lock:
            self._check_distinct(index, "pin")
            state = self._state[index]
            self._refuse(
                index, state == _FREE, "pin", "are free; only allocated ones can be pinned"
            )
            self._pinned_slots += int((state == 0).sum())
            self._state[index] = state + 1

    def unpin(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Drop one pin from each of ``slots``.

        Raises:
            ConfigError: a slot is out of range or repeated.
            StateError: a slot has no pin; nothing was unpinned.
        """
        index = self._checked(slots, "unpin")
        if index.size == 0:
            return
        with self._lock:
            self._check_distinct(index, "unpin")
            state = self._state[index]
            self._refuse(index, state <= 0, "unpin", "are not pinned")
            self._pinned_slots -= int((state == 1).sum())
            self._state[index] = state - 1

    @contextmanager
    def pinned(self, slots: torch.Tensor | Sequence[int]) -> Iterator[torch.Tensor]:
        """Pin ``slots`` for the duration of a ``with`` block; yields them as a tensor."""
        index = torch.from_numpy(self._checked(slots, "pin"))
        self.pin(index)
        try:
            yield index
        finally:
            self.unpin(index)

    def is_allocated(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """A bool tensor: which of ``slots`` are allocated."""
        index = self._checked(slots, "is_allocated")
        with self._lock:
            return torch.from_numpy(self._state[index] != _FREE)

    def pin_counts(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The pin count of each of ``slots`` (0 for unpinned or free slots)."""
        index = self._checked(slots, "pin_counts")
        with self._lock:
            return torch.from_numpy(np.maximum(self._state[index], 0))

    def reset(self) -> None:
        """Free every slot.

        Raises:
            StateError: some slots are pinned; nothing was freed.
        """
        with self._lock:
            if self._pinned_slots:
                raise StateError(
                    subject=f"{self._name} reset",
                    reason=f"{self._pinned_slots} slots are pinned by in-flight transfers",
                )
            self._stack = np.arange(self._capacity, dtype=np.int64)
            self._state.fill(_FREE)
            self._head = 0

    # ------------------------------------------------------------------ checks

    def _checked(self, slots: torch.Tensor | Sequence[int], op: str) -> npt.NDArray[np.int64]:
        index = slot_array(slots, owner=f"{self._name} {op}")
        if index.size and (index.min() < 0 or index.max() >= self._capacity):
            bad = index[(index < 0) | (index >= self._capacity)]
            raise ConfigError(
                owner=f"{self._name} {op}",
                field="slots",
                value=_listed(bad),
                reason="are out of range",
                allowed=f"0 .. {self._capacity - 1}",
            )
        return index

    def _check_distinct(self, index: npt.NDArray[np.int64], op: str) -> None:
        # Write each position into its slot's scratch cell; a repeated slot keeps only one
        # writer, so some position reads back another position's number.
        if index.size > self._capacity:  # more in-range slots than exist: some repeat
            raise ConfigError(
                owner=f"{self._name} {op}",
                field="slots",
                value=f"{index.size} slots",
                reason=f"repeat slots: there are only {self._capacity}",
            )
        positions = self._positions[: index.size]
        self._scratch[index] = positions
        repeated = self._scratch[index] != positions
        if repeated.any():
            raise ConfigError(
                owner=f"{self._name} {op}",
                field="slots",
                value=_listed(index[repeated]),
                reason="are repeated; each slot may appear once per call",
            )

    def _refuse(
        self, index: npt.NDArray[np.int64], bad: npt.NDArray[np.bool_], op: str, what: str
    ) -> None:
        if bad.any():
            raise StateError(
                subject=f"{self._name} {op}", reason=f"slots {_listed(index[bad])} {what}"
            )
