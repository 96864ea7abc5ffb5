"""SGLang 0.5.23's NPU ``SparseKVCacheManager`` backed by our sparse KV manager.

With ``SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD=1`` (Ascend, a DSA MLA model), SGLang keeps each
request's whole MLA KV on the host, one dense ``[rows, max_context_len]`` shared-memory
tensor per layer, and every layer of every forward (map section 4.1, paths-v2 section 8):
writes its new rows there (``offload_v2``); in decode, copies its top-k into a caller
buffer, from a per-layer device window of the previous top-k where it can, from the host
otherwise (``materialize_selected_kv``); in prefill, gathers every request's whole prefix
from the host (``get_forward_kv``). :class:`NpuSparseAdapter` keeps that constructor,
those methods and what SGLang's attention path reads (``sparse_context_len``, the events
``hit_done`` / ``miss_done`` / ``refill_done`` / ``slot_map_done``), and puts the
layer-wise API of :class:`~sglang_storage.managers.sparse.SparseKVManager` behind them:

- host: a :class:`~sglang_storage.memory.KVHostPool` (MLA, one token per page) from the
  process's one host memory budget (component ``sparse``), sized as SGLang's dense buffers
  (``rows * max_context_len`` tokens); refused at start-up when the budget cannot hold it.
  Tokens take pages as they are written, and a row's pages are freed when SGLang gives the
  row to a new request.
- ``offload_v2`` / ``offload`` - SGLang's placement of the new rows (decode: one per
  request at ``seq_len - 1``; prefill: ragged or the graph's ``[B, tokens_per_req]``; the
  same validity masks), then per request ``offload_layer``.
- ``materialize_selected_kv`` - per request ``materialize_layer`` with the layer's
  ``device_kv_buffer`` row as its window; ``selected_kv_buffer[b, j]`` is the KV of
  ``topk[b, j]`` for every valid column, as SGLang's.
- ``get_forward_kv`` - per request ``read_layer_prefix`` into the compact TND tensors.
- ``reset_requests`` / ``init_req`` and rows newly allocated in ``req_to_token_pool``
  (through its ``_on_alloc_rows`` hook, chained to any already there): the row's request
  is dropped. SGLang's own class monkeypatches ``req_to_token_pool.alloc`` with a hook
  that reads ``req.req_pool_idx``, which 0.5.23's ``Req`` does not have.

A write that would leave a gap (a prefix not written on that layer) and a read of tokens
not written are :class:`~sglang_storage.errors.ConfigError`; SGLang's class reads
whatever the dense buffer held. Differences: the index planning runs on the host (one
device-to-host read of the indices per layer), so the calls are not capturable in an NPU
graph; every copy is synchronous on the caller's stream, so the four events are recorded
there when the copies are done. No kernel of ``sgl_kernel_npu`` is used.

Switching on: :func:`install` replaces SGLang's class (HookRegistry class REPLACE; the
class is imported lazily in ``AscendAttnBackend.__init__``) only where SGLang's NPU module
imports (``sgl_kernel_npu`` present); elsewhere it registers nothing. The replacement
builds SGLang's own class unless the server args carry sglang_storage settings with
``npu-sparse`` in ``--storage-managers``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Final

import torch

from sglang_storage.errors import ConfigError, StateError
from sglang_storage.managers import observability
from sglang_storage.managers.sparse import SparseKVConfig, SparseKVManager
from sglang_storage.memory import Attention, KVGeometry, KVHostPool, KVLayout
from sglang_storage_adapters import require_supported_sglang
from sglang_storage_adapters.plugin import hook_registry
from sglang_storage_adapters.runtime import (
    process_runtime,
    published_settings,
)

require_supported_sglang()

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402

__all__ = ["COMPONENT", "MANAGER", "MODULE", "TARGET", "NpuSparseAdapter", "install"]

log = logging.getLogger(__name__)

MODULE: Final = "sglang.srt.hardware_backend.npu.sparsity_driven_kv_offload.manager"
"""SGLang's NPU sparse KV module; it imports only where ``sgl_kernel_npu`` is installed."""
TARGET: Final = f"{MODULE}.SparseKVCacheManager"
"""The class :func:`install` replaces."""
MANAGER: Final = "npu-sparse"
"""The ``--storage-managers`` name that switches the adapter on."""
COMPONENT: Final = "sparse"
"""The runtime component the host pool draws memory as (shared with HiSparse)."""

