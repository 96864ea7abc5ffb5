"""Host buffers: page-locked where CUDA exists, plain elsewhere, always within the budget.

Contract, one line per primitive:

- :class:`Pinning` - ``auto`` (page-locked when CUDA is available), ``always`` (page-locked
  or a clear error), ``never`` (plain memory).
- :class:`HostAllocator` - ``allocate(nbytes)`` one contiguous uint8 buffer, ``release(buffer)``.
  :class:`PlainAllocator` uses ordinary memory; :class:`PinnedAllocator` registers one large
  allocation with CUDA once (``cudaHostRegister``), so a pool costs one registration instead
  of many small pinned tensors, and no power-of-two rounding of torch's pinned cache. A
  registration lasts as long as its buffer: ``release`` ends it, and so does garbage
  collection of a buffer nobody released, so memory never returns to malloc registered.
- :class:`CudaRuntime` - the CUDA runtime calls :class:`PinnedAllocator` makes (injectable,
  so the registration life cycle is testable without a GPU).
- :class:`HostMemory` - the budget plus an allocator: ``allocate(kind, nbytes, label)`` takes
  the bytes from the kind's budget and returns a :class:`HostBuffer`; ``release(buffer)``
  frees the memory and returns the bytes to the budget.

Every pool in this layer draws its memory from a :class:`HostMemory`, so one budget covers
KV pages, embeddings, records and weight blobs alike.
"""

from __future__ import annotations

import abc
import ctypes
import enum
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol, SupportsInt, TypeAlias

import attrs
import torch

from sglang_storage.config import require_int
from sglang_storage.core import DataKind
from sglang_storage.errors import (
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    StateError,
)
from sglang_storage.memory.budget import HostMemoryBudget, Lease, read_memory_facts

__all__ = [
    "CudaArray",
    "CudaRuntime",
    "HostAllocator",
    "HostBuffer",
    "HostMemory",
    "PinnedAllocator",
    "Pinning",
    "PlainAllocator",
    "TorchCudaRuntime",
    "cuda_available",
    "make_allocator",
]

ALIGNMENT: Final = 4096
"""Byte alignment of every buffer's start (O_DIRECT and DMA friendly)."""

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every CUDA context, and
# mapped into the device address space so record pools can hand kernels a UVA view.
_REGISTER_FLAGS: Final = 1 | 2

log = logging.getLogger(__name__)


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


class CudaArray:
    """A host buffer described to torch through ``__cuda_array_interface__`` (UVA).

    ``torch.as_tensor(CudaArray(buffer, shape, typestr))`` is a CUDA tensor over the
    buffer's page-locked memory, without a copy. Torch keeps this object referenced from
    the storage of every tensor made from it, so the ``buffer`` reference keeps the memory
    and its CUDA registration alive for as long as any view of it exists. ``buffer`` may
    also be a CPU tensor someone else registered with CUDA (SGLang's host mirrors).
    """

    def __init__(
        self, buffer: HostBuffer | torch.Tensor, shape: tuple[int, ...], typestr: str
    ) -> None:
        self.buffer = buffer
        address = buffer.data_ptr() if isinstance(buffer, torch.Tensor) else buffer.address
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


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


class CudaRuntime(Protocol):
    """The CUDA runtime calls :class:`PinnedAllocator` makes; each returns a ``cudaError_t``.

    The default is torch's binding plus ``cudaGetLastError`` from the loaded libcudart;
    tests inject a fake.
    """

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> SupportsInt:  # noqa: N802
        """Page-lock and map ``size`` bytes at ``ptr``."""
        ...

    def cudaHostUnregister(self, ptr: int) -> SupportsInt:  # noqa: N802
        """End the registration that starts at ``ptr``."""
        ...

    def cudaGetLastError(self) -> SupportsInt:  # noqa: N802
        """Return and reset this thread's latched runtime error."""
        ...


@functools.cache
def _loaded_get_last_error() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the libcudart this process already loaded, or None.

    A failed runtime call leaves its error latched as the thread's "last error", and torch's
    next kernel-launch check (``cudaGetLastError``) raises it in an unrelated place. Torch's
    ``torch.cuda.cudart()`` binding has no ``cudaGetLastError``, so it is taken from the
    libcudart that torch loaded (found in ``/proc/self/maps``; the cu13 wheels load
    ``nvidia/cu13/lib/libcudart.so.13`` dynamically). Best effort: None when not found.
    """
    try:
        with Path("/proc/self/maps").open(encoding="utf-8") as maps:
            paths = [line.split()[-1] for line in maps if "libcudart.so" in line]
    except OSError as error:
        log.debug("cannot read /proc/self/maps to find libcudart: %s", error)
        return None
    for path in dict.fromkeys(paths):
        try:
            function = ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError) as error:
            log.debug("no cudaGetLastError in %s: %s", path, error)
            continue
        function.restype = ctypes.c_int
        function.argtypes = []
        get_last_error: Callable[[], int] = function
        return get_last_error
    log.debug("no loaded libcudart found; latched CUDA errors are not cleared")
    return None


_Finalizer: TypeAlias = "weakref.finalize[[CudaRuntime, torch.Tensor, str], HostBuffer]"
"""The finalizer that ends a collected buffer's registration."""


