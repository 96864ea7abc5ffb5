"""What the host<->storage pipeline needs from a storage backend.

Declared here so that the transfer layer never imports :mod:`sglang_storage.storage`; every
backend there satisfies :class:`PageStore` structurally (its ``Backend`` protocol extends
this one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sglang_storage.core import GetRequest, GetResult, ObjectKey, PutRequest, PutResult

__all__ = ["PageStore"]


class PageStore(Protocol):
    """Batch existence, zero-copy reads into and writes from host buffers, by key.

    Contract:

    - Every batch method returns one result per input, in input order.
    - A failure that concerns one key is that key's result (``ERROR`` with its cause,
      ``CORRUPT`` for an object that failed verification); the other keys still proceed.
    - A failure of the whole call (the backend is closed or unreachable) raises a
      :class:`~sglang_storage.errors.StorageError`.
    - A bad argument raises :class:`~sglang_storage.errors.ConfigError` before any I/O.
    - Methods may be called from several threads at once.
    - ``get_into`` never leaves bytes of a corrupt or foreign object in the buffers of a
      request whose result is not a hit.
    """

    @property
    def name(self) -> str:
        """The backend's registered name ("file", "memory", "mooncake", ...)."""
        ...

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored (a hint: an object may vanish before it is read)."""
        ...

    def get_into(self, requests: Sequence[GetRequest]) -> list[GetResult]:
        """Read each requested object into its buffers."""
        ...

    def put_from(self, requests: Sequence[PutRequest]) -> list[PutResult]:
        """Store each request's buffers as its key; an existing key is kept, not replaced."""
        ...
