#!/usr/bin/env bash
# Installs what the tests need and runs them (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check shared services tests
python3 -m pytest -q "$@"
