"""I/O backends: the copies that move KV pages between a device pool and a host pool.

A backend is bound to one :class:`~sglang_storage.transfer.device_kv.DeviceKV` and one
:class:`~sglang_storage.memory.KVHostPool` and knows nothing about streams, events, pins or
handles (the pipeline in :mod:`sglang_storage.transfer.device` owns those). Contract, one
line per primitive:

- ``IOBackend.name`` / ``detail`` - the backend's name (``"torch"``, ``"kernel"``) and how
  it copies on this machine, for logs.
- ``IOBackend.plan(host_pages, device_pages)`` - prepare one transfer (index tensors moved
  where the copies need them) and return a :class:`CopyPlan`. Both arguments are validated
  1-D int64 tensors of equal, non-zero length: host pages on the CPU, in range and
  distinct; device pages on the CPU, in range (and distinct when loading), or, where the
  pipeline trusts its caller (``check_device_tokens=False``), possibly on the device and
  unchecked.
- ``CopyPlan.load_layer(layer)`` - host -> device for one layer, all planned pages.
- ``CopyPlan.offload()`` - device -> host for every layer.

On CUDA, ``plan`` and the copy methods enqueue their work on the current CUDA stream and
return without waiting (the pipeline makes its transfer stream current). On CPU they finish
before returning. Failures are raised as ``RuntimeError`` (torch's own) or
:class:`~sglang_storage.errors.StorageError`.

Backends:

- :class:`TorchIOBackend` (``"torch"``) - ``index_select`` / ``index_copy_`` over integer
  views of the element bits, as wide as each layout allows (:func:`copy_views`: 8-byte
  words over the merged contiguous part of a page), so every element type, fp8 included,
  moves byte-exactly; works on CPU and CUDA. On CUDA with
  page-locked host memory the host buffer is addressed in place from the device (a UVA
  view: no staging copy, asynchronous); with pageable host memory each layer goes through
  a synchronous staging copy.
- :class:`~sglang_storage.transfer.io_kernel.KernelIOBackend` (``"kernel"``, in
  :mod:`sglang_storage.transfer.io_kernel`) - SGLang's ``sgl_kernel.kvcacheio`` transfer
  kernels (imported lazily; it is a separate package from SGLang), the ones SGLang 0.5.23's
  host pools call for the same layout, with the same arguments. Needs CUDA, page-locked host
  memory and rows whose byte size is a multiple of 8.

:func:`open_io_backend` picks one by :class:`IOBackendChoice`: ``kernel`` where it cannot
run is a :class:`~sglang_storage.errors.BackendUnavailableError` naming every missing piece
(:func:`~sglang_storage.transfer.io_kernel.kernel_unavailable_reason`);
``auto`` takes ``kernel`` when it can run and ``torch`` otherwise, and logs its choice.
"""

from __future__ import annotations

import abc
import enum
import logging

import torch

from sglang_storage.memory import KVHostPool
from sglang_storage.memory.host import CudaArray
from sglang_storage.memory.layouts import bits_dtype
from sglang_storage.transfer.device_kv import DeviceKV

__all__ = [
    "CopyPlan",
    "IOBackend",
    "IOBackendChoice",
    "TorchIOBackend",
    "copy_views",
    "open_io_backend",
    "token_indices",
    "upload_index",
]

log = logging.getLogger(__name__)


class IOBackendChoice(enum.Enum):
    """Which I/O backend a device<->host pipeline uses."""

    AUTO = "auto"
    """``kernel`` where it can run, else ``torch``; the choice is logged and reported."""
    TORCH = "torch"
    """``index_select`` / ``index_copy_``: correct on CPU and CUDA."""
    KERNEL = "kernel"
    """SGLang's ``sgl_kernel`` transfer kernels; an error where they cannot run."""


class CopyPlan(abc.ABC):
    """The copies of one transfer, with its indices prepared; see the module contract."""

    @abc.abstractmethod
    def load_layer(self, layer: int) -> None:
        """Copy layer ``layer`` of the planned pages from the host to the device."""

    @abc.abstractmethod
    def offload(self) -> None:
        """Copy every layer of the planned pages from the device to the host."""


