"""Flow-GRPO on FLUX.1-dev with PickScore (flow_grpo `config/grpo.py:pickscore_flux`, `scripts/train_flux.py`): beta 0.

    python -m flowrl_jax.data.datasets flow_grpo/dataset/pickscore/train.txt data/pickscore --split train
    python -m flowrl_jax.data.datasets flow_grpo/dataset/pickscore/test.txt data/pickscore --split test
    python -m flowrl_jax.main --config configs/flux1_dev_pickscore.py:v5p-8 --workdir gs://bucket/runs/flux_pickscore \\
        --config.world.pipeline=/path/to/FLUX.1-dev \\
        --config.world.reward_models.pickscore=/path/to/PickScore_v1 \\
        --config.world.reward_models.pickscore_processor=/path/to/CLIP-ViT-H-14-laion2B-s32B-b79K \\
        --config.world.train_prompts=data/pickscore --config.world.test_prompts=data/pickscore

FLUX.1 is guidance-distilled: no CFG (`sampler.cfg = eval.cfg = 1`), the distilled guidance `world.guidance` 3.5 in
training and eval, as flow_grpo. Without `world.reward_models.pickscore` the run trains on the model-free JPEG
compressibility instead, with `train.allow_rewards_without_models=True` (`common.sd35m_train_config`'s rule).
The argument picks the memory plan (`common.FLUX_MEMORY_PLANS`: v5p-8 (default), gpu, v5p-64, v6e-64;
docs/real_models.md "FLUX.1").
"""
from configs import common


def get_config(arg: str = ""):
    config = common.flux1_dev_train_config(rewards=(("pickscore", 1.0),), beta=0.0, plan=arg or "v5p-8")
    config.lock()
    return config
