"""Worlds: what the RL loop needs from a setting, as one small protocol (DESIGN.md "Worlds").

    world = worlds.build(config)          # config.world.name selects it; cheap: prompt sets, checks
    dit, frozen = world.load()            # the base DiT and the frozen params {"dit", "text", ...} (host)
    ids, mask = world.tokenize(prompts)   # host, numpy
    cond = world.encode(frozen, ids, mask)          # jit: the DiT's conditioning pytree, batch-leading
    null = world.null_condition(frozen, batch)      # jit: the CFG null condition (the empty prompt)
    images = world.decode(frozen, x)                # the DiT's output space -> images (identity in pixels)
    rows = world.sample_prompts(n, rng)             # [n] indices into world.train_prompts (uniform draw)
    reward_fn = world.reward_fn((("name", weight), ...), remote_settings)   # host: (images, prompt rows) -> (r [B], parts)
    apply, params, tokenize = world.reward_model()  # a reward differentiable in x (spatial credit, LeapAlign)
    entry = world.evaluate(dit_params, frozen, step, workdir)   # {"table", "scalars", "text"}; writes its PNGs

Prompts are rows (dicts with at least "prompt"); the train set is indexable, so a curriculum can draw
indices itself (`data/curriculum.py`). Every process draws the same global batch (the seed decides) and
the loop takes this process's rows. The shapes world is the first instance; a latent world (SD3's text
encoders and VAE, `sd3.py`) plugs in beside it with its own `DEFAULTS` and an entry in `WORLDS`. A world may
also offer `prompt_reader(prompts_per_iteration)`: a per-process reader (`data/datasets.PromptReader`) that the
loop then draws from instead of `sample_prompts`, saving its position in the checkpoint.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from flowrl_jax.worlds import sd3, shapes


class World(Protocol):
    train_prompts: list[dict]
    test_prompts: list[dict]
    eval_name: str   # the eval table's title ("GenEval-style table")
    eval_rows: str   # what its rows are ("category")

    def load(self) -> tuple[Any, dict]: ...
    def tokenize(self, prompts: list[dict]) -> tuple[np.ndarray, np.ndarray]: ...
    def encode(self, frozen: dict, ids, mask) -> Any: ...
    def null_condition(self, frozen: dict, batch: int) -> Any: ...
    def latent_shape(self, batch: int) -> tuple[int, ...]: ...
    def decode(self, frozen: dict, x) -> Any: ...
    def sample_prompts(self, n: int, rng: np.random.Generator) -> np.ndarray: ...
    def reward_fn(self, weighted, remote_settings: Any = None) -> Callable: ...
    def reward_model(self) -> tuple[Callable, Any, Callable]: ...
    def evaluate(self, dit_params, frozen: dict, step: int, workdir: str) -> dict: ...


WORLDS: dict[str, tuple[Callable[[Any], World], dict]] = {  # name: (class, DEFAULTS)
    "shapes": (shapes.ShapesWorld, shapes.DEFAULTS),
    "sd3": (sd3.SD3World, sd3.DEFAULTS),
}


def config_fields(name: str = "shapes") -> dict:
    """`config.world`: the name and the world's fields with their defaults."""
    return {"name": name, **WORLDS[name][1]}


def build(config) -> World:
    """The world `config.world.name` for this run (ValueError naming a bad field)."""
    name = config.world.name
    if name not in WORLDS:
        raise ValueError(f"unknown world {name!r} (config.world.name); known: {sorted(WORLDS)}")
    return WORLDS[name][0](config)
