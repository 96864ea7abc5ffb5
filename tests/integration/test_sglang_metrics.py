"""sglang_storage's metrics and messages in a process SGLang 0.5.23 drives.

A real ``UnifiedRadixCache`` runs HiCache on our controller and file backend (as in
``test_sglang_hicache_controller.py``): a write-through insert, a backup to storage and a
prefetch into a second tree. Then:

- a ``prometheus_client`` registry with our collector, scraped, shows the controller
  core's, the pipelines' and the backend's counts of that workload;
- with ``PROMETHEUS_MULTIPROC_DIR`` set (SGLang's ``--enable-metrics``), a child process
  runs the workload with the tree's metrics on, and SGLang's own ``/metrics`` app
  (``add_prometheus_middleware``) serves our series next to SGLang's;
- that child logs one start-up line, at the level ``--storage-log-level`` sets;
- without CUDA, SGLang's ``load_plugins()`` prints that serving needs a GPU, once.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.sglang_tree import LIVE, PAGE, SEQ, TOKENS, Tree, prefetch, server_args

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent


def workload(root: Path, *, enable_metrics: bool = False, log_level: str | None = None) -> None:
    """Back SEQ up from one tree and prefetch it into another (SGLang's call sequence).

    With ``enable_metrics`` the second tree has SGLang's metrics on (one tree per process
    can: SGLang registers its collectors globally), and its last event round comes after
    the refresh interval, so the files hold the final counts.
    """
    from sglang_storage.managers.prometheus import REFRESH_INTERVAL_S

    args = server_args(root, log_level=log_level)
    producer = Tree(args)
    producer.insert_random(SEQ, seed=3)
    producer.backup_to_storage(SEQ)
    consumer = Tree(args, enable_metrics=enable_metrics)
    assert prefetch(consumer, "metrics-req") == TOKENS
    if enable_metrics:
        time.sleep(REFRESH_INTERVAL_S + 0.1)
        consumer.cache.check_hicache_events()  # SGLang's get_stats(): our refresh
    for tree in (producer, consumer):
        ok, message = tree.cache.detach_storage_backend()
        assert ok, message
        LIVE.remove(tree)


@pytest.fixture
def single_rank() -> Iterator[None]:
    from sglang.srt.runtime_context import get_parallel, reset_context
    from sglang_storage_adapters import plugin

    plugin.register()
    override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    override.__enter__()
    yield
    override.__exit__(None, None, None)
    reset_context()


Scraped = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Scraped:
    from prometheus_client.parser import text_string_to_metric_families

    out: Scraped = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "pid"))
            key = (sample.name, labels)
            out[key] = out.get(key, 0.0) + sample.value  # one series per process: summed
    return out


def get(samples: Scraped, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape() -> Scraped:
    from prometheus_client import CollectorRegistry, generate_latest

    from sglang_storage.managers.prometheus import install_collector

    registry = CollectorRegistry()
    install_collector(registry)
    return parse(generate_latest(registry).decode())


def test_a_tree_workload_is_counted_in_a_scraped_registry(
    tmp_path: Path, single_rank: None
) -> None:
    before = scrape()
    workload(tmp_path / "kv")
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return get(after, name, **labels) - get(before, name, **labels)

    pages = TOKENS // PAGE
    s = "sglang_storage_"
    put = {
        r: delta(s + "pipeline_pages_total", component="kv", op="put", result=r)
        for r in ("stored", "present")
    }
    # Every layer saw the same pages: the tree's write-through and our backups of them.
    assert put["stored"] >= pages
    assert delta(s + "controller_backup_pages_total", result="stored") == sum(put.values())
    assert delta(s + "backend_writes_total", backend="file", result="stored") == put["stored"]
    assert delta(s + "controller_hit_queries_total", result="agreed") == 1
    assert delta(s + "controller_read_pages_total") == pages
    assert delta(s + "pipeline_pages_total", component="kv", op="get", result="hit") == pages
    assert delta(s + "backend_reads_total", backend="file", result="hit") == pages
    offload = {"component": "kv", "direction": "offload"}
    assert delta(s + "device_transfers_total", **offload, result="done") >= 1
    assert delta(s + "device_pages_total", **offload) >= pages
    done = delta(s + "pipeline_operations_total", component="kv", op="put", result="done")
    assert done >= 1
    assert delta(s + "pipeline_operation_duration_seconds_count", component="kv", op="put") == done
    assert get(after, s + "host_memory_budget_bytes") > 0


CHILD = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from sglang.srt.runtime_context import get_parallel
from sglang_storage_adapters import plugin
import test_sglang_metrics as t

plugin.register()
with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
    t.workload(Path(sys.argv[1]), enable_metrics=True, log_level=sys.argv[2])
"""


