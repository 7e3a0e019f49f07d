#!/usr/bin/env bash
# The install a new user gets: a fresh venv, the CPU build of torch (as scripts/setup.sh picks
# it), then `pip install '.[test]'` with no lock or constraints, so every other dependency is the
# newest its declared range allows. Then, outside the checkout, the install's names and a chat
# through `lockgate serve` (scripts/newest_check.py), and the engine's greedy output against HF
# transformers. A failure here means an upstream release broke Lockgate: fix the code, or narrow
# the range in pyproject.toml with a comment saying why, before anything else lands.
# Usage: bash scripts/newest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${LOCKGATE_NEWEST_VENV:-$(mktemp -d /tmp/lockgate-newest-XXXX)/venv}
TORCH_VERSION=${LOCKGATE_TORCH_VERSION:-2.13.0}
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install "torch==$TORCH_VERSION"      # see scripts/setup.sh: the CPU wheel where no GPU
# torch stays the build just installed: an eager upgrade would swap it for the newest CUDA build
echo "torch==$TORCH_VERSION" > "$(dirname "$VENV")/torch-constraint.txt"
"${PIP[@]}" install --upgrade --upgrade-strategy eager -c "$(dirname "$VENV")/torch-constraint.txt" "$ROOT[test]"
"$VENV/bin/pip" list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|kernels|tokenizers|fastapi|openai)==' \
  | tr '\n' ' '; echo
(cd "$(mktemp -d)" && "$VENV/bin/python" "$ROOT/scripts/newest_check.py")
# the engine against HF on these versions (run from the checkout, whose lockgate/ is the same code)
# (each family's greedy output, and on the Triton kernels; the full equivalence suite runs pinned)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/engine/test_equivalence.py::test_greedy_matches_hf_each_family \
  tests/engine/test_equivalence.py::test_async_engine_staggered_arrivals_match_hf \
  tests/kernels/test_paged_attention_triton.py::test_engine_greedy_output_on_the_triton_kernels_matches_hf \
  tests/test_install.py
echo "newest: passed"
