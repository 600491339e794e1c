"""GRPO-Guard (RatioNorm and its per-step reweighting) on Flow-GRPO, as its authors' code in flow_grpo runs it
(`scripts/train_sd3_GRPO_Guard.py`, `config/grpo_guard.py`, `config.rationorm=True`):

    python -m flowrl_jax.main --config configs/grpo_guard.py --workdir workdirs/grpo_guard

`objective.grpo.ratio_norm=True` (`objectives/grpo.py`): the per-sample log-ratio `(dl + mean_e dmu^2 / (2 std^2)) std`,
centred at 0 at every step, clipped at 2e-6 (upstream's GenEval/OCR setting), each step's term divided by `|dt|`; no KL
(beta 0). Steps 0..8 of 10 trained with independent initial noise per image (upstream's `timestep_fraction=0.99`), SDE
noise level 0.7, CFG 3 (the embedded world's; upstream 4.5), the gradient through both CFG branches, advantages
normalised by each prompt group's std (`advantage.global_std=False`: all three of upstream's `config/grpo_guard.py`
presets), 2 optimizer steps per iteration (upstream's `gradient_accumulation_steps = num_batches_per_epoch // 2`).
Budget: `common.embedded_train_config()` (8 prompts x 12, LoRA rank 32 at lr 3e-4; upstream 48 x 24 at lr 1e-4).
At the embedded world's shift 1 every step's `1 / |dt|` is the same 9.01, so the reweighting is a constant here;
`--config.sampler.shift=3` (SD3's) makes it vary from 25.1 to 3.7 over the steps (`benchmarks/lambda_budget.py`).
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.sampler.update(sde_window=(0, 9), same_noise_per_group=False)
    config.train.update(minibatches=2)
    config.advantage.global_std = False
    config.objective.grpo.update(ratio_norm=True, clip_range=2e-6, beta=0.0)
    config.lock()
    return config
