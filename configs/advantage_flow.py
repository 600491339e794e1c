"""AdvantageFlow (docs/math.md §6): `python -m flowrl_jax.main --config configs/advantage_flow.py --workdir workdirs/advantage_flow`.

Advantage-weighted flow matching on the policy's own ODE samples with rollout-policy regularization:
`beta ||v - v_old||^2 + A_i ||v - (eps - x0)||^2`, `beta = max(-A) + beta0`, each sample noised afresh
at `objective.timesteps` times per iteration; group advantages from the exact evaluator's score, as in
Flow-GRPO. The rollout-velocity anchor is the project's variant (WORKSPACE_NOTES.md);
`objective.advantage_flow.regularizer="samples"` is docs/math.md's literal form (`(beta + A_i) ||v - (eps - x0)||^2`),
which collapsed to blank images in all four settings tried (WORKSPACE_NOTES.md). Rollouts and the trained
velocity use the sampler's CFG, as DiffusionNFT's config. Budget: `common.embedded_train_config(ode_rollouts=True)`.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config(ode_rollouts=True)
    config.objective.name = "advantage_flow"  # options: config.objective.advantage_flow (objectives/advantage_flow.py)
    config.lock()
    return config