_OWNER: Final = "sglang_storage NPU sparse KV adapter"
_EVENTS: Final = ("hit_done", "miss_done", "refill_done", "slot_map_done")
_original: list[type] = []  # SGLang's class, kept by install()


def _refuse(field: str, value: object, reason: str, allowed: str | None = None) -> ConfigError:
    return ConfigError(owner=_OWNER, field=field, value=value, reason=reason, allowed=allowed)


def _npu() -> Any:
    """``torch.npu`` (registered by ``torch_npu`` on an NPU host)."""
    npu = getattr(torch, "npu", None)
    if npu is None:
        raise StateError(subject=_OWNER, reason="torch.npu is not available (no torch_npu)")
    return npu


def _record(stream: Any, event: Any) -> None:
    if hasattr(stream, "record_event"):
        stream.record_event(event)
    else:
        event.record(stream)


def _topk_2d(topk: torch.Tensor) -> torch.Tensor:
    """DSA top-k indices as ``[batch, topk]`` (SGLang accepts 2-D, ``[B,1,K]``, ``[B,1,1,K]``)."""
    if topk.dim() == 2:
        return topk
    if topk.dim() in (3, 4) and all(d == 1 for d in topk.shape[1:-1]):
        return topk.reshape(topk.shape[0], topk.shape[-1])
    raise _refuse(
        "topk_indices",
        tuple(topk.shape),
        "must be [batch, topk], [batch, 1, topk] or [batch, 1, 1, topk]",
    )


