"""Stepwise credit from Tweedie gains (docs/math.md §3 `stepwise`):
`python -m flowrl_jax.main --config configs/stepwise.py --workdir workdirs/stepwise`.

Each trained step's advantage is the group-normalized gain `R(x0_hat_{t+1}) - R(x0_hat_t)` of the
exact evaluator's score on the Tweedie estimates, in place of the trajectory's one advantage.
Budget and sampler: `common.embedded_train_config()`.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.credit.names = ("stepwise",)
    config.lock()
    return config
