#!/usr/bin/env bash
# Set up Lockgate in ./.venv: the right torch build for this machine, then every other
# dependency of the test extra (the benchmarks' and the tests' dependencies, ruff, mypy) at the
# versions and hashes of requirements.lock, then the project itself, editable, with no deps.
#   no NVIDIA GPU -> the CPU wheel (torch==2.13.0; these machines keep it on disk)
#   NVIDIA GPU    -> the default (CUDA) wheel of the same release, plus triton
# Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${LOCKGATE_TORCH_VERSION:-2.13.0}
VENV=${LOCKGATE_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
  : # torch already there
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found, installing the CUDA build of torch $TORCH_VERSION"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
else
  echo "setup: no GPU, installing the CPU build of torch $TORCH_VERSION"
  # On these machines the CPU wheel of this release lies on disk and plain pip takes it
  # (a torch range left to the resolver would pull a multi-GB CUDA build instead).
  # Elsewhere set PIP_INDEX_URL / PIP_EXTRA_INDEX_URL to PyTorch's CPU index first.
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi

# --require-hashes: a gateway holds keys and sees every prompt, and a poisoned release of a
# dependency would too; the lock (scripts/lock.sh) names each file by its hash. --no-deps:
# the lock is complete but for torch, installed above.
"${PIP[@]}" install --require-hashes --no-deps -r requirements.lock
"${PIP[@]}" install --no-deps -e .

# the console's browser tests (tests/e2e/test_console_browser.py) drive Debian's chromium through
# Playwright (in the lock): installed here when missing, as root or by sudo without a prompt;
# Playwright's own browser download is never used
if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
  as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
    echo "setup: installing chromium from Debian's packages (the console's browser tests)"
    as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "setup: chromium is missing and cannot be installed here (no root, no apt-get):" \
         "the console's browser tests will be skipped (in CI, CI=true, they fail instead)"
  fi
fi
echo "setup: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")'))"
