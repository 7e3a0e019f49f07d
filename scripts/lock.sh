#!/usr/bin/env bash
# Regenerate requirements.lock: every dependency of the test extra (which brings bench, pool,
# triton and lora-demo) pinned with its hashes, torch excepted (its CPU and CUDA wheels differ;
# scripts/setup.sh installs the build that fits the machine first). Existing pins are kept
# unless --upgrade is given (passed on to pip-compile, as is --upgrade-package NAME).
# Usage: bash scripts/lock.sh [pip-compile options]
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=${LOCKGATE_LOCK_VENV:-/tmp/lockgate-lock-venv}
if [ ! -x "$TOOLS/bin/pip-compile" ]; then
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip -q install "pip-tools>=7.4,<8"
fi
# the existing pins seed the run (pip-compile keeps what the output file already holds)
if [ -f requirements.lock ]; then cp requirements.lock requirements.lock.tmp; fi
# torch's own dependencies as the CPU build has them (the CUDA build's nvidia-* stay out)
echo "torch==${LOCKGATE_TORCH_VERSION:-2.13.0}+cpu" > torch-constraint.tmp.txt
"$TOOLS/bin/pip-compile" -q -c torch-constraint.tmp.txt --generate-hashes --allow-unsafe --unsafe-package torch --extra test \
  --strip-extras --no-emit-index-url --no-emit-find-links --no-header -o requirements.lock.tmp \
  "$@" pyproject.toml
# drop the project itself (its extras name it) and torch, which --allow-unsafe lists anyway
python3 - <<'PY'
import re
from pathlib import Path
text = Path("requirements.lock.tmp").read_text()
blocks = re.split(r"\n(?=\S)", text)
keep = [b for b in blocks if not re.match(r"(lockgate @ |torch==|# WARNING|# Consider|# The following packages)", b)]
head = ("# Pinned with hashes by scripts/lock.sh; scripts/setup.sh installs it with --require-hashes,\n"
        "# then the project with --no-deps. torch is not here: setup.sh installs the CPU or CUDA build.\n")
Path("requirements.lock").write_text(head + "\n".join(keep).rstrip("\n") + "\n")
PY
rm -f requirements.lock.tmp torch-constraint.tmp.txt
echo "lock: $(grep -c '^[a-zA-Z]' requirements.lock) packages in requirements.lock"
