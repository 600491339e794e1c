"""MixGRPO (Tencent-Hunyuan/MixGRPO, `--sample_strategy progressive`) on the embedded world:

    python -m flowrl_jax.main --config configs/mixgrpo.py --workdir workdirs/mixgrpo

A sliding SDE window: SDE on the window's steps, the ODE (Euler, as MixGRPO) on every other step, only the window
trained (`sampler.window.schedule="sliding"`, `sampling/windows.py`). Upstream: a window of 4 of 25 steps from step 0, moved by 1 step every 25 iterations, back to 0
past the end (`--roll_back`), 300 iterations (so it covers steps 0-14, the first half). Scaled to the embedded budget's
10 steps and 36 iterations: a window of 2 steps from 0, moved by 1 every 8 iterations (steps 0-5 over the run).
Upstream's other settings kept: noise level 0.7, the group's images share their initial noise, clip 1e-4, no KL (beta 0),
advantages normalised by each group's unbiased std + 1e-8 (`train_grpo_flux.py`: torch's `std()`; `advantage.std_ddof=1`,
`std_eps=1e-8`), 4 optimizer steps per iteration (12 samples per rank, gradient accumulation 3). A window truncated at the
schedule's end and rolled back only past it (`sampler.window.end="truncate"`, `grpo_states.py`; not reached in 36
iterations here, nor in upstream's 300). Upstream's lr is 1e-5 on the whole FLUX model; here LoRA rank 32 at 3e-4 like
every embedded config.

`--config configs/mixgrpo.py:flash` is MixGRPO-Flash (`MixGRPO_Flash.sh`): after the window, DPM-Solver++(2M) on a coarser
grid (upstream's `int((T - last SDE step) * 0.4)` points spaced evenly in unshifted time from the window's end to 0,
`rollout.tail_schedule`; the history's x0 feeding the solver), so fewer velocity calls per rollout, and the window moved
every 20 iterations upstream instead of 25 (here every 6 instead of 8).
"""
from configs import common


def get_config(arg: str = ""):
    config = common.embedded_train_config()
    config.sampler.update(sde_window=(0, 2), same_noise_per_group=True, noise_level=0.7)
    config.sampler.window.update(schedule="sliding", shift_every=8, stride=1, wrap=True)
    config.train.minibatches = 4
    config.advantage.update(global_std=False, std_eps=1e-8, std_ddof=1)
    if arg == "flash":
        config.sampler.window.update(tail_solver="dpm2m", tail_ratio=0.4, shift_every=6)
    elif arg:
        raise ValueError(f"configs/mixgrpo.py:{arg}: the one variant is 'flash' (MixGRPO-Flash)")
    config.objective.grpo.update(clip_range=1e-4, beta=0.0)
    config.lock()
    return config
