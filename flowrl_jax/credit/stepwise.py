"""Stepwise credit from Tweedie gains (docs/math.md §3 `stepwise`).

    r_t[b] = R(x0_hat_t[b])  (t < T),   r_T[b] = R(final sample)       # prepare: [B, T + 1]
    d_t    = r_{t+1} - r_t                                             # what step t added
    A[b, t] = group-normalized d_t, per step                           # apply: [B, T, 1]

`x0_hat_t = x_t - sigma_t v` is the rollout's Tweedie estimate at the state before step t, so `d_t`
credits each step with the reward its move added to the predicted image. The incoming advantage is
replaced (put `stepwise` first in a chain); the normalization is the run's (docs/math.md §2, its std and clip).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def prepare(ctx, options) -> dict:
    """Rewards of every step's Tweedie estimate and of the final sample -> {"step_rewards": [B, T + 1]}."""
    ro = ctx.rollout
    return {"step_rewards": ctx.rewards_of(jnp.concatenate([ro.x0_hat, ro.final[:, None]], axis=1))}


def gains(step_rewards):
    """[B, T + 1] rewards before each step (and of the final sample) -> [B, T] gains `d_t`."""
    return step_rewards[:, 1:] - step_rewards[:, :-1]


def apply(inputs: dict, adv, state, options):
    d = gains(inputs["stepwise"]["step_rewards"])
    a = jax.vmap(inputs["normalize"], in_axes=1, out_axes=1)(d)  # [B, T], normalized per step
    return a[:, :, None].astype(jnp.float32), state
