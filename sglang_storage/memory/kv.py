"""The KV host pool: pages of K/V (or MLA latent) rows in SGLang's host layouts.

Contract, one line per primitive:

- ``KVHostPool(geometry, memory)`` - one contiguous buffer from the host memory budget,
  shaped exactly as SGLang 0.5.23's host pool for the same geometry (see
  :mod:`sglang_storage.memory.layouts`).
- ``alloc(n)`` / ``free(pages)`` / ``pin(pages)`` / ``unpin(pages)`` / ``pinned(pages)`` -
  page allocation with pin counts (:class:`~sglang_storage.memory.slots.SlotAllocator`).
- ``page(p)`` - a view of one page in the layout's page shape.
- ``read_pages(pages)`` / ``write_pages(pages, data)`` - gather / scatter whole pages as
  ``(n, page_numel)`` rows, each row byte-identical to SGLang's ``get_data_page(flat=True)``.
- ``layer(i)`` - per-layer views ``(pages, page_size, H, D)`` of K and V (or the latent).
- ``page_regions(pages)`` - ``(address, nbytes)`` runs for zero-copy backends, in the order
  SGLang's ``get_page_buffer_meta`` lists them.
- ``page_views(p)`` / ``page_spec`` - byte views of one page whose concatenation is SGLang's
  flat data page (what its ``HiCacheFile`` stores), and the object spec that describes
  it: the buffers and spec of a zero-copy storage get or put.
- ``stats()`` / ``close()`` - usage in bytes; give the memory back to the budget.

Pages are addressed by page number ``0 .. num_pages-1``; ``geometry.token_indices(pages)``
gives the token indices SGLang's callers use.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from sglang_storage.core import DataKind, ObjectSpec
from sglang_storage.errors import ConfigError
from sglang_storage.memory.base import SlotPool
from sglang_storage.memory.host import HostMemory
from sglang_storage.memory.layouts import KVGeometry, KVLayout, bits_dtype
from sglang_storage.memory.slots import as_slot_tensor
from sglang_storage.memory.stats import PoolStats
from sglang_storage.memory.tensors import tensor_spec

__all__ = ["KVHostPool", "KVLayerView"]


@attrs.frozen(kw_only=True, eq=False)
class KVLayerView:
    """One layer of a KV host pool, as views shaped ``(num_pages, page_size, H, D)``.

    For MLA, ``v`` is None and ``k`` holds the latent rows.
    """

    k: torch.Tensor
    v: torch.Tensor | None


class KVHostPool(SlotPool):
    """Host pages of KV cache in one of SGLang's layouts, with page allocation and pins.

    Args:
        geometry: Attention kind, layout, element type and sizes.
        memory: Where the buffer comes from; it is charged to the KV budget.
        label: The pool's name in stats and errors.

    Raises:
        CapacityError: the budget has no room for the buffer.
    """

    def __init__(
        self, geometry: KVGeometry, memory: HostMemory, *, label: str = "KV host pool"
    ) -> None:
        super().__init__(
            memory,
            DataKind.KV,
            geometry.total_bytes,
            label=label,
            capacity=geometry.num_pages,
            unit="pages",
        )
        self._geometry = geometry
        self._kv = self._check_open().tensor.view(geometry.dtype).view(geometry.buffer_shape)
        # Every layout is (planes, A, pages, chunk) with A = layers for layer_first and 1
        # otherwise: a page is [:, :, page] and flattens in SGLang's page order.
        g = geometry
        self._outer = g.layer_num if g.layout is KVLayout.LAYER_FIRST else 1
        self._chunk = g.page_numel // (g.kv_planes * self._outer)
        self._planes = g.kv_planes
        self._page_numel = g.page_numel
        self._paged = self._kv.view(self._planes, self._outer, g.num_pages, self._chunk)
        # Pages move as integers of the element's size: exact, and every dtype has kernels.
        self._bits = bits_dtype(g.dtype)
        self._paged_bits = self._paged.view(self._bits)
        self._bytes = self._check_open().tensor.numpy().data

    # ------------------------------------------------------------------ facts

    @property
    def geometry(self) -> KVGeometry:
        """The pool's shape."""
        return self._geometry

    @property
    def kv_buffer(self) -> torch.Tensor:
        """The whole buffer, shaped as SGLang's ``kv_buffer`` for this geometry."""
        self._check_open()
        return self._kv

    # ------------------------------------------------------------------ pages

    def page(self, page: int) -> torch.Tensor:
        """A view of ``page`` in the layout's page shape (``get_data_page(flat=False)``)."""
        self._check_open()
        self._check_page(page)
        g = self._geometry
        if g.layout in (KVLayout.PAGE_FIRST_DIRECT, KVLayout.PAGE_HEAD):
            return self._kv.narrow(0 if g.is_mla else 1, page, 1)
        start = page * g.page_size
        axis = (1 if g.is_mla else 2) if g.layout is KVLayout.LAYER_FIRST else int(not g.is_mla)
        return self._kv.narrow(axis, start, g.page_size)

    def read_pages(
        self, pages: torch.Tensor | Sequence[int], *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gather ``pages`` into rows ``(n, page_numel)``, each as SGLang flattens a page.

        Args:
            pages: Page numbers.
            out: A contiguous ``(n, page_numel)`` tensor of the pool's dtype to fill instead
                of a new one.
        """
        index = self._pages(pages)
        n = index.numel()
        target = self._rows_out(out, n)
        # One copy, straight into the caller's rows: the strided out view puts each
        # gathered page where SGLang's flat page order wants it.
        rows = target.view(self._bits).view(n, self._planes, self._outer, self._chunk)
        torch.index_select(self._paged_bits, 2, index, out=rows.permute(1, 2, 0, 3))
        return target

    def write_pages(self, pages: torch.Tensor | Sequence[int], data: torch.Tensor) -> None:
        """Scatter rows ``(n, page_numel)`` (as :meth:`read_pages` makes them) into ``pages``.

        ``data`` may also be raw bytes: a uint8 tensor of ``n * page_bytes`` elements.

        Raises:
            ConfigError: ``data`` has the wrong size or element type, or a page is out of
                range or repeated.
        """
        index = self._pages(pages)
        self._check_distinct(index)
        n = index.numel()
        rows = self._rows_in(data, n).view(self._bits)
        source = rows.view(n, self._planes, self._outer, self._chunk).permute(1, 2, 0, 3)
        self._paged_bits.index_copy_(2, index, source)

    def read_page(self, page: int) -> torch.Tensor:
        """One page, flat, as a new tensor (SGLang's ``get_data_page(flat=True)`` bytes)."""
        return self.read_pages([page])[0]

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Write one flat page (SGLang's ``set_from_flat_data_page``)."""
        self.write_pages([page], data.reshape(1, -1))

    # ------------------------------------------------------------------ layers

    def layer(self, layer_id: int) -> KVLayerView:
        """Views of layer ``layer_id``: K and V (or the MLA latent) as ``(pages, page, H, D)``."""
        self._check_open()
        g = self._geometry
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise ConfigError(
                owner=f"{self._label}.layer", field="layer_id", value=layer_id, reason="must be int"
            )
        if not 0 <= layer_id < g.layer_num:
            raise ConfigError(
                owner=f"{self._label}.layer",
                field="layer_id",
                value=layer_id,
                reason="is out of range",
                allowed=f"0 .. {g.layer_num - 1}",
            )
        planes = [self._kv] if g.is_mla else [self._kv[0], self._kv[1]]
        views = [self._plane_layer(plane, layer_id) for plane in planes]
        return KVLayerView(k=views[0], v=None if g.is_mla else views[1])

    def _plane_layer(self, plane: torch.Tensor, layer_id: int) -> torch.Tensor:
        g = self._geometry
        pages, page, heads, dim = g.num_pages, g.page_size, g.head_num, g.head_dim
        if g.layout is KVLayout.LAYER_FIRST:
            return plane[layer_id].view(pages, page, heads, dim)
        if g.layout is KVLayout.PAGE_FIRST:
            return plane[:, layer_id].view(pages, page, heads, dim)
        if g.layout is KVLayout.PAGE_FIRST_DIRECT:
            return plane[:, layer_id]
        return plane[:, :, :, layer_id].transpose(1, 2)

    # ------------------------------------------------------------------ zero copy

    def page_regions(self, pages: torch.Tensor | Sequence[int]) -> list[tuple[int, int]]:
        """``(address, nbytes)`` runs covering ``pages``, ordered as ``get_page_buffer_meta``.

        Contiguous layouts give one run per page per plane (K then V); ``layer_first``
        gives one per page, layer and plane.
        """
        index = self._pages(pages).tolist()
        g = self._geometry
        base = self._kv.data_ptr()
        plane_bytes = g.total_bytes // g.kv_planes
        planes = range(g.kv_planes)
        regions: list[tuple[int, int]] = []
        if g.layout is KVLayout.LAYER_FIRST:
            run = g.page_size * g.row_bytes
            layer_bytes = g.size * g.row_bytes
            for p in index:
                for layer in range(g.layer_num):
                    start = base + p * run + layer * layer_bytes
                    regions += [(start + plane * plane_bytes, run) for plane in planes]
        else:
            run = g.page_bytes // g.kv_planes
            for p in index:
                regions += [(base + p * run + plane * plane_bytes, run) for plane in planes]
        return regions

    @property
    def page_spec(self) -> ObjectSpec:
        """The spec of one stored page: element type, page shape and this layout."""
        g = self._geometry
        return tensor_spec(g.dtype, g.page_shape, g.layout.value)

    def page_views(self, page: int) -> tuple[memoryview, ...]:
        """Writable byte views of ``page`` whose concatenation is its flat data page.

        The order is SGLang's ``get_data_page(flat=True)`` (K then V; per layer for
        ``layer_first``), so a stored page holds the same payload bytes as SGLang's own
        file backend writes. Contiguous layouts give one view per plane.
        """
        self._check_open()
        self._check_page(page)
        g = self._geometry
        plane_bytes = g.total_bytes // g.kv_planes
        run = self._chunk * g.itemsize
        outer_bytes = g.num_pages * run
        return tuple(
            self._bytes[start : start + run]
            for plane in range(self._planes)
            for outer in range(self._outer)
            for start in (plane * plane_bytes + outer * outer_bytes + page * run,)
        )

    # ------------------------------------------------------------------ stats

    def stats(self) -> PoolStats:
        """Bytes used, free and pinned by in-flight transfers."""
        counts = self._slots.stats()
        page = self._geometry.page_bytes
        return PoolStats(
            kind=DataKind.KV,
            label=self._label,
            capacity_bytes=counts.capacity * page,
            used_bytes=counts.used * page,
            free_bytes=counts.free * page,
            pinned_bytes=counts.pinned * page,
            page_locked=self.page_locked,
        )

    def _check_page(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int):
            raise ConfigError(owner=self._label, field="page", value=page, reason="must be int")
        if not 0 <= page < self._geometry.num_pages:
            raise ConfigError(
                owner=self._label,
                field="page",
                value=page,
                reason="is out of range",
                allowed=f"0 .. {self._geometry.num_pages - 1}",
            )

    def _pages(self, pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
        self._check_open()
        if (
            isinstance(pages, torch.Tensor)
            and pages.dtype == torch.int64
            and pages.dim() == 1
            and pages.device.type == "cpu"
        ):
            index = pages
        else:
            index = as_slot_tensor(pages, owner=f"{self._label} pages")
        n = index.numel()
        if n == 0:
            return index
        # Small batches (the common case per request) check faster in Python than numpy.
        if n <= 32:
            values = index.tolist()
            low, high = min(values), max(values)
        else:
            array = index.numpy()
            low, high = int(array.min()), int(array.max())
        limit = self._geometry.num_pages
        if low < 0 or high >= limit:
            bad = index[(index < 0) | (index >= limit)]
            raise ConfigError(
                owner=self._label,
                field="pages",
                value=bad[:8].tolist(),
                reason="are out of range",
                allowed=f"0 .. {limit - 1}",
            )
        return index

    def _check_distinct(self, index: torch.Tensor) -> None:
        if index.numel() > 1 and np.unique(index.numpy()).size != index.numel():
            raise ConfigError(
                owner=self._label,
                field="pages",
                value=index.tolist()[:8],
                reason="are repeated; a write names each page once",
            )

    def _rows_out(self, out: torch.Tensor | None, n: int) -> torch.Tensor:
        g = self._geometry
        if out is None:
            return torch.empty((n, self._page_numel), dtype=g.dtype)
        if out.dtype != g.dtype or out.shape != (n, self._page_numel):
            raise ConfigError(
                owner=f"{self._label}.read_pages",
                field="out",
                value=f"{out.dtype} tensor of shape {tuple(out.shape)}",
                reason=f"must be a {g.dtype} tensor of shape {(n, g.page_numel)}",
            )
        if not out.is_contiguous():
            raise ConfigError(
                owner=f"{self._label}.read_pages",
                field="out",
                value="a non-contiguous tensor",
                reason="must be contiguous",
            )
        return out

    def _rows_in(self, data: torch.Tensor, n: int) -> torch.Tensor:
        g = self._geometry
        if data.dtype == torch.uint8 and g.dtype != torch.uint8:
            if data.numel() != n * g.page_bytes:
                raise ConfigError(
                    owner=f"{self._label}.write_pages",
                    field="data",
                    value=f"{data.numel()} bytes",
                    reason=f"must hold exactly {n} pages of {g.page_bytes} bytes",
                )
            raw = data.reshape(-1)
            # A payload after an odd-sized header is not aligned for the element type.
            if not raw.is_contiguous() or raw.data_ptr() % g.itemsize:
                raw = raw.clone()
            return raw.view(g.dtype).view(n, g.page_numel)
        if data.dtype != g.dtype:
            raise ConfigError(
                owner=f"{self._label}.write_pages",
                field="data",
                value=str(data.dtype),
                reason=f"must have the pool's element type {g.dtype} (or be raw uint8 bytes)",
            )
        if data.numel() != n * g.page_numel:
            raise ConfigError(
                owner=f"{self._label}.write_pages",
                field="data",
                value=f"tensor of shape {tuple(data.shape)}",
                reason=f"must hold exactly {n} pages of {g.page_numel} elements",
            )
        return data.reshape(n, g.page_numel).contiguous()
