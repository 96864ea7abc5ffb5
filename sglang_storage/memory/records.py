"""Record pools (fixed-shape rows) and blob pools (large immutable byte blocks).

Contract, one line per primitive:

- :class:`RecordPool` - ``capacity`` records of one shape and element type (RL top-k rows,
  rope/position info): ``alloc(n)`` / ``free`` / ``pin`` / ``unpin`` slots,
  ``write(slots, data)``, ``read(slots)``, ``records`` (all of them as one tensor) and
  ``device_view()``: on CUDA, the same page-locked memory as a CUDA tensor (UVA), so kernels
  read records in place without a copy; a clear error without CUDA or page-locked memory.
  A device view keeps the pool's memory (and its registration) alive, and ``close()`` is
  refused while one is alive.
- :class:`BlobPool` - named blobs of any size in one buffer (expert weight shards):
  ``put(key, data)`` copies once into a contiguous, aligned block; ``view(key)`` is a
  zero-copy view; ``remove`` / ``pin`` / ``unpin``; a blob is never split, and a request that
  only fragmented space could hold fails with a CapacityError saying so.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np
import torch

from sglang_storage.config import BYTES, instance_of, non_empty_str, positive_int, tuple_of
from sglang_storage.core import DataKind
from sglang_storage.errors import BackendUnavailableError, ConfigError, StateError
from sglang_storage.memory.base import HostPool, SlotPool
from sglang_storage.memory.extents import ExtentAllocator, Run
from sglang_storage.memory.host import CudaArray, HostMemory, cuda_available
from sglang_storage.memory.layouts import ELEMENT_DTYPES, bits_dtype, dtype_in
from sglang_storage.memory.slots import as_slot_tensor
from sglang_storage.memory.stats import PoolStats

__all__ = ["Blob", "BlobPool", "BlobPoolConfig", "RecordPool", "RecordPoolConfig"]

BLOB_ALIGNMENT: Final = 4096
"""Blobs start on 4 KiB boundaries (O_DIRECT and DMA friendly)."""


@attrs.frozen(kw_only=True)
class RecordPoolConfig:
    """Shape, element type and number of records."""

    shape: tuple[int, ...] = attrs.field(validator=tuple_of(positive_int))
    """The shape of one record, e.g. ``(top_k, 2)``."""
    dtype: torch.dtype = attrs.field(
        validator=dtype_in(ELEMENT_DTYPES, what="an element type a record pool can hold")
    )
    capacity: int = attrs.field(validator=positive_int)
    """Number of records."""
    kind: DataKind = attrs.field(default=DataKind.RECORD, validator=instance_of(DataKind))
    """The budget the pool is charged to."""
    label: str = attrs.field(default="record pool", validator=non_empty_str)

    @property
    def record_numel(self) -> int:
        """Elements per record."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def record_bytes(self) -> int:
        """Bytes per record."""
        return self.record_numel * self.dtype.itemsize


_TYPESTR: Final[dict[torch.dtype, str]] = {
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.float64: "<f8",
    torch.int64: "<i8",
    torch.int32: "<i4",
    torch.int16: "<i2",
    torch.int8: "|i1",
    torch.uint8: "|u1",
    torch.bool: "|b1",
}


