"""Flow-GRPO on SD3.5-Medium, OCR prompts (flow_grpo `config/grpo.py`'s OCR setting): beta 0.04.

    python -m flowrl_jax.data.datasets flow_grpo/dataset/ocr/train.txt data/ocr --split train
    python -m flowrl_jax.data.datasets flow_grpo/dataset/ocr/test.txt data/ocr --split test
    python -m flowrl_jax.main --config configs/sd35m_ocr.py:v5p-8 --workdir gs://bucket/runs/ocr \\
        --config.world.pipeline=/path/to/stable-diffusion-3.5-medium \\
        --config.world.train_prompts=data/ocr --config.world.test_prompts=data/ocr

The OCR reward (an OCR model's edit distance to the quoted text) is not in this library yet; the default
reward is the model-free JPEG compressibility (`--config.train.rewards` to change it).
The argument picks the memory plan of the hardware (`config_lib.MEMORY_PLANS`: v5p-8 (default), v6e-8, gpu, v5p-64, v6e-64;
README "Memory plan").
"""
from flowrl_jax import config_lib


def get_config(arg: str = ""):
    config = config_lib.sd35m_train_config(beta=0.04, plan=arg or "v5p-8")
    config.lock()
    return config
