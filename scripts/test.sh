#!/usr/bin/env bash
# Installs what the tests need (test extras, chromium) and runs them (the README's test
# command; .ci/run calls it). Needs Redis at 127.0.0.1:6379 or REDIS_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
python3 -m ruff check shared services tests
report="${PAGEDSERVE_TEST_REPORT:-/tmp/pagedserve-tests.xml}"  # per-test times, summed per module below
workers="${PAGEDSERVE_TEST_WORKERS:-0}"  # pytest-xdist workers (tests/conftest.py groups modules); 0: one process
status=0
python3 -m pytest -q -n "$workers" --dist loadgroup --no-loadscope-reorder --durations=15 --junitxml="$report" "$@" || status=$?
python3 scripts/test_times.py "$report" || true
exit "$status"
