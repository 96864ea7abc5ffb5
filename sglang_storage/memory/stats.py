"""Usage figures every host pool reports, in one typed shape."""

from __future__ import annotations

import attrs

from sglang_storage.core import DataKind

__all__ = ["PoolStats"]


@attrs.frozen(kw_only=True)
class PoolStats:
    """A snapshot of one host pool's memory, in bytes."""

    kind: DataKind
    """The data kind the pool holds."""
    label: str
    """The pool's name."""
    capacity_bytes: int
    """Bytes the pool can hold."""
    used_bytes: int
    """Bytes in allocated units (slots, pages, runs)."""
    free_bytes: int
    """Bytes that can still be allocated."""
    pinned_bytes: int
    """Bytes in units pinned by in-flight transfers (they cannot be freed now)."""
    page_locked: bool
    """Whether the pool's memory is page-locked for DMA."""
