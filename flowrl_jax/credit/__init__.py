"""Credit schemes: advantage transforms `(inputs, A, state) -> (A[b, t, k], state)` (SPEC.md §3).

    credit = build(("uniform",), config.credit_options)
    state = credit.init()
    A, state = credit.apply(inputs, state)       # A [B, T, K] (K = 1 or N tokens, broadcastable)

`inputs` is a dict: `rollout` (sampling.rollout.Rollout), `rewards [B]`, `group_ids [B]`,
`num_groups`, `normalize` (`(r [B], group_std) -> A [B]`, SPEC §2 with the run's clip), and what each
scheme's host-side `prepare(ctx, options)` added under its own name (the rewards of Tweedie estimates
for stepwise credit, of ODE completions for turning points, learned-reward gradients for spatial
credit; `ctx` is a `credit.context.Context` with the rollout and the tools). The chain starts from
Flow-GRPO's group-relative advantage `A[b]` as `[B, 1, 1]` and each named scheme refines the
previous one's output, so schemes compose: `("turning_point", "spatial")` re-weights turning-point
step advantages per token. A scheme is `Scheme(init, apply)`; `apply(inputs, A, state, options)` is
pure and jit-compiled inside the train step, `state` (e.g. a global reward baseline) is part of the
checkpointed TrainState. New schemes register in `SCHEMES`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax.numpy as jnp

from flowrl_jax.credit import adaptive, group, spatial, stepwise, turning_point


class Scheme(NamedTuple):
    init: Callable[[Any], Any]           # options -> state pytree ({} when stateless)
    apply: Callable[..., tuple[Any, Any]]  # (inputs, A, state, options) -> (A, state)
    prepare: Callable | None = None      # host side: (ctx, options) -> pytree of global arrays, or None


def _stateless(options):
    return {}


SCHEMES: dict[str, Scheme] = {
    "uniform": Scheme(_stateless, group.uniform),
    "stepwise": Scheme(_stateless, stepwise.apply, stepwise.prepare),
    "turning_point": Scheme(_stateless, turning_point.apply, turning_point.prepare),
    "spatial": Scheme(_stateless, spatial.apply, spatial.prepare),
    "adaptive": Scheme(adaptive.init, adaptive.apply),
}


class Credit(NamedTuple):
    names: tuple[str, ...]
    init: Callable[[], dict]
    apply: Callable[[dict, dict], tuple[Any, dict]]
    prepare: Callable[[Any], dict]  # host side, before `apply`: ctx -> {name: extras} (global arrays)


def build(names, options, global_std: bool = True, clip: float = 5.0) -> Credit:
    """The composed scheme `names` (applied left to right) with per-scheme `options[name]`."""
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in SCHEMES]
    if unknown or not names:
        raise ValueError(f"unknown credit scheme(s) {unknown or names}; known: {sorted(SCHEMES)}")
    opts = {n: (options.get(n, {}) if options is not None else {}) for n in names}

    def init() -> dict:
        return {n: SCHEMES[n].init(opts[n]) for n in names}

    def prepare(ctx) -> dict:
        return {n: SCHEMES[n].prepare(ctx, opts[n]) for n in names if SCHEMES[n].prepare is not None}

    def apply(inputs: dict, state: dict):
        def normalize(r, group_std: bool = not global_std):
            return group.group_advantages(r, inputs["group_ids"], inputs["num_groups"], not group_std, clip)

        inputs = {**inputs, "normalize": normalize}
        adv = normalize(inputs["rewards"])[:, None, None]
        new_state = dict(state)
        for n in names:
            adv, new_state[n] = SCHEMES[n].apply(inputs, adv, state[n], opts[n])
        return adv, new_state

    return Credit(names, init, apply, prepare)


def kept_samples(adv, trained) -> jnp.ndarray:
    """[B] bool: samples with a non-zero advantage on some trained step (SPEC §2 drops the rest)."""
    nonzero = jnp.any(adv != 0, axis=-1) & trained[None, :]
    return jnp.any(nonzero, axis=-1)
