"""Host buffers: page-locked where CUDA exists, plain elsewhere, always within the budget.

Contract, one line per primitive:

- :class:`Pinning` - ``auto`` (page-locked when CUDA is available), ``always`` (page-locked
  or a clear error), ``never`` (plain memory).
- :class:`HostAllocator` - ``allocate(nbytes)`` one contiguous uint8 buffer, ``release(buffer)``.
  :class:`PlainAllocator` uses ordinary memory; :class:`PinnedAllocator` registers one large
  allocation with CUDA once (``cudaHostRegister``), so a pool costs one registration instead
  of many small pinned tensors, and no power-of-two rounding of torch's pinned cache.
- :class:`HostMemory` - the budget plus an allocator: ``allocate(kind, nbytes, label)`` takes
  the bytes from the kind's budget and returns a :class:`HostBuffer`; ``release(buffer)``
  frees the memory and returns the bytes to the budget.

Every pool in this layer draws its memory from a :class:`HostMemory`, so one budget covers
KV pages, embeddings, records and weight blobs alike.
"""

from __future__ import annotations

import abc
import enum
import threading
from typing import Final

import attrs
import torch

from sglang_storage.config import require_int
from sglang_storage.core import DataKind
from sglang_storage.errors import BackendUnavailableError, CapacityError, StateError
from sglang_storage.memory.budget import HostMemoryBudget, Lease, read_memory_facts

__all__ = [
    "HostAllocator",
    "HostBuffer",
    "HostMemory",
    "PinnedAllocator",
    "Pinning",
    "PlainAllocator",
    "cuda_available",
    "make_allocator",
]

ALIGNMENT: Final = 4096
"""Byte alignment of every buffer's start (O_DIRECT and DMA friendly)."""

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every CUDA context, and
# mapped into the device address space so record pools can hand kernels a UVA view.
_REGISTER_FLAGS: Final = 1 | 2


class Pinning(enum.Enum):
    """Whether host buffers are page-locked (pinned) for fast, asynchronous DMA."""

    AUTO = "auto"
    """Page-locked when CUDA is available, plain otherwise."""
    ALWAYS = "always"
    """Page-locked; a clear error where CUDA is not available."""
    NEVER = "never"
    """Plain memory."""


def cuda_available() -> bool:
    """Whether CUDA devices can be used by this process."""
    return torch.cuda.is_available()


@attrs.frozen(kw_only=True, eq=False)
class HostBuffer:
    """One contiguous block of host memory, as a 1-D uint8 tensor."""

    tensor: torch.Tensor
    """The bytes. Views of other dtypes and shapes are made with ``view`` / ``reshape``."""
    page_locked: bool
    """Whether the block is registered with CUDA (pinned)."""
    label: str
    """What the block is for."""

    @property
    def nbytes(self) -> int:
        """The block's size in bytes."""
        return self.tensor.numel()

    @property
    def address(self) -> int:
        """The block's start address (for zero-copy registration with backends)."""
        return self.tensor.data_ptr()


