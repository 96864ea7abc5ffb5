"""Mapped host regions: anonymous, memfd-shared across a host's processes, or file-backed.

Host tables that GPU kernels read in place (DeepSeek Engram's ~94 GiB fp8 tables) need what
:class:`~sglang_storage.memory.HostMemory`'s ``torch.empty`` buffers cannot give: one copy
shared by every rank of a host, transparent huge pages, and optionally a file's pages.
Contract, one line per primitive:

- :class:`MappedRegionConfig` - size, :class:`MappingMode`, huge pages, pre-faulting,
  pinning, the budget kind, and the file for :attr:`MappingMode.FILE`; validated on
  construction.
- ``MappedRegion.create(config, budget)`` - map the region and charge its bytes to
  ``budget`` (any :class:`BudgetCharge`: a :class:`~sglang_storage.memory.HostMemoryBudget`
  or a runtime component's). ``MADV_HUGEPAGE`` is applied before the first touch when
  asked; the region is registered with CUDA per ``pinning`` through an injectable
  :class:`~sglang_storage.memory.CudaRuntime`.
- ``MappedRegion.attach(handle, ...)`` - map a memfd region another process of this host
  created, by its :class:`SharedHandle` (``pid``, ``fd``) through ``/proc/<pid>/fd/<fd>``;
  :class:`~sglang_storage.errors.BackendUnavailableError` when that path cannot be opened
  (the creator exited, closed the descriptor, or runs in another PID namespace).
- ``tensor`` / ``address`` - the bytes as a 1-D uint8 tensor (``torch.frombuffer``) and
  their start address.
- ``backing()`` - a :class:`BackingReport` read from ``/proc/self/smaps`` for exactly this
  mapping: resident and huge-page kB, with the machine's THP modes, so "huge pages were
  asked and here is what the kernel gave" is measured, never assumed.
- ``collapse()`` - ``MADV_COLLAPSE`` what is still on base pages (anonymous memory).
- ``state()`` - a :class:`RegionState`: mode, bytes, charged bytes, registration and why.
- ``close()`` - end the registration, return the charge, close the descriptor, unmap
  (the mapping itself goes with the last tensor view still alive, as plain buffers do).

Who is charged for a shared mapping: the creator charges the whole region to its budget;
an attacher charges nothing (its :attr:`RegionState.charged_bytes` is 0 and
:attr:`RegionState.shared_from` names the creator), so a table shared by the ranks of a
host is counted once, not once per rank. Each process registers its own mapping with CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import logging
import mmap
import os
import re
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import numpy as np
import torch

from sglang_storage.config import (
    BYTES,
    instance_of,
    non_empty_str,
    non_negative_int,
    positive_int,
)
from sglang_storage.core import DataKind
from sglang_storage.errors import (
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    StateError,
)
from sglang_storage.memory.budget import Lease
from sglang_storage.memory.host import CudaRuntime, Pinning, TorchCudaRuntime, cuda_available

__all__ = [
    "THP_DIR",
    "BackingReport",
    "BudgetCharge",
    "MappedRegion",
    "MappedRegionConfig",
    "MappingMode",
    "RegionState",
    "Registration",
    "SharedHandle",
    "read_backing",
    "thp_mode",
]

log = logging.getLogger(__name__)

THP_DIR: Final = Path("/sys/kernel/mm/transparent_hugepage")
"""Where the kernel's transparent huge page knobs live."""

_SMAPS: Final = Path("/proc/self/smaps")
_PAGEMAP: Final = Path("/proc/self/pagemap")
_PAGEMAP_CHUNK: Final = 1 << 17  # entries read at once (1 MiB)
_HUGE_FIELDS: Final = ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped")
_MADV_POPULATE_READ: Final = 22
_MADV_POPULATE_WRITE: Final = 23
_MADV_COLLAPSE: Final = 25  # Linux >= 6.1; not in Python's mmap module
# cudaHostRegisterPortable | cudaHostRegisterMapped, as the project's PinnedAllocator.
_REGISTER_FLAGS: Final = 1 | 2
_REGISTER_READ_ONLY: Final = 8  # cudaHostRegisterReadOnly
_MEMFD_LINK: Final = "/memfd:"


