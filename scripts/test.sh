#!/usr/bin/env bash
# Installs what the tests need (test extras, chromium) and runs them (the README's test
# command; .ci/run calls it). Needs Redis at 127.0.0.1:6379 or REDIS_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
python3 -m ruff check shared services tests
python3 -m pytest -q --durations=15 "$@"
