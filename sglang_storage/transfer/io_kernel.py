"""The ``kernel`` I/O backend: SGLang's AOT transfer kernels (``sgl_kernel.kvcacheio``).

The kernels are the ones SGLang 0.5.23's host pools call for each layout
(``pool_host/mha.py`` / ``mla.py``, ``io_backend="kernel"``), with the same arguments:

- ``layer_first``: load ``transfer_kv_per_layer[_mla]``, offload
  ``transfer_kv_all_layer[_mla]``;
- ``page_first``: ``transfer_kv_per_layer[_mla]_pf_lf``, ``transfer_kv_all_layer[_mla]_lf_pf``;
- ``page_head`` (MHA only): ``transfer_kv_per_layer_ph_lf``, ``transfer_kv_all_layer_lf_ph``;
- ``page_first_direct``: ``transfer_kv_per_layer_direct_pf_lf``,
  ``transfer_kv_all_layer_direct_lf_pf``.

Loads run per layer (H2D), offloads all layers at once (D2H). ``page_first_direct`` uses
SGLang's ``direct`` ops (one page-sized ``copy_`` each), as SGLang does for that layout.
The kernels read and write page-locked host memory in place from the device, so they need
CUDA, a page-locked host pool and rows whose byte size is a multiple of 8;
:func:`kernel_unavailable_reason` lists whatever is missing.
``sgl_kernel`` is a separate package from SGLang and is imported only when the backend is
asked for; it is never needed on CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Final

import torch

from sglang_storage.errors import BackendUnavailableError
from sglang_storage.memory import KVHostPool, KVLayout
from sglang_storage.transfer.device_kv import DeviceKV
from sglang_storage.transfer.io import CopyPlan, IOBackend, token_indices, upload_index

__all__ = ["KERNEL_MODULES", "KernelIOBackend", "kernel_unavailable_reason"]

KERNEL_MODULES: Final = ("sgl_kernel.kvcacheio", "sglang_kernel.kvcacheio")
"""Where SGLang's AOT transfer kernels are looked for, in order."""


# The kvcacheio ops SGLang 0.5.23's host pools call, per (MLA?, layout): (load, offload).
_KERNEL_OPS: Final[dict[tuple[bool, KVLayout], tuple[str, str]]] = {
    (False, KVLayout.LAYER_FIRST): ("transfer_kv_per_layer", "transfer_kv_all_layer"),
    (False, KVLayout.PAGE_FIRST): ("transfer_kv_per_layer_pf_lf", "transfer_kv_all_layer_lf_pf"),
    (False, KVLayout.PAGE_HEAD): ("transfer_kv_per_layer_ph_lf", "transfer_kv_all_layer_lf_ph"),
    (False, KVLayout.PAGE_FIRST_DIRECT): (
        "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_all_layer_direct_lf_pf",
    ),
    (True, KVLayout.LAYER_FIRST): ("transfer_kv_per_layer_mla", "transfer_kv_all_layer_mla"),
    (True, KVLayout.PAGE_FIRST): (
        "transfer_kv_per_layer_mla_pf_lf",
        "transfer_kv_all_layer_mla_lf_pf",
    ),
    (True, KVLayout.PAGE_FIRST_DIRECT): (
        "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_all_layer_direct_lf_pf",
    ),
}


def _find_kernel_module() -> tuple[ModuleType | None, str]:
    """The first kvcacheio module that imports, or None and why none did."""
    problems = []
    for name in KERNEL_MODULES:
        package = name.partition(".")[0]
        if importlib.util.find_spec(package) is None:
            problems.append(f"{package} is not installed")
            continue
        try:
            return importlib.import_module(name), ""
        except (ImportError, OSError, RuntimeError) as error:
            problems.append(f"{name} does not import ({error})")
    return None, "; ".join(problems)


