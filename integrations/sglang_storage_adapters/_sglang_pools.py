"""Pages of an SGLang 0.5.23 host pool as byte views, for zero-copy storage reads and writes.

What one stored page holds is fixed by SGLang's own file backend: the bytes of
``host_pool.get_data_page(index, flat=True)``, the page in the host layout's order (for
MHA ``layer_first``: K of every layer, then V of every layer; ``page_first``: K then V,
each ``[page, layer, head, dim]``; and so on). :class:`PoolPages` hands out exactly those
bytes without copying them:

- ``PoolPages.describe(name, pool)`` - probe one host pool once. When the pool's
  ``get_data_page(index, flat=False)`` is a view into one of the pool's own buffers
  (every KV layout SGLang's flat page API supports: ``layer_first``, ``page_first``,
  ``page_first_direct``, ``page_head``; MLA and MHA alike), the page is served as views.
  Otherwise (pools whose page is a concatenation of several buffers, e.g. Mamba state) it
  is served through the flat page API with one staging copy per page, the way
  ``HiCacheFile`` moves it. A pool with no flat page API (``page_unified``) is refused
  with :class:`~sglang_storage.errors.ConfigError`; one with ``kv_buffer is None``
  (DeepSeek V4's logical KV anchor) is *logical*: it holds no bytes to store.
- ``page_starts(host_indices, pages)`` - the first token index of each page, checked.
- ``views(start)`` - writable byte views over the pool's memory whose concatenation is
  the flat data page (one view per contiguous run: two for MHA ``page_first``, one for
  MLA ``page_first``, one per layer and plane for ``layer_first``). No copy.
- ``read_copy(start)`` / ``staging_page()`` / ``commit(start, page)`` - the staging path.
- ``memory()`` - the pool's whole buffers as byte views, for backends that register host
  memory once (Mooncake's transfer engine).
- ``spec`` - the :class:`~sglang_storage.core.ObjectSpec` of one page: element type, the
  page's shape in this layout (``get_data_page(flat=False)``'s, the same as
  ``KVHostPool.page_spec`` for the same geometry) and the layout name.

SGLang's own ``get_page_buffer_meta`` is not used for the byte order: for MHA
``layer_first`` it lists K and V interleaved per layer, which is not the flat page order
that ``HiCacheFile`` stores. Views are cut from the page tensor's strides instead, which
gives the flat order for every layout.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from typing import Any, Final, Protocol

import torch

from sglang_storage.core import DTYPE_SIZES, ObjectSpec
from sglang_storage.errors import ConfigError
from sglang_storage.memory import dtype_name, tensor_bytes

__all__ = ["PoolPages", "SGLangHostPool"]

_LAYOUT_NAME: Final = re.compile(r"[a-z0-9_]{0,32}")

Run = tuple[int, int]
"""``(byte offset, byte length)`` of one contiguous run."""


class SGLangHostPool(Protocol):
    """The part of SGLang's ``HostKVCache`` (and its sidecar pools) a storage backend uses."""

    page_size: int
    layout: str

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """The page starting at token ``index`` (a view or a copy, per pool)."""
        ...

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zeroed flat page, the target of a staged read."""
        ...

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write one flat page at token ``index``."""
        ...


def _storage_bytes(tensor: torch.Tensor) -> tuple[int, memoryview]:
    """The whole storage under ``tensor``: its address and a byte view of it."""
    storage = tensor.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    return storage.data_ptr(), whole.numpy().data.cast("B")


