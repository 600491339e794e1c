"""LeapAlign (docs/math.md §6): `python -m flowrl_jax.main --config configs/leapalign.py --workdir workdirs/leapalign`.

Direct gradients of the shipped learned reward (`shapes32_reward`) through two leaps of the policy's
ODE trajectory (`gamma` scales the nested gradient, `tau` the leap weights); memory flat in the
number of sampler steps (`benchmarks/memory.py`). The exact evaluator's score is still what the run
logs and evaluates. Budget: `common.embedded_train_config()`, with an ODE sampler.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config(ode_rollouts=True)
    config.objective.name = "leapalign"  # options: config.objective.leapalign (objectives/leap.py)
    config.lock()
    return config