def run_child(root: Path, metrics_dir: Path, log_level: str) -> str:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST", "PROMETHEUS"))
    }
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(root), log_level],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return child.stderr


def test_sglangs_metrics_endpoint_serves_our_series_and_the_log_level_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    root = tmp_path / "kv"
    log = run_child(root, metrics_dir, "info")
    # One start-up line in the process, shown at --storage-log-level info although the
    # process logs warnings only.
    lines = [line for line in log.splitlines() if "sglang_storage on (pid" in line]
    assert len(lines) == 1, log[-4000:]
    assert "managers kv" in lines[0]
    assert f"backend file root={root}" in lines[0]
    assert "host memory budget" in lines[0]
    (tmp_path / "prometheus2").mkdir()
    quiet = run_child(tmp_path / "kv2", tmp_path / "prometheus2", "error")
    assert "sglang_storage on (pid" not in quiet

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    app = Starlette()
    add_prometheus_middleware(app)  # SGLang's own /metrics: a MultiProcessCollector
    response = TestClient(app).get("/metrics")
    assert response.status_code == 200
    text = response.text
    samples = parse(text)
    pages = TOKENS // PAGE
    s = "sglang_storage_"
    stored = get(samples, s + "pipeline_pages_total", component="kv", op="put", result="stored")
    assert stored >= pages
    assert get(samples, s + "backend_writes_total", backend="file", result="stored") == stored
    assert get(samples, s + "controller_backup_pages_total", result="stored") >= stored
    assert get(samples, s + "pipeline_pages_total", component="kv", op="get", result="hit") == pages
    assert get(samples, s + "controller_read_pages_total") == pages
    assert get(samples, s + "host_memory_used_bytes", component="kv") > 0
    assert "# TYPE sglang_storage_pipeline_operation_duration_seconds histogram" in text
    assert any(name.startswith("sglang:") for name, _ in samples), "SGLang's own series"


def test_the_log_level_flag_reaches_every_process_through_the_extra_config() -> None:
    from sglang_storage_adapters.flags import (
        add_storage_cli_args,
        extra_config,
        storage_flags_from_args,
    )
    from sglang_storage_adapters.runtime import parse_settings

    parser = argparse.ArgumentParser()
    add_storage_cli_args(parser)
    args = parser.parse_args(["--storage-backend", "memory", "--storage-log-level", "debug"])
    flags = storage_flags_from_args(args)
    assert flags is not None
    assert flags.log_level == "debug"
    extra = extra_config(flags)
    assert extra["storage_log_level"] == "debug"
    assert parse_settings(extra).log_level == "debug"
    assert parse_settings({"storage_backend": "memory"}).log_level is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--storage-backend", "memory", "--storage-log-level", "loud"])


def test_without_cuda_load_plugins_says_serving_needs_a_gpu_once() -> None:
    script = textwrap.dedent(
        """
        from sglang.srt.plugins import load_plugins
        from sglang_storage_adapters import plugin
        load_plugins()
        load_plugins()
        assert not plugin.say_if_no_cuda()  # said already
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    child = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-4000:]
    said = child.stderr.count("serving with SGLang needs a GPU")
    if torch.cuda.is_available():
        assert said == 0
    else:
        assert said == 1, child.stderr[-4000:]
        assert "`sglang-storage replay`" in child.stderr
        assert "`sglang-storage bench`" in child.stderr
