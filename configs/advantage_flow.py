"""AdvantageFlow (SPEC.md §6): `python -m flowrl_jax.main --config configs/advantage_flow.py --workdir workdirs/advantage_flow`.

Advantage-weighted flow matching on the policy's own ODE samples with rollout-policy regularization:
weights `max(-A) + beta0 + A_i >= beta0`, each sample noised afresh at `objective.timesteps` times per
iteration. Group advantages from the exact evaluator's score, as in Flow-GRPO. Budget:
`config_lib.embedded_train_config()`, with an ODE sampler (independent initial noise per image, so a
group's images differ).
"""
from flowrl_jax import config_lib


def get_config(arg: str = ""):
    config = config_lib.embedded_train_config()
    config.sampler.update(kind="ode", sde_window=(), same_noise_per_group=False)
    config.objective.update(name="advantage_flow", timesteps=4, beta0=1.0)
    config.lock()
    return config
