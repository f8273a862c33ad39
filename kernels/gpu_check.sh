#!/usr/bin/env bash
# The handoff-extend kernels on one CUDA GPU, in under 10 minutes, on a machine that has only
# Python, torch and Triton (no network needed):
#   1. pdd is installed without its dependencies (editable, from this checkout);
#   2. every kernel case (GQA and MLA) against its torch reference, on the GPU;
#   3. the benchmark for both shapes, GQA 32/8 heads x 128 and MLA 16 x (512 + 64) (DeepSeek-V3
#      per rank at TP 8), each ending with its achieved bandwidth over the device's peak
#      (target >= 0.6) and writing JSON (+ a PNG where matplotlib is installed) under OUT.
# SGLang's own extend attention is timed beside pdd's only where SGLang is installed.
# Usage: bash kernels/gpu_check.sh [OUT]   (default runs/gpu_check)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_check}"
python -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
echo "== kernels against their references on $(python -c 'import torch; print(torch.cuda.get_device_name())')"
python -m pdd.kernels.check --device cuda
for shape in gqa mla; do
  echo "== benchmark, $shape"
  python -m pdd.eval.bench_extend_kernel --shape "$shape" --out "$out/$shape"
done
