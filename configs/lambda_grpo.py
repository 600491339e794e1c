"""lambda-controlled GRPO (docs/math.md §4): `python -m flowrl_jax.main --config configs/lambda_grpo.py --workdir workdirs/lambda_grpo`.

The clipped objective with the calibrated ratio `rho exp(sg(V_t) / 2)`, per-step effort weights
`1 / kappa_t` and the path-variance budget `lambda = eps^2` (steps over `lambda D` get no gradient
that round). `V_t` (measured and predicted) and the budget are logged per step for every objective,
so a Flow-GRPO run's metrics.jsonl can be set beside this one's. Budget and sampler:
`common.embedded_train_config()`.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.objective.grpo.lambda_control = True
    config.lock()
    return config
