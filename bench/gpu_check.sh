#!/usr/bin/env bash
# The GPU check a maintainer runs on a machine with NVIDIA GPUs, PyTorch (CUDA) and flexpipe
# installed; no internet needed (random weights, model shapes from the catalog). Under 8 minutes:
#
#   1. flexpipe discover --probe      the GPUs and links flexpipe sees, bandwidth measured
#   2. flexpipe calibrate --quick     the performance model's kernels timed on GPU 0 (and NCCL
#                                     collectives when more than one GPU is visible), fitted
#   3. the model's error against those measurements with generic, shipped and freshly fitted
#      factors: the table of docs/performance-model.md, for this GPU
#
#   bench/gpu_check.sh                      # writes gpu-check-<UTC time>/
#   OUT=/tmp/gc MODEL=llama-3.1-8b FULL=1 bench/gpu_check.sh     # the full calibration (~5 min)
#
# The results stay in $OUT (cluster.yaml, calibrate.csv, error-table.md, a log per step, and a
# store of their own: ~/.flexpipe is not touched). Without a usable GPU it stops at once with
# one line on stderr and exit status 2.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-llama-2-7b}
OUT=${OUT:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

why=$("$PYTHON" - <<'EOF' 2>&1 || true
try:
    import torch
except ImportError:
    print("no PyTorch here (pip install 'flexpipe[calibrate]')")
    raise SystemExit(0)
if not torch.cuda.is_available():
    print(f"no CUDA GPU visible to PyTorch {torch.__version__}")
EOF
)
if [ -n "$why" ]; then
    echo "gpu_check: no GPU to check: $(echo "$why" | tail -n 1)" >&2
    exit 2
fi

mkdir -p "$OUT"
STORE="sqlite:///$(cd "$OUT" && pwd)/store.db"
quick=--quick
[ "${FULL:-0}" = 1 ] && quick=
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    if ! timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
        echo "gpu_check: $name failed (log: $OUT/$name.log): $(tail -n 1 "$OUT/$name.log")" >&2
        exit 1
    fi
    tail -n 20 "$OUT/$name.log"
}

started=$(date +%s)
"$PYTHON" -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda,
    "|", ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))' \
    | tee "$OUT/devices.txt"
step discover 120 "$PYTHON" -m flexpipe discover --probe -o "$OUT/cluster.yaml"
step calibrate 330 "$PYTHON" -m flexpipe calibrate --model "$MODEL" $quick \
    --out "$OUT/calibrate.csv" --store "$STORE"
step compare 60 "$PYTHON" -m bench._gpu_check_compare "$OUT/calibrate.csv"
cp "$OUT/compare.log" "$OUT/error-table.md"
echo "gpu_check: done in $(( $(date +%s) - started )) s; results in $OUT/"
