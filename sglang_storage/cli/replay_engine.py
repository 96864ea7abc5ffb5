"""The scheduler ``sglang-storage replay`` emulates, driving a real :class:`KVCacheManager`.

For each :class:`~sglang_storage.cli.workload.Turn` the engine does what SGLang's scheduler
does with HiCache, on a real device pool (CUDA when asked, CPU tensors otherwise), a real
host pool, the real pipelines and the chosen backend:

1. match the input's full pages: the prefix on device (an LRU map kept here), then on
   host and in storage (:meth:`KVCacheManager.match`);
2. ask the :class:`~sglang_storage.policy.CostModel` (fed with the bandwidths this run
   measures) whether loading the host and storage hits beats recomputing them;
3. prefetch the storage hit into host pages, waiting under the prefetch stop policy, then
   load every host page of the prefix into device pages and VERIFY each loaded page
   byte for byte against what was written for its key;
4. "compute" the rest of the input and the answer: write every new page with bytes derived
   from its key (:class:`KVPattern`), so any page that comes back can be checked;
5. hand the turn's pages to the write policy (``device_hit``), which writes them to host;
   the manager backs them up to storage.

Device pages are evicted (``device_evict`` first) when a turn needs room, least recently
used first; host pages likewise (``evict_host``), waiting for their release. Nothing here
starts a thread: the storage pipeline's workers are the only ones.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, cast

import attrs
import torch

from sglang_storage.cli.workload import Turn
from sglang_storage.config import (
    instance_of,
    non_negative_int,
    one_of,
    positive_int,
    positive_number,
)
from sglang_storage.core import Namespace
from sglang_storage.errors import CapacityError, OperationTimeoutError, StorageError
from sglang_storage.managers.kv import HostReleased, HostWriteDone, KVCacheManager, PrefetchDone
from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
)
from sglang_storage.policy import (
    PREFETCH_STOP_POLICY_NAMES,
    WRITE_POLICY_NAMES,
    CostModel,
    CostModelConfig,
    CostModelStats,
    PrefetchStopConfig,
    Tier,
    WritePolicyConfig,
    make_prefetch_stop_policy,
    make_write_policy,
)
from sglang_storage.storage import Backend
from sglang_storage.storage.backend import MemoryRegistrar
from sglang_storage.transfer import (
    DeviceHostPipeline,
    DeviceKV,
    DeviceTransferHandle,
    LatencySnapshot,
    PipelineMetrics,
    StoragePipeline,
    StoragePipelineConfig,
)
from sglang_storage.transfer.device import DeviceTransferMetrics
from sglang_storage.transfer.metrics import LatencyHistogram

__all__ = [
    "DTYPES",
    "EngineConfig",
    "EngineTotals",
    "KVPattern",
    "ModelShape",
    "ReplayEngine",
    "SkipCounts",
]

DTYPES: Final[dict[str, torch.dtype]] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""KV element types the replay accepts, by name."""

_POLL_S: Final = 0.0005  # sleep between polls while waiting for storage I/O
_SHOWN: Final = 5  # mismatched keys kept for the report


