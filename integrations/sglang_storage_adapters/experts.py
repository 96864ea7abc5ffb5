"""SGLang 0.5.23's paged-experts host store in sglang_storage's host memory budget.

With ``--enable-paged-experts`` each MoE layer keeps K of its E routed experts in GPU slots
and pages the rest from a host copy of every expert, SGLang's ``HostExpertStore``
(``srt/layers/moe/paged_experts/store.py``): one ``[E, *row]`` tensor per paged weight
tensor, ``torch.empty(..., pin_memory=pin)`` outside any budget. Across layers that is the
model's whole routed-expert weight, the largest host allocation SGLang makes.

:class:`StorageHostExpertStore` replaces the class (HookRegistry REPLACE; SGLang imports
it by name in ``method.py`` and ``formats.py``, and the registry rebinds those names): the
same constructor, ``host``, ``pin``, ``page_in``, ``bind_device_gather`` and ``gather``,
with every ``host[name]`` the records of a :class:`~sglang_storage.memory.RecordPool`
(one record per expert) drawn from the process's one budget (component ``experts``,
charged to the ``weight`` kind). Page-locked where CUDA exists (the runtime's allocator
registers the memory, whatever ``pin`` asks: SGLang's pageable staging store of a repack
is then locked too, which costs a registration and nothing else); refused at start-up when
the budget cannot hold it. A store SGLang drops (the staged store a repack replaces) gives
its memory back to the budget.

Without sglang_storage settings naming ``experts`` in ``--storage-managers``, constructing
the class builds SGLang's own store.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any, Final

import torch

from sglang_storage.core import DataKind
from sglang_storage.errors import ConfigError
from sglang_storage.memory import RecordPool, RecordPoolConfig
from sglang_storage.memory.layouts import ELEMENT_DTYPES
from sglang_storage_adapters import require_supported_sglang
from sglang_storage_adapters.plugin import hook_registry
from sglang_storage_adapters.runtime import RuntimeSettings, process_runtime, runtime_settings

require_supported_sglang()

# After the version check: this module exists with this name in 0.5.23 only.
from sglang.srt.layers.moe.paged_experts.store import HostExpertStore  # noqa: E402

__all__ = ["TARGET", "StorageHostExpertStore", "install"]

log = logging.getLogger(__name__)

TARGET: Final = "sglang.srt.layers.moe.paged_experts.store.HostExpertStore"
"""The class :func:`install` replaces."""

_OWNER: Final = "sglang_storage paged-experts host store"
COMPONENT: Final = "experts"
"""The runtime component (and ``--storage-managers`` name) the store draws memory as."""


def _settings() -> RuntimeSettings | None:
    """This process's sglang_storage settings, or ``None`` (none published, or not on)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return runtime_settings(get_server_args())
    except (RuntimeError, ValueError):  # no server arguments published in this process
        return None


def _close(pools: list[RecordPool]) -> None:
    for pool in pools:
        pool.close()


class StorageHostExpertStore(HostExpertStore):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's ``HostExpertStore`` with every expert row in a budgeted :class:`RecordPool`.

    Constructed as SGLang constructs its store; see the module docstring.

    Raises:
        CapacityError: the host memory budget cannot hold the experts.
        ConfigError: a paged tensor's element type or shape has no record pool.
    """

    pools: list[RecordPool]
    """The record pools behind ``host`` (one per paged tensor with a non-empty row)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """This store when sglang_storage serves ``experts``, else SGLang's own."""
        settings = _settings()
        if cls is StorageHostExpertStore and (settings is None or not settings.enabled(COMPONENT)):
            # SGLang's class through the base (HookRegistry rebinds every other name).
            original: Any = object.__new__(StorageHostExpertStore.__bases__[0])
            original.__init__(*args, **kwargs)
            return original
        return object.__new__(cls)

    def __init__(self, layer: Any, names: Sequence[str], num_experts: int, pin: bool = True):
        settings = _settings()
        if settings is None:
            raise ConfigError(
                owner=_OWNER,
                field="settings",
                reason="no sglang_storage settings are published in this process",
                allowed="--storage-backend with --storage-managers including experts",
            )
        self._memory = process_runtime(settings).host_memory(COMPONENT)
        self.pools = []
        try:
            super().__init__(layer, names, num_experts, pin=pin)
        except BaseException:
            _close(self.pools)
            raise
        weakref.finalize(self, _close, list(self.pools))
        log.info(
            "sglang_storage paged experts: %d experts x %d tensors, %d bytes in the budget%s",
            num_experts,
            len(self.pools),
            sum(p.config.capacity * p.config.record_bytes for p in self.pools),
            " (page-locked)" if any(p.page_locked for p in self.pools) else "",
        )

    def _alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """``[E, *row]`` of ``dtype`` in a record pool (one record per expert)."""
        experts, row = int(shape[0]), tuple(int(d) for d in shape[1:])
        if experts < 1:
            raise ConfigError(
                owner=_OWNER, field="num_experts", value=experts, reason="must be >= 1"
            )
        if any(d == 0 for d in row):  # e.g. GPTQ without act-order: empty g_idx rows
            return torch.empty((experts, *row), dtype=dtype)
        stored, stored_row = dtype, row or (1,)
        if dtype not in ELEMENT_DTYPES:  # e.g. float8_e8m0fnu scales: held as bytes
            stored, stored_row = torch.uint8, (*stored_row[:-1], stored_row[-1] * dtype.itemsize)
        config = RecordPoolConfig(
            shape=stored_row,
            dtype=stored,
            capacity=experts,
            kind=DataKind.WEIGHT,
            label=f"paged experts {tuple(shape)} {dtype}",
        )
        pool = RecordPool(config, self._memory)
        self.pools.append(pool)
        records = pool.records
        if stored is not dtype:
            records = records.view(dtype)
        return records.reshape(experts, *row)


def install(registry: Any = None) -> None:
    """Register :class:`StorageHostExpertStore` as SGLang's paged-experts host store.

    Call from the ``sglang.srt.plugins`` entry point (SGLang applies the hooks after the
    plug-ins ran). ``registry`` defaults to SGLang's ``HookRegistry``.
    """
    registry, hook_type = hook_registry(registry)
    registry.register(TARGET, StorageHostExpertStore, hook_type.REPLACE)
