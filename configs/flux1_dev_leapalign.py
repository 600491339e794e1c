"""LeapAlign on FLUX.1-dev (docs/math.md §6), as its paper describes the FLUX run, with PickScore as the reward.

    python -m flowrl_jax.main --config configs/flux1_dev_leapalign.py:v5p-8 --workdir gs://bucket/runs/flux_leapalign \\
        --config.world.pipeline=/path/to/FLUX.1-dev \\
        --config.world.reward_models.pickscore=/path/to/PickScore_v1 \\
        --config.world.reward_models.pickscore_processor=/path/to/CLIP-ViT-H-14-laion2B-s32B-b79K \\
        --config.world.train_prompts=data/pickscore --config.world.test_prompts=data/pickscore

From the paper (arXiv 2604.15311) and its code's README: FLUX.1-dev at 720 px, a 25-step ODE rollout and 50 eval steps at
the distilled guidance 3.5 (no CFG), the whole transformer fine-tuned with AdamW at lr 1e-5 and weight decay 1e-4, 64
images per step, 300 steps, EMA decay 0.995, the nested-gradient discount alpha 0.3 (`gamma`).
Where we chose:
- The reward: the paper trains on HPSv2.1 by default; this project has no HPSv2 port, and the paper's Table 3 also
  trains on PickScore, which this preset uses.
- The loss: the paper's is `relu(lambda - r)` (lambda 0.55) divided by the leaps' similarity factor (tau 0.1); ours is
  `-sum w R` with softmax leap weights (`objectives/leap.py`), so `tau` keeps our default.
- 64 images as 16 prompts x 4 (the loop draws groups; LeapAlign does not use their advantages).
- The "gpu" plan trains LoRA (rank 64, flow_grpo's FLUX targets) instead: the full fine-tune's float32 weights, Adam
  moments and EMA are 190 GB, more than any one GPU holds. On the pod plans the full fine-tune does not fit either, by
  the memory plan's bf16 bound (docs/real_models.md): it needs a plan of its own (more chips on the fsdp axis, LoRA,
  or a shorter rollout), not yet made.
The argument picks the memory plan (`common.FLUX_MEMORY_PLANS`).
"""
from configs import common
from flowrl_jax.sampling import schedule


def get_config(arg: str = ""):
    plan = arg or "v5p-8"
    config = common.flux1_dev_train_config(rewards=(("pickscore", 1.0),), plan=plan,
                                           rewards_without_models=())  # the gradient needs the device reward's weights
    config.objective.name = "leapalign"
    config.objective.leapalign.update(gamma=0.3)
    shift = schedule.flux_shift(720)
    config.world.resolution = 720
    config.sampler.update(kind="ode", num_steps=25, shift=shift, sde_window=(), same_noise_per_group=False)
    config.train.update(iterations=300, prompts_per_iteration=16, group_size=4, minibatches=1, lr=1e-5, weight_decay=1e-4,
                        lora_rank=64 if plan == "gpu" else 0, ema_decay=0.995, ema_every=1)
    config.eval.update(num_steps=50, shift=shift)
    config.lock()
    return config