class IOBackend(abc.ABC):
    """Copies KV pages between one device pool and one host pool; see the module contract."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The backend's name (``"torch"``, ``"kernel"``, or a third party's)."""

    @property
    def detail(self) -> str:
        """How the backend copies on this machine (for logs)."""
        return self.name

    @abc.abstractmethod
    def plan(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> CopyPlan:
        """Prepare the copies between ``host_pages`` and ``device_pages`` (pairwise)."""


def upload_index(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``index`` on ``device``; from the CPU to CUDA through page-locked memory, no sync.

    An index already on ``device`` is returned as it is. Call it with the stream that will
    use the index current.
    """
    same_type = index.device.type == device.type
    if index.device == device or (same_type and device.index is None):
        return index
    if device.type == "cuda" and index.device.type == "cpu":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def token_indices(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The token indices of ``pages`` (on their device): each page's tokens, in order."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages.unsqueeze(1) * page_size + offsets).flatten()


# ---------------------------------------------------------------------- torch

_WORDS: tuple[torch.dtype, ...] = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _mergeable_dims(view: torch.Tensor) -> int:
    """How many trailing dimensions of ``view`` lie contiguously and can merge into one."""
    if view.stride(-1) != 1:
        return 1
    merged = 1
    for dim in range(view.dim() - 2, 0, -1):  # dimension 0 (the page) is indexed: keep it
        if view.stride(dim) != view.stride(dim + 1) * view.size(dim + 1):
            break
        merged += 1
    return merged


def copy_views(host: torch.Tensor, device: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``host`` and ``device`` (same shape, page first) as rows of the widest words both allow.

    The trailing dimensions that are contiguous in both views merge into one, which is then
    read as the widest integer (8, 4, 2 or 1 bytes) that divides its size, strides and start
    in both. Fewer, wider elements move the same bytes in fewer (and, on a GPU reading host
    memory in place, larger) transactions; the bits are unchanged.
    """
    merged = min(_mergeable_dims(host), _mergeable_dims(device))
    if merged > 1:
        host = host.view(*host.shape[:-merged], -1)
        device = device.view(*device.shape[:-merged], -1)
    for word in _WORDS:
        if word.itemsize < host.element_size():
            continue
        try:
            return host.view(word), device.view(word)
        except RuntimeError:  # size, a stride or the start is not a multiple of the word
            continue
    return host.view(torch.uint8), device.view(torch.uint8)


def _uva_bytes(host: KVHostPool, device: torch.device) -> torch.Tensor | None:
    """The host pool's buffer as a CUDA uint8 tensor over the same memory, or None.

    Page-locked, mapped host memory (what :class:`~sglang_storage.memory.PinnedAllocator`
    registers) is addressable from the device at its host address (UVA).
    """
    buffer = host.buffer
    if not buffer.page_locked:
        return None
    try:
        with torch.cuda.device(device):
            # No ``device=`` here: torch would copy to it if the memory's device differed.
            view = torch.as_tensor(CudaArray(buffer, (buffer.nbytes,), "|u1"))
    except (RuntimeError, TypeError, ValueError) as error:
        log.warning("no device view of %s (%s); staging host copies", host.label, error)
        return None
    if view.device != device:
        log.warning(
            "%s is registered with %s, not %s; staging host copies",
            host.label,
            view.device,
            device,
        )
        return None
    if view.data_ptr() != buffer.address:
        # torch copied instead of viewing (a default device set to the CPU does that).
        log.warning("no in-place device view of %s (torch copied it); staging", host.label)
        return None
    return view


class TorchIOBackend(IOBackend):
    """Copies with ``index_select`` / ``index_copy_``; see the module contract.

    Args:
        device_kv: The device pool.
        host: The host pool; its geometry must match ``device_kv.geometry``.

    Raises:
        ConfigError: the pools' geometries do not match.
    """

    def __init__(self, device_kv: DeviceKV, host: KVHostPool) -> None:
        device_kv.require_compatible(host)
        self._device_kv = device_kv
        g = host.geometry
        bits = bits_dtype(g.dtype)
        device = device_kv.device
        host_base = host.kv_buffer
        uva = _uva_bytes(host, device) if device.type == "cuda" else None
        if device.type == "cpu":
            self._mode = "cpu"
        elif uva is not None:
            self._mode = "uva"
        else:
            self._mode = "staged"

        def host_view(view: torch.Tensor) -> torch.Tensor:
            if uva is None:
                return view.view(bits)
            offset = (view.data_ptr() - host_base.data_ptr()) // g.itemsize
            rebased = uva.view(g.dtype).as_strided(view.shape, view.stride(), offset)
            return rebased.view(bits)

        pages = device_kv.num_pages

        def device_view(tensor: torch.Tensor) -> torch.Tensor:
            paged = tensor.narrow(0, 0, pages * g.page_size)
            return paged.view(pages, g.page_size, g.head_num, g.head_dim).view(bits)

        # Per layer: (host view, device view) per plane, both (pages, page, H, D).
        self._pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in range(g.layer_num):
            views = host.layer(layer)
            host_planes = [views.k] if views.v is None else [views.k, views.v]
            self._pairs.append(
                [
                    copy_views(host_view(h), device_view(d))
                    for h, d in zip(host_planes, device_kv.planes(layer), strict=True)
                ]
            )
        self._host_index_device = device if uva is not None else torch.device("cpu")

    @property
    def name(self) -> str:
        """``"torch"``."""
        return "torch"

    @property
    def mode(self) -> str:
        """How copies run: ``"cpu"``, ``"uva"`` or ``"staged"``.

        ``"uva"``: the device reads and writes page-locked host memory in place.
        ``"staged"``: synchronous copies through pageable memory.
        """
        return self._mode

    @property
    def detail(self) -> str:
        """The backend and its mode."""
        how = {
            "cpu": "index_select/index_copy_ on CPU, synchronous",
            "uva": "index_select/index_copy_ on the device over page-locked host memory",
            "staged": "index_select/index_copy_ with synchronous staging (pageable host memory)",
        }[self._mode]
        return f"torch ({how})"

    def plan(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> CopyPlan:
        """Move the page indices to where the copies run."""
        return _TorchPlan(
            self._pairs,
            upload_index(host_pages, self._host_index_device),
            upload_index(device_pages, self._device_kv.device),
        )


class _TorchPlan(CopyPlan):
    def __init__(
        self,
        pairs: list[list[tuple[torch.Tensor, torch.Tensor]]],
        host_index: torch.Tensor,
        device_index: torch.Tensor,
    ) -> None:
        self._pairs = pairs
        self._host_index = host_index
        self._device_index = device_index

    def load_layer(self, layer: int) -> None:
        for host_view, device_view in self._pairs[layer]:
            rows = host_view.index_select(0, self._host_index)
            device_view.index_copy_(0, self._device_index, rows.to(device_view.device))

    def offload(self) -> None:
        for planes in self._pairs:
            for host_view, device_view in planes:
                rows = device_view.index_select(0, self._device_index)
                host_view.index_copy_(0, self._host_index, rows.to(host_view.device))


# ---------------------------------------------------------------------- choice


def open_io_backend(choice: IOBackendChoice, device_kv: DeviceKV, host: KVHostPool) -> IOBackend:
    """The backend ``choice`` names, bound to these pools.

    ``AUTO`` takes ``kernel`` where
    :func:`~sglang_storage.transfer.io_kernel.kernel_unavailable_reason` finds nothing
    missing, ``torch`` otherwise, and logs which and why.

    Raises:
        BackendUnavailableError: ``KERNEL`` where the kernels cannot run; the reason says
            what is missing.
    """
    # The kernel backend imports this module; import it only when a choice needs it.
    from sglang_storage.transfer.io_kernel import KernelIOBackend, kernel_unavailable_reason

    if choice is IOBackendChoice.TORCH:
        return TorchIOBackend(device_kv, host)
    if choice is IOBackendChoice.KERNEL:
        return KernelIOBackend(device_kv, host)
    reason = kernel_unavailable_reason(device_kv, host)
    backend: IOBackend
    if reason is None:
        backend = KernelIOBackend(device_kv, host)
        log.info("device<->host I/O backend 'auto' chose %s", backend.detail)
    else:
        backend = TorchIOBackend(device_kv, host)
        log.info(
            "device<->host I/O backend 'auto' chose %s; kernel unavailable: %s",
            backend.detail,
            reason,
        )
    return backend