class MappingMode(enum.Enum):
    """What backs a mapped region."""

    ANONYMOUS = "anonymous"
    """Private anonymous memory of this process (``MAP_PRIVATE | MAP_ANONYMOUS``)."""
    MEMFD = "memfd"
    """A memfd shared with the other processes of this host (``MAP_SHARED``)."""
    FILE = "file"
    """A file's pages (``MAP_SHARED``; writes reach the file unless read-only)."""


class Registration(enum.Enum):
    """Whether a region is registered with CUDA, and if not, why."""

    REGISTERED = "registered"
    """``cudaHostRegister`` succeeded: page-locked and mapped for the GPU."""
    NOT_ASKED = "not_asked"
    """Pinning was ``never``."""
    UNAVAILABLE = "unavailable"
    """Pinning was ``auto`` and CUDA is not available here (no runtime was injected)."""
    CLOSED = "closed"
    """The region was closed; its registration (if any) ended."""


def _valid_path(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, str) and value.strip()):
        raise ConfigError(
            owner=type(instance).__name__,
            field=attribute.name,
            value=value,
            reason="must be a non-empty path string or None",
        )


@attrs.frozen(kw_only=True)
class MappedRegionConfig:
    """One mapped region: its size, what backs it and how it is prepared.

    Raises:
        ConfigError: a size below 1; ``path`` missing for :attr:`MappingMode.FILE` or given
            for another mode; ``read_only`` without a file; ``prefault`` of a read-only file
            together with huge pages asked is allowed, anything else wrongly typed is not.
    """

    nbytes: int = attrs.field(metadata=BYTES, validator=positive_int)
    """The region's size in bytes."""
    mode: MappingMode = attrs.field(validator=instance_of(MappingMode))
    """What backs the region."""
    label: str = attrs.field(validator=non_empty_str)
    """What the region is for (budget labels, errors, the memfd's name)."""
    kind: DataKind = attrs.field(default=DataKind.WEIGHT, validator=instance_of(DataKind))
    """The budget kind the region is charged to."""
    huge_pages: bool = attrs.field(default=True, validator=instance_of(bool))
    """``madvise(MADV_HUGEPAGE)`` before the first touch."""
    prefault: bool = attrs.field(default=False, validator=instance_of(bool))
    """Fault every page in at creation (``MADV_POPULATE_*``), so the first reader does not."""
    pinning: Pinning = attrs.field(default=Pinning.AUTO, validator=instance_of(Pinning))
    """Whether the region is registered with CUDA (``auto``: where CUDA is available)."""
    path: str | None = attrs.field(default=None, validator=_valid_path)
    """The file behind a :attr:`MappingMode.FILE` region."""
    read_only: bool = attrs.field(default=False, validator=instance_of(bool))
    """Map the file read-only (``PROT_READ``); the file must exist and hold ``nbytes``."""

    def __attrs_post_init__(self) -> None:
        owner = type(self).__name__
        if self.mode is MappingMode.FILE and self.path is None:
            raise ConfigError(
                owner=owner, field="path", reason="is required for mode 'file'", allowed="a path"
            )
        if self.mode is not MappingMode.FILE and self.path is not None:
            raise ConfigError(
                owner=owner,
                field="path",
                value=self.path,
                reason=f"applies to mode 'file' only, not {self.mode.value!r}",
            )
        if self.read_only and self.mode is not MappingMode.FILE:
            raise ConfigError(
                owner=owner,
                field="read_only",
                value=True,
                reason=f"applies to mode 'file' only, not {self.mode.value!r}",
            )


@attrs.frozen(kw_only=True)
class SharedHandle:
    """How another process of this host attaches to a memfd region: the creator's pid and fd."""

    pid: int = attrs.field(validator=positive_int)
    fd: int = attrs.field(validator=non_negative_int)
    nbytes: int = attrs.field(metadata=BYTES, validator=positive_int)
    """The region's size, checked against the memfd's on attach."""

    @property
    def proc_path(self) -> str:
        """The path an attacher opens."""
        return f"/proc/{self.pid}/fd/{self.fd}"


