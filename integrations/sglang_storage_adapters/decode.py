"""SGLang 0.5.23's ``DecodeKVCacheOffloadManager`` backed by our decode offload manager.

In PD disaggregation the decode side writes what it decodes through to storage, stride by
stride (map section 3). SGLang's class builds a ``HiCacheController`` and a host pool of
its own and exposes a queue-shaped contract; :class:`DecodeOffloadAdapter` keeps that
contract (its constructor and every method and attribute SGLang's callers use) and puts
:class:`~sglang_storage.managers.decode.DecodeOffloadManager` behind it:

- ``DecodeOffloadAdapter(req_to_token_pool, token_to_kv_pool_allocator, tp_group,
  tree_cache)`` - as ``scheduler.py:643`` builds it. The device pool's own tensors are
  wrapped (no copy); the host pool has SGLang's ``--hicache-mem-layout`` and its
  ``--hicache-size`` / ``--hicache-ratio`` sizing; pages go to the ``--storage-backend``.
- ``offload_kv_cache(req) -> bool`` - every decode step and once at finish
  (``batch_result_processor.py:1433,1455``): hands the manager the tokens whose KV is on
  the device (``origin_input_ids + output_ids[:-1]``) and the request's device pages; a
  whole stride past the prefill's page-aligned prompt is copied device->host. True when a
  copy was submitted now. At finish the request's backup is due once its copies land.
- ``finalize_release_on_finish(req)`` - frees the request's device KV now, unless the
  manager still tracks it (then ``check_offload_progress`` frees it once its copies landed).
- ``check_offload_progress()`` - polls the manager; frees the device KV of finished
  requests whose copies have landed, oldest first, as many as every TP rank has ready
  (a MIN all-reduce, as SGLang does, so ranks free the same requests in the same step).
- ``drain_before_retraction()`` - polls, then raises ``RuntimeError`` on every rank when
  any rank still has a device->host copy in flight (SGLang's MAX all-reduce).
- ``has_inflight_device_transfer()``, ``ongoing_offload`` (requests whose copies may still
  read device KV), ``ongoing_backup`` (requests whose backup has not finished),
  ``release_host_resources()``.

Keys and bytes: pages are stored under SGLang's page keys (the hash chain seeded by
``storage_namespace_seed(extra_key, cache_salt)`` and continued from the prefill's
page-aligned prompt), in the same namespace and with the same payload as the HiCache
adapter (:mod:`.hicache_storage`) gives SGLang's KV pool with this layout, so a prefill
instance running HiCache on sglang_storage reads what the decode side wrote.

Differences from SGLang's own class, by design of the manager: backups run when the
request finishes (not per stride), host pages are freed when the backup completes, and an
aborted request (``FINISH_ABORT``) stores nothing more. MLA pages are stored by TP rank 0
only (the other ranks copy and free device KV in step with it). Hybrid SWA pools
(``UnifiedSWAKVPool``) are refused with a :class:`~sglang_storage.errors.ConfigError`.

Switching on: :func:`install` replaces SGLang's class (HookRegistry class REPLACE, map
section 6.2). The replacement builds SGLang's own class unless the process's server args
carry sglang_storage settings with ``decode`` in ``--storage-managers``
(:func:`~.runtime.runtime_settings`); without them SGLang is unchanged.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Final

import attrs
import torch

from sglang_storage.errors import ConfigError
from sglang_storage.managers import observability
from sglang_storage.managers.decode import (
    BackupDone,
    BackupFailed,
    DecodeOffloadConfig,
    DecodeOffloadManager,
    DeviceReleased,
    OffloadFailed,
)
from sglang_storage.managers.logs import RateLimitedLog
from sglang_storage.managers.runtime import kv_page_namespace
from sglang_storage.memory import Attention, KVGeometry, KVHostPool, KVLayout
from sglang_storage.storage.keys import namespace_seed
from sglang_storage.transfer import DeviceHostPipeline, DeviceKV
from sglang_storage_adapters import metrics, require_supported_sglang
from sglang_storage_adapters.device_checks import check_device_pools
from sglang_storage_adapters.plugin import hook_registry
from sglang_storage_adapters.ranks import rank_sync
from sglang_storage_adapters.runtime import (
    process_rank_layout,
    process_runtime,
    published_settings,
)

require_supported_sglang()

# Imported as modules: HookRegistry rebinds every module attribute that *is* the replaced
# class, so a name bound here to SGLang's class would be rebound to the adapter.
import sglang.srt.disaggregation.decode_kvcache_offload_manager as _sglang_decode  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.runtime_context import (  # noqa: E402
    get_memory,
    get_schedule,
    get_serving,
)

__all__ = ["TARGET", "DecodeOffloadAdapter", "host_pool_geometry", "install"]

log = logging.getLogger(__name__)
_limited: Final = RateLimitedLog(log)

_RANK_TIMEOUT_S: Final = 5.0
"""How long a TP agreement of the offload waits for the other ranks."""

TARGET: Final = (
    "sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager"
)
"""The class :func:`install` replaces."""

_OWNER: Final = "sglang_storage decode offload adapter"
_BYTES_PER_GB: Final = 10**9  # SGLang's --hicache-size unit


def host_pool_geometry(kv_cache: Any, page_size: int) -> KVGeometry:
    """The host pool for SGLang's device pool ``kv_cache``, laid out and sized as SGLang's.

    Layout: ``--hicache-mem-layout``; tokens: ``--hicache-size`` GB of them when set, else
    ``--hicache-ratio`` times the device pool's (``build_kv_host_pool``'s rule).

    Raises:
        ConfigError: the pool is not an MHA/MLA token pool, or the layout or sizes are
            not ones the host pool supports.
    """
    memory = get_memory()
    mla = isinstance(kv_cache, MLATokenToKVPool)
    if not mla and not isinstance(kv_cache, MHATokenToKVPool):
        raise ConfigError(
            owner=_OWNER,
            field="token_to_kv_pool_allocator.get_kvcache()",
            value=type(kv_cache).__name__,
            reason="is not a KV pool the decode offload manager serves",
            allowed="MHATokenToKVPool, MLATokenToKVPool (hybrid SWA pools are not served)",
        )
    layout_name = str(memory.hicache_mem_layout)
    try:
        layout = KVLayout(layout_name)
    except ValueError:
        raise ConfigError(
            owner=_OWNER,
            field="--hicache-mem-layout",
            value=layout_name,
            reason="is not a host layout the decode offload manager supports",
            allowed=", ".join(x.value for x in KVLayout),
        ) from None
    if mla:
        head_num, head_dim = 1, int(kv_cache.kv_cache_dim)
        planes = 1
    else:
        head_num, head_dim = int(kv_cache.head_num), int(kv_cache.head_dim)
        planes = 2
    dtype = kv_cache.store_dtype
    layers = int(kv_cache.layer_num)
    token_bytes = planes * layers * head_num * head_dim * dtype.itemsize
    size_gb = float(memory.hicache_size or 0)
    if size_gb > 0:
        tokens = int(size_gb * _BYTES_PER_GB // token_bytes)
    else:
        tokens = int(int(kv_cache.size) * float(memory.hicache_ratio or 2.0))
    return KVGeometry(
        attention=Attention.MLA if mla else Attention.MHA,
        layout=layout,
        dtype=dtype,
        layer_num=layers,
        page_size=page_size,
        num_pages=max(tokens // page_size, 1),
        head_num=head_num,
        head_dim=head_dim,
    )


def _device_kv(kv_cache: Any, geometry: KVGeometry) -> DeviceKV:
    """SGLang's device pool tensors, wrapped without a copy."""
    if geometry.is_mla:
        return DeviceKV(geometry=geometry, k=tuple(kv_cache.kv_buffer))
    return DeviceKV(geometry=geometry, k=tuple(kv_cache.k_buffer), v=tuple(kv_cache.v_buffer))


