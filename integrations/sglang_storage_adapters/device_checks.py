"""Build-time checks that SGLang 0.5.23's device indices fit our device<->host pipeline.

The HiCache controller adapter (:mod:`.hicache_controller`) and the decode offload
adapter (:mod:`.decode`) copy device KV by page, naming each page by its first token
divided by the page size, and they do not look at the index values per call (that
would wait for the GPU). That is only right when every run of ``page_size`` device
tokens SGLang hands them is one whole device page: ``page_size`` consecutive token slots
starting at a multiple of ``page_size``, in the device pool's own index space. These
checks refuse, when the adapter is built, every configuration where SGLang 0.5.23 can
hand out anything else:

- :func:`check_page_aligned_allocator` - with ``page_size > 1``, only the allocators
  known to hand out whole pages of ``page_size`` (:data:`PAGE_ALIGNED_ALLOCATORS`,
  matched by exact class) are accepted. SGLang's token-granular
  ``TokenToKVPoolAllocator`` hands out single slots (``1 .. n``), which a tree with
  pages of 4 would copy shifted by one. ``page_size == 1`` is always accepted: every
  slot is a whole page.
- :func:`check_dcp` - decode context parallelism (``--dcp-size`` > 1) is refused. Under
  DCP, SGLang's paged allocator hands out pages of ``page_size * dcp_size`` slots of a
  widened index space (slot ``s`` lives on DCP rank ``s % dcp_size`` at row
  ``s // dcp_size``), the tree's page is that widened page, and host pools hold
  ``page_size`` physical rows per page. Our pipeline does not translate widened slots to
  rank-local rows, so it would copy other ranks' rows.
- :func:`check_device_pools` - both, in that order (the one call the adapters make).

Under DCP, SGLang 0.5.23 builds its own HiCache stack (our stack strategy does not
match DCP), and its controller refuses ``dynamic`` storage backends, ours included, at
attach. Our storage adapter (:mod:`.hicache_storage`) is still correct for SGLang's DCP
MLA host pools when built directly: it steps host indices by the pool's
``logical_page_size``, as SGLang's controller does.
"""

from __future__ import annotations

import functools
from typing import Final

from sglang_storage.errors import ConfigError
from sglang_storage_adapters import require_supported_sglang

require_supported_sglang()

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402

__all__ = [
    "PAGE_ALIGNED_ALLOCATORS",
    "check_dcp",
    "check_device_pools",
    "check_page_aligned_allocator",
    "page_aligned_allocators",
]

_OWNER: Final = "sglang_storage device checks"

PAGE_ALIGNED_ALLOCATORS: Final = (
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator",
    "sglang.srt.hardware_backend.npu.allocator_npu.NPUPagedTokenToKVPoolAllocator",
)
"""SGLang 0.5.23's allocators that hand out whole pages of their ``page_size`` only.

``PagedTokenToKVPoolAllocator`` (``alloc``, ``alloc_extend`` and ``alloc_decode`` take
free pages and return ``page * page_size + offset``) and its NPU subclass, which keeps
that allocation. Its other subclass, ``PageInterleavePoolAllocator``, hands out slots of
an index space widened over a shard group and is not accepted; nor are the token,
SWA, HiSparse, Mamba or unified allocators, whose slots are single tokens or indices
that the device pool translates.
"""


@functools.cache
def page_aligned_allocators() -> tuple[type, ...]:
    """The classes of :data:`PAGE_ALIGNED_ALLOCATORS` that import here."""
    classes: list[type] = [PagedTokenToKVPoolAllocator]
    try:
        from sglang.srt.hardware_backend.npu.allocator_npu import (
            NPUPagedTokenToKVPoolAllocator,
        )
    except ImportError:  # not importable here, so not the allocator in use either
        pass
    else:
        classes.append(NPUPagedTokenToKVPoolAllocator)
    return tuple(classes)


