#!/usr/bin/env bash
# The GPU check of the Triton kernels, in one short run on a machine with an NVIDIA GPU:
#   1. the kernel tests on CUDA tensors, compiled (no interpreter), against the references;
#   2. engine tests on CUDA: greedy output equal to HF's across families and block sizes,
#      with the Triton paths, and the CUDA-only engine code (memory accounting, offload);
#   3. `lockgate bench kernels` on the device's own measured peaks.
# It fails fast, naming what is missing (no GPU, a Python package, torch without CUDA).
# Usage: bash scripts/device-check.sh [OUTPUT_DIR]   (PYTHON=... picks the interpreter;
# default: .venv/bin/python when it sees CUDA, else python3). Each step's output goes to
# OUTPUT_DIR (default device-check-out/), and a summary line per step to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-device-check-out}
mkdir -p "$OUT_DIR"

fail() { echo "device-check: FAIL: $*" >&2; exit 1; }

command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: this check needs an NVIDIA GPU and its driver"
nvidia-smi -L || fail "nvidia-smi lists no GPU"

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0   # compiled kernels on the GPU; tests/kernels/device.py then puts their tensors there
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

"$PY" - <<'EOF' || fail "the Python environment above lacks what the check needs"
import importlib, sys
need = ["torch", "triton", "pytest", "transformers", "safetensors", "tokenizers", "typer", "jinja2"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
import torch
if not torch.cuda.is_available():
    missing.append(f"torch with CUDA (this torch {torch.__version__} sees no GPU)")
try:
    import engine  # noqa: F401  the engine's own imports
except Exception as exc:  # noqa: BLE001
    missing.append(f"the engine's imports ({type(exc).__name__}: {exc})")
if missing:
    print("device-check: missing: " + "; ".join(missing) + ". A machine without a package index takes "
          "wheels fetched elsewhere: scripts/device-wheels.sh", file=sys.stderr)
    sys.exit(1)
import triton
print(f"device-check: python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"{torch.cuda.get_device_name(0)}")
EOF

status=0
step() {   # step NAME COMMAND...: run it, its output to OUT_DIR/NAME.log, a summary line here
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$OUT_DIR/$name.log" 2>&1; then
    echo "device-check: $name: ok ($((SECONDS - t0)) s): $(tail -n 1 "$OUT_DIR/$name.log")"
  else
    echo "device-check: $name: FAILED ($((SECONDS - t0)) s); the end of $OUT_DIR/$name.log:"
    tail -n 40 "$OUT_DIR/$name.log"
    status=1
  fi
}

step kernel-tests "$PY" -m pytest -q -p no:cacheprovider -x tests/kernels
step engine-cuda env LOCKGATE_KERNELS=triton "$PY" -m pytest -q -p no:cacheprovider \
  tests/engine/test_equivalence.py tests/engine/test_memory.py tests/engine/test_model_pool.py \
  tests/engine/test_quant.py tests/engine/test_lora_engine.py
step bench-kernels "$PY" -c "from lockgate.loadtests.bench_kernels import bench_kernels; bench_kernels()"
cat "$OUT_DIR/bench-kernels.log"
exit $status