def _runs(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[Run, ...]:
    """The contiguous byte runs of a strided tensor at offset 0, in C (flatten) order."""
    dims = [(size, stride) for size, stride in zip(shape, strides, strict=True) if size != 1]
    if any(size == 0 for size, _ in dims):
        return ()
    run = 1
    inner = len(dims)
    while inner and dims[inner - 1][1] == run:
        run *= dims[inner - 1][0]
        inner -= 1
    offsets = [0]
    for size, stride in dims[:inner]:
        offsets = [base + i * stride for base in offsets for i in range(size)]
    return tuple((offset * itemsize, run * itemsize) for offset in offsets)


def _spec_of(page: torch.Tensor, layout: str) -> ObjectSpec:
    dtype = dtype_name(page.dtype)
    layout = layout if _LAYOUT_NAME.fullmatch(layout) else ""
    if dtype in DTYPE_SIZES and page.dim() <= 8:
        return ObjectSpec(dtype=dtype, shape=tuple(page.shape), layout=layout)
    # An element type the object format does not name (fp4 packs, e8m0 scales): raw bytes.
    return ObjectSpec(dtype="uint8", shape=(page.numel() * page.element_size(),), layout=layout)


def _pool_buffers(pool: Any) -> list[torch.Tensor]:
    buffers: list[torch.Tensor] = []
    kv = getattr(pool, "kv_buffer", None)
    if isinstance(kv, torch.Tensor):
        buffers.append(kv)
    hybrid = getattr(pool, "get_hybrid_pool_buffer", None)
    if callable(hybrid):
        # A pool whose hybrid buffers cannot be listed is still usable (staging path).
        with contextlib.suppress(Exception):
            buffers.extend(b for b in hybrid() if isinstance(b, torch.Tensor))
    return buffers


class PoolPages:
    """One SGLang host pool's pages as storage payloads; see the module docstring.

    Build with :meth:`describe`. Thread-safe after construction (read-only state).
    """

    def __init__(
        self,
        *,
        name: str,
        pool: SGLangHostPool,
        spec: ObjectSpec | None,
        tokens_per_page: int,
        template: tuple[Run, ...] | None,
        page_layout: tuple[tuple[int, ...], tuple[int, ...]] | None,
    ) -> None:
        self.name = name
        self.pool = pool
        self._spec = spec
        self.tokens_per_page = tokens_per_page
        self._template = template
        self._page_layout = page_layout
        self._storage_ptr = 0
        self._storage: memoryview | None = None

    @classmethod
    def describe(cls, name: str, pool: SGLangHostPool) -> PoolPages:
        """Probe ``pool`` (registered as ``name``) and choose how its pages move.

        Raises:
            ConfigError: the pool has no flat page API SGLang's storage backends could use
                (the message names its layout and the layouts that work).
        """
        page_size = int(pool.page_size)
        tokens = int(getattr(pool, "logical_page_size", page_size) or page_size)
        if getattr(pool, "kv_buffer", 0) is None:
            return cls(
                name=name, pool=pool, spec=None, tokens_per_page=tokens, template=None,
                page_layout=None,
            )  # fmt: skip
        layout = str(getattr(pool, "layout", ""))
        try:
            page = pool.get_data_page(0, flat=False)
        except (ValueError, NotImplementedError, AttributeError) as error:
            raise ConfigError(
                owner="sglang_storage HiCache backend",
                field=f"host pool {name!r}",
                value=f"{type(pool).__name__} with layout {layout!r}",
                reason=f"has no flat page API to store pages from ({error})",
                allowed="host layouts layer_first, page_first, page_first_direct, page_head",
            ) from None
        owners = {b.untyped_storage().data_ptr() for b in _pool_buffers(pool)}
        if page.device.type == "cpu" and page.untyped_storage().data_ptr() in owners:
            template = _runs(page.shape, page.stride(), page.element_size())
            if sum(n for _, n in template) == page.numel() * page.element_size():
                return cls(
                    name=name,
                    pool=pool,
                    spec=_spec_of(page, layout),
                    tokens_per_page=tokens,
                    template=template,
                    page_layout=(tuple(page.shape), tuple(page.stride())),
                )
        flat = pool.get_data_page(0, flat=True)
        return cls(
            name=name,
            pool=pool,
            spec=_spec_of(flat.reshape(-1), layout),
            tokens_per_page=tokens,
            template=None,
            page_layout=None,
        )

    # ------------------------------------------------------------------ facts

    @property
    def logical(self) -> bool:
        """The pool holds no page bytes (a logical anchor): nothing to store or load."""
        return self._spec is None

    @property
    def zero_copy(self) -> bool:
        """Pages move as views of the pool's memory (else through a staging copy)."""
        return self._template is not None

    @property
    def spec(self) -> ObjectSpec:
        """What one stored page of this pool is.

        Raises:
            ConfigError: the pool is logical.
        """
        if self._spec is None:
            raise ConfigError(
                owner="sglang_storage HiCache backend",
                field=f"host pool {self.name!r}",
                reason="is a logical pool with no page bytes",
            )
        return self._spec

    # ------------------------------------------------------------------ pages

    def page_starts(self, host_indices: torch.Tensor | None, pages: int) -> list[int]:
        """The first token index of each of ``pages`` pages in ``host_indices``.

        Raises:
            ConfigError: ``host_indices`` is missing or does not hold ``pages`` whole pages.
        """
        stride = self.tokens_per_page
        count = 0 if host_indices is None else int(host_indices.numel())
        if host_indices is None or count != pages * stride:
            raise ConfigError(
                owner=f"sglang_storage HiCache backend, pool {self.name!r}",
                field="host_indices",
                value=count,
                reason=f"must hold {stride} token indices per key for {pages} keys",
                allowed=str(pages * stride),
            )
        return [int(i) for i in host_indices.reshape(-1)[::stride].tolist()]

    def views(self, start: int) -> tuple[memoryview, ...]:
        """Writable byte views of the page at token ``start``, in flat page order."""
        if self._template is None:
            raise ConfigError(
                owner=f"sglang_storage HiCache backend, pool {self.name!r}",
                field="views",
                reason="this pool's pages are not views of its memory; use the staging path",
            )
        page = self.pool.get_data_page(start, flat=False)
        ptr = page.untyped_storage().data_ptr()
        storage = self._storage
        if storage is None or ptr != self._storage_ptr:
            self._storage_ptr, storage = _storage_bytes(page)
            self._storage = storage
        template = self._template
        if (tuple(page.shape), tuple(page.stride())) != self._page_layout:
            template = _runs(page.shape, page.stride(), page.element_size())
        base = page.storage_offset() * page.element_size()
        return tuple(storage[base + offset : base + offset + n] for offset, n in template)

    def read_copy(self, start: int) -> memoryview:
        """The page at token ``start`` as bytes of a flat copy (the staging write path)."""
        page = self.pool.get_data_page(start, flat=True).contiguous()
        return tensor_bytes(page, owner=f"host pool {self.name!r}")

    def staging_page(self) -> torch.Tensor:
        """A new zeroed flat page to read into (the staging read path)."""
        return self.pool.get_dummy_flat_data_page()

    def commit(self, start: int, page: torch.Tensor) -> None:
        """Copy a staged flat page into the pool at token ``start``."""
        self.pool.set_from_flat_data_page(start, page)

    def memory(self) -> list[tuple[int, memoryview]]:
        """The pool's own memory, for one-time registration with a backend's transport.

        One ``(address, whole storage as bytes)`` per distinct storage under the pool's
        buffers; empty for pools served through staging copies or with no bytes.
        """
        if self._template is None:
            return []
        regions: dict[int, memoryview] = {}
        for buffer in _pool_buffers(self.pool):
            if buffer.device.type == "cpu":
                ptr, view = _storage_bytes(buffer)
                if view.nbytes:
                    regions.setdefault(ptr, view)
        return sorted(regions.items())

    def nbytes(self) -> int:
        """Bytes of one page (0 for a logical pool)."""
        return 0 if self._spec is None else self._spec.nbytes

    def __repr__(self) -> str:
        mode = "logical" if self.logical else "views" if self.zero_copy else "staging"
        shape = () if self._spec is None else self._spec.shape
        return f"PoolPages({self.name!r}, {mode}, shape={shape}, {math.prod(shape)} elements)"
