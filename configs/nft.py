"""DiffusionNFT (docs/math.md §6): `python -m flowrl_jax.main --config configs/nft.py --workdir workdirs/nft`.

Forward-process training with implicit positive/negative policies `v+- ` around the old policy,
`r = clip((A / 5) / 2 + 0.5, 0, 1)`, adaptive weights; rollouts by the old policy's ODE sampler,
which follows the policy by the EMA `d = min(0.001 step, 0.5)`. NVlabs' recipe (`scripts/train_nft_sd3.py`,
`config/nft.py`; `objectives/nft.py` DEFAULTS): CFG-free rollouts and training (`sampler.cfg = 1`, the point the
paper makes), 9 of the sampler's 10 timesteps per sample, the loss scaled by adv_clip_max = 5, beta_kl = 1e-4, one
optimizer step per iteration (their SD3 configs' gradient accumulation over the whole batch; the EMA's decay counts
optimizer steps, as their `global_step`).
Eval at CFG 1, as NVlabs evaluates its CFG-free models (`guidance_scale=1.0`; their eval runs 40 steps at their
10-step rollouts, the embedded world's eval 20: `--config.eval.num_steps=40` for theirs). The earlier setting is
`--config.sampler.cfg=3 --config.objective.nft.times=midpoints --config.objective.nft.timesteps=4
--config.objective.nft.beta_kl=0 --config.objective.nft.adv_clip_max=...` (that one also sets r's scale).
Budget: `common.embedded_train_config()`, with an ODE sampler (independent initial noise per image).
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config(ode_rollouts=True)
    config.objective.name = "nft"  # options: config.objective.nft (objectives/nft.py)
    config.sampler.cfg = 1.0  # CFG-free rollouts and training, as NVlabs' SD3 configs
    config.train.minibatches = 1  # one optimizer step per iteration, as NVlabs' SD3 geneval / pickscore configs
    config.eval.cfg = 1.0  # CFG-free eval, as NVlabs' train_nft_sd3.py
    config.lock()
    return config
