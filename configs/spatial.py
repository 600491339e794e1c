"""Gradient-guided spatial credit (docs/math.md §3 `spatial`) on the embedded world:
`python -m flowrl_jax.main --config configs/spatial.py --workdir workdirs/spatial`.

Flow-GRPO's group advantage re-weighted per DiT token by the MAD-normalized gradient norm of the
shipped learned reward (`shapes32_reward`) w.r.t. the final image, with per-token ratios. The policy
is still trained on the exact evaluator's score; the learned reward only draws the credit map
(`credit_maps_<step>.png` in the workdir). Budget and sampler: `common.embedded_train_config()`.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.credit.names = ("uniform", "spatial")  # options: config.credit.spatial (credit/spatial.py)
    config.objective.grpo.ratio = "token"
    config.lock()
    return config
