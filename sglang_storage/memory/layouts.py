"""KV host layouts, byte for byte the ones SGLang 0.5.23's host pools use.

SGLang's ``MHATokenToKVPoolHost.init_kv_buffer`` (``pool_host/mha.py``) and
``MLATokenToKVPoolHost.init_kv_buffer`` (``pool_host/mla.py``) shape the host buffer as
below, where ``size = num_pages * page_size`` tokens, ``L`` layers, ``H`` heads and ``D``
the head dimension (for MLA, ``D`` is the compressed KV width and there is no K/V axis):

=====================  =================================  ==============================
layout                 MHA buffer                         MLA buffer
=====================  =================================  ==============================
``layer_first``        ``(2, L, size, H, D)``             ``(L, size, 1, D)``
``page_first``         ``(2, size, L, H, D)``             ``(size, L, 1, D)``
``page_first_direct``  ``(2, pages, L, page, H, D)``      ``(pages, L, page, 1, D)``
``page_head``          ``(2, pages, H, page, L, D)``      (not defined for MLA)
=====================  =================================  ==============================

A *page* in storage is the flattened slice SGLang's ``get_data_page(index, flat=True)``
returns: the page's tokens across every layer (and K and V), in the order of the layout's
axes. So a page stored from a ``page_first`` pool reads back correctly into a
``page_first`` pool of either implementation. :class:`KVGeometry` computes all of it.
"""

from __future__ import annotations

import enum
from typing import Any, Final

import attrs
import torch

from sglang_storage.config import Validator, instance_of, positive_int
from sglang_storage.errors import ConfigError

__all__ = [
    "ELEMENT_DTYPES",
    "KV_DTYPES",
    "Attention",
    "KVGeometry",
    "KVLayout",
    "bits_dtype",
    "dtype_in",
]


class KVLayout(enum.Enum):
    """How a KV host buffer orders pages, layers, tokens and heads."""

    LAYER_FIRST = "layer_first"
    """Per layer, all tokens: the device pool's order (``direct`` and ``kernel`` I/O)."""
    PAGE_FIRST = "page_first"
    """Per token, all layers: one contiguous run of bytes per page and K/V."""
    PAGE_FIRST_DIRECT = "page_first_direct"
    """Per page, per layer, the page's tokens: contiguous pages, layer-contiguous rows."""
    PAGE_HEAD = "page_head"
    """Per page, per head: lets ranks with fewer heads read a slice of a page (MHA only)."""


class Attention(enum.Enum):
    """The attention kind a KV pool stores."""

    MHA = "mha"
    """Separate K and V per head (MHA, GQA, MQA)."""
    MLA = "mla"
    """One compressed latent row per token (DeepSeek MLA); shared by every TP rank."""


KV_DTYPES: Final[tuple[torch.dtype, ...]] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.uint8,
    torch.int8,
)
"""Element types a KV pool accepts (SGLang keeps some fp8 caches as uint8)."""


