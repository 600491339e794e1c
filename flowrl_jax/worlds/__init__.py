"""Worlds: what the RL loop needs from a setting, as one small protocol (docs/design.md "Worlds").

    world = worlds.build(config, mesh)    # config.world.name selects it; cheap: prompt sets, checks
    dit, frozen = world.load()            # the base DiT and the frozen params {"dit", "text", ...} (host)
    ids, mask = world.tokenize(prompts)   # host, numpy
    cond = world.encode(frozen, ids, mask)          # jit: the DiT's conditioning pytree, batch-leading
    null = world.null_condition(frozen, batch)      # jit: the CFG null condition (the empty prompt)
    images = world.decode(frozen, x)                # the DiT's output space -> images (identity in pixels)
    rows = world.sample_prompts(n, rng)             # [n] indices into world.train_prompts (uniform draw)
    reward_fn = world.reward_fn(weighted, remote_settings)   # rewards.Weighted: host, device and remote parts
    model = world.reward_model()                    # RewardModel: a reward differentiable in x (spatial credit, LeapAlign)
    out = world.evaluate(dit_params, frozen, step, workdir)   # Evaluation; writes its PNGs

A world receives its own settings (`config.world`, its eval's `config.eval`) and the few facts of the run it needs, by
name (`RunFacts`); it reads no other part of the config. Prompts are rows (dicts with at least "prompt"); the train set
is indexable, so a curriculum can draw indices itself (`data/curriculum.py`). Every process draws the same global batch
(the seed decides) and the loop takes this process's rows. A world may also offer `prompt_reader(prompts_per_iteration)`:
a per-process reader (`data/datasets.PromptReader`) that the loop then draws from instead of `sample_prompts`, saving
its position in the checkpoint. A new world: its package here with its `DEFAULTS`, and an entry in `WORLDS`.
"""
from __future__ import annotations

from typing import Callable

import jax

from flowrl_jax import parallel
from flowrl_jax.worlds import sd3, shapes
from flowrl_jax.worlds.protocol import Evaluation, RewardModel, RunFacts, World  # noqa: F401 (the worlds' interface)


WORLDS: dict[str, tuple[Callable[..., World], dict]] = {  # name: (class, DEFAULTS)
    "shapes": (shapes.ShapesWorld, shapes.DEFAULTS),
    "sd3": (sd3.SD3World, sd3.DEFAULTS),
    "flux": (sd3.FluxWorld, sd3.FLUX_DEFAULTS),
}


def config_fields(name: str = "shapes") -> dict:
    """`config.world`: the name and the world's fields with their defaults."""
    return {"name": name, **WORLDS[name][1]}


def check(config) -> None:
    """The world's name and its own settings, checked without reading a file or building it (ValueError naming the
    field): what `rl/plan.validate` runs."""
    name = config.world.name
    if name not in WORLDS:
        raise ValueError(f"unknown world {name!r} (config.world.name); known: {sorted(WORLDS)}")
    cls = WORLDS[name][0]
    if hasattr(cls, "check"):
        cls.check(config.world)
    if hasattr(cls, "check_run"):  # the rest of the run's settings, where the world cannot take some (FLUX: no CFG)
        cls.check_run(config)


def run_facts(config, mesh: jax.sharding.Mesh, weighted_rewards=None) -> RunFacts:
    """The facts a world of this train `config` gets; `weighted_rewards`: the rewards the run trains on (default
    `config.train.rewards`)."""
    place = lambda tree: parallel.put_global(tree, parallel.tree_shardings(tree, mesh, config.partition_rules,  # noqa: E731
                                                                            config.min_fsdp_size))
    t = config.train
    return RunFacts(config.seed, tuple(weighted_rewards or t.rewards), t.get("remote_rewards"), t.get("rollout_chunk", 0), mesh, place)


def build(config, mesh: jax.sharding.Mesh | None = None, weighted_rewards=None) -> World:
    """The world `config.world.name` of a train `config` (ValueError naming a bad field); `mesh`: the run's
    (default `parallel.make_mesh(config.mesh)`)."""
    check(config)
    facts = run_facts(config, mesh if mesh is not None else parallel.make_mesh(config.mesh), weighted_rewards)
    return WORLDS[config.world.name][0](config.world, config.eval, facts)
