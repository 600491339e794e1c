"""LeapAlign: direct reward gradients through two leaps of an ODE trajectory (docs/math.md §6).

    mb = leap_pairs(ro, sigmas, cond, null, rows, weight, key, extras)     # one pair per sample
    mb = pairs(data, rows, slots, weight, key, options)                    # the objectives' shared signature
    loss, aux = leap.loss(trees, mb, fns, options)                         # trees: batch.ParamTrees with `reward`

The rollout is the ODE sampler (`sampler.kind="ode"`), run without gradient. Per sample, steps
`i_k < i_j` are drawn at random (`sigma_k > sigma_j > 0`). Leap 1: `x^_j = x_k - (sigma_k - sigma_j)
v_theta(x_k)`, connector `x~_j = x^_j + sg(x_j - x^_j)`; leap 2 `x^_0 = x~_j - sigma_j v_theta(u)`, where
only the model's input is `u = gamma x~_j + (1 - gamma) sg(x~_j)` (the value of `x~_j`, its gradient
scaled by `gamma`): the identity path keeps its full gradient and the nested term through the velocity's
input (the one DRTune removes) is scaled, not removed; connector `x~_0 = x^_0 + sg(x_0 - x^_0)`. The loss `-sum_b w_b R(x~_0[b])` has the real sample's reward
as its value and the two leaps' Jacobians as its gradient; `R` is the shipped learned reward
(differentiable in the pixels). `w = softmax_b(-mean_e(x^_j - x_j)^2 / tau)` over the minibatch: leaps
that land closer to the real path count more (our reading: the per-element mean, so that `tau` does
not scale with the image size; `w` is a weight, held constant). Two velocity calls with gradient per
sample whatever `T` is, so the update's memory does not grow with the number of sampler steps.
Options (`DEFAULTS`, `config.objective.leapalign`): train_cfg (the velocity's CFG, 0 = the sampler's), gamma, tau,
beta_kl: an anchor to the base model (ours, not the paper's; 0 = off), `beta_kl * mean_e(v_theta(x_k) - v_ref(x_k))^2`
on the first leap's velocity (one more forward, without gradient), as NFT's `beta_kl`; detach_uncond: no gradient
through CFG's unconditional branch (as Flow-GRPO's option; the backward covers the conditional batch only).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.objectives.batch import IterationData, Minibatch, ParamTrees
from flowrl_jax.objectives.forward import weighted_mean
from flowrl_jax.sampling import kernels

DEFAULTS = {"train_cfg": 0.0, "gamma": 0.5, "tau": 0.01, "beta_kl": 0.0, "detach_uncond": False}


def check(options, sampler) -> None:
    if sampler.kind != "ode":
        raise ValueError(f"sampler.kind={sampler.kind!r} cannot be trained on by objective 'leapalign' (it leaps along the "
                         "ODE trajectory); choose one of ode")
    if float(options["beta_kl"]) < 0:
        raise ValueError(f"objective.leapalign.beta_kl={options['beta_kl']}: the anchor's weight must be >= 0 (0 = off)")


def slots(options, levels) -> np.ndarray:
    """One pair per sample (its steps `k < j` are drawn inside the update)."""
    return np.zeros(1, np.int64)


def pairs(data: IterationData, rows, slots, weight, key, options) -> Minibatch:
    """`leap_pairs` on the iteration's data and the reward's tokens."""
    extras = {"reward_ids": data.reward_ids, "reward_mask": data.reward_mask}
    return leap_pairs(data.rollout, data.schedule.sigmas, data.cond, data.null, rows, weight, key, extras)


def leap_pairs(ro, sigmas, cond, null_cond, rows, weight, key, extras) -> Minibatch:
    """One pair per sample `rows[m]`: x_k, x_j, x0 [M, H, W, C], sigma_k, sigma_j [M], the condition and
    the objective's host-side extras (the learned reward's tokens), all of the rows."""
    num_steps = ro.states.shape[1]
    k_j, k_k = jax.random.split(key)
    i_j = jax.random.randint(k_j, rows.shape, 1, num_steps)
    i_k = jnp.floor(jax.random.uniform(k_k, rows.shape) * i_j).astype(jnp.int32)
    pick = lambda tree: jax.tree_util.tree_map(lambda a: a[rows], tree)  # noqa: E731
    return Minibatch(pairs={"x_k": ro.states[rows, i_k], "x_j": ro.states[rows, i_j], "x0": ro.final[rows],
                            "sigma_k": sigmas[i_k], "sigma_j": sigmas[i_j], "cond": pick(cond), "null": pick(null_cond),
                            "weight": weight, "step": i_j, **pick(extras)})


def two_leaps(velocity, x_k, x_j, x0, sigma_k, sigma_j, gamma: float):
    """-> (x~_0, x^_j, v(x_k)) [M, H, W, C] (module doc); `velocity(x, sigma [M]) -> v`."""
    sg = jax.lax.stop_gradient
    v_k = velocity(x_k, sigma_k)
    x_j_hat = x_k - kernels.column(sigma_k - sigma_j, x_k) * v_k
    x_j_tilde = x_j_hat + sg(x_j - x_j_hat)
    u = gamma * x_j_tilde + (1.0 - gamma) * sg(x_j_tilde)  # the model's input only
    x0_hat = x_j_tilde - kernels.column(sigma_j, u) * velocity(u, sigma_j)
    return x0_hat + sg(x0 - x0_hat), x_j_hat, v_k


def leap_weights(x_j_hat, x_j, weight, tau: float):
    """[M] `softmax(-mean_e(x^_j - x_j)^2 / tau)` over the real pairs (padding gets 0), held constant."""
    err = jnp.mean(jnp.square(jax.lax.stop_gradient(x_j_hat) - x_j), axis=tuple(range(1, x_j.ndim)))
    logits = jnp.where(weight > 0, -err / tau, -jnp.inf)
    return jax.nn.softmax(logits), err


def loss(trees: ParamTrees, mb: Minibatch, fns, options):
    gamma, tau, beta_kl = float(options["gamma"]), float(options["tau"]), float(options["beta_kl"])
    chex.assert_equal_shape([mb["x_k"], mb["x_j"], mb["x0"]])
    chex.assert_equal_shape([mb["sigma_k"], mb["sigma_j"], mb["weight"]])
    velocity = lambda x, sigma: fns.velocity(trees.policy, x, sigma, mb)  # noqa: E731
    x0_tilde, x_j_hat, v_k = two_leaps(velocity, mb["x_k"], mb["x_j"], mb["x0"], mb["sigma_k"], mb["sigma_j"], gamma)
    w, err = leap_weights(x_j_hat, mb["x_j"], mb["weight"], tau)
    reward = fns.reward(trees.reward, x0_tilde, mb)
    kl = jnp.zeros(())
    if beta_kl > 0:
        v_ref = jax.lax.stop_gradient(fns.velocity(trees.reference, mb["x_k"], mb["sigma_k"], mb))
        kl = weighted_mean(jnp.mean(jnp.square(v_k - v_ref), axis=tuple(range(1, v_k.ndim))), mb["weight"])
    return -jnp.sum(w * reward) + beta_kl * kl, {"learned_reward": weighted_mean(reward, mb["weight"]), "kl": kl,
                                                 "leap_error": weighted_mean(err, mb["weight"]), "leap_weight_max": jnp.max(w)}