class NpuSparseAdapter:
    """SGLang's NPU ``SparseKVCacheManager``, served by our sparse KV manager.

    Constructed like SGLang's class (``ascend_backend.py:371``); see the module docstring.
    Without sglang_storage settings naming ``npu-sparse``, constructing it builds SGLang's
    own class (the one :func:`install` found).

    Raises:
        ConfigError: ``sparse_context_len`` is not positive, the device pool is not an
            ``MLATokenToKVPool``, or sglang_storage is not configured.
        CapacityError: the host memory budget cannot hold the host pool.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """This adapter when sglang_storage serves ``npu-sparse``, else SGLang's own class."""
        settings = published_settings()
        if cls is NpuSparseAdapter and (settings is None or not settings.enabled(MANAGER)):
            if not _original:
                raise StateError(subject=_OWNER, reason="install() has not found SGLang's class")
            return _original[0](*args, **kwargs)
        return object.__new__(cls)

    def __init__(
        self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, sparse_context_len: int
    ) -> None:
        self.sparse_context_len = int(sparse_context_len)
        if self.sparse_context_len <= 0:
            raise _refuse("sparse_context_len", sparse_context_len, "must be positive")
        pool = token_to_kv_pool_allocator.get_kvcache()
        if not isinstance(pool, MLATokenToKVPool):
            raise _refuse("kvcache", type(pool).__name__, "is not served", "MLATokenToKVPool")
        settings = published_settings()
        if settings is None:
            raise _refuse(
                "--storage-managers",
                None,
                "sglang_storage is not configured in this process's server args",
                f"--storage-backend ... --storage-managers ...,{MANAGER}",
            )
        self.req_to_token_pool = req_to_token_pool
        self.paged_kv_cache = pool
        self.size = int(req_to_token_pool.req_to_token.shape[0])
        self.max_context_len = int(req_to_token_pool.max_context_len)
        self.device = req_to_token_pool.device
        self.start_layer = int(pool.start_layer)
        self.layer_num = int(pool.layer_num)
        self.head_num = 1
        self.kv_lora_rank = int(pool.kv_lora_rank)
        self.qk_rope_head_dim = int(pool.qk_rope_head_dim)
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.store_dtype = pool.store_dtype
        npu = _npu()
        for name in _EVENTS:
            setattr(self, name, npu.Event())
        # The per-layer device windows: row r of layer l holds r's previous top-k of l.
        self.device_kv_buffer: list[torch.Tensor] = [
            torch.zeros(
                (self.size, self.sparse_context_len, self.head_num, self.head_dim),
                dtype=self.store_dtype,
                device=self.device,
            )
            for _ in range(self.layer_num)
        ]
        geometry = KVGeometry(
            attention=Attention.MLA,
            layout=KVLayout.LAYER_FIRST,
            dtype=self.store_dtype,
            layer_num=self.layer_num,
            page_size=1,
            num_pages=self.size * self.max_context_len,
            head_num=self.head_num,
            head_dim=self.head_dim,
        )
        memory = process_runtime(settings).host_memory(COMPONENT)
        self.host_pool = KVHostPool(geometry, memory, label="NPU sparse KV host pool")
        observability.watch_pool(self.host_pool, COMPONENT)
        self.manager = SparseKVManager(
            host=self.host_pool,
            config=SparseKVConfig(
                device_slots=self.sparse_context_len,
                max_tokens=self.max_context_len,
                max_requests=self.size,
            ),
        )
        self.hit_tokens = 0
        """Selected tokens copied from a device window (the previous top-k), so far."""
        self.miss_tokens = 0
        """Selected tokens read from the host, so far."""
        self._rows: dict[int, str] = {}  # req_to_token row -> manager request
        self._count = 0
        previous = req_to_token_pool._on_alloc_rows

        def on_alloc_rows(rows: list[int]) -> None:
            if previous is not None:
                previous(rows)
            self.reset_requests(list(rows))

        req_to_token_pool._on_alloc_rows = on_alloc_rows
        log.info(
            "sglang_storage NPU sparse KV: %d rows x %d tokens x %d layers on the host, "
            "%d-token device windows",
            self.size,
            self.max_context_len,
            self.layer_num,
            self.sparse_context_len,
        )

    # ------------------------------------------------------------------ requests

    def init_req(self, req: Any) -> None:
        """Start ``req``'s row afresh (not for a later chunk of a chunked prefill)."""
        if getattr(req, "is_chunked", 0) > 0:
            return
        row = req.kv.req_pool_idx
        if row is None:
            raise StateError(
                subject=f"{_OWNER} request {req.rid!r}", reason="has no request pool row yet"
            )
        self.reset_requests([int(row)])

    def reset_requests(self, req_ids: list[int]) -> None:
        """Drop what the rows held: host pages and device windows."""
        for row in req_ids:
            manager_id = self._rows.pop(int(row), None)
            if manager_id is not None:
                self.manager.release(manager_id)

    def close(self) -> None:
        """Drop every row and give the host pool's memory back to the budget."""
        self.reset_requests(list(self._rows))
        self.host_pool.close()

    # ------------------------------------------------------------------ SGLang's seam

    def offload_v2(
        self, k: torch.Tensor, k_rope: torch.Tensor, layer: Any, forward_batch: Any, stream: Any
    ) -> None:
        """Write this forward's new rows of ``layer`` (compact ``[T, 1, dim]``) to the host."""
        rows = torch.cat([k, k_rope], dim=-1)
        self._offload(rows, self._layer(layer), forward_batch, stream)

    def offload(
        self, k: torch.Tensor, k_rope: torch.Tensor, layer: Any, forward_batch: Any, stream: Any
    ) -> None:
        """Write the rows at ``out_cache_loc`` of full KV views ``k`` / ``k_rope`` (v1)."""
        loc = forward_batch.out_cache_loc.to(torch.long)
        rows = torch.cat([k, k_rope], dim=-1)[loc.clamp(min=0)]
        self._offload(rows, self._layer(layer), forward_batch, stream)

    def materialize_selected_kv(
        self,
        layer: Any,
        forward_batch: Any,
        topk_indices: torch.Tensor,
        selected_kv_buffer: torch.Tensor,
        stream: Any,
    ) -> None:
        """``selected_kv_buffer[b, j]`` := layer KV of ``topk[b, j]`` for every valid column."""
        layer_idx = self._layer(layer)
        npu = _npu()
        stream = stream if stream is not None else npu.current_stream()
        topk = _topk_2d(topk_indices)
        if topk.shape[1] > self.sparse_context_len:
            raise _refuse(
                "topk_indices",
                int(topk.shape[1]),
                f"exceeds the device window (sparse_context_len {self.sparse_context_len})",
            )
        rows = forward_batch.req_pool_indices.to(device="cpu", dtype=torch.long).tolist()
        selected = topk.to(device="cpu", dtype=torch.long)
        with npu.stream(stream):
            for b, row in enumerate(rows):
                if not 0 <= row < self.size:
                    continue  # a padded request
                picks = selected[b]
                valid = (picks >= 0) & (picks < self.max_context_len)
                positions = picks[valid]
                columns = torch.nonzero(valid).reshape(-1)
                window = self.device_kv_buffer[layer_idx][row]
                target = selected_kv_buffer[b]
                if torch.equal(columns, torch.arange(columns.numel())):
                    out = target  # the valid columns are a prefix: fill in place
                else:
                    out = torch.empty_like(target)
                fill = self.manager.materialize_layer(
                    self._request(row), layer_idx, positions, window=window, out=out
                )
                self.hit_tokens += fill.hits
                self.miss_tokens += fill.misses
                if out is not target:
                    dest = columns.to(target.device)
                    target.index_copy_(0, dest, out[: columns.numel()])
            for name in _EVENTS:
                _record(stream, getattr(self, name))

    def get_forward_kv(
        self, layer: Any, forward_batch: Any, stream: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's whole prefix of ``layer``, compact TND ``(k_nope, k_pe)``."""
        layer_idx = self._layer(layer)
        if forward_batch.req_pool_indices is None or forward_batch.seq_lens is None:
            raise _refuse("forward_batch", None, "needs req_pool_indices and seq_lens")
        req_ids = forward_batch.req_pool_indices
        device = req_ids.device if req_ids.device.type == "npu" else torch.device(self.device)
        rows = req_ids.to(device="cpu", dtype=torch.long)
        lengths = forward_batch.seq_lens.to(device="cpu", dtype=torch.long)
        if rows.numel() != lengths.numel():
            raise _refuse(
                "seq_lens", int(lengths.numel()), f"must match req_pool_indices ({rows.numel()})"
            )
        keep = (lengths > 0) & (rows >= 0)
        rows, lengths = rows[keep], lengths[keep]
        if bool((rows >= self.size).any()) or bool((lengths > self.max_context_len).any()):
            raise _refuse(
                "forward_batch",
                (rows.tolist(), lengths.tolist()),
                f"rows must be < {self.size} and seq_lens <= {self.max_context_len}",
            )
        total = int(lengths.sum())
        kv = torch.empty(
            (total, self.head_num, self.head_dim), dtype=self.store_dtype, device=device
        )
        npu = _npu()
        with npu.stream(stream if stream is not None else npu.current_stream()):
            start = 0
            for row, n in zip(rows.tolist(), lengths.tolist(), strict=True):
                out = kv.narrow(0, start, n)
                self.manager.read_layer_prefix(self._request(row), layer_idx, n, out=out)
                start += n
        k_nope = kv.narrow(-1, 0, self.kv_lora_rank).contiguous()
        k_pe = kv.narrow(-1, self.kv_lora_rank, self.qk_rope_head_dim).contiguous()
        return k_nope, k_pe

    # ------------------------------------------------------------------ internals

    def _layer(self, layer: Any) -> int:
        layer_id = int(layer.layer_id if hasattr(layer, "layer_id") else layer)
        index = layer_id - self.start_layer
        if not 0 <= index < self.layer_num:
            raise _refuse(
                "layer",
                layer_id,
                "is not a layer of this pool",
                f"{self.start_layer} .. {self.start_layer + self.layer_num - 1}",
            )
        return index

    def _request(self, row: int) -> str:
        """The manager request of ``row``, admitted on first use."""
        manager_id = self._rows.get(row)
        if manager_id is None:
            self._count += 1
            manager_id = f"row{row}#{self._count}"
            self.manager.admit(manager_id)
            self._rows[row] = manager_id
        return manager_id

    def _offload(self, rows: torch.Tensor, layer_idx: int, forward_batch: Any, stream: Any) -> None:
        req, pos, valid = self._placement(forward_batch, int(rows.shape[0]))
        npu = _npu()
        with npu.stream(stream if stream is not None else npu.current_stream()):
            host_rows = rows.to("cpu")
            for row in torch.unique(req[valid]).tolist():
                mine = torch.nonzero(valid & (req == row)).reshape(-1)
                if not 0 <= row < self.size:
                    raise _refuse("req_pool_indices", row, f"must be < {self.size}")
                self.manager.offload_layer(
                    self._request(row), layer_idx, pos[mine], host_rows[mine]
                )

    def _placement(
        self, batch: Any, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per new row: its request row, its position and whether it is written (SGLang's)."""
        cpu = torch.device("cpu")
        req_ids = batch.req_pool_indices.to(device=cpu, dtype=torch.long)
        max_len = self.max_context_len
        loc = None if batch.out_cache_loc is None else batch.out_cache_loc.to(cpu, torch.long)
        if batch.forward_mode.is_decode():
            seq_lens = batch.seq_lens.to(device=cpu, dtype=torch.long)
            if req_ids.numel() != num_rows or loc is None or loc.numel() != num_rows:
                raise _refuse("k", num_rows, "decode rows must match the batch and out_cache_loc")
            pos = seq_lens - 1
            valid = (seq_lens != 1) & (loc >= 0) & (req_ids >= 0) & (pos >= 0) & (pos < max_len)
            return req_ids, pos, valid
        if batch.extend_seq_lens is None or batch.extend_prefix_lens is None:
            raise _refuse(
                "forward_batch", None, "prefill needs extend_seq_lens and extend_prefix_lens"
            )
        lens = batch.extend_seq_lens.to(device=cpu, dtype=torch.long)
        prefix = batch.extend_prefix_lens.to(device=cpu, dtype=torch.long)
        size = req_ids.numel()
        if lens.numel() != size or prefix.numel() > size:
            raise _refuse("extend_seq_lens", lens.numel(), f"must be padded to the batch ({size})")
        prefix = torch.cat([prefix, torch.zeros(size - prefix.numel(), dtype=torch.long)])
        if int(lens.sum()) == num_rows:  # ragged: [req0 tokens][req1 tokens]...
            starts = torch.cumsum(lens, 0) - lens
            req = torch.repeat_interleave(req_ids, lens)
            pos = torch.repeat_interleave(prefix - starts, lens) + torch.arange(num_rows)
            valid = (req >= 0) & (pos >= 0) & (pos < max_len)
        else:  # the graph's [B, tokens_per_req]
            if size == 0 or num_rows % size:
                raise _refuse(
                    "k", num_rows, f"must be sum(extend_seq_lens) or a multiple of batch {size}"
                )
            per = num_rows // size
            offsets = torch.arange(per).expand(size, per)
            req = req_ids.unsqueeze(1).expand(size, per).reshape(-1)
            pos2d = prefix.unsqueeze(1) + offsets
            valid = ((offsets < lens.unsqueeze(1)) & (pos2d < max_len)).reshape(-1) & (req >= 0)
            pos = pos2d.reshape(-1)
        if loc is not None and loc.numel() == num_rows:
            valid &= loc >= 0
        return req, pos, valid


def install(registry: Any = None) -> bool:
    """Register :class:`NpuSparseAdapter` as SGLang's NPU sparse KV manager, where it imports.

    Call from the ``sglang.srt.plugins`` entry point. ``registry`` defaults to SGLang's
    ``HookRegistry``. Returns False, registering nothing, where SGLang's NPU module cannot
    be imported (no ``sgl_kernel_npu``: not an NPU host).
    """
    try:
        module = importlib.import_module(MODULE)
    except ImportError as error:
        log.debug("sglang_storage: NPU sparse KV adapter not installed (%s)", error)
        return False
    original = module.SparseKVCacheManager
    if original is not NpuSparseAdapter:
        _original[:] = [original]
    registry, hook_type = hook_registry(registry)
    registry.register(TARGET, NpuSparseAdapter, hook_type.REPLACE)
    return True
