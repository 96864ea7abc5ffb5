"""Captured top-k rows travel with the KV pages they describe (SGLang issue #26975).

SGLang's RL capturers (routed experts, DSA indexer top-k) keep one row ``[layers, top_k]``
int32 per device KV slot in a host mirror, written when a forward computes the slot and
read at request finish through the request's KV slots. A prefix that HiCache loads back
from host or storage into new slots was not computed there, so SGLang returns whatever
those slots held before. Here each capturer's rows become a side part of every host page:

- device -> host (write-back): the rows of the written device slots are copied into the
  host page's side slot, ordered before the KV copy's completion;
- host -> device (load): the host page's rows are copied into the mirror at the new device
  slots, ordered before the first layer of the KV copy is reported loaded;
- host <-> storage: the rows are one more part of the page (object key ``<page key>-<name>``),
  stored and read with it; a page stored without them (a server with capture off) is a
  miss, never a page with stale rows.

On CUDA the copies run on the transfer's stream through the page-locked memories' device
views (no synchronisation with the host), elsewhere as plain CPU copies. Capture is decided
when the controller is built (SGLang creates its capturers before the cache).
"""

from __future__ import annotations

import logging
from typing import Any, Final

import torch

from sglang_storage.errors import ConfigError, StateError
from sglang_storage.managers import SidePool
from sglang_storage.memory import (
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    RecordPool,
    RecordPoolConfig,
)
from sglang_storage.memory.host import CudaArray
from sglang_storage.transfer.io import upload_index

__all__ = ["CaptureRows", "capture_rows"]

log = logging.getLogger(__name__)

_CAPTURERS: Final = (
    ("routed_experts", "sglang.srt.state_capturer.routed_experts", "get_global_experts_capturer"),
    ("indexer_topk", "sglang.srt.state_capturer.indexer_topk", "get_global_indexer_capturer"),
)


class CaptureRows:
    """One capturer's rows for every host page, as a side part of the page.

    Args:
        name: The capturer (``routed_experts`` or ``indexer_topk``); also the side part's
            name in object keys.
        mirror: SGLang's host mirror ``[kv slots, layers, top_k]`` int32, indexed by device
            KV slot (``host_cache.buffer``).
        page_size: Tokens per page.
        host_pages: Pages of the host KV pool; side slot ``p`` belongs to host page ``p``.
        memory: Where the side pool's bytes come from (the process budget).

    Raises:
        ConfigError: the mirror is not a contiguous 3-D int32 tensor.
        CapacityError: the budget cannot hold the side pool.
    """

    def __init__(
        self,
        name: str,
        mirror: torch.Tensor,
        *,
        page_size: int,
        host_pages: int,
        memory: HostMemory,
    ) -> None:
        if mirror.dim() != 3 or mirror.dtype != torch.int32 or not mirror.is_contiguous():
            raise ConfigError(
                owner="sglang_storage capture rows",
                field=name,
                value=f"{tuple(mirror.shape)} {mirror.dtype}",
                reason="is not a capturer's host mirror",
                allowed="a contiguous int32 tensor [kv slots, layers, top_k]",
            )
        self.name = name
        self.mirror = mirror
        self.page_size = page_size
        layers, top_k = int(mirror.shape[1]), int(mirror.shape[2])
        config = RecordPoolConfig(
            shape=(page_size, layers, top_k),
            dtype=torch.int32,
            capacity=host_pages,
            label=f"HiCache {name} rows",
        )
        self.pool = RecordPool(config, memory)
        slots = self.pool.alloc(host_pages)
        # Side slot p is host page p: allocated once, never freed while the pool lives.
        if not torch.equal(slots, torch.arange(host_pages, dtype=slots.dtype)):
            self.pool.close()
            raise StateError(
                subject=f"sglang_storage {name} rows",
                reason="a fresh record pool did not hand out its slots in order",
            )
        self.part = SidePool(name=name, pool=self.pool)
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._warned = False

    @property
    def nbytes(self) -> int:
        """Bytes of the side pool."""
        return self.pool.config.record_bytes * self.pool.config.capacity

    def save(self, host_pages: torch.Tensor, device_tokens: torch.Tensor) -> None:
        """Copy the mirror's rows of ``device_tokens`` (whole pages) into ``host_pages``.

        On CUDA the copy is queued on the current stream.
        """
        if host_pages.numel():
            mirror, records, pages, tokens = self._operands(host_pages, device_tokens)
            rows = mirror.index_select(0, tokens).view(-1, *records.shape[1:])
            records.index_copy_(0, pages, rows)

    def restore(self, host_pages: torch.Tensor, device_tokens: torch.Tensor) -> None:
        """Copy ``host_pages``' rows into the mirror at ``device_tokens`` (whole pages).

        On CUDA the copy is queued on the current stream.
        """
        if host_pages.numel():
            mirror, records, pages, tokens = self._operands(host_pages, device_tokens)
            rows = records.index_select(0, pages).view(-1, *mirror.shape[1:])
            mirror.index_copy_(0, tokens, rows)

    def _operands(
        self, host_pages: torch.Tensor, device_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mirror, side records, page index, token index) where the copy runs.

        On CUDA: the page-locked memories' device views and device indices; where the
        side pool is not page-locked (pinning turned off), the CPU copy after the device
        indices came to the host (which waits for the device).
        """
        if device_tokens.device.type != "cuda":
            mirror, records = self.mirror, self.pool.records
        elif not self.pool.page_locked:
            if not self._warned:
                self._warned = True
                log.warning(
                    "sglang_storage: the %s rows pool is not page-locked; each transfer's "
                    "rows are copied on the host after waiting for the device",
                    self.name,
                )
            mirror, records = self.mirror, self.pool.records
        else:
            if self._views is None:
                with torch.cuda.device(device_tokens.device):
                    view = torch.as_tensor(CudaArray(self.mirror, tuple(self.mirror.shape), "<i4"))
                if view.data_ptr() != self.mirror.data_ptr():
                    raise StateError(
                        subject=f"sglang_storage {self.name} rows",
                        reason="torch copied the capturer's mirror instead of viewing it",
                    )
                self._views = (view, self.pool.device_view(device_tokens.device))
            mirror, records = self._views
        pages = upload_index(host_pages, records.device)
        return mirror, records, pages, device_tokens.to(records.device, torch.int64)

    def close(self) -> None:
        """Give the side pool's memory back."""
        self._views = None
        self.pool.close()


