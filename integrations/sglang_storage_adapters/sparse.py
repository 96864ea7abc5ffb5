"""SGLang 0.5.23's ``HiSparseCoordinator`` backed by our sparse KV manager.

HiSparse (``--enable-hisparse``, DSA models) keeps a request's whole KV on the host and
only a small device buffer per request; every decode step each attention layer swaps the
top-k selected tokens into that buffer (map section 4.2). SGLang's coordinator does this
with its own host pool, streams, ack queue, a GPU-side LRU and CUDA swap-in kernels.
:class:`HiSparseAdapter` keeps the coordinator's constructor and every method and
attribute SGLang's callers use, and puts
:class:`~sglang_storage.managers.sparse.SparseKVManager` behind them:

- device: at construction the adapter reserves one contiguous run of
  ``rows * device_buffer_size`` token slots of SGLang's HiSparse device pool (from its
  ``hisparse_attn_allocator``) and gives the manager views of those slots, no copy; a
  request's region is ``device_buffer_size`` of them, and every device location the
  adapter hands SGLang is ``base + the manager's slot``.
- host: a :class:`~sglang_storage.memory.KVHostPool` with one token per page, sized to the
  allocator's logical capacity (``host_to_device_ratio`` times the device pool).
- ``admit_request_into_staging(req)`` - the prefill's KV is copied (device to device)
  into the request's region chunk by chunk; the least recently used tokens go to the host
  as the region fills; the prefill's own HiSparse slots are freed.
  ``collect_ready_reqs()`` returns the staged requests every TP rank has ready (MIN
  all-reduce); ``ack_staging_queue`` / ``has_ongoing_staging()`` as SGLang's.
- ``map_last_loc_to_buffer(...)`` - each decode step gives the new token a slot in the
  region (evicting the least recently used token to the host when full) and points SGLang's
  ``full_to_hisparse_device_index_mapping`` at it, so the model writes its KV there.
- ``swap_in_selected_pages(req_pool_indices, seq_lens, top_k, layer_id)`` - per request a
  top-k prefetch: resident tokens are hits, misses are loaded host->device (the layer is
  waited on); returns the ``int32`` device locations, ``-1`` for padding. The newest token
  is kept resident through the step (its KV of later layers is not written yet).
- ``request_finished`` / ``retract_req`` / ``abort_staging_request`` - the request's
  region and host pages are freed and its mapping entries cleared (so SGLang's own
  ``release_kv_cache`` frees only its logical slots).
- ``get_token_stats()``, ``destroy()``, ``set_decode_producer_stream``,
  ``wait_for_pending_backup`` (copies are fenced by the manager's pipeline),
  ``allocate_spec_scratch`` (no speculative scratch), ``num_real_reqs``,
  ``device_buffer_size``, ``top_k``, ``raw_indices_buffer``.

Served: DSA models (``HiSparseDSATokenToKVPool`` + ``HiSparseTokenToKVPoolAllocator``),
no speculative decoding, ``device_buffer_size > top_k``. Refused with a
:class:`~sglang_storage.errors.ConfigError` at construction: DeepSeek V4 and MiniMax M3
pools, speculative decoding, shared-index prefetch is ignored (every layer swaps in
synchronously). ``admit_request_direct`` (PD decode with KV written straight into SGLang's
host pool) and ``mem_pool_host`` raise :class:`~sglang_storage.errors.StateError`: the host
pages are ours, not an SGLang host pool.

Differences from SGLang's coordinator: tokens move to the host when evicted, not eagerly
each step; the manager's residency is per token across all layers, so a layer whose top-k
differs from the previous layer's loads all layers of its misses.

Switching on: :func:`install` replaces SGLang's class (HookRegistry class REPLACE; the
coordinator is imported lazily in ``ModelRunner.maybe_init_hisparse_coordinator``). The
replacement builds SGLang's own class unless the server args carry sglang_storage
settings with ``sparse`` in ``--storage-managers``.

NPU: SGLang's ``SparseKVCacheManager`` (``hardware_backend/npu/...``) is adapted in
:mod:`.npu_sparse`, on the manager's layer-wise API; this module registers nothing for it.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import attrs
import torch

from sglang_storage.errors import ConfigError, StateError
from sglang_storage.managers import observability
from sglang_storage.managers.sparse import SparseKVConfig, SparseKVManager
from sglang_storage.memory import Attention, KVGeometry, KVHostPool, KVLayout
from sglang_storage.transfer import DeviceHostPipeline, DeviceKV
from sglang_storage_adapters import metrics, require_supported_sglang
from sglang_storage_adapters.plugin import hook_registry
from sglang_storage_adapters.runtime import (
    process_runtime,
    published_settings,
)

require_supported_sglang()

# As a module: HookRegistry rebinds every module attribute that *is* the replaced class.
import sglang.srt.managers.hisparse_coordinator as _sglang_hisparse  # noqa: E402
from sglang.srt.mem_cache.allocator.hisparse import (  # noqa: E402
    HiSparseTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool  # noqa: E402

__all__ = ["TARGET", "HiSparseAdapter", "install"]

log = logging.getLogger(__name__)

TARGET: Final = "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator"
"""The class :func:`install` replaces."""

_OWNER: Final = "sglang_storage HiSparse adapter"


def _refuse(field: str, value: object, reason: str, allowed: str | None = None) -> ConfigError:
    return ConfigError(owner=_OWNER, field=field, value=value, reason=reason, allowed=allowed)


@attrs.define(eq=False)
class _Request:
    manager_id: str
    req: Any


class HiSparseAdapter(_sglang_hisparse.HiSparseCoordinator):  # type: ignore[misc]
    """SGLang's ``HiSparseCoordinator``, served by our sparse KV manager.

    Constructed like SGLang's class (``model_runner.py:1042``); see the module docstring.
    Without sglang_storage settings naming ``sparse``, constructing it builds SGLang's own
    class.

    Raises:
        ConfigError: a pool, allocator or option the adapter does not serve, or the
            HiSparse device pool has no contiguous run of slots left to reserve.
        CapacityError: the host memory budget cannot hold the host pool.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """This adapter when sglang_storage serves ``sparse``, else SGLang's own class."""
        settings = published_settings()
        if cls is HiSparseAdapter and (settings is None or not settings.enabled("sparse")):
            original: Any = object.__new__(HiSparseAdapter.__bases__[0])
            original.__init__(*args, **kwargs)
            return original
        return object.__new__(cls)

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        top_k: int,
        device_buffer_size: int,
        device: str,
        tp_group: Any,
        host_to_device_ratio: int = 2,
        swap_in_block_size: int = 960,
        shared_index_layers: list[bool] | None = None,
        num_draft_tokens: int = 0,
    ) -> None:
        allocator = token_to_kv_pool_allocator
        if type(allocator) is not HiSparseTokenToKVPoolAllocator:
            raise _refuse(
                "token_to_kv_pool_allocator",
                type(allocator).__name__,
                "is not served (DeepSeek V4 HiSparse is not)",
                "HiSparseTokenToKVPoolAllocator",
            )
        pool = allocator.get_kvcache()
        if not isinstance(pool, HiSparseDSATokenToKVPool):
            raise _refuse(
                "kvcache",
                type(pool).__name__,
                "is not served (MiniMax M3 HiSparse is not)",
                "HiSparseDSATokenToKVPool",
            )
        if num_draft_tokens:
            raise _refuse(
                "num_draft_tokens", num_draft_tokens, "speculative decoding is not served"
            )
        if not 0 < top_k < device_buffer_size:
            raise _refuse(
                "device_buffer_size",
                device_buffer_size,
                f"must exceed top_k ({top_k}): the newest token stays resident beside the top-k",
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = allocator
        self.mem_pool_device = pool
        self.top_k = top_k
        self.device_buffer_size = device_buffer_size
        self.device = device
        self.tp_group = tp_group
        self.tp_world_size = torch.distributed.get_world_size(group=tp_group)
        self.swap_in_block_size = swap_in_block_size
        self.page_size = int(pool.page_size)
        self.compress_ratio = 1
        self.is_dsv4_hisparse = False
        self.is_m3_hisparse = False
        self.enable_prefetch = False
        self.decode_producer_stream: Any = None
        self.ack_staging_queue: list[Any] = []
        rows = int(req_to_token_pool.req_to_token.shape[0])
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.raw_indices_buffer = torch.full((rows, top_k), -1, dtype=torch.int32, device=device)
        self._requests: dict[int, _Request] = {}  # req_pool_idx -> request
        self._count = 0

        geometry = KVGeometry(
            attention=Attention.MLA,
            layout=KVLayout.LAYER_FIRST,
            dtype=pool.store_dtype,
            layer_num=int(pool.layer_num),
            page_size=1,
            num_pages=int(allocator.size_full),
            head_num=1,
            head_dim=int(pool.kv_cache_dim),
        )
        settings = published_settings()
        if settings is None:
            raise _refuse(
                "--storage-managers",
                None,
                "sglang_storage is not configured in this process's server args",
                "--storage-backend ... --storage-managers ...,sparse",
            )
        # The process's one host memory budget (shared with every other adapter).
        memory = process_runtime(settings).host_memory("sparse")
        self._reserved = self._reserve(rows * device_buffer_size)
        self.base = int(self._reserved[0])
        end = self.base + rows * device_buffer_size
        device_kv = DeviceKV(
            geometry=geometry, k=tuple(buffer[self.base : end] for buffer in pool.kv_buffer)
        )
        self.host_pool = KVHostPool(geometry, memory, label="HiSparse host pool")
        pipeline = DeviceHostPipeline(device_kv, self.host_pool)
        observability.watch_device_pipeline(pipeline, "sparse")
        observability.watch_pool(self.host_pool, "sparse")
        self.manager = SparseKVManager(
            host=self.host_pool,
            device=pipeline,
            config=SparseKVConfig(
                device_slots=device_buffer_size,
                max_tokens=int(req_to_token_pool.max_context_len),
                max_requests=rows,
            ),
        )
        log.info(
            "sglang_storage HiSparse: %d requests x %d device slots at %d, %d host tokens",
            rows,
            device_buffer_size,
            self.base,
            geometry.num_pages,
        )

    # ------------------------------------------------------------------ set-up

    def _reserve(self, tokens: int) -> torch.Tensor:
        """One contiguous run of HiSparse device slots, whole pages, held until destroy."""
        pages = -(-tokens // self.page_size) * self.page_size
        slots = self.token_to_kv_pool_allocator.hisparse_attn_allocator.alloc(pages)
        if slots is None:
            raise _refuse(
                "device_buffer_size",
                self.device_buffer_size,
                f"the HiSparse device pool has no {pages} free slots for the request buffers",
            )
        run: torch.Tensor = slots.to(device="cpu", dtype=torch.int64)
        if not torch.equal(run, torch.arange(int(run[0]), int(run[0]) + pages)):
            self.token_to_kv_pool_allocator.free_hisparse_indices(slots)
            raise _refuse(
                "token_to_kv_pool_allocator",
                "fragmented HiSparse device slots",
                "the request buffers need one contiguous run; build the adapter before "
                "any request is admitted",
            )
        return run

    @property
    def mem_pool_host(self) -> Any:
        """SGLang's host pool: there is none (the host pages are sglang_storage's)."""
        raise StateError(
            subject=_OWNER,
            reason="HiSparse host pages are sglang_storage's; the direct-to-host PD path "
            "that writes SGLang's host pool is not served (drop 'sparse' from "
            "--storage-managers)",
        )

    # ------------------------------------------------------------------ SGLang's seam

    def set_decode_producer_stream(self, stream: Any) -> None:
        """Remember the stream decode batches are produced on (SGLang's bookkeeping)."""
        self.decode_producer_stream = stream

    def allocate_spec_scratch(self, req_pool_indices: list[int]) -> None:
        """No speculative scratch: speculative decoding is refused at construction."""

    def destroy(self) -> None:
        """Drop every request, give the reserved device slots back, close the host pool."""
        for entry in list(self._requests.values()):
            self.manager.release(entry.manager_id)
        self._requests.clear()
        mapping = self.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping
        self.token_to_kv_pool_allocator.free_hisparse_indices(self._reserved.to(mapping.device))
        self.host_pool.close()

    def get_token_stats(self) -> Any:
        """Device and host token usage, as SGLang's ``HiSparseTokenStats``."""
        resident = sum(
            int(self.manager.resident(e.manager_id).numel()) for e in self._requests.values()
        )
        device_capacity = int(self._reserved.numel())
        stats = self.host_pool.stats()
        host_capacity = self.host_pool.geometry.num_pages
        host_tokens = stats.used_bytes // max(self.host_pool.geometry.page_bytes, 1)
        return _sglang_hisparse.HiSparseTokenStats(
            device_tokens=resident,
            device_token_usage=resident / device_capacity if device_capacity else 0.0,
            host_tokens=host_tokens,
            host_token_usage=host_tokens / host_capacity if host_capacity else 0.0,
        )

    def admit_request_into_staging(self, req: Any) -> None:
        """Move the prefill's KV into the request's region (the rest goes to the host)."""
        req.hisparse_staging = True
        idx = int(req.kv.req_pool_idx)
        logical = self.req_to_token_pool.req_to_token[idx, : req.extend_end].to(torch.int64)
        mapping = self.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping
        source = mapping[logical].clone()
        self._count += 1
        entry = _Request(manager_id=f"{req.rid}#{self._count}", req=req)
        self.manager.admit(entry.manager_id)
        self._requests[idx] = entry
        buffers = self.mem_pool_device.kv_buffer
        for start in range(0, int(source.numel()), self.device_buffer_size):
            chunk = source[start : start + self.device_buffer_size]
            slots = self.manager.append(entry.manager_id, int(chunk.numel())) + self.base
            slots = slots.to(chunk.device)
            for buffer in buffers:
                buffer[slots] = buffer[chunk]
        self.token_to_kv_pool_allocator.free_hisparse_indices(source[source > 0])
        mapping[logical] = 0
        self.ack_staging_queue.append(_sglang_hisparse.HiSparseAct(None, None, req))

    def admit_request_direct(self, req: Any) -> None:
        """Not served: SGLang's PD path wrote the KV into an SGLang host pool."""
        raise StateError(
            subject=f"{_OWNER} request {req.rid!r}",
            reason="the direct-to-host PD admission is not served by sglang_storage",
        )

    def host_token_len(self, kv_allocated_len: int) -> int:
        """Host tokens of a request with ``kv_allocated_len`` tokens (no compression)."""
        return int(kv_allocated_len)

    def has_ongoing_staging(self) -> bool:
        """Whether a staged request waits for :meth:`collect_ready_reqs`."""
        return bool(self.ack_staging_queue)

    def collect_ready_reqs(self) -> list[Any]:
        """The staged requests every TP rank has ready, oldest first."""
        metrics.refresh()  # the scheduler asks every step
        ready = len(self.ack_staging_queue)
        if ready and self.tp_world_size > 1:
            count = torch.tensor(ready, dtype=torch.int)
            torch.distributed.all_reduce(
                count, op=torch.distributed.ReduceOp.MIN, group=self.tp_group
            )
            ready = int(count.item())
        done, self.ack_staging_queue = (
            self.ack_staging_queue[:ready],
            self.ack_staging_queue[ready:],
        )
        reqs = [act.req for act in done]
        for req in reqs:
            req.hisparse_staging = False
        return reqs

    def map_last_loc_to_buffer(
        self,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        req_pool_indices_cpu: torch.Tensor,
    ) -> None:
        """Give each request's new token a device slot; the model writes its KV there."""
        mapping = self.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping
        locs = out_cache_loc.to(torch.int64)
        for i, idx in enumerate(req_pool_indices_cpu.tolist()):
            entry = self._entry(int(idx))
            slot = self.manager.append(entry.manager_id, 1) + self.base
            mapping[locs[i : i + 1]] = slot.to(mapping.device)

    def wait_for_pending_backup(self) -> None:
        """Nothing to wait for: the manager fences its device->host copies."""

    def swap_in_selected_pages(
        self,
        req_pool_indices: torch.Tensor,
        compressed_seq_lens: torch.Tensor,
        top_k_result: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        """Make each request's top-k tokens resident; their device locations (``int32``).

        ``top_k_result[i]`` holds token positions of request ``i`` (``-1`` is padding);
        the result has the same shape, ``-1`` where the input was padding.
        """
        if top_k_result.dim() != 2:
            raise _refuse(
                "top_k_result",
                tuple(top_k_result.shape),
                "must be [requests, top_k] (speculative top-k is not served)",
            )
        out = torch.full(top_k_result.shape, -1, dtype=torch.int32)
        selected = top_k_result.to(device="cpu", dtype=torch.int64)
        lengths = compressed_seq_lens.to("cpu").tolist()
        for i, idx in enumerate(req_pool_indices.to("cpu").tolist()):
            entry = self._entry(int(idx))
            row = selected[i]
            valid = (row >= 0) & (row < int(lengths[i]))
            positions = row[valid]
            newest = int(lengths[i]) - 1
            wanted = positions
            if newest >= 0 and not bool((positions == newest).any()):
                wanted = torch.cat([positions, torch.tensor([newest])])  # keep it resident
            result = self.manager.prefetch(entry.manager_id, wanted)
            if result.load is not None:
                result.load.wait_layer(layer_id)
            out[i, valid] = (result.device_tokens[: positions.numel()] + self.base).to(torch.int32)
        return out.to(top_k_result.device)

    def naive_load_topk(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        top_k_tokens: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        """SGLang's reference swap-in; the same as :meth:`swap_in_selected_pages` here."""
        return self.swap_in_selected_pages(req_pool_indices, seq_lens, top_k_tokens, layer_id)

    def abort_staging_request(self, req: Any) -> None:
        """Drop a request that was staged but not yet collected."""
        self.ack_staging_queue = [act for act in self.ack_staging_queue if act.req is not req]
        self.request_finished(req)
        req.hisparse_staging = False

    def retract_req(self, req: Any) -> None:
        """Drop a retracted request (staged or decoding)."""
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
        else:
            self.request_finished(req)

    def request_finished(self, req: Any) -> None:
        """Free the request's region and host pages; clear its device mapping entries."""
        idx = req.kv.req_pool_idx
        entry = None if idx is None else self._requests.pop(int(idx), None)
        if entry is None or entry.req is not req:
            return
        self.manager.release(entry.manager_id)
        allocated = self.req_to_token_pool.req_to_token[int(idx), : req.kv.kv_allocated_len]
        mapping = self.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping
        mapping[allocated.to(torch.int64)] = 0  # SGLang's release frees logical slots only

    # ------------------------------------------------------------------ internals

    def _entry(self, req_pool_idx: int) -> _Request:
        entry = self._requests.get(req_pool_idx)
        if entry is None:
            raise StateError(
                subject=f"{_OWNER} request slot {req_pool_idx}", reason="no staged request"
            )
        return entry


def install(registry: Any = None) -> None:
    """Register :class:`HiSparseAdapter` as SGLang's HiSparse coordinator class.

    Call from the ``sglang.srt.plugins`` entry point. ``registry`` defaults to SGLang's
    ``HookRegistry``. The NPU ``SparseKVCacheManager`` is :mod:`.npu_sparse`'s.
    """
    registry, hook_type = hook_registry(registry)
    registry.register(TARGET, HiSparseAdapter, hook_type.REPLACE)
