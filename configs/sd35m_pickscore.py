"""Flow-GRPO on SD3.5-Medium, PickScore prompts (flow_grpo `config/grpo.py`'s PickScore setting): beta 0.01.

    python -m flowrl_jax.data.datasets flow_grpo/dataset/pickscore/train.txt data/pickscore --split train
    python -m flowrl_jax.data.datasets flow_grpo/dataset/pickscore/test.txt data/pickscore --split test
    python -m flowrl_jax.main --config configs/sd35m_pickscore.py:v5p-8 --workdir gs://bucket/runs/pickscore \\
        --config.world.pipeline=/path/to/stable-diffusion-3.5-medium \\
        --config.world.train_prompts=data/pickscore --config.world.test_prompts=data/pickscore

PickScore (a CLIP-H preference model) is not in this library yet; the default reward is the model-free
JPEG compressibility (`--config.train.rewards` to change it).
The argument picks the memory plan of the hardware (`config_lib.MEMORY_PLANS`: v5p-8 (default), v6e-8, gpu, v5p-64, v6e-64;
README "Memory plan").
"""
from flowrl_jax import config_lib


def get_config(arg: str = ""):
    config = config_lib.sd35m_train_config(beta=0.01, plan=arg or "v5p-8")
    config.lock()
    return config
