"""Build, shard and run the MMDiT once: `python -m flowrl_jax.main --config configs/inspect_mmdit.py:small`.

Variants are the model presets (tiny, small, medium, sd3_medium, sd35_medium, sd35_large). On a pod:
  --config configs/inspect_mmdit.py:sd35_medium --config.mesh="(('data',-1),('fsdp',8))"
With real weights: --config.model.weights=/path/to/stable-diffusion-3.5-medium
"""
from configs import common


def get_config(arg: str = "small"):
    config = common.base_config("inspect")
    config.model = common.model_config(arg or "small")
    config.inspect = dict(batch_size=2, text_len=8)
    config.lock()
    return config
