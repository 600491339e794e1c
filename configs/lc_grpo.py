"""LC-GRPO (docs/math.md §1 `lc`): `python -m flowrl_jax.main --config configs/lc_grpo.py --workdir workdirs/lc_grpo`.

Flow-GRPO with Langevin-corrected transitions on the SDE window (Euler, then one Langevin step
toward the marginal at the next sigma; two velocity calls per step). Any reverse-process config takes
`--config.sampler.kind=lc` (or `cps`); `benchmarks/sampler_gap.py` measures each kernel's training
rollouts against the ODE sampler. Budget: `common.embedded_train_config()`.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.sampler.kind = "lc"
    config.lock()
    return config