@attrs.frozen(kw_only=True)
class BackingReport:
    """What backs a mapping now, from ``/proc/self/smaps`` (kB, as the kernel reports)."""

    mapped_kb: int = attrs.field(validator=non_negative_int)
    """Resident kB of the mapping (``Rss``). Where the mapping is part of a larger area
    (the kernel merged it with a neighbour, or it is a view into a bigger mapping), smaps
    counts the whole area; then the range's own pages are counted one by one
    (``/proc/self/pagemap``), and the huge-page fields below, which smaps gives only for
    the whole area, are capped at this value."""
    anon_huge_kb: int = attrs.field(validator=non_negative_int)
    """``AnonHugePages``: anonymous memory in transparent huge pages."""
    shmem_huge_kb: int = attrs.field(validator=non_negative_int)
    """``ShmemPmdMapped``: shmem (memfd) memory mapped with huge pages."""
    file_huge_kb: int = attrs.field(validator=non_negative_int)
    """``FilePmdMapped``: file pages mapped with huge pages."""
    huge_pages_asked: bool
    """Whether ``MADV_HUGEPAGE`` was applied to the mapping."""
    thp_enabled: str
    """The active ``transparent_hugepage/enabled`` mode ("" if unreadable)."""
    thp_shmem_enabled: str
    """The active ``transparent_hugepage/shmem_enabled`` mode ("" if unreadable)."""
    found: bool = True
    """Whether the mapping was found in smaps at all."""

    @property
    def huge_kb(self) -> int:
        """Kilobytes in huge pages, of any kind."""
        return self.anon_huge_kb + self.shmem_huge_kb + self.file_huge_kb

    @property
    def huge_fraction(self) -> float:
        """The part of the resident memory in huge pages (0.0 when nothing is resident)."""
        return self.huge_kb / self.mapped_kb if self.mapped_kb else 0.0

    def describe(self) -> str:
        """One line for logs."""
        asked = "asked" if self.huge_pages_asked else "not asked"
        return (
            f"{self.mapped_kb / 1024:.0f} MiB resident, {self.huge_kb / 1024:.0f} MiB in huge "
            f"pages ({100 * self.huge_fraction:.0f}%); huge pages {asked}; "
            f"transparent_hugepage enabled={self.thp_enabled or 'unreadable'}, "
            f"shmem_enabled={self.thp_shmem_enabled or 'unreadable'}"
        )


@attrs.frozen(kw_only=True)
class RegionState:
    """A snapshot of a region's life cycle."""

    mode: MappingMode
    nbytes: int
    label: str
    address: int
    """Start address (0 once closed)."""
    charged_bytes: int
    """Bytes this process charged to its budget for the region (0 for an attacher)."""
    shared_from: int | None
    """The creator's pid for an attached region, else ``None``."""
    registration: Registration
    registration_note: str
    """Why the region is (not) registered, in words."""
    huge_pages_asked: bool
    read_only: bool
    closed: bool


class BudgetCharge(Protocol):
    """What a region charges its bytes to.

    :class:`~sglang_storage.memory.HostMemoryBudget` satisfies it, and so does a runtime
    component's budget view.
    """

    def acquire(self, kind: DataKind, nbytes: int, *, label: str) -> Lease:
        """Take ``nbytes`` of ``kind``; :class:`CapacityError` when there is no room."""
        ...


def thp_mode(knob: str) -> str:
    """The active mode of a ``transparent_hugepage`` knob ("" if unreadable)."""
    try:
        text = (THP_DIR / knob).read_text()
    except OSError:
        return ""
    match = re.search(r"\[(\w[\w+]*)\]", text)
    return match.group(1) if match else ""


_VMA: Final = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def read_backing(address: int, nbytes: int, *, huge_pages_asked: bool) -> BackingReport:
    """The :class:`BackingReport` of ``[address, address + nbytes)``, summed over its VMAs."""
    totals = dict.fromkeys(("Rss", *_HUGE_FIELDS), 0)
    end = address + nbytes
    inside = found = wider = False
    try:
        with _SMAPS.open(encoding="ascii", errors="replace") as smaps:
            for line in smaps:
                match = _VMA.match(line)
                if match:
                    start, stop = int(match.group(1), 16), int(match.group(2), 16)
                    inside = start < end and address < stop
                    found = found or inside
                    wider = wider or (inside and (start < address or stop > end))
                    continue
                if inside:
                    key, _, rest = line.partition(":")
                    if key in totals:
                        totals[key] += int(rest.split()[0])
    except OSError as error:
        log.debug("cannot read %s: %s", _SMAPS, error)
    if wider:  # an area that holds more than the range: count the range's own pages
        resident = _resident_kb(address, nbytes)
        if resident is not None:
            totals = {key: min(value, resident) for key, value in totals.items()}
            totals["Rss"] = resident
    return BackingReport(
        mapped_kb=totals["Rss"],
        anon_huge_kb=totals["AnonHugePages"],
        shmem_huge_kb=totals["ShmemPmdMapped"],
        file_huge_kb=totals["FilePmdMapped"],
        huge_pages_asked=huge_pages_asked,
        thp_enabled=thp_mode("enabled"),
        thp_shmem_enabled=thp_mode("shmem_enabled"),
        found=found,
    )


