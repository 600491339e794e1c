"""AdvantageFlow (SPEC.md §6): `python -m flowrl_jax.main --config configs/advantage_flow.py --workdir workdirs/advantage_flow`.

Advantage-weighted flow matching on the policy's own ODE samples (drawn at CFG 3) with rollout-policy
regularization: weights `max(-A) + beta0 + A_i >= beta0`, each sample noised afresh at
`objective.timesteps` times per iteration. The loss trains the *conditional* velocity (`train_cfg=1`):
flow matching of the CFG-3 velocity itself on its own samples collapsed the model (overall strict
0.26 -> 0.00 in 24 iterations, WORKSPACE_NOTES.md); our reading: a guided velocity is not the
marginal velocity of the samples it draws, so regressing it onto them pulls it away from the model. Group advantages from the exact evaluator's score, as in Flow-GRPO. Budget:
`config_lib.embedded_train_config()`, with an ODE sampler (independent initial noise per image, so a
group's images differ).
"""
from flowrl_jax import config_lib


def get_config(arg: str = ""):
    config = config_lib.embedded_train_config(ode_rollouts=True)
    config.objective.update(name="advantage_flow", timesteps=4, beta0=1.0, train_cfg=1.0)
    config.lock()
    return config
