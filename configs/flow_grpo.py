"""Flow-GRPO as upstream runs it, on the embedded shapes world:
`python -m flowrl_jax.main --config configs/flow_grpo.py --workdir workdirs/flow_grpo`.

Upstream is flow_grpo's `config/grpo.py:geneval_sd3` with `scripts/train_sd3.py` (docs/math.md §1-§4). Matched here:
SDE kernel, noise level 0.7, 10 rollout steps with steps 0..8 trained (`timestep_fraction=0.99`; step 9 runs
the ODE here), groups of 24, per-sample ratio clipped at 1e-4, KL beta 0.04 in upstream's form (divided by
`std_dev_t^2`, without the `sqrt(-dt)` factor: `objective.grpo.kl_form="flow_grpo"`), the gradient through both CFG
branches (upstream's current `compute_log_prob`; its July 2025 version detached the unconditional one:
`--config.objective.grpo.detach_uncond=True`), advantages with the global std (+1e-4), one inner epoch,
two optimizer steps per iteration, each sample's trained steps in one optimizer step, LoRA rank 32 / alpha 64
on the joint-attention projections with PEFT's gaussian init, AdamW lr 3e-4, grad clip 1, EMA decay 0.9
applied every 8 optimizer steps. Forced by the world (WORKSPACE_NOTES.md lists each difference): the
shipped `shapes32` base, CFG 3 (its best eval setting; upstream 4.5), shift 1 (upstream 3), 8 prompts per
iteration (upstream 48: 192 images here against 1,152), a 3,072-element pixel latent (upstream 65,536).
"""
from configs import common


def get_config(arg: str = ""):
    config = common.train_config()
    config.sampler.update(sde_window=(0, 9), same_noise_per_group=False)
    config.train.update(prompts_per_iteration=8, group_size=24, minibatches=2, lora_rank=32, lora_init="gaussian",
                        lr=3e-4, ema_decay=0.9, ema_every=8)
    config.objective.grpo.update(kl_form="flow_grpo", detach_uncond=False, clip_range=1e-4, beta=0.04)
    config.lock()
    return config
