"""The kinds of data the subsystem stores, and the clock type every timed component takes."""

from __future__ import annotations

import enum
from collections.abc import Callable

__all__ = ["Clock", "DataKind"]


class DataKind(enum.Enum):
    """A kind of data, each with its own host memory reservation and storage namespace."""

    KV = "kv"
    """KV cache pages (HiCache tiers, decode-side request KV, sparse KV)."""
    EMBEDDING = "embedding"
    """Encoder outputs (multimodal embeddings), variable numbers of rows."""
    RECORD = "record"
    """Fixed-shape records: RL top-k rows, rope/position info."""
    WEIGHT = "weight"
    """Large immutable blobs: expert weight shards."""


Clock = Callable[[], float]
"""Returns monotonic seconds; only differences between two readings mean anything."""
