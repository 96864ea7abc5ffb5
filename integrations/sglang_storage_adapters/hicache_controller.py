"""SGLang 0.5.23's HiCache controller and KV host pool on sglang_storage's memory and pipelines.

SGLang's tree (``UnifiedRadixCache``) and scheduler speak to their controller through a
queue-shaped contract (map section 2.4): ``write``/``load`` return host or device indices,
acknowledgements arrive in ``ack_write_queue``/``ack_load_queue`` as events the tree polls,
and the tree calls private methods (``_move_write_operation``, ``_l2_transfers``, ...). This
module keeps that contract byte for byte by subclassing SGLang's own classes, and swaps
what is underneath:

- :class:`StorageMHAHostPool` / :class:`StorageMLAHostPool` - SGLang's ``HostKVCache``
  surface (``alloc``/``free``/``available_size``/``clear`` in token indices, the page API
  SGLang's storage backends use) over our :class:`~sglang_storage.memory.KVHostPool`: the
  buffer comes from our host memory budget (page-locked where CUDA exists, refused at
  start-up when the host cannot hold it) and pages are allocated by our slot allocator,
  which refuses to free a page a transfer still uses.
- :class:`PipelineTransferEngine` - SGLang's ``L2TransferEngine`` contract
  (``submit_device_to_host``/``submit_host_to_device`` returning a ``TransferCompletion``
  of events) over our :class:`~sglang_storage.transfer.DeviceHostPipeline`: the ``torch``
  I/O backend on CPU (where SGLang's own copies need ``sgl_kernel`` and cannot run) and the
  ``kernel`` backend where it can.
- :class:`StorageCacheController` - a ``HybridCacheController`` whose device<->host
  engine and host pool are the two above and whose storage tier (hit queries, prefetch
  reads, backups, rank agreement) is our index-addressed
  :class:`~sglang_storage.managers.controller.CacheController`, with none of SGLang's
  storage threads: ``prefetch`` starts the core's hit query, the tree's
  ``prefetch_hit_queue`` / ``ack_prefetch_queue`` / ``ack_backup_queue`` are filled from
  the core's ``poll()`` whenever the tree looks at them (``qsize``/``empty``), a prefetch
  the tree puts into ``prefetch_buffer`` starts reading at once, and the ranks agree on
  hits and read progress through a bounded :class:`~sglang_storage.managers.ranks.StoreRankSync`
  (:func:`rank_sync`), so a stalled rank is a miss on every rank, never a hang. The
  tree's stop policies, host allocation and its own scheduler-thread collectives stay
  SGLang's. A backend attached at run time that is not ours gets SGLang's own threads.
- :class:`StorageStackStrategy` - installs all of it through SGLang's own seam
  ``register_stack_strategy`` (see :mod:`.plugin`): it matches plain MHA/MLA KV caches
  only when :func:`~.runtime.runtime_settings` says the ``kv`` manager is on, and otherwise
  leaves SGLang's own strategy to build SGLang's own stack.

What stays SGLang's: the tree and its index bookkeeping (which host token slots hold which
node), which the core takes as given (host pages named by the tree's indices).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from sglang_storage.errors import CapacityError, ConfigError, StorageError
from sglang_storage.managers import observability
from sglang_storage.managers.controller import (
    CacheController,
    ControllerConfig,
    ControllerEvent,
    HitQueryDone,
    ReadProgress,
)
from sglang_storage.managers.logs import RateLimitedLog
from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
)
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceTransferConfig,
    DeviceTransferHandle,
    DeviceTransferResult,
    StoragePipeline,
)
from sglang_storage.transfer.device_kv import DeviceKV
from sglang_storage_adapters import require_supported_sglang
from sglang_storage_adapters.capture_rows import CaptureRows, capture_rows
from sglang_storage_adapters.device_checks import check_device_pools
from sglang_storage_adapters.flags import host_pool_size
from sglang_storage_adapters.hicache_storage import HiCacheBackend
from sglang_storage_adapters.ranks import rank_sync
from sglang_storage_adapters.runtime import runtime_settings

require_supported_sglang()

# After the version check: these modules exist with these names in 0.5.23 only.
from sglang.srt.managers.cache_controller import PrefetchAck  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.l2_transfer import TransferCompletion  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import (  # noqa: E402
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.utils import get_device_module  # noqa: E402

__all__ = [
    "PipelineTransferEngine",
    "StorageCacheController",
    "StorageHostPool",
    "StorageMHAHostPool",
    "StorageMLAHostPool",
    "StorageStackStrategy",
    "build_host_pool",
    "device_kv",
    "install",
]

log = logging.getLogger(__name__)
_limited: Final = RateLimitedLog(log)

_OWNER: Final = "sglang_storage HiCache controller"
_LAYOUTS: Final = {layout.value: layout for layout in KVLayout}
_device_module: Any = get_device_module()


# ---------------------------------------------------------------------- host pools


class StorageHostPool:
    """SGLang's ``HostKVCache`` allocation surface over our :class:`KVHostPool`.

    Mixed into SGLang's own MHA/MLA host pool classes (their page API, layouts and
    attributes are kept); only where the bytes live and who allocates pages change.
    Token indices SGLang sees are ``page * page_size + offset``.
    """

    storage_pool: KVHostPool
    """Our pool: the buffer and the page allocator."""

    # Attributes SGLang's HostKVCache sets; declared for the type checker.
    page_size: int
    page_num: int
    size: int
    layer_num: int
    layout: str
    dtype: torch.dtype
    lock: Any
    kv_buffer: torch.Tensor
    fd: Any
    before_free: Callable[[], None] | None = None
    """Called before pages are freed (the controller collects finished transfers)."""
    after_free: Callable[[torch.Tensor], None] | None = None
    """Called with the page numbers just freed."""
    rows_memory: HostMemory | None = None
    """Where captured rows kept with the pages are charged (None: a budget of their own)."""
    side_rows: tuple[CaptureRows, ...] = ()
    """Captured rows kept with the pages (closed with the pool)."""

    def _geometry(self) -> KVGeometry:
        raise NotImplementedError

    def _allocate_host_buffer(self) -> None:
        # Replaces SGLang's: its budget check and cudaHostRegister become ours.
        from sglang.srt.mem_cache.pool_host.base import ranks_per_host
        from sglang.srt.runtime_context import get_server_args

        from sglang_storage_adapters.runtime import process_runtime

        geometry = self._geometry()
        nbytes = geometry.total_bytes
        try:
            settings = runtime_settings(get_server_args())
        except ValueError:  # no server args published: a pool built on its own
            settings = None
        memory: HostMemory
        if settings is not None:
            # The process's one budget, shared with every other adapter (checked against
            # this host's memory, shared by its ranks).
            memory = process_runtime(settings).host_memory("kv")
            self.rows_memory = process_runtime(settings).host_memory("records")
        else:
            # Checked at start-up against this host's memory, shared by its ranks (as SGLang).
            config = BudgetConfig(total=nbytes, kv=nbytes, ranks_per_host=ranks_per_host())
            memory = HostMemory(HostMemoryBudget(config))
        self.storage_pool = KVHostPool(geometry, memory, label="HiCache KV host pool")
        self.kv_buffer = self.storage_pool.kv_buffer
        self.fd = None
        log.info(
            "sglang_storage KV host pool: %d pages of %d tokens, layout %s, %d bytes%s",
            geometry.num_pages,
            geometry.page_size,
            geometry.layout.value,
            nbytes,
            " (page-locked)" if self.storage_pool.page_locked else "",
        )

    def pages_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The page numbers of token ``indices`` that cover whole pages, in order.

        Raises:
            ConfigError: the indices are not whole pages.
        """
        flat = indices.reshape(-1).to("cpu", torch.int64)
        ps = self.page_size
        if flat.numel() % ps:
            raise ConfigError(
                owner=_OWNER,
                field="host indices",
                value=int(flat.numel()),
                reason=f"must cover whole pages of {ps} tokens",
            )
        rows = flat.view(-1, ps)
        pages = rows[:, 0] // ps
        if not torch.equal(rows, pages[:, None] * ps + torch.arange(ps)):
            raise ConfigError(
                owner=_OWNER,
                field="host indices",
                reason="must be whole pages (page_size consecutive tokens from a page start)",
            )
        return pages

    def tokens_of(self, pages: torch.Tensor) -> torch.Tensor:
        """Every token index of ``pages``, page by page."""
        ps = self.page_size
        return (pages.to(torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)

    def clear(self) -> None:
        """Free every page (SGLang's reset; nothing may be in flight)."""
        pool = getattr(self, "storage_pool", None)
        if pool is not None:
            if self.before_free is not None:
                self.before_free()  # finished transfers give their pages back first
            pool.slots.reset()

    def available_size(self) -> int:
        """Free host token slots."""
        return int(self.storage_pool.slots.free_count) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` token slots (whole pages), or None when host memory is short."""
        if need_size % self.page_size:
            raise ConfigError(
                owner=_OWNER,
                field="need_size",
                value=need_size,
                reason=f"must be a multiple of the page size ({self.page_size})",
            )
        with self.lock:
            try:
                pages = self.storage_pool.alloc(need_size // self.page_size)
            except CapacityError:
                return None
        return self.tokens_of(pages)

    def free(self, indices: torch.Tensor) -> int:
        """Give token slots (whole pages) back; returns how many tokens were freed.

        Raises:
            StateError: a page is not allocated, or a transfer still uses it.
        """
        if indices.numel() == 0:
            return 0
        pages = self.pages_of(indices)
        if self.before_free is not None:
            self.before_free()
        with self.lock:
            self.storage_pool.free(pages)
        if self.after_free is not None:
            self.after_free(pages)
        return int(indices.numel())

    def destroy(self) -> None:
        """Release the buffer to our host memory (idempotent)."""
        pool = getattr(self, "storage_pool", None)
        if pool is not None and not getattr(self, "_destroyed", False):
            pool.close()  # StateError while a transfer pins pages: nothing is closed
            self._destroyed = True
            for rows in self.side_rows:
                rows.close()


class StorageMHAHostPool(StorageHostPool, MHATokenToKVPoolHost):  # type: ignore[misc]
    """SGLang's ``MHATokenToKVPoolHost`` with its buffer and pages from our KV host pool."""

    head_num: int
    head_dim: int

    def _init_write_back_staging_buffers(self, buffer_info: Any, write_back_staging: Any) -> None:
        # SGLang's staged write-back kernel is not on our path: no device staging buffers.
        self.staging_page_capacity = 0
        self.staging_token_capacity = 0
        self.staging_k_buffer = None
        self.staging_v_buffer = None
        self.can_use_write_back_jit = False

    def _geometry(self) -> KVGeometry:
        return KVGeometry(
            attention=Attention.MHA,
            layout=_layout(self.layout),
            dtype=self.dtype,
            layer_num=self.layer_num,
            page_size=self.page_size,
            num_pages=self.page_num,
            head_num=self.head_num,
            head_dim=self.head_dim,
        )


class StorageMLAHostPool(StorageHostPool, MLATokenToKVPoolHost):  # type: ignore[misc]
    """SGLang's ``MLATokenToKVPoolHost`` with its buffer and pages from our KV host pool."""

    kv_cache_dim: int

    def _geometry(self) -> KVGeometry:
        return KVGeometry(
            attention=Attention.MLA,
            layout=_layout(self.layout),
            dtype=self.dtype,
            layer_num=self.layer_num,
            page_size=self.page_size,
            num_pages=self.page_num,
            head_num=1,
            head_dim=self.kv_cache_dim,
        )


def _layout(name: str) -> KVLayout:
    try:
        return _LAYOUTS[name]
    except KeyError:
        raise ConfigError(
            owner=_OWNER,
            field="hicache_mem_layout",
            value=name,
            reason="is not a layout the sglang_storage KV host pool holds",
            allowed=", ".join(_LAYOUTS),
        ) from None


def device_kv(device_pool: Any, host: KVHostPool) -> DeviceKV:
    """SGLang's device pool's per-layer buffers as our :class:`DeviceKV` (no copy)."""
    if isinstance(device_pool, MLATokenToKVPool):
        return DeviceKV(geometry=host.geometry, k=device_pool.kv_buffer)
    return DeviceKV(geometry=host.geometry, k=device_pool.k_buffer, v=device_pool.v_buffer)


# ---------------------------------------------------------------------- device <-> host


class PipelineTransferEngine:
    """SGLang's ``L2TransferEngine`` contract over our device<->host pipeline.

    Args:
        pipeline: Our pipeline between the device pool and ``host``'s KV host pool.
        host: The SGLang-facing host pool whose token indices transfers name.

    Only transfers of ``host`` are accepted (plain KV stacks have no other pool).
    Completions are events of SGLang's device module, recorded when the copy has
    finished: on CPU at once (our copies are synchronous there), on CUDA on this engine's
    streams after they wait for our pipeline's transfer.
    """

    def __init__(self, pipeline: DeviceHostPipeline, host: StorageHostPool) -> None:
        self.pipeline = pipeline
        self.host = host
        self.io_backend = pipeline.io_backend
        self.device_to_host_stream = _device_module.Stream()
        self.host_to_device_stream = _device_module.Stream()
        self._cuda = pipeline.device.type == "cuda"
        self._offloads: dict[int, torch.Tensor] = {}  # transfer id -> its host pages
        self.rows: tuple[CaptureRows, ...] = ()
        """Captured rows moved with every page (SGLang's capturers; empty when capture is off)."""
        self.unreadable: set[int] = set()
        """Host pages whose device->host copy failed: never loaded or backed up until freed."""
        self.failed_transfers = 0

    def poll(self) -> list[DeviceTransferResult]:
        """Collect finished transfers (unpins their host pages); never raises.

        A failed copy is reported on its own result (logged and counted); a failed
        device->host copy marks its host pages unreadable, so they are never loaded to
        the device or backed up to storage (wrong bytes), until the tree frees them.
        """
        results = self.pipeline.poll()
        for result in results:
            pages = self._offloads.pop(result.transfer_id, None)
            if result.ok:
                continue
            self.failed_transfers += 1
            _limited.log(
                logging.ERROR,
                f"transfer-{result.direction.value}",
                "sglang_storage %s of %d host pages failed: %s",
                result.direction.value,
                result.pages,
                result.error,
            )
            if pages is not None:
                self.unreadable.update(int(p) for p in pages.tolist())
        return results

    def forget(self, pages: torch.Tensor) -> None:
        """``pages`` were freed: what they held no longer matters."""
        if self.unreadable:
            self.unreadable.difference_update(int(p) for p in pages.tolist())

    def readable_prefix(self, pages: torch.Tensor) -> int:
        """How many leading ``pages`` hold what a finished copy wrote (none failed)."""
        if not self.unreadable:
            return int(pages.numel())
        for i, page in enumerate(pages.tolist()):
            if int(page) in self.unreadable:
                return i
        return int(pages.numel())

    def _pages(self, transfers: Sequence[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for transfer in transfers:
            if transfer.host_pool is not self.host:
                raise ConfigError(
                    owner=_OWNER,
                    field="L2 transfer",
                    value=type(transfer.host_pool).__name__,
                    reason="names a host pool this engine does not serve",
                    allowed="the sglang_storage KV host pool",
                )
            # The device indices stay where they are (the pipeline trusts them): no sync.
            out.append((self.host.pages_of(transfer.host_indices), transfer.device_indices))
        return out

    def _finish(self, handle: DeviceTransferHandle, stream: Any) -> Any:
        event = _device_module.Event()
        if self._cuda:
            with torch.cuda.stream(stream):
                handle.fence()
                event.record()
        else:
            result = handle.wait()
            if result.error is not None:
                raise result.error
            event.record()
        return event

    def submit_device_to_host(self, transfers: list[Any]) -> Any:
        """Copy device pages into host pages (every layer); SGLang's ``TransferCompletion``."""
        self.poll()
        start = _device_module.Event()
        start.record()
        finish = start
        stream = self.device_to_host_stream
        for pages, tokens in self._pages(transfers):
            if self._cuda:
                with torch.cuda.stream(stream):
                    # After what compute queued before this call (SGLang's start_event wait):
                    # the pipeline orders itself after the stream current here, the engine's.
                    stream.wait_event(start)
                    for rows in self.rows:
                        rows.save(pages, tokens)
                    handle = self.pipeline.offload(pages, tokens)
            else:
                for rows in self.rows:
                    rows.save(pages, tokens)
                handle = self.pipeline.offload(pages, tokens)
            self._offloads[handle.transfer_id] = pages
            finish = self._finish(handle, stream)
        return TransferCompletion(start, finish, False)

    def submit_host_to_device(
        self,
        transfers: list[Any],
        *,
        transfer_layer_id_max: int,
        start_event: Any = None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> Any:
        """Copy host pages into device pages layer by layer, calling ``on_layer_done(i)``."""
        self.poll()
        moves = self._pages(transfers)
        for pages, _ in moves:
            if self.readable_prefix(pages) < pages.numel():
                raise StorageError(
                    "sglang_storage: refusing to load host pages whose device->host copy "
                    f"failed ({sorted(self.unreadable & set(pages.tolist()))[:8]})"
                )
        if start_event is None:
            start_event = _device_module.Event()
            start_event.record()
        stream = self.host_to_device_stream
        handles = []
        for pages, tokens in moves:
            if self._cuda:
                with torch.cuda.stream(stream):
                    stream.wait_event(start_event)
                    # Queued before the KV copy, which waits for this stream: a layer
                    # reported loaded implies the rows are in the mirror.
                    for rows in self.rows:
                        rows.restore(pages, tokens)
                    handles.append(self.pipeline.load(pages, tokens))
            else:
                for rows in self.rows:
                    rows.restore(pages, tokens)
                handles.append(self.pipeline.load(pages, tokens))
        for layer in range(transfer_layer_id_max):
            if self._cuda:
                with torch.cuda.stream(stream):
                    for handle in handles:
                        handle.wait_layer(layer)
                    if on_layer_done is not None:
                        on_layer_done(layer)
            elif on_layer_done is not None:
                on_layer_done(layer)
        finish = start_event
        for handle in handles:
            finish = self._finish(handle, stream)
        if not handles:
            finish = _device_module.Event()
            finish.record()
        return TransferCompletion(start_event, finish, False)


# ---------------------------------------------------------------------- host <-> storage


class _PumpedQueue(queue.Queue[Any]):
    """One of SGLang's controller queues, filled from our core whenever the tree looks at it."""

    def __init__(self, pump: Callable[[], None]) -> None:
        super().__init__()
        self._pump = pump

    def qsize(self) -> int:
        self._pump()
        return super().qsize()

    def empty(self) -> bool:
        self._pump()
        return super().empty()


class _ReadQueue(queue.Queue[Any]):
    """SGLang's ``prefetch_buffer``: a prefetch the tree puts here starts reading at once."""

    def __init__(self, start: Callable[[Any], None]) -> None:
        super().__init__()
        self._start = start

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self._start(item)


# ---------------------------------------------------------------------- controller


class StorageCacheController(HybridCacheController):  # type: ignore[misc]
    """``HybridCacheController`` with our host pool and device<->host pipeline underneath.

    Constructed exactly as SGLang constructs ``HybridCacheController`` (same arguments);
    every attribute, queue and method the tree and the scheduler use is SGLang's. The
    host pool group's anchor must be a :class:`StorageHostPool`.

    Raises:
        ConfigError: the anchor host pool is not ours, or the pools do not match.
    """

    def __init__(
        self,
        token_to_kv_pool_allocator: Any,
        mem_pool_host: Any,
        page_size: int,
        tp_group: Any,
        load_cache_event: Any,
        attn_cp_group: Any = None,
        attn_tp_group: Any = None,
        pp_group: Any = None,
        write_policy: str = "write_through_selective",
        io_backend: str = "",
        storage_backend: str | None = None,
        prefetch_threshold: int = 256,
        model_name: str | None = None,
        storage_backend_extra_config: dict[str, Any] | None = None,
        transfer_layer_id_max: int | None = None,
        enable_storage_metrics: bool = False,
        host_memory_mode: str = "cache",
    ) -> None:
        # SGLang attaches storage inside its constructor; ours attaches once the
        # device<->host engine below is in place.
        super().__init__(
            token_to_kv_pool_allocator,
            mem_pool_host,
            page_size,
            tp_group,
            load_cache_event,
            attn_cp_group=attn_cp_group,
            attn_tp_group=attn_tp_group,
            pp_group=pp_group,
            write_policy=write_policy,
            io_backend=io_backend,
            storage_backend=None,
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            transfer_layer_id_max=transfer_layer_id_max,
            enable_storage_metrics=enable_storage_metrics,
            host_memory_mode=host_memory_mode,
        )
        host = self.mem_pool_host.anchor_entry.host_pool
        if not isinstance(host, StorageHostPool):
            raise ConfigError(
                owner=_OWNER,
                field="mem_pool_host",
                value=type(host).__name__,
                reason="must be the sglang_storage KV host pool",
            )
        check_device_pools(token_to_kv_pool_allocator, page_size, host_pool=host, owner=_OWNER)
        # SGLang's allocator hands out the device indices; like SGLang's own transfer
        # kernels, the pipeline trusts them, so a write or load never waits for the GPU.
        config = DeviceTransferConfig(io_backend="auto", check_device_tokens=False)
        device = device_kv(self.mem_pool_device, host.storage_pool)
        pipeline = DeviceHostPipeline(device, host.storage_pool, config)
        self.l2_transfer_engine = PipelineTransferEngine(pipeline, host)
        # SGLang built its capturers before the cache: their rows travel with the pages.
        self._rows = tuple(
            capture_rows(
                page_size,
                host.storage_pool.geometry.num_pages,
                device.tokens,
                host.rows_memory,
            )
        )
        self.l2_transfer_engine.rows = host.side_rows = self._rows
        observability.watch_device_pipeline(pipeline, "kv")
        observability.watch_pool(host.storage_pool, "kv")
        self._host = host
        self._core: CacheController | None = None
        self._storage_pipeline: StoragePipeline | None = None
        self._sync_groups = (attn_cp_group, attn_tp_group or tp_group, pp_group)
        self._queries: dict[int, Any] = {}
        self._reads: dict[int, Any] = {}
        self._read_ids: dict[int, int] = {}  # id(prefetch operation) -> read id
        self._backups: dict[int, Any] = {}
        host.before_free = self._before_free
        host.after_free = self.l2_transfer_engine.forget
        log.info("sglang_storage HiCache controller: device<->host I/O %s", pipeline.io_detail)
        if storage_backend is not None:
            self.attach_storage_backend(
                storage_backend=storage_backend,
                prefetch_threshold=prefetch_threshold,
                model_name=model_name,
                storage_backend_extra_config=storage_backend_extra_config,
                host_pools=getattr(self.mem_pool_host, "entries", None),
            )

    @property
    def device_pipeline(self) -> DeviceHostPipeline:
        """Our device<->host pipeline (metrics, I/O backend)."""
        engine: PipelineTransferEngine = self.l2_transfer_engine
        return engine.pipeline

    @property
    def storage_core(self) -> CacheController | None:
        """Our controller core (hit queries, prefetch reads, backups) while our backend is on.

        None otherwise: another backend attached at run time gets SGLang's own threads.
        """
        return self._core

    def move_indices(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices as our pipeline takes them: on the CPU, in the tree's order."""
        return host_indices.to("cpu"), device_indices

    def _before_free(self) -> None:
        engine: PipelineTransferEngine = self.l2_transfer_engine
        engine.poll()
        self._pump()

    # ------------------------------------------------------------------ storage tier

    def _start_storage_threads(self) -> None:
        if not isinstance(self.storage_backend, HiCacheBackend):
            super()._start_storage_threads()  # another backend: SGLang's own threads
            return
        # No thread: SGLang's queues, filled by our core whenever the tree drains them.
        self.prefetch_queue: queue.Queue[Any] = queue.Queue()
        self.backup_queue: queue.Queue[Any] = queue.Queue()
        self.prefetch_sync_queue: queue.Queue[Any] = queue.Queue()
        self.prefetch_buffer = _ReadQueue(self._start_read)
        self.prefetch_hit_queue = _PumpedQueue(self._pump)
        self.ack_prefetch_queue = _PumpedQueue(self._pump)
        self.ack_backup_queue = _PumpedQueue(self._pump)
        self.host_mem_release_queue: queue.Queue[Any] = queue.Queue()
        self._init_extra_host_mem_release_queues()
        backend = self.storage_backend
        config = ControllerConfig(load_policy=backend.settings.runtime.load_policy)
        self._storage_pipeline = backend.runtime.storage_pipeline(backend.lease)
        self._core = CacheController(
            host=self._host.storage_pool,
            device=self.device_pipeline,
            storage=self._storage_pipeline,
            sides=[rows.part for rows in self._rows],
            ranks=rank_sync(self._sync_groups),
            config=config,
        )
        observability.watch_controller(self._core)
        observability.watch_storage_pipeline(self._storage_pipeline, "kv")
        observability.watch_backend(backend.backend)
        log.info(
            "sglang_storage HiCache storage tier: backend %s, load policy %s, no storage threads",
            type(backend.backend).__name__,
            config.load_policy.value,
        )

    def _stop_storage_threads(self) -> None:
        core, pipeline = self._core, self._storage_pipeline
        if core is None:
            super()._stop_storage_threads()
            return
        self.storage_stop_event.set()
        self._core = self._storage_pipeline = None
        observability.SOURCES.remove(core)  # its counts stay in the totals
        observability.SOURCES.capture(self.device_pipeline)
        self._deliver(core.close())
        if pipeline is not None:
            pipeline.close(drain=True)
            core.poll()  # calls that outlived the close have returned: unpin their pages
            observability.SOURCES.remove(pipeline)
        self._queries.clear()
        self._reads.clear()
        self._read_ids.clear()

    def _pump(self) -> None:
        core = self._core
        if core is not None:
            self._deliver(core.poll())

    def _deliver(self, events: Sequence[ControllerEvent]) -> None:
        """Put what the core finished into SGLang's queues, as SGLang's threads would."""
        ps = self.page_size
        for event in events:
            if isinstance(event, HitQueryDone):
                operation = self._queries.pop(event.query_id)
                hashes = list(operation.all_hash_values or [])
                operation.hash_value = hashes[: event.pages]
                operation.storage_hit_count = event.pages * ps
                operation.pool_storage_result.update_kv_hit_pages(event.pages)
                operation.query_pool_hit_pages = {PoolName.KV: event.pages}
                queue.Queue.put(self.prefetch_hit_queue, operation)
            elif isinstance(event, ReadProgress):
                operation = self._reads[event.read_id]
                ack = PrefetchAck(
                    rid=operation.request_id,
                    operation=operation,
                    completed_tokens=event.pages * ps,
                )
                queue.Queue.put(self.ack_prefetch_queue, ack)
                if event.final:
                    del self._reads[event.read_id]
                    self._read_ids.pop(id(operation), None)
                    self._record(prefetch=True, pages=event.pages, started=operation)
                    done = PrefetchAck(
                        rid=operation.request_id, operation=operation, completed_req=True
                    )
                    queue.Queue.put(self.ack_prefetch_queue, done)
            else:
                operation = self._backups.pop(event.backup_id)
                if event.stored_pages < event.requested_pages:
                    _limited.warning(
                        "backup",
                        "sglang_storage backup: %d of %d pages stored (%s)",
                        event.stored_pages,
                        event.requested_pages,
                        event.error,
                    )
                operation.completed_tokens = event.stored_pages * ps
                self._record(prefetch=False, pages=event.stored_pages, started=operation)
                queue.Queue.put(self.ack_backup_queue, operation)

    def _record(self, *, prefetch: bool, pages: int, started: Any) -> None:
        backend = self.storage_backend
        if isinstance(backend, HiCacheBackend):
            since = getattr(started, "_sgs_started", None)
            seconds = 0.0 if since is None else time.perf_counter() - since
            nbytes = pages * self._host.storage_pool.page_spec.nbytes
            backend.record_transfer(prefetch=prefetch, pages=pages, nbytes=nbytes, seconds=seconds)

    def _object_keys(self, hashes: Sequence[str]) -> list[Any]:
        """Each page's object key; with captured rows, a tuple: the KV page's, then each part's."""
        backend = self.storage_backend
        assert isinstance(backend, HiCacheBackend)
        if not self._rows:
            return [backend.object_key(h) for h in hashes]
        return [
            (backend.object_key(h), *(backend.object_key(f"{h}-{r.name}") for r in self._rows))
            for h in hashes
        ]

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Each page's slots in every part: side slot ``p`` belongs to host page ``p``."""
        if not self._rows:
            return pages
        return pages.reshape(-1, 1).expand(-1, 1 + len(self._rows)).contiguous()

    def prefetch(
        self,
        handle: Any,
        new_input_tokens: list[int],
        last_hash: str | None = None,
        prefix_keys: list[str] | None = None,
        extra_pools: list[Any] | None = None,
        assume_stored: bool = False,
    ) -> Any:
        """SGLang's prefetch: the hit query starts now; its result reaches the hit queue."""
        core = self._core
        if core is None or extra_pools:
            return super().prefetch(
                handle, new_input_tokens, last_hash, prefix_keys, extra_pools, assume_stored
            )
        operation = PrefetchOperation(
            handle,
            new_input_tokens,
            last_hash,
            prefix_keys=prefix_keys,
            pool_transfers=extra_pools,
            assume_stored=assume_stored,
        )
        hashes = get_storage_hash_str(new_input_tokens, last_hash, page_size=self.page_size)
        operation.all_hash_values = hashes
        self._queries[core.query(self._object_keys(hashes))] = operation
        return operation

    def _start_read(self, operation: Any) -> None:
        """The tree allocated host pages for an agreed hit: read it (``prefetch_buffer.put``)."""
        core = self._core
        if core is None:
            return
        hashes = list(operation.hash_value or [])
        pages = self._host.pages_of(operation.host_indices)[: len(hashes)]
        operation._sgs_started = time.perf_counter()
        read_id = core.read(self._object_keys(hashes), self._slots(pages))
        self._reads[read_id] = operation
        self._read_ids[id(operation)] = read_id
        if operation.is_terminated():
            core.cancel_read(read_id)

    def terminate_prefetch(self, operation: Any) -> tuple[int, list[str]]:
        """SGLang's terminate; a read still in flight stops at its next batch."""
        completed = super().terminate_prefetch(operation)
        read_id = self._read_ids.get(id(operation))
        if read_id is not None and self._core is not None:
            self._core.cancel_read(read_id)
        return completed  # type: ignore[no-any-return]

    def _storage_hit_query(self, operation: Any) -> tuple[list[str], int]:
        """This rank's hit (the tree agrees on it): leading pages stored, bounded in time."""
        core = self._core
        if core is None or operation.pool_transfers:
            return super()._storage_hit_query(operation)  # type: ignore[no-any-return]
        hashes = get_storage_hash_str(
            operation.token_ids, operation.last_hash, page_size=self.page_size
        )
        operation.all_hash_values = hashes
        pages = core.local_hit_pages(self._object_keys(hashes))
        operation.pool_storage_result.update_kv_hit_pages(pages)
        operation.query_pool_hit_pages = {PoolName.KV: pages}
        return hashes[:pages], pages * self.page_size

    def detach_storage_backend(self) -> None:
        """SGLang's detach; our backups in flight are finished and acknowledged as usual."""
        super().detach_storage_backend()

    def reset(self) -> None:
        """SGLang's reset: every transfer list and queue emptied; storage stays attached."""
        if self._core is None:
            super().reset()
            return
        self._stop_storage_threads()  # reads cancelled, backups finished (unacknowledged)
        self.write_queue.clear()
        self.load_queue.clear()
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        with self.pp_prefetch_state_lock:
            self.pp_prefetch_states.clear()
            self.pp_prefetch_decisions.clear()
        self.storage_stop_event.clear()
        self._start_storage_threads()
        self.prefetch_tokens_occupied = 0

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: list[int],
        hash_value: list[str] | None = None,
        prefix_keys: list[str] | None = None,
        extra_pools: list[Any] | None = None,
    ) -> int:
        """Back host pages up to storage; the ack arrives in ``ack_backup_queue`` (op id)."""
        core = self._core
        if core is None or extra_pools:
            return int(
                super().write_storage(host_indices, token_ids, hash_value, prefix_keys, extra_pools)
            )
        operation = StorageOperation(
            host_indices, token_ids, hash_value=hash_value, prefix_keys=prefix_keys
        )
        # A non-writer rank of a TP-shared (MLA) pool stores nothing (SGLang's rule).
        if self.backup_skip:
            queue.Queue.put(self.ack_backup_queue, operation)
            return int(operation.id)
        engine: PipelineTransferEngine = self.l2_transfer_engine
        engine.poll()
        pages = self._host.pages_of(host_indices)[: len(hash_value or [])]
        # Pages whose device->host copy failed are never stored (the backup stops there).
        hashes = list(hash_value or [])[: engine.readable_prefix(pages)]
        operation._sgs_started = time.perf_counter()
        backup = core.backup(self._object_keys(hashes), self._slots(pages[: len(hashes)]))
        self._backups[backup] = operation
        return int(operation.id)


# ---------------------------------------------------------------------- the stack


def _host_pool_class(kv_pool: Any) -> type[StorageHostPool] | None:
    """Our host pool class for ``kv_pool``, or None where SGLang's stack must stay."""
    if isinstance(kv_pool, MLATokenToKVPool):
        if type(kv_pool) is not MLATokenToKVPool:
            return None  # DSA and other MLA variants carry more than the latent rows
        return StorageMLAHostPool
    if type(kv_pool) is not MHATokenToKVPool:
        return None
    info = kv_pool.get_device_pool_infos()[0].buffer_info
    if get_mha_host_pool_cls(info) is not MHATokenToKVPoolHost or info.head_dim != getattr(
        info, "v_head_dim", info.head_dim
    ):
        return None  # FP8 scales, asymmetric K/V widths: SGLang's own host pools
    return StorageMHAHostPool


def _kv_enabled() -> bool:
    from sglang.srt.runtime_context import get_server_args

    # ServerArgs of this process (SGLang publishes them before building caches).
    settings = runtime_settings(get_server_args())
    return settings is not None and settings.enabled("kv")


class StorageStackStrategy(assembler.StackStrategy):  # type: ignore[misc]
    """SGLang's plain-KV HiCache stack with our host pool and controller.

    Matches what SGLang's ``_PlainKvStrategy`` matches (a flat MHA or MLA device pool,
    one FULL component), with SGLang's standard host pool class, a layout our pool holds
    and no decode context parallelism, when the ``kv`` manager is on; otherwise SGLang's
    own strategies build the stack.
    """

    def __init__(self) -> None:
        self._plain = assembler._PlainKvStrategy()

    def matches(self, kvcache: Any, components: set[Any]) -> bool:
        """Whether this strategy builds the stack for ``kvcache``."""
        if not self._plain.matches(kvcache, components) or components != {ComponentType.FULL}:
            return False
        if _host_pool_class(kvcache) is None:
            return False
        from sglang.srt.runtime_context import get_memory, get_parallel

        try:
            if get_parallel().dcp_enabled or get_memory().hicache_mem_layout not in _LAYOUTS:
                return False
            return _kv_enabled()
        except StorageError:
            raise  # a bad --storage-* setting is the operator's to see
        except (RuntimeError, ValueError) as error:
            # No published server arguments (not a scheduler process): SGLang's stack.
            log.debug("sglang_storage HiCache strategy not used: %s", error)
            return False

    def build_direct_linker_pool_group(self, *, kvcache: Any, params: Any, page_size: int) -> Any:
        """SGLang's own (the direct linker has no host tier to replace)."""
        return self._plain.build_direct_linker_pool_group(
            kvcache=kvcache, params=params, page_size=page_size
        )

    def build(
        self,
        *,
        cache: Any,
        kvcache: Any,
        params: Any,
        server_args: Any,
        load_cache_event: Any,
        storage_backend: str | None = None,
        storage_backend_extra_config: dict[str, Any] | None = None,
        prefetch_threshold: int = 256,
        model_name: str | None = None,
        enable_storage_metrics: bool = False,
    ) -> Any:
        """The host pool group and controller (SGLang's ``StackBuildResult``)."""
        if params.mtp_draft_device_pools:
            log.info("sglang_storage: MTP draft KV pools keep SGLang's own HiCache stack")
            return self._plain.build(
                cache=cache,
                kvcache=kvcache,
                params=params,
                server_args=server_args,
                load_cache_event=load_cache_event,
                storage_backend=storage_backend,
                storage_backend_extra_config=storage_backend_extra_config,
                prefetch_threshold=prefetch_threshold,
                model_name=model_name,
                enable_storage_metrics=enable_storage_metrics,
            )
        from sglang.srt.runtime_context import get_memory

        memory = get_memory()
        # Refused before any host memory is taken (the controller checks again, with its pool).
        check_device_pools(params.token_to_kv_pool_allocator, params.page_size, owner=_OWNER)
        host_pool = build_host_pool(kvcache, params.page_size)
        layer_mapping = {i: i for i in range(kvcache.layer_num)}
        group = HostPoolGroup(
            [
                assembler.build_pool_entry(
                    name=PoolName.KV,
                    host_pool=host_pool,
                    device_pool=kvcache,
                    layer_mapping=layer_mapping,
                    transfer_layer_id_max=len(layer_mapping),
                    is_anchor=True,
                )
            ]
        )
        controller = StorageCacheController(
            params.token_to_kv_pool_allocator,
            group,
            params.page_size,
            params.tp_cache_group,
            load_cache_event=load_cache_event,
            attn_cp_group=params.attn_cp_cache_group,
            attn_tp_group=params.attn_tp_cache_group,
            pp_group=params.pp_cache_group,
            write_policy=memory.hicache_write_policy,
            io_backend=memory.hicache_io_backend,
            storage_backend=storage_backend,
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            transfer_layer_id_max=len(layer_mapping),
            enable_storage_metrics=enable_storage_metrics,
            host_memory_mode=memory.hicache_host_memory_mode,
        )
        return assembler.StackBuildResult(
            host_pool_group=group,
            cache_controller=controller,
            component_host_pools={ComponentType.FULL: host_pool},
            pools_desc="KV (sglang_storage)",
        )


def build_host_pool(kv_pool: Any, page_size: int, *, host_size: float | None = None) -> Any:
    """Our host pool for SGLang's device pool ``kv_pool``, sized as SGLang sizes its own.

    Raises:
        ConfigError: ``kv_pool`` is not a plain MHA/MLA pool, or the layout is not ours.
        CapacityError: the host cannot hold the pool.
    """
    from sglang.srt.runtime_context import get_memory, get_server_args

    cls: Any = _host_pool_class(kv_pool)
    if cls is None:
        raise ConfigError(
            owner=_OWNER,
            field="device KV pool",
            value=type(kv_pool).__name__,
            reason="has no sglang_storage host pool",
            allowed="MHATokenToKVPool, MLATokenToKVPool",
        )
    memory = get_memory()
    capacity = (
        kv_pool.size if kv_pool.host_capacity_tokens is None else kv_pool.host_capacity_tokens
    )
    common: dict[str, Any] = {
        "pin_memory": False,  # our host memory pins (cudaHostRegister) where CUDA exists
        "device": "cpu",
        "allocator_type": "default",
        "device_capacity_tokens": capacity,
        "start_layer": kv_pool.start_layer,
        "end_layer": kv_pool.end_layer,
        "draft_buffer_infos": (),
        "pool_label": "kv",
    }
    info = kv_pool.get_device_pool_infos()[0].buffer_info
    if host_size is None:  # --storage-host-memory exactly (SGLang's hicache_size is whole GB)
        try:
            host_size = host_pool_size(get_server_args())
        except ValueError:  # no server args published: a pool built on its own
            host_size = None
    size = memory.hicache_size if host_size is None else host_size
    if cls is StorageMLAHostPool:
        common.update(
            override_kv_cache_dim=kv_pool.kv_cache_dim,
            layer_shard_enabled=kv_pool.layer_shard_enabled,
            target_layer_num=kv_pool.layer_num,
        )
    else:
        common["write_back_staging"] = None
    try:
        return cls(info, memory.hicache_ratio, size, page_size, memory.hicache_mem_layout, **common)
    except StorageError:
        raise
    except ValueError as error:
        raise ConfigError(
            owner=_OWNER, field="KV host pool", reason=f"SGLang refused it: {error}"
        ) from None


_STRATEGY: StorageStackStrategy | None = None


def install() -> None:
    """Put :class:`StorageStackStrategy` first in SGLang's strategies (once per process).

    Harmless without ``--storage-*`` flags: the strategy then matches nothing.
    """
    global _STRATEGY
    if _STRATEGY is None:
        _STRATEGY = StorageStackStrategy()
    if _STRATEGY not in assembler._STRATEGIES:
        assembler.register_stack_strategy(_STRATEGY)
