"""Host pages to and from storage under object keys: the one page I/O path of the managers.

"Store these host pages under these keys, then count the leading run stored" (and the same
for reads and hit queries) is what every tiered manager does with a backend. A
:class:`HostPageIO` does it over one :class:`~sglang_storage.memory.KVHostPool` and one
:class:`~sglang_storage.transfer.StoragePipeline`:

- ``put(keys, pages)`` / ``get(keys, pages)`` - one pipeline operation over zero-copy views
  of the pool's pages, which stay pinned (they cannot be freed) until the operation ends and
  its :class:`PageOp` is ``collect()``-ed. A refused submission is a failed :class:`PageOp`
  (nothing pinned), never an exception, so callers keep their order of acknowledgements.
- ``exists(keys)`` - a hit query bounded by ``deadline_s``; ``leading()`` of its op counts
  the leading keys found.
- :meth:`PageOp.leading` - how many leading pages were stored, read or found: the meaning
  SGLang gives ``completed_tokens`` and hit counts (a page after a missing one is useless).

It starts no threads and never blocks except in ``wait`` and ``exists_now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from sglang_storage.core import GetRequest, ObjectKey, PutRequest
from sglang_storage.errors import ConfigError, StorageError
from sglang_storage.memory import KVHostPool
from sglang_storage.transfer import AnyHandle, OpKind, OpState, Priority, StoragePipeline

__all__ = ["HostPageIO", "PageOp"]

_OWNER: Final = "HostPageIO"


class PageOp:
    """One put, get or exists of host pages; ``leading()`` once it is ``done()``.

    ``PageOp.refused()`` is an operation that never started (no storage tier, or the
    submission was refused): it is done, with nothing stored, read or found.
    """

    @classmethod
    def refused(cls, pages: int = 0, error: StorageError | None = None) -> PageOp:
        """An operation over ``pages`` pages that never started."""
        return cls(None, torch.empty(pages, dtype=torch.int64), io=None, error=error)

    def __init__(
        self,
        handle: AnyHandle | None,
        pages: torch.Tensor,
        *,
        io: HostPageIO | None,
        error: StorageError | None = None,
    ) -> None:
        self._handle = handle
        self._pages = pages
        self._io = io
        self._refused = error
        self._collected = handle is None

    @property
    def handle(self) -> AnyHandle | None:
        """The pipeline operation; None when the submission was refused."""
        return self._handle

    @property
    def pages(self) -> int:
        """How many pages (keys) were asked for."""
        return int(self._pages.numel())

    @property
    def error(self) -> StorageError | None:
        """Why the operation (or its submission) failed; None when it did not."""
        if self._refused is not None:
            return self._refused
        return None if self._handle is None else self._handle.error

    @property
    def latency_s(self) -> float:
        """Seconds from submission to the end (0 for a refused submission or while running)."""
        if self._handle is None or self._handle.latency_s is None:
            return 0.0
        return self._handle.latency_s

    def done(self) -> bool:
        """Whether the operation has ended (done, failed, cancelled or refused)."""
        return self._handle is None or self._handle.done()

    def cancel(self) -> None:
        """Stop the operation's remaining backend calls (those in flight still finish)."""
        if self._handle is not None:
            self._handle.cancel()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the operation ends or ``timeout_s`` passes; whether it ended."""
        return self._handle is None or self._handle.wait(timeout_s)

    def leading(self) -> int:
        """How many leading pages were stored / read / found (0 before ``done()``)."""
        if not self.done() or self._handle is None:
            return 0
        count = 0
        for result in self._handle.partial():
            if not _succeeded(result):
                break
            count += 1
        return count

    def moved_bytes(self) -> int:
        """Payload bytes the leading pages hold."""
        return 0 if self._io is None else self.leading() * self._io.pool.page_spec.nbytes

    def collect(self) -> None:
        """Unpin the pages of an ended operation (idempotent; refused while running).

        Raises:
            StateError: the operation has not ended.
        """
        if self._collected:
            return
        assert self._handle is not None
        self._handle.partial()  # raises StateError while it runs
        self._collected = True
        if self._io is not None and self._handle.kind is not OpKind.EXISTS:
            self._io.pool.unpin(self._pages)


def _succeeded(result: object) -> bool:
    if isinstance(result, bool):
        return result
    ok = getattr(result, "ok", None)
    if ok is None:
        ok = getattr(result, "hit", False)
    return bool(ok)


class HostPageIO:
    """Pages of ``pool`` to and from storage through ``pipeline``; see the module contract.

    Args:
        pool: The host pool whose pages move.
        pipeline: The host<->storage pipeline (shared with other users is fine).
    """

    def __init__(self, pool: KVHostPool, pipeline: StoragePipeline) -> None:
        self.pool = pool
        self.pipeline = pipeline

    def _check(self, keys: Sequence[ObjectKey], pages: torch.Tensor) -> torch.Tensor:
        flat = pages.reshape(-1).to("cpu", torch.int64)
        if flat.numel() != len(keys):
            raise ConfigError(
                owner=_OWNER,
                field="pages",
                value=int(flat.numel()),
                reason=f"must give one host page per key ({len(keys)} keys)",
            )
        return flat

    def put(
        self,
        keys: Sequence[ObjectKey],
        pages: torch.Tensor,
        *,
        priority: Priority = Priority.BACKGROUND,
    ) -> PageOp:
        """Store host ``pages`` under ``keys`` (one page per key).

        Raises:
            ConfigError: ``pages`` and ``keys`` differ in length.
        """
        flat = self._check(keys, pages)
        spec, pool = self.pool.page_spec, self.pool
        try:
            requests = [
                PutRequest(key=key, spec=spec, buffers=pool.page_views(int(p)))
                for key, p in zip(keys, flat.tolist(), strict=True)
            ]
            pool.pin(flat)
        except StorageError as error:
            return PageOp(None, flat, io=self, error=error)
        try:
            handle = self.pipeline.submit_put(requests, priority=priority)
        except StorageError as error:
            pool.unpin(flat)
            return PageOp(None, flat, io=self, error=error)
        return PageOp(handle, flat, io=self)

    def get(
        self,
        keys: Sequence[ObjectKey],
        pages: torch.Tensor,
        *,
        priority: Priority = Priority.URGENT,
    ) -> PageOp:
        """Read ``keys`` into host ``pages`` (one page per key).

        Raises:
            ConfigError: ``pages`` and ``keys`` differ in length.
        """
        flat = self._check(keys, pages)
        spec, pool = self.pool.page_spec, self.pool
        try:
            requests = [
                GetRequest(key=key, spec=spec, buffers=pool.page_views(int(p)))
                for key, p in zip(keys, flat.tolist(), strict=True)
            ]
            pool.pin(flat)
        except StorageError as error:
            return PageOp(None, flat, io=self, error=error)
        try:
            handle = self.pipeline.submit_get(requests, priority=priority)
        except StorageError as error:
            pool.unpin(flat)
            return PageOp(None, flat, io=self, error=error)
        return PageOp(handle, flat, io=self)

    def exists(self, keys: Sequence[ObjectKey], *, deadline_s: float) -> PageOp:
        """Ask which leading ``keys`` storage holds; the query ends by ``deadline_s``."""
        empty = torch.empty(len(keys), dtype=torch.int64)
        try:
            handle = self.pipeline.submit_exists(
                list(keys), priority=Priority.URGENT, deadline_s=deadline_s
            )
        except StorageError as error:
            return PageOp(None, empty, io=self, error=error)
        return PageOp(handle, empty, io=self)

    def exists_now(self, keys: Sequence[ObjectKey], *, timeout_s: float) -> int:
        """How many leading ``keys`` storage holds; 0 when it does not answer in ``timeout_s``."""
        if not keys:
            return 0
        op = self.exists(keys, deadline_s=timeout_s)
        if not op.wait(timeout_s):
            op.cancel()
            return 0
        return op.leading() if op.handle is not None and op.handle.state is OpState.DONE else 0
