"""The clipped GRPO objective on (sample, step) pairs with a KL to a frozen reference (SPEC.md §4).

    loss, aux = clipped_loss(params, ref_params, mb, mean_fn, options)

`mb` is a minibatch of M (sample, step) pairs gathered from a rollout (`gather_pairs`): states `x`,
next states `x_next [M, H, W, C]`, the step's `sigma`, `sigma_next`, noise level `level`, the step
index `step [M]`, the rollout policy's per-token log-probs `logp_old [M, N]`, the advantages
`adv [M, K]` (K = 1 or N), the condition, and a `weight [M]` (0 on padding). `mean_fn(params, mb) ->
(mean, std)` is the kernel mean of the policy with `params` at `mb.x` (the same kernel as the rollout).

- Ratio per sample (Flow-GRPO default): `rho = exp(mean_k l_theta - mean_k l_old)` with the token-mean
  advantage; per token (`ratio="token"`, what spatial credit needs): `rho[k] = exp(l_theta[k] - l_old[k])`.
- `L = -mean[min(rho A, clip(rho, 1 - eps, 1 + eps) A)] + beta KL`; the mean is over pairs (and tokens).
- `KL = mean_e (mu_theta - mu_ref)^2 / (2 std^2)`, the exact KL between the two Gaussian kernels;
  `kl_form="flow_grpo"` divides by the std without its `sqrt(-dt)` factor, as Flow-GRPO's code does.
- Reported: clipfrac, approx_kl (`0.5 mean (log rho)^2`), the KL, and the ratio's mean/std per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flowrl_jax.sampling import kernels

RATIOS = ("sample", "token")
KL_FORMS = ("exact", "flow_grpo")


def gather_pairs(ro, adv, cond, null_cond, rows, steps, weight) -> dict:
    """The minibatch of pairs `(rows[m], steps[m])` of rollout `ro`; `adv [B, T or 1, K]`, `cond` and
    `null_cond` batch-leading pytrees of the rollout's B samples."""
    take = lambda a: a[rows, steps]  # noqa: E731
    adv_t = adv[rows, jnp.minimum(steps, adv.shape[1] - 1)]
    pick = lambda tree: jax.tree_util.tree_map(lambda a: a[rows], tree)  # noqa: E731
    return {"x": take(ro.states), "x_next": take(ro.next_states), "mean_old": take(ro.means), "std": take(ro.stds),
            "logp_old": take(ro.logp), "sigma": ro.sigmas[steps], "sigma_next": ro.sigmas[steps + 1],
            "level": ro.noise_levels[steps], "sigma_1": ro.sigmas[1], "step": steps, "adv": adv_t,
            "cond": pick(cond), "null": pick(null_cond), "weight": weight}


def _per_step(values, weight, steps, num_steps):
    """Weighted mean and std of `values [M]` per step -> ([T], [T]) (NaN-free: empty steps give 0)."""
    w = jax.ops.segment_sum(weight, steps, num_steps)
    mean = jax.ops.segment_sum(weight * values, steps, num_steps) / jnp.maximum(w, 1e-8)
    var = jax.ops.segment_sum(weight * jnp.square(values - mean[steps]), steps, num_steps) / jnp.maximum(w, 1e-8)
    return mean, jnp.sqrt(var)


def clipped_loss(params, ref_params, mb: dict, mean_fn, options) -> tuple[jax.Array, dict]:
    """-> (loss, aux) for `options` with fields clip_range, beta, ratio, kl_form, patch_size,
    logprob_form, num_steps (module doc)."""
    if options.ratio not in RATIOS or options.kl_form not in KL_FORMS:
        raise ValueError(f"ratio={options.ratio!r} (one of {RATIOS}), kl_form={options.kl_form!r} (one of {KL_FORMS})")
    mean, std = mean_fn(params, mb)
    l_new = kernels.token_logprob(mb["x_next"], mean, std, options.patch_size, options.logprob_form)  # [M, N]
    w = mb["weight"]
    adv = mb["adv"]
    if options.ratio == "sample":
        log_ratio = (l_new.mean(-1) - mb["logp_old"].mean(-1))[:, None]  # [M, 1]
        adv = adv.mean(-1, keepdims=True)
    else:
        log_ratio = l_new - mb["logp_old"]  # [M, N]
        adv = jnp.broadcast_to(adv, log_ratio.shape)
    ratio = jnp.exp(log_ratio)
    eps = options.clip_range
    per_pair = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - eps, 1 + eps)).mean(-1)  # [M]
    total_w = jnp.maximum(w.sum(), 1.0)
    policy_loss = jnp.sum(w * per_pair) / total_w

    kl = jnp.zeros(())
    if options.beta > 0:
        ref_mean, _ = mean_fn(ref_params, mb)
        ref_mean = jax.lax.stop_gradient(ref_mean)
        kl_std = std if options.kl_form == "exact" else std / jnp.sqrt(mb["sigma"] - mb["sigma_next"])
        kl_std = kernels._col(jnp.where(std > 0, kl_std, 1.0), mean)
        kl_pair = jnp.mean(jnp.square(mean - ref_mean) / (2 * kl_std**2), axis=(1, 2, 3))
        kl = jnp.sum(w * kl_pair) / total_w
    loss = policy_loss + options.beta * kl

    clipped = (jnp.abs(ratio - 1) > eps).mean(-1)
    sample_ratio = jnp.exp(log_ratio.mean(-1))
    ratio_mean, ratio_std = _per_step(sample_ratio, w, mb["step"], options.num_steps)
    aux = {"policy_loss": policy_loss, "kl": kl, "clipfrac": jnp.sum(w * clipped) / total_w,
           "approx_kl": jnp.sum(w * 0.5 * jnp.square(log_ratio).mean(-1)) / total_w,
           "ratio_mean_per_step": ratio_mean, "ratio_std_per_step": ratio_std}
    return loss, aux
