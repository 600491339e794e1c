"""Config building blocks shared by `configs/*.py`, and the checks `main.py` runs on a config.

Configs are `ml_collections.ConfigDict`s returned by `get_config(arg)` and locked, so an override
of a key that does not exist fails at parse time; `main.py` turns that into a one-line error.
"""
from __future__ import annotations

from ml_collections import ConfigDict

from flowrl_jax.models.presets import PRESETS
from flowrl_jax.parallel import DEFAULT_RULES


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


def model_config(preset: str) -> ConfigDict:
    """`config.model`: an MMDiT preset's hyper-parameters plus precision, remat and weights."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = ConfigDict(dict(PRESETS[preset]))
    cfg.dtype = "float32"  # compute dtype ("bfloat16" on TPU)
    cfg.param_dtype = "float32"
    cfg.remat = False
    cfg.lora_alpha = 64.0
    cfg.timestep_scale = 1000.0
    cfg.weights = ""  # a diffusers SD3Transformer2DModel folder; "" = random init
    return cfg


def base_config(job: str) -> ConfigDict:
    """Fields every job has: job, seed, mesh, sharding rules."""
    cfg = ConfigDict()
    cfg.job = job
    cfg.seed = 0
    cfg.mesh = (("data", -1), ("fsdp", 1))  # -1 fills the remaining devices
    cfg.partition_rules = DEFAULT_RULES
    cfg.min_fsdp_size = 2**14  # arrays smaller than this stay replicated
    cfg.distributed = "auto"  # jax.distributed.initialize() when a cluster environment is detected
    return cfg


def require(config: ConfigDict, fields) -> None:
    """Raise ConfigError naming the first dotted field that is absent or empty."""
    for field in fields:
        node = config
        for part in field.split("."):
            if not isinstance(node, ConfigDict) or part not in node:
                raise ConfigError(f"config has no field {field!r}, which this job requires; add it to the config file")
            node = node[part]
        if node is None or node == "":
            raise ConfigError(f"config field {field!r} is required: set it in the config or pass --config.{field}=...")