def _aligned_empty(nbytes: int, label: str) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``nbytes`` whose start is ALIGNMENT-aligned.

    Raises:
        CapacityError: the operating system refused the memory.
    """
    try:
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    except RuntimeError as error:  # torch reports a refused allocation as RuntimeError
        raise CapacityError(
            resource=f"host memory for {label}",
            requested=nbytes,
            available=read_memory_facts().usable,
            hint=f"the allocation was refused ({error}); lower the budget",
        ) from None
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip : skip + nbytes]


class HostAllocator(abc.ABC):
    """Allocates contiguous host buffers of one kind (plain or page-locked)."""

    @property
    @abc.abstractmethod
    def page_locked(self) -> bool:
        """Whether the buffers this allocator makes are page-locked."""

    @abc.abstractmethod
    def allocate(self, nbytes: int, *, label: str) -> HostBuffer:
        """Allocate ``nbytes`` (> 0) of host memory, aligned to 4 KiB."""

    @abc.abstractmethod
    def release(self, buffer: HostBuffer) -> None:
        """Release a buffer this allocator made; it must not be used afterwards."""


class PlainAllocator(HostAllocator):
    """Ordinary (pageable) host memory; works on every machine."""

    @property
    def page_locked(self) -> bool:
        """Always False."""
        return False

    def allocate(self, nbytes: int, *, label: str) -> HostBuffer:
        """Allocate ``nbytes`` of plain memory."""
        return HostBuffer(tensor=_aligned_empty(nbytes, label), page_locked=False, label=label)

    def release(self, buffer: HostBuffer) -> None:
        """Nothing to undo: the memory goes when the last view of the tensor goes."""


class PinnedAllocator(HostAllocator):
    """Page-locked host memory: one ``cudaHostRegister`` per buffer.

    Raises:
        BackendUnavailableError: CUDA is not available in this process.
    """

    def __init__(self) -> None:
        if not cuda_available():
            raise BackendUnavailableError(
                backend="pinned host memory",
                reason=(
                    f"CUDA is not available (torch {torch.__version__}, CUDA build "
                    f"{torch.version.cuda or 'none'}); use pinning 'auto' or 'never'"
                ),
            )
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    @property
    def page_locked(self) -> bool:
        """Always True."""
        return True

    def allocate(self, nbytes: int, *, label: str) -> HostBuffer:
        """Allocate ``nbytes`` and register them with CUDA."""
        tensor = _aligned_empty(nbytes, label)
        status = self._cudart.cudaHostRegister(tensor.data_ptr(), nbytes, _REGISTER_FLAGS)
        if int(status) != 0:
            raise BackendUnavailableError(
                backend="pinned host memory",
                reason=f"cudaHostRegister of {nbytes} bytes for {label} failed with code {status}",
            )
        return HostBuffer(tensor=tensor, page_locked=True, label=label)

    def release(self, buffer: HostBuffer) -> None:
        """Unregister the buffer from CUDA."""
        self._cudart.cudaHostUnregister(buffer.address)


def make_allocator(pinning: Pinning) -> HostAllocator:
    """The allocator ``pinning`` asks for on this machine.

    Raises:
        BackendUnavailableError: ``Pinning.ALWAYS`` where CUDA is not available.
    """
    if pinning is Pinning.NEVER or (pinning is Pinning.AUTO and not cuda_available()):
        return PlainAllocator()
    return PinnedAllocator()


class HostMemory:
    """The process's host memory: a budget and the allocator that fills it.

    Args:
        budget: The budget every allocation is charged to.
        pinning: Whether buffers are page-locked (see :class:`Pinning`).

    Raises:
        BackendUnavailableError: ``Pinning.ALWAYS`` where CUDA is not available.
    """

    def __init__(self, budget: HostMemoryBudget, *, pinning: Pinning = Pinning.AUTO) -> None:
        self._budget = budget
        self._allocator = make_allocator(pinning)
        self._leases: dict[int, tuple[HostBuffer, Lease]] = {}
        self._lock = threading.Lock()

    @property
    def budget(self) -> HostMemoryBudget:
        """The budget allocations are charged to."""
        return self._budget

    @property
    def page_locked(self) -> bool:
        """Whether buffers from here are page-locked."""
        return self._allocator.page_locked

    def allocate(self, kind: DataKind, nbytes: int, *, label: str) -> HostBuffer:
        """Charge ``nbytes`` to ``kind``'s budget and allocate them.

        Raises:
            ConfigError: ``nbytes`` is not an int >= 1.
            CapacityError: the budget has no room for ``kind``; nothing was allocated.
        """
        require_int(nbytes, owner="HostMemory.allocate", field="nbytes", low=1)
        lease = self._budget.acquire(kind, nbytes, label=label)
        try:
            buffer = self._allocator.allocate(nbytes, label=label)
        except BaseException:
            lease.release()
            raise
        with self._lock:
            self._leases[id(buffer)] = (buffer, lease)
        return buffer

    def release(self, buffer: HostBuffer) -> None:
        """Free ``buffer`` and return its bytes to the budget.

        Raises:
            StateError: ``buffer`` did not come from here or was already released.
        """
        with self._lock:
            entry = self._leases.pop(id(buffer), None)
        if entry is None or entry[0] is not buffer:
            raise StateError(
                subject=f"HostMemory.release of {buffer.label!r}",
                reason="the buffer was not allocated here or was already released",
            )
        try:
            self._allocator.release(buffer)
        finally:
            entry[1].release()
