"""The process's metrics in Prometheus: a pull collector, text, SGLang's multiprocess files.

Needs ``prometheus_client`` (an SGLang dependency); :func:`require_prometheus` raises a
:class:`~sglang_storage.errors.ConfigError` that says so when it is missing. Import this
module only where metrics are read or written: ``prometheus_client`` picks its value
store (in memory, or files under ``PROMETHEUS_MULTIPROC_DIR``) when first imported, and
SGLang sets that variable at start-up, after plug-ins are loaded.

- :class:`StorageCollector` - a ``prometheus_client`` collector whose ``collect()``
  reads :data:`~.observability.SOURCES` at scrape time (no per-operation cost). For one
  process: ``install_collector(registry)``.
- :func:`exposition` - families as Prometheus text (``sglang-storage stats --prometheus``).
- :class:`MultiprocessWriter` / :func:`refresh_multiprocess` - SGLang's mode. SGLang's
  ``/metrics`` (``--enable-metrics``) serves a ``MultiProcessCollector`` over
  ``PROMETHEUS_MULTIPROC_DIR``, which a collector in a scheduler process never reaches,
  so each process writes its snapshot into that directory: counters and histograms as
  this process's totals (the collector sums processes), gauges with
  ``multiprocess_mode="all"`` (one series per process, labelled ``pid``). SGLang's
  scheduler refreshes it each time its tree polls the storage backend's ``get_stats()``;
  the other adapters refresh it from their per-step hooks, at most once a second.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

from sglang_storage.errors import ConfigError
from sglang_storage.managers.observability import (
    SOURCES,
    HistogramValue,
    MetricFamily,
    MetricSources,
    MetricType,
)

__all__ = [
    "MultiprocessWriter",
    "StorageCollector",
    "exposition",
    "install_collector",
    "multiprocess_active",
    "refresh_multiprocess",
    "require_prometheus",
]

_OWNER: Final = "sglang_storage metrics"
REFRESH_INTERVAL_S: Final = 1.0
"""The shortest time between two throttled multiprocess refreshes."""


def require_prometheus() -> Any:
    """The ``prometheus_client`` module.

    Raises:
        ConfigError: it is not installed.
    """
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            owner=_OWNER,
            field="prometheus_client",
            reason="is not installed; Prometheus metrics need it (SGLang depends on it)",
            allowed="pip install prometheus-client",
        ) from None
    return prometheus_client


def _bound(value: float) -> str:
    from prometheus_client import utils

    go_format: Any = utils.floatToGoString  # untyped; the "le" text prometheus_client writes
    return str(go_format(value))


def to_prometheus(families: Iterable[MetricFamily]) -> list[Any]:
    """``prometheus_client`` metric families for ``families``."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    out: list[Any] = []
    for family in families:
        spec = family.spec
        labels = list(spec.labels)
        metric: Any
        if spec.type is MetricType.COUNTER:
            metric = CounterMetricFamily(spec.name, spec.help, labels=labels)
        elif spec.type is MetricType.GAUGE:
            metric = GaugeMetricFamily(spec.name, spec.help, labels=labels)
        else:
            metric = HistogramMetricFamily(spec.name, spec.help, labels=labels)
        for sample in family.samples:
            values = [value for _, value in sample.labels]
            if isinstance(sample.value, HistogramValue):
                buckets = [(_bound(b), float(n)) for b, n in sample.value.cumulative()]
                metric.add_metric(values, buckets, sample.value.total)
            else:
                metric.add_metric(values, float(sample.value))
        out.append(metric)
    return out


class StorageCollector:
    """A ``prometheus_client`` collector over a :class:`~.observability.MetricSources`."""

    def __init__(self, sources: MetricSources = SOURCES) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Any]:
        """The sources' families, read now."""
        yield from to_prometheus(self._sources.collect())

    def describe(self) -> list[Any]:
        """Nothing up front: families appear as components register."""
        return []


def install_collector(registry: Any = None, sources: MetricSources = SOURCES) -> StorageCollector:
    """Register a :class:`StorageCollector` on ``registry`` (default: the global one)."""
    prometheus = require_prometheus()
    collector = StorageCollector(sources)
    (registry if registry is not None else prometheus.REGISTRY).register(collector)
    return collector


