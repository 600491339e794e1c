"""AdvantageFlow: advantage-weighted flow matching with rollout-policy regularization (docs/math.md §6).

    loss, aux = advantage_flow.loss(trees, mb, fns, options)   # mb: forward.forward_pairs; trees: batch.ParamTrees

docs/math.md's form (`regularizer="samples"`): `L = mean_i (beta + A_i) ||v_theta(x_t^i, t_i) - u_i||^2`,
`u_i = eps_i - x0^i`, over the policy's own samples, `beta = max_i(-A_i) + beta0` (the max over the
iteration's whole batch), so every weight is at least `beta0 > 0` and the loss is a non-negative
combination of convex quadratics in `v`. The `beta` part is plain flow matching on the rollout
policy's samples; the `A` part tilts it toward the better samples: the minimizer fits
`q(x0) ~ pi_old(x0) (1 + A(x0) / beta)`.

The default (`regularizer="rollout_velocity"`, our variant, WORKSPACE_NOTES.md): the `beta` part's target
`u_i` is replaced by the rollout policy's own velocity `v_old(x_t^i, t_i)`,
`L = mean_i [beta ||v_theta - v_old||^2 + A_i ||v_theta - u_i||^2]`. When `v_old` is the exact
flow of its samples, `v_old(x_t) = E[u | x_t]` and the two losses have the same expected gradient
(so the same minimizer); the anchored one has no sampling noise in its `beta` part and does not fit the
sampler's discretization error, which made docs/math.md's form drift to blank images in every setting tried.
Per pair the Hessian in `v` is still `2 (beta + A_i) / D >= 2 beta0 / D`: convex.
`||.||^2` is the mean over elements (our reading: it keeps `beta0` free of the image size). The
velocity is the sampler's (CFG `train_cfg`, 0 = the sampler's), the policy that drew the samples. Options
(`DEFAULTS`, `config.objective.advantage_flow`): timesteps, train_cfg, beta0, regularizer.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from flowrl_jax.objectives import forward
from flowrl_jax.objectives.batch import Minibatch, ParamTrees
from flowrl_jax.objectives.forward import weighted_mean

DEFAULTS = {"timesteps": 4, "times": "midpoints", "train_cfg": 0.0, "beta0": 1.0, "regularizer": "rollout_velocity"}
REGULARIZERS = ("samples", "rollout_velocity")


def check(options, sampler) -> None:
    forward.check_times(options, sampler, "advantage_flow")
    if options.regularizer not in REGULARIZERS:
        raise ValueError(f"unknown objective.advantage_flow.regularizer {options.regularizer!r}; choose one of {', '.join(REGULARIZERS)}")


def rollout_policy_decay(step, options=None):
    """The old policy is the rollout policy itself: `old <- params` after every iteration (d = 0)."""
    return jnp.zeros_like(step)


def pair_weights(adv, adv_floor, beta0: float):
    """[M] `beta + A_i` with `beta = max(-A) + beta0` (>= beta0 > 0)."""
    return adv_floor + beta0 + adv


def _sq(a, b):
    """[M] mean over elements of `(a - b)^2`."""
    return jnp.mean(jnp.square(a - b), axis=tuple(range(1, a.ndim)))


def _pair_terms(v, target, adv, adv_floor, beta0: float, v_old=None):
    """([M] squared flow-matching error `||v - u||^2`, [M] per-pair loss `beta ||v - anchor||^2 + A ||v - u||^2`),
    the anchor being the target `u` itself (docs/math.md's form: `(beta + A) ||v - u||^2`) or `v_old` when given."""
    sq = _sq(v, target)
    anchor = sq if v_old is None else _sq(v, jax.lax.stop_gradient(v_old))
    return sq, (adv_floor + beta0) * anchor + adv * sq


def weighted_flow_matching(v, target, adv, adv_floor, weight, beta0: float, v_old=None):
    """The loss as a function of the velocity `v [M, H, W, C]` (convex in `v`): docs/math.md's form, or the
    anchored one when the rollout policy's velocity `v_old [M, H, W, C]` is given."""
    return weighted_mean(_pair_terms(v, target, adv, adv_floor, beta0, v_old)[1], weight)


def loss(trees: ParamTrees, mb: Minibatch, fns, options):
    beta0, regularizer = float(options["beta0"]), options["regularizer"]
    chex.assert_equal_shape([mb["x_t"], mb["x0"], mb["eps"]])
    chex.assert_equal_shape([mb["t"], mb["adv"], mb["weight"]])
    v = fns.velocity(trees.policy, mb["x_t"], mb["t"], mb)
    v_old = fns.velocity(trees.old, mb["x_t"], mb["t"], mb) if regularizer == "rollout_velocity" else None
    sq, per_pair = _pair_terms(v, mb["eps"] - mb["x0"], mb["adv"], mb["adv_floor"], beta0, v_old)
    aux = {"flow_matching": weighted_mean(sq, mb["weight"]),
           "pair_weight_mean": weighted_mean(pair_weights(mb["adv"], mb["adv_floor"], beta0), mb["weight"]),
           "beta": mb["adv_floor"] + beta0}
    if v_old is not None:
        aux["drift_from_rollout_policy"] = weighted_mean(_sq(v, v_old), mb["weight"])
    return weighted_mean(per_pair, mb["weight"]), aux
