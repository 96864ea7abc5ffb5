#!/usr/bin/env bash
# End to end on a GPU CI machine with network access: the real SGLang 0.5.23 server with and
# without the storage tier.
#
# Usage: ci/gpu_e2e.sh [WORKDIR]        (default WORKDIR: a new directory under /tmp)
#
# 1. creates a venv (VENV, default WORKDIR/venv) with ${PYTHON:-python3} (3.11 or newer) and
#    installs this repository with the full SGLang 0.5.23 (`.[sglang]`, CUDA dependencies
#    included), constrained by ci/constraints.txt (CONSTRAINTS= to use none);
# 2. applies our patches (python -m sglang_storage_adapters.patching apply) and shows them;
# 3. builds a tiny random Llama with its tokenizer in WORKDIR/tiny-model, unless MODEL names
#    a model directory or hub name to use instead;
# 4. runs ci/gpu_e2e.py: `python -m sglang.launch_server` three times (no storage tier;
#    `--storage-backend file`; a restart on the same storage root), one multi-turn
#    conversation each, and asserts (a) identical greedy outputs, (b) storage hits after the
#    first turn, (c) after the restart, the same requests served from storage. It prints the
#    time to first token with and without the storage tier and writes WORKDIR/e2e.json.
#
# Environment: PYTHON, VENV, MODEL, PORT (default 30000), CONSTRAINTS, REUSE_VENV=1 (skip
# the install when VENV already has sglang), E2E_SETTLE_S (seconds between turns, default 3).
# Extra arguments for launch_server go in SERVER_ARGS (split on spaces).
# Exit status 0 when every assertion holds. Server logs: WORKDIR/server-*.log.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-$(mktemp -d /tmp/sglang-storage-e2e.XXXXXX)}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
PYTHON="${PYTHON:-python3}"
venv="${VENV:-$work/venv}"
port="${PORT:-30000}"
constraints="${CONSTRAINTS-$repo/ci/constraints.txt}"
echo "gpu_e2e: repository $repo, work directory $work, venv $venv"

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_e2e: nvidia-smi not found; this check needs a CUDA GPU" >&2
    exit 2
fi
nvidia-smi

# ------------------------------------------------------------------ 1. venv + install
py="$venv/bin/python"
if [[ "${REUSE_VENV:-0}" == 1 && -x "$py" ]] && "$py" -c 'import sglang' 2>/dev/null; then
    echo "gpu_e2e: reusing $venv"
else
    "$PYTHON" -m venv "$venv"
    "$py" -m pip install --upgrade pip
    pip_args=(install)
    if [[ -n "$constraints" ]]; then
        pip_args+=(-c "$constraints")
    fi
    # Editable, so the sglang.srt.plugins entry point and the patches' imports resolve here.
    "$py" -m pip "${pip_args[@]}" -e "${repo}[sglang]"
fi
"$py" - <<'EOF'
import importlib.metadata as md

import torch

print(f"sglang {md.version('sglang')}, sglang-storage {md.version('sglang-storage')}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.is_available()}")
assert torch.cuda.is_available(), "torch in the venv does not see the GPU"
assert md.version("sglang") == "0.5.23", "the adapters and patches target SGLang 0.5.23"
EOF

# ------------------------------------------------------------------ 2. patches
"$py" -m sglang_storage_adapters.patching apply
"$py" -m sglang_storage_adapters.patching status

# ------------------------------------------------------------------ 3. model
model="${MODEL:-}"
if [[ -z "$model" ]]; then
    model="$work/tiny-model"
    "$py" "$repo/ci/gpu_e2e.py" build-model "$model"
fi

# ------------------------------------------------------------------ 4. the runs
server_args=()
if [[ -n "${SERVER_ARGS:-}" ]]; then
    read -r -a server_args <<<"$SERVER_ARGS"
fi
cd "$work"
"$py" "$repo/ci/gpu_e2e.py" run --model "$model" --workdir "$work" --port "$port" \
    -- "${server_args[@]}"
