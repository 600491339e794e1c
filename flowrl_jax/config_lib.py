"""Config infrastructure: the error a config mistake raises, the fields every job has, loading and checking.

Configs are `ml_collections.ConfigDict`s returned by `get_config(arg)` and locked, so an override
of a key that does not exist fails at parse time; `main.py` turns that into a one-line error. The train
job's fields live with it (`rl/schema.py`); the presets the config files share in `configs/common.py`.
"""
from __future__ import annotations

import ast
import os
import runpy
import shlex
import sys

from ml_collections import ConfigDict

from flowrl_jax.parallel import DEFAULT_RULES


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


def base_config(job: str) -> ConfigDict:
    """Fields every job has: job, seed, mesh, sharding rules."""
    cfg = ConfigDict()
    cfg.job = job
    cfg.seed = 0
    cfg.mesh = (("data", -1), ("fsdp", 1))  # -1 fills the remaining devices
    cfg.partition_rules = DEFAULT_RULES
    cfg.min_fsdp_size = 2**14  # arrays smaller than this stay replicated
    cfg.distributed = "auto"  # jax.distributed.initialize() on a multi-host TPU slice or cluster (parallel.distributed_plan); True / False
    cfg.compilation_cache = "auto"  # JAX's persistent cache: <workdir>/compilation_cache; a folder; "none" (compiler.cache_dir)
    cfg.distributed_timeout_s = 300  # processes that have not formed their group by then: a one-line error
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


def parse_overrides(items) -> dict:
    """`["train.lr=1e-3", "sampler.sde_window=(0, 9)"]` -> `{"train.lr": 0.001, ...}` (values as Python literals): the
    benchmarks' `--set`."""
    return {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in items)}


def load_config(path: str, variant: str = "", **fields) -> ConfigDict:
    """`get_config(variant)` of a config file with dotted `fields` overridden (`{"train.lr": 1e-3}`): what tests and
    benchmarks build a run from, as `main` does from flags."""
    config = runpy.run_path(path)["get_config"](variant)
    for key, value in fields.items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


def command_line() -> str | None:
    """This process's command as `python -m flowrl_jax.main ...` (what a run records and a model card cites), or None
    when no job was started from the command line (a test, a notebook)."""
    if sys.argv and sys.argv[0].endswith(os.path.join("flowrl_jax", "main.py")):
        return "python -m flowrl_jax.main " + shlex.join(sys.argv[1:])
    return None
