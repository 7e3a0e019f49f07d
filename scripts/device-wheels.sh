#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it has torch, triton, transformers, pytest, but no
# package index), fetched here for its Python (3.12, x86-64) into .whl/, to be carried along
# and installed there before scripts/device-check.sh:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for spec in llguidance==1.9.1 pytest-asyncio==1.5.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$spec"
done
ls -la .whl
