"""Objectives by name: each entry carries its loss, how it builds its training pairs, its options and checks.

    objective = OBJECTIVES[config.objective.name]
    options = resolve_options(config, patch_size)            # its sub-dict + the sampler's facts
    objective.check(options, config.sampler)                 # ValueError naming the option
    slots = objective.slots(options, levels)                 # [S] training slots per sample
    mb = objective.pairs(data, rows, slots, weight, key, options)         # batch.Minibatch
    loss, aux = objective.loss(trees, mb, fns, options)    # trees: batch.ParamTrees; fns: rl.policy.PolicyFns

`data` is the iteration on the device (`batch.IterationData`: the rollout, its schedule, the advantages `[B, T, K]`, the
conditions, and the reward model's tokens when the objective asked for them with `uses_reward_model`). A pair is
(sample `rows[m]`, slot `slots[m]`) with `weight[m]` (0 on padding); `key` is the update's own
randomness (forward-process noise, LeapAlign's steps), drawn from the seed and the update counter.
- `grpo` (docs/math.md §4): (sample, SDE step) pairs of an sde/cps/lc rollout; the clipped ratio, with lambda
  control as an option. It offers per-step ratios (and per-token ones with `ratio="token"`) to credit.
- `advantage_flow`, `nft` (docs/math.md §6): (sample, time slot) pairs of the final samples noised afresh.
- `leapalign` (docs/math.md §6): one pair per sample of an ODE rollout, through the differentiable reward.
`old_policy`: when set, the TrainState keeps `theta_old`, which draws the rollouts and follows the
policy after each iteration by `old <- d old + (1 - d) theta`, `d = old_policy(updates, options)` (optimizer steps done): DiffusionNFT's
EMA schedules, or `d = 0` for AdvantageFlow (its anchor is the rollout policy's velocity).
Objectives that offer per-step ratios drop samples with no advantage on a trained step (docs/math.md §2); the
others keep all (an advantage-free sample still carries their regularizing term).
A new objective: its module (loss, pairs, slots, DEFAULTS, check) and one entry here.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ml_collections import ConfigDict

from flowrl_jax.objectives import advantage_flow, forward, grpo, leap, nft
from flowrl_jax.options import resolve


def _any_kind(options, sampler) -> None:
    return None


class Objective(NamedTuple):
    loss: Callable                     # (trees: ParamTrees, mb: Minibatch, fns, options) -> (loss, aux)
    pairs: Callable                    # (data: IterationData, rows, slots, weight, key, options) -> Minibatch
    slots: Callable                    # (options, levels [T]) -> [S] numpy
    defaults: dict                     # the options and their defaults (config.objective.<name>)
    check: Callable = _any_kind        # (options, sampler) -> None; ValueError naming the option
    offers: Callable = forward.offers  # options -> frozenset of ratio granularities ("step", "token")
    old_policy: Callable | None = None  # (step, options) -> decay d
    uses_reward_model: bool = False    # the loss differentiates the world's reward model


OBJECTIVES = {
    "grpo": Objective(grpo.clipped_loss, grpo.pairs, grpo.slots, grpo.DEFAULTS, grpo.check, grpo.offers),
    "advantage_flow": Objective(advantage_flow.loss, forward.pairs, forward.slots, advantage_flow.DEFAULTS, advantage_flow.check,
                                old_policy=advantage_flow.rollout_policy_decay),
    "nft": Objective(nft.loss, forward.pairs, forward.slots, nft.DEFAULTS, nft.check, old_policy=nft.old_policy_decay),
    "leapalign": Objective(leap.loss, leap.pairs, leap.slots, leap.DEFAULTS, leap.check, uses_reward_model=True),
}


def config_fields() -> dict:
    """`config.objective`: the chosen name and every objective's option sub-dict with its defaults."""
    return {"name": "grpo", **{name: dict(o.defaults) for name, o in OBJECTIVES.items()}}


def get(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r} (config.objective.name); known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


def resolve_options(config, patch_size: int) -> ConfigDict:
    """The chosen objective's options (`config.objective.<name>` over its defaults) plus the sampler's
    facts its loss needs: patch_size, logprob_form, num_steps, kernel, shift."""
    name = config.objective.name
    options = resolve(get(name).defaults, config.objective.get(name), owner=f"objective.{name}")
    s = config.sampler
    options.update(patch_size=patch_size, logprob_form=s.logprob_form, num_steps=s.num_steps, kernel=s.kind, shift=s.shift, grid=s.grid)
    return options
