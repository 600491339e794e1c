"""GenEval-style table for a checkpoint: `python -m flowrl_jax.main --config configs/eval_shapes.py [--config.eval.checkpoint=shapes32|workdir]`.

Prints per-category and overall strict accuracy and partial score on `test.jsonl` (ODE sampler),
writes eval.json and eval_grid.png to --workdir (default workdirs/eval).
"""
from configs import common


def get_config(arg: str = ""):
    config = common.base_config("eval_base")
    config.eval = dict(checkpoint="shapes32", use_ema=True, split="test", max_prompts=0, samples_per_prompt=2,
                       batch_size=96, num_steps=20, cfg=3.0, shift=1.0)
    config.lock()
    return config