_BITS: Final[dict[int, torch.dtype]] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer type of ``dtype``'s size, for moving its bits where ``dtype`` has no kernel.

    CPU ``index_copy_`` has no fp8 kernel; copying the same bits as integers is exact.
    """
    return _BITS[dtype.itemsize]


ELEMENT_DTYPES: Final[tuple[torch.dtype, ...]] = (
    torch.float64,
    *KV_DTYPES,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
"""Element types any pool can hold: those whose bits an integer of the same size carries."""


def dtype_in(allowed: tuple[torch.dtype, ...], *, what: str) -> Validator:
    """An attrs validator: the value must be one of ``allowed`` (``what`` names the rule)."""
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in allowed:
            raise ConfigError(
                owner=type(instance).__name__,
                field=attribute.name,
                value=value,
                reason=f"is not {what}",
                allowed=names,
            )

    return check


@attrs.frozen(kw_only=True)
class KVGeometry:
    """The shape of a KV host pool: attention kind, layout, element type and sizes.

    For MLA, ``head_num`` must be 1 and ``head_dim`` is the latent width
    (``kv_lora_rank + qk_rope_head_dim``).
    """

    attention: Attention = attrs.field(validator=instance_of(Attention))
    layout: KVLayout = attrs.field(validator=instance_of(KVLayout))
    dtype: torch.dtype = attrs.field(validator=dtype_in(KV_DTYPES, what="a KV cache element type"))
    layer_num: int = attrs.field(validator=positive_int)
    page_size: int = attrs.field(validator=positive_int)
    """Tokens per page."""
    num_pages: int = attrs.field(validator=positive_int)
    head_num: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)

    def __attrs_post_init__(self) -> None:
        if self.attention is Attention.MLA:
            if self.layout is KVLayout.PAGE_HEAD:
                raise ConfigError(
                    owner="KVGeometry",
                    field="layout",
                    value=self.layout.value,
                    reason="is not defined for MLA (SGLang has no MLA page_head pool)",
                    allowed="layer_first, page_first, page_first_direct",
                )
            if self.head_num != 1:
                raise ConfigError(
                    owner="KVGeometry",
                    field="head_num",
                    value=self.head_num,
                    reason="must be 1 for MLA (head_dim is the latent width)",
                )

    # ------------------------------------------------------------------ sizes

    @property
    def is_mla(self) -> bool:
        """Whether this is an MLA pool (no K/V axis)."""
        return self.attention is Attention.MLA

    @property
    def kv_planes(self) -> int:
        """2 for MHA (K and V), 1 for MLA."""
        return 1 if self.is_mla else 2

    @property
    def size(self) -> int:
        """Capacity in tokens."""
        return self.num_pages * self.page_size

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one layer in one plane (K or V): ``H * D * itemsize``."""
        return self.head_num * self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token across all layers and planes (SGLang's ``size_per_token``)."""
        return self.kv_planes * self.layer_num * self.row_bytes

    @property
    def page_numel(self) -> int:
        """Elements in one page."""
        return self.kv_planes * self.layer_num * self.page_size * self.head_num * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes in one page."""
        return self.page_numel * self.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole buffer."""
        return self.num_pages * self.page_bytes

    # ------------------------------------------------------------------ shapes

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        """The host buffer's shape, as SGLang's ``init_kv_buffer`` makes it."""
        planes = () if self.is_mla else (2,)
        pages, page, size = self.num_pages, self.page_size, self.size
        layers, heads, dim = self.layer_num, self.head_num, self.head_dim
        if self.layout is KVLayout.LAYER_FIRST:
            return (*planes, layers, size, heads, dim)
        if self.layout is KVLayout.PAGE_FIRST:
            return (*planes, size, layers, heads, dim)
        if self.layout is KVLayout.PAGE_FIRST_DIRECT:
            return (*planes, pages, layers, page, heads, dim)
        return (*planes, pages, heads, page, layers, dim)

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page's shape in this layout (SGLang's ``get_data_page(flat=False)``)."""
        planes = () if self.is_mla else (2,)
        page, layers, heads, dim = self.page_size, self.layer_num, self.head_num, self.head_dim
        if self.layout is KVLayout.LAYER_FIRST:
            return (*planes, layers, page, heads, dim)
        if self.layout is KVLayout.PAGE_FIRST:
            return (*planes, page, layers, heads, dim)
        if self.layout is KVLayout.PAGE_FIRST_DIRECT:
            return (*planes, 1, layers, page, heads, dim)
        return (*planes, 1, heads, page, layers, dim)

    @property
    def pages_contiguous(self) -> bool:
        """Whether each page is one contiguous run of bytes per plane."""
        return self.layout is not KVLayout.LAYER_FIRST

    def token_indices(self, pages: torch.Tensor) -> torch.Tensor:
        """SGLang's token indices for ``pages``: each page's ``page_size`` tokens in order."""
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages.to(torch.int64).unsqueeze(1) * self.page_size + offsets).flatten()

    def pages_of_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The page of each page-start token index (SGLang hands pools page-aligned tokens).

        Raises:
            ConfigError: an index is not the first token of a page.
        """
        tokens = tokens.to(torch.int64)
        misaligned = tokens % self.page_size != 0
        if bool(misaligned.any()):
            raise ConfigError(
                owner="KVGeometry.pages_of_tokens",
                field="tokens",
                value=tokens[misaligned][:8].tolist(),
                reason=f"must be multiples of page_size ({self.page_size})",
            )
        return tokens // self.page_size
