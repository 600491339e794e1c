"""Flow-GRPO on SD3.5-Medium with PickScore (flow_grpo `config/grpo.py:pickscore_sd3`): beta 0.01.

    python -m flowrl_jax.data.datasets flow_grpo/dataset/pickscore/train.txt data/pickscore --split train
    python -m flowrl_jax.data.datasets flow_grpo/dataset/pickscore/test.txt data/pickscore --split test
    python -m flowrl_jax.main --config configs/sd35m_pickscore.py:v5p-8 --workdir gs://bucket/runs/pickscore \\
        --config.world.pipeline=/path/to/stable-diffusion-3.5-medium \\
        --config.world.reward_models.pickscore=/path/to/PickScore_v1 \\
        --config.world.reward_models.pickscore_processor=/path/to/CLIP-ViT-H-14-laion2B-s32B-b79K \\
        --config.world.train_prompts=data/pickscore --config.world.test_prompts=data/pickscore

The reward is PickScore on the device (`rewards/device.py`, flow_grpo's `exp(logit_scale) cos / 26`). Without
`world.reward_models.pickscore` the run trains on the model-free JPEG compressibility instead and says so in a
warning (`train.rewards_without_models`), so the preset runs anywhere.
The argument picks the memory plan of the hardware (`common.MEMORY_PLANS`: v5p-8 (default), v6e-8, gpu, v5p-64, v6e-64;
README "Memory plan").
"""
from configs import common


def get_config(arg: str = ""):
    config = common.sd35m_train_config(rewards=(("pickscore", 1.0),), beta=0.01, plan=arg or "v5p-8",
                                           rewards_without_models=(("jpeg_compressibility", 1.0),))
    config.lock()
    return config