class RecordPool(SlotPool):
    """Fixed-shape records in one budgeted host buffer, allocated by slot with pins.

    Args:
        config: Record shape, element type and count.
        memory: Where the buffer comes from.

    Raises:
        CapacityError: the budget has no room for the buffer.
    """

    def __init__(self, config: RecordPoolConfig, memory: HostMemory) -> None:
        super().__init__(
            memory,
            config.kind,
            config.capacity * config.record_bytes,
            label=config.label,
            capacity=config.capacity,
            unit="records",
        )
        self._config = config
        buffer = self._check_open()
        self._records = buffer.tensor.view(config.dtype).view(config.capacity, *config.shape)
        self._records_bits = self._records.view(bits_dtype(config.dtype))
        self._device_arrays: weakref.WeakSet[CudaArray] = weakref.WeakSet()

    @property
    def config(self) -> RecordPoolConfig:
        """The pool's configuration."""
        return self._config

    @property
    def records(self) -> torch.Tensor:
        """All records, ``(capacity, *shape)``, a view of the pool's memory."""
        self._check_open()
        return self._records

    def write(self, slots: torch.Tensor | Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` ``(n, *shape)`` into allocated ``slots``.

        Raises:
            ConfigError: shape or element type mismatch.
            StateError: a slot is not allocated.
        """
        index = self._allocated(slots, "write")
        c = self._config
        if data.dtype != c.dtype or tuple(data.shape) != (index.numel(), *c.shape):
            raise ConfigError(
                owner=f"{c.label}.write",
                field="data",
                value=f"{data.dtype} tensor of shape {tuple(data.shape)}",
                reason=f"must be a {c.dtype} tensor of shape {(index.numel(), *c.shape)}",
            )
        if index.numel() > 1 and np.unique(index.numpy()).size != index.numel():
            raise ConfigError(
                owner=f"{c.label}.write",
                field="slots",
                value=index.tolist()[:8],
                reason="are repeated; a write names each slot once",
            )
        source = data.to("cpu").contiguous().view(self._records_bits.dtype)
        self._records_bits.index_copy_(0, index, source)

    def read(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """A copy of the records in allocated ``slots``, ``(n, *shape)``.

        Raises:
            StateError: a slot is not allocated.
        """
        index = self._allocated(slots, "read")
        return self._records.index_select(0, index)

    def device_view(self, device: torch.device | str = "cuda") -> torch.Tensor:
        """All records as a CUDA tensor over the same host memory (UVA), without a copy.

        The view (and every tensor sharing its storage) keeps the pool's memory alive;
        ``close()`` is refused until they are all gone.

        Raises:
            BackendUnavailableError: CUDA is not available.
            ConfigError: ``device`` is not a CUDA device or not the one the memory is mapped
                to; the pool's memory is not page-locked; or the element type has no CUDA
                array interface code.
            StateError: the memory is not mapped at its host address.
        """
        buffer = self._check_open()
        owner = f"{self._config.label}.device_view"
        if not cuda_available():
            raise BackendUnavailableError(
                backend="UVA record view",
                reason=f"CUDA is not available (torch {torch.__version__}); "
                "read records with read() instead",
            )
        if not buffer.page_locked:
            raise ConfigError(
                owner=owner,
                field="pinning",
                value="never",
                reason="a device view needs page-locked memory",
                allowed="auto, always",
            )
        typestr = _TYPESTR.get(self._config.dtype)
        if typestr is None:
            raise ConfigError(
                owner=owner,
                field="dtype",
                value=str(self._config.dtype),
                reason="has no CUDA array interface type code",
                allowed=", ".join(str(d) for d in _TYPESTR),
            )
        target = _cuda_device(device, owner)
        shape = (self._config.capacity, *self._config.shape)
        array = CudaArray(buffer, shape, typestr)
        # No device= here: torch takes the device from the pointer, and as_tensor(device=)
        # on another device would silently copy, making the "view" a snapshot.
        with torch.cuda.device(target):
            view = torch.as_tensor(array)
        if view.device != target:
            raise ConfigError(
                owner=owner,
                field="device",
                value=str(target),
                reason=f"the pool's page-locked memory is mapped to {view.device}; "
                "a view on another device would be a copy",
                allowed=str(view.device),
            )
        if view.data_ptr() != buffer.address:
            raise StateError(
                subject=owner,
                reason=f"the memory at {buffer.address:#x} is mapped at device address "
                f"{view.data_ptr():#x}, not at its host address (no UVA mapping)",
            )
        self._device_arrays.add(array)
        return view

    def stats(self) -> PoolStats:
        """Bytes used, free and pinned."""
        counts = self._slots.stats()
        size = self._config.record_bytes
        return PoolStats(
            kind=self._config.kind,
            label=self._config.label,
            capacity_bytes=counts.capacity * size,
            used_bytes=counts.used * size,
            free_bytes=counts.free * size,
            pinned_bytes=counts.pinned * size,
            page_locked=self.page_locked,
        )

    def _pinned_reason(self) -> str | None:
        views = len(self._device_arrays)
        if views:
            return f"{views} device views of its memory are still alive"
        return super()._pinned_reason()

    def _allocated(self, slots: torch.Tensor | Sequence[int], op: str) -> torch.Tensor:
        self._check_open()
        index = as_slot_tensor(slots, owner=f"{self._config.label}.{op}")
        allocated = self._slots.is_allocated(index)
        if not bool(allocated.all()):
            raise StateError(
                subject=f"{self._config.label}.{op}",
                reason=f"slots {index[~allocated][:8].tolist()} are not allocated",
            )
        return index


def _cuda_device(device: torch.device | str, owner: str) -> torch.device:
    """``device`` as a CUDA device with an index (plain "cuda" is the current device).

    Raises:
        ConfigError: ``device`` is not a CUDA device.
    """
    try:
        target: torch.device | None = torch.device(device)
    except RuntimeError:  # torch's message for an unparsable device string
        target = None
    if target is None or target.type != "cuda":
        raise ConfigError(
            owner=owner,
            field="device",
            value=str(device),
            reason="must be a CUDA device",
            allowed="cuda, cuda:N",
        )
    index: int | None = target.index  # None for plain "cuda" (torch's stub says int)
    if index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return target


@attrs.frozen(kw_only=True)
class BlobPoolConfig:
    """Size of a blob pool."""

    capacity: int = attrs.field(metadata=BYTES, validator=positive_int)
    """Bytes of the pool (rounded down to 4 KiB)."""
    kind: DataKind = attrs.field(default=DataKind.WEIGHT, validator=instance_of(DataKind))
    """The budget the pool is charged to."""
    label: str = attrs.field(default="blob pool", validator=non_empty_str)

    def __attrs_post_init__(self) -> None:
        if self.capacity < BLOB_ALIGNMENT:
            raise ConfigError(
                owner="BlobPoolConfig",
                field="capacity",
                value=self.capacity,
                reason=f"must be at least {BLOB_ALIGNMENT} bytes",
            )


@attrs.frozen(kw_only=True)
class Blob:
    """Where one blob lives."""

    key: str
    nbytes: int
    """The blob's size (its block is rounded up to 4 KiB)."""
    run: Run
    """The 4 KiB blocks it occupies."""


class BlobPool(HostPool):
    """Large immutable blobs, each contiguous and 4 KiB aligned, in one budgeted buffer.

    Args:
        config: The pool's size and budget kind.
        memory: Where the buffer comes from.
    """

    def __init__(self, config: BlobPoolConfig, memory: HostMemory) -> None:
        blocks = config.capacity // BLOB_ALIGNMENT
        super().__init__(memory, config.kind, blocks * BLOB_ALIGNMENT, label=config.label)
        self._config = config
        self._blocks = ExtentAllocator(blocks, name=f"{config.label} blocks")
        self._blobs: dict[str, Blob] = {}
        self._pins: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def config(self) -> BlobPoolConfig:
        """The pool's configuration."""
        return self._config

    def __contains__(self, key: object) -> bool:
        return key in self._blobs

    def __len__(self) -> int:
        return len(self._blobs)

    def put(self, key: str, data: torch.Tensor) -> Blob:
        """Copy ``data`` (any dtype and shape, CPU or device) in as blob ``key``.

        Raises:
            StateError: ``key`` is already stored.
            CapacityError: no contiguous free block holds it; nothing was stored.
        """
        buffer = self._check_open()
        nbytes = data.numel() * data.element_size()
        if nbytes < 1:
            raise ConfigError(
                owner=f"{self._config.label}.put", field="data", value=0, reason="is empty"
            )
        with self._lock:
            if key in self._blobs:
                raise StateError(
                    subject=f"{self._config.label}.put", reason=f"key {key!r} is already stored"
                )
            run = self._blocks.allocate_contiguous(-(-nbytes // BLOB_ALIGNMENT))
            blob = Blob(key=key, nbytes=nbytes, run=run)
            self._blobs[key] = blob
        start = run.start * BLOB_ALIGNMENT
        target = buffer.tensor[start : start + nbytes]
        target.copy_(data.detach().contiguous().reshape(-1).view(torch.uint8))
        return blob

    def view(
        self, key: str, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] = (-1,)
    ) -> torch.Tensor | None:
        """A zero-copy view of blob ``key`` as ``dtype`` and ``shape``, or None when absent.

        The view must not be written: blobs are immutable.
        """
        buffer = self._check_open()
        blob = self._blobs.get(key)
        if blob is None:
            return None
        start = blob.run.start * BLOB_ALIGNMENT
        raw = buffer.tensor[start : start + blob.nbytes]
        try:
            return raw.view(dtype).view(shape)
        except RuntimeError as error:  # torch's message says why the view does not fit
            raise ConfigError(
                owner=f"{self._config.label}.view",
                field="dtype, shape",
                value=f"{dtype}, {shape}",
                reason=f"does not fit the {blob.nbytes}-byte blob {key!r}: {error}",
            ) from None

    def remove(self, key: str) -> None:
        """Free blob ``key``.

        Raises:
            StateError: ``key`` is absent or pinned.
        """
        with self._lock:
            blob = self._blobs.get(key)
            if blob is None:
                raise StateError(subject=f"{self._config.label}.remove", reason=f"no key {key!r}")
            if self._pins.get(key):
                raise StateError(
                    subject=f"{self._config.label}.remove", reason=f"key {key!r} is pinned"
                )
            del self._blobs[key]
            self._blocks.free([blob.run])

    def pin(self, key: str) -> None:
        """Add one pin to ``key`` (it cannot be removed until unpinned)."""
        self._check_open()
        with self._lock:
            if key not in self._blobs:
                raise StateError(subject=f"{self._config.label}.pin", reason=f"no key {key!r}")
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        """Drop one pin from ``key``."""
        with self._lock:
            count = self._pins.get(key, 0)
            if count == 0:
                raise StateError(
                    subject=f"{self._config.label}.unpin", reason=f"key {key!r} is not pinned"
                )
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def stats(self) -> PoolStats:
        """Bytes used, free and pinned, in whole 4 KiB blocks."""
        with self._lock:
            free = self._blocks.free_units
            pinned = sum(self._blobs[key].run.length for key in self._pins)
        total = self._blocks.capacity
        return PoolStats(
            kind=self._config.kind,
            label=self._config.label,
            capacity_bytes=total * BLOB_ALIGNMENT,
            used_bytes=(total - free) * BLOB_ALIGNMENT,
            free_bytes=free * BLOB_ALIGNMENT,
            pinned_bytes=pinned * BLOB_ALIGNMENT,
            page_locked=self.page_locked,
        )

    def _pinned_reason(self) -> str | None:
        return f"{len(self._pins)} blobs are pinned" if self._pins else None

    def _on_close(self) -> None:
        self._blobs.clear()
