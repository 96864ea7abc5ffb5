"""``sglang-storage replay``: a multi-turn chat workload through device, host and storage.

Generates a seeded workload (:mod:`.workload`), drives the KV cache manager with it
(:mod:`.replay_engine`) and prints what each tier served, the bytes moved, the cost
model's load-or-recompute decisions, operation latencies and what the run would have cost
without a storage tier (:mod:`.replay_report`, which also documents the ``--json``
schema). Every page loaded back to the device is checked byte for byte against what was
written; the exit status is 1 when one differs (or the run fails), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch

from sglang_storage.cli.replay_engine import DTYPES, EngineConfig, ModelShape, ReplayEngine
from sglang_storage.cli.replay_report import (
    SCHEMA,
    SCHEMA_VERSION,
    Progress,
    build_report,
    render_text,
)
from sglang_storage.cli.workload import Workload, WorkloadConfig
from sglang_storage.errors import ConfigError, StorageError
from sglang_storage.policy import PREFETCH_STOP_POLICY_NAMES, WRITE_POLICY_NAMES
from sglang_storage.storage import Backend, backend_names, create_backend
from sglang_storage.storage.keys import kv_namespace, model_fingerprint
from sglang_storage.units import format_bytes, parse_bytes

__all__ = ["DEFAULT_DIR", "register"]

DEFAULT_DIR: Final = ".sglang-storage-demo"
"""Where the ``file`` backend keeps the demo's pages unless ``--dir`` says otherwise."""

_DESCRIPTION = """\
Replay a generated multi-turn chat workload (many users, several turns each, shared
system prompts, long contexts) through the KV cache manager: device (CUDA when present,
else CPU tensors) -> host memory -> a storage backend (the file backend by default).
Every page loaded back to the device is verified byte for byte. Prints the hits per
tier, bytes moved, load-or-recompute decisions, latencies, and the cost without storage.
"""
_EPILOG = f"""\
examples:
  sglang-storage replay            the demo: under a minute on 2 CPU cores, ~400 MiB on disk
  sglang-storage replay            again: storage now serves the first run's pages
  sglang-storage replay --fresh    start from an empty store
  sglang-storage replay --host-mem 48MiB    squeeze the host tier
  sglang-storage replay --users 24 --turns 6 --context-tokens 2048 \\
      --device-mem 96MiB --host-mem 256MiB  a bigger run (~1.3 GiB on disk)
  sglang-storage replay --dir /mnt/nvme/kv --backend-config '{{"durability": "data"}}'
  sglang-storage replay --backend memory    the in-process DRAM backend
  sglang-storage replay --backend faulty \\
      --backend-config '{{"inner": "memory", "bit_flip_rate": 0.05, "error_rate": 0.05}}'
                                   injected faults: misses and recomputes, never wrong pages
  sglang-storage replay --json report.json  also write the report as JSON (- for stdout)

The file backend keeps its pages under --dir (default ./{DEFAULT_DIR}). The JSON
report follows schema "{SCHEMA}" version {SCHEMA_VERSION} (keys documented in
sglang_storage/cli/replay_report.py). Exit status: 0 when every loaded page verified,
1 when one differed or the run failed, 2 for bad arguments.
"""


_MAX_COUNT: Final = 2**31 - 1
"""The largest count or seed an option takes (sizes and lengths must fit an index)."""


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {low}")
        if value > _MAX_COUNT:
            raise argparse.ArgumentTypeError(f"{value} is above the maximum {_MAX_COUNT}")
        return value

    parse.__name__ = "int"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def _size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error.reason}; {error.allowed}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError("nested too deeply to be options") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"durability": "data"}\'')
    return value