@attrs.define(eq=False)
class _Tracked:
    """One request the manager tracks, under a unique id (SGLang reuses rids)."""

    manager_id: str
    req: Any
    given: int  # tokens handed to the manager so far
    finishing: bool = False  # finished or aborted in the manager; device not yet freed
    released: bool = False  # DeviceReleased seen: its copies have landed
    freed: bool = False  # SGLang's device KV of the request was given back
    dropped: bool = False  # retracted: the manager stopped, SGLang keeps the device KV


class DecodeOffloadAdapter(_sglang_decode.DecodeKVCacheOffloadManager):  # type: ignore[misc]
    """SGLang's ``DecodeKVCacheOffloadManager``, served by our decode offload manager.

    Constructed like SGLang's class; see the module docstring for each method. Without
    sglang_storage settings naming ``decode``, constructing it builds SGLang's own class.

    Args:
        req_to_token_pool: SGLang's ``ReqToTokenPool``.
        token_to_kv_pool_allocator: SGLang's allocator; its ``get_kvcache()`` is the
            device pool (``MHATokenToKVPool`` or ``MLATokenToKVPool``).
        tp_group: The (CPU) TP process group the scheduler passes (``dp_tp_cpu_group``).
        tree_cache: The scheduler's prefix cache (frees device KV, unlocks the prefix).

    Raises:
        ConfigError: an unsupported device pool, host layout or storage setting; an
            allocator that can hand out device slots that are not whole pages; decode
            context parallelism (see :mod:`.device_checks`).
        CapacityError: the host memory budget cannot hold the host pool.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """This adapter when sglang_storage serves ``decode``, else SGLang's own class."""
        settings = published_settings()
        if cls is DecodeOffloadAdapter and (settings is None or not settings.enabled("decode")):
            # SGLang's class is reached through the base: HookRegistry rebinds every module
            # attribute that is SGLang's class, a private alias here included.
            original: Any = object.__new__(DecodeOffloadAdapter.__bases__[0])
            original.__init__(*args, **kwargs)
            return original
        return object.__new__(cls)

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tp_group: Any,
        tree_cache: Any,
    ) -> None:
        settings = published_settings()
        if settings is None:
            raise ConfigError(
                owner=_OWNER,
                field="--storage-managers",
                reason="sglang_storage is not configured in this process's server args",
                allowed="--storage-backend ... --storage-managers ...,decode",
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.tp_group = tp_group
        self.tp_world_size = torch.distributed.get_world_size(group=tp_group)
        self.tp_rank = torch.distributed.get_rank(group=tp_group)
        # Bounded agreement instead of SGLang's blocking all_reduce: a late rank is a miss.
        self._ranks = rank_sync([tp_group], name="decode")
        self.page_size = int(get_schedule().page_size)
        self.offload_stride = _stride(self.page_size)
        self.kv_cache = token_to_kv_pool_allocator.get_kvcache()
        # Device pages are named by their first token (row[::page_size] below).
        check_device_pools(token_to_kv_pool_allocator, self.page_size, owner=_OWNER)
        geometry = host_pool_geometry(self.kv_cache, self.page_size)
        # The process's storage runtime: its one host memory budget, its one instance of
        # the backend (shared with the HiCache adapter, one cap for both), a pipeline.
        self.runtime = process_runtime(settings)
        self.host_pool = KVHostPool(
            geometry, self.runtime.host_memory("decode"), label="decode offload host pool"
        )
        try:
            self._lease = self.runtime.backend(settings.backend, settings.backend_options)
        except BaseException:
            self.host_pool.close()
            raise
        self.backend = self._lease.backend
        self.storage = self.runtime.storage_pipeline(self._lease)
        spec = self.host_pool.page_spec
        model = str(get_serving().served_model_name or "unnamed-model")
        # Derived as the HiCache adapter derives it for this rank, so a HiCache reader of
        # the same rank (TP, PP, attention CP, decode CP) finds the pages.
        self.namespace = kv_page_namespace(
            model,
            pool="kv",
            mla=geometry.is_mla,
            shared=geometry.is_mla,
            dtype=spec.dtype,
            shape=spec.shape,
            layout=spec.layout,
            page_size=self.page_size,
            ranks=process_rank_layout(
                page_size=self.page_size, tp_rank=self.tp_rank, tp_size=self.tp_world_size
            ),
        )
        # MLA pages are the same on every TP rank and share one namespace: rank 0 stores
        # them; the others copy and release in step with it but store nothing.
        self._writer = not geometry.is_mla or self.tp_rank == 0
        device = DeviceHostPipeline(_device_kv(self.kv_cache, geometry), self.host_pool)
        self.manager = DecodeOffloadManager(
            host=self.host_pool,
            device=device,
            storage=self.storage,
            namespace=self.namespace,
            config=DecodeOffloadConfig(stride_pages=self.offload_stride // self.page_size),
        )
        observability.watch_decode(self.manager)
        observability.watch_storage_pipeline(self.storage, "decode")
        observability.watch_device_pipeline(device, "decode")
        observability.watch_pool(self.host_pool, "decode")
        observability.watch_backend(self.backend)
        # SGLang's attributes its callers read (``len(ongoing_offload)``) and this adapter's
        # bookkeeping: manager id -> request.
        self.ongoing_offload: dict[str, Any] = {}
        self.ongoing_backup: dict[str, Any] = {}
        self.offloaded_state: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._tracked: weakref.WeakKeyDictionary[Any, _Tracked] = weakref.WeakKeyDictionary()
        self._finishing: list[_Tracked] = []  # oldest first
        self._by_id: dict[str, _Tracked] = {}
        self._count = 0
        log.info(
            "sglang_storage decode offload: %s backend, host pool %d pages (%s), stride %d",
            settings.backend,
            geometry.num_pages,
            geometry.layout.value,
            self.offload_stride,
        )

    # ------------------------------------------------------------------ SGLang's seam

    def release_host_resources(self) -> None:
        """Finish pending backups (bounded wait), close the pipeline and the host pool.

        The backend is released (the process's last user closes it).
        """
        report = self.storage.close(timeout_s=30.0)
        observability.SOURCES.remove(self.storage)
        observability.SOURCES.remove(self.manager)
        observability.SOURCES.capture(self.backend)
        if not report.clean:
            log.warning("sglang_storage decode offload: storage closed unclean: %s", report)
        self._lease.release()
        if not self.manager.copying:
            self.host_pool.close()

    def has_inflight_device_transfer(self) -> bool:
        """Whether a device->host copy may still read device KV (the decode idle gate)."""
        return self.manager.copying or bool(self.ongoing_offload)

    def offload_kv_cache(self, req: Any) -> bool:
        """Offload every new whole stride of ``req``'s decoded KV; True when one was submitted."""
        if req.kv.req_pool_idx is None or req.kv.req_pool_idx == -1 or len(req.output_ids) == 0:
            return False
        tokens = [*req.origin_input_ids, *req.output_ids[:-1]]
        tracked = self._tracked.get(req)
        if tracked is not None and tracked.finishing:
            return False  # finished in the manager already: nothing more to offload
        if tracked is not None and len(tokens) < tracked.given:
            self._drop(tracked)  # retracted and rebuilt shorter: start over
            tracked = None
        if tracked is None:
            tracked = self._start(req, tokens)
        submitted = 0
        if len(tokens) > tracked.given:
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(tokens)]
            # Left on the device: the manager reads it (a copy to the host, which waits for
            # the GPU) only when a stride is due, not at every decode step.
            pages = row[:: self.page_size].to(dtype=torch.int64) // self.page_size
            submitted = self.manager.on_decoded(tracked.manager_id, tokens[tracked.given :], pages)
            tracked.given = len(tokens)
        if submitted:
            self.ongoing_offload[tracked.manager_id] = req
        if req.finished():
            aborted = isinstance(req.finished_reason, FINISH_ABORT)
            self._finish(tracked, abort=aborted or not self._writer)
        return submitted > 0

    def check_offload_progress(self) -> None:
        """Collect the manager's results; free device KV every TP rank has ready."""
        self._poll()
        metrics.refresh()
        ready = 0
        while ready < len(self._finishing) and self._finishing[ready].released:
            ready += 1
        # A rank that does not answer in time: nothing is released this step.
        ready = self._agree_min("decode_ready", ready, late=0)
        done, self._finishing = self._finishing[:ready], self._finishing[ready:]
        for tracked in done:
            self.ongoing_offload.pop(tracked.manager_id, None)
            self._release_finished_req(tracked.req)

    def drain_before_retraction(self) -> None:
        """Collect results; raise on every rank if any rank still copies device KV."""
        self.check_offload_progress()
        # MAX of "still copying" is 1 - MIN of "done"; a late rank counts as still copying.
        pending = 1 - self._agree_min("decode_drained", int(not self.manager.copying), late=0)
        if pending:
            raise RuntimeError(
                "Decode KV offload copies are still pending on some rank; refusing to "
                f"retract (local: {len(self.ongoing_offload)} requests copying)."
            )

    def finalize_release_on_finish(self, req: Any) -> None:
        """Free ``req``'s device KV now, or once the manager's copies of it have landed."""
        tracked = self._tracked.get(req)
        if tracked is None:
            self._release_finished_req(req)
            return
        if not tracked.finishing:  # released without offload_kv_cache at finish
            self._finish(tracked, abort=True)

    # ------------------------------------------------------------------ internals

    def _start(self, req: Any, tokens: list[int]) -> _Tracked:
        self._count += 1
        manager_id = f"{req.rid}#{self._count}"
        prefill = len(req.origin_input_ids) // self.page_size * self.page_size
        self.manager.start(
            manager_id,
            tokens[:prefill],
            stored_tokens=prefill,
            seed=namespace_seed(req.extra_key, req.cache_salt),
        )
        tracked = _Tracked(manager_id=manager_id, req=req, given=prefill)
        self._tracked[req] = tracked
        self._by_id[manager_id] = tracked
        return tracked

    def _finish(self, tracked: _Tracked, *, abort: bool) -> None:
        """The request is done: its device KV is freed once its copies have landed."""
        if abort:
            self.manager.abort(tracked.manager_id)
        else:
            self.manager.finish(tracked.manager_id)
            self.ongoing_backup[tracked.manager_id] = tracked.req.rid
        tracked.finishing = True
        self._finishing.append(tracked)

    def _drop(self, tracked: _Tracked) -> None:
        """Stop offloading a request whose device KV SGLang keeps managing itself."""
        self.manager.abort(tracked.manager_id)
        self._tracked.pop(tracked.req, None)
        tracked.dropped = True

    def _poll(self) -> None:
        for event in self.manager.poll():
            tracked = self._by_id.get(event.request_id)
            if isinstance(event, DeviceReleased):
                if tracked is not None:
                    tracked.released = True
                    self._forget_if_settled(tracked)
            elif isinstance(event, OffloadFailed):
                _limited.warning(
                    "offload",
                    "sglang_storage decode offload: copy of %s failed (%d pages): %s",
                    event.request_id,
                    event.pages,
                    event.error,
                )
            else:
                self._backed_up(event)
        if not self.manager.copying:  # every copy of an unfinished request has landed
            for manager_id, tracked in list(self._by_id.items()):
                if not tracked.finishing:
                    self.ongoing_offload.pop(manager_id, None)

    def _backed_up(self, event: BackupDone | BackupFailed) -> None:
        self.ongoing_backup.pop(event.request_id, None)
        tracked = self._by_id.get(event.request_id)
        if tracked is not None:
            self._forget_if_settled(tracked)
        if isinstance(event, BackupFailed):
            _limited.warning(
                "backup",
                "sglang_storage decode offload: backup of %s failed (%d of %d pages stored): %s",
                event.request_id,
                event.stored,
                event.pages,
                event.error,
            )

    def _forget_if_settled(self, tracked: _Tracked) -> None:
        """Stop tracking once the device KV is SGLang's again and the backup has ended."""
        device_settled = tracked.dropped or (tracked.released and tracked.freed)
        if device_settled and tracked.manager_id not in self.ongoing_backup:
            self._by_id.pop(tracked.manager_id, None)
            self.ongoing_offload.pop(tracked.manager_id, None)

    def _agree_min(self, op: str, value: int, *, late: int) -> int:
        """MIN of ``value`` over the TP ranks, or ``late`` when one did not answer in time."""
        agreed = self._ranks.agree_min(op, value, timeout_s=_RANK_TIMEOUT_S)
        if agreed is None:
            _limited.warning(
                f"rank-{op}",
                "sglang_storage decode offload: a TP rank did not answer %s in time",
                op,
            )
            return late
        return agreed

    def _release_finished_req(self, req: Any) -> None:
        """SGLang's release of a finished request's device KV (idempotent), then forget it."""
        super()._release_finished_req(req)
        tracked = self._tracked.pop(req, None)
        if tracked is not None:
            tracked.freed = True
            self._forget_if_settled(tracked)


def _stride(page_size: int) -> int:
    """SGLang's offload stride: ``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE`` in whole pages."""
    from sglang.srt.environ import envs

    env_stride = envs.SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE.get()
    if env_stride is None or env_stride <= 0:
        return page_size
    return int(max(page_size, (env_stride // page_size) * page_size))


def install(registry: Any = None) -> None:
    """Register :class:`DecodeOffloadAdapter` as SGLang's decode offload class.

    Call from the ``sglang.srt.plugins`` entry point (SGLang applies the hooks after the
    plug-ins ran). ``registry`` defaults to SGLang's ``HookRegistry``.
    """
    registry, hook_type = hook_registry(registry)
    registry.register(TARGET, DecodeOffloadAdapter, hook_type.REPLACE)
