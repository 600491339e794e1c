"""The README's main job: Flow-GRPO on the embedded world in under 10 minutes on a 2-core laptop.

    python -m flowrl_jax.main --config configs/quickstart.py --workdir /tmp/q

Loads the shipped `shapes32` base model, prints its GenEval-style table on test.jsonl (ODE 20 steps,
CFG 3, one sample per prompt), runs Flow-GRPO against the exact evaluator's partial-credit score and
prints the table again beside the first. Flow-GRPO's recipe with the changes a 10-minute CPU budget
needs (each measured, WORKSPACE_NOTES.md): an SDE window on the first steps (MixGRPO/DanceGRPO: the
layout is decided at high noise, and only window steps cost an update), shared initial noise per
group, no KL term (beta = 0 saves the reference forward), a looser clip, and a learning rate for the
whole 3.4M-parameter DiT.
"""
from flowrl_jax import config_lib


def get_config(arg: str = ""):
    config = config_lib.train_config()
    config.sampler.update(sde_window=(0, 4), same_noise_per_group=True)
    config.train.update(iterations=24, prompts_per_iteration=8, group_size=12, minibatches=2, lr=2e-4)
    config.objective.update(clip_range=0.05, beta=0.0)
    config.eval.update(every=0, per_category=0, samples_per_prompt=1, batch_size=210)
    config.checkpoint.update(every=8)
    config.lock()
    return config