_POSITIVE = _int_at_least(1)
_NON_NEGATIVE = _int_at_least(0)


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``replay`` parser to ``subparsers``."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a multi-turn workload through device, host and storage (the demo)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = WorkloadConfig()
    work = parser.add_argument_group("workload")
    for flag, field, kind, text in (
        ("--users", "users", _POSITIVE, "conversations"),
        ("--turns", "turns", _POSITIVE, "turns per conversation"),
        ("--system-prompts", "system_prompts", _POSITIVE, "system prompts shared across users"),
        ("--system-tokens", "system_tokens", _NON_NEGATIVE, "tokens per system prompt"),
        ("--context-tokens", "context_tokens", _NON_NEGATIVE, "each user's long first context"),
        ("--prompt-tokens", "prompt_tokens", _POSITIVE, "tokens per new user message"),
        ("--answer-tokens", "answer_tokens", _NON_NEGATIVE, "tokens per answer"),
        ("--concurrency", "concurrency", _POSITIVE, "conversations active at once"),
        ("--seed", "seed", _NON_NEGATIVE, "seeds the workload"),
    ):
        default = getattr(defaults, field)
        work.add_argument(
            flag, type=kind, default=default, metavar="N", help=f"{text} (default {default})"
        )
    shape = ModelShape()
    model = parser.add_argument_group("model (KV cache shape)")
    model.add_argument(
        "--layers",
        type=_POSITIVE,
        default=shape.layers,
        metavar="N",
        help=f"default {shape.layers}",
    )
    model.add_argument(
        "--kv-heads",
        type=_POSITIVE,
        default=shape.kv_heads,
        metavar="N",
        help=f"default {shape.kv_heads}",
    )
    model.add_argument(
        "--head-dim",
        type=_POSITIVE,
        default=shape.head_dim,
        metavar="N",
        help=f"default {shape.head_dim}",
    )
    model.add_argument(
        "--page-size",
        type=_POSITIVE,
        default=shape.page_size,
        metavar="TOKENS",
        help=f"default {shape.page_size}",
    )
    model.add_argument(
        "--dtype", choices=sorted(DTYPES), default=shape.dtype, help=f"default {shape.dtype}"
    )
    tiers = parser.add_argument_group("tiers")
    tiers.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the device pool lives (default auto: cuda when available, else cpu)",
    )
    tiers.add_argument(
        "--device-mem",
        type=_size,
        default="48MiB",
        metavar="SIZE",
        help="device KV pool size, e.g. 1GiB (default 48MiB)",
    )
    tiers.add_argument(
        "--host-mem",
        type=_size,
        default="128MiB",
        metavar="SIZE",
        help="host KV pool size (default 128MiB)",
    )
    tiers.add_argument(
        "--backend",
        default="file",
        metavar="NAME",
        help="storage backend by name (default file); see --backend-config",
    )
    tiers.add_argument(
        "--backend-config",
        type=_json_object,
        default={},
        metavar="JSON",
        help="the backend's options as a JSON object (the file backend's root is --dir)",
    )
    tiers.add_argument(
        "--dir",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"the file backend's directory (default ./{DEFAULT_DIR})",
    )
    tiers.add_argument(
        "--fresh",
        action="store_true",
        help="delete this model's pages from the backend before the run",
    )
    policy = parser.add_argument_group("policies")
    policy.add_argument(
        "--write-policy",
        choices=WRITE_POLICY_NAMES,
        default="write_through",
        help="default write_through",
    )
    policy.add_argument(
        "--prefetch-policy",
        choices=PREFETCH_STOP_POLICY_NAMES,
        default="wait_complete",
        help="when a prefetch stops waiting (default wait_complete)",
    )
    policy.add_argument(
        "--prefetch-threshold",
        type=_NON_NEGATIVE,
        default=256,
        metavar="TOKENS",
        help="shortest storage hit worth prefetching (default 256, as SGLang)",
    )
    policy.add_argument(
        "--prefill-tokens-per-s",
        type=_positive_float,
        default=10_000.0,
        metavar="RATE",
        help="assumed GPU prefill throughput for the cost model (default 10000)",
    )
    policy.add_argument(
        "--cost-model",
        choices=("auto", "follow", "report"),
        default="auto",
        help="follow: recompute hits the cost model finds cheaper to recompute; report: "
        "load every hit and only count its decisions (default auto: follow on cuda, report "
        "on cpu, where the device is emulated and host->device is a CPU copy)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--verbose",
        action="store_true",
        help="also show the subsystem's warnings (failed backend calls and the like; "
        "the report counts them either way)",
    )
    out.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the report as JSON to PATH (- for stdout; the text goes to stderr)",
    )
    parser.set_defaults(run=functools.partial(_run, parser))


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        workload_config = WorkloadConfig(
            users=args.users,
            turns=args.turns,
            system_prompts=args.system_prompts,
            system_tokens=args.system_tokens,
            context_tokens=args.context_tokens,
            prompt_tokens=args.prompt_tokens,
            answer_tokens=args.answer_tokens,
            concurrency=args.concurrency,
            seed=args.seed,
        )
        shape = ModelShape(
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            page_size=args.page_size,
            dtype=args.dtype,
        )
    except ConfigError as error:
        parser.error(str(error))
    if shape.row_bytes % 8:
        parser.error(
            f"--kv-heads x --head-dim x {shape.torch_dtype.itemsize} bytes = {shape.row_bytes} "
            "bytes per token row; it must be a multiple of 8"
        )
    engine_config = _engine_config(parser, args, shape, workload_config)
    backend_name, options, location = _backend_options(parser, args)
    namespace = kv_namespace(
        model_fingerprint(
            "sglang-storage-replay",
            layers=shape.layers,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            page_size=shape.page_size,
            dtype=shape.dtype,
            layout="page_first",
        ),
        mla=False,
    )
    try:
        backend = create_backend(backend_name, options)
    except ConfigError as error:
        parser.error(f"--backend {backend_name} / --backend-config: {error}")
    except StorageError as error:
        return _fail(error)
    out = sys.stderr if args.json == "-" else sys.stdout
    logger = logging.getLogger("sglang_storage")
    level = logger.level
    if not args.verbose:  # the report counts what the warnings would say
        logger.setLevel(logging.ERROR)
    try:
        report = _replay(backend, namespace, workload_config, engine_config, args.fresh, location)
    except StorageError as error:
        return _fail(error)
    finally:
        logger.setLevel(level)
    out.write(render_text(report))
    if args.json is not None:
        text = json.dumps(report, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            try:
                Path(args.json).write_text(text)
            except OSError as error:
                return _fail(f"cannot write --json {args.json}: {error.strerror or error}")
    return 0 if report["ok"] else 1


def _replay(
    backend: Backend,
    namespace: Any,
    workload_config: WorkloadConfig,
    engine_config: EngineConfig,
    fresh: bool,
    location: str | None,
) -> dict[str, Any]:
    started = time.perf_counter()
    workload = Workload(workload_config, page_size=engine_config.shape.page_size)
    try:
        if fresh:
            backend.clear(namespace)
        engine = ReplayEngine(engine_config, backend, namespace)
        progress = Progress(sys.stderr, len(workload))
        try:
            for done, turn in enumerate(workload, 1):
                engine.run_turn(turn)
                progress.update(done)
            totals = engine.finish()
        finally:
            progress.close()
            engine.close()
        stored = backend.stats()
    finally:
        backend.close()
    return build_report(
        workload=workload_config,
        engine=engine_config,
        totals=totals,
        backend=backend.name,
        location=location,
        stored=stored,
        elapsed_s=time.perf_counter() - started,
    )


def _engine_config(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    shape: ModelShape,
    workload: WorkloadConfig,
) -> EngineConfig:
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (use --device cpu or auto)")
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    page = shape.page_bytes
    turn_pages = -(-workload.max_tokens // shape.page_size)
    for flag, size, need in (
        ("--device-mem", args.device_mem, turn_pages + 1),
        ("--host-mem", args.host_mem, turn_pages),
    ):
        if size // page < need:
            parser.error(
                f"{flag} {format_bytes(size)} holds {size // page} pages of "
                f"{format_bytes(page)}; the longest turn needs {need} pages: give at least "
                f"{format_bytes(need * page)} (or shrink the workload or the model)"
            )
    return EngineConfig(
        shape=shape,
        device_pages=args.device_mem // page,
        host_pages=args.host_mem // page,
        device=device,
        write_policy=args.write_policy,
        prefetch_policy=args.prefetch_policy,
        prefetch_threshold_tokens=args.prefetch_threshold,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        follow_cost_model=args.cost_model == "follow"
        or (args.cost_model == "auto" and device == "cuda"),
    )


def _backend_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[str, dict[str, Any], str | None]:
    names = backend_names()
    if args.backend not in backend_names(test_backends=True):
        parser.error(
            f"--backend {args.backend!r} is not a known backend; choose from {', '.join(names)}"
        )
    options = dict(args.backend_config)
    if args.backend != "file":
        if args.dir is not None:
            parser.error("--dir applies to the file backend only (use --backend-config)")
        return args.backend, options, None
    if "root" in options:
        if args.dir is not None:
            parser.error(
                "give the file backend's directory once: --dir or root in --backend-config"
            )
        root = Path(str(options["root"]))
    else:
        root = args.dir if args.dir is not None else Path(DEFAULT_DIR)
    root = root.expanduser().absolute()
    if root.exists() and not root.is_dir():
        parser.error(f"--dir {root} exists and is not a directory")
    options["root"] = str(root)
    return args.backend, options, os.fspath(root)


def _fail(error: StorageError | str) -> int:
    sys.stderr.write(f"sglang-storage replay: error: {error}\n")
    return 1