class _Static:
    def __init__(self, families: Sequence[MetricFamily]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return to_prometheus(self._families)


def exposition(families: Sequence[MetricFamily]) -> str:
    """``families`` in the Prometheus text format.

    Raises:
        ConfigError: ``prometheus_client`` is not installed.
    """
    prometheus = require_prometheus()
    registry = prometheus.CollectorRegistry(auto_describe=False)
    registry.register(_Static(families))
    return str(prometheus.generate_latest(registry).decode())


def multiprocess_active() -> bool:
    """Whether ``prometheus_client`` keeps its values in ``PROMETHEUS_MULTIPROC_DIR`` files."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return False
    try:
        from prometheus_client import values
    except ImportError:
        return False
    return bool(getattr(values.ValueClass, "_multiprocess", False))


class MultiprocessWriter:
    """Writes families into this process's files under ``PROMETHEUS_MULTIPROC_DIR``.

    Each :meth:`write` sets every series to the snapshot's value (no increments, so no
    double counting). Values go through ``prometheus_client``'s own multiprocess value
    class, the one its metrics use in this process, hence into the same per-process files.

    Raises:
        ConfigError: ``prometheus_client`` is missing or not in multiprocess mode.
    """

    def __init__(self) -> None:
        require_prometheus()
        if not multiprocess_active():
            raise ConfigError(
                owner=_OWNER,
                field="PROMETHEUS_MULTIPROC_DIR",
                value=os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
                reason=(
                    "prometheus_client is not in multiprocess mode (the variable must name "
                    "a directory before prometheus_client is first imported)"
                ),
            )
        from prometheus_client import values

        self._value_class: Any = values.ValueClass
        self._values: dict[tuple[str, str, tuple[tuple[str, str], ...]], Any] = {}
        self._lock = threading.Lock()

    def write(self, families: Iterable[MetricFamily]) -> None:
        """Set this process's series to ``families``' values."""
        with self._lock:
            for family in families:
                spec = family.spec
                for sample in family.samples:
                    if isinstance(sample.value, HistogramValue):
                        self._histogram(family, sample.labels, sample.value)
                    elif spec.type is MetricType.COUNTER:
                        base = spec.name.removesuffix("_total")
                        self._set("counter", base, spec.name, sample.labels, spec, sample.value)
                    else:
                        self._set("gauge", spec.name, spec.name, sample.labels, spec, sample.value)

    def _histogram(
        self, family: MetricFamily, labels: tuple[tuple[str, str], ...], value: HistogramValue
    ) -> None:
        spec, name = family.spec, family.spec.name
        for bound, n in zip((*value.bounds, float("inf")), value.counts, strict=True):
            le = (*labels, ("le", _bound(bound)))
            self._set("histogram", name, f"{name}_bucket", le, spec, n)
        self._set("histogram", name, f"{name}_sum", labels, spec, value.total)

    def _set(
        self,
        typ: str,
        metric: str,
        sample: str,
        labels: tuple[tuple[str, str], ...],
        spec: Any,
        value: float,
    ) -> None:
        key = (typ, sample, labels)
        held = self._values.get(key)
        if held is None:
            held = self._value_class(
                typ,
                metric,
                sample,
                [k for k, _ in labels],
                [v for _, v in labels],
                spec.help,
                multiprocess_mode="all",
            )
            self._values[key] = held
        held.set(float(value))


_writer: MultiprocessWriter | None = None
_writer_lock = threading.Lock()
_last_refresh = 0.0


def refresh_multiprocess(
    sources: MetricSources = SOURCES, *, min_interval_s: float = REFRESH_INTERVAL_S
) -> bool:
    """Write ``sources``' snapshot for SGLang's ``/metrics`` when metrics are on.

    A no-op (``False``) outside multiprocess mode (SGLang without ``--enable-metrics``)
    or within ``min_interval_s`` of the last refresh. Never raises into the caller's
    serving path for a missing ``prometheus_client``.
    """
    global _writer, _last_refresh
    now = time.monotonic()
    if now - _last_refresh < min_interval_s or not multiprocess_active():
        return False
    with _writer_lock:
        if now - _last_refresh < min_interval_s:
            return False
        _last_refresh = now
        if _writer is None:
            _writer = MultiprocessWriter()
        writer = _writer
    writer.write(sources.collect())
    return True
