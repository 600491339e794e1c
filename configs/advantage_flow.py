"""AdvantageFlow (SPEC.md §6): `python -m flowrl_jax.main --config configs/advantage_flow.py --workdir workdirs/advantage_flow`.

Advantage-weighted flow matching on the policy's own ODE samples with rollout-policy regularization:
weights `max(-A) + beta0 + A_i >= beta0`, each sample noised afresh at `objective.timesteps` times per
iteration. Group advantages from the exact evaluator's score, as in Flow-GRPO. Rollouts and the trained
velocity are both the *conditional* one (`sampler.cfg=1`, `objective.train_cfg=1`; evals stay at CFG 3):
the flow-matching term is then fitted to the samples of the very velocity it trains. With CFG-3 rollouts
the model collapsed, whether the loss trained the CFG-3 velocity (overall strict 0.26 -> 0.00 in 24
iterations) or the conditional one (0.26 -> 0.05 in 40); WORKSPACE_NOTES.md. Budget:
`config_lib.embedded_train_config(ode_rollouts=True)` (independent initial noise per image).
"""
from flowrl_jax import config_lib


def get_config(arg: str = ""):
    config = config_lib.embedded_train_config(ode_rollouts=True)
    config.sampler.cfg = 1.0
    config.objective.update(name="advantage_flow", timesteps=4, beta0=1.0, train_cfg=1.0)
    config.lock()
    return config
