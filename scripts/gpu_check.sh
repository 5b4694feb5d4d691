#!/usr/bin/env bash
# The GPU check (issue 35): one call on a machine with an NVIDIA GPU and no network, under 8 minutes.
#   (a) the wheels carried in .whl/ (what the machine's python lacks) into $SITE, pagedserve linked there
#   (b) the Triton and verification attention kernels against the torch reference, compiled for CUDA
#   (c) greedy parity with transformers on CUDA: tiny random checkpoints of every family, float32
#   (d) `pagedserve bench throughput` on random-64 on the GPU, bf16: a random-weight model of
#       SmolLM2-135M's shape, then the one-layer tiny model (both built there from their configs)
# Each part runs under its own time limit; a failed or timed-out part is reported and the next runs.
# Writes $OUT/gpu_check.md (results), $OUT/gpu_check.log (all output) and the parts' JSON.
#   OUT=/some/dir bash scripts/gpu_check.sh      (OUT unset: /tmp/gpu_check_out)
# Without a GPU it runs as its own CPU fallback (device cpu, the tiny model only), to test the script.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/gpu_check_out}
SITE=${GPU_CHECK_SITE:-/tmp/site}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
MD=$OUT/gpu_check.md
: > "$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# no CPU kernels: the torch backend (Gemma's windows) would compile them on a CUDA machine (minutes)
export PAGEDSERVE_CPU_KERNELS=0 PAGEDSERVE_WEIGHT_CACHE=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  DEVICE=cuda SCALE=1
else
  DEVICE=cpu SCALE=${GPU_CHECK_CPU_SCALE:-4}  # the CPU fallback's limits, on a shared 2-core machine
fi
export GPU_CHECK_DEVICE=$DEVICE
STARTED=$SECONDS

# part NAME LIMIT_S COMMAND...: runs the command under its limit, its output into the log and
# $OUT/part.txt; one row of the results table
part() {
  local name=$1 limit=$(($2 * SCALE)) began=$SECONDS rc status
  shift 2
  printf '\n==> [%s] %s (limit %ss): %s\n' "$(date -u +%T)" "$name" "$limit" "$*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/part.txt" >> "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=passed ;;
    124|137) status="TIMED OUT" ;;
    *) status="FAILED (rc $rc)" ;;
  esac
  local summary
  summary=$(grep -E '(passed|failed|error|skipped).* in [0-9.]+s' "$OUT/part.txt" | tail -1 | tr -d '=|')
  echo "| $name | $status | $((SECONDS - began)) s | ${summary:-} |" >> "$MD"
  echo "    $name: $status in $((SECONDS - began)) s ${summary:-}"
  return 0
}

gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
versions=$($PY -c 'import sys, torch, triton, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")' 2>&1 | tail -1)
{
  echo "# GPU check ($(date -u +'%Y-%m-%d %H:%M') UTC)"
  echo
  echo "- device: $DEVICE${gpu:+ ($gpu)}; CPU cores: $(nproc)"
  echo "- $versions"
  echo "- checkout: ${GPU_CHECK_REV:-git HEAD there $(git rev-parse --short HEAD 2>/dev/null) (the working tree may differ)}"
  echo
  echo "| part | result | time | summary |"
  echo "|---|---|---|---|"
} > "$MD"

# (a) only what is missing: a machine that imports them already (a dev box) keeps its own
if $PY -c 'import msgspec, redis, gguf' >/dev/null 2>&1; then
  echo "| (a) wheels | skipped: msgspec, redis, gguf import already | 0 s | |" >> "$MD"
else
  part "(a) wheels" 30 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
fi
mkdir -p "$SITE"
$PY scripts/gpu_check.py site "$SITE" >> "$LOG" 2>&1 || echo "| site | FAILED: see the log | | |" >> "$MD"
export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}

PYTEST=($PY -m pytest -q -p no:cacheprovider -o addopts="" -rfE)
part "(b) Triton + verification kernels on $DEVICE" 100 "${PYTEST[@]}" \
  tests/gpu_worker/test_attention_triton.py tests/gpu_worker/test_spec_attention.py \
  -k "test_on_gpu or on_cuda or refused"
part "(c) greedy parity with transformers on $DEVICE" 140 $PY scripts/gpu_check.py parity "$OUT/parity.json"

SHAPES="smollm2 tiny"
WORKLOAD=${GPU_CHECK_WORKLOAD:-random-64}
[ "$DEVICE" = cpu ] && [ -z "${GPU_CHECK_FULL:-}" ] && SHAPES=tiny  # SmolLM2's shape on 2 CPU cores: minutes
# pools of ~10^5 blocks (1.4 GB of an H200 for the tiny model): random-64 holds at most 3,072 at once,
# and the kvstore's set-up and walks grow with the count
for shape in $SHAPES; do
  model=/tmp/gpu-check-$shape
  rm -rf "$model"
  part "(d) build random-weight $shape" $([ $shape = tiny ] && echo 20 || echo 30) $PY scripts/gpu_check.py random-model "$shape" "$model"
  part "(d) bench throughput $WORKLOAD, $shape" $([ $shape = tiny ] && echo 60 || echo 90) $PY -m pagedserve.services.cli bench throughput \
    --model "$model" --device "$DEVICE" --dtype "$([ "$DEVICE" = cuda ] && echo bfloat16 || echo float32)" \
    --workload "$WORKLOAD" --gpu-memory-utilization "$([ $shape = tiny ] && echo 0.01 || echo 0.05)" \
    --output "$OUT/bench-$shape.json"
done

echo "| total | | $((SECONDS - STARTED)) s | |" >> "$MD"
$PY scripts/gpu_check.py report "$OUT" >> "$MD" 2>> "$LOG"
rm -f "$OUT/part.txt"
echo
cat "$MD"
