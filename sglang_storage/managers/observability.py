"""The process's metrics: live components' counters as named metric families, read at scrape time.

Nothing here runs per operation. Components keep the counters they already keep
(``StoragePipeline.metrics()``, ``DeviceHostPipeline.metrics()``, ``Backend.stats()``,
managers' ``stats()``, host pools' ``stats()``, the runtime's budget); a scrape reads those
snapshots and names them after Prometheus' conventions
(``sglang_storage_<subsystem>_<name>_<unit>``, ``_total`` for counters, histograms for
latency, labels for component, operation, direction, tier, kind, backend and result).

- :data:`FAMILIES` - every metric family: name, type, help and label names (the README's
  "Metrics" table lists the same).
- :class:`MetricSources` - the registry of live sources; :data:`SOURCES` is the process's.
  ``add(owner, convert)`` holds ``owner`` weakly and calls ``convert(owner)`` at each
  ``collect()``; ``remove(owner)`` (a component closing) takes a last snapshot, and
  ``capture(owner)`` one that stands in for it once it can no longer be read. Counters
  and histograms of sources that are gone stay in the totals, so a counter never goes
  down when a component is rebuilt; gauges of gone sources disappear.
- Converters, one per snapshot type: :func:`pipeline_families`,
  :func:`device_families`, :func:`backend_families`, :func:`controller_families`,
  :func:`kv_families`, :func:`decode_families`, :func:`pool_families`,
  :func:`runtime_families`, :func:`store_families`.
- ``watch_*`` - add one live component of a kind to :data:`SOURCES` (or another
  registry) with its converter: what adapters and tools call when they build one.

The Prometheus side (``prometheus_client`` collectors, text exposition, SGLang's
multiprocess directory) is :mod:`sglang_storage.managers.prometheus`; this module needs
no third-party package.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, Protocol, TypeVar

import attrs

from sglang_storage.errors import StorageError
from sglang_storage.managers.controller import CacheController, ControllerStats
from sglang_storage.managers.decode import DecodeOffloadManager, DecodeOffloadStats
from sglang_storage.managers.kv import KVCacheManager, KVCacheStats
from sglang_storage.managers.runtime import COMPONENTS, StorageRuntime
from sglang_storage.memory.stats import PoolStats
from sglang_storage.storage import Backend, BackendStats, ScanSummary
from sglang_storage.transfer import DeviceHostPipeline, StoragePipeline
from sglang_storage.transfer.device_types import DeviceTransferMetrics
from sglang_storage.transfer.metrics import LatencySnapshot, PipelineMetrics

__all__ = [
    "FAMILIES",
    "SOURCES",
    "FamilySpec",
    "HistogramValue",
    "MetricFamily",
    "MetricSources",
    "MetricType",
    "Sample",
    "backend_families",
    "controller_families",
    "decode_families",
    "device_families",
    "kv_families",
    "pipeline_families",
    "pool_families",
    "runtime_families",
    "store_families",
    "watch_backend",
    "watch_controller",
    "watch_decode",
    "watch_device_pipeline",
    "watch_kv_manager",
    "watch_pool",
    "watch_storage_pipeline",
]

log = logging.getLogger(__name__)

PREFIX: Final = "sglang_storage_"
"""Every family's name starts with this."""

T = TypeVar("T")


