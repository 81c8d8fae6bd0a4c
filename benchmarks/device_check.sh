#!/usr/bin/env bash
# The prepared device check of issue 45 (under 8 minutes on one H100 or H200):
#   1. the GPU tests with the Triton kernels compiled (tests/gpu without TRITON_INTERPRET) and the
#      float64 gradient grid on the device (tests/system/test_on_device.py);
#   2. a step's host synchronisations (benchmarks/count_syncs.py: torch.cuda.set_sync_debug_mode
#      "warn" around train_step, each synchronisation counted with its place; one a step expected),
#      written to syncs_<card>.json;
#   3. the GPU benchmark (benchmarks/bench_gpu.py): pedestrian, PyTorch eager and torch.compile at
#      char-small 12x64, gpt2-124M 8x1024, SmolLM2-135M's shape 4x2048, float32; its JSON and
#      Markdown table, and the bench:gpu table of docs/performance.md.
#
#   benchmarks/device_check.sh             # on a GPU
#   benchmarks/device_check.sh --dry-run   # anywhere: the same steps on the CPU, the Triton
#                                          # kernels under the interpreter, tiny shapes (~3 minutes)
#
# PYTHON picks the interpreter (default: python3); the log and the benchmark's files go to
# benchmarks/results/ (or to $OUT when it is set, as on a lent machine). Exit status: the first
# failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST"
LOG="$DEST/device_check.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
status=0
step() {   # step NAME CMD...: run, log, remember the first failure
    local name=$1; shift
    echo "== $name: $*" | tee -a "$LOG"
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    [ $status -eq 0 ] && status=$rc
}
: > "$LOG"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$LOG"
import platform, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "not installed"
card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"device check: {card}; torch {torch.__version__}; triton {tv}; Python {platform.python_version()}")
PYEOF
if [ $DRY -eq 1 ]; then
    step tests env TRITON_INTERPRET=1 "$PY" -m pytest -q -x -p no:cacheprovider tests/gpu tests/system/test_on_device.py
    step syncs "$PY" benchmarks/count_syncs.py --dry-run --out "$DEST"
    step bench "$PY" benchmarks/bench_gpu.py --dry-run --out "$DEST"
else
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "device check: no CUDA device visible to torch; run it on a GPU, or with --dry-run" | tee -a "$LOG"
        exit 2
    fi
    step tests env -u TRITON_INTERPRET "$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/system/test_on_device.py
    step syncs env -u TRITON_INTERPRET "$PY" benchmarks/count_syncs.py --out "$DEST"
    step bench env -u TRITON_INTERPRET "$PY" benchmarks/bench_gpu.py --out "$DEST"
    if [ "$DEST" != "benchmarks/results" ] && [ -f docs/performance.md ]; then
        cp docs/performance.md "$DEST/performance.md"      # with its refreshed bench:gpu table
    fi
fi
echo "device check: exit $status (log: $LOG)" | tee -a "$LOG"
exit $status