def _capturer_mirrors() -> list[tuple[str, torch.Tensor]]:
    """The host mirrors of SGLang's capturers that exist in this process."""
    import importlib

    found = []
    for name, module_name, getter in _CAPTURERS:
        try:
            capturer: Any = getattr(importlib.import_module(module_name), getter)()
        except (ImportError, AttributeError, RuntimeError) as error:
            log.debug("no %s capturer: %s", name, error)
            continue
        buffer = None if capturer is None else getattr(capturer.host_cache, "buffer", None)
        if isinstance(buffer, torch.Tensor):
            found.append((name, buffer))
    return found


def capture_rows(
    page_size: int, host_pages: int, device_slots: int, memory: HostMemory | None
) -> list[CaptureRows]:
    """A :class:`CaptureRows` per capturer SGLang built in this process (none: capture off).

    ``device_slots``: token slots of the device KV pool, every one of which the mirror must
    have a row for. ``memory`` None: a budget of exactly the side pools (a cache built
    without server args).

    Raises:
        ConfigError: a capturer's mirror has fewer rows than the device pool has slots.
        CapacityError: the budget cannot hold the rows of every host page.
    """
    mirrors = _capturer_mirrors()
    for name, mirror in mirrors:
        if mirror.dim() >= 1 and mirror.shape[0] < device_slots:
            raise ConfigError(
                owner="sglang_storage capture rows",
                field=name,
                value=f"{mirror.shape[0]} rows",
                reason="the capturer's host mirror does not cover the device KV pool",
                allowed=f"at least {device_slots} rows (one per device token slot)",
            )
    rows: list[CaptureRows] = []
    try:
        for name, mirror in mirrors:
            source = memory
            if source is None:
                need = page_size * host_pages * mirror[0].numel() * mirror.element_size()
                config = BudgetConfig(total=need, record=need, headroom=0)
                source = HostMemory(HostMemoryBudget(config))
            made = CaptureRows(
                name, mirror, page_size=page_size, host_pages=host_pages, memory=source
            )
            rows.append(made)
    except BaseException:
        for partial in rows:
            partial.close()
        raise
    for done in rows:
        log.info(
            "sglang_storage HiCache: %s rows kept with every host page (%d bytes)",
            done.name,
            done.nbytes,
        )
    return rows
