#!/usr/bin/env bash
# Issue 28's figures not yet measured, for one quiet sitting (nothing else running; about 40 min):
#   cost      random-64 served throughput, offload tier on (default size) against
#             --kv-offload-memory 0, alternating on off on off on off (3 pairs);
#   eviction  6 distinct 1,500-token prefixes, 3 rounds, on a 200-block pool: tier on, tier off,
#             then vllm serve (CPU) with a pool of the same 3,200 tokens and prefix caching on.
# Usage: bash scripts/bench_kv_tier.sh [OUTDIR] [cost|eviction]  (cost: only the cost pairs, about
# 12 min; eviction: only the eviction runs;
# vLLM from the peers: bash ../shared/peers/setup.sh)
# Then: python3 scripts/bench_kv_tier_summary.py OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/bench-kv-tier}
only=${2:-all}
P=${PEERS:-$HOME/.cache/pagedserve-peers}
port=8177
mkdir -p "$out"
uptime | tee "$out/load-before.txt"

wait_ready() {  # $1: a URL that answers 200 once the server serves
    for _ in $(seq 900); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done
    echo "not ready: $1" >&2; return 1
}

stop() {  # $1: pid; SIGINT, as a terminal would send
    kill -INT "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true
}

if [ "$only" != eviction ]; then
for i in 1 2 3; do
    for tier in 2GiB 0; do
        pagedserve bench serve --workload random-64 --launch --up-arg=--kv-offload-memory=$tier \
            --output "$out/cost-$tier-$i.json"
    done
done
[ "$only" = cost ] && { uptime | tee "$out/load-after.txt"; exit 0; }
fi

for tier in 2GiB 0; do
    pagedserve up --num-blocks 200 --kv-offload-memory $tier --port $port > "$out/up-evict-$tier.log" 2>&1 &
    pid=$!
    wait_ready "http://127.0.0.1:$port/ready"
    python3 -m pagedserve.services.bench.kv_tier eviction --url "http://127.0.0.1:$port" > "$out/evict-$tier.json"
    stop $pid
done

# vLLM in the dtype the stack's `auto` picks here: bf16 where the CPU has it natively, else float32
if grep -q -w -e avx512_bf16 -e amx_bf16 /proc/cpuinfo; then vdtype=bfloat16 vdir=bf16; else vdtype=float32 vdir=fp32; fi
(
    source ../shared/peers/vllm_env.sh
    # 100 blocks of 32 (its float32 CPU attention wants multiples of 32) hold the same 3,200 tokens
    exec "$P/venv-vllm/bin/vllm" serve "$P/smollm2-hf/$vdir" --dtype $vdtype --port $port \
        --served-model-name smollm2 --block-size 32 --num-gpu-blocks-override 100 --max-model-len 3072 \
        --enable-prefix-caching > "$out/vllm-evict.log" 2>&1
) &
pid=$!
wait_ready "http://127.0.0.1:$port/health"
python3 -m pagedserve.services.bench.kv_tier eviction --url "http://127.0.0.1:$port" > "$out/evict-vllm.json"
stop $pid
grep -m1 -i "blocks" "$out/vllm-evict.log" > "$out/vllm-pool.txt" || true  # check vLLM's pool size
uptime | tee "$out/load-after.txt"
