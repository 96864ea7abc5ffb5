"""Metrics: live components' snapshots scraped through a real ``prometheus_client`` registry.

A workload runs on a real ``memory`` backend through a real storage pipeline; the
process's sources are read by :class:`StorageCollector` on a fresh ``CollectorRegistry``
and by SGLang's mode (files under ``PROMETHEUS_MULTIPROC_DIR``, written from another
process and read back with ``MultiProcessCollector``). Also: family naming rules, the
README's list of names, rate-limited warnings and ``--storage-log-level``'s helper, and
``sglang-storage stats --prometheus``.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from sglang_storage.cli import main
from sglang_storage.core import DataKind, GetRequest, ObjectSpec, PutRequest
from sglang_storage.errors import ConfigError
from sglang_storage.managers.logs import RateLimitedLog, apply_log_level
from sglang_storage.managers.observability import (
    FAMILIES,
    MetricSources,
    MetricType,
    backend_families,
    pipeline_families,
)
from sglang_storage.managers.prometheus import exposition, install_collector
from sglang_storage.storage import create_backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint
from sglang_storage.transfer import StoragePipeline

REPO = Path(__file__).resolve().parents[3]
PAGE = 4096
WAIT_S = 10.0
SPEC = ObjectSpec(dtype="uint8", shape=(PAGE,))
NAMESPACE = kv_namespace(model_fingerprint("metrics-test"), mla=False, tp_rank=0, tp_size=1)


def keys(n: int, start: int = 0) -> list[Any]:
    return [NAMESPACE.key(f"page-{i:04d}") for i in range(start, start + n)]


def workload(pipeline: StoragePipeline) -> None:
    """12 pages stored, 2 already present, 12 hits and 4 misses read, 3 exists asked."""
    pages = [bytearray(bytes([i]) * PAGE) for i in range(12)]
    puts = [
        PutRequest(key=k, spec=SPEC, buffers=(p,)) for k, p in zip(keys(12), pages, strict=True)
    ]
    assert all(r.ok for r in pipeline.submit_put(puts).result(WAIT_S))
    assert all(r.ok for r in pipeline.submit_put(puts[:2]).result(WAIT_S))  # present
    outs = [bytearray(PAGE) for _ in range(16)]
    gets = [GetRequest(key=k, spec=SPEC, buffers=(o,)) for k, o in zip(keys(16), outs, strict=True)]
    results = pipeline.submit_get(gets).result(WAIT_S)
    assert sum(r.hit for r in results) == 12
    assert pipeline.submit_exists(keys(3, start=10)).result(WAIT_S) == [True, True, False]


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``registry``'s exposition, parsed back from the text format."""
    text = generate_latest(registry).decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "pid"))
            out[(sample.name, labels)] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_a_workload_scraped_through_a_real_registry_has_the_names_and_values() -> None:
    sources = MetricSources()
    backend = create_backend("memory", {})
    with StoragePipeline(backend) as pipeline:
        sources.add(pipeline, lambda p: pipeline_families(p.metrics(), component="kv"))
        sources.add(backend, lambda b: backend_families(b.stats(), backend=b.name))
        registry = CollectorRegistry()
        install_collector(registry, sources)
        workload(pipeline)
        samples = scrape(registry)
    p = "sglang_storage_pipeline_"
    assert value(samples, p + "operations_total", component="kv", op="put", result="done") == 2
    assert value(samples, p + "operations_total", component="kv", op="get", result="done") == 1
    assert value(samples, p + "pages_total", component="kv", op="get", result="hit") == 12
    assert value(samples, p + "pages_total", component="kv", op="get", result="miss") == 4
    assert value(samples, p + "pages_total", component="kv", op="put", result="stored") == 12
    assert value(samples, p + "pages_total", component="kv", op="put", result="present") == 2
    assert value(samples, p + "pages_total", component="kv", op="exists", result="absent") == 1
    assert value(samples, p + "bytes_total", component="kv", op="get") == 12 * PAGE
    assert value(samples, p + "queue_depth", component="kv", op="get") == 0
    histogram = p + "operation_duration_seconds"
    assert value(samples, histogram + "_count", component="kv", op="put") == 2
    assert value(samples, histogram + "_bucket", component="kv", op="put", le="+Inf") == 2
    assert value(samples, histogram + "_sum", component="kv", op="put") > 0
    b = "sglang_storage_backend_"
    assert value(samples, b + "reads_total", backend="memory", result="hit") == 12
    assert value(samples, b + "reads_total", backend="memory", result="miss") == 4
    assert value(samples, b + "writes_total", backend="memory", result="stored") == 12
    assert value(samples, b + "objects", backend="memory") == 12
    assert value(samples, b + "read_bytes_total", backend="memory") == 12 * PAGE
    backend.close()


