#!/usr/bin/env bash
# Issue 32 item 5, on one GPU (`pip install -r requirements.txt 'jax[cuda12]>=0.8,<0.13' -e .` and a CUDA torch for the
# comparison): the train job at SD3.5-M's real shapes with XLA's attention and with cuDNN flash attention (images/s,
# pairs/s, peak memory against the plan, the update's MFU: benchmarks/gpu_real_size.py), then ours in bf16 against
# PyTorch/diffusers with bf16 autocast, eager and torch.compile'd (benchmarks/compare_torch.py). JSON under $OUT.
#   bash benchmarks/gpu_performance.sh                 # ~15 min on an H100/H200
#   TINY=1 bash benchmarks/gpu_performance.sh          # the script tried on any machine at toy shapes (~3 min on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if [[ -n "${TINY:-}" ]]; then
  python benchmarks/gpu_real_size.py --tiny --quickstart_iterations 0 --out "$OUT/gpu_real_size_xla.json"
  python benchmarks/compare_torch.py --bf16 --setups quickstart --repeats 1 --no-compile --out "$OUT/compare_torch_bf16.json"
  exit 0
fi
python benchmarks/gpu_real_size.py --out "$OUT/gpu_real_size_xla.json"
python benchmarks/gpu_real_size.py --attention cudnn --quickstart_iterations 0 --out "$OUT/gpu_real_size_cudnn.json"
python benchmarks/compare_torch.py --device cuda --bf16 --repeats 3 --out "$OUT/compare_torch_bf16.json"
