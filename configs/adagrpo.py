"""AdaGRPO (docs/math.md §3 `adaptive`, §5): `python -m flowrl_jax.main --config configs/adagrpo.py --workdir workdirs/adagrpo`.

The online prompt curriculum (per-prompt proficiency EMA in the checkpointed train state, band-filtered
sampling with exploration) and cross-level advantage fusion `alpha A_group + (1 - alpha) A_global`
with an EMA global baseline. Budget and sampler: `common.embedded_train_config()`.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.credit.names = ("uniform", "adaptive")  # options: config.credit.adaptive (credit/adaptive.py)
    config.curriculum.enabled = True
    config.lock()
    return config