def test_counters_outlive_their_component_and_gauges_do_not() -> None:
    sources = MetricSources()
    backend = create_backend("memory", {})
    pipeline = StoragePipeline(backend)
    sources.add(pipeline, lambda p: pipeline_families(p.metrics(), component="kv"))
    sources.add(pipeline, lambda p: pipeline_families(p.metrics(), component="other"))  # kept once
    workload(pipeline)
    pipeline.close()
    sources.remove(pipeline)
    second = StoragePipeline(backend)
    sources.add(second, lambda p: pipeline_families(p.metrics(), component="kv"))
    workload(second)
    second.close()
    del second  # dropped without remove(): what it showed at the last collect stays
    names = {f.name for f in sources.collect()}
    assert "sglang_storage_pipeline_queue_depth" in names
    gc.collect()
    by_name = {f.name: f for f in sources.collect()}
    assert len(sources) == 0
    assert "sglang_storage_pipeline_queue_depth" not in by_name  # a gauge of nothing alive
    pages = {
        dict(s.labels)["result"]: s.value
        for s in by_name["sglang_storage_pipeline_pages_total"].samples
        if dict(s.labels)["op"] == "get"
    }
    assert pages == {"hit": 24, "miss": 8}  # both pipelines, never a step down
    assert {dict(s.labels)["component"] for f in by_name.values() for s in f.samples} == {"kv"}
    backend.close()


def test_family_names_follow_prometheus_conventions_and_the_readme_lists_them() -> None:
    readme = (REPO / "README.md").read_text()
    for name, spec in FAMILIES.items():
        assert re.fullmatch(r"sglang_storage_[a-z]+_[a-z_]+", name), name
        assert (spec.type is MetricType.COUNTER) == name.endswith("_total"), name
        if spec.type is MetricType.HISTOGRAM:
            assert name.endswith("_seconds"), name
        assert spec.help.endswith("."), name
        assert f"`{name}`" in readme, f"README does not document {name}"


def test_multiprocess_files_are_read_by_sglangs_collector(tmp_path: Path) -> None:
    """Another process writes its snapshot (and a metric of its own, as SGLang does)."""
    script = textwrap.dedent(
        """
        import prometheus_client
        from sglang_storage.managers.observability import SOURCES, backend_families
        from sglang_storage.managers.prometheus import refresh_multiprocess
        from sglang_storage.storage import create_backend
        from test_metrics import workload
        from sglang_storage.transfer import StoragePipeline
        from sglang_storage.managers.observability import pipeline_families

        theirs = prometheus_client.Counter("sglang_theirs", "SGLang's own counter")
        backend = create_backend("memory", {})
        pipeline = StoragePipeline(backend)
        SOURCES.add(pipeline, lambda p: pipeline_families(p.metrics(), component="kv"))
        SOURCES.add(backend, lambda b: backend_families(b.stats(), backend=b.name))
        assert refresh_multiprocess(min_interval_s=0)
        workload(pipeline)
        theirs.inc(3)
        assert refresh_multiprocess(min_interval_s=0)
        assert not refresh_multiprocess(min_interval_s=3600)  # throttled
        pipeline.close()
        """
    )
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    for _ in range(2):  # two processes: counters add up, gauges stay one per pid
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    text = generate_latest(registry).decode()
    samples = scrape(registry)
    p = "sglang_storage_pipeline_"
    assert value(samples, "sglang_theirs_total") == 6
    assert value(samples, p + "pages_total", component="kv", op="get", result="hit") == 24
    assert value(samples, p + "operation_duration_seconds_count", component="kv", op="put") == 4
    assert (
        value(samples, "sglang_storage_backend_reads_total", backend="memory", result="miss") == 8
    )
    objects = [
        line for line in text.splitlines() if line.startswith("sglang_storage_backend_objects")
    ]
    assert len(objects) == 2, objects
    assert all('pid="' in line for line in objects), objects
    assert "# TYPE sglang_storage_pipeline_operation_duration_seconds histogram" in text


