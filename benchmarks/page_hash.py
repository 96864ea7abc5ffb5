"""Page keys: ``keys.page_hashes`` against SGLang 0.5.23's native ``get_hash_str``.

Run: ``.venv/bin/python benchmarks/page_hash.py`` (``--tokens``, ``--repeats``,
``--page-sizes``; ``--quick`` for a short run). Hashes the same seeded token ids (ids below
a 150k vocabulary) both ways, in one process, for each page size and two input forms:

- ``list``: a Python list of ints (what our managers pass; SGLang converts it to an
  ``array('q')`` before its C++ loop);
- ``array-q``: an ``array('q')``, what SGLang's ``RadixKey.token_ids`` holds (SGLang hashes
  it in place).

Before timing, every row checks that both give the same keys. Each measurement times ours
and SGLang's back to back (order alternating) on the same input, so both see the same
machine load; rows print the median microseconds per call of each, the median of the
paired ratios SGLang / ours (> 1: ours is faster) with the spread (lowest and highest
paired ratio), and two limits measured in the same run:

- ``py floor``: one bare ``hashlib.sha256(prior + page).digest()`` per page over bytes
  packed in advance, the least a pure-Python chain can do (the chain is sequential: each
  page's key needs the previous digest, so pages cannot be hashed in parallel); ours
  runs the C chain (``sglang_storage/storage/_pagehash.c``) where it was compiled at
  install, which the first line says;
- ``C++ only``: SGLang's native loop on an ``array('q')`` (no conversion).

The goal is ``>= 1.0x`` at page sizes 16, 64 and 256; the last line says whether the worst
row meets it. Progress (one line per row, with the time elapsed) goes to stderr. This is a
benchmark, not a test: machines are shared and noisy, so read the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from array import array
from collections.abc import Callable
from functools import partial
from typing import Any, cast

from sglang_storage.cli.bench_report import Progress, goal_verdict
from sglang_storage.storage import keys
from sglang_storage.storage.keys import page_hashes

VOCAB = 150_000


def _sglang_hash() -> Callable[..., Any]:
    from sglang.srt.mem_cache.utils import get_hash_str

    return cast(Callable[..., Any], get_hash_str)


def _time(run: Callable[[], object], inner: int) -> float:
    started = time.perf_counter()
    for _ in range(inner):
        run()
    return (time.perf_counter() - started) / inner


def _py_floor(ids: list[int], page_size: int) -> Callable[[], object]:
    data = array("I", ids).tobytes()
    stride = page_size * 4
    pages = [data[s : s + stride] for s in range(0, len(data), stride)]
    sha256 = hashlib.sha256

    def run() -> object:
        prior = b""
        for page in pages:
            prior = sha256(prior + page).digest()
        return prior

    return run


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="token ids per call")
    parser.add_argument("--repeats", type=int, default=15, help="paired measurements")
    parser.add_argument("--inner", type=int, default=0, help="calls per measurement (0: auto)")
    parser.add_argument("--page-sizes", default="16,64,256", help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="8192 tokens, 7 repeats")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 8192, 7
    get_hash_str = _sglang_hash()
    rng = random.Random(25)
    ids = [rng.randrange(VOCAB) for _ in range(args.tokens)]
    inputs: dict[str, Any] = {"list": ids, "array-q": array("q", ids)}
    inner = args.inner or max(1, 200_000 // args.tokens)
    print(  # noqa: T201
        f"{args.tokens} token ids per call, {inner} calls per measurement,"
        f" median of {args.repeats} paired measurements (order alternating);"
        f" ours: {'the C chain (_pagehash)' if keys.NATIVE else 'the pure-Python chain'}"
    )
    print(  # noqa: T201
        f"{'page':>4} {'input':<8} {'ours us':>9} {'sglang us':>10} {'ratio':>7}"
        f" {'spread':>13} {'py floor us':>12} {'C++ only us':>12}"
    )
    worst = float("inf")
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    progress = Progress(len(page_sizes) * len(inputs), "page_hash.py")
    for page_size in page_sizes:
        floor = _py_floor(ids, page_size)
        native = inputs["array-q"]
        for form, given in inputs.items():
            progress.step(f"page size {page_size}, {form}")
            expected = get_hash_str(given, None, page_size=page_size)
            if page_hashes(given, page_size) != expected:
                raise SystemExit(f"keys differ from SGLang's at page size {page_size} ({form})")

            def ours(given: Any = given, page_size: int = page_size) -> object:
                return page_hashes(given, page_size)

            def theirs(given: Any = given, page_size: int = page_size) -> object:
                return get_hash_str(given, None, page_size=page_size)

            pairs: list[tuple[float, float]] = []
            floors: list[float] = []
            cpp: list[float] = []
            for repeat in range(args.repeats + 1):  # the first round warms up
                if repeat % 2:
                    t_theirs, t_ours = _time(theirs, inner), _time(ours, inner)
                else:
                    t_ours, t_theirs = _time(ours, inner), _time(theirs, inner)
                f = _time(floor, inner)
                c = _time(partial(get_hash_str, native, None, page_size=page_size), inner)
                if repeat:
                    pairs.append((t_ours, t_theirs))
                    floors.append(f)
                    cpp.append(c)
            ratios = sorted(t / o for o, t in pairs)
            ratio = statistics.median(ratios)
            worst = min(worst, ratio)
            print(  # noqa: T201
                f"{page_size:>4} {form:<8} {statistics.median(o for o, _ in pairs) * 1e6:>9.1f}"
                f" {statistics.median(t for _, t in pairs) * 1e6:>10.1f} {ratio:>6.2f}x"
                f" {f'{ratios[0]:.2f}-{ratios[-1]:.2f}x':>13}"
                f" {statistics.median(floors) * 1e6:>12.1f} {statistics.median(cpp) * 1e6:>12.1f}"
            )
    progress.close()
    print(goal_verdict(">= 1.0x at every row", f"worst row {worst:.2f}x", worst >= 1.0))  # noqa: T201


if __name__ == "__main__":
    main()