@attrs.frozen(kw_only=True)
class ModelShape:
    """The KV cache shape of the emulated model (MHA, one rank)."""

    layers: int = attrs.field(default=8, validator=positive_int)
    kv_heads: int = attrs.field(default=8, validator=positive_int)
    head_dim: int = attrs.field(default=64, validator=positive_int)
    page_size: int = attrs.field(default=16, validator=positive_int)
    dtype: str = attrs.field(default="bfloat16", validator=one_of(*DTYPES))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type."""
        return DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one layer in K (or V)."""
        return self.kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's KV over every layer."""
        return 2 * self.layers * self.row_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""
        return self.page_size * self.token_bytes

    def geometry(self, host_pages: int) -> KVGeometry:
        """The host pool's geometry (``page_first``, SGLang's default for storage)."""
        return KVGeometry(
            attention=Attention.MHA,
            layout=KVLayout.PAGE_FIRST,
            dtype=self.torch_dtype,
            layer_num=self.layers,
            page_size=self.page_size,
            num_pages=host_pages,
            head_num=self.kv_heads,
            head_dim=self.head_dim,
        )


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything the engine needs besides the backend; validated on construction."""

    shape: ModelShape = attrs.field(validator=instance_of(ModelShape))
    device_pages: int = attrs.field(validator=positive_int)
    host_pages: int = attrs.field(validator=positive_int)
    device: str = attrs.field(default="cpu", validator=one_of("cpu", "cuda"))
    write_policy: str = attrs.field(default="write_through", validator=one_of(*WRITE_POLICY_NAMES))
    prefetch_policy: str = attrs.field(
        default="wait_complete", validator=one_of(*PREFETCH_STOP_POLICY_NAMES)
    )
    prefetch_threshold_tokens: int = attrs.field(default=256, validator=non_negative_int)
    prefill_tokens_per_s: float = attrs.field(default=10_000.0, validator=positive_number)
    follow_cost_model: bool = attrs.field(default=True, validator=instance_of(bool))
    """Recompute hits the cost model says are cheaper to recompute; False: only count
    its decisions and load every hit."""
    storage_workers: int = attrs.field(default=2, validator=positive_int)
    io_wait_s: float = attrs.field(default=120.0, validator=positive_number)
    """The longest the engine waits for storage I/O before it gives up with an error."""


@attrs.frozen(kw_only=True)
class SkipCounts:
    """Storage-hit pages that were found but not loaded, by reason."""

    cost_model: int = 0
    """The cost model said recomputing is faster."""
    below_threshold: int = 0
    """Shorter than the prefetch threshold."""
    truncated: int = 0
    """Prefetched but not delivered: corrupt, missing or failed in storage."""
    host_full: int = 0
    """No host memory for the prefetch."""


@attrs.frozen(kw_only=True)
class EngineTotals:
    """What a replay did, as counted by the engine and its parts."""

    turns: int
    prompt_tokens: int
    decode_tokens: int
    device_tokens: int
    """Input tokens served by pages already on device."""
    host_tokens: int
    """Input tokens loaded from host pages."""
    storage_tokens: int
    """Input tokens prefetched from storage, then loaded."""
    computed_tokens: int
    """Input tokens recomputed (prefill)."""
    host_recomputed_tokens: int
    """Of ``computed_tokens``: host hits the cost model chose to recompute."""
    storage_found_pages: int
    skipped: SkipCounts
    verified_pages: int
    mismatched_pages: int
    mismatched_keys: tuple[str, ...]
    load_failures: int
    host_write_failures: int
    host_full_skips: int
    """Turns whose pages could not all be written to host for lack of room."""
    host_load_s: float
    """Seconds spent loading host hits to device."""
    storage_load_s: float
    """Seconds spent prefetching storage hits and loading them to device."""
    latency: Mapping[str, LatencySnapshot]
    device_metrics: DeviceTransferMetrics
    storage_metrics: PipelineMetrics
    cost: CostModelStats
    manager: Mapping[str, int]


class KVPattern:
    """Deterministic KV bytes per page key, written into and checked against a device pool.

    Each (layer, K/V) plane of a page holds a fixed random block XOR a 64-bit digest of the
    key, so a page read back under the wrong key, or with any bit changed, fails the check.
    The block depends only on ``salt`` (the model's fingerprint), so runs share it.
    """

    def __init__(self, device_kv: DeviceKV, *, salt: str) -> None:
        g = device_kv.geometry
        row_bytes = g.row_bytes
        if row_bytes % 8:
            raise ValueError(f"a token row of {row_bytes} bytes is not a multiple of 8 bytes")
        self._page = g.page_size
        self._device = device_kv.device
        self._words = [
            plane.view(torch.uint8).reshape(plane.shape[0], row_bytes).view(torch.int64)
            for layer in range(g.layer_num)
            for plane in device_kv.planes(layer)
        ]
        seed = int.from_bytes(hashlib.sha256(salt.encode()).digest()[:7], "little")
        gen = torch.Generator().manual_seed(seed)
        shape = (len(self._words), g.page_size, row_bytes // 8)
        self._base = torch.randint(-(2**63), 2**63 - 1, shape, generator=gen, dtype=torch.int64).to(
            self._device
        )

    def _marks(self, keys: Sequence[str]) -> torch.Tensor:
        marks = torch.tensor([_key_word(k) for k in keys], dtype=torch.int64, device=self._device)
        return marks.view(-1, 1, 1)

    def _expected(self, plane: int, marks: torch.Tensor) -> torch.Tensor:
        """``(pages * page_size, words)``: what the pages hold in one plane."""
        return (self._base[plane].unsqueeze(0) ^ marks).reshape(-1, self._base.shape[2])

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * self._page
        return (index + torch.arange(self._page)).reshape(-1).to(self._device)

    def fill(self, keys: Sequence[str], pages: Sequence[int]) -> None:
        """Write each key's bytes into its device page."""
        if not keys:
            return
        marks, index = self._marks(keys), self._index(pages)
        for n, words in enumerate(self._words):
            words.index_copy_(0, index, self._expected(n, marks))

    def check(self, keys: Sequence[str], pages: Sequence[int]) -> list[str]:
        """The keys whose device page does not hold exactly their bytes."""
        if not keys:
            return []
        marks, index = self._marks(keys), self._index(pages)
        bad: torch.Tensor | None = None
        for n, words in enumerate(self._words):
            got = words.index_select(0, index).view(len(keys), self._page, -1)
            got ^= marks  # a copy: undo each key's mark, leaving the shared block
            base = self._base[n].expand_as(got)
            if torch.equal(got, base):
                continue
            differ = (got != base).view(len(keys), -1).any(dim=1)
            bad = differ if bad is None else bad | differ
        if bad is None:
            return []
        return [k for k, b in zip(keys, bad.tolist(), strict=True) if b]


def _key_word(key: str) -> int:
    """A signed 64-bit digest of the whole key."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), signed=True)


class ReplayEngine:
    """Runs turns through the tiers; see the module docstring.

    Args:
        config: Shapes, budgets and policies.
        backend: The storage tier (the engine closes its pipeline, not the backend).
        namespace: Where the pages are stored.

    Raises:
        ConfigError: a bad policy name.
        CapacityError: the host budget does not fit this machine.
    """

    def __init__(self, config: EngineConfig, backend: Backend, namespace: Namespace) -> None:
        shape = config.shape
        self._config = config
        self._page = shape.page_size
        geometry = shape.geometry(config.host_pages)
        budget = HostMemoryBudget(
            BudgetConfig(total=geometry.total_bytes, kv=geometry.total_bytes, headroom=256 << 20)
        )
        self._host = KVHostPool(geometry, HostMemory(budget), label="replay host pool")
        device_kv = DeviceKV.allocate(
            geometry, config.device_pages * self._page, torch.device(config.device)
        )
        # Touch every page now, so first-use page faults do not count as transfer time.
        for layer in range(geometry.layer_num):
            for plane in device_kv.planes(layer):
                plane.fill_(0)
        self._host.kv_buffer.view(torch.uint8).fill_(0)
        self._pattern = KVPattern(device_kv, salt=namespace.model)
        self._device = DeviceHostPipeline(device_kv, self._host)
        self._registrar: MemoryRegistrar | None = None
        self._registered = self._host.kv_buffer.view(torch.uint8).reshape(-1).numpy().data
        if backend.capabilities.registers_memory:
            self._registrar = cast(MemoryRegistrar, backend)
            self._registrar.register_memory(self._registered)
        self._storage = StoragePipeline(
            backend, StoragePipelineConfig(workers=config.storage_workers)
        )
        self._stop = make_prefetch_stop_policy(
            PrefetchStopConfig(
                name=config.prefetch_policy,  # type: ignore[arg-type]
                threshold_tokens=config.prefetch_threshold_tokens,
            ),
            page_size=self._page,
        )
        self._write_back = config.write_policy == "write_back"
        self._manager = KVCacheManager(
            host=self._host,
            device=self._device,
            storage=self._storage,
            namespace=namespace,
            write_policy=make_write_policy(
                WritePolicyConfig(name=config.write_policy)  # type: ignore[arg-type]
            ),
            prefetch_policy=self._stop,
        )
        self._cost = CostModel(
            CostModelConfig(prior_prefill_tokens_per_s=config.prefill_tokens_per_s),
            bytes_per_token={"kv": shape.token_bytes},
        )
        # Device pages: key -> page, least recently used first.
        self._dev: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._dev_free = list(range(config.device_pages - 1, -1, -1))
        self._offloads: list[DeviceTransferHandle] = []  # may still read device pages
        self._timed: list[DeviceTransferHandle] = []  # offloads whose latency is not taken
        # Host pages the engine asked for, least recently used first, and those released.
        self._on_host: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._releasing: set[str] = set()
        self._hist = {name: LatencyHistogram() for name in ("d2h", "h2d", "prefetch", "turn")}
        self._n = collections.Counter[str]()
        self._skip = collections.Counter[str]()
        self._bad_keys: list[str] = []
        self._host_load_s = 0.0
        self._storage_load_s = 0.0

    # ------------------------------------------------------------------ one turn

    def run_turn(self, turn: Turn) -> None:
        """Serve one request through the tiers.

        Raises:
            OperationTimeoutError: storage I/O did not finish within ``io_wait_s``.
        """
        started = time.perf_counter()
        page = self._page
        keys = list(turn.keys)
        protect = set(keys)
        matchable = max(0, (turn.prompt_len - 1) // page)  # one input token is always computed
        prefix = keys[:matchable]
        d = 0
        while d < matchable and prefix[d] in self._dev:
            d += 1
        hits = self._manager.match(prefix, device_pages=d)
        h, s = hits.host_pages, hits.storage_pages
        if not self._advice(Tier.HOST, h):
            self._n["host_recomputed_tokens"] += h * page
            self._skip["cost_model"] += s
            h = s = 0
        self._n["storage_found_pages"] += s
        delivered: tuple[str, ...] = ()
        prefetch_s = 0.0
        if s:
            delivered, prefetch_s = self._prefetch(
                turn.index, prefix[d + h : d + h + s], prefix[d : d + h]
            )
        ready = prefix[d : d + h + len(delivered)]
        loaded = self._load(ready, h, prefetch_s, protect) if ready else 0
        served_host = min(h, loaded)
        self._n["device_tokens"] += d * page
        self._n["host_tokens"] += served_host * page
        self._n["storage_tokens"] += (loaded - served_host) * page
        self._n["computed_tokens"] += turn.prompt_len - (d + loaded) * page
        self._n["prompt_tokens"] += turn.prompt_len
        self._n["decode_tokens"] += turn.answer_len
        self._compute(keys[d + loaded :], protect)
        self._write_to_host(keys, protect)
        for key in reversed(keys):  # the prefix ends up most recent: evicted last
            self._dev.move_to_end(key)
        self._n["turns"] += 1
        self._poll()
        self._hist["turn"].observe(time.perf_counter() - started)

    def _prefetch(
        self, index: int, keys: list[str], keep: list[str]
    ) -> tuple[tuple[str, ...], float]:
        """Prefetch ``keys`` to host (``keep`` stays there); the delivered prefix and seconds."""
        n, page = len(keys), self._page
        if not self._stop.admits(n * page):
            self._skip["below_threshold"] += n
            return (), 0.0
        if not self._advice(Tier.STORAGE, n):
            self._skip["cost_model"] += n
            return (), 0.0
        started = time.perf_counter()
        rid = f"turn-{index}"
        deadline = started + self._config.io_wait_s
        # A key still being released would be "kept" by the prefetch as it is freed.
        while any(k in self._releasing for k in keys):
            self._poll()
            if any(k in self._releasing for k in keys):
                self._wait_io(deadline, "host pages to be released")
        if not self._host_room(n, set(keep)) or not self._manager.prefetch(rid, keys):
            self._skip["host_full"] += n
            return (), 0.0
        done: PrefetchDone | None = None
        while done is None:
            self._poll()
            done = self._manager.check_prefetch(rid)
            if done is None:
                self._wait_io(deadline, "a prefetch")
        elapsed = time.perf_counter() - started
        self._hist["prefetch"].observe(elapsed)
        self._storage_load_s += elapsed
        self._skip["truncated"] += n - len(done.keys)
        for key in done.keys:
            self._on_host[key] = None
        return done.keys, elapsed

    def _advice(self, tier: Tier, pages: int) -> bool:
        """Whether to load a hit of ``pages`` on ``tier`` (the cost model's decision is counted)."""
        if not pages:
            return True
        load = self._cost.decide(tier.value, pages * self._page).load
        return load or not self._config.follow_cost_model

    def _load(self, keys: list[str], from_host: int, prefetch_s: float, protect: set[str]) -> int:
        """Load ``keys`` (ready on host) to device and verify them; return pages served."""
        pages = self._device_pages(keys, protect)
        load = self._manager.load(keys, self._tokens(pages))
        result = load.handle.wait()
        if not result.ok:
            self._n["load_failures"] += 1
            self._release_device(keys)
            return 0
        self._hist["h2d"].observe(result.latency_s)
        stored = len(keys) - from_host
        host_share = result.latency_s * from_host / len(keys)
        self._host_load_s += host_share
        self._storage_load_s += result.latency_s - host_share
        page_bytes = self._host.geometry.page_bytes
        if from_host:
            self._cost.observe(Tier.HOST.value, from_host * page_bytes, max(host_share, 1e-9))
        if stored:  # the whole path: storage to host, then host to device
            self._cost.observe(
                Tier.STORAGE.value,
                stored * page_bytes,
                max(prefetch_s + result.latency_s - host_share, 1e-9),
            )
        bad = self._pattern.check(keys, pages)
        self._n["verified_pages"] += len(keys)
        if bad:
            self._n["mismatched_pages"] += len(bad)
            self._bad_keys += bad[: _SHOWN - len(self._bad_keys)]
        for key in reversed(keys):  # most recently used: the prefix last
            self._on_host.pop(key, None)
            self._on_host[key] = None
        return len(keys)

    def _compute(self, keys: list[str], protect: set[str]) -> None:
        pages = self._device_pages(keys, protect)
        self._pattern.fill(keys, pages)

    def _write_to_host(self, keys: list[str], protect: set[str]) -> None:
        if not keys:
            return
        if not self._write_back:
            need = sum(k not in self._on_host and k not in self._releasing for k in keys)
            if not self._host_room(need, protect):
                self._n["host_full_skips"] += 1
                return
        try:
            write = self._manager.device_hit(keys, self._tokens([self._dev[k] for k in keys]))
        except CapacityError:
            self._n["host_full_skips"] += 1
            return
        if write is not None:
            self._track(write.handle, write.keys)

    # ------------------------------------------------------------------ device pages

    def _tokens(self, pages: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * self._page
        return (index + torch.arange(self._page)).reshape(-1)

    def _device_pages(self, keys: Sequence[str], protect: set[str]) -> list[int]:
        """A device page for each key (a key already on device gives up its old page)."""
        self._release_device(k for k in keys if k in self._dev)
        short = len(keys) - len(self._dev_free)
        if short > 0:
            victims = [k for k in self._dev if k not in protect][:short]
            if len(victims) < short:
                raise CapacityError(
                    resource="replay device pool",
                    requested=len(keys),
                    available=len(self._dev_free) + len(victims),
                    hint="raise --device-mem",
                )
            self._evict_device(victims, protect)
        pages = [self._dev_free.pop() for _ in keys]
        for key, page in zip(keys, pages, strict=True):
            self._dev[key] = page
        return pages

    def _evict_device(self, victims: list[str], protect: set[str]) -> None:
        pages = [self._dev[k] for k in victims]
        if self._write_back:
            need = sum(k not in self._on_host for k in victims)
            if self._host_room(need, protect):
                try:
                    write = self._manager.device_evict(victims, self._tokens(pages))
                except CapacityError:
                    write = None
                if write is not None:
                    self._track(write.handle, write.keys)
        else:
            self._manager.device_evict(victims, self._tokens(pages))
        self._release_device(victims)

    def _release_device(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        for handle in self._offloads:  # they may still read these pages
            handle.fence()
        self._offloads.clear()
        for key in keys:
            self._dev_free.append(self._dev.pop(key))

    def _track(self, handle: DeviceTransferHandle, keys: Sequence[str]) -> None:
        self._offloads.append(handle)
        self._timed.append(handle)
        for key in reversed(keys):
            self._on_host[key] = None
            self._on_host.move_to_end(key)

    # ------------------------------------------------------------------ host pages

    def _host_free(self) -> int:
        return self._config.host_pages - self._host.slots.stats().used

    def _host_room(self, n: int, protect: set[str]) -> bool:
        """Make ``n`` host pages free, evicting unprotected ones; False when impossible."""
        if n <= 0:
            return True
        deadline = time.perf_counter() + self._config.io_wait_s
        while self._host_free() < n:
            short = n - self._host_free() - len(self._releasing)
            if short > 0:
                batch = max(short, self._config.host_pages // 16)
                victims = [k for k in self._on_host if k not in protect][:batch]
                if len(victims) < short and not self._releasing:
                    return False
                for key in victims:
                    del self._on_host[key]
                self._releasing.update(victims)
                self._manager.evict_host(victims)
            self._poll()
            if self._host_free() < n:
                self._wait_io(deadline, "host pages to be released")
        return True

    # ------------------------------------------------------------------ completions

    def _poll(self) -> None:
        for event in self._manager.poll():
            if isinstance(event, HostReleased):
                self._releasing.difference_update(event.keys)
            elif isinstance(event, HostWriteDone) and event.error is not None:
                self._n["host_write_failures"] += len(event.keys)
                for key in event.keys:
                    self._on_host.pop(key, None)
                    self._releasing.add(key)
        still = []
        for handle in self._timed:
            if handle.done():
                result = handle.wait()
                if result.ok:
                    self._hist["d2h"].observe(result.latency_s)
            else:
                still.append(handle)
        self._timed = still

    def _wait_io(self, deadline: float, what: str) -> None:
        if time.perf_counter() > deadline:
            raise OperationTimeoutError(
                operation=f"replay waiting for {what}", timeout_s=self._config.io_wait_s
            )
        threading.Event().wait(_POLL_S)

    # ------------------------------------------------------------------ end

    def finish(self) -> EngineTotals:
        """Wait for the backups in flight, close the pipelines and return the totals.

        Under ``write_back`` the host's pages are evicted (so backed up) first.

        Raises:
            OperationTimeoutError: the backups did not finish within ``io_wait_s``.
        """
        deadline = time.perf_counter() + self._config.io_wait_s
        if self._write_back:  # write back what the host holds, as at shutdown
            self._releasing.update(self._on_host)
            self._manager.evict_host(list(self._on_host))
            self._on_host.clear()
        self._poll()
        while self._storage.metrics().in_flight or self._timed or self._manager.backups_in_flight:
            self._wait_io(deadline, "backups to finish")
            self._poll()
        device_metrics = self._device.metrics()
        storage_metrics = self._storage.metrics()
        latency = {name: h.snapshot() for name, h in self._hist.items()}
        latency["storage_get"] = storage_metrics.get.latency
        latency["storage_put"] = storage_metrics.put.latency
        latency["storage_exists"] = storage_metrics.exists.latency
        self.close()
        n = self._n
        return EngineTotals(
            turns=n["turns"],
            prompt_tokens=n["prompt_tokens"],
            decode_tokens=n["decode_tokens"],
            device_tokens=n["device_tokens"],
            host_tokens=n["host_tokens"],
            storage_tokens=n["storage_tokens"],
            computed_tokens=n["computed_tokens"],
            host_recomputed_tokens=n["host_recomputed_tokens"],
            storage_found_pages=n["storage_found_pages"],
            skipped=SkipCounts(**self._skip),
            verified_pages=n["verified_pages"],
            mismatched_pages=n["mismatched_pages"],
            mismatched_keys=tuple(self._bad_keys),
            load_failures=n["load_failures"],
            host_write_failures=n["host_write_failures"],
            host_full_skips=n["host_full_skips"],
            host_load_s=self._host_load_s,
            storage_load_s=self._storage_load_s,
            latency=latency,
            device_metrics=device_metrics,
            storage_metrics=storage_metrics,
            cost=self._cost.stats(),
            manager=attrs.asdict(self._manager.stats()),
        )

    def close(self) -> None:
        """Stop the pipelines (idempotent); the backend stays open."""
        with contextlib.suppress(StorageError):
            self._storage.close(timeout_s=self._config.io_wait_s)
        self._device.close()
        if self._registrar is not None:
            self._registrar.unregister_memory(self._registered)
            self._registrar = None
        self._host.close()
