#!/usr/bin/env bash
# The GPU check: the gpu-marked tests and the device<->host transfer benchmark, in one run.
#
# Usage: ci/gpu_check.sh [--require-target] OUTDIR
#
# Needs only Python with torch (2.11 or newer) and, for real results, CUDA; plus pytest,
# pytest-timeout, hypothesis, attrs and xxhash. No SGLang, no Mooncake, no network, no
# installs: this repository's source is used from the working tree (PYTHONPATH), installed
# or not. Run from anywhere; it works in the repository root. Writes into OUTDIR:
#
#   env.txt            python, torch, CUDA and GPU facts
#   native.log         the in-place build of the C extensions (best effort)
#   gpu-tests.xml      JUnit XML of `pytest tests/gpu -m gpu`
#   gpu-tests.log      the pytest output (-ra: every skip with its reason)
#   gpu_transfer.json  benchmark rows: pipeline vs plain pinned copy_, GiB/s and ratio
#   gpu_transfer.md    the same as a markdown table, with the >= 90% target verdict
#   benchmark.log      the benchmark's output
#   summary.txt        one line per step and its exit status
#
# Exit status: 0 when the tests pass (or, without CUDA, all skip with their reason) and the
# benchmark ran (or, without CUDA, reported "CUDA not available: skipped"); non-zero
# otherwise. With --require-target a missed bandwidth target (page_first, pages >= 1 MiB,
# pipeline >= 90% of the plain copy) also fails. With CUDA present the gpu tests are
# required (SGLANG_STORAGE_REQUIRE=gpu), so none can pass by skipping. Bounded: tests
# 240 s (60 s per test), benchmark 150 s, under 7 minutes in all (GPU_TEST_TIMEOUT, GPU_BENCH_TIMEOUT
# override; PYTHON picks the interpreter). The benchmark writes its files after every row,
# so a run cut short keeps what it measured.
set -euo pipefail

usage() {
    echo "usage: $0 [--require-target] OUTDIR" >&2
    exit 2
}

require_target=""
outdir=""
while (($#)); do
    case "$1" in
    --require-target) require_target="--require-target" ;;
    -h | --help) usage ;;
    -*) echo "unknown option: $1" >&2 && usage ;;
    *)
        [[ -z "$outdir" ]] || usage
        outdir="$1"
        ;;
    esac
    shift
done
[[ -n "$outdir" ]] || usage

PYTHON="${PYTHON:-python3}"
test_timeout="${GPU_TEST_TIMEOUT:-240}"
bench_timeout="${GPU_BENCH_TIMEOUT:-150}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$outdir"
outdir="$(cd "$outdir" && pwd)"
cd "$repo"

# The source tree, never an installed copy; tests/ for `support` (pyproject's pythonpath too).
export PYTHONPATH="$repo:$repo/integrations:$repo/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
# Only the plug-ins named here: the run is the same wherever third-party plug-ins differ.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
summary="$outdir/summary.txt"
: >"$summary"
started=$SECONDS

# ------------------------------------------------------------------ facts
"$PYTHON" - >"$outdir/env.txt" 2>&1 <<'EOF'
import platform
import sys

import torch

print(f"python: {sys.version.split()[0]} ({sys.executable})")
print(f"platform: {platform.platform()}")
print(f"torch: {torch.__version__}")
print(f"torch CUDA build: {torch.version.cuda}")
available = torch.cuda.is_available()
print(f"CUDA available: {available}")
if available:
    print(f"CUDA devices: {torch.cuda.device_count()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(
            f"device {i}: {p.name}, capability {p.major}.{p.minor}, "
            f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs"
        )
    print(f"cuDNN: {torch.backends.cudnn.version()}")
try:
    import sgl_kernel  # noqa: F401

    print("sgl_kernel: importable")
except Exception as error:  # any failure: report it, the check goes on
    print(f"sgl_kernel: not importable ({type(error).__name__}: {error})")
EOF
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi >>"$outdir/env.txt" 2>&1 || true
fi
cat "$outdir/env.txt"
cuda="$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')"
if [[ "$cuda" == 1 ]]; then
    export SGLANG_STORAGE_REQUIRE=gpu
else
    export SGLANG_STORAGE_REQUIRE=""
fi

# ------------------------------------------------------------------ C extensions
# Best effort: where this machine has a compiler, OpenSSL's headers and xxhash.h the C page
# keys and file reads are built in place, else the Python paths run (same results, slower).
if timeout 120 "$PYTHON" ci/build_native.py >"$outdir/native.log" 2>&1; then
    echo "C extensions: built" | tee -a "$summary"
else
    echo "C extensions: not (all) built, the Python paths run; see native.log" | tee -a "$summary"
fi

# ------------------------------------------------------------------ tests
# pytest runs in-process under a wrapper that also fails the step when SGLang or Mooncake
# got imported: the gpu tests must need neither.
set +e
timeout --kill-after=10 "$test_timeout" "$PYTHON" - "$outdir" <<'EOF' 2>&1 | tee "$outdir/gpu-tests.log"
import sys

import pytest

out = sys.argv[1]
rc = pytest.main(
    [
        "tests/gpu",
        "-m",
        "gpu",
        "-p",
        "pytest_timeout",
        "--timeout=60",
        "-p",
        "no:cacheprovider",
        "-v",
        f"--junitxml={out}/gpu-tests.xml",
        "-o",
        "junit_family=xunit2",
    ]
)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {"sglang", "mooncake"})
if leaked:
    print(f"gpu_check: the gpu tests imported {', '.join(leaked[:5])}; they must not")
    sys.exit(3)
sys.exit(int(rc))
EOF
tests_rc=${PIPESTATUS[0]}
set -e
echo "tests: exit $tests_rc" >>"$summary"

# ------------------------------------------------------------------ benchmark
set +e
bench_args=(--out "$outdir")
[[ -z "$require_target" ]] || bench_args+=("$require_target")
timeout --kill-after=10 "$bench_timeout" "$PYTHON" benchmarks/gpu_transfer.py "${bench_args[@]}" \
    2>&1 | tee "$outdir/benchmark.log"
bench_rc=${PIPESTATUS[0]}
set -e
echo "benchmark: exit $bench_rc" >>"$summary"
echo "total: $((SECONDS - started)) s" >>"$summary"

echo "--- gpu_check summary ($outdir)"
cat "$summary"
if ((tests_rc != 0 || bench_rc != 0)); then
    exit 1
fi
