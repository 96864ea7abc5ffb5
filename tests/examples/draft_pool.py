"""Worked example, part 1 of a new data kind: a host pool for speculative-decoding drafts.

A draft is a fixed number of proposed token ids (``int32``) that a draft model produced for
a prefix. The pool keeps drafts in one budgeted host buffer, one draft per slot. It is
built on :class:`~sglang_storage.memory.SlotPool`, which already owns the buffer's life cycle
(charged to a :class:`~sglang_storage.core.DataKind` budget, closed-state checks, ``close()``
refused while a transfer pins a slot) and slot allocation with pins; the pool adds only what
is specific to drafts: their shape, typed reads and writes, and a byte view of one slot for
storage I/O.

Drafts are fixed-shape records, so they are charged to :attr:`DataKind.RECORD` and need no
change to the core enum (``docs/extending.md`` says what a new kind would touch).
"""

from __future__ import annotations

import attrs
import torch

from sglang_storage.config import non_empty_str, positive_int
from sglang_storage.core import DataKind
from sglang_storage.errors import ConfigError, StateError
from sglang_storage.memory import HostMemory, PoolStats, SlotPool

__all__ = ["DraftPool", "DraftPoolConfig"]


@attrs.frozen(kw_only=True)
class DraftPoolConfig:
    """How many drafts the pool holds and how long each is."""

    tokens: int = attrs.field(validator=positive_int)
    """Token ids per draft."""
    capacity: int = attrs.field(validator=positive_int)
    """Drafts the pool holds."""
    label: str = attrs.field(default="draft pool", validator=non_empty_str)

    @property
    def draft_bytes(self) -> int:
        """Bytes per draft."""
        return self.tokens * torch.int32.itemsize


class DraftPool(SlotPool):
    """Drafts of ``config.tokens`` int32 token ids, one per slot, in budgeted host memory.

    Args:
        config: Draft length and count.
        memory: Where the buffer comes from (charged to ``DataKind.RECORD``).

    Raises:
        CapacityError: the budget has no room for the pool.
    """

    def __init__(self, config: DraftPoolConfig, memory: HostMemory) -> None:
        super().__init__(
            memory,
            DataKind.RECORD,
            config.capacity * config.draft_bytes,
            label=config.label,
            capacity=config.capacity,
            unit="drafts",
        )
        self._config = config
        self._drafts = self.buffer.tensor.view(torch.int32).view(config.capacity, config.tokens)

    @property
    def config(self) -> DraftPoolConfig:
        """The pool's configuration."""
        return self._config

    def write(self, slot: int, tokens: torch.Tensor) -> None:
        """Copy ``tokens`` (``config.tokens`` int32 ids) into allocated ``slot``.

        Raises:
            ConfigError: wrong shape or element type.
            StateError: the slot is not allocated.
        """
        if tokens.dtype != torch.int32 or tuple(tokens.shape) != (self._config.tokens,):
            raise ConfigError(
                owner=f"{self.label}.write",
                field="tokens",
                value=f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}",
                reason=f"must be an int32 tensor of shape ({self._config.tokens},)",
            )
        self._row(slot, "write").copy_(tokens)

    def read(self, slot: int) -> torch.Tensor:
        """A copy of the draft in allocated ``slot``."""
        return self._row(slot, "read").clone()

    def bytes_of(self, slot: int) -> memoryview:
        """Allocated ``slot``'s memory as writable bytes: the buffer of a storage get or put."""
        return self._row(slot, "view").numpy().data.cast("B")

    def stats(self) -> PoolStats:
        """Bytes used, free and pinned."""
        counts = self.slots.stats()
        size = self._config.draft_bytes
        return PoolStats(
            kind=DataKind.RECORD,
            label=self.label,
            capacity_bytes=counts.capacity * size,
            used_bytes=counts.used * size,
            free_bytes=counts.free * size,
            pinned_bytes=counts.pinned * size,
            page_locked=self.page_locked,
        )

    def _row(self, slot: int, op: str) -> torch.Tensor:
        self._check_open()
        if not bool(self.slots.is_allocated([slot]).all()):
            raise StateError(subject=f"{self.label}.{op}", reason=f"slot {slot} is not allocated")
        return self._drafts[slot]
