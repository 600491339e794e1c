"""Flow-GRPO on the embedded world at a 2-core laptop's budget (the quickstart's job until issue 16).

    python -m flowrl_jax.main --config configs/flow_grpo_cpu.py --workdir /tmp/flow_grpo_cpu

Loads the shipped `shapes32` base model, prints its GenEval-style table on test.jsonl (ODE 20 steps,
CFG 3, one sample per prompt), runs Flow-GRPO against the exact evaluator's partial-credit score and
prints the table again beside the first. `common.embedded_train_config()`: Flow-GRPO's recipe (clip 1e-4, beta 0.04,
LoRA rank 32 on the joint-attention projections at lr 3e-4) with the changes a 10-minute CPU budget needs:
an SDE window on the first two of the 10 steps (MixGRPO/DanceGRPO: the layout is decided at high noise,
and only window steps cost an update) and shared initial noise per group (DanceGRPO).

What it reaches is in README.md and WORKSPACE_NOTES.md: at this budget (36 iterations of 96 images)
the table does not move beyond noise. Looser settings (clip 0.05, no KL, higher lr, the whole DiT
trained) raised single_object but lowered the other categories, measured in WORKSPACE_NOTES.md.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.lock()
    return config
