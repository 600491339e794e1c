"""Credit schemes: advantage transforms `(inputs, A, state) -> (A[b, t, k], state)` (docs/math.md §3).

    credit = build(config.credit.names, config.credit, global_std=True, clip=5.0)
    state = credit.init()
    extras = credit.prepare(ctx)                  # host side, once per iteration (credit.context.Context)
    A, state = credit.apply(inputs, state)        # A [B, T, K] (K = 1 or N tokens), jit-compiled

`inputs` is a dict: `rollout` (sampling.rollout.Rollout), `schedule` (its `Schedule`), `rewards [B]`, `group_ids [B]`,
`num_groups`, `normalize` (`(r [B], group_std) -> A [B]`, docs/math.md §2 with the run's clip), and what each
scheme's host-side `prepare(ctx, options)` added under its own name (the rewards of Tweedie estimates
for stepwise credit, of ODE completions for turning points, reward-model gradients for spatial
credit). The chain starts from Flow-GRPO's group-relative advantage `A[b]` as `[B, 1, 1]` and each
named scheme refines the previous one's output, so schemes compose: `("turning_point", "spatial")`
re-weights turning-point step advantages per token. `state` (e.g. a global reward baseline) is part of
the checkpointed TrainState.

A `Scheme` declares what it needs from the objective (`needs`: per-"step" or per-"token" ratios, checked
against `Objective.offers`), its options with their defaults (`config.credit.<name>`), its host-side
`prepare` and, optionally, `debug_images(ctx, extras, options) -> {stem: save_grid kwargs}`, which the
train loop writes as `<stem>_<step>.png` at the first and the last iteration. A new scheme: its module
and one entry in `SCHEMES`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import chex
import jax.numpy as jnp

from flowrl_jax.credit import adaptive, group, spatial, stepwise, turning_point
from flowrl_jax.options import resolve


def _stateless(options):
    return {}


class Scheme(NamedTuple):
    apply: Callable[..., tuple[Any, Any]]  # (inputs, A, state, options) -> (A, state)
    init: Callable[[Any], Any] = _stateless  # options -> state pytree ({} when stateless)
    prepare: Callable | None = None        # host side: (ctx, options) -> pytree of global arrays
    defaults: dict = {}                    # options and their defaults
    needs: frozenset = frozenset()         # ratio granularities the objective must offer: "step", "token"
    debug_images: Callable | None = None   # host side: (ctx, extras, options) -> {stem: metrics.save_grid kwargs}
    check: Callable | None = None          # options -> None; ValueError naming a bad option
    uses_reward_model: bool = False        # `prepare` differentiates the world's reward model (ctx.reward_gradient)


SCHEMES: dict[str, Scheme] = {
    "uniform": Scheme(group.uniform),
    "stepwise": Scheme(stepwise.apply, prepare=stepwise.prepare, needs=frozenset({"step"})),
    "turning_point": Scheme(turning_point.apply, prepare=turning_point.prepare, defaults=turning_point.DEFAULTS, needs=frozenset({"step"})),
    "spatial": Scheme(spatial.apply, prepare=spatial.prepare, defaults=spatial.DEFAULTS, needs=frozenset({"step", "token"}),
                      debug_images=spatial.debug_images, check=spatial.check, uses_reward_model=True),
    "adaptive": Scheme(adaptive.apply, init=adaptive.init, defaults=adaptive.DEFAULTS),
}


def config_fields() -> dict:
    """`config.credit`: the chain's names and every scheme's option sub-dict with its defaults."""
    return {"names": ("uniform",), **{name: dict(s.defaults) for name, s in SCHEMES.items()}}


class Credit(NamedTuple):
    names: tuple[str, ...]
    needs: frozenset
    init: Callable[[], dict]
    apply: Callable[[dict, dict], tuple[Any, dict]]
    prepare: Callable[[Any], dict]       # host side, before `apply`: ctx -> {name: extras} (global arrays)
    debug_images: Callable[[Any, dict], dict]  # host side: (ctx, extras) -> {stem: save_grid kwargs}
    uses_reward_model: bool = False      # a scheme of the chain differentiates the world's reward model


def build(names, options=None, global_std: bool = True, clip: float = 5.0, std_eps: float = 1e-4, std_ddof: int = 0) -> Credit:
    """The composed scheme `names` (applied left to right); `options[name]` overrides a scheme's defaults; the group
    normalisation's `global_std`, `clip`, `std_eps`, `std_ddof` (`group.group_advantages`, `config.advantage`)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in SCHEMES]
    if unknown or not names:
        raise ValueError(f"unknown credit scheme(s) {unknown or names}; known: {sorted(SCHEMES)}")
    opts = {n: resolve(SCHEMES[n].defaults, (options or {}).get(n), owner=f"credit.{n}") for n in names}
    for n in names:
        if SCHEMES[n].check is not None:
            SCHEMES[n].check(opts[n])

    def init() -> dict:
        return {n: SCHEMES[n].init(opts[n]) for n in names}

    def prepare(ctx) -> dict:
        return {n: SCHEMES[n].prepare(ctx, opts[n]) for n in names if SCHEMES[n].prepare is not None}

    def debug_images(ctx, extras: dict) -> dict:
        images = {}
        for n in names:
            if SCHEMES[n].debug_images is not None:
                images.update(SCHEMES[n].debug_images(ctx, extras, opts[n]))
        return images

    def apply(inputs: dict, state: dict):
        def normalize(r, group_std: bool = not global_std):
            return group.group_advantages(r, inputs["group_ids"], inputs["num_groups"], not group_std, clip, std_eps, std_ddof)

        inputs = {**inputs, "normalize": normalize}
        adv = normalize(inputs["rewards"])[:, None, None]
        new_state = dict(state)
        for n in names:
            adv, new_state[n] = SCHEMES[n].apply(inputs, adv, state[n], opts[n])
        batch, steps = inputs["rewards"].shape[0], inputs["schedule"].levels.shape[0]
        chex.assert_rank(adv, 3)
        chex.assert_axis_dimension(adv, 0, batch)
        assert adv.shape[1] in (1, steps), f"credit {names} gave A of shape {adv.shape}: its step axis must be 1 or T = {steps}"
        return adv, new_state

    needs = frozenset().union(*(SCHEMES[n].needs for n in names))
    return Credit(names, needs, init, apply, prepare, debug_images, any(SCHEMES[n].uses_reward_model for n in names))


def kept_samples(adv, trained) -> jnp.ndarray:
    """[B] bool: samples with a non-zero advantage on some trained step (docs/math.md §2 drops the rest)."""
    nonzero = jnp.any(adv != 0, axis=-1) & trained[None, :]
    return jnp.any(nonzero, axis=-1)