def kernel_unavailable_reason(device_kv: DeviceKV, host: KVHostPool) -> str | None:
    """Why :class:`KernelIOBackend` cannot move pages between these pools, or None.

    Lists every missing piece: CUDA, a CUDA device pool, page-locked host memory, row
    sizes the kernels can copy, and the ``sgl_kernel`` package with the layout's ops.
    """
    g = host.geometry
    reasons = []
    cuda = torch.cuda.is_available()
    if not cuda:
        reasons.append(
            f"CUDA is not available (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'})"
        )
    elif torch.version.hip is not None:
        reasons.append("ROCm is not supported (host pointers need a device mapping there)")
    if device_kv.device.type != "cuda":
        reasons.append(f"the device pool is on {device_kv.device}, not a CUDA device")
    if not host.page_locked:
        reasons.append(f"{host.label} is not page-locked (the kernels read host memory in place)")
    if g.row_bytes % 8:
        reasons.append(f"a token row is {g.row_bytes} bytes; the kernels copy multiples of 8")
    elif g.layout is KVLayout.PAGE_HEAD and (g.row_bytes // g.head_num) % 8:
        reasons.append(
            f"a head row is {g.row_bytes // g.head_num} bytes; page_head copies multiples of 8"
        )
    if not cuda:
        # Importing the CUDA-only package without CUDA can fail in odd ways; only look.
        if all(importlib.util.find_spec(m.partition(".")[0]) is None for m in KERNEL_MODULES):
            reasons.append(f"none of {', '.join(KERNEL_MODULES)} is installed")
    else:
        module, problem = _find_kernel_module()
        if module is None:
            reasons.append(problem)
        else:
            missing = [op for op in _KERNEL_OPS[(g.is_mla, g.layout)] if not hasattr(module, op)]
            if missing:
                reasons.append(f"{module.__name__} lacks {', '.join(missing)}")
    return "; ".join(reasons) or None


class KernelIOBackend(IOBackend):
    """Copies with SGLang's ``sgl_kernel.kvcacheio`` kernels; see the module contract.

    Args:
        device_kv: The device pool (CUDA).
        host: The host pool (page-locked); its geometry must match ``device_kv.geometry``.

    Raises:
        ConfigError: the pools' geometries do not match.
        BackendUnavailableError: the kernels cannot run here; the reason lists why.
    """

    def __init__(self, device_kv: DeviceKV, host: KVHostPool) -> None:
        device_kv.require_compatible(host)
        reason = kernel_unavailable_reason(device_kv, host)
        if reason is not None:
            raise BackendUnavailableError(backend="kernel", reason=reason)
        module, _ = _find_kernel_module()
        assert module is not None  # checked by kernel_unavailable_reason
        g = host.geometry
        load_op, offload_op = _KERNEL_OPS[(g.is_mla, g.layout)]
        self._module_name = module.__name__
        self._load_op: Callable[..., object] = getattr(module, load_op)
        self._offload_op: Callable[..., object] = getattr(module, offload_op)
        self._g = g
        self._device_kv = device_kv
        self._device = device_kv.device
        kv = host.kv_buffer
        # Host planes as SGLang's pools hold them: k_buffer / v_buffer, or the MLA buffer.
        self._host_planes: list[torch.Tensor] = [kv] if g.is_mla else [kv[0], kv[1]]
        self._direct = g.layout is KVLayout.PAGE_FIRST_DIRECT
        self._item_size = g.row_bytes
        self._layout_dim = g.row_bytes * g.layer_num

        def table(tensors: list[torch.Tensor]) -> torch.Tensor:
            pointers = [t.data_ptr() for t in tensors]
            return torch.tensor(pointers, dtype=torch.uint64, device=self._device)

        self._device_tables = [table(list(p)) for p in self._device_planes()]
        self._host_tables = (
            [table([plane[layer] for layer in range(g.layer_num)]) for plane in self._host_planes]
            if g.layout is KVLayout.LAYER_FIRST
            else []
        )

    def _device_planes(self) -> list[tuple[torch.Tensor, ...]]:
        kv = self._device_kv
        return [kv.k] if kv.v is None else [kv.k, kv.v]

    @property
    def name(self) -> str:
        """``"kernel"``."""
        return "kernel"

    @property
    def detail(self) -> str:
        """The module and ops in use."""
        return f"kernel ({self._module_name}, {self._g.layout.value})"

    def plan(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> CopyPlan:
        """Token indices on the device (CPU for the direct ``page_first_direct`` ops)."""
        ps = self._g.page_size
        host_tokens = token_indices(host_pages, ps)
        device_tokens = token_indices(device_pages, ps)
        if self._direct:
            device_tokens = device_tokens.cpu()  # the direct ops take host indices (a sync)
        else:
            host_tokens = upload_index(host_tokens, self._device)
            device_tokens = upload_index(device_tokens, self._device)
        return _KernelPlan(self, host_tokens, device_tokens)

    def _load_layer(self, layer: int, host_tokens: torch.Tensor, dev_tokens: torch.Tensor) -> None:
        g, op = self._g, self._load_op
        device = self._device_kv.planes(layer)
        host = self._host_planes
        common = {"src_indices": host_tokens, "dst_indices": dev_tokens}
        if self._direct:
            op(
                src_ptrs=host,
                dst_ptrs=list(device),
                layer_id=layer,
                page_size=g.page_size,
                **common,
            )
        elif g.is_mla:
            if g.layout is KVLayout.LAYER_FIRST:
                op(src=host[0][layer], dst=device[0], item_size=self._item_size, **common)
            else:
                op(
                    src=host[0],
                    dst=device[0],
                    layer_id=layer,
                    item_size=self._item_size,
                    src_layout_dim=self._layout_dim,
                    **common,
                )
        elif g.layout is KVLayout.LAYER_FIRST:
            op(
                src_k=host[0][layer],
                dst_k=device[0],
                src_v=host[1][layer],
                dst_v=device[1],
                item_size=self._item_size,
                **common,
            )
        else:
            extra = (
                {"page_size": g.page_size, "head_num": g.head_num}
                if g.layout is KVLayout.PAGE_HEAD
                else {}
            )
            op(
                src_k=host[0],
                dst_k=device[0],
                src_v=host[1],
                dst_v=device[1],
                layer_id=layer,
                item_size=self._item_size,
                src_layout_dim=self._layout_dim,
                **common,
                **extra,
            )

    def _offload(self, host_tokens: torch.Tensor, dev_tokens: torch.Tensor) -> None:
        g, op = self._g, self._offload_op
        host = self._host_planes
        dev = self._device_tables
        common = {"src_indices": dev_tokens, "dst_indices": host_tokens}
        if self._direct:
            sources = [t for plane in self._device_planes() for t in plane]
            op(src_ptrs=sources, dst_ptrs=host, page_size=g.page_size, **common)
        elif g.is_mla:
            if g.layout is KVLayout.LAYER_FIRST:
                op(
                    src_layers=dev[0],
                    dst_layers=self._host_tables[0],
                    item_size=self._item_size,
                    num_layers=g.layer_num,
                    **common,
                )
            else:
                op(
                    src_layers=dev[0],
                    dst=host[0],
                    item_size=self._item_size,
                    dst_layout_dim=self._layout_dim,
                    num_layers=g.layer_num,
                    **common,
                )
        elif g.layout is KVLayout.LAYER_FIRST:
            op(
                src_k_layers=dev[0],
                dst_k_layers=self._host_tables[0],
                src_v_layers=dev[1],
                dst_v_layers=self._host_tables[1],
                item_size=self._item_size,
                num_layers=g.layer_num,
                **common,
            )
        else:
            extra = (
                {"page_size": g.page_size, "head_num": g.head_num}
                if g.layout is KVLayout.PAGE_HEAD
                else {}
            )
            op(
                src_k_layers=dev[0],
                dst_k=host[0],
                src_v_layers=dev[1],
                dst_v=host[1],
                item_size=self._item_size,
                dst_layout_dim=self._layout_dim,
                num_layers=g.layer_num,
                **common,
                **extra,
            )


class _KernelPlan(CopyPlan):
    def __init__(
        self, backend: KernelIOBackend, host_tokens: torch.Tensor, device_tokens: torch.Tensor
    ) -> None:
        self._backend = backend
        self._host_tokens = host_tokens
        self._device_tokens = device_tokens

    def load_layer(self, layer: int) -> None:
        self._backend._load_layer(layer, self._host_tokens, self._device_tokens)

    def offload(self) -> None:
        self._backend._offload(self._host_tokens, self._device_tokens)
