#!/usr/bin/env bash
# Installs pagedserve (not the test extras), builds the CPU kernels, then starts the whole
# stack serving the default model (SmolLM2-135M-Instruct) on http://127.0.0.1:8000. Uses
# REDIS_URL if set, else an embedded Redis. Extra arguments go to `pagedserve up`
# (e.g. --dtype float32 --port 9000). `pagedserve up` prints the URL it serves once /ready answers 200.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
printf '\n==> [%s] starting the stack: pagedserve up %s (it prints the URL once ready)\n' "$(date +%T)" "$*"
exec python3 -m pagedserve.services.cli up "$@"