class TorchCudaRuntime:
    """The real CUDA runtime as a :class:`CudaRuntime`: torch's cudart binding.

    ``cudaGetLastError`` comes from the loaded libcudart (0 where none is loaded).
    """

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> SupportsInt:  # noqa: N802
        """Page-lock ``size`` bytes at ``ptr``; the CUDA status code."""
        status: SupportsInt = self._cudart.cudaHostRegister(ptr, size, flags)
        return status

    def cudaHostUnregister(self, ptr: int) -> SupportsInt:  # noqa: N802
        """End the registration of ``ptr``; the CUDA status code."""
        status: SupportsInt = self._cudart.cudaHostUnregister(ptr)
        return status

    def cudaGetLastError(self) -> SupportsInt:  # noqa: N802
        """Return and clear the error the last failed call latched."""
        function = _loaded_get_last_error()
        return 0 if function is None else int(function())


def _clear_latched_error(cudart: CudaRuntime) -> None:
    """Reset the error a failed call latched, so torch does not raise it later elsewhere."""
    cudart.cudaGetLastError()


def _unregister(cudart: CudaRuntime, tensor: torch.Tensor) -> int:
    """End ``tensor``'s registration; returns the runtime status (0 = success)."""
    status = int(cudart.cudaHostUnregister(tensor.data_ptr()))
    if status != 0:
        _clear_latched_error(cudart)
    return status


def _unregister_collected(cudart: CudaRuntime, tensor: torch.Tensor, label: str) -> None:
    """The finalizer of a buffer collected without release: unregister, warn on failure."""
    status = _unregister(cudart, tensor)
    if status != 0:
        log.warning(
            "cudaHostUnregister of the collected %d-byte buffer %r failed with code %d",
            tensor.numel(),
            label,
            status,
        )


class PinnedAllocator(HostAllocator):
    """Page-locked host memory: one ``cudaHostRegister`` per buffer, for the buffer's life.

    Each registration ends exactly once: at :meth:`release`, or when the buffer is garbage
    collected unreleased (then a failure is logged, not raised). Until then the allocator
    keeps the registered memory alive, so it never returns to malloc registered.

    Args:
        cudart: The CUDA runtime to call; default torch's (CUDA must be available). An
            injected runtime is used as given, without checking for CUDA.

    Raises:
        BackendUnavailableError: no runtime was injected and CUDA is not available.
    """

    def __init__(self, cudart: CudaRuntime | None = None) -> None:
        if cudart is None:
            if not cuda_available():
                raise BackendUnavailableError(
                    backend="pinned host memory",
                    reason=(
                        f"CUDA is not available (torch {torch.__version__}, CUDA build "
                        f"{torch.version.cuda or 'none'}); use pinning 'auto' or 'never'"
                    ),
                )
            cudart = TorchCudaRuntime()
        self._cudart = cudart
        self._registrations: weakref.WeakKeyDictionary[HostBuffer, _Finalizer] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    @property
    def page_locked(self) -> bool:
        """Always True."""
        return True

    def allocate(self, nbytes: int, *, label: str) -> HostBuffer:
        """Allocate ``nbytes`` and register them with CUDA until released or collected.

        Raises:
            CapacityError: the operating system refused the memory.
            BackendUnavailableError: ``cudaHostRegister`` failed (its error is cleared).
        """
        tensor = _aligned_empty(nbytes, label)
        status = int(self._cudart.cudaHostRegister(tensor.data_ptr(), nbytes, _REGISTER_FLAGS))
        if status != 0:
            _clear_latched_error(self._cudart)
            raise BackendUnavailableError(
                backend="pinned host memory",
                reason=f"cudaHostRegister of {nbytes} bytes for {label} failed with code {status}",
            )
        buffer = HostBuffer(tensor=tensor, page_locked=True, label=label)
        # The finalizer holds the tensor (never the buffer): the memory outlives the
        # registration, which ends when the buffer is collected if release never ran.
        finalizer = weakref.finalize(buffer, _unregister_collected, self._cudart, tensor, label)
        finalizer.atexit = False  # no CUDA calls during interpreter shutdown
        with self._lock:
            self._registrations[buffer] = finalizer
        return buffer

    def release(self, buffer: HostBuffer) -> None:
        """End the buffer's registration with CUDA.

        Raises:
            StateError: the buffer was not allocated here or was already released.
            BackendIOError: ``cudaHostUnregister`` failed (``code`` is its error); the
                buffer counts as released all the same.
        """
        with self._lock:
            finalizer = self._registrations.pop(buffer, None)
        detached = None if finalizer is None else finalizer.detach()
        if detached is None:
            raise StateError(
                subject=f"PinnedAllocator.release of {buffer.label!r}",
                reason="the buffer was not allocated here or was already released",
            )
        cudart: CudaRuntime = detached[2][0]
        tensor: torch.Tensor = detached[2][1]
        label: str = detached[2][2]
        status = _unregister(cudart, tensor)
        if status != 0:
            raise BackendIOError(
                backend="pinned host memory",
                operation=f"cudaHostUnregister of the {tensor.numel()}-byte buffer {label!r}",
                reason=f"the CUDA runtime returned error {status}",
                code=status,
            )


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
        allocator: The allocator to use instead of the one ``pinning`` picks (``pinning``
            is then ignored); tests inject one over a fake CUDA runtime.

    Raises:
        BackendUnavailableError: ``Pinning.ALWAYS`` where CUDA is not available.
    """

    def __init__(
        self,
        budget: HostMemoryBudget,
        *,
        pinning: Pinning = Pinning.AUTO,
        allocator: HostAllocator | None = None,
    ) -> None:
        self._budget = budget
        self._allocator = make_allocator(pinning) if allocator is None else allocator
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
            BackendIOError: the allocator failed to undo the buffer (a failed
                ``cudaHostUnregister``); the bytes are back in the budget all the same.
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