def _resident_kb(address: int, nbytes: int) -> int | None:
    """The kB of ``[address, address + nbytes)`` mapped in this process now, or None.

    What smaps calls ``Rss``, for exactly this range: the pages ``/proc/self/pagemap``
    marks present.
    """
    page = mmap.PAGESIZE
    first = address // page
    pages = -(-(address + nbytes) // page) - first
    present = 0
    try:
        with _PAGEMAP.open("rb") as pagemap:
            pagemap.seek(first * 8)
            while pages > 0:
                chunk = pagemap.read(8 * min(pages, _PAGEMAP_CHUNK))
                if not chunk:
                    return None
                entries = np.frombuffer(chunk, dtype="<u8")
                present += int(np.count_nonzero(entries >> np.uint64(63)))
                pages -= len(entries)
    except OSError as error:
        log.debug("cannot read %s: %s", _PAGEMAP, error)
        return None
    return present * page // 1024


def _libc_madvise(address: int, nbytes: int, advice: int) -> int:
    """``madvise`` through libc; returns 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice) == 0:
        return 0
    return ctypes.get_errno()


@attrs.define(eq=False)
class _Resources:
    """What a region must give back, shared with its finalizer (never the region itself)."""

    mm: mmap.mmap | None
    fd: int | None
    lease: Lease | None
    cudart: CudaRuntime | None
    address: int
    label: str
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def release(self) -> int:
        """Unregister, return the charge, close the descriptor, try to unmap; the status."""
        with self.lock:
            status = 0
            cudart, self.cudart = self.cudart, None
            if cudart is not None:
                status = int(cudart.cudaHostUnregister(self.address))
                if status != 0:
                    cudart.cudaGetLastError()
            lease, self.lease = self.lease, None
            if lease is not None and not lease.released:
                lease.release()
            fd, self.fd = self.fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            mm, self.mm = self.mm, None
            if mm is not None:
                with contextlib.suppress(BufferError):  # views alive: unmapped with the last
                    mm.close()
            return status


def _collected(resources: _Resources) -> None:
    status = resources.release()
    if status != 0:
        log.warning(
            "cudaHostUnregister of the collected region %r failed with code %d",
            resources.label,
            status,
        )


class MappedRegion:
    """A host memory mapping charged to a budget; build it with :meth:`create` or :meth:`attach`.

    Thread-safe for :meth:`state`, :meth:`backing` and :meth:`close`; the bytes themselves
    are the caller's to synchronize. Keep the region alive as long as anything (a GPU
    kernel) reads its memory: collecting it unclosed ends its registration and charge.
    """

    def __init__(
        self,
        *,
        config: MappedRegionConfig,
        mm: mmap.mmap,
        fd: int | None,
        lease: Lease | None,
        shared_from: int | None,
    ) -> None:
        """Use :meth:`create` or :meth:`attach`."""
        self._config = config
        self._shared_from = shared_from
        if config.read_only:
            with warnings.catch_warnings():  # torch warns that the buffer is not writable
                warnings.simplefilter("ignore", UserWarning)
                self._tensor: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)
        else:
            self._tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self._address = self._tensor.data_ptr()
        self._resources = _Resources(
            mm=mm, fd=fd, lease=lease, cudart=None, address=self._address, label=config.label
        )
        self._finalizer = weakref.finalize(self, _collected, self._resources)
        self._finalizer.atexit = False  # no CUDA calls during interpreter shutdown
        self._registration = Registration.NOT_ASKED
        self._note = "not registered yet"
        self._closed = False

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(
        cls,
        config: MappedRegionConfig,
        budget: BudgetCharge,
        *,
        cudart: CudaRuntime | None = None,
    ) -> MappedRegion:
        """Map a new region, charge its bytes to ``budget`` and prepare it as configured.

        Args:
            config: The region.
            budget: Where its bytes are charged (released on :meth:`close`).
            cudart: The CUDA runtime to register with (default: torch's, where CUDA is
                available); tests inject a fake.

        Raises:
            CapacityError: the budget has no room, or the system refused the mapping.
            ConfigError: a read-only file smaller than ``nbytes``.
            BackendIOError: the file or memfd could not be opened or sized.
            BackendUnavailableError: pinning ``always`` without CUDA, or a failed
                ``cudaHostRegister``.
        """
        if not isinstance(config, MappedRegionConfig):
            raise ConfigError(
                owner="MappedRegion.create",
                field="config",
                value=type(config).__name__,
                reason="must be a MappedRegionConfig",
            )
        _check_pinning(config.pinning, cudart)
        lease = budget.acquire(config.kind, config.nbytes, label=config.label)
        fd: int | None = None
        try:
            fd, mm = _map_new(config)
            region = cls(config=config, mm=mm, fd=fd, lease=lease, shared_from=None)
        except BaseException:
            if fd is not None:
                os.close(fd)
            lease.release()
            raise
        try:
            region._prepare(fresh=config.mode is not MappingMode.FILE)
            region._registration, region._note = region._register(cudart)
        except BaseException:
            region.close()
            raise
        return region

    @classmethod
    def attach(
        cls,
        handle: SharedHandle,
        *,
        label: str,
        kind: DataKind = DataKind.WEIGHT,
        huge_pages: bool = True,
        pinning: Pinning = Pinning.AUTO,
        cudart: CudaRuntime | None = None,
    ) -> MappedRegion:
        """Map the memfd region another process of this host created; nothing is charged.

        Raises:
            BackendUnavailableError: ``/proc/<pid>/fd/<fd>`` cannot be opened (the creator
                exited or closed it, or this process is in another PID namespace), or it is
                not a memfd; pinning ``always`` without CUDA; a failed ``cudaHostRegister``.
            StateError: the memfd's size differs from the handle's.
        """
        if not isinstance(handle, SharedHandle):
            raise ConfigError(
                owner="MappedRegion.attach",
                field="handle",
                value=type(handle).__name__,
                reason="must be a SharedHandle",
            )
        config = MappedRegionConfig(
            nbytes=handle.nbytes,
            mode=MappingMode.MEMFD,
            label=label,
            kind=kind,
            huge_pages=huge_pages,
            pinning=pinning,
        )
        _check_pinning(pinning, cudart)
        fd = _open_shared(handle)
        try:
            mm = mmap.mmap(
                fd, handle.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            region = cls(config=config, mm=mm, fd=fd, lease=None, shared_from=handle.pid)
        except BaseException:
            os.close(fd)
            raise
        try:
            region._prepare(fresh=False)
            region._registration, region._note = region._register(cudart)
        except BaseException:
            region.close()
            raise
        return region

    # ---------------------------------------------------------------- the region

    @property
    def config(self) -> MappedRegionConfig:
        """What the region was built from (an attacher's: mode memfd, the handle's size)."""
        return self._config

    @property
    def nbytes(self) -> int:
        """The region's size in bytes."""
        return self._config.nbytes

    @property
    def tensor(self) -> torch.Tensor:
        """The bytes as a 1-D uint8 CPU tensor (writing a read-only region's is undefined).

        Raises:
            StateError: the region is closed.
        """
        if self._tensor is None:
            raise StateError(subject=f"mapped region {self._config.label!r}", reason="is closed")
        return self._tensor

    @property
    def address(self) -> int:
        """The start address of the mapping (the device address too, under CUDA's UVA)."""
        return self._address if not self._closed else 0

    @property
    def page_locked(self) -> bool:
        """Whether the region is registered with CUDA."""
        return self._registration is Registration.REGISTERED

    def share_handle(self) -> SharedHandle:
        """The handle other processes of this host attach with (:meth:`attach`).

        Raises:
            StateError: the region is not a memfd region, or is closed.
        """
        fd = self._resources.fd
        if self._config.mode is not MappingMode.MEMFD or fd is None or self._closed:
            raise StateError(
                subject=f"mapped region {self._config.label!r}",
                reason="only an open memfd region can be shared",
            )
        # This process's descriptor: an attacher can hand the region on as well.
        return SharedHandle(pid=os.getpid(), fd=fd, nbytes=self._config.nbytes)

    def backing(self) -> BackingReport:
        """What backs the mapping now, from ``/proc/self/smaps``.

        Raises:
            StateError: the region is closed.
        """
        self.tensor  # noqa: B018 - raises when closed
        return read_backing(
            self._address, self._config.nbytes, huge_pages_asked=self._config.huge_pages
        )

    def collapse(self, *, tries: int = 3, wait_s: float = 1.0) -> bool:
        """``MADV_COLLAPSE`` the region into huge pages now; whether the kernel did it.

        Anonymous memory only in practice (shmem follows ``shmem_enabled``); ``EAGAIN`` is
        retried up to ``tries`` times, ``wait_s`` apart.

        Raises:
            StateError: the region is closed.
        """
        self.tensor  # noqa: B018 - raises when closed
        for attempt in range(max(1, tries)):
            status = _libc_madvise(self._address, self._config.nbytes, _MADV_COLLAPSE)
            if status == 0:
                return True
            if status != errno.EAGAIN or attempt == tries - 1:
                log.info("MADV_COLLAPSE of %r: %s", self._config.label, errno.errorcode.get(status))
                return False
            time.sleep(wait_s)
        return False

    def state(self) -> RegionState:
        """A snapshot of the region's life cycle."""
        lease = self._resources.lease
        return RegionState(
            mode=self._config.mode,
            nbytes=self._config.nbytes,
            label=self._config.label,
            address=self.address,
            charged_bytes=0 if lease is None or lease.released else lease.nbytes,
            shared_from=self._shared_from,
            registration=Registration.CLOSED if self._closed else self._registration,
            registration_note=self._note,
            huge_pages_asked=self._config.huge_pages,
            read_only=self._config.read_only,
            closed=self._closed,
        )

    def close(self) -> None:
        """End the registration, return the charge, close the descriptor and unmap.

        The mapping stays until the last tensor view of it is gone. Closing twice is a no-op.

        Raises:
            BackendIOError: ``cudaHostUnregister`` failed (``code`` is its error); the
                region counts as closed all the same.
        """
        if self._closed:
            return
        self._closed = True
        self._tensor = None
        self._finalizer.detach()
        status = self._resources.release()
        if status != 0:
            raise BackendIOError(
                backend="mapped host memory",
                operation=f"cudaHostUnregister of {self._config.label!r}",
                reason=f"the CUDA runtime returned error {status}",
                code=status,
            )

    def __enter__(self) -> MappedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self._registration.value
        return (
            f"<MappedRegion {self._config.label!r} {self._config.mode.value} "
            f"{self._config.nbytes} bytes, {state}>"
        )

    # ---------------------------------------------------------------- internals

    def _prepare(self, *, fresh: bool) -> None:
        """Huge pages before the first touch, then the optional pre-fault."""
        mm = self._resources.mm
        assert mm is not None
        if self._config.huge_pages:
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError as error:  # e.g. a file system without huge page support
                log.info("MADV_HUGEPAGE on %r refused: %s", self._config.label, error)
        if self._config.prefault:
            populate = _MADV_POPULATE_WRITE if fresh else _MADV_POPULATE_READ
            if self._config.read_only:
                populate = _MADV_POPULATE_READ
            status = _libc_madvise(self._address, self._config.nbytes, populate)
            if status in (errno.EINVAL, errno.ENOSYS):  # a kernel before 5.14: touch pages
                pages = np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE]
                if fresh:
                    pages[:] = 0
                else:
                    int(pages.sum())
            elif status != 0:
                raise CapacityError(
                    resource=f"host memory for {self._config.label}",
                    requested=self._config.nbytes,
                    available=0,
                    hint=f"pre-faulting failed ({errno.errorcode.get(status, status)})",
                )

    def _register(self, cudart: CudaRuntime | None) -> tuple[Registration, str]:
        pinning = self._config.pinning
        if pinning is Pinning.NEVER:
            return Registration.NOT_ASKED, "not registered: pinning is 'never'"
        if cudart is None:
            if not cuda_available():
                return Registration.UNAVAILABLE, (
                    f"not registered: CUDA is not available (torch {torch.__version__}, "
                    f"CUDA build {torch.version.cuda or 'none'})"
                )
            cudart = TorchCudaRuntime()
        flags = _REGISTER_FLAGS | (_REGISTER_READ_ONLY if self._config.read_only else 0)
        status = int(cudart.cudaHostRegister(self._address, self._config.nbytes, flags))
        if status != 0:
            cudart.cudaGetLastError()
            raise BackendUnavailableError(
                backend="mapped host memory",
                reason=(
                    f"cudaHostRegister of {self._config.nbytes} bytes for "
                    f"{self._config.label!r} failed with code {status}"
                ),
            )
        self._resources.cudart = cudart
        return Registration.REGISTERED, f"registered with CUDA (flags {flags})"