def test_exposition_without_sources_and_with_a_histogram_family() -> None:
    backend = create_backend("memory", {})
    with StoragePipeline(backend) as pipeline:
        workload(pipeline)
        text = exposition(pipeline_families(pipeline.metrics(), component="decode"))
    backend.close()
    assert "# TYPE sglang_storage_pipeline_operations_total counter" in text
    assert (
        'sglang_storage_pipeline_operations_total{component="decode",op="get",result="done"} 1.0'
        in text
    )
    assert exposition([]) == ""


def test_rate_limited_warnings_count_what_they_suppress(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    logger = logging.getLogger("sglang_storage.test_metrics")
    limited = RateLimitedLog(logger, interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert limited.warning("page", "page %s failed", "a")
        for name in "bcd":
            assert not limited.warning("page", "page %s failed", name)
        assert limited.warning("other", "another kind")  # its own key
        assert limited.suppressed("page") == 3
        now[0] += 61.0
        assert limited.warning("page", "page %s failed", "e")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "page a failed",
        "another kind",
        "page e failed (suppressed 3 similar in the last 60 s)",
    ]
    with pytest.raises(ConfigError, match="interval_s"):
        RateLimitedLog(logger, interval_s=0)


def test_log_level_applies_to_our_loggers_only() -> None:
    ours, theirs = logging.getLogger("sglang_storage"), logging.getLogger("sglang")
    saved = ours.level, logging.getLogger("sglang_storage_adapters").level, theirs.level
    try:
        apply_log_level("error")
        assert logging.getLogger("sglang_storage.storage.file").getEffectiveLevel() == logging.ERROR
        assert (
            logging.getLogger("sglang_storage_adapters.decode").getEffectiveLevel() == logging.ERROR
        )
        assert theirs.level == saved[2]
        with pytest.raises(ConfigError, match="allowed: debug, info, warning, error"):
            apply_log_level("loud")
    finally:
        ours.setLevel(saved[0])
        logging.getLogger("sglang_storage_adapters").setLevel(saved[1])


def test_stats_prometheus_is_the_stores_exposition(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    backend = create_backend("file", {"root": str(root), "durability": "none"})
    pages = [bytearray(bytes([i]) * PAGE) for i in range(5)]
    backend.put_from(
        [PutRequest(key=k, spec=SPEC, buffers=(p,)) for k, p in zip(keys(5), pages, strict=True)]
    )
    backend.close()
    assert main(["stats", "--dir", str(root), "--prometheus"]) == 0
    text = capsys.readouterr().out
    samples: dict[Any, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert value(samples, "sglang_storage_backend_objects", backend="file") == 5
    assert value(samples, "sglang_storage_store_objects", kind=DataKind.KV.value) == 5
    assert value(samples, "sglang_storage_store_bytes", kind=DataKind.KV.value) > 5 * PAGE
    assert value(samples, "sglang_storage_store_scanned_entries", state="ok") == 5
    assert value(samples, "sglang_storage_store_scanned_entries", state="corrupt") == 0
    assert main(["stats", "--dir", str(root), "--prometheus", "--json"]) == 2
    assert "one of --json and --prometheus" in capsys.readouterr().err
