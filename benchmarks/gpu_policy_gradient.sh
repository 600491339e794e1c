#!/usr/bin/env bash
# Issue 33 item 8, on one GPU (`pip install -r requirements.txt 'jax[cuda12]>=0.8,<0.13' -e .` first): does the policy
# gradient learn at upstream's batch? Flow-GRPO as upstream runs it (configs/flow_grpo.py at 48 prompts x 24, steps 0-8
# trained) against its null control, and Flow-GRPO-Fast (the best SNR per second of benchmarks/snr_judge.sh) at 48
# prompts with its null control, 3 seeds each, the same training wall-clock, the same eval prompts and noise
# (benchmarks/compare_methods.py; results under benchmarks/results/gpu_compare, merged across sessions).
#   bash benchmarks/gpu_policy_gradient.sh                       # BUDGET_S=900 s of training per run: ~12 x 17 min
#   BUDGET_S=3 SEEDS=0 bash benchmarks/gpu_policy_gradient.sh --per_category 1 --samples_per_prompt 1 \
#       --set train.prompts_per_iteration=2 --set train.group_size=4 --out /tmp/gpu_try   # the script tried at toy shapes
# The budget: Flow-GRPO at steps 0-8 needs ~1,300 groups for SNR 1 at the point estimate (>= 316, 96 groups on CPU;
# README "Which design brings the policy gradient within reach"), 48 groups per iteration, so ~28 iterations per unit
# of cumulative SNR; 900 s holds a few hundred iterations where an iteration takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
python benchmarks/compare_methods.py \
  --methods flow_grpo_upstream48,flow_grpo_upstream48_null,flow_grpo_fast48,flow_grpo_fast48_null \
  --seeds "${SEEDS:-0,1,2}" --budget_s "${BUDGET_S:-900}" --out benchmarks/results/gpu_compare "$@"