def check_page_aligned_allocator(allocator: object, page_size: int, *, owner: str = _OWNER) -> None:
    """Refuse a device allocator that can hand out runs not aligned to ``page_size``.

    Accepted: any allocator when ``page_size`` is 1; otherwise an allocator whose exact
    class is in :data:`PAGE_ALIGNED_ALLOCATORS` and whose own ``page_size`` is
    ``page_size``.

    Args:
        allocator: SGLang's ``token_to_kv_pool_allocator``.
        page_size: The page size the adapter copies device KV in (the tree's).
        owner: The adapter named in errors.

    Raises:
        ConfigError: ``page_size`` is below 1, or the allocator's class is not known to
            hand out whole pages, or its pages are another size (the message names the
            class and both page sizes).
    """
    if page_size < 1:
        raise ConfigError(
            owner=owner, field="page_size", value=page_size, reason="must be at least 1"
        )
    if page_size == 1:
        return
    cls = type(allocator)
    if cls not in page_aligned_allocators():
        raise ConfigError(
            owner=owner,
            field="token_to_kv_pool_allocator",
            value=f"{cls.__name__} at page_size={page_size}",
            reason=(
                f"can hand out device token slots that are not whole pages of {page_size}, "
                "and the sglang_storage device<->host copies name each page by its first "
                "token (wrong KV would be copied); use SGLang's paged allocator, or "
                "page_size 1"
            ),
            allowed=", ".join(PAGE_ALIGNED_ALLOCATORS) + " (exact classes); any at page_size=1",
        )
    own = getattr(allocator, "page_size", None)
    if own != page_size:
        raise ConfigError(
            owner=owner,
            field="token_to_kv_pool_allocator.page_size",
            value=own,
            reason=(
                f"must be the adapter's page size ({page_size}): {cls.__name__} hands out "
                "whole pages of its own size only"
            ),
            allowed=str(page_size),
        )


def _runtime_dcp_size() -> int:
    """``attn_dcp_size`` of this process, or 1 when SGLang has published no parallel state."""
    from sglang.srt.runtime_context import get_parallel

    try:
        size = get_parallel().attn_dcp_size
    except (RuntimeError, ValueError, AttributeError):  # nothing published: not a server rank
        return 1
    return int(size)


_DCP_REASON: Final = (
    "decode context parallelism is not supported by the sglang_storage device<->host "
    "copies: its device slots are widened (slot s is row s // dcp_size on DCP rank "
    "s % dcp_size), and the copies would read and write other ranks' rows"
)
_DCP_ALLOWED: Final = (
    "1 (run without --dcp-size, or without sglang_storage's kv and decode managers)"
)


def check_dcp(allocator: object, *, host_pool: object = None, owner: str = _OWNER) -> None:
    """Refuse decode context parallelism (DCP > 1) for an adapter copying device KV.

    DCP is recognised from any of: SGLang's published ``attn_dcp_size``; an allocator
    whose pages are larger than its device pool's (SGLang's DCP paged allocator widens
    its page by ``dcp_size``); a host pool built with ``dcp_size > 1``. A smaller
    allocator page is :func:`check_page_aligned_allocator`'s to judge.

    Args:
        allocator: SGLang's ``token_to_kv_pool_allocator``; ``get_kvcache()`` is its
            device pool.
        host_pool: The adapter's host KV pool, when it is an SGLang ``HostKVCache``.
        owner: The adapter named in errors.

    Raises:
        ConfigError: DCP is on, or the allocator's pages are larger than the device pool's.
    """
    size = _runtime_dcp_size()
    if size > 1:
        raise ConfigError(
            owner=owner,
            field="dcp_size",
            value=size,
            reason=_DCP_REASON,
            allowed=_DCP_ALLOWED,
        )
    host_dcp = int(getattr(host_pool, "dcp_size", 1) or 1)
    if host_dcp > 1:
        raise ConfigError(
            owner=owner,
            field="host pool dcp_size",
            value=host_dcp,
            reason=_DCP_REASON,
            allowed=_DCP_ALLOWED,
        )
    get_kvcache = getattr(allocator, "get_kvcache", None)
    device_pool = get_kvcache() if callable(get_kvcache) else None
    device_page = getattr(device_pool, "page_size", None)
    allocator_page = getattr(allocator, "page_size", None)
    if (
        isinstance(device_page, int)
        and isinstance(allocator_page, int)
        and allocator_page > device_page
    ):
        raise ConfigError(
            owner=owner,
            field="token_to_kv_pool_allocator.page_size",
            value=allocator_page,
            reason=(
                f"must not exceed the device KV pool's page size ({device_page}): a larger "
                f"allocator page is SGLang's DCP layout ({type(allocator).__name__} over "
                f"{type(device_pool).__name__}); " + _DCP_REASON
            ),
            allowed=f"at most {device_page}",
        )


def check_device_pools(
    allocator: object, page_size: int, *, host_pool: object = None, owner: str = _OWNER
) -> None:
    """Refuse device indices an adapter would copy wrongly (DCP, unaligned allocators).

    Runs :func:`check_dcp`, then :func:`check_page_aligned_allocator`.

    Raises:
        ConfigError: see those two functions.
    """
    check_dcp(allocator, host_pool=host_pool, owner=owner)
    check_page_aligned_allocator(allocator, page_size, owner=owner)
