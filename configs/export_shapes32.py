"""Ship a pretrained base model: `python -m flowrl_jax.main --config configs/export_shapes32.py`.

Measures the GenEval-style table of `export.workdir` (ODE, 20 steps, the tuned CFG) and writes
`flowrl_jax/assets/<export.name>/` with it in MANIFEST.json.
"""
from configs import common


def get_config(arg: str = ""):
    config = common.base_config("export_asset")
    config.export = dict(workdir="workdirs/pretrain_shapes32", name="shapes32", notes="",
                         eval=dict(samples_per_prompt=2, batch_size=96, num_steps=20, cfg=3.0, shift=1.0))
    config.lock()
    return config
