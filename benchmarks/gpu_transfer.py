"""The device<->host pipeline's bandwidth against a plain pinned ``copy_`` of the same bytes.

Run: ``python benchmarks/gpu_transfer.py --out DIR`` (``--pages``, ``--repeats``,
``--page-kib``, ``--layouts``, ``--require-target``). Needs CUDA; where it is absent it says
``CUDA not available: skipped`` (and writes that into ``--out``) and exits 0: no numbers are
made up. ``--device cpu`` runs the same rows with a CPU "device" pool and pageable host
memory: no PCIe is involved, so its ratios compare our gather/scatter with one contiguous
``copy_`` in host memory; it exercises this script and the pipeline's copies where no GPU
is lent, and is never reported as a GPU result.

For each layout (``layer_first``, ``page_first``) and page size (64 KiB, 256 KiB, 1 MiB and
4 MiB by default: the bytes of one KV page, every layer, K and V), one MHA bf16 host pool of
``--pages`` pages in page-locked memory and a device pool of the same number of pages are
built, and ``--pages`` pages are moved per transfer, two ways, in both directions:

- ``pipeline``: :class:`~sglang_storage.transfer.device.DeviceHostPipeline` ``offload``
  (D2H) and ``load`` (H2D, every layer), host and device pages shuffled, waited with the
  handle's ``wait()``;
- ``plain``: one ``copy_`` of the same number of bytes between a contiguous pinned host
  tensor and a contiguous device tensor (the PCIe ceiling).

Each timing is host wall time from a ``torch.cuda.synchronize()`` to the end of the
transfer (``synchronize`` again), so the pipeline's submission cost is counted; device time
from CUDA events (ours: the transfer's start and finish events) is reported beside it. Runs
alternate pipeline and plain, the first ``--warmup`` rounds are not counted, and rows report
the medians (GiB/s) and the ratio pipeline / plain of the medians. The goal is a ratio
>= 0.90 for ``page_first`` at pages of 1 MiB and more; with ``--require-target`` a run that
does not meet it exits 1. Writes ``gpu_transfer.json`` and ``gpu_transfer.md`` into ``--out``.

This is a benchmark, not a test: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from sglang_storage.memory import (
    Attention,
    BudgetConfig,
    HostMemory,
    HostMemoryBudget,
    KVGeometry,
    KVHostPool,
    KVLayout,
    Pinning,
)
from sglang_storage.transfer.device import DeviceHostPipeline
from sglang_storage.transfer.device_kv import DeviceKV

SKIPPED = "CUDA not available: skipped"
TARGET_RATIO = 0.90
TARGET_LAYOUT = "page_first"
TARGET_MIN_PAGE = 1 << 20
LAYERS, HEADS, HEAD_DIM = 8, 8, 128
DTYPE = torch.bfloat16
ROW_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 2  # one token: K and V, every layer, bf16
GIB = float(1 << 30)


def geometry(layout: KVLayout, page_bytes: int, pages: int) -> KVGeometry:
    """An MHA bf16 geometry whose pages hold ``page_bytes`` bytes."""
    if page_bytes % ROW_BYTES:
        raise SystemExit(f"page size {page_bytes} B is not a multiple of {ROW_BYTES} B")
    return KVGeometry(
        attention=Attention.MHA,
        layout=layout,
        dtype=DTYPE,
        layer_num=LAYERS,
        page_size=page_bytes // ROW_BYTES,
        num_pages=pages,
        head_num=HEADS,
        head_dim=HEAD_DIM,
    )


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed(run: Callable[[], float | None], device: str) -> tuple[float, float]:
    """Seconds ``run`` takes: wall time (device work included) and device time.

    ``run`` returns its device time where it measures it (the pipeline's transfer events);
    otherwise the copies it queued are timed with events around it (the wall time on CPU).
    """
    synchronize(device)
    events = (
        (
            torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
            torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
        )
        if device == "cuda"
        else None
    )
    if events is not None:
        events[0].record()
    started = time.perf_counter()
    own = run()
    if events is not None:
        events[1].record()
    synchronize(device)
    wall = time.perf_counter() - started
    if own is not None:
        return wall, own
    if events is not None:
        return wall, float(events[0].elapsed_time(events[1])) / 1000.0
    return wall, wall


def measure(
    layout: KVLayout,
    page_bytes: int,
    pages: int,
    repeats: int,
    warmup: int,
    seed: int,
    device_type: str = "cuda",
) -> dict[str, Any]:
    """One row: medians per direction, pipeline and plain, and their ratios."""
    g = geometry(layout, page_bytes, pages)
    total = pages * g.page_bytes
    cuda = device_type == "cuda"
    memory = HostMemory(
        HostMemoryBudget(BudgetConfig(total=total + (64 << 20), headroom=0)),
        pinning=Pinning.ALWAYS if cuda else Pinning.NEVER,
    )
    host = KVHostPool(g, memory)
    host.alloc(pages)
    device = DeviceKV.allocate(g, pages * g.page_size, device_type)
    for tensor in (*device.k, *(device.v or ())):
        tensor.view(torch.uint8).random_(0, 256)
    host.kv_buffer.view(torch.uint8).random_(0, 256)
    rng = random.Random(seed)
    host_pages = torch.tensor(rng.sample(range(pages), pages), dtype=torch.int64)
    device_pages = torch.tensor(rng.sample(range(pages), pages), dtype=torch.int64)
    tokens = (device_pages.unsqueeze(1) * g.page_size + torch.arange(g.page_size)).flatten()
    plain_host = torch.empty(total, dtype=torch.uint8)
    if cuda:
        plain_host = plain_host.pin_memory()
    plain_device = torch.empty(total, dtype=torch.uint8, device=device_type)
    names = ("d2h", "h2d", "plain_d2h", "plain_h2d")
    times: dict[str, list[float]] = {k: [] for k in names}
    device_times: dict[str, list[float]] = {k: [] for k in names}
    with DeviceHostPipeline(device, host) as pipe:
        backend = pipe.io_detail

        def offload() -> float:
            result = pipe.offload(host_pages, tokens).wait()
            if not result.ok:
                raise SystemExit("offload failed")
            return result.latency_s

        def load() -> float:
            result = pipe.load(host_pages, tokens).wait()
            if not result.ok:
                raise SystemExit("load failed")
            return result.latency_s

        def plain_d2h() -> None:
            plain_host.copy_(plain_device, non_blocking=True)

        def plain_h2d() -> None:
            plain_device.copy_(plain_host, non_blocking=True)

        runs: dict[str, Callable[[], float | None]] = {
            "d2h": offload,
            "plain_d2h": plain_d2h,
            "h2d": load,
            "plain_h2d": plain_h2d,
        }
        order = list(runs)
        for round_ in range(warmup + repeats):
            for name in order if round_ % 2 == 0 else reversed(order):
                wall, on_device = timed(runs[name], device_type)
                if round_ >= warmup:
                    times[name].append(wall)
                    device_times[name].append(on_device)
    host.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    device_medians = {k: statistics.median(v) for k, v in device_times.items()}
    row: dict[str, Any] = {
        "layout": layout.value,
        "page_bytes": g.page_bytes,
        "page_tokens": g.page_size,
        "pages": pages,
        "transfer_bytes": total,
        "io_backend": backend,
    }
    for direction in ("d2h", "h2d"):
        ours = total / medians[direction] / GIB
        plain = total / medians[f"plain_{direction}"] / GIB
        row[f"{direction}_gib_s"] = round(ours, 3)
        row[f"plain_{direction}_gib_s"] = round(plain, 3)
        row[f"{direction}_ratio"] = round(ours / plain, 4)
        # Device time only (events): the copies without the host's submission cost.
        ours_device = total / device_medians[direction] / GIB
        plain_device_rate = total / device_medians[f"plain_{direction}"] / GIB
        row[f"{direction}_device_ratio"] = round(ours_device / plain_device_rate, 4)
    # The goal is about PCIe: a CPU run never applies it.
    row["target_applies"] = (
        cuda and layout.value == TARGET_LAYOUT and g.page_bytes >= TARGET_MIN_PAGE
    )
    row["target_met"] = (
        min(row["d2h_ratio"], row["h2d_ratio"]) >= TARGET_RATIO if row["target_applies"] else None
    )
    return row


def markdown(rows: Sequence[dict[str, Any]], facts: dict[str, Any]) -> str:
    """The rows as a markdown table, with the goal verdict."""
    lines = [
        "# Device<->host pipeline vs plain pinned copy_",
        "",
        f"{facts['device']}, torch {facts['torch']}, CUDA {facts['cuda']}; "
        f"I/O backend: {rows[0]['io_backend'] if rows else '-'}",
        "",
        "| layout | page | pages | D2H ours | D2H plain | D2H ratio "
        "| H2D ours | H2D plain | H2D ratio | D2H / H2D device-time ratio | goal (>= 90%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = "n/a" if r["target_met"] is None else ("met" if r["target_met"] else "not met")
        lines.append(
            f"| {r['layout']} | {r['page_bytes'] >> 10} KiB | {r['pages']} "
            f"| {r['d2h_gib_s']:.1f} | {r['plain_d2h_gib_s']:.1f} | {r['d2h_ratio']:.1%} "
            f"| {r['h2d_gib_s']:.1f} | {r['plain_h2d_gib_s']:.1f} | {r['h2d_ratio']:.1%} "
            f"| {r['d2h_device_ratio']:.1%} / {r['h2d_device_ratio']:.1%} | {verdict} |"
        )
    lines += [
        "",
        "Bandwidths in GiB/s (medians of wall time, submission included); ratio = ours / "
        "plain. The device-time ratio uses CUDA events only (ours: the transfer's own start "
        "and finish events), leaving out the host's submission cost. The goal is judged "
        "on wall time.",
    ]
    return "\n".join(lines) + "\n"


def write(out: Path | None, report: dict[str, Any], table: str) -> None:
    """Write the JSON report and the markdown table into ``out`` (when given)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_transfer.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_transfer.md").write_text(table)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=None, help="directory for JSON + markdown")
    parser.add_argument("--pages", type=int, default=32, help="pages per transfer")
    parser.add_argument("--repeats", type=int, default=9, help="counted rounds")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted first rounds")
    parser.add_argument(
        "--page-kib", type=int, nargs="+", default=[64, 256, 1024, 4096], help="page sizes"
    )
    parser.add_argument(
        "--layouts", nargs="+", default=["layer_first", "page_first"], help="host layouts"
    )
    parser.add_argument(
        "--require-target", action="store_true", help="exit 1 when the goal (>= 90%%) is not met"
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (the GPU check) or cpu (a CPU 'device' pool: exercises the script, not PCIe)",
    )
    args = parser.parse_args(argv)
    if args.pages < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--pages and --repeats must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 unless ``--require-target`` and the goal was not met."""
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        reason = f"{SKIPPED} (torch {torch.__version__}, CUDA build {torch.version.cuda})"
        print(reason)  # noqa: T201
        write(args.out, {"skipped": reason, "rows": []}, f"# GPU transfer benchmark\n\n{reason}\n")
        return 0
    facts = {
        "device": (
            torch.cuda.get_device_name()
            if args.device == "cuda"
            else "CPU (no GPU: host memory both sides, not a PCIe result)"
        ),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    rows = []
    for name in args.layouts:
        for kib in args.page_kib:
            row = measure(
                KVLayout(name), kib << 10, args.pages, args.repeats, args.warmup, kib, args.device
            )
            print(json.dumps(row), flush=True)  # noqa: T201
            rows.append(row)
            # Written after every row: a run cut short by a time limit keeps what it measured.
            write(args.out, {"facts": facts, "partial": True, "rows": rows}, markdown(rows, facts))
    applicable = [r for r in rows if r["target_applies"]]
    met = all(r["target_met"] for r in applicable) if applicable else None
    report = {
        "facts": facts,
        "target": {
            "ratio": TARGET_RATIO,
            "layout": TARGET_LAYOUT,
            "min_page_bytes": TARGET_MIN_PAGE,
            "met": met,
        },
        "rows": rows,
    }
    table = markdown(rows, facts)
    verdict = {None: "not measured", True: "met", False: "not met"}[met]
    table += f"\nGoal (page_first, >= 1 MiB pages, both directions >= 90%): {verdict}\n"
    write(args.out, report, table)
    print(table)  # noqa: T201
    return 1 if args.require_target and met is False else 0


if __name__ == "__main__":
    sys.exit(main())
