"""DiffusionNFT (SPEC.md §6): `python -m flowrl_jax.main --config configs/nft.py --workdir workdirs/nft`.

Forward-process training with implicit positive/negative policies `v+- ` around the old policy,
`r = clip((A / 5) / 2 + 0.5, 0, 1)`, adaptive weights; rollouts by the old policy's ODE sampler,
which follows the policy by the EMA `d = min(0.001 step, 0.5)`. Budget:
`config_lib.embedded_train_config()`, with an ODE sampler (independent initial noise per image).
"""
from flowrl_jax import config_lib


def get_config(arg: str = ""):
    config = config_lib.embedded_train_config(ode_rollouts=True)
    config.objective.name = "nft"  # options: config.objective.nft (objectives/nft.py)
    config.lock()
    return config
