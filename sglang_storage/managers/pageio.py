"""Host pages to and from storage under object keys: the one page I/O path of the managers.

"Store these host pages under these keys, then count the leading run stored" (and the same
for reads and hit queries) is what every tiered manager does with a backend. A
:class:`HostPageIO` does it over one :class:`~sglang_storage.memory.KVHostPool` and one
:class:`~sglang_storage.transfer.StoragePipeline`:

- ``put(keys, pages)`` / ``get(keys, pages)`` - one pipeline operation over zero-copy views
  of the pool's pages, which stay pinned (they cannot be freed) until the operation ends and
  its :class:`PageOp` is ``collect()``-ed. A refused submission is a failed :class:`PageOp`
  (nothing pinned), never an exception, so callers keep their order of acknowledgements.
  ``deadline_s`` bounds when its backend calls may start (default: the pipeline's).
  :attr:`PageOp.queue_full` tells a refusal by a full queue (worth retrying later) from others.
- ``exists(keys)`` - a hit query bounded by ``deadline_s``; ``leading()`` of its op counts
  the leading keys found.
- :meth:`PageOp.leading` - how many leading pages were stored, read or found: the meaning
  SGLang gives ``completed_tokens`` and hit counts (a page after a missing one is useless).

It starts no threads and never blocks except in ``wait`` and ``exists_now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol, TypeAlias

import torch

from sglang_storage.core import GetRequest, ObjectKey, ObjectSpec, PutRequest
from sglang_storage.errors import CapacityError, ConfigError, StorageError
from sglang_storage.memory import KVHostPool
from sglang_storage.transfer import AnyHandle, OpState, Priority, StoragePipeline

__all__ = ["HostPageIO", "KVPart", "PageKeys", "PageOp", "PagePart"]

_OWNER: Final = "HostPageIO"

PageKeys: TypeAlias = ObjectKey | tuple[ObjectKey, ...]
"""A page's object key, or one per part (in the order of the parts)."""


class PagePart(Protocol):
    """A pool holding one part of every page: one slot per page."""

    @property
    def spec(self) -> ObjectSpec:
        """The stored object's spec of one slot."""
        ...

    def views(self, slot: int) -> tuple[memoryview, ...]:
        """Writable byte views of one slot."""
        ...

    def pin(self, slots: torch.Tensor) -> None:
        """Keep ``slots`` from being freed while they move."""

    def unpin(self, slots: torch.Tensor) -> None:
        """Undo one :meth:`pin` of ``slots``."""


class KVPart:
    """A :class:`KVHostPool`'s pages as a :class:`PagePart`."""

    def __init__(self, pool: KVHostPool) -> None:
        self.pool = pool

    @property
    def spec(self) -> ObjectSpec:
        """One page's spec."""
        return self.pool.page_spec

    def views(self, slot: int) -> tuple[memoryview, ...]:
        """One page's byte views."""
        return self.pool.page_views(slot)

    def pin(self, slots: torch.Tensor) -> None:
        """Pin pages."""
        self.pool.pin(slots)

    def unpin(self, slots: torch.Tensor) -> None:
        """Unpin pages."""
        self.pool.unpin(slots)


