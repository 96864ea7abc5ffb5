"""The embedding pool: encoder outputs of any number of rows, keyed by multimodal hash.

Contract, one line per primitive:

- ``EmbeddingPool(config, memory)`` - one buffer of ``(num_pages * rows_per_page, dim)``
  rows from the embedding budget (not one pinned pool per modality of a fixed 4 GB).
- ``put(key, rows)`` - store ``rows`` ``(n, dim)`` under ``key`` in as few page runs as
  possible (:class:`~sglang_storage.memory.extents.ExtentAllocator`); fails only when the
  pool has fewer free pages than needed, never because free pages are scattered.
- ``get(key)`` - a copy of the rows, or None when ``key`` is absent; ``read_into`` fills a
  caller's tensor instead; ``segments(key)`` gives zero-copy views, one per run.
- ``remove(key)`` - free the rows; refused while pinned.
- ``pin(key)`` / ``unpin(key)`` - an in-flight transfer holds the rows.
- ``stats()`` - bytes used, free and pinned.

The pool does not evict on its own: the owner picks victims with an eviction policy and
removes them, so one policy implementation serves every cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import attrs
import torch

from sglang_storage.config import BYTES, instance_of, non_empty_str, optional, positive_int
from sglang_storage.core import DataKind
from sglang_storage.errors import ConfigError, StateError
from sglang_storage.memory.base import HostPool
from sglang_storage.memory.extents import ExtentAllocator, Run
from sglang_storage.memory.host import HostMemory
from sglang_storage.memory.layouts import ELEMENT_DTYPES, dtype_in
from sglang_storage.memory.stats import PoolStats

__all__ = ["EmbeddingEntry", "EmbeddingPool", "EmbeddingPoolConfig"]

TARGET_PAGE_BYTES = 256 * 1024
"""Default page size in bytes (as SGLang's embedding cache)."""


@attrs.frozen(kw_only=True)
class EmbeddingPoolConfig:
    """Shape and size of an embedding pool."""

    dim: int = attrs.field(validator=positive_int)
    """Hidden size of one embedding row."""
    dtype: torch.dtype = attrs.field(
        validator=dtype_in(
            tuple(d for d in ELEMENT_DTYPES if d.is_floating_point),
            what="a floating-point element type",
        )
    )
    """Element type of the rows."""
    capacity: int = attrs.field(metadata=BYTES, validator=positive_int)
    """Bytes of the pool (rounded down to whole pages)."""
    rows_per_page: int | None = attrs.field(default=None, validator=optional(positive_int))
    """Rows per page; default: as many as fit in 256 KiB (at least 1)."""
    label: str = attrs.field(default="embedding pool", validator=non_empty_str)

    @property
    def page_rows(self) -> int:
        """Rows per page, resolved."""
        if self.rows_per_page is not None:
            return self.rows_per_page
        return max(1, TARGET_PAGE_BYTES // (self.dim * self.dtype.itemsize))

    @property
    def row_bytes(self) -> int:
        """Bytes per row."""
        return self.dim * self.dtype.itemsize

    @property
    def num_pages(self) -> int:
        """Whole pages that fit in ``capacity``."""
        return self.capacity // (self.page_rows * self.row_bytes)

    def __attrs_post_init__(self) -> None:
        if self.num_pages < 1:
            raise ConfigError(
                owner="EmbeddingPoolConfig",
                field="capacity",
                value=self.capacity,
                reason=f"must hold at least one page ({self.page_rows * self.row_bytes} bytes)",
            )


@attrs.frozen(kw_only=True)
class EmbeddingEntry:
    """Where one key's rows live: ``num_rows`` rows over ``runs`` of pages, in order."""

    key: str = attrs.field(validator=instance_of(str))
    num_rows: int = attrs.field(validator=positive_int)
    runs: tuple[Run, ...]


class EmbeddingPool(HostPool):
    """Variable-length runs of embedding rows in one budgeted host buffer.

    Args:
        config: Row shape, element type and capacity.
        memory: Where the buffer comes from; charged to the embedding budget.

    Raises:
        CapacityError: the budget has no room for the buffer.
    """

    def __init__(self, config: EmbeddingPoolConfig, memory: HostMemory) -> None:
        rows = config.num_pages * config.page_rows
        super().__init__(memory, DataKind.EMBEDDING, rows * config.row_bytes, label=config.label)
        self._config = config
        self._rows = self._check_open().tensor.view(config.dtype).view(rows, config.dim)
        self._pages = ExtentAllocator(config.num_pages, name=f"{config.label} pages")
        self._entries: dict[str, EmbeddingEntry] = {}
        self._pins: dict[str, int] = {}
        self._pinned_pages = 0
        self._lock = threading.Lock()

    @property
    def config(self) -> EmbeddingPoolConfig:
        """The pool's configuration."""
        return self._config

    @property
    def rows(self) -> torch.Tensor:
        """The whole buffer as ``(num_pages * rows_per_page, dim)`` rows."""
        self._check_open()
        return self._rows

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[str]:
        """The stored keys."""
        return iter(list(self._entries))

    def entry(self, key: str) -> EmbeddingEntry | None:
        """Where ``key``'s rows live, or None when absent."""
        return self._entries.get(key)

    def pages_for(self, num_rows: int) -> int:
        """Pages ``num_rows`` rows occupy."""
        return -(-num_rows // self._config.page_rows)

    def can_fit(self, num_rows: int) -> bool:
        """Whether ``put`` of ``num_rows`` rows would find room now."""
        return self.pages_for(num_rows) <= self._pages.free_units

    def put(self, key: str, rows: torch.Tensor) -> EmbeddingEntry:
        """Store ``rows`` ``(n, dim)`` under ``key``.

        Raises:
            ConfigError: ``rows`` has the wrong shape or element type, or is empty.
            StateError: ``key`` is already stored.
            CapacityError: fewer free pages than ``rows`` need; nothing was stored.
        """
        self._check_open()
        c = self._config
        if not isinstance(key, str):
            raise ConfigError(
                owner=f"{c.label}.put",
                field="key",
                value=key,
                reason=f"must be a str (a multimodal hash as text), not {type(key).__name__}",
            )
        if rows.dim() != 2 or rows.shape[1] != c.dim or rows.shape[0] < 1:
            raise ConfigError(
                owner=f"{c.label}.put",
                field="rows",
                value=f"tensor of shape {tuple(rows.shape)}",
                reason=f"must be (n >= 1, {c.dim})",
            )
        if rows.dtype != c.dtype:
            raise ConfigError(
                owner=f"{c.label}.put",
                field="rows",
                value=str(rows.dtype),
                reason=f"must have the pool's element type {c.dtype}",
            )
        with self._lock:
            if key in self._entries:
                raise StateError(subject=f"{c.label}.put", reason=f"key {key!r} is already stored")
            runs = self._pages.allocate(self.pages_for(rows.shape[0]))
            entry = EmbeddingEntry(key=key, num_rows=rows.shape[0], runs=runs)
            self._entries[key] = entry
        # Pinned while the rows are copied in, so a concurrent remove cannot free them.
        self.pin(key)
        try:
            done = 0
            for segment in self._segments(entry):
                count = segment.shape[0]
                segment.copy_(rows[done : done + count])
                done += count
        finally:
            self.unpin(key)
        return entry

    def get(self, key: str) -> torch.Tensor | None:
        """A copy of ``key``'s rows ``(n, dim)``, or None when absent."""
        self._check_open()
        entry = self._entries.get(key)
        if entry is None:
            return None
        out = torch.empty((entry.num_rows, self._config.dim), dtype=self._config.dtype)
        self.read_into(key, out)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Copy ``key``'s rows into ``out`` (any device), shaped ``(n, dim)``.

        Raises:
            StateError: ``key`` is absent.
            ConfigError: ``out`` has the wrong shape.
        """
        entry = self._require(key, "read_into")
        if out.dtype != self._config.dtype:
            raise ConfigError(
                owner=f"{self._config.label}.read_into",
                field="out",
                value=str(out.dtype),
                reason=f"must have the pool's element type {self._config.dtype}",
            )
        if tuple(out.shape) != (entry.num_rows, self._config.dim):
            raise ConfigError(
                owner=f"{self._config.label}.read_into",
                field="out",
                value=f"tensor of shape {tuple(out.shape)}",
                reason=f"must be {(entry.num_rows, self._config.dim)}",
            )
        done = 0
        for segment in self._segments(entry):
            count = segment.shape[0]
            out[done : done + count].copy_(segment, non_blocking=out.device.type != "cpu")
            done += count

    def segments(self, key: str) -> list[torch.Tensor]:
        """Views of ``key``'s rows, one per page run, in row order (zero copy)."""
        return self._segments(self._require(key, "segments"))

    def remove(self, key: str) -> None:
        """Free ``key``'s rows.

        Raises:
            StateError: ``key`` is absent, or pinned by an in-flight transfer.
        """
        with self._lock:
            entry = self._require(key, "remove")
            if self._pins.get(key):
                raise StateError(
                    subject=f"{self._config.label}.remove",
                    reason=f"key {key!r} is pinned by an in-flight transfer",
                )
            del self._entries[key]
            self._pages.free(entry.runs)

    def pin(self, key: str) -> None:
        """Add one pin to ``key``: it cannot be removed until unpinned.

        Raises:
            StateError: ``key`` is absent.
        """
        with self._lock:
            entry = self._require(key, "pin")
            count = self._pins.get(key, 0)
            if count == 0:
                self._pinned_pages += sum(run.length for run in entry.runs)
            self._pins[key] = count + 1

    def unpin(self, key: str) -> None:
        """Drop one pin from ``key``.

        Raises:
            StateError: ``key`` is absent or not pinned.
        """
        with self._lock:
            entry = self._require(key, "unpin")
            count = self._pins.get(key, 0)
            if count == 0:
                raise StateError(
                    subject=f"{self._config.label}.unpin", reason=f"key {key!r} is not pinned"
                )
            if count == 1:
                del self._pins[key]
                self._pinned_pages -= sum(run.length for run in entry.runs)
            else:
                self._pins[key] = count - 1

    def stats(self) -> PoolStats:
        """Bytes used, free and pinned, in whole pages."""
        page = self._config.page_rows * self._config.row_bytes
        with self._lock:
            free = self._pages.free_units
            pinned = self._pinned_pages
        return PoolStats(
            kind=DataKind.EMBEDDING,
            label=self._config.label,
            capacity_bytes=self._pages.capacity * page,
            used_bytes=(self._pages.capacity - free) * page,
            free_bytes=free * page,
            pinned_bytes=pinned * page,
            page_locked=self.page_locked,
        )

    def _pinned_reason(self) -> str | None:
        if not self._pins:
            return None
        return f"{len(self._pins)} keys are pinned by in-flight transfers"

    def _on_close(self) -> None:
        self._entries.clear()

    # ------------------------------------------------------------------ internals

    def _require(self, key: str, op: str) -> EmbeddingEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise StateError(subject=f"{self._config.label}.{op}", reason=f"no key {key!r}")
        return entry

    def _segments(self, entry: EmbeddingEntry) -> list[torch.Tensor]:
        self._check_open()
        per_page = self._config.page_rows
        left = entry.num_rows
        views = []
        for run in entry.runs:
            count = min(left, run.length * per_page)
            views.append(self._rows[run.start * per_page : run.start * per_page + count])
            left -= count
        return views
