"""DiffusionNFT: the forward-process objective with implicit positive and negative policies (docs/math.md §6).

    loss, aux = nft.loss(trees, mb, fns, options)   # mb: forward.forward_pairs; trees: batch.ParamTrees with `old`

Rollouts come from the *old* policy `theta_old` with a deterministic sampler (only `x0` is used);
`r = clip((A / adv_clip_max) / 2 + 0.5, 0, 1)` maps the group advantage to an optimality probability. At
`x_t = (1 - t) x0 + t eps`: `v+ = b v_theta + (1 - b) v_old`, `v- = (1 + b) v_old - b v_theta`,
`x0+- = x_t - t v+-`, adaptive weights `w+- = sg(mean |x0+- - x0|)` (at least 1e-5),
`L = adv_clip_max mean[(r ||x0+ - x0||^2 / w+ + (1 - r) ||x0- - x0||^2 / w-) / b] + beta_kl ||v_theta - v_ref||^2`,
norms as means over elements. After each iteration `theta_old <- d theta_old + (1 - d) theta` with NVlabs'
schedules (`old_policy_decay`) in optimizer steps done, as their `global_step` counts: "linear" `d = min(0.001 step,
0.5)` (their decay_type 1, the SD3 default), "flat_then_rise" `d = 0` for 75 steps, then `min(0.0075 (step - 75),
0.999)` (decay_type 2, their OCR config). `configs/nft.py` takes one optimizer step per iteration, as their SD3 configs.

Defaults follow NVlabs' `scripts/train_nft_sd3.py` + `config/nft.py` (WORKSPACE_NOTES.md has the table):
9 of the sampler's 10 timesteps per sample (`times="sampler"`), the loss scaled by `adv_clip_max = 5`,
`beta_kl = 1e-4` to the base model, and (in `configs/nft.py`) CFG-free rollouts and training (`sampler.cfg = 1`).
The velocities are the sampler's (CFG `sampler.cfg`) or, with `train_cfg > 0`, at that CFG scale.
Options (`DEFAULTS`, `config.objective.nft`): timesteps, times, train_cfg, beta (`b`), beta_kl, adv_clip_max, decay.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from flowrl_jax.objectives import forward
from flowrl_jax.objectives.batch import Minibatch, ParamTrees
from flowrl_jax.objectives.forward import weighted_mean
from flowrl_jax.sampling import kernels

DEFAULTS = {"timesteps": 9, "times": "sampler", "train_cfg": 0.0, "beta": 1.0, "beta_kl": 1e-4, "adv_clip_max": 5.0,
            "decay": "linear"}
DECAYS = {"linear": (0, 0.001, 0.5), "flat_then_rise": (75, 0.0075, 0.999)}  # (flat steps, rate, cap): NVlabs' decay_type 1, 2


def check(options, sampler) -> None:
    forward.check_times(options, sampler, "nft")
    if options["decay"] not in DECAYS:
        raise ValueError(f"objective.nft.decay={options['decay']!r}: choose one of {', '.join(DECAYS)}")
    if sampler.kind != "ode":
        raise ValueError(f"sampler.kind={sampler.kind!r} cannot be trained on by objective 'nft' (its rollouts store only x0); "
                         "choose one of ode")


def optimality(adv, adv_clip_max: float = 5.0):
    """[M] r = clip((A / adv_clip_max) / 2 + 0.5, 0, 1)."""
    return jnp.clip(adv / (2.0 * adv_clip_max) + 0.5, 0.0, 1.0)


def old_policy_decay(step, options=None):
    """d after `step` optimizer steps for the old-policy EMA, by `options.decay` (module doc; default "linear")."""
    flat, rate, cap = DECAYS[options["decay"] if options is not None else "linear"]
    return jnp.where(step < flat, 0.0, jnp.minimum((step - flat) * rate, cap))


def nft_terms(v, v_old, x_t, x0, t, r, b: float):
    """Per-pair NFT loss [M] (module doc) from the policy's and the old policy's velocities [M, H, W, C]."""
    v_old = jax.lax.stop_gradient(v_old)
    axes = tuple(range(1, x_t.ndim))
    t = kernels.column(t, x_t)
    x0_pos = x_t - t * (b * v + (1 - b) * v_old)
    x0_neg = x_t - t * ((1 + b) * v_old - b * v)
    w_pos = jax.lax.stop_gradient(jnp.maximum(jnp.mean(jnp.abs(x0_pos - x0), axes), 1e-5))
    w_neg = jax.lax.stop_gradient(jnp.maximum(jnp.mean(jnp.abs(x0_neg - x0), axes), 1e-5))
    pos = jnp.mean(jnp.square(x0_pos - x0), axes) / w_pos
    neg = jnp.mean(jnp.square(x0_neg - x0), axes) / w_neg
    return (r * pos + (1 - r) * neg) / b


def loss(trees: ParamTrees, mb: Minibatch, fns, options):
    b, beta_kl = float(options["beta"]), float(options["beta_kl"])
    chex.assert_equal_shape([mb["x_t"], mb["x0"]])
    chex.assert_equal_shape([mb["t"], mb["adv"], mb["weight"]])
    v = fns.velocity(trees.policy, mb["x_t"], mb["t"], mb)
    v_old = fns.velocity(trees.old, mb["x_t"], mb["t"], mb)
    scale = float(options["adv_clip_max"])
    r = optimality(mb["adv"], scale)
    policy_loss = scale * weighted_mean(nft_terms(v, v_old, mb["x_t"], mb["x0"], mb["t"], r, b), mb["weight"])
    kl = jnp.zeros(())
    if beta_kl > 0:
        v_ref = jax.lax.stop_gradient(fns.velocity(trees.reference, mb["x_t"], mb["t"], mb))
        kl = weighted_mean(jnp.mean(jnp.square(v - v_ref), axis=(1, 2, 3)), mb["weight"])
    return policy_loss + beta_kl * kl, {"policy_loss": policy_loss, "kl": kl, "optimality_mean": weighted_mean(r, mb["weight"])}