def _check_pinning(pinning: Pinning, cudart: CudaRuntime | None) -> None:
    if pinning is Pinning.ALWAYS and cudart is None and not cuda_available():
        raise BackendUnavailableError(
            backend="mapped host memory",
            reason="pinning 'always' needs CUDA, which is not available; use 'auto' or 'never'",
        )


def _map_new(config: MappedRegionConfig) -> tuple[int | None, mmap.mmap]:
    """The descriptor (memfd, file) and mapping of a new region."""
    try:
        if config.mode is MappingMode.ANONYMOUS:
            return None, mmap.mmap(
                -1,
                config.nbytes,
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        fd = _memfd(config) if config.mode is MappingMode.MEMFD else _open_file(config)
    except OSError as error:
        raise _refused(config, error) from None
    try:
        prot = mmap.PROT_READ if config.read_only else mmap.PROT_READ | mmap.PROT_WRITE
        return fd, mmap.mmap(fd, config.nbytes, flags=mmap.MAP_SHARED, prot=prot)
    except BaseException as error:
        os.close(fd)
        if isinstance(error, OSError):
            raise _refused(config, error) from None
        raise


def _refused(config: MappedRegionConfig, error: OSError) -> CapacityError | BackendIOError:
    if error.errno == errno.ENOMEM:
        return CapacityError(
            resource=f"host memory for {config.label}",
            requested=config.nbytes,
            available=0,
            hint=f"the system refused the mapping ({error})",
        )
    return BackendIOError(
        backend="mapped host memory",
        operation=f"mapping {config.nbytes} bytes ({config.mode.value}) for {config.label!r}",
        reason=str(error),
        code=error.errno,
    )


def _memfd(config: MappedRegionConfig) -> int:
    fd = os.memfd_create(config.label[:249], os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, config.nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_file(config: MappedRegionConfig) -> int:
    assert config.path is not None
    if config.read_only:
        fd = os.open(config.path, os.O_RDONLY | os.O_CLOEXEC)
        size = os.fstat(fd).st_size
        if size < config.nbytes:
            os.close(fd)
            raise ConfigError(
                owner="MappedRegion.create",
                field="path",
                value=config.path,
                reason=f"holds {size} bytes, fewer than the {config.nbytes} to map read-only",
            )
        return fd
    fd = os.open(config.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_size < config.nbytes:
            os.ftruncate(fd, config.nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_shared(handle: SharedHandle) -> int:
    path = handle.proc_path
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as error:
        raise BackendUnavailableError(
            backend="shared host mapping",
            reason=(
                f"cannot open {path} ({error.strerror}): the creating process must be alive, "
                "still hold the descriptor, run as the same user and share this process's "
                "PID namespace"
            ),
        ) from None
    try:
        target = str(Path(f"/proc/self/fd/{fd}").readlink())
        size = os.fstat(fd).st_size
    except OSError as error:
        os.close(fd)
        raise BackendUnavailableError(
            backend="shared host mapping", reason=f"cannot inspect {path}: {error}"
        ) from None
    if not target.startswith(_MEMFD_LINK):
        os.close(fd)
        raise BackendUnavailableError(
            backend="shared host mapping",
            reason=f"{path} is {target!r}, not a memfd (the pid or fd is stale)",
        )
    if size != handle.nbytes:
        os.close(fd)
        raise StateError(
            subject=f"attaching {path}",
            reason=f"the memfd holds {size} bytes, the handle says {handle.nbytes}",
        )
    return fd