class MetricType(enum.Enum):
    """A metric family's Prometheus type."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@attrs.frozen(kw_only=True)
class FamilySpec:
    """What one metric family is: its name, type, meaning and label names."""

    name: str
    """The full name (counters end in ``_total``)."""
    type: MetricType
    help: str
    labels: tuple[str, ...]


def _spec(name: str, type_: MetricType, help_: str, *labels: str) -> FamilySpec:
    return FamilySpec(name=PREFIX + name, type=type_, help=help_, labels=labels)


_C, _G, _H = MetricType.COUNTER, MetricType.GAUGE, MetricType.HISTOGRAM
_PIPE = ("component", "op")
_DEV = ("component", "direction")

FAMILIES: Final[Mapping[str, FamilySpec]] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            # host<->storage pipelines (StoragePipeline.metrics())
            _spec(
                "pipeline_operations_total",
                _C,
                "Pipeline operations by end state (done, failed, cancelled) or rejected by "
                "back-pressure.",
                *_PIPE,
                "result",
            ),
            _spec(
                "pipeline_timeouts_total",
                _C,
                "Failed pipeline operations whose cause was a missed deadline.",
                *_PIPE,
            ),
            _spec(
                "pipeline_pages_total",
                _C,
                "Pages by per-page outcome (hit, miss, corrupt, error, stored, present, "
                "absent, skipped).",
                *_PIPE,
                "result",
            ),
            _spec(
                "pipeline_bytes_total",
                _C,
                "Payload bytes moved: read by hits, written by stored pages.",
                *_PIPE,
            ),
            _spec(
                "pipeline_backend_calls_total",
                _C,
                "Backend calls made by the pipeline's workers (ok, error).",
                *_PIPE,
                "result",
            ),
            _spec(
                "pipeline_queue_depth",
                _G,
                "Operations waiting for a backend call now.",
                *_PIPE,
            ),
            _spec(
                "pipeline_in_flight_operations",
                _G,
                "Operations submitted and not yet finished.",
                "component",
            ),
            _spec(
                "pipeline_operation_duration_seconds",
                _H,
                "Submission to end of one pipeline operation.",
                *_PIPE,
            ),
            _spec(
                "pipeline_backend_call_duration_seconds",
                _H,
                "Duration of one backend call.",
                *_PIPE,
            ),
            # device<->host pipelines (DeviceHostPipeline.metrics())
            _spec(
                "device_transfers_total",
                _C,
                "Device<->host transfers collected, by result (done, failed).",
                *_DEV,
                "result",
            ),
            _spec("device_pages_total", _C, "Pages moved by finished transfers.", *_DEV),
            _spec("device_bytes_total", _C, "Bytes moved by finished transfers.", *_DEV),
            _spec(
                "device_transfer_seconds_total",
                _C,
                "Summed copy time of finished transfers (device time on CUDA).",
                *_DEV,
            ),
            _spec(
                "device_in_flight_transfers",
                _G,
                "Transfers submitted and not yet collected.",
                "component",
            ),
            # backends (Backend.stats())
            _spec("backend_objects", _G, "Objects the backend holds.", "backend"),
            _spec("backend_stored_bytes", _G, "Bytes held, headers included.", "backend"),
            _spec("backend_capacity_bytes", _G, "The cap the backend evicts down to.", "backend"),
            _spec(
                "backend_reads_total",
                _C,
                "Object reads by result (hit, miss, corrupt, error).",
                "backend",
                "result",
            ),
            _spec(
                "backend_writes_total",
                _C,
                "Object writes by result (stored, present, error).",
                "backend",
                "result",
            ),
            _spec("backend_read_bytes_total", _C, "Payload bytes delivered by hits.", "backend"),
            _spec("backend_written_bytes_total", _C, "Payload bytes stored.", "backend"),
            _spec(
                "backend_removed_objects_total",
                _C,
                "Objects removed, by reason (deleted on request, evicted for capacity).",
                "backend",
                "reason",
            ),
            # a store's contents, from its object headers (sglang-storage stats --prometheus)
            _spec("store_objects", _G, "Whole, verified objects by data kind.", "kind"),
            _spec("store_bytes", _G, "Bytes of those objects, headers included.", "kind"),
            _spec(
                "store_scanned_entries",
                _G,
                "Everything a scan found on the medium, by state (ok, corrupt, "
                "wrong_version, orphaned_temp, foreign, quarantined, in_progress, ...).",
                "state",
            ),
            # the HiCache controller core (CacheController.stats())
            _spec(
                "controller_hit_queries_total",
                _C,
                "Storage hit queries by result (agreed, cost_skipped: the cost policy "
                "turned the hit into a miss).",
                "result",
            ),
            _spec(
                "controller_hit_pages_total",
                _C,
                "Pages of storage hits by result (agreed, cost_skipped).",
                "result",
            ),
            _spec(
                "controller_rank_misses_total",
                _C,
                "Agreements turned into misses because a rank did not answer in time.",
            ),
            _spec("controller_backups_total", _C, "Backups to storage started."),
            _spec(
                "controller_backup_pages_total",
                _C,
                "Pages of backups by result (stored, failed).",
                "result",
            ),
            _spec(
                "controller_reads_total",
                _C,
                "Prefetch reads by result (started, cancelled).",
                "result",
            ),
            _spec("controller_read_pages_total", _C, "Pages read into host memory, agreed."),
            # the key-addressed KV cache manager (KVCacheManager.stats())
            _spec(
                "kv_hit_pages_total",
                _C,
                "Pages found by lookups, by tier (device, host, storage).",
                "tier",
            ),
            _spec(
                "kv_pages_total",
                _C,
                "KV pages by event (written, loaded, backed_up, backup_failed, prefetched, "
                "prefetch_truncated, dropped).",
                "event",
            ),
            _spec("kv_host_pages", _G, "KV host pages held now."),
            _spec(
                "kv_rank_misses_total",
                _C,
                "KV operations turned into misses because the ranks did not agree in time.",
            ),
            # decode-side offload (DecodeOffloadManager.stats())
            _spec("decode_requests", _G, "Decoding requests being offloaded now."),
            _spec("decode_host_pages", _G, "Decode host pages held (not yet backed up)."),
            _spec(
                "decode_pages_total",
                _C,
                "Decode KV pages by event (offloaded, stored).",
                "event",
            ),
            _spec("decode_failed_backups_total", _C, "Decode backups that failed."),
            _spec(
                "decode_deferred_offloads_total",
                _C,
                "Offload steps put off because the host pool was full.",
            ),
            # host pools (PoolStats) and the host memory budget (StorageRuntime)
            _spec(
                "host_pool_capacity_bytes", _G, "Bytes a host pool can hold.", "component", "kind"
            ),
            _spec("host_pool_used_bytes", _G, "Bytes in allocated units.", "component", "kind"),
            _spec(
                "host_pool_pinned_bytes",
                _G,
                "Bytes pinned by in-flight transfers.",
                "component",
                "kind",
            ),
            _spec("host_memory_budget_bytes", _G, "The process's host memory budget."),
            _spec(
                "host_memory_used_bytes",
                _G,
                "Host memory each component holds from the budget.",
                "component",
            ),
            _spec(
                "host_memory_reserved_bytes",
                _G,
                "Budget bytes reserved per data kind.",
                "kind",
            ),
        )
    }
)
"""Every metric family, by name."""


@attrs.frozen(kw_only=True)
class HistogramValue:
    """A histogram: samples per bucket (not cumulative) and their sum."""

    bounds: tuple[float, ...]
    """Upper bounds of the buckets in seconds; one more bucket counts what lies above."""
    counts: tuple[int, ...]
    """Samples per bucket (``len(bounds) + 1`` entries)."""
    total: float
    """Sum of the samples."""

    @property
    def count(self) -> int:
        """Number of samples."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, samples at or below it)``, ending with ``(inf, count)``."""
        out: list[tuple[float, int]] = []
        seen = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += n
            out.append((bound, seen))
        return out

    def plus(self, other: HistogramValue) -> HistogramValue:
        """The two histograms merged (same bounds)."""
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return attrs.evolve(self, counts=counts, total=self.total + other.total)

    @classmethod
    def of(cls, snapshot: LatencySnapshot) -> HistogramValue:
        """A pipeline latency histogram as a metric value."""
        return cls(bounds=snapshot.bounds_s, counts=snapshot.counts, total=snapshot.total_s)


