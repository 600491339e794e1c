"""Flow-GRPO on SD3.5-Medium with the LAION aesthetic score: the port-validation run flow_grpo's maintainers advise
(the reward should rise within ~15 iterations, or something is wrong).

    python -m flowrl_jax.rewards.device convert-pth sac+logos+ava1-l14-linearMSE.pth aesthetic_mlp.safetensors   # once, torch
    python -m flowrl_jax.main --config configs/sd35m_aesthetic.py:v5p-8 --workdir gs://bucket/runs/aesthetic \\
        --config.world.pipeline=/path/to/stable-diffusion-3.5-medium \\
        --config.world.reward_models.aesthetic_clip=/path/to/clip-vit-large-patch14 \\
        --config.world.reward_models.aesthetic_mlp=aesthetic_mlp.safetensors \\
        --config.world.train_prompts=data/pickscore --config.world.test_prompts=data/pickscore

The recipe is flow_grpo's PickScore one on SD3.5-M (10 steps, groups of 24, 48 prompts, beta 0.01, its prompts) with the
reward swapped for `aesthetic` (`rewards/device.py`: the MLP on the normalised CLIP-L/14 image embedding): the snapshot of
flow_grpo read for this port has no SD3 aesthetic config of its own. Without the weights the run trains on the JPEG
compressibility and says so (`train.rewards_without_models`). The argument picks the memory plan (README "Memory plan").
"""
from configs import common


def get_config(arg: str = ""):
    config = common.sd35m_train_config(rewards=(("aesthetic", 1.0),), beta=0.01, plan=arg or "v5p-8",
                                           rewards_without_models=(("jpeg_compressibility", 1.0),))
    config.lock()
    return config
