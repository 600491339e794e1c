"""The run's plan: every check of a train config, and the pieces it names (world, objective, credit), built once.

    checked = validate(config)     # pure: a ConfigError naming the key and the fix; reads no file, touches no device
    plan = make_plan(config)       # validate, then the mesh, the world and the checks that need them

`validate` is what `python -m flowrl_jax.main` runs on any train config before anything heavy: it neither rewrites the
config nor builds the world. `make_plan` adds what needs the devices (the batch against the mesh) or the world (the
prompt sets against the rewards), and builds each piece once: the train job, the benchmarks and the tests start here.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from ml_collections import ConfigDict

from flowrl_jax import credit as credit_lib, objectives, parallel, rewards, worlds
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.models import attention, lora, mmdit
from flowrl_jax.rewards import remote
from flowrl_jax.rl.minibatch import minibatch_pairs
from flowrl_jax.rl.state import learning_rate, make_optimizer
from flowrl_jax.sampling import windows


class Checked(NamedTuple):
    """What `validate` found: the pieces a config names, checked and resolved."""
    objective: objectives.Objective
    options: ConfigDict            # the objective's options (`objectives.resolve_options`; the DiT's patch size not yet known)
    credit: credit_lib.Credit
    rewards: tuple                 # ((name, weight), ...) the run trains on (`train_rewards`)
    warning: str | None            # why those are not `train.rewards`, or None


def train_rewards(config) -> tuple[tuple, str | None]:
    """-> (the rewards the run trains on, a warning or None): `train.rewards`, or `train.rewards_without_models` (a preset's
    model-free demo) when a device reward there has no weights given (`world.reward_models`) or `train.rewards` is empty,
    and only with `train.allow_rewards_without_models=True`: without it a ConfigError names the missing weights' flag and
    the opt-in, so no pod run trains on the demo reward by accident."""
    weighted = tuple((str(n), float(w)) for n, w in config.train.rewards)
    models, fallback = config.world.get("reward_models"), tuple(config.train.get("rewards_without_models", ()))
    missing = [(n, rewards.device.FOLDER_OF[n]) for n, _ in weighted
               if n in rewards.device.FACTORIES and not (models or {}).get(rewards.device.FOLDER_OF[n])]
    if weighted and not (missing and fallback):
        return weighted, None
    used = tuple((str(n), float(w)) for n, w in fallback)
    flags = ", ".join(f"--config.world.reward_models.{key}" for _, key in missing)
    need = (f"train.rewards {[n for n, _ in missing]} need their weights ({flags})" if weighted else
            "train.rewards is empty: this preset needs its reward named (--config.train.rewards=\"(('NAME', 1.0),)\")")
    if not used:
        raise ConfigError(f"{need}; no train.rewards_without_models to use instead")
    if not config.train.get("allow_rewards_without_models", False):
        raise ConfigError(f"{need}; or pass --config.train.allow_rewards_without_models=True to train on the model-free "
                          f"{[n for n, _ in used]} instead (a demo, not the preset's task)")
    return used, f"{need}, not given: training on {[n for n, _ in used]} instead (train.allow_rewards_without_models)"


def validate(config) -> Checked:
    """Every check of a train config that needs no device, file or model (module doc); ConfigError names the key."""
    s, t = config.sampler, config.train
    try:
        learning_rate(t)
        worlds.check(config)
        weighted, warning = train_rewards(config)  # after the world's own fields (a preset first asks for its pipeline)
        objective = objectives.get(config.objective.name)
        options = objectives.resolve_options(config, patch_size=None)
        objective.check(options, s)
        a = config.advantage
        credit = credit_lib.build(config.credit.names, config.credit, a.global_std, a.clip, a.std_eps, a.std_ddof)
        rewards.check(weighted, config.world.get("reward_models"))  # the device rewards' folders, before compiling
        remote.settings(t.get("remote_rewards"))
        windows.levels_at(s, 0, config.seed)  # the window's schedule and its options
        coarser = any(windows.tail(s)[k] != windows.DEFAULTS[k] for k in ("tail_solver", "tail_ratio"))
        if coarser and (config.objective.name == "leapalign" or "turning_point" in config.credit.names):
            raise ValueError("sampler.window.tail_solver / tail_ratio: LeapAlign and TurningPoint credit read every step's state "
                             "on the base grid (Schedule.sigmas) and its Euler completions; keep the default tail (euler, 1.0)")
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    rows = t.prompts_per_iteration * t.group_size
    if t.get("score_while_sampling") and not 0 < t.rollout_chunk < rows:
        raise ConfigError(f"train.score_while_sampling=True scores each rollout chunk while the next samples: set "
                          f"train.rollout_chunk to the rows per chunk, fewer than the {rows} of an iteration (e.g. {rows // 4})")
    if 0 < t.rollout_chunk < rows and rows % t.rollout_chunk:
        raise ConfigError(f"train.rollout_chunk={t.rollout_chunk} must divide the {rows} rows of an iteration")
    if config.world.get("scan_blocks", "auto") not in mmdit.SCAN_CHOICES:
        raise ConfigError(f"world.scan_blocks={config.world.scan_blocks!r}: choose one of {', '.join(mmdit.SCAN_CHOICES)}")
    if config.world.get("attention", "xla") not in attention.IMPLEMENTATIONS:
        raise ConfigError(f"world.attention={config.world.attention!r}: choose one of {', '.join(attention.IMPLEMENTATIONS)}")
    if t.lora_init not in lora.INITS:
        raise ConfigError(f"train.lora_init={t.lora_init!r}: choose one of {', '.join(lora.INITS)}")
    if s.kind == "ode" and s.same_noise_per_group:
        raise ConfigError("sampler.kind=ode with sampler.same_noise_per_group=True makes every image of a group the same "
                          "(no advantage to learn from): set --config.sampler.same_noise_per_group=False")
    for need in sorted(credit.needs - objective.offers(options)):
        schemes = [n for n in credit.names if need in credit_lib.SCHEMES[n].needs]
        raise ConfigError(f"credit {', '.join(schemes)} needs per-{need} ratios, which objective {config.objective.name!r} "
                          f"does not offer with its options (config.objective.{config.objective.name}); per-sample "
                          "objectives take credit ('uniform',) or ('uniform', 'adaptive')")
    return Checked(objective, options, credit, weighted, warning)


def check_mesh(config, mesh: jax.sharding.Mesh) -> None:
    """The batch's sizes against the mesh's devices and batch shards (ConfigError naming the field)."""
    t = config.train
    rows, shards = t.prompts_per_iteration * t.group_size, parallel.batch_shards(mesh)
    if rows % mesh.devices.size:
        raise ConfigError(f"train.prompts_per_iteration x train.group_size = {rows} must be divisible by the {mesh.devices.size} devices")
    if 0 < t.rollout_chunk < rows and t.rollout_chunk % shards:
        raise ConfigError(f"train.rollout_chunk={t.rollout_chunk} must divide the {rows} rows of an iteration and be a "
                          f"multiple of the {shards} batch shards of the mesh")
    if t.microbatch and t.microbatch % shards:
        raise ConfigError(f"train.microbatch={t.microbatch} must be a multiple of the {shards} batch shards of the mesh")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A train config's pieces, built once (`make_plan`)."""
    config: ConfigDict
    mesh: jax.sharding.Mesh
    world: Any                     # worlds.World
    objective: objectives.Objective
    options: ConfigDict            # the objective's options without the DiT's patch size (`loss_options` adds it)
    credit: credit_lib.Credit
    rewards: tuple                 # ((name, weight), ...) the run trains on
    optimizer: optax.GradientTransformation

    def levels_at(self, it: int) -> np.ndarray:
        """[T] the noise level per step at iteration `it` (the SDE window of `sampler.window`'s schedule)."""
        return windows.levels_at(self.config.sampler, it, self.config.seed)

    def slots_at(self, levels: np.ndarray) -> np.ndarray:
        """The objective's training slots for a rollout drawn at `levels` (the SDE window's steps, for grpo)."""
        return self.objective.slots(self.options, np.asarray(levels))

    @property
    def minibatch_size(self) -> int:
        """Pairs per optimizer step (every window of the schedule has the same size, so one compiled shape)."""
        return minibatch_pairs(self.config.train, len(self.slots_at(windows.sampler_levels(self.config.sampler))))

    @property
    def uses_reward_model(self) -> bool:
        """The objective or a credit scheme differentiates the world's reward model."""
        return self.objective.uses_reward_model or self.credit.uses_reward_model

    def loss_options(self, patch_size: int) -> ConfigDict:
        """The objective's options with the DiT's patch size, what its loss reads."""
        options = ConfigDict(self.options.to_dict())
        options.patch_size = patch_size
        return options


def make_plan(config, mesh: jax.sharding.Mesh | None = None) -> Plan:
    """`validate`, then the mesh (`config.mesh`, unless given), the world and the checks that need them (module doc)."""
    checked = validate(config)
    mesh = mesh if mesh is not None else parallel.make_mesh(config.mesh)
    check_mesh(config, mesh)
    if checked.warning:
        print(f"flowrl_jax: warning: {checked.warning}", file=sys.stderr)
    try:
        world = worlds.build(config, mesh, checked.rewards)
        for prompts in (world.train_prompts, getattr(world, "test_prompts", None) or []):  # the latent world's eval scores
            rewards.check_prompts(checked.rewards, prompts)  # test prompts with the train rewards; e.g. OCR's quoted text
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    return Plan(config, mesh, world, checked.objective, checked.options, checked.credit, checked.rewards,
                make_optimizer(config.train))