Labels = tuple[tuple[str, str], ...]
Value = float | HistogramValue


@attrs.frozen(kw_only=True)
class Sample:
    """One series of a family: its label values and its value."""

    labels: Labels
    value: Value


@attrs.frozen(kw_only=True)
class MetricFamily:
    """A family with its samples at one moment."""

    spec: FamilySpec
    samples: tuple[Sample, ...]

    @property
    def name(self) -> str:
        """The family's full name."""
        return self.spec.name


class _Builder:
    """Collects samples by family name; labels are given in the spec's order."""

    def __init__(self) -> None:
        self._samples: dict[str, list[Sample]] = {}

    def add(self, name: str, value: Value, **labels: str) -> None:
        spec = FAMILIES[PREFIX + name]
        if tuple(labels) != spec.labels:
            raise ValueError(f"{spec.name}: labels {tuple(labels)} != {spec.labels}")
        sample = Sample(labels=tuple(labels.items()), value=value)
        self._samples.setdefault(spec.name, []).append(sample)

    def families(self) -> list[MetricFamily]:
        return [
            MetricFamily(spec=FAMILIES[name], samples=tuple(samples))
            for name, samples in self._samples.items()
        ]


# ---------------------------------------------------------------------- converters


def pipeline_families(metrics: PipelineMetrics, *, component: str) -> list[MetricFamily]:
    """A host<->storage pipeline's snapshot (``StoragePipeline.metrics()``)."""
    out = _Builder()
    for kind in (metrics.get, metrics.put, metrics.exists):
        op = kind.kind.value
        where = {"component": component, "op": op}
        for result, n in (
            ("done", kind.done),
            ("failed", kind.failed),
            ("cancelled", kind.cancelled),
            ("rejected", kind.rejected),
        ):
            out.add("pipeline_operations_total", n, **where, result=result)
        out.add("pipeline_timeouts_total", kind.timed_out, **where)
        for result, n in sorted(kind.page_outcomes.items()):
            out.add("pipeline_pages_total", n, **where, result=result)
        out.add("pipeline_bytes_total", kind.bytes, **where)
        ok = kind.backend_calls - kind.backend_errors
        out.add("pipeline_backend_calls_total", ok, **where, result="ok")
        out.add("pipeline_backend_calls_total", kind.backend_errors, **where, result="error")
        out.add("pipeline_queue_depth", kind.queue_depth, **where)
        out.add("pipeline_operation_duration_seconds", HistogramValue.of(kind.latency), **where)
        call = HistogramValue.of(kind.call_latency)
        out.add("pipeline_backend_call_duration_seconds", call, **where)
    out.add("pipeline_in_flight_operations", metrics.in_flight, component=component)
    return out.families()


