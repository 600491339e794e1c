"""TurningPoint-GRPO (docs/math.md §3 `turning_point`):
`python -m flowrl_jax.main --config configs/tp_grpo.py --workdir workdirs/tp_grpo`.

Incremental step rewards from ODE completions of every SDE-window state (one batched scan per
iteration), turning points by sign changes, the balanced bonus, per-step group normalization.
Composes with spatial credit (none of the papers offers this):
`--config.credit.names='("turning_point", "spatial")' --config.objective.grpo.ratio=token` (spatial's
options: `config.credit.spatial`). Budget and sampler: `common.embedded_train_config()`.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.credit.names = ("turning_point",)
    config.lock()
    return config
