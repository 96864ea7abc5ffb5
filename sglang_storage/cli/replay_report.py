"""What ``sglang-storage replay`` prints: the versioned JSON report, its text form, progress.

The JSON report (``--json PATH``; ``-`` for stdout) is one object. Schema
``sglang-storage.replay`` version :data:`SCHEMA_VERSION`; a version only grows keys, a
removed or retyped key is a new version. Sizes are bytes, times seconds, ``null`` where
there is no sample:

- ``schema`` (str), ``schema_version`` (int), ``ok`` (bool: every loaded page verified
  identical), ``elapsed_s`` (float).
- ``config``: ``workload`` (the :class:`~sglang_storage.cli.workload.WorkloadConfig`
  fields), ``model`` (``layers``, ``kv_heads``, ``head_dim``, ``page_size``, ``dtype``,
  ``page_bytes``, ``token_bytes``), ``device`` (``kind``, ``pages``, ``bytes``), ``host``
  (``pages``, ``bytes``), ``write_policy``, ``prefetch_policy``,
  ``prefetch_threshold_tokens``, ``prefill_tokens_per_s`` (float), ``follow_cost_model``
  (bool: hits the cost model finds cheaper to recompute were recomputed).
- ``storage``: ``backend`` (str), ``location`` (str or null: the file backend's
  directory), ``objects``, ``bytes`` (held at the end), ``corrupt`` (reads that failed
  verification, all ints).
- ``tokens``: ``turns``, ``prompt``, ``decode`` (ints).
- ``hits``: ``device``, ``host``, ``storage``, ``miss`` - each ``{"tokens": int,
  "fraction": float}`` of the input tokens (``miss``: recomputed, including hits the cost
  model chose to recompute and storage hits not loaded).
- ``storage_hits_not_loaded``: pages by reason - ``cost_model``, ``below_threshold``,
  ``truncated`` (corrupt, missing or failed in storage), ``host_full`` (ints).
- ``bytes``: ``d2h``, ``h2d``, ``host_to_storage``, ``storage_to_host`` (ints).
- ``decisions``: per tier (``host``, ``storage``): ``load``, ``recompute`` (ints),
  ``bandwidth_bytes_per_s``, ``latency_s`` (floats), ``source`` (``prior``, ``fit`` or
  ``partial_fit``), ``observations`` (int).
- ``latency``: per operation (``turn``, ``d2h``, ``h2d``, ``prefetch``, ``storage_get``,
  ``storage_put``, ``storage_exists``): ``count`` (int), ``p50_s``, ``p99_s``, ``max_s``
  (float or null; p50/p99 are histogram estimates).
- ``cost``: ``prefill_tokens_per_s`` (float) and ``with_storage`` / ``without_storage``,
  each ``recomputed_tokens`` (int), ``prefill_s``, ``load_s``, ``total_s`` (floats):
  prefill time estimated at that throughput, load time as measured in this run; without
  storage, storage hits are recomputed.
- ``verification``: ``pages_verified``, ``mismatched_pages`` (ints), ``mismatched_keys``
  (up to 5 str).
- ``faults``: ``load_failures``, ``host_write_failures``, ``host_full_skips`` (ints).
- ``manager``: the KV cache manager's counters
  (:class:`~sglang_storage.managers.kv.KVCacheStats` fields, ints).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final, TextIO

import attrs

from sglang_storage.cli.replay_engine import EngineConfig, EngineTotals
from sglang_storage.cli.workload import WorkloadConfig
from sglang_storage.storage.backend import BackendStats
from sglang_storage.transfer import LatencySnapshot
from sglang_storage.units import format_bytes

__all__ = ["SCHEMA", "SCHEMA_VERSION", "Progress", "build_report", "render_text"]

SCHEMA: Final = "sglang-storage.replay"
SCHEMA_VERSION: Final = 1
_OPERATIONS: Final = (
    "turn",
    "d2h",
    "h2d",
    "prefetch",
    "storage_get",
    "storage_put",
    "storage_exists",
)
_TIERS: Final = ("host", "storage")


def _latency(snapshot: LatencySnapshot) -> dict[str, Any]:
    return {
        "count": snapshot.count,
        "p50_s": snapshot.p50_s,
        "p99_s": snapshot.p99_s,
        "max_s": snapshot.max_s if snapshot.count else None,
    }


def build_report(
    *,
    workload: WorkloadConfig,
    engine: EngineConfig,
    totals: EngineTotals,
    backend: str,
    location: str | None,
    stored: BackendStats,
    elapsed_s: float,
) -> dict[str, Any]:
    """The JSON report of a finished replay (see the module docstring for the schema)."""
    shape = engine.shape
    t = totals
    prompt = max(t.prompt_tokens, 1)
    miss = t.computed_tokens
    rate = t.cost.prefill_tokens_per_s
    loads = t.host_load_s + t.storage_load_s
    decisions: dict[str, Any] = {}
    for tier in t.cost.tiers:
        if tier.tier in _TIERS:
            decisions[tier.tier] = {
                "load": tier.load_decisions,
                "recompute": tier.recompute_decisions,
                "bandwidth_bytes_per_s": tier.bandwidth_bytes_per_s,
                "latency_s": tier.latency_s,
                "source": tier.source.value,
                "observations": tier.observations,
            }
    sm = t.storage_metrics
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "ok": t.mismatched_pages == 0,
        "elapsed_s": elapsed_s,
        "config": {
            "workload": attrs.asdict(workload),
            "model": {
                **attrs.asdict(shape),
                "page_bytes": shape.page_bytes,
                "token_bytes": shape.token_bytes,
            },
            "device": {
                "kind": engine.device,
                "pages": engine.device_pages,
                "bytes": engine.device_pages * shape.page_bytes,
            },
            "host": {"pages": engine.host_pages, "bytes": engine.host_pages * shape.page_bytes},
            "write_policy": engine.write_policy,
            "prefetch_policy": engine.prefetch_policy,
            "prefetch_threshold_tokens": engine.prefetch_threshold_tokens,
            "prefill_tokens_per_s": engine.prefill_tokens_per_s,
            "follow_cost_model": engine.follow_cost_model,
        },
        "storage": {
            "backend": backend,
            "location": location,
            "objects": stored.objects,
            "bytes": stored.bytes,
            "corrupt": stored.corrupt,
        },
        "tokens": {"turns": t.turns, "prompt": t.prompt_tokens, "decode": t.decode_tokens},
        "hits": {
            name: {"tokens": n, "fraction": n / prompt}
            for name, n in (
                ("device", t.device_tokens),
                ("host", t.host_tokens),
                ("storage", t.storage_tokens),
                ("miss", miss),
            )
        },
        "storage_hits_not_loaded": attrs.asdict(t.skipped),
        "bytes": {
            "d2h": t.device_metrics.offload.nbytes,
            "h2d": t.device_metrics.load.nbytes,
            "host_to_storage": sm.put.bytes,
            "storage_to_host": sm.get.bytes,
        },
        "decisions": decisions,
        "latency": {name: _latency(t.latency[name]) for name in _OPERATIONS},
        "cost": {
            "prefill_tokens_per_s": rate,
            "with_storage": _cost(miss, rate, loads),
            "without_storage": _cost(miss + t.storage_tokens, rate, t.host_load_s),
        },
        "verification": {
            "pages_verified": t.verified_pages,
            "mismatched_pages": t.mismatched_pages,
            "mismatched_keys": list(t.mismatched_keys),
        },
        "faults": {
            "load_failures": t.load_failures,
            "host_write_failures": t.host_write_failures,
            "host_full_skips": t.host_full_skips,
        },
        "manager": dict(t.manager),
    }


def _cost(tokens: int, rate: float, load_s: float) -> dict[str, Any]:
    prefill = tokens / rate
    return {
        "recomputed_tokens": tokens,
        "prefill_s": prefill,
        "load_s": load_s,
        "total_s": prefill + load_s,
    }


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f} us"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def _rate(value: float) -> str:
    return f"{format_bytes(int(value))}/s"


def render_text(report: Mapping[str, Any]) -> str:
    """The report as a summary a newcomer can read."""
    c, s = report["config"], report["storage"]
    w, m = c["workload"], c["model"]
    lines = [
        f"sglang-storage replay: {report['tokens']['turns']} turns from {w['users']} users "
        f"({w['turns']} turns each, {w['system_prompts']} shared system prompts, "
        f"up to {w['concurrency']} conversations at once, seed {w['seed']})",
        f"model: {m['layers']} layers x {m['kv_heads']} KV heads x {m['head_dim']} dims, "
        f"{m['dtype']}, {m['page_size']}-token pages of {format_bytes(m['page_bytes'])}",
        f"tiers: device {c['device']['pages']} pages ({format_bytes(c['device']['bytes'])}, "
        f"{c['device']['kind']}) -> host {c['host']['pages']} pages "
        f"({format_bytes(c['host']['bytes'])}) -> {s['backend']} backend"
        + (f" at {s['location']}" if s["location"] else ""),
        f"policies: {c['write_policy']}, prefetch {c['prefetch_policy']} "
        f"(threshold {c['prefetch_threshold_tokens']} tokens)",
        "",
        f"Where the {report['tokens']['prompt']:,} input tokens came from:",
    ]
    labels = {
        "device": "device (already there)",
        "host": "host (loaded)",
        "storage": "storage (prefetched, loaded)",
        "miss": "recomputed (miss)",
    }
    for name, label in labels.items():
        hit = report["hits"][name]
        lines.append(f"  {label:<30} {hit['tokens']:>10,}  {hit['fraction']:6.1%}")
    skipped = report["storage_hits_not_loaded"]
    if any(skipped.values()):
        lines.append(
            "  storage hits not loaded (pages): "
            + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in skipped.items() if v)
        )
    b = report["bytes"]
    lines += [
        "",
        "Bytes moved:",
        f"  device -> host (D2H)  {format_bytes(b['d2h']):>12}",
        f"  host -> device (H2D)  {format_bytes(b['h2d']):>12}",
        f"  host -> storage       {format_bytes(b['host_to_storage']):>12}",
        f"  storage -> host       {format_bytes(b['storage_to_host']):>12}",
        "",
        "Load or recompute (cost model fed with this run's measured bandwidth; prefill "
        f"assumed at {c['prefill_tokens_per_s']:,.0f} tokens/s"
        + ("):" if c["follow_cost_model"] else "; advisory: every hit was loaded):"),
    ]
    for tier, d in report["decisions"].items():
        lines.append(
            f"  {tier:<8} load {d['load']:>5}  recompute {d['recompute']:>4}   "
            f"{_rate(d['bandwidth_bytes_per_s'])}, {_seconds(d['latency_s'])} per transfer "
            f"({d['source'].replace('_', ' ')}, {d['observations']} transfers)"
        )
    lines += ["", f"  {'latency':<16}{'count':>7}{'p50':>11}{'p99':>11}"]
    for name, lat in report["latency"].items():
        lines.append(
            f"  {name:<16}{lat['count']:>7}{_seconds(lat['p50_s']):>11}{_seconds(lat['p99_s']):>11}"
        )
    cost = report["cost"]
    with_s, without = cost["with_storage"], cost["without_storage"]
    lines += [
        "",
        "Without the storage tier:",
        f"  tokens recomputed     {with_s['recomputed_tokens']:>10,} with storage, "
        f"{without['recomputed_tokens']:,} without",
        f"  est. prefill + loads  {_seconds(with_s['total_s']):>10} with storage, "
        f"{_seconds(without['total_s'])} without",
    ]
    if c["device"]["kind"] == "cpu":
        lines.append(
            "  (the device is emulated with CPU tensors: loads are timed as CPU copies, while "
            "prefill is the assumed GPU rate)"
        )
    v = report["verification"]
    if v["mismatched_pages"]:
        verdict = (
            f"{v['mismatched_pages']} of {v['pages_verified']:,} loaded pages DIFFER from what "
            f"was written (e.g. {', '.join(k[:16] for k in v['mismatched_keys'])})"
        )
    else:
        verdict = f"all {v['pages_verified']:,} loaded pages are byte-identical to what was written"
    lines += ["", f"Verification: {verdict}."]
    if s["corrupt"]:
        lines.append(
            f"  storage found {s['corrupt']} corrupt objects: each was a miss and recomputed"
        )
    held = f"Data: {s['objects']:,} objects ({format_bytes(s['bytes'])})"
    if s["location"]:
        lines.append(
            f"{held} in {s['location']}; run again to reuse them, add --fresh to start empty."
        )
    else:
        lines.append(f"{held} held by the {s['backend']} backend at the end of the run.")
    lines.append(f"Done in {report['elapsed_s']:.1f} s.")
    return "\n".join(lines) + "\n"


class Progress:
    """A one-line progress bar on ``stream``, drawn only when it is a terminal."""

    _WIDTH: Final = 30
    _EVERY_S: Final = 0.1

    def __init__(self, stream: TextIO, total: int, *, label: str = "turns") -> None:
        self._stream = stream
        self._total = max(total, 1)
        self._label = label
        self._on = stream.isatty()
        self._started = time.perf_counter()
        self._drawn = 0.0

    @property
    def enabled(self) -> bool:
        """Whether the bar is drawn."""
        return self._on

    def update(self, done: int) -> None:
        """Show ``done`` of the total (redrawn at most ten times a second, and at the end)."""
        now = time.perf_counter()
        if not self._on or (now - self._drawn < self._EVERY_S and done < self._total):
            return
        self._drawn = now
        filled = self._WIDTH * done // self._total
        bar = "#" * filled + "." * (self._WIDTH - filled)
        self._stream.write(
            f"\r[{bar}] {done}/{self._total} {self._label}  {now - self._started:5.1f} s"
        )
        self._stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self._on:
            self._stream.write("\n")
            self._stream.flush()
            self._on = False