def device_families(metrics: DeviceTransferMetrics, *, component: str) -> list[MetricFamily]:
    """A device<->host pipeline's snapshot (``DeviceHostPipeline.metrics()``)."""
    out = _Builder()
    for direction, copies in (("offload", metrics.offload), ("load", metrics.load)):
        where = {"component": component, "direction": direction}
        done = copies.transfers - copies.failed
        out.add("device_transfers_total", done, **where, result="done")
        out.add("device_transfers_total", copies.failed, **where, result="failed")
        out.add("device_pages_total", copies.pages, **where)
        out.add("device_bytes_total", copies.nbytes, **where)
        out.add("device_transfer_seconds_total", copies.latency_s, **where)
    out.add("device_in_flight_transfers", metrics.in_flight, component=component)
    return out.families()


def backend_families(stats: BackendStats, *, backend: str) -> list[MetricFamily]:
    """A backend's :class:`~sglang_storage.storage.BackendStats`."""
    out = _Builder()
    out.add("backend_objects", stats.objects, backend=backend)
    out.add("backend_stored_bytes", stats.bytes, backend=backend)
    if stats.capacity_bytes is not None:
        out.add("backend_capacity_bytes", stats.capacity_bytes, backend=backend)
    for result, n in (
        ("hit", stats.hits),
        ("miss", stats.misses),
        ("corrupt", stats.corrupt),
        ("error", stats.get_errors),
    ):
        out.add("backend_reads_total", n, backend=backend, result=result)
    for result, n in (
        ("stored", stats.stored),
        ("present", stats.present),
        ("error", stats.put_errors),
    ):
        out.add("backend_writes_total", n, backend=backend, result=result)
    out.add("backend_read_bytes_total", stats.bytes_read, backend=backend)
    out.add("backend_written_bytes_total", stats.bytes_written, backend=backend)
    out.add("backend_removed_objects_total", stats.deleted, backend=backend, reason="deleted")
    out.add("backend_removed_objects_total", stats.evicted, backend=backend, reason="evicted")
    return out.families()


