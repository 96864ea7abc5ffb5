"""Hit queries through SGLang's own interface: ``HiCacheBackend`` against ``HiCacheFile``.

Run: ``.venv/bin/python benchmarks/hicache_interface.py`` (``--keys``, ``--repeats``;
``--quick`` for a short run). Both sides are built the way SGLang 0.5.23 builds a storage
backend and called the way its HiCache controller calls it:

- ours: ``StorageBackendFactory.create_backend("dynamic", ...)`` with our adapter over the
  ``file`` backend, attached to an SGLang host pool (``register_mem_pool_host`` ...), pages
  written with ``batch_set_v1``;
- SGLang's: ``HiCacheFile`` with its defaults (no metadata cache), pages written with
  ``batch_set`` of ``get_data_page`` tensors.

Then ``batch_exists`` of the same ``--keys`` SGLang page keys (all stored: every key is
checked, which is the controller's hit query for a cached prefix), timed back to back (order
alternating) so both see the same machine load. Rows print the median keys per second of
each, the median of the paired ratios ours / SGLang's (> 1: ours is faster) with the spread
(lowest and highest paired ratio), and the limit measured in the same run: a bare
``os.stat`` loop over our objects' paths (what any file-backed hit query must do per key).
Pages are small (one token row per layer; page size does not change an ``exists``). The
goal is ``>= 1.5x`` at 1k-key batches; the last line says whether the median meets it.
Progress (one line per step, with the time elapsed) goes to stderr.

This is a benchmark, not a test: machines are shared and noisy, so read the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.sglang_pools import build_hicache_file, build_sglang_host_pool

from sglang_storage.cli.bench_report import Progress, goal_verdict
from sglang_storage.storage.keys import page_hashes

PAGE = 4


def _ours(root: Path, pages: int) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    host = build_sglang_host_pool(
        attention="mha",
        layout="page_first",
        dtype=torch.bfloat16,
        layer_num=2,
        page_size=PAGE,
        num_pages=pages,
    )
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/hicache-interface",
        extra_config={
            "backend_name": "sglang_storage",
            "module_path": "sglang_storage_adapters.hicache_storage",
            "class_name": "HiCacheBackend",
            "interface_v1": 1,
            "storage_backend": "file",
            "storage_options": {"root": str(root)},
        },
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, host.pool)
    backend.register_mem_pool_host(host.pool)
    backend.register_mem_host_pool_v2(host.pool, PoolName.KV)
    backend.on_host_pools_registered()
    return backend, host


def _time(run: Callable[[], int], expected: int, inner: int) -> float:
    started = time.perf_counter()
    for _ in range(inner):
        if run() != expected:
            raise SystemExit("a hit query missed a stored page")
    return (time.perf_counter() - started) / inner


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000, help="keys per batch_exists")
    parser.add_argument("--repeats", type=int, default=15, help="paired measurements")
    parser.add_argument("--inner", type=int, default=5, help="queries per measurement")
    parser.add_argument("--quick", action="store_true", help="7 repeats")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 7
    n = int(args.keys)
    names = page_hashes(list(range(n * PAGE)), PAGE)
    progress = Progress(args.repeats + 2, "hicache_interface.py")
    with progress, tempfile.TemporaryDirectory(prefix="bench-hicache-") as tmp:
        progress.step(f"writing {n} pages both ways")
        ours, host = _ours(Path(tmp) / "ours", n)
        theirs = build_hicache_file(Path(tmp) / "sglang", model_name="bench/hicache-interface")
        try:
            indices = torch.arange(n * PAGE, dtype=torch.int64)
            if not all(ours.batch_set_v1(names, indices)):
                raise SystemExit("our batch_set_v1 failed")
            pages = [host.pool.get_data_page(i * PAGE, flat=True) for i in range(n)]
            if not theirs.batch_set(names, pages):
                raise SystemExit("HiCacheFile batch_set failed")
            paths = [ours.lease.backend._path(ours.object_key(name)) for name in names]

            def stat_loop() -> int:
                for path in paths:
                    os.stat(path)  # noqa: PTH116 - the limit is the bare syscall
                return n

            pairs: list[tuple[float, float]] = []
            limits: list[float] = []
            for repeat in range(args.repeats + 1):  # the first round warms up
                progress.step(f"round {repeat} of {args.repeats}" if repeat else "warm-up round")
                first, second = (
                    (lambda: theirs.batch_exists(names), lambda: ours.batch_exists(names))
                    if repeat % 2
                    else (lambda: ours.batch_exists(names), lambda: theirs.batch_exists(names))
                )
                a, b = _time(first, n, args.inner), _time(second, n, args.inner)
                t_ours, t_theirs = (b, a) if repeat % 2 else (a, b)
                limit = _time(stat_loop, n, args.inner)
                if repeat:
                    pairs.append((t_ours, t_theirs))
                    limits.append(limit)
        finally:
            ours.close()
    ratios = sorted(t / o for o, t in pairs)
    ratio = statistics.median(ratios)
    print(  # noqa: T201
        f"batch_exists of {n} stored keys, {args.inner} queries per measurement,"
        f" median of {args.repeats} paired measurements (order alternating)"
    )
    print(  # noqa: T201
        f"{'row':<12} {'ours keys/s':>12} {'sglang keys/s':>14} {'ratio':>7} {'spread':>13}"
        f" {'os.stat keys/s':>15}"
    )
    ours_s = statistics.median(o for o, _ in pairs)
    theirs_s = statistics.median(t for _, t in pairs)
    print(  # noqa: T201
        f"{'exists hit':<12} {n / ours_s:>12,.0f} {n / theirs_s:>14,.0f} {ratio:>6.2f}x"
        f" {f'{ratios[0]:.2f}-{ratios[-1]:.2f}x':>13}"
        f" {n / statistics.median(limits):>15,.0f}"
    )
    print(goal_verdict(">= 1.5x", f"{ratio:.2f}x", ratio >= 1.5))  # noqa: T201


if __name__ == "__main__":
    main()