class PageOp:
    """One put, get or exists of host pages; ``leading()`` once it is ``done()``.

    ``PageOp.refused()`` is an operation that never started (no storage tier, or the
    submission was refused): it is done, with nothing stored, read or found.
    """

    @classmethod
    def refused(cls, pages: int = 0, error: StorageError | None = None) -> PageOp:
        """An operation over ``pages`` pages that never started."""
        return cls(None, torch.empty(pages, 1, dtype=torch.int64), io=None, error=error)

    def __init__(
        self,
        handle: AnyHandle | None,
        slots: torch.Tensor,
        *,
        io: HostPageIO | None,
        error: StorageError | None = None,
        pinned: bool = True,
    ) -> None:
        self._handle = handle
        self._slots = slots  # (pages, parts)
        self._io = io
        self._refused = error
        self._collected = handle is None or not pinned

    @property
    def handle(self) -> AnyHandle | None:
        """The pipeline operation; None when the submission was refused."""
        return self._handle

    @property
    def op_id(self) -> int | None:
        """The pipeline's id of the operation (as ``completions()`` reports it); None if refused."""
        return None if self._handle is None else self._handle.op_id

    @property
    def queue_full(self) -> bool:
        """Whether the submission was refused because the pipeline's queue was full.

        Such a refusal (a :class:`CapacityError`) changes nothing: the same submission
        may succeed later. Any other refusal (a closed pipeline) will not.
        """
        return self._handle is None and isinstance(self._refused, CapacityError)

    @property
    def pages(self) -> int:
        """How many pages were asked for."""
        return int(self._slots.shape[0])

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

    def page_ok(self) -> list[bool]:
        """Per page, whether every part of it was stored / read / found (False while running)."""
        if not self.done() or self._handle is None:
            return [False] * self.pages
        parts = int(self._slots.shape[1])
        results = [_succeeded(r) for r in self._handle.partial()]
        return [all(results[i * parts : (i + 1) * parts]) for i in range(self.pages)]

    def leading(self) -> int:
        """How many leading pages were stored / read / found (0 before ``done()``)."""
        count = 0
        for ok in self.page_ok():
            if not ok:
                break
            count += 1
        return count

    def first_error(self) -> StorageError | None:
        """:attr:`error`, else the error of the first page that failed; None when none did.

        A page read that found nothing (a miss) failed without an error.
        """
        if self.error is not None or not self.done() or self._handle is None:
            return self.error
        for result in self._handle.partial():
            error = getattr(result, "error", None)
            if isinstance(error, StorageError):
                return error
        return None

    def moved_bytes(self) -> int:
        """Payload bytes the leading pages hold."""
        return 0 if self._io is None else self.leading() * self._io.page_bytes

    def collect(self) -> None:
        """Unpin the slots of an ended operation (idempotent; refused while running).

        Raises:
            StateError: the operation has not ended.
        """
        if self._collected:
            return
        assert self._handle is not None
        assert self._io is not None
        self._handle.partial()  # raises StateError while it runs
        self._collected = True
        self._io.unpin(self._slots)


def _succeeded(result: object) -> bool:
    if isinstance(result, bool):
        return result
    ok = getattr(result, "ok", None)
    if ok is None:
        ok = getattr(result, "hit", False)
    return bool(ok)