def store_families(summary: ScanSummary) -> list[MetricFamily]:
    """A scan of a store's medium (``sglang_storage.storage.summarize``)."""
    out = _Builder()
    for kind, tally in summary.kinds.items():
        out.add("store_objects", tally.count, kind=kind.value)
        out.add("store_bytes", tally.bytes, kind=kind.value)
    for state, tally in summary.states.items():
        out.add("store_scanned_entries", tally.count, state=state.value)
    return out.families()


def controller_families(stats: ControllerStats) -> list[MetricFamily]:
    """The HiCache controller core's ``ControllerStats``."""
    out = _Builder()
    out.add("controller_hit_queries_total", stats.hit_queries, result="agreed")
    out.add("controller_hit_queries_total", stats.cost_skipped_queries, result="cost_skipped")
    out.add("controller_hit_pages_total", stats.hit_pages, result="agreed")
    out.add("controller_hit_pages_total", stats.cost_skipped_pages, result="cost_skipped")
    out.add("controller_rank_misses_total", stats.rank_misses)
    out.add("controller_backups_total", stats.backups)
    out.add("controller_backup_pages_total", stats.backed_up_pages, result="stored")
    out.add("controller_backup_pages_total", stats.backup_failed_pages, result="failed")
    out.add("controller_reads_total", stats.reads, result="started")
    out.add("controller_reads_total", stats.read_cancelled, result="cancelled")
    out.add("controller_read_pages_total", stats.read_pages)
    return out.families()


def kv_families(stats: KVCacheStats) -> list[MetricFamily]:
    """The KV cache manager's ``KVCacheStats``."""
    out = _Builder()
    for tier in ("device", "host", "storage"):
        out.add("kv_hit_pages_total", getattr(stats, f"{tier}_hit_pages"), tier=tier)
    for event in (
        "written",
        "loaded",
        "backed_up",
        "backup_failed",
        "prefetched",
        "prefetch_truncated",
        "dropped",
    ):
        out.add("kv_pages_total", getattr(stats, f"{event}_pages"), event=event)
    out.add("kv_host_pages", stats.host_pages)
    out.add("kv_rank_misses_total", stats.rank_misses)
    return out.families()


def decode_families(stats: DecodeOffloadStats) -> list[MetricFamily]:
    """The decode offload manager's ``DecodeOffloadStats``."""
    out = _Builder()
    out.add("decode_requests", stats.requests)
    out.add("decode_host_pages", stats.host_pages)
    out.add("decode_pages_total", stats.offloaded_pages, event="offloaded")
    out.add("decode_pages_total", stats.stored_pages, event="stored")
    out.add("decode_failed_backups_total", stats.failed_backups)
    out.add("decode_deferred_offloads_total", stats.deferred)
    return out.families()


def pool_families(stats: PoolStats, *, component: str) -> list[MetricFamily]:
    """A host pool's :class:`~sglang_storage.memory.PoolStats`."""
    out = _Builder()
    where = {"component": component, "kind": stats.kind.value}
    out.add("host_pool_capacity_bytes", stats.capacity_bytes, **where)
    out.add("host_pool_used_bytes", stats.used_bytes, **where)
    out.add("host_pool_pinned_bytes", stats.pinned_bytes, **where)
    return out.families()


