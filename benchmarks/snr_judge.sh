#!/usr/bin/env bash
# Issue 33's judge: gradient SNR per group and per second for each design of the policy-gradient family, on the same
# base, prompts (seed 0) and group size. Appends one line per design to benchmarks/results/gradient_snr.json.
#   bash benchmarks/snr_judge.sh [groups]      (320 groups: about 30 minutes on 2 cores, one design at a time)
set -euo pipefail
cd "$(dirname "$0")/.."
groups="${1:-320}"
run() { python benchmarks/gradient_snr.py --groups "$groups" "$@"; }
run --config configs/flow_grpo_fast.py
run --config configs/flow_grpo_cpu.py
run --config configs/mixgrpo.py
run --config configs/mixgrpo.py:flash
run --config configs/grpo_guard.py
run --config configs/flow_grpo_cpu.py --set 'sampler.sde_window=(0, 9)' --set sampler.same_noise_per_group=False