class HostPageIO:
    """Pages of ``parts`` to and from storage through ``pipeline``; see the module contract.

    Args:
        parts: The pools holding a page's parts, the KV pool first (a bare
            :class:`KVHostPool` is one part).
        pipeline: The host<->storage pipeline (shared with other users is fine).
    """

    def __init__(
        self, parts: KVHostPool | Sequence[PagePart | KVHostPool], pipeline: StoragePipeline
    ) -> None:
        given = [parts] if isinstance(parts, KVHostPool) else list(parts)
        if not given:
            raise ConfigError(owner=_OWNER, field="parts", reason="must name at least one pool")
        self.parts: tuple[PagePart, ...] = tuple(
            KVPart(p) if isinstance(p, KVHostPool) else p for p in given
        )
        self.pipeline = pipeline
        self.page_bytes = sum(p.spec.nbytes for p in self.parts)
        """Payload bytes of one page, every part."""

    def unpin(self, slots: torch.Tensor) -> None:
        """Undo the pins of ``slots`` (one row per page, one column per part)."""
        for n, part in enumerate(self.parts):
            part.unpin(slots[:, n])

    def _rows(
        self, keys: Sequence[PageKeys], slots: torch.Tensor
    ) -> tuple[list[tuple[ObjectKey, ...]], torch.Tensor]:
        parts = len(self.parts)
        rows = slots.to("cpu", torch.int64)
        rows = rows.reshape(-1, 1) if rows.dim() <= 1 else rows
        page_keys = [k if isinstance(k, tuple) else (k,) for k in keys]
        if rows.shape[0] != len(page_keys) or rows.shape[1] != parts:
            raise ConfigError(
                owner=_OWNER,
                field="slots",
                value=tuple(rows.shape),
                reason=f"must be one row per key ({len(page_keys)}) and one slot per part",
                allowed=f"shape ({len(page_keys)}, {parts})",
            )
        if any(len(k) != parts for k in page_keys):
            raise ConfigError(
                owner=_OWNER,
                field="keys",
                reason=f"every page needs one key per part ({parts})",
            )
        return page_keys, rows

    def _pin(self, rows: torch.Tensor) -> None:
        done = 0
        try:
            for n, part in enumerate(self.parts):
                part.pin(rows[:, n])
                done += 1
        except BaseException:
            for n in range(done):
                self.parts[n].unpin(rows[:, n])
            raise

    def _submit(
        self,
        keys: Sequence[PageKeys],
        slots: torch.Tensor,
        *,
        put: bool,
        priority: Priority,
        deadline_s: float | None,
    ) -> PageOp:
        page_keys, rows = self._rows(keys, slots)
        make = PutRequest if put else GetRequest
        try:
            requests = [
                make(key=key, spec=part.spec, buffers=part.views(int(slot)))
                for row_keys, row in zip(page_keys, rows.tolist(), strict=True)
                for key, part, slot in zip(row_keys, self.parts, row, strict=True)
            ]
            self._pin(rows)
        except StorageError as error:
            return PageOp(None, rows, io=self, error=error)
        try:
            if put:
                handle: AnyHandle = self.pipeline.submit_put(
                    requests,  # type: ignore[arg-type]
                    priority=priority,
                    deadline_s=deadline_s,
                )
            else:
                handle = self.pipeline.submit_get(
                    requests,  # type: ignore[arg-type]
                    priority=priority,
                    deadline_s=deadline_s,
                )
        except StorageError as error:
            self.unpin(rows)
            return PageOp(None, rows, io=self, error=error)
        return PageOp(handle, rows, io=self)

    def put(
        self,
        keys: Sequence[PageKeys],
        slots: torch.Tensor,
        *,
        priority: Priority = Priority.BACKGROUND,
        deadline_s: float | None = None,
    ) -> PageOp:
        """Store the pages in ``slots`` under ``keys`` (one row of slots per page).

        ``deadline_s``: seconds from now by which each backend call must start (None: the
        pipeline's default); a call that cannot start by then fails the operation.

        Raises:
            ConfigError: ``slots`` and ``keys`` do not match in pages or parts.
        """
        return self._submit(keys, slots, put=True, priority=priority, deadline_s=deadline_s)

    def get(
        self,
        keys: Sequence[PageKeys],
        slots: torch.Tensor,
        *,
        priority: Priority = Priority.URGENT,
        deadline_s: float | None = None,
    ) -> PageOp:
        """Read ``keys`` into the pages in ``slots`` (one row of slots per page).

        ``deadline_s``: as for :meth:`put`.

        Raises:
            ConfigError: ``slots`` and ``keys`` do not match in pages or parts.
        """
        return self._submit(keys, slots, put=False, priority=priority, deadline_s=deadline_s)

    def exists(self, keys: Sequence[PageKeys], *, deadline_s: float) -> PageOp:
        """Ask which leading pages (every part) storage holds; ends by ``deadline_s``."""
        parts = len(self.parts)
        page_keys = [k if isinstance(k, tuple) else (k,) for k in keys]
        shape = torch.empty(len(page_keys), parts, dtype=torch.int64)
        if any(len(k) != parts for k in page_keys):
            raise ConfigError(
                owner=_OWNER, field="keys", reason=f"every page needs one key per part ({parts})"
            )
        try:
            handle = self.pipeline.submit_exists(
                [key for row in page_keys for key in row],
                priority=Priority.URGENT,
                deadline_s=deadline_s,
            )
        except StorageError as error:
            return PageOp(None, shape, io=self, error=error)
        return PageOp(handle, shape, io=self, pinned=False)

    def exists_now(self, keys: Sequence[PageKeys], *, timeout_s: float) -> int:
        """How many leading pages storage holds; 0 when it does not answer in ``timeout_s``."""
        if not keys:
            return 0
        op = self.exists(keys, deadline_s=timeout_s)
        if not op.wait(timeout_s):
            op.cancel()
            return 0
        return op.leading() if op.handle is not None and op.handle.state is OpState.DONE else 0