def runtime_families(runtime: StorageRuntime) -> list[MetricFamily]:
    """A :class:`~sglang_storage.managers.runtime.StorageRuntime`'s budget and use."""
    budget = runtime.budget.stats()
    out = _Builder()
    out.add("host_memory_budget_bytes", budget.total)
    for component in COMPONENTS:
        out.add("host_memory_used_bytes", runtime.used(component), component=component)
    for kind, usage in budget.kinds.items():
        if usage.reserved:
            out.add("host_memory_reserved_bytes", usage.reserved, kind=kind.value)
    return out.families()


# ---------------------------------------------------------------------- the sources

Key = tuple[str, Labels]


def _index(families: Iterable[MetricFamily]) -> dict[Key, tuple[FamilySpec, Value]]:
    out: dict[Key, tuple[FamilySpec, Value]] = {}
    for family in families:
        for sample in family.samples:
            key = (family.name, sample.labels)
            held = out.get(key)
            out[key] = (family.spec, sample.value if held is None else _plus(held[1], sample.value))
    return out


def _plus(a: Value, b: Value) -> Value:
    if isinstance(a, HistogramValue) and isinstance(b, HistogramValue):
        return a.plus(b)
    if isinstance(a, HistogramValue) or isinstance(b, HistogramValue):
        raise TypeError("a histogram and a number cannot be added")
    return a + b


@attrs.define(eq=False)
class _Source:
    ref: weakref.ref[Any]
    convert: Callable[[Any], Sequence[MetricFamily]]
    last: dict[Key, tuple[FamilySpec, Value]] = attrs.field(factory=dict)


