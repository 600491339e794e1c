"""GRPO-Guard (RatioNorm and its per-step reweighting) on Flow-GRPO, as its authors' code in flow_grpo runs it
(`scripts/train_sd3_GRPO_Guard.py`, `config/grpo_guard.py`, `config.rationorm=True`):

    python -m flowrl_jax.main --config configs/grpo_guard.py --workdir workdirs/grpo_guard

`objective.grpo.ratio_norm=True` (`objectives/grpo.py`): the per-sample log-ratio `(dl + mean_e dmu^2 / (2 std^2)) std`,
centred at 0 at every step, clipped at 2e-6 (upstream's GenEval/OCR setting), each step's term divided by `|dt|`; no KL
(beta 0). Steps 0..8 of 10 trained with independent initial noise per image (upstream's `timestep_fraction=0.99`), SDE
noise level 0.7, CFG 3 (the embedded world's; upstream 4.5). Budget: `common.embedded_train_config()` (8 prompts x 12,
LoRA rank 32 at lr 3e-4; upstream 48 x 24 at lr 1e-4), with 4 optimizer steps per iteration for the 9 trained steps.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.sampler.update(sde_window=(0, 9), same_noise_per_group=False)
    config.train.update(minibatches=4)
    config.objective.grpo.update(ratio_norm=True, clip_range=2e-6, beta=0.0)
    config.lock()
    return config
