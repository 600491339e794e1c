"""AdvantageFlow: advantage-weighted flow matching with rollout-policy regularization (SPEC.md §6).

    loss, aux = advantage_flow.loss(variables, ref_variables, mb, fns, options)   # mb: forward.forward_pairs

`L = mean_i (beta + A_i) ||v_theta(x_t^i, t_i) - (eps_i - x0^i)||^2` over the policy's own samples,
`beta = max_i(-A_i) + beta0` (the max over the iteration's whole batch), so every weight is at least
`beta0 > 0` and the loss is a non-negative combination of convex quadratics in `v`. The `beta` part is
plain flow matching on the rollout policy's samples (it keeps the policy near them); the `A` part
tilts it toward the better samples: the minimizer fits `q(x0) ~ pi_old(x0) (1 + A(x0) / beta)`.
`||.||^2` is the mean over elements (our reading: it keeps `beta0` free of the image size). The
velocity is the sampler's (CFG `sampler.cfg`), the policy that drew the samples.
"""
from __future__ import annotations

import jax.numpy as jnp

from flowrl_jax.objectives.forward import weighted_mean

DEFAULTS = {"beta0": 1.0}


def pair_weights(adv, adv_floor, beta0: float):
    """[M] `beta + A_i` with `beta = max(-A) + beta0` (>= beta0 > 0)."""
    return adv_floor + beta0 + adv


def _pair_terms(v, target, adv, adv_floor, beta0: float):
    """([M] squared flow-matching error, [M] pair weights)."""
    return jnp.mean(jnp.square(v - target), axis=tuple(range(1, v.ndim))), pair_weights(adv, adv_floor, beta0)


def weighted_flow_matching(v, target, adv, adv_floor, weight, beta0: float):
    """The loss as a function of the velocity `v [M, H, W, C]` (convex in `v`)."""
    sq, w = _pair_terms(v, target, adv, adv_floor, beta0)
    return weighted_mean(w * sq, weight)


def loss(variables, ref_variables, mb: dict, fns, options):
    beta0 = float(options.get("beta0", DEFAULTS["beta0"]))
    v = fns.velocity(variables, mb["x_t"], mb["t"], mb)
    sq, w = _pair_terms(v, mb["eps"] - mb["x0"], mb["adv"], mb["adv_floor"], beta0)
    return weighted_mean(w * sq, mb["weight"]), {"flow_matching": weighted_mean(sq, mb["weight"]),
                                                 "pair_weight_mean": weighted_mean(w, mb["weight"]),
                                                 "beta": mb["adv_floor"] + beta0}
