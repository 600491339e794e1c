"""Flow-GRPO-Fast, CFG-free, as flow_grpo runs it (`scripts/train_sd3_fast.py`, `config/grpo.py:geneval_sd3_fast_nocfg`):

    python -m flowrl_jax.main --config configs/flow_grpo_fast.py --workdir workdirs/flow_grpo_fast

Each iteration draws an SDE window of 3 steps whose start is uniform in 0..2 (upstream's `sde_window_size=3`,
`sde_window_range=(0, 5)`; `sampler.window.schedule="random"`, `sampling/windows.py`); the steps before it and after it
run the ODE, and only the window's 3 steps are trained. Upstream's No-CFG path: CFG 1 in rollouts and training (one
forward per step, no unconditional branch; `sampler.cfg=1`), the CPS kernel at noise level 0.8 with its published
log-prob (`sampler.logprob_form="cps_compat"`), clip range 1e-5, no KL (beta 0), independent initial noise per image
(`same_latent=False`). Differences, forced by the embedded budget (`common.embedded_train_config()`): 8 prompts x 12
per iteration (upstream 48 x 24), and one window per iteration for the whole batch (upstream draws one per sampling batch
per GPU, so a group can mix windows). Eval at CFG 1, as upstream evaluates its No-CFG model (`eval_guidance_scale=1`);
`--config.eval.cfg=3` is the embedded world's usual eval, the one the other methods' configs keep.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.sampler.update(kind="cps", noise_level=0.8, logprob_form="cps_compat", cfg=1.0, sde_window=(0, 3),
                          same_noise_per_group=False)
    config.sampler.window.update(schedule="random", range=(0, 5))
    config.objective.grpo.update(clip_range=1e-5, beta=0.0)
    config.eval.cfg = 1.0
    config.lock()
    return config
