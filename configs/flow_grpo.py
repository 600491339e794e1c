"""Flow-GRPO on the embedded shapes world: `python -m flowrl_jax.main --config configs/flow_grpo.py --workdir workdirs/flow_grpo`.

The paper's defaults (SPEC.md §1-§4): SDE kernel with noise level a = 0.7, 10 rollout steps and 20
ODE eval steps, group-relative advantages with the global std, per-sample ratio clipped at 1e-4,
exact-Gaussian KL with beta = 0.04, one inner epoch. Adapted to the embedded world: the shipped
`shapes32` base model, CFG 3 (its best eval setting), shift 1, the whole DiT trained (3.4M params;
`--config.train.lora_rank=32` trains Flow-GRPO's LoRA instead), groups of 12 images.
"""
from flowrl_jax import config_lib


def get_config(arg: str = ""):
    config = config_lib.train_config()
    config.lock()
    return config
