"""What the CUDA pipeline tests (``tests/gpu/``) share: KV fixtures and the CPU reference.

The reference applies SGLang's layout formulas to CPU copies, one token row at a time, so
it shares nothing with the code under test. The pools and device tensors are built with
seeded random bytes; :class:`SlowBackend` keeps the transfer stream busy before each layer
and each offload, so that "still in flight" is observable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    MemoryFacts,
    Pinning,
)
from sglang_storage.memory.layouts import bits_dtype
from sglang_storage.transfer.device_kv import DeviceKV
from sglang_storage.transfer.io import CopyPlan, IOBackend

__all__ = [
    "COMBOS",
    "COMBO_IDS",
    "SlowBackend",
    "expected_load",
    "expected_offload",
    "host_memory",
    "host_row",
    "make_device",
    "make_host",
    "randomize",
    "same_bits",
    "tensors",
    "tokens_of",
]

COMBOS = [
    (Attention.MHA, KVLayout.LAYER_FIRST),
    (Attention.MHA, KVLayout.PAGE_FIRST),
    (Attention.MHA, KVLayout.PAGE_FIRST_DIRECT),
    (Attention.MHA, KVLayout.PAGE_HEAD),
    (Attention.MLA, KVLayout.LAYER_FIRST),
    (Attention.MLA, KVLayout.PAGE_FIRST),
    (Attention.MLA, KVLayout.PAGE_FIRST_DIRECT),
]
"""Every attention x host layout SGLang has."""
COMBO_IDS = [f"{a.value}-{layout.value}" for a, layout in COMBOS]


def randomize(tensor: torch.Tensor, seed: int) -> None:
    """Fill ``tensor`` (any device) with seeded random bytes."""
    raw = tensor.view(torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator)
    raw.copy_(values.to(raw.device))


def tensors(device: DeviceKV) -> list[torch.Tensor]:
    """The device pool's per-layer tensors, K planes then V planes."""
    return [*device.k, *(device.v or ())]


def make_device(g: KVGeometry, tokens: int, seed: int, on: str = "cuda") -> DeviceKV:
    """A KV pool (on CUDA by default) of ``tokens`` rows per layer, filled with random bytes."""
    device = DeviceKV.allocate(g, tokens, on)
    for index, tensor in enumerate(tensors(device)):
        randomize(tensor, seed * 100 + index)
    return device


def host_memory(total: int, pinning: Pinning = Pinning.ALWAYS) -> HostMemory:
    """A HostMemory with a ``total``-byte budget (facts of a 64 GiB host), page-locked
    unless ``pinning`` says otherwise."""
    facts = MemoryFacts(physical=64 << 30, available=64 << 30)
    budget = HostMemoryBudget(BudgetConfig(total=total, headroom=0), facts=facts)
    return HostMemory(budget, pinning=pinning)


def make_host(g: KVGeometry, pinning: Pinning, seed: int) -> KVHostPool:
    """A host pool of every page of ``g``, all allocated, filled with random bytes."""
    host = KVHostPool(g, host_memory(256 << 20, pinning))
    randomize(host.kv_buffer, seed)
    host.alloc(g.num_pages)
    return host


def host_row(
    kv: torch.Tensor, g: KVGeometry, plane: int, layer: int, page: int, j: int
) -> torch.Tensor:
    """The host row of token ``j`` of ``page`` in ``layer`` and ``plane`` (SGLang's formulas)."""
    buffer = kv if g.is_mla else kv[plane]
    token = page * g.page_size + j
    if g.layout is KVLayout.LAYER_FIRST:
        return buffer[layer, token]
    if g.layout is KVLayout.PAGE_FIRST:
        return buffer[token, layer]
    if g.layout is KVLayout.PAGE_FIRST_DIRECT:
        return buffer[page, layer, j]
    return buffer[page, :, j, layer]


def expected_offload(
    kv: torch.Tensor, device_cpu: list[torch.Tensor], g: KVGeometry, pairs: list[tuple[int, int]]
) -> torch.Tensor:
    """The host buffer after offloading each ``(host page, device page)`` pair."""
    kv = kv.clone()
    for host_page, device_page in pairs:
        for layer in range(g.layer_num):
            for plane in range(g.kv_planes):
                rows = device_cpu[plane * g.layer_num + layer]
                for j in range(g.page_size):
                    token = device_page * g.page_size + j
                    host_row(kv, g, plane, layer, host_page, j).copy_(rows[token])
    return kv


def expected_load(
    kv: torch.Tensor, device_cpu: list[torch.Tensor], g: KVGeometry, pairs: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """The device tensors after loading each ``(host page, device page)`` pair."""
    out = [t.clone() for t in device_cpu]
    for host_page, device_page in pairs:
        for layer in range(g.layer_num):
            for plane in range(g.kv_planes):
                for j in range(g.page_size):
                    token = device_page * g.page_size + j
                    row = host_row(kv, g, plane, layer, host_page, j)
                    out[plane * g.layer_num + layer][token].copy_(row)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (NaN payloads and -0.0 included)."""
    bits = bits_dtype(a.dtype)
    return a.shape == b.shape and torch.equal(a.cpu().view(bits), b.cpu().view(bits))


def tokens_of(pages: list[int], page_size: int) -> list[int]:
    """The token rows of ``pages``."""
    return [p * page_size + j for p in pages for j in range(page_size)]


class SlowBackend(IOBackend):
    """An I/O backend that runs ``sleep`` on the transfer stream before each layer and offload.

    ``loads`` / ``offloads`` False leaves that direction at full speed.
    """

    def __init__(
        self,
        inner: IOBackend,
        sleep: Callable[[], None],
        *,
        loads: bool = True,
        offloads: bool = True,
    ) -> None:
        self.inner = inner
        self.sleep = sleep
        self.loads = loads
        self.offloads = offloads

    @property
    def name(self) -> str:
        return "slow"

    def plan(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> CopyPlan:
        return _SlowPlan(self.inner.plan(host_pages, device_pages), self)


class _SlowPlan(CopyPlan):
    def __init__(self, inner: CopyPlan, backend: SlowBackend) -> None:
        self.inner = inner
        self.backend = backend

    def load_layer(self, layer: int) -> None:
        if self.backend.loads:
            self.backend.sleep()
        self.inner.load_layer(layer)

    def offload(self) -> None:
        if self.backend.offloads:
            self.backend.sleep()
        self.inner.offload()