class MetricSources:
    """Live components whose snapshots make up the process's metrics.

    Thread-safe: components register from the scheduler thread while a scrape reads from
    another. A ``convert`` that raises a :class:`~sglang_storage.errors.StorageError`
    (a backend closed under it) is skipped for that scrape.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[int, _Source] = {}
        self._retired: dict[Key, tuple[FamilySpec, Value]] = {}

    def add(self, owner: T, convert: Callable[[T], Sequence[MetricFamily]]) -> None:
        """Read ``convert(owner)`` at every :meth:`collect` while ``owner`` lives.

        ``owner`` is held weakly; adding one owner twice keeps the first converter, so
        components sharing one backend can each add it.
        """
        with self._lock:
            key = id(owner)
            held = self._sources.get(key)
            if held is not None:
                if held.ref() is owner:
                    return
                self._retire(held)  # a dead owner whose id was reused
            self._sources[key] = _Source(ref=weakref.ref(owner), convert=convert)

    def remove(self, owner: object) -> None:
        """``owner`` is closing: keep its counters and histograms, drop its gauges."""
        with self._lock:
            source = self._sources.get(id(owner))
            if source is None or source.ref() is not owner:
                return
            del self._sources[id(owner)]
            self._snapshot(source, owner)
            self._retire(source)

    def capture(self, owner: object) -> None:
        """Take ``owner``'s snapshot now (it is about to close or go away).

        What a later scrape shows of it, once it can no longer be read, is this.
        """
        with self._lock:
            source = self._sources.get(id(owner))
            if source is not None and source.ref() is owner:
                self._snapshot(source, owner)

    def __len__(self) -> int:
        """Sources registered and alive."""
        with self._lock:
            return sum(1 for s in self._sources.values() if s.ref() is not None)

    def collect(self) -> list[MetricFamily]:
        """Every family with samples, summed over sources (retired ones included), by name."""
        with self._lock:
            live: list[_Source] = []
            for key, source in list(self._sources.items()):
                owner = source.ref()
                if owner is None:  # collected without remove(): keep what it last showed
                    del self._sources[key]
                    self._retire(source)
                    continue
                self._snapshot(source, owner)
                live.append(source)
            merged = dict(self._retired)
            for source in live:
                for sample_key, (spec, value) in source.last.items():
                    held = merged.get(sample_key)
                    merged[sample_key] = (spec, value if held is None else _plus(held[1], value))
        by_family: dict[str, list[Sample]] = {}
        specs: dict[str, FamilySpec] = {}
        for (name, labels), (spec, value) in merged.items():
            specs[name] = spec
            by_family.setdefault(name, []).append(Sample(labels=labels, value=value))
        return [
            MetricFamily(spec=specs[name], samples=tuple(sorted(by_family[name], key=_by_labels)))
            for name in sorted(by_family)
        ]

    def clear(self) -> None:
        """Forget every source and retired total (tests, a re-initialised process)."""
        with self._lock:
            self._sources.clear()
            self._retired.clear()

    def _snapshot(self, source: _Source, owner: object) -> None:
        try:
            source.last = _index(source.convert(owner))
        except StorageError as error:
            log.debug("sglang_storage metrics: a source could not be read: %s", error)

    def _retire(self, source: _Source) -> None:
        for key, (spec, value) in source.last.items():
            if spec.type is MetricType.GAUGE:
                continue
            held = self._retired.get(key)
            self._retired[key] = (spec, value if held is None else _plus(held[1], value))


def _by_labels(sample: Sample) -> Labels:
    return sample.labels


SOURCES: Final = MetricSources()
"""The process's metric sources (what SGLang's ``/metrics`` and ``--prometheus`` show)."""


# ---------------------------------------------------------------------- watching


class _Pool(Protocol):
    def stats(self) -> PoolStats: ...


def _storage_pipeline(pipeline: StoragePipeline, *, component: str) -> list[MetricFamily]:
    return pipeline_families(pipeline.metrics(), component=component)


def _device_pipeline(pipeline: DeviceHostPipeline, *, component: str) -> list[MetricFamily]:
    return device_families(pipeline.metrics(), component=component)


def _backend(backend: Backend) -> list[MetricFamily]:
    return backend_families(backend.stats(), backend=backend.name)


def _pool(pool: _Pool, *, component: str) -> list[MetricFamily]:
    return pool_families(pool.stats(), component=component)


def _controller(core: CacheController) -> list[MetricFamily]:
    return controller_families(core.stats())


def _kv(manager: KVCacheManager) -> list[MetricFamily]:
    return kv_families(manager.stats())


def _decode(manager: DecodeOffloadManager) -> list[MetricFamily]:
    return decode_families(manager.stats())


def watch_storage_pipeline(
    pipeline: StoragePipeline, component: str, sources: MetricSources = SOURCES
) -> None:
    """Export ``pipeline``'s metrics under ``component`` (``kv``, ``decode``, ...)."""
    sources.add(pipeline, functools.partial(_storage_pipeline, component=component))


def watch_device_pipeline(
    pipeline: DeviceHostPipeline, component: str, sources: MetricSources = SOURCES
) -> None:
    """Export a device<->host pipeline's totals under ``component``."""
    sources.add(pipeline, functools.partial(_device_pipeline, component=component))


def watch_backend(backend: Backend, sources: MetricSources = SOURCES) -> None:
    """Export ``backend``'s stats under its name (once, however many components share it)."""
    sources.add(backend, _backend)


def watch_pool(pool: _Pool, component: str, sources: MetricSources = SOURCES) -> None:
    """Export a host pool's usage under ``component``."""
    sources.add(pool, functools.partial(_pool, component=component))


def watch_controller(core: CacheController, sources: MetricSources = SOURCES) -> None:
    """Export the HiCache controller core's counts."""
    sources.add(core, _controller)


def watch_kv_manager(manager: KVCacheManager, sources: MetricSources = SOURCES) -> None:
    """Export the KV cache manager's counts."""
    sources.add(manager, _kv)


def watch_decode(manager: DecodeOffloadManager, sources: MetricSources = SOURCES) -> None:
    """Export the decode offload manager's counts."""
    sources.add(manager, _decode)
